"""The :mod:`kvjax.eval` tasks bound to a model of this package.

``kvjax.eval`` takes the model as callables; these helpers build them from
``(params, config)`` so the CLI and the experiment scripts run a task in one call.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from kvjax.allocation import Sensitivity, check_budget
from kvjax.cache import dense, key_calibration
from kvjax.calibration import Activations, fit_cache, save_fitted
from kvjax.centering import KeyCalibration
from kvjax.eval import calibrated
from kvjax.eval import needle as needle_task
from kvjax.eval import retrieval as retrieval_task
from kvjax.eval.calibrated import CalibrationSettings
from kvjax.eval.corpus import load_corpus, tokenize_prefix, windows
from kvjax.eval.ppl import PerplexityResult, continuation_perplexity, perplexity
from kvjax.eval.sweep import Evaluate, Settings, config_slug
from kvjax.eval.tradeoff import Measure
from kvjax.spec import CacheConfig, parse_cache, parse_codec
from models import chat_prompt_ids, llama
from models.config import ModelConfig
from models.generate import generate, prefill

#: new tokens generated per needle prompt: an 8-digit number is 8 tokens in SmolLM2's
#: and Llama-3's tokenizers, and a few more show whether the model stopped after it
NEEDLE_NEW_TOKENS = 12
#: windows of calibration text (each as long as the evaluation's) for ``calib`` clauses:
#: the corpus right after the evaluation windows, so no evaluated token is seen
CALIBRATION_WINDOWS = 4


def check_window_len(context: int, window_len: int) -> None:
    """Raise ``ValueError`` when perplexity windows of ``window_len`` tokens exceed a
    model's ``context`` (:func:`models.context_length`, known before loading)."""
    if window_len > context:
        raise ValueError(f"windows of {window_len} tokens exceed the model's context of "
                         f"{context} tokens")


def check_needle_lengths(context: int, lengths: Sequence[int]) -> None:
    """Raise ``ValueError`` when a needle prompt length plus the answer's
    ``NEEDLE_NEW_TOKENS`` exceeds a model's ``context``."""
    too_long = [n for n in lengths if n > context - NEEDLE_NEW_TOKENS]
    if too_long:
        raise ValueError(f"needle lengths {too_long} exceed the model's context "
                         f"({context} tokens, {NEEDLE_NEW_TOKENS} kept for the answer)")


def load_model_and_windows(model: str, corpus: str, num_windows: int, window_len: int):
    """``(config, params, tokenizer, text, windows)`` for a perplexity run.

    The model is loaded in float32; ``windows`` is ``int[num_windows, window_len]`` cut
    from the start of the tokenized corpus. Raises ``ValueError`` for a model without a
    tokenizer, windows longer than its context, or a corpus too short.
    """
    import models

    text = load_corpus(corpus)
    config, params, tokenizer = models.load(model, jnp.float32)
    if tokenizer is None:
        raise ValueError(f"model '{model}' has no tokenizer")
    check_window_len(config.max_position_embeddings, window_len)
    ids = tokenize_prefix(tokenizer, text, num_windows * window_len)
    return config, params, tokenizer, text, windows(ids, num_windows, window_len)


def _forward(params: llama.Params, config: ModelConfig, mesh: Mesh | None = None):
    """The jitted ``forward(tokens, cache, valid) -> (logits, cache)`` of the model that
    the perplexity loops call (over ``mesh``: on params placed there)."""
    if mesh is not None:
        params = llama.shard_params(params, config, mesh)
    return lambda tokens, cache, valid: llama.jit_forward(params, config, tokens, cache,
                                                           valid, mesh=mesh)


