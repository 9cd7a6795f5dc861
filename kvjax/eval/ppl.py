"""Evaluation of a model whose KV cache is compressed: perplexity over fixed windows,
and with a reference cache the distribution metrics (:mod:`kvjax.eval.distribution`).

The model is an argument, never an import (DESIGN.md §2): callers pass a ``forward``
callable and a ``new_cache`` callable, typically closures over a model's params/config and
a :class:`kvjax.cache.CacheConfig`. Each window is fed through the same cache path that
decoding uses, in prefill chunks, so streaming codecs (KIVI groups, residual windows,
sinks) see their tokens arrive exactly as they would during generation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import check, fallback_blocks, outlier_overflow, stored_bits
from kvjax.eval.distribution import PositionBucket, summarize, token_divergence

Forward = Callable[[jax.Array, Any, Any], tuple[jax.Array, Any]]
NewCache = Callable[[int, int], Any]


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """Perplexity of a model (with its cache) over a set of windows.

    Attributes:
        ppl: ``exp(nll)``.
        nll: mean negative log-likelihood (nats) over the scored tokens.
        tokens: how many tokens were scored (``window_len - 1`` per window).
        bits_per_element: bits the final caches spend per stored K/V element, measured
            from their arrays (residual window, sinks and layer policy included).
        k_bits_per_element, v_bits_per_element: the same for K and V alone.
        seconds: wall time of the whole evaluation (compiles included).
        fallback_blocks: cache blocks that a variable-length codec stored below its
            nominal precision because they did not fit its budget
            (:func:`kvjax.cache.fallback_blocks`; 0 for fixed-rate codecs).
        outlier_chunks, outlier_overflow, medc_chunks: Med-C chunks of the final caches
            (:func:`kvjax.cache.outlier_overflow`): stored exactly as outliers, over the
            threshold but beyond a block's slots (left to the base codec), and every
            chunk the Med-C codecs compressed; 0 without Med-C.
        outlier_overflow_share: ``outlier_overflow / (outlier_chunks +
            outlier_overflow)``, the share of the chunks over the threshold that did not
            fit (0 when none was over it); None where no Med-C codec compressed a chunk.
        reference_ppl: perplexity of the same windows through the reference cache;
            None without one.
        kl_mean, kl_p99, top1_agreement: next-token distribution against the reference
            cache's (:class:`kvjax.eval.distribution.DistributionMetrics`): mean and 99th
            percentile of ``KL(P_ref || P)`` in nats, share of tokens with the same most
            likely next token; None without a reference.
        kl_by_position: the same per position bucket of the window
            (:class:`kvjax.eval.distribution.PositionBucket`); empty without a reference.
    """

    ppl: float
    nll: float
    tokens: int
    bits_per_element: float
    k_bits_per_element: float
    v_bits_per_element: float
    seconds: float
    fallback_blocks: int = 0
    outlier_chunks: int = 0
    outlier_overflow: int = 0
    medc_chunks: int = 0
    outlier_overflow_share: float | None = None
    reference_ppl: float | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    top1_agreement: float | None = None
    kl_by_position: tuple[PositionBucket, ...] = ()


@jax.jit
def _chunk_nll(logits, targets, scored):
    """Per-token NLL ``[B, T]`` (float32, 0 where not ``scored``) of one chunk's logits."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.where(scored, -picked, 0.0)


