"""What every decode kernel of :mod:`pallas_kernels` shares: the flash-decoding loop over
one slice of the cache, the matmul helpers, and the grid's blocking.

A kernel's grid is ``(B, K, query blocks * splits)``: one program per (row, kv head,
block of query rows, slice of the cache) holds the query rows of its kv head (a decode's
*all* of them, GQA: every code byte is read once; a prefill chunk's ``G * T`` rows in
blocks of :data:`BLOCK_ROWS`), walks its slice in blocks of ``block_s`` tokens with an
online softmax (:func:`split_softmax`) and writes a partial ``(o, m, l)``
(:mod:`pallas_kernels.partial`). Every query row sees its own count of the coded tokens
(the entries' ``lengths [B]``, or ``[B, G]`` per row: a causal chunk's rows see the
tokens before them), so one loop serves decodes and chunks alike, reading the codes in
place tile by tile: nothing is ever decoded to memory. The token addresses a program
loads are computed in one place (:func:`split_softmax`'s tile start, read by
:func:`_loader`): a row's own slots in a contiguous cache, or through the row's block
table in a paged one (``page_tokens``: the refs are then the pool, one row of every
page's tokens, :func:`stacked_spec` with ``shared``; the table rides in the layer
input, :func:`leading_inputs`). What differs between
kernels is only how a block's codes become logits and how the probabilities meet its
values: the two callbacks of :func:`split_softmax`. No value is ever sliced, gathered or
concatenated inside a kernel (the Triton lowering supports none of these): operands are
loaded in the slices they are used in.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.partial import NEG

#: the smallest matrix-instruction tile edge of the Triton lowering
MIN_DOT = 16
#: matmul operand type: codes (< 2**8) are exact in it, and its 10-bit mantissa keeps
#: the rounded query and probabilities within ~5e-4 relative (bfloat16: ~4e-3) at the
#: same tensor-core speed; accumulation is float32
OPERAND = jnp.float16
#: multiprocessors of an H200, and the warps of a decode kernel one holds at once (the
#: INT kernel's ~120 registers per thread allow 16, measured with Nsight Compute)
SMS = 132
WARPS_PER_SM = 16
#: warps per program: 2 measured fastest (docs/kernels.md)
NUM_WARPS = 2
#: wave occupancy good enough to stop adding splits at
GOOD_WAVES = 0.9
#: at most this many waves when looking for a split count that fills them
MAX_WAVES = 4


#: tokens per block and pipeline stages unless a kernel says otherwise
#: (:func:`default_blocking`)
BLOCK_S = 128
NUM_STAGES = 3
#: the library's ``(block_s, num_warps, num_stages)``, which a kernel may replace by its own
BLOCKING = (BLOCK_S, NUM_WARPS, NUM_STAGES)


def default_blocking(block_s: int | None, num_stages: int | None,
                     block: int = BLOCK_S) -> tuple[int, int]:
    """Tokens per block and pipeline stages: ``block`` (the kernel's own choice; 128,
    measured best on the H200 at one row and 128k tokens as at 32 rows and 32k tokens
    for the INT kernel, docs/kernels.md) and :data:`NUM_STAGES`."""
    return block_s or block, num_stages or NUM_STAGES


#: at most this many splits for a chunk's query blocks: each split holds a partial of
#: every row, so the partials' memory is this many times the chunk's output (a decode's
#: few rows may split more)
CHUNK_SPLITS = 4


def default_splits(batch: int, heads: int, slots: int, block_s: int,
                   num_warps: int = NUM_WARPS, most: int | None = None) -> int:
    """Splits of the cache length so the ``batch * heads * splits`` programs fill whole
    waves of the GPU: a last, partial wave runs at the speed of a full one (with 768
    programs, 1.45 waves, Nsight Compute estimated half the time lost to the tail). The
    fewest splits whose waves are at least ``GOOD_WAVES`` full, else the fullest; at
    most ``most``."""
    rows = batch * heads
    wave = SMS * WARPS_PER_SM // num_warps
    most = max(1, min(math.ceil(slots / block_s), MAX_WAVES * wave // rows,
                      most or slots))

    def fill(splits: int) -> float:
        programs = rows * splits
        return programs / (math.ceil(programs / wave) * wave)

    good = [s for s in range(1, most + 1) if fill(s) >= GOOD_WAVES]
    return good[0] if good else max(range(1, most + 1), key=fill)


def schedule(batch: int, heads: int, slots: int, *, block_s: int | None,
             num_stages: int | None, splits: int | None, num_warps: int,
             interpret: bool | None, block: int = BLOCK_S, group: int = 1
             ) -> tuple[int, int, int, bool]:
    """An entry's ``(block_s, num_stages, splits, interpret)``, each None replaced by the
    library's choice (:func:`default_blocking` with the kernel's ``block``,
    :func:`default_splits` counting the programs of ``group`` query rows per kv head,
    interpret mode off a GPU)."""
    block_s, num_stages = default_blocking(block_s, num_stages, block)
    blocks = -(-group // BLOCK_ROWS)
    splits = splits or default_splits(batch * blocks, heads, slots, block_s, num_warps,
                                      most=CHUNK_SPLITS if blocks > 1 else None)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return block_s, num_stages, splits, interpret


def check_query(kernel: str, q: jax.Array,
                unsupported: Callable[[int], str | None]) -> tuple[int, int, int]:
    """``(B, K, D)`` of an entry's query rows ``q [B, K, G, D]``: ``ValueError`` for
    another rank, ``NotImplementedError`` naming ``kernel`` where ``unsupported(D)``
    gives a reason."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, K, G, D], got shape {q.shape}")
    batch, heads, _, head_dim = q.shape
    reason = unsupported(head_dim)
    if reason is not None:
        raise NotImplementedError(f"{kernel}: {reason}")
    return batch, heads, head_dim