def cache_perplexity(
    params: llama.Params,
    config: ModelConfig,
    cache_config: CacheConfig,
    windows,
    *,
    chunk: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    cache_dtype: Any = jnp.bfloat16,
    progress: bool = False,
    calibration: KeyCalibration | None = None,
    reference: CacheConfig | None = None,
    mesh: Mesh | None = None,
) -> PerplexityResult:
    """:func:`kvjax.eval.perplexity` of the model with caches of ``cache_config``.

    Codec parameters are drawn from ``seed``; raw cache regions are stored in
    ``cache_dtype``. ``windows`` is ``int[num_windows, window_len]``. ``calibration``
    serves ``calib`` clauses (:func:`calibrate_keys`). ``reference``: a cache config
    (normally :meth:`~kvjax.spec.CacheConfig.reference`) that the windows also run
    through, for the reference perplexity and the distribution metrics against it.
    ``mesh``: the model tensor-parallel and the caches split over it
    (:func:`models.llama.hidden_states`); each batch of windows must split over its data
    axis.
    """
    check_window_len(config.max_position_embeddings, windows.shape[-1])
    if cache_config.evict is not None:
        raise ValueError(f"cache spec '{cache_config.spec}': an evict= clause acts on a "
                         "prompt, which a perplexity over whole windows has not; use "
                         "cache_continuation (kvjax ppl --context N)")

    def cache_of(cc: CacheConfig):
        def new_cache(batch, max_len):
            return llama.new_cache(config, cc, batch=batch, max_len=max_len,
                                   dtype=cache_dtype, key=jax.random.PRNGKey(seed),
                                   calibration=calibration, mesh=mesh)

        return new_cache

    return perplexity(_forward(params, config, mesh), cache_of(cache_config), windows,
                      chunk=chunk, batch_size=batch_size, progress=progress,
                      reference=None if reference is None else cache_of(reference))


def cache_continuation(
    params: llama.Params,
    config: ModelConfig,
    cache_config: CacheConfig,
    windows,
    *,
    context: int,
    chunk: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    cache_dtype: Any = jnp.bfloat16,
    progress: bool = False,
    calibration: KeyCalibration | None = None,
    reference: CacheConfig | None = None,
    mesh: Mesh | None = None,
) -> PerplexityResult:
    """:func:`kvjax.eval.ppl.continuation_perplexity` of the model: each window's first
    ``context`` tokens are prefilled (``chunk`` at a time) into a cache of
    ``cache_config`` (an ``evict=`` clause scores and drops tokens there), the rest is
    scored after them. ``reference``: the cache config of the distribution metrics.
    ``mesh``: as :func:`cache_perplexity`'s."""
    check_window_len(config.max_position_embeddings, windows.shape[-1])
    window_len = windows.shape[-1]
    if mesh is not None:  # placed once, not at every batch's prefill
        params = llama.shard_params(params, config, mesh)

    def prefill_of(cc: CacheConfig):
        def fill(prompts):
            pre = prefill(params, config, prompts.tolist(), cache_config=cc,
                          max_len=window_len, room=window_len - context,
                          cache_dtype=cache_dtype, chunk=chunk,
                          key=jax.random.PRNGKey(seed), calibration=calibration,
                          mesh=mesh)
            return pre.logits, pre.cache

        return fill

    return continuation_perplexity(
        prefill_of(cache_config), _forward(params, config, mesh), windows, context=context,
        batch_size=batch_size, progress=progress,
        reference=None if reference is None else prefill_of(reference))


def calibrate_keys(params: llama.Params, config: ModelConfig, windows) -> KeyCalibration:
    """The key statistics of the model on ``windows`` (``int[N, S]``, text kept apart
    from what is evaluated), for a cache spec's ``center=calib`` / ``smooth=calib``:
    the windows run through a float32 cache and every stored key counts."""
    windows = jnp.asarray(windows)
    cache = llama.new_cache(config, CacheConfig(k="f32", v="f32"), batch=windows.shape[0],
                            max_len=windows.shape[1], dtype=jnp.float32)
    _, cache = llama.jit_forward(params, config, windows, cache, None)
    return key_calibration(cache)


def _observed_forward(params, config, tokens, cache):
    moment = jnp.zeros((config.num_layers, config.num_kv_heads, config.head_dim,
                        config.head_dim), jnp.float32)
    _, cache, moment = llama.hidden_states(
        params, config, tokens, cache, observe=(llama.query_moment_observer(config), moment))
    return cache, moment


_observed_forward_jit = jax.jit(_observed_forward, static_argnums=1)


