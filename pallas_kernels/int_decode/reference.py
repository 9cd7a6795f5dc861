"""Pure-jnp specification of the INT-N decode-attention kernel.

One decode query per row attends to the compressed region of one layer's cache. The
result is a *partial* softmax, ``(o, m, l)``: ``o`` the un-normalized output
``sum_s exp(s_s - m) v_s``, ``m`` the running maximum logit and ``l = sum_s exp(s_s - m)``,
so that partials over disjoint key sets (kernel splits, the raw window, sinks) merge
exactly (:func:`merge_partials`).

This reference is exact: codes are dequantized (``zero + scale * c``) and every product
is float32 at HIGHEST precision. The kernel rounds its matmul operands (the query and
the probabilities times the value scales) to float16 and accumulates in float32; its
tests state the tolerance that costs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.attention import NEG
from kvjax.codec import EXACT
from kvjax.codecs.intn import dequantize
from kvjax.primitives.packing import unpack_bits


def codes_partial_reference(
    q: jax.Array,
    k_codes: jax.Array,
    k_scale: jax.Array,
    k_zero: jax.Array,
    v_codes: jax.Array,
    v_scale: jax.Array,
    v_zero: jax.Array,
    n_comp: jax.Array,
    *,
    bits: int,
    sm_scale: float,
    rotation: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of grouped queries over the first ``n_comp[b]`` coded tokens.

    q ``[B, K, G, D]`` float32; codes ``uint32[B, K, S, W]`` (planar, see
    :mod:`kvjax.primitives.packing`); scales and zeros ``[B, K, S]`` (fp16 or float32); ``n_comp``
    ``int32[B]``; ``rotation`` ``[K, D, D]`` (keys stored as ``R x``) or None. Returns
    ``o [B, K, G, D]``, ``m [B, K, G]``, ``l [B, K, G]`` in float32; rows with no coded
    token get ``o = 0, l = 0, m = finfo.min``.
    """
    head_dim = q.shape[-1]
    f32 = jnp.float32
    q = q.astype(f32)
    if rotation is not None:
        q = jnp.einsum("bkgd,ked->bkge", q, rotation.astype(f32), precision=EXACT)
    keys = dequantize(unpack_bits(k_codes, bits, head_dim), k_scale[..., None],
                      k_zero[..., None])
    values = dequantize(unpack_bits(v_codes, bits, head_dim), v_scale[..., None],
                        v_zero[..., None])
    valid = jnp.arange(k_codes.shape[2])[None, :] < n_comp[:, None]
    return dense_partial(q, keys, values, valid, sm_scale=sm_scale)


def dense_partial(
    q: jax.Array, keys: jax.Array, values: jax.Array, valid: jax.Array, *, sm_scale: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of ``q [B, K, G, D]`` over raw ``keys, values [B, K, n, D]``.

    ``valid [B, n]`` marks the stored tokens; exact float32 (HIGHEST precision).
    """
    f32 = jnp.float32
    s = jnp.einsum("bkgd,bknd->bkgn", q.astype(f32), keys.astype(f32), precision=EXACT)
    s = s * sm_scale
    ok = valid[:, None, None, :]
    s = jnp.where(ok, s, NEG)
    m = jnp.max(s, axis=-1) if s.shape[-1] else jnp.full(s.shape[:-1], NEG, f32)
    p = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
    o = jnp.einsum("bkgn,bknd->bkgd", p, values.astype(f32), precision=EXACT)
    return o, m, jnp.sum(p, axis=-1)


def merge_partials(partials, axis: int | None = None):
    """Merge partial softmaxes exactly into one partial ``(o, m, l)``.

    ``partials`` is a list of ``(o, m, l)`` with equal shapes, or one triple whose
    ``axis`` (of ``m``; ``o`` has the same axis and a trailing ``D``) enumerates the
    parts (kernel splits).
    """
    if axis is not None:
        o, m, l = partials
        o, m, l = jnp.moveaxis(o, axis, 0), jnp.moveaxis(m, axis, 0), jnp.moveaxis(l, axis, 0)
    else:
        o = jnp.stack([p[0] for p in partials])
        m = jnp.stack([p[1] for p in partials])
        l = jnp.stack([p[2] for p in partials])
    top = jnp.max(m, axis=0)
    weight = jnp.exp(m - top)
    return jnp.sum(weight[..., None] * o, axis=0), top, jnp.sum(weight * l, axis=0)


def normalize(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """The attention output ``o / l`` of a partial; rows that saw no key give 0."""
    del m
    return o / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]
