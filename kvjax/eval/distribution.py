"""How far a compressed cache moves the model's next-token distribution from a reference
cache's (normally bf16) on the same tokens: KL divergence and top-1 agreement, overall
and by position in the context.

Perplexity averages log-likelihoods of the corpus' own next tokens, so a cache that
shifts probability between wrong tokens, or errs only late in long windows, can leave it
nearly unchanged. The distribution metrics compare the two models directly, token by
token: ``KL(P_ref || P)`` in nats over the whole vocabulary (float32 log-softmax of each
model's logits), and whether both pick the same most likely token. They are summarized
as the mean, the 99th percentile (the tail where outputs break) and per position bucket
(:func:`position_edges`: the first eighth of the window, to the quarter, to the half, to
the end), so that error growing with distance into the context shows.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

#: the percentile of per-token KL reported beside the mean
TAIL_PERCENTILE = 99.0


@jax.jit
def token_divergence(reference_logits: jax.Array, logits: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """Per token of ``[B, T, V]`` logits: ``KL(softmax(reference) || softmax(logits))``
    in nats (float32, >= 0 up to rounding) and whether the two argmaxes agree."""
    ref = jax.nn.log_softmax(reference_logits.astype(jnp.float32), axis=-1)
    got = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(ref) * (ref - got), axis=-1)
    agree = jnp.argmax(reference_logits, axis=-1) == jnp.argmax(logits, axis=-1)
    return jnp.maximum(kl, 0.0), agree


def position_edges(length: int) -> tuple[int, ...]:
    """Bucket edges over positions ``0 .. length - 1``: 0, then an eighth, a quarter and
    a half of ``length``, then ``length`` (fewer where those coincide)."""
    if length < 1:
        raise ValueError(f"length must be positive, got {length}")
    edges = sorted({0, length // 8, length // 4, length // 2, length})
    return tuple(edges)


@dataclasses.dataclass(frozen=True)
class PositionBucket:
    """The metrics over the scored tokens at positions ``start .. end - 1``."""

    start: int
    end: int
    tokens: int
    kl_mean: float | None
    kl_p99: float | None
    top1_agreement: float | None


@dataclasses.dataclass(frozen=True)
class DistributionMetrics:
    """Next-token distribution of a cache against a reference cache.

    Attributes:
        kl_mean: mean ``KL(P_ref || P)`` (nats) over the scored tokens.
        kl_p99: its 99th percentile.
        top1_agreement: share of tokens whose most likely next token is the reference's.
        tokens: tokens compared.
        by_position: the same per :func:`position_edges` bucket of the window.
    """

    kl_mean: float
    kl_p99: float
    top1_agreement: float
    tokens: int
    by_position: tuple[PositionBucket, ...]


def _stats(kl: np.ndarray, agree: np.ndarray) -> tuple[float | None, ...]:
    if kl.size == 0:
        return None, None, None
    return (float(np.mean(kl, dtype=np.float64)),
            float(np.percentile(kl, TAIL_PERCENTILE)),
            float(np.mean(agree, dtype=np.float64)))


def summarize(kl, agree, scored) -> DistributionMetrics:
    """Metrics of per-token ``kl``, ``agree`` and the ``scored`` mask, ``[N, L]`` arrays
    over ``N`` windows of ``L`` positions (position ``t`` predicts token ``t + 1``)."""
    kl, agree, scored = (np.asarray(a) for a in (kl, agree, scored))
    if kl.ndim != 2 or kl.shape != agree.shape or kl.shape != scored.shape:
        raise ValueError(f"kl, agree and scored must be [N, L] arrays of one shape, got "
                         f"{kl.shape}, {agree.shape}, {scored.shape}")
    scored = scored.astype(bool)
    if not scored.any():
        raise ValueError("no token is scored")
    kl_mean, kl_p99, top1 = _stats(kl[scored], agree[scored])
    edges = position_edges(kl.shape[1])
    buckets = []
    for start, end in itertools.pairwise(edges):
        mask = scored[:, start:end]
        stats = _stats(kl[:, start:end][mask], agree[:, start:end][mask])
        buckets.append(PositionBucket(start, end, int(mask.sum()), *stats))
    return DistributionMetrics(kl_mean=kl_mean, kl_p99=kl_p99, top1_agreement=top1,
                               tokens=int(scored.sum()), by_position=tuple(buckets))


__all__ = ["TAIL_PERCENTILE", "DistributionMetrics", "PositionBucket", "position_edges",
           "summarize", "token_divergence"]
