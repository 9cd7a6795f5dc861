"""Pallas kernel: decode attention read straight from HQMQ byte streams (flash-decoding,
:mod:`pallas_kernels.flash`).

A token of ``C = D / 4`` chunks is ``scale / (2**B - 1) * k_c * w_c`` per chunk ``c``,
``k_c`` the radius code and ``w_c = q_p q_s`` the codeword of the chunk's joint index.
With the query's columns laid out by quaternion component (``q_m[c] = q[4 c + m]``, once
per call), ``q . k = scale / (2**B - 1) * sum_m q_m . (k * w_m)``: per block, four
``[block, C]`` operand tiles, one per component, and four matmuls; the values the same
way against the probabilities, into four ``[rows, C]`` accumulators.

Per block and chunk the kernel rebuilds the joint index from the stream
(:class:`kvjax.primitives.quaternion.HqmqLayout`): the chunk's mixed-radix group (one or two bytes,
gathered by column) gives its digit by float arithmetic, ``floor((v + 1/2) / place)``
modulo the odd base (exact: the quotient's error is far below the half-step margin); the
low index bits are a window of bytes, the radius codes a window of nibbles interleaved
in registers. The codewords come from the head's table ``[4, 24 S]`` (float16, computed
once per call), gathered by index: the whole table stays in the L1 cache. Operands of
the dots are float16, accumulation float32; the reference is exact float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kvjax.primitives.quaternion import HqmqLayout
from pallas_kernels.flash import (
    OPERAND,
    decode_call,
    dot_nn,
    dot_nt,
    leading_inputs,
    split_len,
    split_softmax,
    stacked_spec,
)

#: quaternion components
COMPONENTS = 4


def query_columns(chunks: int) -> np.ndarray:
    """The dim in each kernel column of the query (and of the output): component-major,
    ``m * C + c`` holds dim ``4 c + m``."""
    return np.arange(COMPONENTS * chunks).reshape(chunks, COMPONENTS).T.reshape(-1)


def _chunk_columns(layout: HqmqLayout):
    """Per chunk column: the byte of its digits' group, whether the group has a high
    byte, and ``1 / place`` (float32), from an iota: a kernel closes over no array
    constants."""
    column = jax.lax.broadcasted_iota(jnp.int32, (layout.chunks,), 0)
    digit_byte = 2 * (column // layout.group)
    wide = (column < layout.full * layout.group)[None, :]
    position = column % layout.group
    inverse = jnp.zeros((layout.chunks,), jnp.float32)
    for i in range(layout.group):
        inverse = jnp.where(position == i, np.float32(1.0 / layout.odd**i), inverse)
    return digit_byte, wide, inverse[None, :]


def _decoded(load, ref, table_ref, layout: HqmqLayout, columns):
    """The block's four ``[block, C]`` float16 tiles ``k_c * w_m[c]`` of the tokens in
    ``ref`` (a byte stream), codewords from ``table_ref [4, 24 S]``."""
    digit_byte, wide, inverse = columns
    lo = load(ref, digit_byte).astype(jnp.float32)
    hi = load(ref, digit_byte + 1).astype(jnp.float32)
    v = lo + 256.0 * jnp.where(wide, hi, 0.0)
    quotient = jnp.floor((v + 0.5) * inverse)
    digit = quotient - layout.odd * jnp.floor((quotient + 0.5) * np.float32(1.0 / layout.odd))
    low = load(ref, pl.ds(layout.low_offset, layout.chunks)).astype(jnp.int32)
    index = digit.astype(jnp.int32) * (1 << layout.low_bits) + low
    radius = load(ref, pl.ds(layout.radius_offset, layout.chunks // 2))
    # nibble 2 t is byte t's low nibble: interleaving the byte with its high nibble
    # puts every chunk's code in its own column
    radius = jnp.stack([radius & jnp.asarray(15, radius.dtype),
                        radius >> jnp.asarray(4, radius.dtype)], axis=-1)
    radius = radius.reshape(radius.shape[0], layout.chunks).astype(jnp.float32)
    return [(table_ref[m, index].astype(jnp.float32) * radius).astype(OPERAND)
            for m in range(COMPONENTS)]


def _kernel(n_ref, layer_ref, q_ref, ks_ref, kscale_ref, vs_ref, vscale_ref, kt_ref, vt_ref,
            o_ref, m_ref, l_ref, *, layout, block_s, split_len, sm_scale):
    chunks = layout.chunks
    rows = q_ref.shape[0]
    levels = np.float32(1.0 / (2**layout.radius_bits - 1))
    q_slots = [q_ref[:, pl.ds(m * chunks, chunks)].astype(OPERAND) for m in range(COMPONENTS)]
    columns = _chunk_columns(layout)

    def scores(load):
        tiles = _decoded(load, ks_ref, kt_ref, layout, columns)
        dots = sum(dot_nt(q_slots[m], tiles[m]) for m in range(COMPONENTS))
        scale = load(kscale_ref).astype(jnp.float32) * (levels * sm_scale)
        return dots * scale[None, :]

    def accumulate(acc, p, correction, load):
        tiles = _decoded(load, vs_ref, vt_ref, layout, columns)
        scale = load(vscale_ref).astype(jnp.float32) * levels
        pv = (p * scale[None, :]).astype(OPERAND)
        return tuple(acc[m] * correction[:, None] + dot_nn(pv, tiles[m])
                     for m in range(COMPONENTS))

    init = tuple(jnp.zeros((rows, chunks), jnp.float32) for _ in range(COMPONENTS))
    acc, m, l = split_softmax(
        n_ref, layer_ref, rows=rows, slots=ks_ref.shape[1], block_s=block_s,
        split_len=split_len, scores=scores, accumulate=accumulate, init=init)
    for c in range(COMPONENTS):
        o_ref[:, pl.ds(c * chunks, chunks)] = acc[c]
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=("layout", "sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret"),
)
def codes_partial(q, k_stream, k_scale, v_stream, v_scale, n_comp, k_table, v_table,
                  layer=None, *, layout: HqmqLayout, sm_scale: float, block_s: int,
                  splits: int, num_warps: int, num_stages: int, interpret: bool):
    """Per-split partial softmaxes over the coded tokens: ``q [B, K, R, D]`` with ``R``
    query rows already padded (:func:`pallas_kernels.flash.pad_query_rows`), the streams
    and scales stacked ``[L, B, K, S, ...]`` (``layer`` None reads a stack of one), the
    codeword tables ``[K, 4, 24 S]`` float16. Returns ``o [B, K, splits, R, D]``, ``m, l
    [B, K, splits, R]`` (float32) in dim order; no check (:func:`.api.hqmq_decode` does
    them)."""
    batch, heads, rows, head_dim = q.shape
    if layer is None:
        k_stream, k_scale, v_stream, v_scale = (
            a[None] for a in (k_stream, k_scale, v_stream, v_scale))
        layer = 0
    layers, slots = k_stream.shape[0], k_stream.shape[3]
    perm = query_columns(layout.chunks)
    kernel = functools.partial(_kernel, layout=layout, block_s=block_s,
                               split_len=split_len(slots, splits, block_s), sm_scale=sm_scale)
    args, in_specs = leading_inputs(n_comp, layer, q[..., perm])
    stream_spec = stacked_spec(layers, slots, k_stream.shape[4])
    scale_spec = stacked_spec(layers, slots)
    table_spec = pl.BlockSpec((None, COMPONENTS, k_table.shape[-1]), lambda b, h, j: (h, 0, 0))
    args += [k_stream, k_scale, v_stream, v_scale, k_table.astype(OPERAND),
             v_table.astype(OPERAND)]
    in_specs += [stream_spec, scale_spec, stream_spec, scale_spec, table_spec, table_spec]
    o, m, l = decode_call(kernel, args, in_specs, batch=batch, heads=heads, splits=splits,
                          rows=rows, head_dim=head_dim, num_warps=num_warps,
                          num_stages=num_stages, interpret=interpret,
                          name="hqmq_decode_attention")
    return o[..., np.argsort(perm)], m, l
