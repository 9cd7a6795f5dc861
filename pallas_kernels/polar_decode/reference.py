"""Pure-jnp specification of the PolarQuant decode-attention kernel.

:func:`polar_decode` has the signature of :func:`.api.polar_decode` and returns the same
partial softmax ``(o, m, l)`` over the coded tokens, exactly: each angle's code is read
at its bit offset, replaced by its centroid, and the unit vector rebuilt level by level
(each radius split into ``r cos psi`` and ``r sin psi``) in float32; keys are scored in
the rotated space (``|k| (R q) . y``), values dequantized per channel group, every
product float32 at HIGHEST precision (:func:`pallas_kernels.rotated.reference`). The
kernel rounds its matmul operands to float16
and accumulates in float32; its tests state the tolerance that costs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.primitives.packing import unpack_at
from pallas_kernels import rotated
from pallas_kernels.flash import NUM_WARPS
from pallas_kernels.polar_decode.api import key_reader
from pallas_kernels.polar_decode.kernel import level_starts, level_widths


def unit_vectors(codes: jax.Array, angle_bits: int, centroids: tuple[tuple[float, ...], ...],
                 offsets: tuple[int, ...], head_dim: int) -> jax.Array:
    """``[..., S, D]`` float32 unit vectors of stored angle words ``[..., S, W]``."""
    widths = level_widths(head_dim, angle_bits)
    starts = level_starts(head_dim)
    per_angle = np.concatenate([np.full(head_dim >> level, w)
                                for level, w in enumerate(widths, start=1)])
    offsets = np.asarray(offsets)
    stored = np.flatnonzero(per_angle > 0)
    flat = unpack_at(codes, per_angle[stored], offsets[stored]).astype(jnp.int32)
    lead = codes.shape[:-1]
    r = jnp.ones((*lead, 1), jnp.float32)
    for level in range(len(widths), 0, -1):
        table = jnp.asarray(centroids[level - 1], jnp.float32)
        count = head_dim >> level
        if widths[level - 1]:
            # stored angles come in level order, so a level's codes are one run of them
            first = int(np.searchsorted(stored, starts[level - 1]))
            psi = table[flat[..., first:first + count]]
        else:
            psi = jnp.broadcast_to(table[0], (*lead, count))
        pair = jnp.stack([r * jnp.cos(psi), r * jnp.sin(psi)], axis=-1)
        r = pair.reshape(*lead, 2 * count)
    return r


@functools.partial(jax.jit, static_argnames=("angle_bits", "centroids", "offsets",
                                             *rotated.STATIC_ARGNAMES))
def polar_decode(
    q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer=None, k_signs=None,
    k_qjl=None, k_residual_norm=None, qjl_sketch=None, pages=None, *,
    angle_bits, centroids, offsets,
    value_bits, value_group, sm_scale, block_s=None, splits=None, num_warps=NUM_WARPS,
    num_stages=None, interpret=None, page_tokens=0,
):
    """The specification of :func:`.api.polar_decode`: same arguments, same checks, the
    exact partial ``(o [B, K, G, D], m [B, K, G], l [B, K, G])`` in float32. The
    blocking and interpret arguments only shape the kernel's schedule and are ignored."""
    del block_s, splits, num_warps, num_stages, interpret
    return rotated.reference(
        key_reader(q, angle_bits, centroids, offsets, value_bits, value_group,
                   (k_qjl, k_residual_norm, qjl_sketch)),
        functools.partial(unit_vectors, angle_bits=angle_bits, centroids=centroids,
                          offsets=offsets),
        q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer, k_signs, k_qjl,
        k_residual_norm, qjl_sketch, pages, value_bits=value_bits, value_group=value_group,
        sm_scale=sm_scale, page_tokens=page_tokens)
