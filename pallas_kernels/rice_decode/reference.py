"""Pure-jnp specification of the Rice decode-attention kernel.

:func:`rice_decode` has the signature of :func:`.api.rice_decode` and returns the same
partial softmax ``(o, m, l)`` over the coded tokens, exactly: every block is decoded by
the codec's own rule (:func:`kvjax.primitives.rice_blocks.rotated_tokens`: Rice streams,
bit-stripping, fallback levels and signs) and every product is float32 at HIGHEST
precision. The kernel rounds the query and the probabilities times the token factors to
float16 (the codes are exact); its tests state the tolerance that costs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.primitives.rice_blocks import rotated_tokens
from pallas_kernels.flash import NUM_WARPS, layer_arrays, paged_rows, visible_slots
from pallas_kernels.partial import dense_partial
from pallas_kernels.rice_decode.api import check_arrays


@functools.partial(
    jax.jit,
    static_argnames=("layout", "sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret", "page_tokens"),
)
def rice_decode(
    q: jax.Array,
    k_stream: jax.Array,
    k_index: jax.Array,
    k_norm: jax.Array,
    v_stream: jax.Array,
    v_index: jax.Array,
    v_norm: jax.Array,
    lengths: jax.Array,
    layer: jax.Array | None = None,
    pages: jax.Array | None = None,
    *,
    layout,
    sm_scale: float,
    block_s: int | None = None,
    splits: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    interpret: bool | None = None,
    page_tokens: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The specification of :func:`.api.rice_decode`: same arguments, same checks, the
    exact partial. The blocking and interpret arguments only shape the kernel's schedule
    and are ignored here."""
    del block_s, splits, num_warps, num_stages, interpret
    check_arrays(q, k_stream, k_index, k_norm, v_stream, v_index, v_norm, lengths, layer,
                 layout, pages, page_tokens)
    arrays = paged_rows(
        layer_arrays((k_stream, k_index, k_norm, v_stream, v_index, v_norm), layer), pages,
        page_tokens, k_stream.shape[-2] * layout.block)

    def tokens(stream, index, norm):
        x = rotated_tokens(layout, stream, index, norm)
        return x.reshape(*x.shape[:-3], -1, layout.head_dim)

    keys, values = tokens(*arrays[:3]), tokens(*arrays[3:])
    valid = visible_slots(lengths, keys.shape[2])
    return dense_partial(q.astype(jnp.float32), keys, values, valid, sm_scale=sm_scale)
