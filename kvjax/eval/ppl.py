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
        sequence_bits_per_element: the final caches' bits over the elements of every
            token of the windows, tokens that eviction dropped included
            (:func:`kvjax.cache.stored_bits`): ``bits_per_element`` without eviction.
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
    sequence_bits_per_element: float | None = None


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
    tally = _Tally()
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
            tally.nll += _nll_sum(logits, targets[:, s:e], scored)
            tally.scored += int(scored.sum())
            if ref_cache is not None:
                ref_logits, ref_cache = forward(jnp.asarray(rows[:, s:e]), ref_cache, None)
                tally.ref_nll += _nll_sum(ref_logits, targets[:, s:e], scored)
                chunk_kl, chunk_agree = token_divergence(ref_logits, logits)
                kl[b0:b0 + rows.shape[0], s:e] = np.asarray(chunk_kl)
                agree[b0:b0 + rows.shape[0], s:e] = np.asarray(chunk_agree)
            if bar is not None:
                bar.update(1)
        tally.add_cache(cache)
    if bar is not None:
        bar.close()
    divergence = None
    if reference is not None:
        divergence = (kl, agree, np.broadcast_to(np.arange(window_len) < window_len - 1,
                                                 wins.shape))
    return tally.result(time.perf_counter() - t0, divergence)


def _nll_sum(logits, targets, scored) -> float:
    return float(np.asarray(_chunk_nll(logits, targets, scored), np.float64).sum())


class _Tally:
    """What an evaluation adds up over its batches: NLL sums (host float64) and the
    accounting of each batch's final cache (checked here)."""

    def __init__(self):
        self.nll = self.ref_nll = 0.0
        self.scored = 0
        self.bits = {"k": 0.0, "v": 0.0}
        self.elements = self.sequence_elements = 0
        self.fallbacks = 0
        self.outliers = {"outliers": 0, "overflow": 0, "chunks": 0}

    def add_cache(self, cache) -> None:
        check(cache)
        self.fallbacks += fallback_blocks(cache)
        counted = outlier_overflow(cache)
        for key in self.outliers:
            self.outliers[key] += counted[key]
        measured = stored_bits(cache)
        self.bits["k"] += measured["k_bits"]
        self.bits["v"] += measured["v_bits"]
        self.elements += measured["elements"]
        self.sequence_elements += measured["sequence_elements"]

    def result(self, seconds: float, divergence=None) -> PerplexityResult:
        """The result; ``divergence``: ``(kl, agree, scored)`` ``[N, L]`` arrays against
        the reference, whose NLL is then ``ref_nll``."""
        nll_mean = self.nll / self.scored
        half_total = self.elements / 2
        over = self.outliers["outliers"] + self.outliers["overflow"]
        share = None
        if self.outliers["chunks"]:
            share = self.outliers["overflow"] / over if over else 0.0
        distribution = {}
        if divergence is not None:
            metrics = summarize(*divergence)
            distribution = {"reference_ppl": math.exp(self.ref_nll / self.scored),
                            "kl_mean": metrics.kl_mean, "kl_p99": metrics.kl_p99,
                            "top1_agreement": metrics.top1_agreement,
                            "kl_by_position": metrics.by_position}
        bits = self.bits["k"] + self.bits["v"]
        return PerplexityResult(
            ppl=math.exp(nll_mean),
            nll=nll_mean,
            tokens=self.scored,
            bits_per_element=bits / self.elements,
            k_bits_per_element=self.bits["k"] / half_total,
            v_bits_per_element=self.bits["v"] / half_total,
            seconds=seconds,
            fallback_blocks=self.fallbacks,
            outlier_chunks=self.outliers["outliers"],
            outlier_overflow=self.outliers["overflow"],
            medc_chunks=self.outliers["chunks"],
            outlier_overflow_share=share,
            sequence_bits_per_element=bits / self.sequence_elements,
            **distribution,
        )


Prefill = Callable[[np.ndarray], tuple[jax.Array, Any]]


def continuation_perplexity(
    prefill: Prefill,
    forward: Forward,
    windows,
    *,
    context: int,
    batch_size: int | None = None,
    progress: bool = False,
    reference: Prefill | None = None,
) -> PerplexityResult:
    """Perplexity of each window's tokens after its first ``context``, which are
    prefilled once as a prompt: the protocol of prompt compression, where a cache is
    built from the whole prompt (eviction scores it first, :mod:`kvjax.eviction`) and
    what follows attends to it.

    ``prefill(prompts int32[B, context]) -> (next-token logits [B, V], cache)`` with
    room for the rest of the window; ``forward`` as in :func:`perplexity` feeds the
    continuation in one chunk. The ``window_len - context`` continuation tokens are
    scored: the first by the prefill's logits, each other by the one before it.
    ``reference``: a second ``prefill`` (normally an uncompressed cache) for the
    distribution metrics, by position over the continuation. The result's
    ``sequence_bits_per_element`` counts the bits of the final caches over every token
    of the windows, evicted ones included.
    """
    wins = np.asarray(windows)
    if wins.ndim != 2 or wins.shape[0] == 0 or not np.issubdtype(wins.dtype, np.integer):
        raise ValueError(f"windows must be a non-empty integer [num_windows, window_len] "
                         f"array, got {wins.dtype} {wins.shape}")
    num_windows, window_len = wins.shape
    if not isinstance(context, int | np.integer) or not 1 <= context < window_len:
        raise ValueError(f"context must be in 1 .. window_len - 1 = {window_len - 1}, "
                         f"got {context!r}")
    batch_size = num_windows if batch_size is None else batch_size
    if not isinstance(batch_size, int | np.integer) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    wins = wins.astype(np.int32)
    follow = window_len - context
    batches = range(0, num_windows, int(batch_size))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(batches), desc="continuation", unit="batch")
    t0 = time.perf_counter()
    tally = _Tally()
    kl = np.zeros((num_windows, follow), np.float32)
    agree = np.zeros((num_windows, follow), bool)

    def run(fill, rows):
        first, cache = fill(rows[:, :context])
        logits = first[:, None]
        if follow > 1:
            rest, cache = forward(jnp.asarray(rows[:, context:-1]), cache, None)
            logits = jnp.concatenate([logits, rest.astype(logits.dtype)], axis=1)
        return logits, cache

    for b0 in batches:
        rows = wins[b0 : b0 + batch_size]
        targets = rows[:, context:]
        scored = np.ones(targets.shape, bool)
        logits, cache = run(prefill, rows)
        tally.nll += _nll_sum(logits, targets, scored)
        tally.scored += int(scored.sum())
        tally.add_cache(cache)
        if reference is not None:
            ref_logits, _ = run(reference, rows)
            tally.ref_nll += _nll_sum(ref_logits, targets, scored)
            batch_kl, batch_agree = token_divergence(ref_logits, logits)
            kl[b0:b0 + rows.shape[0]] = np.asarray(batch_kl)
            agree[b0:b0 + rows.shape[0]] = np.asarray(batch_agree)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    divergence = None if reference is None else (kl, agree, np.ones(kl.shape, bool))
    return tally.result(time.perf_counter() - t0, divergence)


__all__ = ["PerplexityResult", "continuation_perplexity", "perplexity"]