def collect_activations(params: llama.Params, config: ModelConfig, windows, *,
                        batch_size: int | None = None, progress: bool = False) -> Activations:
    """The :class:`kvjax.calibration.Activations` of the model on ``windows``
    (``int[N, S]``, text kept apart from what is evaluated): every window runs through a
    float32 cache (``batch_size`` windows at a time, default all), whose stored keys and
    values are taken whole, while the queries' second moments add up."""
    windows = jnp.asarray(windows)
    count, length = windows.shape
    batch_size = count if batch_size is None else min(batch_size, count)
    keys, values, moment = [], [], 0.0
    starts = range(0, count, batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="calibration text", unit="batch")
    for start in starts:
        batch = windows[start:start + batch_size]
        cache = llama.new_cache(config, CacheConfig(k="f32", v="f32"), batch=batch.shape[0],
                                max_len=length, dtype=jnp.float32)
        cache, part = _observed_forward_jit(params, config, batch, cache)
        moment = moment + part
        for role, out in (("k", keys), ("v", values)):
            layers = [dense(getattr(cache.layer(i), role), cache.lengths,
                            restore_keys=role == "k") for i in range(config.num_layers)]
            # [L, B, K, S, D] -> [L, K, B * S, D]: every row's tokens of a head pooled
            stacked = jnp.swapaxes(jnp.stack(layers), 1, 2)
            out.append(stacked.reshape(*stacked.shape[:2], -1, stacked.shape[-1]))
    return Activations(keys=jnp.concatenate(keys, axis=2),
                       values=jnp.concatenate(values, axis=2), query_moment=moment)


def layer_sensitivity(params: llama.Params, config: ModelConfig, windows,
                      candidates: Sequence[str], *, seed: int = 0, progress: bool = False,
                      budgets: Sequence[float] = ()) -> Sensitivity:
    """Measured per-(layer, K|V) sensitivity for :func:`kvjax.allocation.allocate`: the
    mean KL divergence from the bf16 cache's next tokens on ``windows`` when one unit
    stores with a candidate (K codec specs; V takes each one's value codec) and every
    other the candidate of most bits, less that cache's own. ``2 * layers *
    (candidates - 1)`` perplexity runs, each its own compiled program (the layer rules
    differ), dropped once run so that their memory does not add up. ``budgets``: the
    allocations the measurement is for, checked first
    (:func:`kvjax.allocation.check_budget`)."""
    codecs = [parse_codec(c) for c in candidates]
    bits = {"k": tuple(c.bits_per_element(config.head_dim) for c in codecs),
            "v": tuple(c.value_codec().bits_per_element(config.head_dim) for c in codecs)}
    for budget in budgets:
        check_budget(bits, budget)
    top = max(range(len(codecs)), key=lambda c: bits["k"][c] + bits["v"][c])
    base_clause = f"k={codecs[top].spec} v={codecs[top].value_codec().spec}"
    reference = CacheConfig(k="bf16")

    def kl(spec: str) -> float:
        return cache_perplexity(params, config, parse_cache(spec), windows, seed=seed,
                                reference=reference).kl_mean

    base = kl(base_clause)
    loss = np.zeros((config.num_layers, 2, len(codecs)))
    runs = [(layer, r, c) for layer in range(config.num_layers) for r in range(2)
            for c in range(len(codecs)) if c != top]
    if progress:
        from tqdm.auto import tqdm

        runs = tqdm(runs, desc="sensitivity", unit="run")
    for layer, r, c in runs:
        codec = codecs[c] if r == 0 else codecs[c].value_codec()
        loss[layer, r, c] = kl(f"{base_clause} layers[{layer}]:{'kv'[r]}={codec.spec}") - base
        jax.clear_caches()
    return Sensitivity(candidates=tuple(c.spec for c in codecs), bits=bits, loss=loss,
                       base=base)