def check_stack(name: str, a: jax.Array, batch: int, heads: int, layer, width: int,
                what: str, axes: str = "S, W") -> None:
    """``ValueError`` unless ``a`` is ``[B, K, ..., width]`` stored per (row, kv head),
    ``[L, B, K, ...]`` when a layer is read: ``axes`` names its last two axes, ``what``
    says what ``width`` counts."""
    lead = 5 if layer is not None else 4
    if a.ndim != lead or a.shape[-4:-2] != (batch, heads) or a.shape[-1] != width:
        stack = f"[L, B, K, {axes}]" if layer is not None else f"[B, K, {axes}]"
        raise ValueError(f"{name} must be {stack} with B, K = {batch}, {heads} and "
                         f"{what}, got shape {a.shape}")


def layer_arrays(arrays, layer):
    """The arrays of layer ``layer`` of ``[L, ...]`` stacks (None entries pass through;
    ``layer`` None: the arrays as they are): what a reference reads."""
    if layer is None:
        return list(arrays)
    return [None if a is None else jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)
            for a in arrays]


#: query rows per program at most: a chunk's ``G * T`` rows are blocked into programs of
#: this many (a decode's ``G`` rows are one block)
BLOCK_ROWS = 64


def query_rows(group: int, width: int) -> int:
    """Rows of an entry's padded query for ``group`` real rows: a power of two, at least
    16 when its matmul operands are ``width >= 16`` columns wide (the smallest
    matrix-instruction tile), else just the next power of two (broadcast path); past
    :data:`BLOCK_ROWS`, whole blocks of it (:func:`row_block`)."""
    if group > BLOCK_ROWS:
        return -(-group // BLOCK_ROWS) * BLOCK_ROWS
    rows = max(MIN_DOT, group) if width >= MIN_DOT else group
    return 1 << (rows - 1).bit_length()


def row_block(rows: int) -> int:
    """Query rows per program for a padded query of ``rows`` rows (:func:`query_rows`)."""
    return min(rows, BLOCK_ROWS)


def pad_query_rows(q: jax.Array, width: int) -> jax.Array:
    """``q [B, K, G, D]`` zero-padded to :func:`query_rows` rows."""
    group = q.shape[2]
    return jnp.pad(q, ((0, 0), (0, 0), (0, query_rows(group, width) - group), (0, 0)))


def visible_slots(lengths: jax.Array, slots: int) -> jax.Array:
    """Which of ``slots`` coded tokens each query row sees: ``lengths [B]`` (every row of
    a batch row sees its first ``lengths[b]``) gives ``[B, S]``, per-row ``lengths [B,
    G]`` (a causal chunk's rows see different prefixes) ``[B, G, S]``."""
    return jnp.arange(slots)[(None,) * lengths.ndim] < lengths[..., None]


def check_pages(pages: jax.Array | None, page_tokens: int, batch: int, pool_tokens: int
                ) -> int:
    """The rows' token capacity of an entry's arrays: ``pool_tokens`` (each row's slots)
    without ``pages``, else ``pages [B, P]`` (int32 block tables into a pool of
    ``pool_tokens`` tokens in pages of ``page_tokens``) give ``P * page_tokens``.
    ``ValueError`` for malformed tables or a pool that is not whole pages."""
    if pages is None:
        if page_tokens:
            raise ValueError(f"page_tokens={page_tokens} without block tables (pages=)")
        return pool_tokens
    if (pages.ndim != 2 or pages.shape[0] != batch
            or not jnp.issubdtype(pages.dtype, jnp.integer)):
        raise ValueError(f"pages must be integer block tables [B, P] with B = {batch}, got "
                         f"{pages.shape} {pages.dtype.name}")
    if page_tokens < 1 or pool_tokens % page_tokens:
        raise ValueError(f"a pool of {pool_tokens} tokens is not whole pages of "
                         f"page_tokens={page_tokens}")
    return pages.shape[1] * page_tokens


def page_block(block_s: int, page_tokens: int) -> int:
    """The tile of a kernel reading pages of ``page_tokens``: its ``block_s`` halved
    until it divides a page (no tile straddles two pages); ``NotImplementedError``
    below :data:`MIN_DOT`."""
    if not page_tokens:
        return block_s
    while page_tokens % block_s and block_s > MIN_DOT:
        block_s //= 2
    if page_tokens % block_s:
        raise NotImplementedError(f"pages of {page_tokens} tokens: the kernel reads tiles "
                                  f"of a power of two >= {MIN_DOT} tokens that divides a "
                                  "page")
    return block_s


def paged_rows(arrays, pages: jax.Array | None, page_tokens: int, pool_tokens: int):
    """Each row's tokens of paged pool arrays, as a contiguous cache holds them: arrays
    ``[1, K, E, ...]`` of one layer (``E`` entries for ``pool_tokens`` tokens, one per
    token or one per group of tokens) become ``[B, K, P * page entries, ...]`` gathered
    through the block tables ``pages [B, P]`` (entries of a missing page read as the
    pool's first). Without ``pages`` the arrays pass through: what a reference reads."""
    if pages is None:
        return list(arrays)
    pages = jnp.maximum(pages.astype(jnp.int32), 0)
    out = []
    for a in arrays:
        if a is None:
            out.append(None)
            continue
        per = a.shape[2] * page_tokens // pool_tokens  # entries of one page
        index = (pages[:, :, None] * per + jnp.arange(per)[None, None, :]).reshape(
            pages.shape[0], -1)
        out.append(jnp.moveaxis(a[0][:, index], 1, 0))
    return out


def check_lengths(lengths: jax.Array, batch: int, group: int) -> None:
    """``ValueError`` unless ``lengths`` are integers ``[B]`` (tokens every query row of
    a batch row sees) or ``[B, G]`` (tokens each query row sees)."""
    if (lengths.shape not in ((batch,), (batch, group))
            or not jnp.issubdtype(lengths.dtype, jnp.integer)):
        raise ValueError(f"lengths must be integers of shape {(batch,)} or {(batch, group)} "
                         f"(per query row), got {lengths.shape} {lengths.dtype.name}")


def row_limits(lengths: jax.Array, rows: int) -> jax.Array:
    """``[B, rows]`` int32 token counts per padded query row from ``lengths [B]`` or
    ``[B, G]``: padding rows repeat the last real row's count, so that they widen no
    program's walk and mask no block that the real rows see whole."""
    lengths = lengths.astype(jnp.int32)
    if lengths.ndim == 1:
        return jnp.broadcast_to(lengths[:, None], (lengths.shape[0], rows))
    return jnp.pad(lengths, ((0, 0), (0, rows - lengths.shape[1])), mode="edge")


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [M, K] @ b[N, K]^T`` in float32 from float16 operands."""
    if min(a.shape[0], a.shape[1], b.shape[0]) >= MIN_DOT:
        return plgpu.dot(a, b, trans_b=True)
    return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None, :, :],
                   axis=-1)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [M, K] @ b[K, N]`` in float32 from float16 operands."""
    if min(a.shape[0], a.shape[1], b.shape[1]) >= MIN_DOT:
        return plgpu.dot(a, b)
    return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None, :, :],
                   axis=1)


