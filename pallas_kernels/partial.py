"""Partial softmaxes: what every decode kernel returns, and how partials combine.

A partial ``(o, m, l)`` of query rows over a set of keys holds ``o = sum_s exp(s_s - m)
v_s`` (un-normalized output), ``m`` the largest logit and ``l = sum_s exp(s_s - m)``.
Partials over disjoint key sets (a kernel's splits, a cache's sinks and residual window)
merge exactly (:func:`merge_partials`); :func:`normalize` gives the attention output.
Shapes: ``o [..., D]``, ``m, l [...]``, float32. A partial over no key is ``o = 0, l = 0,
m = NEG`` (:func:`empty_partial`), which every merge absorbs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: the masked logit (finite, so a row with no visible key stays NaN-free)
NEG = float(jnp.finfo(jnp.float32).min)
#: float32 products of the exact paths (GPUs would otherwise use TF32 by default)
EXACT = jax.lax.Precision.HIGHEST


def empty_partial(q: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The partial of query rows ``q [..., D]`` over no key at all."""
    rows = q.shape[:-1]
    return (jnp.zeros(q.shape, jnp.float32), jnp.full(rows, NEG, jnp.float32),
            jnp.zeros(rows, jnp.float32))


def dense_partial(
    q: jax.Array,      # [B, K, G, D] query rows grouped per kv head
    keys: jax.Array,   # [B, K, n, D] raw keys
    values: jax.Array,  # [B, K, n, D] raw values
    valid: jax.Array,  # bool [B, n]: which of the n tokens are stored
    *,
    sm_scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of ``q`` over raw ``keys, values`` (exact float32, HIGHEST).

    Returns ``o [B, K, G, D]``, ``m, l [B, K, G]``.
    """
    f32 = jnp.float32
    s = jnp.einsum("bkgd,bknd->bkgn", q.astype(f32), keys.astype(f32), precision=EXACT)
    return logits_partial(s * sm_scale, values, valid)


def logits_partial(
    s: jax.Array,       # [B, K, G, n] logits (sm_scale applied)
    values: jax.Array,  # [B, K, n, D] raw values
    valid: jax.Array,   # bool [B, n]: which of the n tokens are stored, or [B, G, n] per row
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of given logits over raw ``values`` (exact float32, HIGHEST):
    for scores that are not a plain ``q . k`` (an estimator's), or that each query row
    sees its own part of (``valid [B, G, n]``: a causal chunk's).

    Returns ``o [B, K, G, D]``, ``m, l [B, K, G]``.
    """
    f32 = jnp.float32
    ok = valid[:, None] if valid.ndim == 3 else valid[:, None, None, :]
    s = jnp.where(ok, s.astype(f32), NEG)
    m = jnp.max(s, axis=-1) if s.shape[-1] else jnp.full(s.shape[:-1], NEG, f32)
    p = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
    o = jnp.einsum("bkgn,bknd->bkgd", p, values.astype(f32), precision=EXACT)
    return o, m, jnp.sum(p, axis=-1)


def merge_partials(partials, axis: int | None = None):
    """Merge partial softmaxes exactly into one partial ``(o, m, l)``.

    ``partials`` is a list of ``(o, m, l)`` with equal shapes, or one triple whose
    ``axis`` (of ``m``; ``o`` has the same axis and a trailing ``D``) enumerates the
    parts (a kernel's splits).
    """
    if axis is not None:
        o, m, l = partials
        o, m, l = jnp.moveaxis(o, axis, 0), jnp.moveaxis(m, axis, 0), jnp.moveaxis(l, axis, 0)
    else:
        o = jnp.stack([p[0] for p in partials])
        m = jnp.stack([p[1] for p in partials])
        l = jnp.stack([p[2] for p in partials])
    if o.shape[0] == 1:
        return o[0], m[0], l[0]
    # one variadic reduction whose step merges two partials, rather than the largest
    # logit first and the weighted sums after it: at decode time each reduction is a
    # kernel launch of its own, per layer and step, on a few kilobytes
    f32 = jnp.float32
    o, top, total = jax.lax.reduce(
        (o.astype(f32), jnp.broadcast_to(m[..., None], o.shape).astype(f32),
         jnp.broadcast_to(l[..., None], o.shape).astype(f32)),
        (f32(0), f32(NEG), f32(0)), _merge_two, (0,))
    return o, top[..., 0], total[..., 0]


def _merge_two(a, b):
    (oa, ma, la), (ob, mb, lb) = a, b
    top = jnp.maximum(ma, mb)
    # NEG is finite: two empty partials weigh exp(0) = 1 each and add zeros
    wa, wb = jnp.exp(ma - top), jnp.exp(mb - top)
    return oa * wa + ob * wb, top, la * wa + lb * wb


def normalize(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """The attention output ``o / l`` of a partial; rows that saw no key give 0."""
    del m
    return o / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]


def unrotate_output(o: jax.Array, rotation: jax.Array) -> jax.Array:
    """``R^T o`` per kv head: the output of a partial over values stored as ``R v``.

    ``o [B, K, G, D]``, ``rotation [K, D, D]`` (orthogonal ``R``); exact float32. The
    output is linear in the values, so rotating it back once replaces un-rotating every
    value.
    """
    return jnp.einsum("bkgd,kde->bkge", o.astype(jnp.float32),
                      rotation.astype(jnp.float32), precision=EXACT)