def calibrated_measure(settings: CalibrationSettings, fits_dir: str | Path, *,
                       progress: bool = False, loaded: tuple | None = None) -> Measure:
    """``measure(name, cache_config) -> [row]`` of one direction of
    :mod:`kvjax.eval.calibrated`: perplexity and distribution metrics against bf16 on
    the evaluation windows; a configuration with a codec that needs fitting is first
    fitted (:func:`kvjax.calibration.fit_cache`) on the activations of the fit corpus
    (collected once, when first needed) and saved to ``fits_dir``, which its ``fit=``
    clause then names. ``loaded``: what :func:`load_model_and_windows` returned for the
    evaluation windows."""
    model_config, params, tokenizer, _, wins = loaded or load_model_and_windows(
        settings.model, settings.eval_corpus, settings.windows, settings.window_len)
    fits_dir = Path(fits_dir)
    collected: list[Activations] = []

    def activations() -> Activations:
        if not collected:
            text = load_corpus(settings.fit_corpus)
            ids = tokenize_prefix(tokenizer, text, settings.fit_windows * settings.fit_len)
            collected.append(collect_activations(
                params, model_config, windows(ids, settings.fit_windows, settings.fit_len),
                batch_size=4, progress=progress))
        return collected[0]

    def measure(name: str, cache_config: CacheConfig) -> list[dict]:
        fit_seconds, fit_bytes = 0.0, 0
        if cache_config.needs_fit:
            start = time.perf_counter()
            fit = fit_cache(cache_config, activations(), key=jax.random.PRNGKey(settings.seed),
                            progress=progress,
                            metadata={"model": settings.model, "corpus": settings.fit_corpus,
                                      "seed": settings.seed})
            where = fits_dir / config_slug(cache_config.spec)
            fit_bytes = save_fitted(where, fit, overwrite=True)
            fit_seconds = time.perf_counter() - start
            cache_config = dataclasses.replace(cache_config, fit=str(where))
        result = cache_perplexity(params, model_config, cache_config, wins,
                                  seed=settings.seed, reference=CacheConfig(k="bf16"),
                                  progress=progress)
        return [{"fit_corpus": settings.fit_corpus, "eval_corpus": settings.eval_corpus,
                 "family": calibrated.family(name), "config": name,
                 "fitted": cache_config.needs_fit,
                 "bits_per_element": result.bits_per_element, "ppl": result.ppl,
                 "reference_ppl": result.reference_ppl, "kl_mean": result.kl_mean,
                 "kl_p99": result.kl_p99, "top1_agreement": result.top1_agreement,
                 "fit_seconds": fit_seconds, "fit_bytes": fit_bytes}]

    return measure


def heldout_calibration(params: llama.Params, config: ModelConfig, tokenizer, text: str,
                        evaluated_windows: int, window_len: int) -> KeyCalibration:
    """:func:`calibrate_keys` on the :data:`CALIBRATION_WINDOWS` windows of ``text`` that
    follow ``evaluated_windows`` windows of ``window_len`` tokens (the ones evaluated,
    cut from the start as :func:`load_model_and_windows` cuts them)."""
    start = evaluated_windows * window_len
    ids = tokenize_prefix(tokenizer, text, start + CALIBRATION_WINDOWS * window_len)
    return calibrate_keys(params, config, windows(ids, CALIBRATION_WINDOWS, window_len, start))


def _prompt_parts(tokenizer, haystack_text: str, lengths: Sequence[int], trials: int,
                  what: str):
    """``(encode_prompt, haystack ids)`` of a prompt task (needle, retrieval suite): the
    model's chat turn with the reply begun, and enough tokenized haystack for every
    trial. Raises ``ValueError`` for a model without a tokenizer."""
    if tokenizer is None:
        raise ValueError(f"the {what} needs the model's tokenizer")

    def encode_prompt(text: str, prefix: str) -> list[int]:
        return chat_prompt_ids(tokenizer, text, prefix)

    # a margin of 64 tokens per trial: re-tokenizing decoded text may need a few more
    return encode_prompt, tokenize_prefix(tokenizer, haystack_text,
                                          trials * (max(lengths) + 64))


def needle_cases(
    config: ModelConfig,
    tokenizer,
    haystack_text: str,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int = 1,
    seed: int = 0,
) -> list[needle_task.NeedleCase]:
    """Needle prompts in the model's chat template, haystack from ``haystack_text``.

    Raises ``ValueError`` when a length plus the answer's tokens exceeds the model's
    context, or the model has no tokenizer or chat template.
    """
    check_needle_lengths(config.max_position_embeddings, lengths)
    encode_prompt, hay = _prompt_parts(tokenizer, haystack_text, lengths, trials,
                                       "needle task")
    return needle_task.make_cases(tokenizer, encode_prompt, hay, lengths=lengths,
                                  depths=depths, trials=trials, seed=seed)


