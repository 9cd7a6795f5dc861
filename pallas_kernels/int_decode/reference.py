"""Pure-jnp specification of the INT-N decode-attention kernel.

:func:`int_decode` has the signature of :func:`.api.int_decode` and returns the same
partial softmax ``(o, m, l)`` over the coded tokens, exactly: codes are dequantized
(``zero + scale * code``) and every product is float32 at HIGHEST precision. The kernel
rounds its matmul operands (the query and the probabilities times the value scales) to
float16 and accumulates in float32; its tests state the tolerance that costs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.primitives.packing import unpack_codes
from pallas_kernels.flash import layer_arrays, paged_rows, visible_slots
from pallas_kernels.int_decode.api import NUM_WARPS, check_arrays
from pallas_kernels.int_decode.kernel import Research
from pallas_kernels.partial import EXACT, dense_partial, unrotate_output


def dequantize(codes: jax.Array, scale: jax.Array, zero: jax.Array | None, bits: int,
               head_dim: int, offset: int | None = None) -> jax.Array:
    """Tokens ``zero + scale * code`` in float32 from ``uint32[..., S, W]`` words and
    ``[..., S]`` scales and zeros (with ``offset`` and no zeros: ``scale * (code -
    offset)``): ``[..., S, D]``."""
    c = unpack_codes(codes, bits, head_dim).astype(jnp.float32)
    if zero is None:
        return (c - offset) * scale[..., None].astype(jnp.float32)
    return zero[..., None].astype(jnp.float32) + c * scale[..., None].astype(jnp.float32)


@functools.partial(
    jax.jit,
    static_argnames=("bits", "offset", "sm_scale", "block_s", "splits", "num_warps",
                     "num_stages", "interpret", "research", "page_tokens"),
)
def int_decode(
    q: jax.Array,        # [B, K, G, D] float: the query rows that read kv head k
    k_codes: jax.Array,  # uint32 [B, K, S, W] ([L, B, K, S, W] with layer): planar codes
    k_scale: jax.Array,  # [B, K, S] ([L, ...]) fp16 or float32: key = zero + scale * code
    k_zero: jax.Array | None,  # [B, K, S] ([L, ...]) fp16 or float32; None with offset
    v_codes: jax.Array,  # uint32, like k_codes
    v_scale: jax.Array,  # like k_scale
    v_zero: jax.Array | None,  # like k_zero
    lengths: jax.Array,  # int32 [B], or [B, G] per query row: coded tokens seen, the first of S
    layer: jax.Array | None = None,       # int32 []: the layer of stacked codes to read
    q_rotation: jax.Array | None = None,  # [K, D, D]: keys stored as R k; reads R q
    v_rotation: jax.Array | None = None,  # [K, D, D]: values stored as R v; R^T o out
    pages: jax.Array | None = None,  # int32 [B, P]: block tables into a paged pool
    *,
    bits: int,
    offset: int | None = None,
    sm_scale: float,
    block_s: int | None = None,
    splits: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    interpret: bool | None = None,
    research: Research | None = None,
    page_tokens: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The specification of :func:`.api.int_decode`: same arguments, same checks, the
    exact partial ``(o [B, K, G, D], m [B, K, G], l [B, K, G])`` in float32. The
    blocking, interpret and research arguments only shape the kernel's schedule and are
    ignored here."""
    del block_s, splits, num_warps, num_stages, interpret, research
    check_arrays(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lengths, layer,
                 q_rotation, v_rotation, bits, offset, pages, page_tokens)
    head_dim = q.shape[-1]
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = paged_rows(layer_arrays(
        (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), layer), pages, page_tokens,
        k_codes.shape[-2])
    q = q.astype(jnp.float32)
    if q_rotation is not None:
        q = jnp.einsum("bkgd,ked->bkge", q, q_rotation.astype(jnp.float32), precision=EXACT)
    keys = dequantize(k_codes, k_scale, k_zero, bits, head_dim, offset)
    values = dequantize(v_codes, v_scale, v_zero, bits, head_dim, offset)
    valid = visible_slots(lengths, k_codes.shape[2])
    o, m, l = dense_partial(q, keys, values, valid, sm_scale=sm_scale)
    if v_rotation is not None:
        o = unrotate_output(o, v_rotation)
    return o, m, l
