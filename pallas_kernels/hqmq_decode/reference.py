"""Pure-jnp specification of the HQMQ decode-attention kernel.

:func:`hqmq_decode` has the signature of :func:`.api.hqmq_decode` and returns the same
partial softmax ``(o, m, l)`` over the coded tokens, exactly: every chunk's index,
radius and codeword are read from the stream as the layout says (:func:`dequantize`) and
every product is float32 at HIGHEST precision; Med-C outlier chunks replace the
flagged ones as the codec's decode does. The kernel rounds its operands (the
query, the codewords times the radius codes, the probabilities times the scales) to
float16; its tests state the tolerance that costs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.primitives.quaternion import HqmqLayout, replace_outliers
from pallas_kernels.flash import NUM_WARPS, layer_arrays, paged_rows, visible_slots
from pallas_kernels.hqmq_decode.api import check_arrays, pairs
from pallas_kernels.hqmq_decode.kernel import COMPONENTS
from pallas_kernels.partial import dense_partial


def dequantize(stream: jax.Array, scale: jax.Array, table: jax.Array,
               layout: HqmqLayout) -> jax.Array:
    """Tokens ``[..., S, D]`` (float32) of byte streams ``[..., S, H]``, scales ``[...,
    S]`` and a codeword table ``[4, N]`` (one head's)."""
    b = stream.astype(jnp.int32)
    chunk = jnp.arange(layout.chunks)
    group = chunk // layout.group
    wide = group < layout.full
    v = b[..., 2 * group] + jnp.where(wide, b[..., 2 * group + 1] << 8, 0)
    digit = (v // layout.odd ** (chunk % layout.group)) % layout.odd
    index = (digit << layout.low_bits) + b[..., layout.low_offset + chunk]
    nibble = b[..., layout.radius_offset + chunk // 2] >> (4 * (chunk % 2)) & 15
    codeword = jnp.take(table.astype(jnp.float32).T, index, axis=0)  # [..., S, C, 4]
    levels = 1.0 / (2**layout.radius_bits - 1)
    radius = nibble.astype(jnp.float32) * (scale.astype(jnp.float32)[..., None] * levels)
    return (radius[..., None] * codeword).reshape(*stream.shape[:-1], COMPONENTS * layout.chunks)


def with_outliers(x: jax.Array, outliers, block: int) -> jax.Array:
    """Tokens ``x [..., S, D]`` with the Med-C chunks ``(flags [..., NB, W], chunks [...,
    NB, 4 P][, start [..., NB, 1]])`` in place of the flagged ones (the codec's own rule,
    :func:`kvjax.primitives.quaternion.replace_outliers`; with ``start`` the chunks are
    one pool per row)."""
    flags, chunks, *start = outliers
    chunks = chunks.reshape(*chunks.shape[:-1], -1, COMPONENTS)
    return replace_outliers(x, flags, chunks, block, *start)


@functools.partial(
    jax.jit,
    static_argnames=("layout", "sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret", "lookup", "page_tokens"),
)
def hqmq_decode(
    q: jax.Array,
    k_stream: jax.Array,
    k_scale: jax.Array,
    v_stream: jax.Array,
    v_scale: jax.Array,
    lengths: jax.Array,
    k_table: jax.Array,
    v_table: jax.Array,
    layer: jax.Array | None = None,
    k_outlier_flags: jax.Array | None = None,
    k_outliers: jax.Array | None = None,
    v_outlier_flags: jax.Array | None = None,
    v_outliers: jax.Array | None = None,
    k_outlier_start: jax.Array | None = None,
    v_outlier_start: jax.Array | None = None,
    pages: jax.Array | None = None,
    *,
    layout: HqmqLayout,
    sm_scale: float,
    block_s: int | None = None,
    splits: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    interpret: bool | None = None,
    lookup: str = "product",
    page_tokens: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The specification of :func:`.api.hqmq_decode`: same arguments, same checks, the
    exact partial. The blocking, interpret and lookup arguments only shape how the kernel
    computes and are ignored here."""
    del block_s, splits, num_warps, num_stages, interpret, lookup
    k_med, v_med = pairs(k_outlier_flags, k_outliers, v_outlier_flags, v_outliers,
                         k_outlier_start, v_outlier_start)
    block, _ = check_arrays(q, k_stream, k_scale, v_stream, v_scale, lengths, layer, k_table,
                            v_table, layout, k_med, v_med, pages, page_tokens)
    pool = k_stream.shape[-2]

    def rows(arrays):  # one layer's arrays, a paged pool's gathered per row
        return paged_rows(layer_arrays(arrays, layer), pages, page_tokens, pool)

    k_stream, k_scale, v_stream, v_scale = rows((k_stream, k_scale, v_stream, v_scale))
    per_head = jax.vmap(dequantize, in_axes=(1, 1, 0, None), out_axes=1)
    head_dim = q.shape[-1]  # the codec's padding of the last chunk dropped
    keys = per_head(k_stream, k_scale, k_table, layout)[..., :head_dim]
    values = per_head(v_stream, v_scale, v_table, layout)[..., :head_dim]
    if k_med is not None:
        keys = with_outliers(keys, rows(k_med), block)
    if v_med is not None:
        values = with_outliers(values, rows(v_med), block)
    valid = visible_slots(lengths, k_stream.shape[2])
    return dense_partial(q.astype(jnp.float32), keys, values, valid, sm_scale=sm_scale)