def needle_retrieval(
    params: llama.Params,
    config: ModelConfig,
    tokenizer,
    cache_config: CacheConfig,
    cases: Sequence[needle_task.NeedleCase],
    *,
    seed: int = 0,
    batch_size: int | None = None,
    progress: bool = False,
    calibration: KeyCalibration | None = None,
) -> list[dict]:
    """Greedy answers of the model, with caches of ``cache_config``, to needle ``cases``
    (:func:`needle_cases`), scored by exact match (:func:`kvjax.eval.needle.run_needle`);
    ``calibration`` serves ``calib`` clauses."""

    def run(prompts: list[list[int]]) -> list[list[int]]:
        return generate(params, config, prompts, cache_config=cache_config,
                        max_new_tokens=NEEDLE_NEW_TOKENS, seed=seed,
                        calibration=calibration).tokens

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return needle_task.run_needle(cases, run, decode, batch_size=batch_size,
                                  progress=progress)


#: prefill chunk of the retrieval suite's prompts: a batch of six 8k-token prompts
#: prefilled whole needs 30 GB of attention scores in float32
RETRIEVAL_PREFILL_CHUNK = 1024


def retrieval_cases(
    config: ModelConfig,
    tokenizer,
    haystack_text: str,
    *,
    tasks: Sequence[str] = retrieval_task.TASKS,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int = 1,
    seed: int = 0,
) -> list[retrieval_task.RetrievalCase]:
    """Retrieval-suite prompts (:mod:`kvjax.eval.retrieval`) in the model's chat
    template, haystack from ``haystack_text``. Raises ``ValueError`` when a length
    exceeds the model's context, or the model has no tokenizer or chat template."""
    too_long = [n for n in lengths if n > config.max_position_embeddings]
    if too_long:
        raise ValueError(f"retrieval lengths {too_long} exceed the model's context "
                         f"({config.max_position_embeddings} tokens)")
    encode_prompt, hay = _prompt_parts(tokenizer, haystack_text, lengths, trials,
                                       "retrieval suite")
    return retrieval_task.make_cases(tokenizer, encode_prompt, hay, tasks=tasks,
                                     lengths=lengths, depths=depths, trials=trials,
                                     seed=seed)