#: ``load(ref, columns=None, per=1, rows=None, head=None)``: a block's tokens of a
#: ``[L, S]`` or ``[L, S, C]`` ref, masked rows read as 0; ``columns`` a ``pl.ds`` of the
#: columns, or an int vector whose entry ``c`` names the ref column that tile column ``c``
#: reads (a gather: one load per element, where a window loads a row's columns
#: together). ``per > 1``: the ref ``[L, S / per, C]`` holds one entry per ``per`` tokens
#: and the block (which must lie in one entry) reads its entry's columns, a vector
#: ``[C]`` (no mask: entries are whole); with ``rows`` (an int array shaped like the int
#: array ``columns``) it gathers entry ``rows`` after the block's first (clipped to the
#: ref), with ``entries`` (the same) entry ``entries`` of the ref, wherever the block
#: lies (a pool that the row's blocks share). ``head``: the ref has a head axis after
#: the layer (``[L, H, S, ...]``, a program serving ``H`` kv heads); an int reads that
#: head's tokens as above, an int vector ``[R]`` gathers a ``[R, block_s]`` tile of a
#: ``[L, H, S]`` ref, row ``r`` from head ``head[r]`` (per-token metadata laid out like
#: the query rows it scales)
Load = Callable[..., jax.Array]


def _loader(layer, tile, ok) -> Load:
    def load(ref, columns=None, per: int = 1, rows=None, head=None, entries=None):
        if getattr(head, "ndim", 0) == 1:
            shape = (head.shape[0], tile.size)
            index = (layer, jnp.broadcast_to(head[:, None], shape),
                     tile.start + jax.lax.broadcasted_iota(jnp.int32, shape, 1))
            if ok is None:
                return ref[index]
            return plgpu.load(ref.at[index], mask=jnp.broadcast_to(ok[None, :], shape),
                              other=0)
        # a Python int beside traced indices trips the masked load's discharge rule
        lead = (layer,) if head is None else (layer, jnp.int32(head))
        if per > 1:
            entry = tile.start // per
            if entries is not None:
                return ref[(*lead, jnp.clip(entries, 0, ref.shape[len(lead)] - 1), columns)]
            if rows is not None:
                return ref[(*lead, jnp.minimum(entry + rows, ref.shape[len(lead)] - 1),
                            columns)]
            return ref[(*lead, entry, slice(None) if columns is None else columns)]
        mask = None if ok is None else ok[:, None]
        if len(ref.shape) == len(lead) + 1:
            index, mask = (*lead, tile), ok
        elif isinstance(columns, jax.Array):
            shape = (tile.size, columns.shape[0])
            rows = tile.start + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
            index = (*lead, rows, jnp.broadcast_to(columns[None, :], shape))
            mask = None if ok is None else jnp.broadcast_to(mask, shape)
        else:
            index = (*lead, tile, slice(None) if columns is None else columns)
        if ok is None:
            return ref[index]
        return plgpu.load(ref.at[index], mask=mask, other=0)

    return load