def perplexity(
    forward: Forward,
    new_cache: NewCache,
    windows,
    *,
    chunk: int | None = None,
    batch_size: int | None = None,
    progress: bool = False,
    reference: NewCache | None = None,
) -> PerplexityResult:
    """Perplexity of ``windows`` (``int[num_windows, window_len]``) through the cache.

    ``forward(tokens[B, T] int32, cache, valid[B] | None) -> (logits[B, T, V], cache)``
    and ``new_cache(batch, max_len) -> cache``. Each batch of ``batch_size`` windows
    (default: all of them) gets a fresh cache of ``window_len`` slots and is fed in
    chunks of ``chunk`` tokens (default: the whole window); the logits at position ``t``
    are scored against token ``t + 1``, so a window of ``L`` tokens scores ``L - 1``.
    NLL is summed in float64 on host. ``reference``: a second ``new_cache`` (normally a
    bf16 cache) that every chunk also runs through, for the reference perplexity and
    the distribution metrics of the cache against it
    (:mod:`kvjax.eval.distribution`; twice the model's work).

    ``forward`` should be a jitted function that takes the model weights as *arguments*
    (e.g. a closure calling ``models.llama.jit_forward(params, config, ...)``); it then
    compiles once per chunk shape. It is deliberately not wrapped in
    another ``jax.jit`` here: jitting a closure over the weights bakes them into the
    program as constants, which made compiles ~8x slower for a 135M model on CPU.

    Raises ``ValueError`` on an empty or malformed ``windows``, windows shorter than two
    tokens, ``chunk < 1`` or ``batch_size < 1``, and (via :func:`kvjax.cache.check`) when a
    cache overflowed, was given bad valid counts, received NaN/Inf or saturated values
    beyond its storage's range.
    """
    wins = np.asarray(windows)
    if wins.ndim != 2 or wins.shape[0] == 0:
        raise ValueError(f"windows must be a non-empty [num_windows, window_len] array, "
                         f"got shape {wins.shape}")
    if not np.issubdtype(wins.dtype, np.integer):
        raise ValueError(f"windows must hold integer token ids, got {wins.dtype}")
    num_windows, window_len = wins.shape
    if window_len < 2:
        raise ValueError(f"windows need at least 2 tokens to score one, got {window_len}")
    chunk = window_len if chunk is None else chunk
    batch_size = num_windows if batch_size is None else batch_size
    for name, value in (("chunk", chunk), ("batch_size", batch_size)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    chunk = min(int(chunk), window_len)
    batch_size = min(int(batch_size), num_windows)
    wins = wins.astype(np.int32)

    starts = list(range(0, window_len, chunk))
    batches = list(range(0, num_windows, batch_size))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(starts) * len(batches), desc="ppl", unit="chunk")

    t0 = time.perf_counter()
    nll_sum, scored_count = 0.0, 0
    bits = {"k": 0.0, "v": 0.0}
    elements = 0
    fallbacks = 0
    outliers = {"outliers": 0, "overflow": 0, "chunks": 0}
    ref_nll_sum = 0.0
    if reference is not None:  # per-token divergence, filled chunk by chunk
        kl = np.zeros(wins.shape, np.float32)
        agree = np.zeros(wins.shape, bool)
    for b0 in batches:
        rows = wins[b0 : b0 + batch_size]
        cache = new_cache(rows.shape[0], window_len)
        ref_cache = None if reference is None else reference(rows.shape[0], window_len)
        # a target for every position: the next token, or a dummy 0 after the last one
        targets = np.concatenate([rows[:, 1:], np.zeros_like(rows[:, :1])], axis=1)
        for s in starts:
            e = min(s + chunk, window_len)
            scored = np.broadcast_to(np.arange(s, e) < window_len - 1, (rows.shape[0], e - s))
            logits, cache = forward(jnp.asarray(rows[:, s:e]), cache, None)
            nll = _chunk_nll(logits, targets[:, s:e], scored)
            nll_sum += float(np.asarray(nll, np.float64).sum())
            scored_count += int(scored.sum())
            if ref_cache is not None:
                ref_logits, ref_cache = forward(jnp.asarray(rows[:, s:e]), ref_cache, None)
                ref_nll = _chunk_nll(ref_logits, targets[:, s:e], scored)
                ref_nll_sum += float(np.asarray(ref_nll, np.float64).sum())
                chunk_kl, chunk_agree = token_divergence(ref_logits, logits)
                kl[b0:b0 + rows.shape[0], s:e] = np.asarray(chunk_kl)
                agree[b0:b0 + rows.shape[0], s:e] = np.asarray(chunk_agree)
            if bar is not None:
                bar.update(1)
        check(cache)
        fallbacks += fallback_blocks(cache)
        counted = outlier_overflow(cache)
        for key in outliers:
            outliers[key] += counted[key]
        measured = stored_bits(cache)
        bits["k"] += measured["k_bits"]
        bits["v"] += measured["v_bits"]
        elements += measured["elements"]
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0

    nll_mean = nll_sum / scored_count
    half_total = elements / 2
    over = outliers["outliers"] + outliers["overflow"]
    share = None
    if outliers["chunks"]:
        share = outliers["overflow"] / over if over else 0.0
    distribution = {}
    if reference is not None:
        scored = np.broadcast_to(np.arange(window_len) < window_len - 1, wins.shape)
        metrics = summarize(kl, agree, scored)
        distribution = {"reference_ppl": math.exp(ref_nll_sum / scored_count),
                        "kl_mean": metrics.kl_mean, "kl_p99": metrics.kl_p99,
                        "top1_agreement": metrics.top1_agreement,
                        "kl_by_position": metrics.by_position}
    return PerplexityResult(
        ppl=math.exp(nll_mean),
        nll=nll_mean,
        tokens=scored_count,
        bits_per_element=(bits["k"] + bits["v"]) / elements,
        k_bits_per_element=bits["k"] / half_total,
        v_bits_per_element=bits["v"] / half_total,
        seconds=seconds,
        fallback_blocks=fallbacks,
        outlier_chunks=outliers["outliers"],
        outlier_overflow=outliers["overflow"],
        medc_chunks=outliers["chunks"],
        outlier_overflow_share=share,
        **distribution,
    )


__all__ = ["PerplexityResult", "perplexity"]