def retrieval_answers(
    params: llama.Params,
    config: ModelConfig,
    tokenizer,
    cache_config: CacheConfig,
    cases: Sequence[retrieval_task.RetrievalCase],
    *,
    seed: int = 0,
    batch_size: int | None = None,
    progress: bool = False,
    calibration: KeyCalibration | None = None,
    prefill_chunk: int | None = RETRIEVAL_PREFILL_CHUNK,
) -> list[dict]:
    """Greedy answers of the model, with caches of ``cache_config``, to retrieval
    ``cases`` (:func:`retrieval_cases`), scored by exact match
    (:func:`kvjax.eval.retrieval.run_retrieval`). Prompts are prefilled
    ``prefill_chunk`` tokens at a time (None: whole), which keeps the attention scores
    of a batch of 8k-token prompts to a few GB."""

    def run(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        return generate(params, config, prompts, cache_config=cache_config,
                        max_new_tokens=new_tokens, seed=seed, calibration=calibration,
                        prefill_chunk=prefill_chunk).tokens

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return retrieval_task.run_retrieval(cases, run, decode, batch_size=batch_size,
                                        progress=progress)


def suite_answer(params: llama.Params, config: ModelConfig, tokenizer,
                 settings: retrieval_task.SuiteSettings, *, batch_size: int | None = None,
                 progress: bool = False):
    """The ``answer(name, cache_config) -> rows`` that
    :func:`kvjax.eval.retrieval.run_suite` takes, for the suite ``settings`` describe:
    its cases are built once, from the settings' corpus."""
    cases = retrieval_cases(config, tokenizer, load_corpus(settings.corpus),
                            tasks=settings.tasks, lengths=settings.lengths,
                            depths=settings.depths, trials=settings.trials,
                            seed=settings.seed)

    def answer(name: str, cache_config: CacheConfig) -> list[dict]:
        return retrieval_answers(params, config, tokenizer, cache_config, cases,
                                 seed=settings.seed, batch_size=batch_size,
                                 progress=progress)

    return answer


def sweep_evaluator(settings: Settings, *, needle_batch: int | None = None,
                    progress: bool = False, loaded: tuple | None = None) -> Evaluate:
    """The evaluator of :func:`kvjax.eval.sweep.run_sweep` for ``settings``: loads the
    model and corpus once and returns the function that measures one configuration
    (perplexity over the windows and, with ``settings.distribution`` and but for the
    bf16 cache itself, the distribution metrics against it,
    :meth:`~kvjax.spec.CacheConfig.reference`; needle retrieval, ``needle_batch``
    prompts per generate call, when asked). ``loaded``: what
    :func:`load_model_and_windows` returned for these settings, to evaluate without
    loading again. A configuration with
    ``calib`` clauses gets the key statistics of :data:`CALIBRATION_WINDOWS` windows
    that follow the evaluated ones (computed once)."""
    config, params, tokenizer, text, wins = loaded or load_model_and_windows(
        settings.model, settings.corpus, settings.windows, settings.window_len)
    calibrations: dict[str, KeyCalibration] = {}

    def calibration_for(cache_config: CacheConfig) -> KeyCalibration | None:
        if not cache_config.calibrated:
            return None
        if "keys" not in calibrations:
            calibrations["keys"] = heldout_calibration(
                params, config, tokenizer, text, settings.windows, settings.window_len)
        return calibrations["keys"]

    cases = None
    if settings.needle_trials:
        cases = needle_cases(config, tokenizer, text, lengths=settings.needle_lengths,
                             depths=settings.needle_depths, trials=settings.needle_trials,
                             seed=settings.seed)

    def evaluate(name: str, cache_config: CacheConfig, with_needle: bool) -> dict:
        calibration = calibration_for(cache_config)
        reference = cache_config.reference()
        compare = settings.distribution and cache_config != reference
        result = cache_perplexity(params, config, cache_config, wins, chunk=settings.chunk,
                                  seed=settings.seed, progress=progress,
                                  calibration=calibration,
                                  reference=reference if compare else None)
        row = dataclasses.asdict(result)
        if with_needle:
            answers = needle_retrieval(params, config, tokenizer, cache_config, cases,
                                       seed=settings.seed, batch_size=needle_batch,
                                       calibration=calibration)
            row["needle_rows"] = answers
            row["needle_accuracy"] = sum(a["correct"] for a in answers) / len(answers)
        return row

    return evaluate


def sweep_builder(*, needle_batch: int | None = None,
                  progress: bool = False) -> Callable[[Settings], Evaluate]:
    """``build(settings) -> Evaluate`` (:func:`sweep_evaluator`) that loads each model,
    corpus and windows once and keeps them: the evaluators of settings that differ only
    in the seed or the cache clauses share one loaded model
    (:func:`kvjax.eval.sweep.run_seeds`, :func:`kvjax.eval.sweep.lazy_evaluator`).
    Called under ``jax.default_device`` (a sweep over several devices, from a thread per
    device), the evaluator gets a copy of the weights on that device, made once."""
    loaded: dict[tuple, tuple] = {}
    lock = threading.Lock()

    def build(settings: Settings) -> Evaluate:
        key = (settings.model, settings.corpus, settings.windows, settings.window_len)
        device = jax.config.jax_default_device
        with lock:  # threads of a sweep over devices load a model once between them
            if key not in loaded:
                loaded[key] = load_model_and_windows(*key)
            if (key, device) not in loaded:
                config, params, *rest = loaded[key]
                placed = params if device is None else jax.device_put(params, device)
                loaded[key, device] = (config, placed, *rest)
        return sweep_evaluator(settings, needle_batch=needle_batch, progress=progress,
                               loaded=loaded[key, device])

    return build


__all__ = [
    "CALIBRATION_WINDOWS",
    "NEEDLE_NEW_TOKENS",
    "RETRIEVAL_PREFILL_CHUNK",
    "cache_perplexity",
    "calibrate_keys",
    "calibrated_measure",
    "check_needle_lengths",
    "check_window_len",
    "collect_activations",
    "heldout_calibration",
    "layer_sensitivity",
    "load_model_and_windows",
    "needle_cases",
    "needle_retrieval",
    "retrieval_answers",
    "retrieval_cases",
    "sweep_builder",
    "sweep_evaluator",
]
