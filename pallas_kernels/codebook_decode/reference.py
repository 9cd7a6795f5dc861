"""Pure-jnp specification of the codebook decode-attention kernel.

:func:`codebook_decode` has the signature of :func:`.api.codebook_decode` and returns the
same partial softmax ``(o, m, l)`` over the coded tokens, exactly: keys are decoded in the
rotated space (``|k| y``, ``y`` the codebook values of the sign-magnitude codes), the query
rotated, QJL's term formed from ``G q`` and the sign bits, values dequantized per channel
group, every product float32 at HIGHEST precision (:func:`pallas_kernels.rotated.
reference`). The kernel rounds its matmul operands to float16 and accumulates in
float32; its tests state the tolerance that costs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.primitives.packing import unpack_codes
from pallas_kernels import rotated
from pallas_kernels.codebook_decode.api import key_reader
from pallas_kernels.flash import NUM_WARPS


def codebook_values(codes: jax.Array, bits: int, magnitudes: tuple[float, ...],
                    head_dim: int) -> jax.Array:
    """``[..., S, D]`` float32 codebook values of stored sign-magnitude key words."""
    c = unpack_codes(codes, bits, head_dim)
    half = 1 << (bits - 1)
    # the low bits rank the magnitude (none at 1 bit: one magnitude), the top bit signs it
    rank = (c & (half - 1)).astype(jnp.int32)
    value = jnp.asarray(magnitudes, jnp.float32)[rank]
    return jnp.where(c >= half, -value, value)


@functools.partial(jax.jit, static_argnames=("key_bits", "magnitudes",
                                             *rotated.STATIC_ARGNAMES))
def codebook_decode(
    q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer=None, k_signs=None,
    k_qjl=None, k_residual_norm=None, qjl_sketch=None, pages=None, *,
    key_bits, magnitudes, value_bits,
    value_group, sm_scale, block_s=None, splits=None, num_warps=NUM_WARPS, num_stages=None,
    interpret=None, page_tokens=0,
):
    """The specification of :func:`.api.codebook_decode`: same arguments, same checks,
    the exact partial ``(o [B, K, G, D], m [B, K, G], l [B, K, G])`` in float32. The
    blocking and interpret arguments only shape the kernel's schedule and are ignored."""
    del block_s, splits, num_warps, num_stages, interpret
    return rotated.reference(
        key_reader(q, key_bits, magnitudes, value_bits, value_group),
        functools.partial(codebook_values, bits=key_bits, magnitudes=magnitudes),
        q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer, k_signs, k_qjl,
        k_residual_norm, qjl_sketch, pages, value_bits=value_bits, value_group=value_group,
        sm_scale=sm_scale, page_tokens=page_tokens)
