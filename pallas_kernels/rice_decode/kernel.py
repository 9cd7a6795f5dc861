"""Pallas kernel: decode attention read straight from HyperQuant's Rice-coded blocks
(E8 lattice, :mod:`kvjax.codecs.hyperquant`), flash-decoding as in
:mod:`pallas_kernels.flash`, in the codec's rotated frame (the entry rotates the query
once and the caller rotates the output back).

A tile is ``T`` tokens, ``T / tN`` Rice blocks. Per block the stream holds, for each of
its ``n_sub`` sub-streams, the remainders (``k`` bits each, at fixed offsets) and then
the unary quotients, the ``i``-th ending at the ``i``-th one of the unary region
(:mod:`kvjax.primitives.rice`). Both halves decode without a serial scan:

- a remainder is a window of the stream at ``start + i k``: two gathered words, a shift
  and a mask (its bits are stored least significant first);
- a quotient needs the position of its terminating one. Every bit of the block's words
  is a lane whose rank among the block's ones is a prefix count of the words'
  population counts plus the population count of its word's lower bits; the ones of
  ranks ``base_s + r`` (``r < S``) end sub-stream ``s``'s symbols and store their
  positions in a per-program scratch tile at the symbols' ``(token, dim)``. After a
  barrier the tile is read back densely, and each quotient is its end minus the
  previous symbol's end minus one.

Symbols then become E8 codes (:meth:`kvjax.primitives.lattices.Lattice.unstrip`): each
group of 8 needs the parity of its first seven halved coordinates and the low bit of
its last symbol, which two small float16 products with 0/1 matrices gather and spread
back (exact: counts below 16). A block in the sign fallback reads its signs and token
scales instead. Per token, ``|x| / (alpha_level sqrt D)`` (or ``|x| s / sqrt D``)
scales the logits and the probabilities; the codes (integers, exact in float16 below
2048) are the matmul operands.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.primitives.packing import code_position
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

#: lattice dimension (E8)
GROUP = 8
#: the largest code magnitude passed on (float16 holds it; real codes are far smaller)
FINITE = 1 << 15
#: Rice levels that code at a scale (``alpha 2**(-j/2)``); the next is the sign fallback
LADDER = 4


def _unzigzag(u: jax.Array) -> jax.Array:
    """``0, 1, 2, 3, ... -> 0, -1, 1, -2, ...`` (uint32 in, int32 out)."""
    return (u >> 1).astype(jnp.int32) ^ -(u & 1).astype(jnp.int32)


def _group_sums(x: jax.Array, head_dim: int) -> jax.Array:
    """Each group of 8 columns of ``x [T, D]`` (small non-negative integers, float)
    summed and spread back over the group: two float16 products with 0/1 matrices
    (exact below 2048), ``D / 8`` group columns padded to the smallest matmul width."""
    groups = max(MIN_DOT, head_dim // GROUP)
    d = jax.lax.broadcasted_iota(jnp.int32, (head_dim, groups), 0)
    g = jax.lax.broadcasted_iota(jnp.int32, (head_dim, groups), 1)
    gather = (d // GROUP == g).astype(OPERAND)  # [D, groups]
    g2 = jax.lax.broadcasted_iota(jnp.int32, (groups, head_dim), 0)
    d2 = jax.lax.broadcasted_iota(jnp.int32, (groups, head_dim), 1)
    spread = (d2 // GROUP == g2).astype(OPERAND)  # [groups, D]
    per_group = dot_nn(x.astype(OPERAND), gather)
    return dot_nn(per_group.astype(OPERAND), spread)


def _popcount(words: jax.Array) -> jax.Array:
    """Set bits per uint32 word (int32): as int32, which the Triton lowering maps to
    ``__nv_popc`` (it has no lowering for unsigned words)."""
    return jax.lax.population_count(jax.lax.bitcast_convert_type(words, jnp.int32))


def _scatter_ends(load, stream_ref, index_ref, scratch_ref, layout, b, tile: int):
    """Store, for every symbol of the tile's ``b``-th block, the stream position of its
    unary terminator in ``scratch_ref`` at the symbol's ``(token, dim)``.

    Every bit of the block's words is a lane (32 words at a time, a ``[32, 32]`` tile
    whatever the budget); its rank among the block's ones is the ones of the words
    before it plus the population count of its word's lower bits. Ranks grow with the
    position, so sub-stream ``s``'s terminators are exactly the ones of ranks ``base_s ..
    base_s + S - 1``, ``base_s`` the ones before its unary region: no lane needs its
    region's bounds."""
    count, symbols = layout.words, layout.substream
    lane = jax.lax.broadcasted_iota(jnp.int32, (32,), 0)
    rows = jnp.full((32,), b, jnp.int32)
    chunks, running = [], jnp.int32(0)
    for c in range(-(-count // 32)):
        w = c * 32 + lane
        words = load(stream_ref, jnp.minimum(w, count - 1), per=layout.block, rows=rows)
        words = jnp.where(w < count, words, jnp.uint32(0))
        counts = _popcount(words)
        chunks.append((w, words, running + jnp.cumsum(counts) - counts))  # ones before
        running = running + jnp.sum(counts)
    sub = jax.lax.broadcasted_iota(jnp.int32, (MIN_DOT,), 0)
    index = load(index_ref, jnp.minimum(sub, layout.n_sub - 1), per=layout.block,
                 rows=jnp.full((MIN_DOT,), b, jnp.int32))
    bases = []
    for s in range(layout.n_sub):
        field = jnp.sum(jnp.where(sub == s, index, jnp.uint32(0)))
        start = 0 if s == 0 else (field & 0xFFFFFF).astype(jnp.int32)
        unary = start + symbols * ((field >> 24) & 15).astype(jnp.int32)
        word, shift = unary // 32, (unary % 32).astype(jnp.uint32)
        base = jnp.int32(0)  # ones before the unary region
        for w, words, before in chunks:
            below = _popcount(words & ((jnp.uint32(1) << shift) - 1))
            base = base + jnp.sum(jnp.where(w == word, before + below, 0))
        bases.append(base)
    bit = jax.lax.broadcasted_iota(jnp.int32, (32, 32), 1)
    below_bit = (jnp.uint32(1) << bit.astype(jnp.uint32)) - 1
    for w, words, before in chunks:
        rank = before[:, None] + _popcount(words[:, None] & below_bit)
        ones = ((words[:, None] >> bit.astype(jnp.uint32)) & 1) == 1
        symbol, top = rank - bases[0], bases[0] + symbols
        for s in range(1, layout.n_sub):
            later = rank >= bases[s]
            symbol = jnp.where(later, rank - bases[s] + s * symbols, symbol)
            top = jnp.where(later, bases[s] + symbols, top)
        ends = ones & (rank >= bases[0]) & (rank < top)
        row = jnp.where(ends, b * layout.block + symbol // layout.head_dim, tile + bit % tile)
        col = jnp.where(ends, symbol % layout.head_dim, bit)
        plgpu.store(scratch_ref.at[row, col], w[:, None] * 32 + bit, mask=ends)


def _decoded(load, stream_ref, index_ref, norm_ref, scratch_ref, layout, tile: int,
             barrier):
    """The tile's ``[T, D]`` float16 operands (E8 codes, or signs for a block in the
    sign fallback) and per-token factors ``[T]`` (float32) whose product is each token
    in the rotated frame."""
    head_dim, tokens, symbols = layout.head_dim, layout.block, layout.substream
    t = jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)
    in_block = t % tokens
    sub = in_block * head_dim // symbols
    first = in_block * head_dim % symbols  # the token's first symbol in its sub-stream
    field = load(index_ref, sub, per=tokens, rows=t // tokens)
    level = (load(index_ref, jnp.zeros_like(t), per=tokens, rows=t // tokens)
             & 0xFFFFFF).astype(jnp.int32)
    start = jnp.where(sub == 0, 0, (field & 0xFFFFFF).astype(jnp.int32))
    k = ((field >> 24) & 15).astype(jnp.int32)
    norm = load(norm_ref, in_block, per=tokens, rows=t // tokens).astype(jnp.float32)

    # quotients: every block's terminators into the scratch tile, then read back
    barrier()  # the previous tile's reads are done
    for b in range(tile // tokens):
        _scatter_ends(load, stream_ref, index_ref, scratch_ref, layout, b, tile)
    barrier()
    row = jax.lax.broadcasted_iota(jnp.int32, (tile, head_dim), 0)
    d = jax.lax.broadcasted_iota(jnp.int32, (tile, head_dim), 1)
    ends = scratch_ref[pl.ds(0, tile), :]
    i = first[:, None] + d  # the symbol's index in its sub-stream
    previous = scratch_ref[jnp.where(d == 0, jnp.maximum(row - 1, 0), row),
                           jnp.where(d == 0, head_dim - 1, d - 1)]
    unary = start + symbols * k
    previous = jnp.where(i == 0, (unary - 1)[:, None], previous)
    quotient = (ends - previous - 1).astype(jnp.uint32)

    # remainders: k bits at start + i k, least significant first
    bit = start[:, None] + i * k[:, None]
    word = bit // 32
    shift = (bit % 32).astype(jnp.uint32)
    blocks = jnp.broadcast_to((t // tokens)[:, None], (tile, head_dim))
    lo = load(stream_ref, jnp.minimum(word, layout.words - 1), per=tokens, rows=blocks)
    hi = load(stream_ref, jnp.minimum(word + 1, layout.words - 1), per=tokens, rows=blocks)
    window = (lo >> shift) | jnp.where(shift == 0, jnp.uint32(0), hi << (32 - shift))
    ku = k.astype(jnp.uint32)[:, None]
    remainder = window & ((jnp.uint32(1) << ku) - 1)
    u = (quotient << ku) | remainder

    # E8 codes: 2 t + p on the first seven coordinates, 4 t7' + 2 parity + p on the last
    last = d % GROUP == GROUP - 1
    t7 = _unzigzag(u >> 1)
    t_ = _unzigzag(u)
    low = jnp.where(last, (u & 1).astype(jnp.int32), 2 * (t_ & 1))
    spread = _group_sums(low.astype(jnp.float32), head_dim).astype(jnp.int32)
    p, parity = spread & 1, (spread >> 1) & 1
    codes = jnp.where(last, 4 * t7 + 2 * parity + p, 2 * t_ + p)

    # the sign fallback: one bit per coordinate, token-major, as pack_bits stores them
    sign_at, sign_bit = code_position(in_block[:, None] * head_dim + d, tokens * head_dim, 1)
    sign_word = load(stream_ref, sign_at, per=tokens, rows=blocks)
    sign = ((sign_word >> sign_bit.astype(jnp.uint32)) & 1).astype(jnp.float32)
    is_sign = (level == LADDER)[:, None]
    # a token past the row's end decodes whatever the buffer holds: clipped to fp16's
    # range, its zero probability keeps it out of the output (inf * 0 would not)
    codes = jnp.clip(codes, -FINITE, FINITE)
    operand = jnp.where(is_sign, 2.0 * sign - 1.0, codes.astype(jnp.float32))

    # per token: |x| / (alpha_level sqrt D), or |x| s / sqrt D in the sign fallback
    rice_scale = jnp.exp2(jnp.minimum(level, LADDER - 1).astype(jnp.float32) / 2) * np.float32(
        1.0 / (layout.alpha * math.sqrt(head_dim)))
    factor = norm * jnp.where(level == LADDER, _sign_scales(load, stream_ref, layout, t),
                              rice_scale)
    return operand.astype(OPERAND), factor


def _sign_scales(load, stream_ref, layout, t: jax.Array) -> jax.Array:
    """Per token of the tile, ``s / sqrt D`` of the sign fallback (its scale code
    ``c`` read as :func:`kvjax.primitives.packing.pack_bits` stores ``tN`` codes of
    ``sign_scale_bits`` after the signs: ``s = (c + 1) / 2**bits``, or ``sqrt(2 / pi)``
    without bits)."""
    bits, tokens = layout.sign_scale_bits, layout.block
    root = np.float32(1.0 / math.sqrt(layout.head_dim))
    if not bits:
        return jnp.full(t.shape, np.float32(math.sqrt(2.0 / math.pi)) * root)
    word, shift = code_position(t % tokens, tokens, bits)
    base = layout.sign_words()
    lo = load(stream_ref, base + word, per=tokens, rows=t // tokens)
    hi = load(stream_ref, jnp.minimum(base + word + 1, layout.words - 1), per=tokens,
              rows=t // tokens)
    ushift = shift.astype(jnp.uint32)
    window = (lo >> ushift) | jnp.where(ushift == 0, jnp.uint32(0), hi << (32 - ushift))
    code = window & jnp.uint32((1 << bits) - 1)
    return (code.astype(jnp.float32) + 1.0) * np.float32(1.0 / (1 << bits)) * root


def _kernel(n_ref, layer_ref, q_ref, ks_ref, ki_ref, kn_ref, vs_ref, vi_ref, vn_ref,
            o_ref, m_ref, l_ref, scratch_ref, *, layout, block_s, split_len, splits, sm_scale,
            interpret, page_tokens):
    rows = q_ref.shape[0]
    # interpret mode runs a program's lanes in lockstep: nothing to wait for
    barrier = (lambda: None) if interpret else plgpu.debug_barrier
    q = q_ref[...].astype(OPERAND)

    def scores(load):
        operand, factor = _decoded(load, ks_ref, ki_ref, kn_ref, scratch_ref, layout, block_s,
                                   barrier)
        return dot_nt(q, operand) * (factor * sm_scale)[None, :]

    def accumulate(acc, p, correction, load):
        operand, factor = _decoded(load, vs_ref, vi_ref, vn_ref, scratch_ref, layout, block_s,
                                   barrier)
        return acc * correction[:, None] + dot_nn((p * factor[None, :]).astype(OPERAND),
                                                  operand)

    acc, m, l = split_softmax(
        n_ref, layer_ref, rows=rows, slots=ks_ref.shape[1] * layout.block, block_s=block_s,
        split_len=split_len, splits=splits, scores=scores, accumulate=accumulate,
        init=jnp.zeros((rows, layout.head_dim), jnp.float32), page_tokens=page_tokens)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=("layout", "sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret", "page_tokens"),
)
def codes_partial(q, k_stream, k_index, k_norm, v_stream, v_index, v_norm, n_comp,
                  layer=None, pages=None, *, layout, sm_scale: float, block_s: int,
                  splits: int, num_warps: int, num_stages: int, interpret: bool,
                  page_tokens: int = 0):
    """Per-split partial softmaxes over the coded tokens: ``q [B, K, R, D]`` (rotated,
    ``R`` rows padded), the blocks stacked ``[L, B, K, NB, ...]`` (``layer`` None reads a
    stack of one; with ``pages``, block tables ``[B, P]`` of ``page_tokens`` pages, a
    paged pool ``[L, 1, K, NB, ...]`` that each row reads through its table). Returns
    ``o [B, K, splits, R, D]`` (rotated frame), ``m, l [B, K, splits, R]`` (float32); no
    check (:func:`.api.rice_decode` does them)."""
    batch, heads, rows, head_dim = q.shape
    arrays = (k_stream, k_index, k_norm, v_stream, v_index, v_norm)
    if layer is None:
        arrays = tuple(a[None] for a in arrays)
        layer = 0
    layers, blocks = arrays[0].shape[0], arrays[0].shape[3]
    slots = blocks * layout.block if pages is None else pages.shape[1] * page_tokens
    kernel = functools.partial(_kernel, layout=layout, block_s=block_s,
                               split_len=split_len(slots, splits, block_s), splits=splits,
                               sm_scale=sm_scale, interpret=interpret,
                               page_tokens=page_tokens)
    args, in_specs = leading_inputs(n_comp, layer, q, splits, pages)
    args += list(arrays)
    in_specs += [stacked_spec(layers, blocks, a.shape[4], shared=pages is not None)
                 for a in arrays]
    o, m, l = decode_call(
        kernel, args, in_specs, batch=batch, heads=heads, splits=splits, rows=rows,
        head_dim=head_dim, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        name="rice_decode_attention", scratch=jax.ShapeDtypeStruct((2 * block_s, head_dim),
                                                                    jnp.int32))
    return o, m, l
