"""Pure-jnp specification of the OCTOPUS decode-attention kernel.

:func:`octopus_decode` has the signature of :func:`.api.octopus_decode` and returns the
same partial softmax ``(o, m, l)`` over the coded tokens, exactly: keys are decoded in the
rotated space (``|k| y``, every triplet of ``y`` its norm level times the codec's own
octahedral decode of its coordinates, read where the byte layout puts them), the query
rotated, QJL's term formed from ``G q`` and the sign bits, values dequantized per channel
group, every product float32 at HIGHEST precision (:func:`pallas_kernels.rotated.
reference`). The kernel rounds its matmul operands to float16 and accumulates in
float32; its tests state the tolerance that costs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.primitives.octahedral import octahedral_decode
from pallas_kernels import rotated
from pallas_kernels.flash import NUM_WARPS
from pallas_kernels.octopus_decode.api import key_reader
from pallas_kernels.octopus_decode.kernel import NIBBLE, RANK, SIGN


def triplet_values(codes: jax.Array, magnitudes: tuple[float, ...], norms: tuple[float, ...],
                   layout, head_dim: int) -> jax.Array:
    """``[..., S, D]`` float32 rotated unit vectors ``y`` of key bytes in ``layout``."""
    direction = codes[..., np.asarray(layout.direction)].astype(jnp.int32)
    table = jnp.asarray(magnitudes, jnp.float32)

    def coordinate(code):
        value = table[code & RANK]
        return jnp.where(code & SIGN, -value, value)

    m = octahedral_decode(coordinate(direction & (2 * SIGN - 1)),
                          coordinate(direction >> NIBBLE))
    if layout.norm:
        bits = (len(norms) - 1).bit_length()
        byte, slot = (np.asarray(a) for a in zip(*layout.norm, strict=True))
        index = (codes[..., byte].astype(jnp.int32) >> (bits * slot)) & ((1 << bits) - 1)
        rho = jnp.asarray(norms, jnp.float32)[index]
    else:
        rho = jnp.full(direction.shape, norms[0], jnp.float32)
    y = rho[..., None] * m
    return y.reshape(*y.shape[:-2], -1)[..., :head_dim]


@functools.partial(jax.jit, static_argnames=("direction_bits", "magnitudes", "norms",
                                             "layout", *rotated.STATIC_ARGNAMES))
def octopus_decode(
    q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer=None, k_signs=None,
    k_qjl=None, k_residual_norm=None, qjl_sketch=None, pages=None, *,
    direction_bits, magnitudes, norms,
    layout, value_bits, value_group, sm_scale, block_s=None, splits=None,
    num_warps=NUM_WARPS, num_stages=None, interpret=None, page_tokens=0,
):
    """The specification of :func:`.api.octopus_decode`: same arguments, same checks,
    the exact partial ``(o [B, K, G, D], m [B, K, G], l [B, K, G])`` in float32. The
    blocking and interpret arguments only shape the kernel's schedule and are ignored."""
    del block_s, splits, num_warps, num_stages, interpret
    return rotated.reference(
        key_reader(q, direction_bits, magnitudes, norms, layout, value_bits, value_group),
        functools.partial(triplet_values, magnitudes=magnitudes, norms=norms, layout=layout),
        q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer, k_signs, k_qjl,
        k_residual_norm, qjl_sketch, pages, value_bits=value_bits, value_group=value_group,
        sm_scale=sm_scale, page_tokens=page_tokens)
