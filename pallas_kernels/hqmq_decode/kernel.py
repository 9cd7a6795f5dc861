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
gathered by column; with ``digits="matmul"`` the groups' bytes, the stream's first, are
one contiguous load and a matmul with a 0/1/256 matrix spreads them to the chunks'
columns, two gathers per chunk fewer for one small matmul) gives its digit by float
arithmetic, ``floor((v + 1/2) / place)``
modulo the odd base (exact: the quotient's error is far below the half-step margin); the
low index bits are a window of bytes, the radius codes a window of nibbles interleaved
in registers. A codeword ``q_p q_s`` is formed one of two ways (``lookup``): ``"product"``
gathers the secondary quaternion ``q_s`` from the head's ``S`` secondaries (float16, 768
bytes at ``S = 96``) and multiplies it by the Hurwitz unit ``q_p``, whose components follow
from its index by comparisons (no table); ``"table"`` gathers the whole codeword from the
head's ``24 S`` codewords (18 KB). Either table stays in the L1 cache, but a gather costs
one L1 wavefront per distinct 128-byte line its lanes touch: ~29 for random indices
into the large table, at most 6 into the small one, which is what the product's sixteen
multiply-adds buy back. (The same tables as float16 pairs in 32-bit words, two gathers
per chunk instead of four for two masks, a shift and four bitcasts, measured slower:
docs/kernels.md, "The work each kernel asks for".) Operands of the dots are float16,
accumulation float32; the reference is exact float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kvjax.primitives.packing import code_position
from kvjax.primitives.quaternion import NUM_HURWITZ, HqmqLayout, hamilton_components
from pallas_kernels.flash import (
    MIN_DOT,
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
#: how the kernel forms codewords (module doc); the first is the default
LOOKUPS = ("product", "table")
#: how it reads each chunk's mixed-radix group (module doc); the first is the default
DIGITS = ("gather", "matmul")


def digit_bytes(layout: HqmqLayout) -> int:
    """Bytes of the stream ``digits="matmul"`` loads per token: the digit groups' bytes
    (the first of the stream), rounded up to a whole matmul depth: within the token for
    every layout the kernel reads, whose ``C`` low bytes and radius nibbles follow."""
    groups = -(-layout.chunks // layout.group)
    return -(-2 * groups // MIN_DOT) * MIN_DOT


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


def _unit_components(p: jax.Array) -> list:
    """The four components (float32 tiles) of the Hurwitz units of indices ``p`` (int32),
    in the order of :func:`kvjax.primitives.quaternion.hurwitz_units`: ``2 c + n`` is
    ``(-1)**n`` on axis ``c``, ``8 + m`` has component ``c`` at ``-1/2`` iff bit ``c`` of
    ``m`` is set, else ``+1/2``."""
    half = p >= 8
    out = []
    for c in range(COMPONENTS):
        axis = jnp.where(p == 2 * c, 1.0, jnp.where(p == 2 * c + 1, -1.0, 0.0))
        negative = jax.lax.shift_right_logical(p - 8, c) & 1
        out.append(jnp.where(half, 0.5 - negative.astype(jnp.float32), axis))
    return out


def _codewords(table_ref, index: jax.Array, lookup: str) -> list:
    """The four components (float32 tiles) of the codewords of joint indices ``index``:
    ``table_ref`` holds ``[4, 24 S]`` codewords (``"table"``) or ``[4, S]`` secondaries
    (``"product"``)."""

    def gather(at):
        return [table_ref[m, at].astype(jnp.float32) for m in range(COMPONENTS)]

    if lookup == "table":
        return gather(index)
    s = jax.lax.div(index, np.int32(NUM_HURWITZ))
    return hamilton_components(_unit_components(index - NUM_HURWITZ * s), gather(s))


def _digit_spread(layout: HqmqLayout) -> jax.Array:
    """``[digit_bytes, C]`` float16: column ``c`` holds 1 at its group's low byte and 256
    at its high byte (zero for the last, one-byte group), so the stream's first bytes
    times it are every chunk's group value. Exact: bytes and 256 are exact float16
    operands, and the float32 sums of two such products are integers below 2^16."""
    shape = (digit_bytes(layout), layout.chunks)
    byte = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    column = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    low = 2 * (column // layout.group)
    wide = column < layout.full * layout.group
    return jnp.where(byte == low, 1.0,
                     jnp.where(wide & (byte == low + 1), 256.0, 0.0)).astype(OPERAND)


def _decoded(load, ref, table_ref, layout: HqmqLayout, columns, lookup: str, spread=None):
    """The block's four ``[block, C]`` float16 tiles ``k_c * w_m[c]`` of the tokens in
    ``ref`` (a byte stream), codewords by ``lookup`` from ``table_ref``; the digit
    groups gathered by column, or with ``spread`` (:func:`_digit_spread`) one load of
    the stream's first bytes and a matmul."""
    digit_byte, wide, inverse = columns
    if spread is None:
        lo = load(ref, digit_byte).astype(jnp.float32)
        hi = load(ref, digit_byte + 1).astype(jnp.float32)
        v = lo + 256.0 * jnp.where(wide, hi, 0.0)
    else:
        head = load(ref, pl.ds(0, spread.shape[0])).astype(OPERAND)
        v = dot_nn(head, spread)
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
    return [(w * radius).astype(OPERAND) for w in _codewords(table_ref, index, lookup)]


def _split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x`` (float32) as two float16 terms, ``hi + lo``, to ~22 bits: a tensor-core
    product of both with exact float16 operands is as good as a float32 one."""
    hi = x.astype(OPERAND)
    return hi, (x - hi.astype(jnp.float32)).astype(OPERAND)


def _outlier_tiles(load, flags_ref, chunks_ref, start_ref=None, *, block: int,
                   chunks: int) -> list:
    """The Med-C outliers of the block being read (one outlier block of ``block``
    tokens) as four dense ``[block, C]`` float16 tiles, one per component: the stored
    chunk where a chunk is flagged, zero elsewhere (the codec encoded a flagged chunk
    zeroed, so adding the tiles' products replaces it).

    Chunk ``i = t C + c`` is flagged by its bit as
    :func:`~kvjax.primitives.packing.pack_bits` stores them; its slot among the
    ``P`` stored chunks is the number of flags before it in that order (chunks past the
    capacity are not flagged by the codec; a slot past it is read as zero). With
    ``start_ref`` (pooled outliers) the entries of ``chunks_ref`` are one pool of the
    row and the slot counts on from the block's ``start``."""
    slots = chunks_ref.shape[-1] // COMPONENTS
    t = jax.lax.broadcasted_iota(jnp.int32, (block, chunks), 0)
    i = t * chunks + jax.lax.broadcasted_iota(jnp.int32, (block, chunks), 1)
    here = jnp.zeros((block, chunks), jnp.int32)  # the block's own entry
    word, bit = code_position(i, block * chunks, 1)
    words = load(flags_ref, word, per=block, rows=here)
    flag = (jax.lax.shift_right_logical(words, bit.astype(words.dtype))
            & jnp.asarray(1, words.dtype)).astype(jnp.int32)
    row_total = jnp.sum(flag, axis=1)
    slot = (jnp.cumsum(row_total) - row_total)[:, None] + jnp.cumsum(flag, axis=1) - flag
    zero = jnp.zeros((), OPERAND)
    if start_ref is not None:
        slot = slot + load(start_ref, here, per=block, rows=here).astype(jnp.int32)
        entry, slot = slot // slots, slot % slots
        return [jnp.where(flag == 1, load(chunks_ref, slot * COMPONENTS + m, per=block,
                                          entries=entry).astype(OPERAND), zero)
                for m in range(COMPONENTS)]
    keep = (flag == 1) & (slot < slots)
    base = jnp.minimum(slot, slots - 1) * COMPONENTS
    return [jnp.where(keep, load(chunks_ref, base + m, per=block, rows=here).astype(OPERAND),
                      zero) for m in range(COMPONENTS)]


def _kernel(n_ref, layer_ref, q_ref, ks_ref, kscale_ref, vs_ref, vscale_ref, kt_ref, vt_ref,
            *refs, layout, block_s, split_len, splits, sm_scale, lookup, digits, k_outliers,
            v_outliers, page_tokens):
    o_ref, m_ref, l_ref = refs[-3:]
    extra = list(refs[:-3])
    k_med = [extra.pop(0) for _ in range(k_outliers)] or None
    v_med = [extra.pop(0) for _ in range(v_outliers)] or None
    chunks = layout.chunks
    rows = q_ref.shape[0]
    levels = np.float32(1.0 / (2**layout.radius_bits - 1))
    q_columns = [q_ref[:, pl.ds(m * chunks, chunks)] for m in range(COMPONENTS)]
    q_slots = [q.astype(OPERAND) for q in q_columns]
    # outlier products read the query to ~22 bits: the outliers are the largest chunks
    q_parts = [_split(q.astype(jnp.float32)) for q in q_columns] if k_outliers else None
    columns = _chunk_columns(layout)
    spread = _digit_spread(layout) if digits == "matmul" else None

    def scores(load):
        tiles = _decoded(load, ks_ref, kt_ref, layout, columns, lookup, spread)
        dots = sum(dot_nt(q_slots[m], tiles[m]) for m in range(COMPONENTS))
        scale = load(kscale_ref).astype(jnp.float32) * (levels * sm_scale)
        s = dots * scale[None, :]
        if k_med:
            tiles = _outlier_tiles(load, *k_med, block=block_s, chunks=chunks)
            s = s + sm_scale * sum(dot_nt(part, tiles[m]) for m in range(COMPONENTS)
                                   for part in q_parts[m])
        return s

    def accumulate(acc, p, correction, load):
        tiles = _decoded(load, vs_ref, vt_ref, layout, columns, lookup, spread)
        scale = load(vscale_ref).astype(jnp.float32) * levels
        pv = (p * scale[None, :]).astype(OPERAND)
        out = [acc[m] * correction[:, None] + dot_nn(pv, tiles[m]) for m in range(COMPONENTS)]
        if v_med:
            tiles = _outlier_tiles(load, *v_med, block=block_s, chunks=chunks)
            p_parts = _split(p)
            out = [out[m] + sum(dot_nn(part, tiles[m]) for part in p_parts)
                   for m in range(COMPONENTS)]
        return tuple(out)

    init = tuple(jnp.zeros((rows, chunks), jnp.float32) for _ in range(COMPONENTS))
    acc, m, l = split_softmax(
        n_ref, layer_ref, rows=rows, slots=ks_ref.shape[1], block_s=block_s,
        split_len=split_len, splits=splits, scores=scores, accumulate=accumulate, init=init,
        page_tokens=page_tokens)
    for c in range(COMPONENTS):
        o_ref[:, pl.ds(c * chunks, chunks)] = acc[c]
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=("layout", "sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret", "lookup", "digits", "page_tokens"),
)
def codes_partial(q, k_stream, k_scale, v_stream, v_scale, n_comp, k_table, v_table,
                  layer=None, k_outliers=None, v_outliers=None, pages=None, *,
                  layout: HqmqLayout, sm_scale: float, block_s: int, splits: int,
                  num_warps: int, num_stages: int, interpret: bool, lookup: str = LOOKUPS[0],
                  digits: str = DIGITS[0], page_tokens: int = 0):
    """Per-split partial softmaxes over the coded tokens: ``q [B, K, R, D]`` with ``R``
    query rows already padded (:func:`pallas_kernels.flash.pad_query_rows`), the streams
    and scales stacked ``[L, B, K, S, ...]`` (``layer`` None reads a stack of one), the
    codeword tables ``[K, 4, 24 S]`` (of which ``"product"`` reads the secondaries, the
    columns of unit 0); ``k_outliers``, ``v_outliers``: None, or Med-C ``(flags [L, B,
    K, NB, W], chunks [L, B, K, NB, 4 P])`` per outlier block of ``block_s`` tokens,
    with ``start [L, B, K, NB, 1]`` after them where the chunks are one pool per row.
    With ``pages`` (block tables ``[B, P]`` of ``page_tokens`` pages) every stack is a
    paged pool ``[L, 1, K, ...]`` that each row reads through its table. Returns ``o [B,
    K, splits, R, D]``, ``m, l [B, K, splits, R]`` (float32) in dim order; no check
    (:func:`.api.hqmq_decode` does them)."""
    batch, heads, rows, head_dim = q.shape
    if layer is None:
        k_stream, k_scale, v_stream, v_scale = (
            a[None] for a in (k_stream, k_scale, v_stream, v_scale))
        k_outliers, v_outliers = (None if o is None else tuple(a[None] for a in o)
                                  for o in (k_outliers, v_outliers))
        layer = 0
    layers, slots = k_stream.shape[0], k_stream.shape[3]
    row_slots = slots if pages is None else pages.shape[1] * page_tokens
    perm = query_columns(layout.chunks)
    kernel = functools.partial(_kernel, layout=layout, block_s=block_s,
                               split_len=split_len(row_slots, splits, block_s), splits=splits,
                               sm_scale=sm_scale,
                               lookup=lookup, digits=digits, k_outliers=len(k_outliers or ()),
                               v_outliers=len(v_outliers or ()), page_tokens=page_tokens)
    if lookup == "product":  # codeword 24 s is q_s times the unit 1
        k_table, v_table = k_table[..., ::NUM_HURWITZ], v_table[..., ::NUM_HURWITZ]
    args, in_specs = leading_inputs(n_comp, layer, q[..., perm], splits, pages)
    shared = pages is not None
    stream_spec = stacked_spec(layers, slots, k_stream.shape[4], shared=shared)
    scale_spec = stacked_spec(layers, slots, shared=shared)
    k_table, v_table = k_table.astype(OPERAND), v_table.astype(OPERAND)
    table_spec = pl.BlockSpec((None, *k_table.shape[-2:]), lambda b, h, j: (h, 0, 0))
    args += [k_stream, k_scale, v_stream, v_scale, k_table, v_table]
    in_specs += [stream_spec, scale_spec, stream_spec, scale_spec, table_spec, table_spec]
    for arrays in (k_outliers, v_outliers):
        if arrays is not None:
            args += list(arrays)
            in_specs += [stacked_spec(layers, a.shape[3], a.shape[4], shared=shared)
                         for a in arrays]
    o, m, l = decode_call(kernel, args, in_specs, batch=batch, heads=heads, splits=splits,
                          rows=rows, head_dim=head_dim, num_warps=num_warps,
                          num_stages=num_stages, interpret=interpret,
                          name="hqmq_decode_attention")
    return o[..., np.argsort(perm)], m, l