def softmax_step(s: jax.Array, m_prev: jax.Array, l_prev: jax.Array, ok=None):
    """One block of an online softmax: logits ``s [rows, cols]`` (``ok``: the visible
    ones, a mask broadcasting to ``s``; the rest count as absent), the running maximum
    and sum ``[rows]`` before it. Returns ``(p, correction, m, l)``: the block's
    un-normalized probabilities, the factor that rescales the old accumulator to the new
    maximum, and the new maximum and sum."""
    if ok is not None:
        s = jnp.where(ok, s, NEG)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, None])
    if ok is not None:
        # a row that has seen nothing yet has m = NEG, where exp(s - m) is 1
        p = jnp.where(ok, p, 0.0)
    return p, correction, m_next, l_prev * correction + jnp.sum(p, axis=1)


def split_softmax(
    n_ref,
    layer_ref,
    *,
    rows: int,
    slots: int,
    block_s: int,
    split_len: int,
    splits: int,
    scores: Callable[[Load], jax.Array],
    accumulate: Callable[[Any, jax.Array, jax.Array, Load], Any],
    init: Any,
    page_tokens: int = 0,
) -> tuple[Any, jax.Array, jax.Array]:
    """The online softmax of one program over its slice of the coded tokens.

    ``n_ref [rows]`` counts the coded tokens each query row sees (the first ones: a
    decode's rows all see the row's every token, a causal chunk's row the tokens before
    its position), ``layer_ref[0]`` is the layer of the stacked refs to read; the grid's
    third axis enumerates (query block, slice) pairs, the slice ``pl.program_id(2) %
    splits`` of ``split_len`` tokens (a multiple of ``block_s``; ``slots`` the refs'
    token axis). Per block, ``scores(load)`` gives the logits ``[rows, block_s]``
    (sm_scale applied) and ``accumulate(acc, p, correction, load)`` the accumulator
    after the block, from the un-normalized probabilities ``p [rows, block_s]`` and the
    factor ``correction [rows]`` that rescales the old accumulator to the new maximum.
    Returns ``(acc, m, l)``; a slice with no token returns ``(init, NEG, 0)``. Blocks
    every row sees whole run without masks; the blocks some rows see only in part (the
    causal diagonal, the row's last partial block) with them, and load nothing past the
    last token any row sees.

    ``page_tokens``: 0 for refs holding each row's tokens at their positions; else the
    refs are a paged pool and ``layer_ref[1 + i]`` the pool page of the row's ``i``-th
    page of ``page_tokens`` tokens (a multiple of ``block_s``: no tile straddles pages).
    """
    limits = n_ref[...]
    layer = layer_ref[0]
    start = (pl.program_id(2) % splits) * split_len
    end = start + split_len
    stop = jnp.minimum(end, jnp.max(limits))
    # whole blocks from the slice's start that every row sees
    full = jnp.maximum(jnp.minimum(end, jnp.min(limits)) - start, 0) // block_s

    def body(i, carry, masked):
        acc, m_prev, l_prev = carry
        t0 = start + i * block_s
        ok, seen = None, None
        if masked:
            tokens = t0 + jnp.arange(block_s)
            ok = tokens < stop
            # the slice's tokens that each row sees (none past the slice: the next one's)
            seen = ok[None, :] & (tokens[None, :] < limits[:, None])
        first = t0
        if page_tokens:
            page = jnp.maximum(layer_ref[1 + t0 // page_tokens], 0)
            first = page * page_tokens + t0 % page_tokens
        load = _loader(layer, pl.ds(first, block_s), ok)
        p, correction, m_next, l_next = softmax_step(scores(load), m_prev, l_prev, seen)
        return accumulate(acc, p, correction, load), m_next, l_next

    carry = (init, jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    # a cache shorter than one block has no whole block (and no unmasked tile shape)
    if slots >= block_s:
        carry = jax.lax.fori_loop(0, full, functools.partial(body, masked=False), carry)
    else:
        full = jnp.zeros_like(full)
    tail = jnp.maximum(pl.cdiv(stop - start, block_s), full)
    return jax.lax.fori_loop(full, tail, functools.partial(body, masked=True), carry)


def split_len(slots: int, splits: int, block_s: int) -> int:
    """Tokens per slice: ``slots / splits`` rounded up to whole blocks."""
    return pl.cdiv(pl.cdiv(slots, splits), block_s) * block_s


def stacked_spec(layers: int, slots: int, *trailing: int, heads: int | None = None,
                 shared: bool = False) -> pl.BlockSpec:
    """The block of one (row, kv head) of a ``[L, B, K, S, *trailing]`` stack: every
    layer and token of it (the kernel indexes the layer and the tokens itself).
    ``heads``: the block of ``heads`` consecutive kv heads (program ``h`` of the grid's
    head axis reads heads ``h * heads ..``), with the head axis kept (``[L, heads, S,
    ...]``). ``shared``: the stack is a paged pool ``[L, 1, K, S, ...]`` that every row
    reads (through its block table)."""
    zeros = (0,) * len(trailing)
    if shared:
        return pl.BlockSpec((layers, None, None if heads is None else heads, slots,
                             *trailing), lambda b, h, j: (0, 0, h, 0, *zeros))
    return pl.BlockSpec((layers, None, None if heads is None else heads, slots, *trailing),
                        lambda b, h, j: (0, b, h, 0, *zeros))


def leading_inputs(n_comp: jax.Array, layer, q: jax.Array, splits: int,
                   pages: jax.Array | None = None):
    """``(args, in_specs)`` of every decode kernel's first three inputs: the token counts
    of each query row ``[B, R]`` (from ``n_comp [B]`` or per row ``[B, G]``:
    :func:`row_limits`), the layer index ``[1]`` and the query rows ``[B, K, R, D]``
    (float32), or ``[B, K / H, H, R, D]`` for programs that serve ``H`` kv heads
    (:func:`group_heads`). A program reads one block of :func:`row_block` rows: block
    ``j // splits`` of the grid's third axis (:func:`row_spec`). With a paged pool's
    block tables ``pages [B, P]`` the layer input is each row's ``[layer, *pages]``
    (padded to a power of two), which :func:`split_softmax` reads its pages from."""
    rows = q.shape[-2]
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    if pages is None:
        layer_spec = pl.BlockSpec((1,), lambda b, h, j: (0,))
    else:
        batch, count = pages.shape
        width = pl.next_power_of_2(count + 1)
        layer = jnp.concatenate([jnp.broadcast_to(layer, (batch, 1)),
                                 pages.astype(jnp.int32),
                                 jnp.zeros((batch, width - count - 1), jnp.int32)], axis=1)
        layer_spec = pl.BlockSpec((None, width), lambda b, h, j: (b, 0))
    args = [row_limits(n_comp, rows), layer, q.astype(jnp.float32)]
    block = row_block(rows)
    specs = [pl.BlockSpec((None, block), lambda b, h, j: (b, j // splits)),
             layer_spec,
             row_spec(q.shape[2:], splits)]
    return args, specs


def row_spec(inner: tuple[int, ...], splits: int) -> pl.BlockSpec:
    """The block of a ``[B, K, ..., R, C]`` per-query-row input (``inner`` its shape past
    ``B, K``) that program ``(b, h, j)`` reads: query block ``j // splits`` of
    :func:`row_block` rows."""
    block = (*inner[:-2], row_block(inner[-2]), inner[-1])
    zeros = (0,) * (len(inner) - 2)
    return pl.BlockSpec((None, None, *block), lambda b, h, j: (b, h, *zeros, j // splits, 0))


def group_heads(q: jax.Array, heads: int, rows: int) -> jax.Array:
    """``q [B, K, G, D]`` as the query block of programs that serve ``heads`` kv heads
    each: ``[B, K / heads, heads, rows, D]``, where head ``h``'s slot holds its ``G``
    rows at rows ``h * G ..`` of the program's ``rows`` and zeros elsewhere. Summed over
    the slots the block is every head's rows stacked, so a matmul of slot ``h`` with
    head ``h``'s keys leaves each row's own scores and zeros for the others."""
    batch, kv_heads, group, head_dim = q.shape
    if kv_heads % heads or heads * group > rows:
        raise ValueError(f"{kv_heads} kv heads of {group} rows do not fill programs of "
                         f"{heads} heads and {rows} rows")
    q = q.reshape(batch, kv_heads // heads, heads, group, head_dim)
    return jnp.stack([jnp.pad(q[:, :, h], ((0, 0), (0, 0), (h * group, rows - (h + 1) * group),
                                           (0, 0)))
                      for h in range(heads)], axis=2)


def ungroup_rows(a: jax.Array, heads: int, group: int) -> jax.Array:
    """Per-program partials ``[B, K / heads, splits, rows, ...]`` as ``[B, K, splits,
    group, ...]``: each kv head's ``group`` rows out of its program's block."""
    batch, programs, splits, _, *rest = a.shape
    a = a[:, :, :, :heads * group].reshape(batch, programs, splits, heads, group, *rest)
    a = jnp.moveaxis(a, 3, 2)
    return a.reshape(batch, programs * heads, splits, group, *rest)


def decode_call(kernel, args, in_specs, *, batch: int, heads: int, splits: int, rows: int,
                head_dim: int, num_warps: int, num_stages: int, interpret: bool, name: str,
                scratch: jax.ShapeDtypeStruct | None = None):
    """The ``pallas_call`` of a decode kernel on the grid ``(B, K, query blocks *
    splits)`` (``rows`` padded query rows in blocks of :func:`row_block`); returns its
    per-split partials ``o [B, K, splits, R, D]``, ``m, l [B, K, splits, R]`` (float32).
    ``scratch``: a block of that shape per program, the kernel's last ref (an output in
    memory the program writes and reads back; discarded)."""
    block = row_block(rows)
    programs = rows // block * splits
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, programs, block, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, programs, block), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, programs, block), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, block, head_dim), lambda b, h, j: (b, h, j, 0, 0)),
        pl.BlockSpec((None, None, None, block), lambda b, h, j: (b, h, j, 0)),
        pl.BlockSpec((None, None, None, block), lambda b, h, j: (b, h, j, 0)),
    ]
    if scratch is not None:
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, programs, *scratch.shape),
                                              scratch.dtype))
        zeros = (0,) * len(scratch.shape)
        out_specs.append(pl.BlockSpec((None, None, None, *scratch.shape),
                                      lambda b, h, j: (b, h, j, *zeros)))
    out = pl.pallas_call(
        kernel,
        grid=(batch, heads, programs),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*args)
    return tuple(_rows_of_blocks(a, splits) for a in out[:3])


def _rows_of_blocks(a: jax.Array, splits: int) -> jax.Array:
    """``[B, K, blocks * splits, block, ...]`` partials as ``[B, K, splits, blocks *
    block, ...]``."""
    batch, heads, programs, block, *rest = a.shape
    a = a.reshape(batch, heads, programs // splits, splits, block, *rest)
    return jnp.moveaxis(a, 2, 3).reshape(batch, heads, splits, -1, *rest)
