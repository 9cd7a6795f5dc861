"""Pallas kernel: decode attention read straight from PolarQuant keys (full-depth polar
angles of the rotated unit vector) and group-wise INT values (flash-decoding,
:mod:`pallas_kernels.flash`).

A key is ``|k| R^T y`` and ``q . k = |k| (R q) . y``: the query is rotated once, before
the kernel. ``y`` is rebuilt from its angles by products only, never by a gather:
``y[2j] = r_j cos phi_j``, ``y[2j + 1] = r_j sin phi_j`` with ``phi_j`` the level-1 angle
of pair ``j`` and ``r_j`` the product, over its ancestors, of the cosine (left child) or
sine (right child) of each ancestor's angle.

The codes come in the column layout of :func:`kvjax.codecs.polarquant.column_layout`,
described to the kernel only by each angle's bit offset (:func:`plan` reads the layout
from them): the tree is cut into 16 columns, column ``c`` owning the subtree under node
``c`` of level ``log2 D - 4``. Every angle a column holds sits at the same bits of one
unit per column, so one ``[block, 16]`` tile of units gives, by a shift and a mask, the
codes of one tree position in all 16 columns; a level-``l`` tile ``p`` holds nodes
``c << (b - l) | p`` (``b = log2 D - 4``) and its two children tiles are ``2p`` and
``2p + 1``. Per block the kernel

* reads the angles above the columns (15 of them, or more where the columns hold fewer
  levels) as ``[block, 1]`` columns of their units, looks up their cosines and sines and
  multiplies them down the tree to the radii of the columns' top level; a chain of
  selects over the column index lays those out as ``[block, 16]`` tiles;
* walks the column-held levels down: per tile a register lookup (:func:`~pallas_kernels.
  units.table_plane`) reads the codes' cosines and sines straight from the tile of
  units, two products the children's radii; level 1 ends in ``2^b`` tiles of ``y``,
  tile ``t`` holding dims ``c * 2^b + t``;
* rounds those to float16 for one matmul each with the rotated query's matching columns
  and scales the block's dots by the stored norms.

Cosines and sines (:class:`Trig`): a level of up to 8 centroids is a table of its own,
read whole by the lookup. Level 1's codebook is uniform on ``[0, 2 pi)`` (``N``
centroids ``(k + 1/2) 2 pi / N``); at ``N = 16`` angle ``k + 8`` is angle ``k`` plus
``pi``, so the top bit of the code is the sign of the first half circle's cosine or
sine (the lookup's signed form), and at ``N = 32`` both are ``+-`` one of ``N / 4``
magnitudes, picked by the low bits (mirrored in odd quadrants) and signed by the two
quadrant bits. The lookups read bytes and 16-bit units: a column-held level in 32-bit
units is narrowed to 16 bits first (one conversion). The ``[block, 1]`` columns of the
angles above the columns, one 32-bit word per token each, stay chains of selects over
float32 tables: no lookup reads a word, and they are a sixteenth of a tile. The lookups'
tables are float16, converted to float32 for the products down the tree: each of ``y``'s
factors is off by at most its float16 rounding (half an ulp, ``2^-12`` below 1), and
the products themselves are float32 until the matmul operand.

Values are the shared group-wise INT side (:mod:`pallas_kernels.group_values`), and the
``pallas_call`` around this key side is that of every kernel over rotated keys
(:mod:`pallas_kernels.rotated`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import rotated
from pallas_kernels.flash import MIN_DOT, OPERAND, dot_nt
from pallas_kernels.units import run_ptx, table_plane, table_ptx, unit_view
from pallas_kernels.units import select_table as _select

#: columns of the layout, and the width of every tile the kernel multiplies
COLUMNS = MIN_DOT
#: unit widths (bits) the kernel reads codes in, and their views of the words
UNITS = {8: "bytes", 16: "halves", 32: "words"}


@dataclasses.dataclass(frozen=True)
class Read:
    """Where one code lies: bit ``shift`` of unit ``unit`` of the ``bits``-bit view of a
    token's words, ``width`` bits wide (0: not stored, the level's one centroid)."""

    bits: int
    unit: int
    shift: int
    width: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the kernel reads a layout: ``depth`` levels held in the columns, ``tiles[l -
    1][p]`` the read of tile ``p`` of level ``l <= depth`` (``unit`` the first of its 16
    units), ``top[l - depth - 1][i]`` the read of node ``i`` of level ``l > depth``."""

    head_dim: int
    depth: int
    tiles: tuple[tuple[Read, ...], ...]
    top: tuple[tuple[Read, ...], ...]

    @property
    def base(self) -> int:
        """``b = log2(D / 16)``: the level whose nodes are the columns."""
        return self.head_dim.bit_length() - COLUMNS.bit_length()

    @property
    def views(self) -> tuple[int, ...]:
        """The unit widths any read uses, ascending: one kernel input each."""
        reads = [r for level in self.tiles + self.top for r in level if r.width]
        return tuple(sorted({r.bits for r in reads}))


def level_widths(head_dim: int, angle_bits: int) -> list[int]:
    """Code bits per level, level 1 first: ``B + 1``, then ``B - 1``."""
    levels = head_dim.bit_length() - 1
    return [angle_bits + 1] + [angle_bits - 1] * (levels - 1)


def level_starts(head_dim: int) -> list[int]:
    """Index of each level's first angle in the offsets (level 1's ``D / 2`` first)."""
    levels = head_dim.bit_length() - 1
    return np.cumsum([0] + [head_dim >> level for level in range(1, levels)]).tolist()


def _column_read(offsets: list[int], width: int) -> Read | None:
    """The read of 16 codes (one per column) that sit at the same bits of 16 units."""
    first = offsets[0]
    for bits in UNITS:
        if (offsets == [first + c * bits for c in range(COLUMNS)]
                and first % bits + width <= bits):
            return Read(bits, first // bits, first % bits, width)
    return None


def _single_read(offset: int, width: int) -> Read | None:
    """The read of one code from the widest unit holding all of it: neighbouring codes
    share the unit's one column load."""
    for bits in reversed(UNITS):
        if offset // bits == (offset + width - 1) // bits:
            return Read(bits, offset // bits, offset % bits, width)
    return None


@functools.cache
def plan(head_dim: int, angle_bits: int, offsets: tuple[int, ...]) -> Plan | str:
    """The kernel's reads of a layout given by each angle's bit offset (level order,
    -1 where a level stores no bits), or why it cannot read it."""
    levels = head_dim.bit_length() - 1
    base = levels - COLUMNS.bit_length() + 1
    widths, starts = level_widths(head_dim, angle_bits), level_starts(head_dim)
    tiles = []
    for level in range(1, base + 1):
        width, reads = widths[level - 1], []
        for p in range(1 << (base - level)):
            nodes = [starts[level - 1] + (c << (base - level) | p) for c in range(COLUMNS)]
            read = Read(8, 0, 0, 0) if not width else _column_read(
                [offsets[n] for n in nodes], width)
            if read is None:
                break
            reads.append(read)
        if len(reads) < 1 << (base - level):
            break
        tiles.append(tuple(reads))
    if not tiles:
        return "the level-1 angles do not sit at the same bits of 16 units"
    depth = len(tiles)
    top = []
    for level in range(depth + 1, levels + 1):
        width, reads = widths[level - 1], []
        for i in range(head_dim >> level):
            read = Read(8, 0, 0, 0) if not width else _single_read(
                offsets[starts[level - 1] + i], width)
            if read is None:
                return f"a level-{level} angle straddles two words"
            reads.append(read)
        top.append(tuple(reads))
    return Plan(head_dim, depth, tuple(tiles), tuple(top))


def query_columns(head_dim: int) -> np.ndarray:
    """The dim of each kernel column of the query: tile ``t`` of ``y`` (columns ``16 t ..
    16 t + 15``) holds dims ``c * 2^b + t``."""
    tiles = head_dim // COLUMNS
    return np.arange(head_dim).reshape(COLUMNS, tiles).T.reshape(-1)


#: the unit dtypes the register lookups read, and their widths
LOOKUP_UNITS = {jnp.dtype(jnp.uint8): 8, jnp.dtype(jnp.uint16): 16}
#: the most entries a register lookup holds (:func:`~pallas_kernels.units.table_plane`)
LOOKUP_ENTRIES = 8


@dataclasses.dataclass(frozen=True)
class Trig:
    """Cosines and sines of a level's centroids as the kernel looks them up: tables
    ``cos``, ``sin`` indexed by the code (``fold`` 1), or, for a uniform level-1
    codebook of more entries than a register lookup holds, by the code folded onto the
    first half circle (``fold`` 2: angle ``k + N / 2`` is angle ``k`` plus ``pi``, the
    top bit a sign) or the first quadrant (``fold`` 4: ``N / 4`` cosines, mirrored in
    odd quadrants and signed by the two quadrant bits, the sines the same at ``k - N /
    4``)."""

    fold: int
    cos: tuple[float, ...]
    sin: tuple[float, ...]

    @classmethod
    def of(cls, level: int, centroids: tuple[float, ...]) -> Trig:
        """The tables of level ``level``'s centroids."""
        fold = 1
        if level == 1 and len(centroids) > LOOKUP_ENTRIES:
            fold = 2 if len(centroids) == 2 * LOOKUP_ENTRIES else 4
        first = centroids[:len(centroids) // fold]
        return cls(fold, tuple(math.cos(c) for c in first), tuple(math.sin(c) for c in first))

    @property
    def uniform(self) -> bool:
        """Whether the lookup assumes a uniform codebook (a folded one)."""
        return self.fold > 1

    def exact(self, codes: np.ndarray, quadrant: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(cos, sin)`` that the lookup gives the integer ``codes``, in float64 and
        before its float16 rounding: what :func:`uniform_error` checks. ``quadrant``:
        those of the quadrant form, which a half-circle fold takes in 32-bit units."""
        cos, sin = np.asarray(self.cos), np.asarray(self.sin)
        if self.fold == 1:
            return cos[codes], sin[codes]
        size = len(self.cos)
        if self.fold == 2 and not quadrant:
            sign = np.where(codes & size, -1.0, 1.0)
            return sign * cos[codes % size], sign * sin[codes % size]
        q = size * self.fold // 4
        low, h0, h1 = codes % q, codes // q & 1, codes // (2 * q) & 1
        rank = low ^ (h0 * (q - 1))
        return (np.where(h0 ^ h1, -1.0, 1.0) * cos[rank],
                np.where(h1, -1.0, 1.0) * cos[rank ^ (q - 1)])

    def __call__(self, tile: jax.Array | None, read: Read, asm: bool) -> tuple:
        """``(cos, sin)`` float32 of the centroids of the codes at ``read`` in every unit
        of ``tile`` (Python floats for a level that stores no bits: its one centroid).
        Tiles of bytes or 16-bit units use the register lookups (float16 tables, then
        float32 for the products down the tree); 32-bit units, which no lookup reads,
        chains of selects over float32 tables."""
        if not read.width:
            return self.cos[0], self.sin[0]
        lookup = jnp.dtype(tile.dtype) in LOOKUP_UNITS and len(self.cos) <= LOOKUP_ENTRIES
        if self.fold == 1:
            if lookup:
                return tuple(table_plane(tile, read.shift, read.width, t, asm)
                             .astype(jnp.float32) for t in (self.cos, self.sin))
            code = _field(tile, read)
            return _select(self.cos, code), _select(self.sin, code)
        if self.fold == 2 and lookup:
            return tuple(_signed(tile, read.shift, t, asm).astype(jnp.float32)
                         for t in (self.cos, self.sin))
        # 32 centroids, or 16 in 32-bit units: select chains over a quadrant are half as long
        q = len(self.cos) * self.fold // 4
        return _quadrant(_field(tile, read), self.cos[:q], lookup, asm)


def _quadrant(code: jax.Array, magnitudes: tuple[float, ...], lookup: bool,
              asm: bool) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` float32 of uniform codes ``k`` (4 quadrants of ``q`` centroids)
    from the first quadrant's ``q`` cosines: ``cos`` is ``+-magnitudes[m]``, ``m`` the
    low bits mirrored in odd quadrants, and ``sin`` the same at ``k - q``. ``lookup``:
    the mirrored ranks (a tile of the codes' dtype) through a register lookup."""
    q = len(magnitudes)
    low = code & jnp.asarray(q - 1, code.dtype)
    h0 = (code >> jnp.asarray(q.bit_length() - 1, code.dtype)) & jnp.asarray(1, code.dtype)
    h1 = (code >> jnp.asarray(q.bit_length(), code.dtype)) & jnp.asarray(1, code.dtype)
    rank = low ^ h0 * jnp.asarray(q - 1, code.dtype)
    mirrored = rank ^ jnp.asarray(q - 1, code.dtype)
    if lookup:
        width = max((q - 1).bit_length(), 1)
        cos, sin = (table_plane(r, 0, width, magnitudes, asm).astype(jnp.float32)
                    for r in (rank, mirrored))
    else:
        cos, sin = _select(magnitudes, rank), _select(magnitudes, mirrored)
    return jnp.where((h0 ^ h1) != 0, -cos, cos), jnp.where(h1 != 0, -sin, sin)


def _signed(tile: jax.Array, offset: int, table: tuple[float, ...], asm: bool) -> jax.Array:
    """float16 ``(-1)^s table[m]`` of the 4-bit fields at bit ``offset`` of every unit of
    a tile of bytes or 16-bit units: ``m`` the low 3 bits, ``s`` the top one (an
    8-entry :func:`~pallas_kernels.units.table_ptx` with its sign bit)."""
    if asm:
        unit = LOOKUP_UNITS[jnp.dtype(tile.dtype)]
        return run_ptx(table_ptx(unit, offset, 3, table, sign=True), [tile])
    value = table_plane(tile, offset, 3, table, asm=False)
    negative = (tile >> jnp.asarray(offset + 3, tile.dtype)) & jnp.asarray(1, tile.dtype)
    return jnp.where(negative != 0, -value, value)


def trig_tables(centroids: tuple[tuple[float, ...], ...]) -> tuple[Trig, ...]:
    """:class:`Trig` of every level."""
    return tuple(Trig.of(level, c) for level, c in enumerate(centroids, start=1))


@functools.cache
def uniform_error(centroids: tuple[float, ...]) -> float:
    """Largest difference between the level-1 lookup's cosines and sines and those of
    the centroids themselves (0 where it reads them from tables; a folded lookup assumes
    uniform centroids)."""
    trig = Trig.of(1, centroids)
    c = np.asarray(centroids, np.float64)
    codes = np.arange(len(centroids))
    forms = [trig.exact(codes, quadrant) for quadrant in {False, trig.uniform}]
    return float(max(np.max(np.abs(v - want)) for cos, sin in forms
                     for v, want in ((cos, np.cos(c)), (sin, np.sin(c)))))


def _field(tile: jax.Array, read: Read) -> jax.Array:
    """Bits ``shift .. shift + width`` of every unit of a tile."""
    shifted = tile >> jnp.asarray(read.shift, tile.dtype) if read.shift else tile
    return shifted & jnp.asarray((1 << read.width) - 1, tile.dtype)


def unit_vectors(plan_: Plan, trig: tuple[Trig, ...], load, refs: dict,
                 asm: bool = False) -> list[jax.Array]:
    """The ``2^b`` float32 tiles ``[block, 16]`` of a block's unit vectors ``y`` (see the
    module docstring); ``refs[bits]`` is the ref of the ``bits``-bit view. ``asm``: the
    register lookups' inline PTX (compiled only)."""
    base, depth = plan_.base, plan_.depth
    tiles_of, columns_of = {}, {}

    def tile(read):
        # one [block, 16] load per region, whatever number of fields it holds
        key = (read.bits, read.unit)
        if key not in tiles_of:
            tiles_of[key] = load(refs[read.bits], pl.ds(read.unit, COLUMNS))
        return tiles_of[key]

    def column(read):
        key = (read.bits, read.unit)
        if key not in columns_of:
            columns_of[key] = load(refs[read.bits], pl.ds(read.unit, 1))
        return columns_of[key]

    # above the columns: [block, 1] radii, multiplied down from the top angle's radius 1
    radii = [1.0]
    for level in range(len(plan_.top) + depth, depth, -1):
        reads, down = plan_.top[level - depth - 1], []
        for i, read in enumerate(reads):
            cos, sin = trig[level - 1](column(read) if read.width else None, read, asm)
            down += [radii[i] * cos, radii[i] * sin]
        radii = down
    # the columns' top level as tiles: node c << (base - depth) | p in column c of tile p
    index = jax.lax.broadcasted_iota(jnp.int32, (1, COLUMNS), 1)
    rows = next(iter(columns_of.values())).shape[0] if columns_of else None
    tiles = []
    for p in range(1 << (base - depth)):
        nodes = [radii[c << (base - depth) | p] for c in range(COLUMNS)]
        out = jnp.broadcast_to(jnp.asarray(nodes[0], jnp.float32), (rows or 1, COLUMNS))
        for c in range(1, COLUMNS):
            out = jnp.where(index == c, nodes[c], out)
        tiles.append(out)
    # down the column-held levels: tile p's codes split its radii into tiles 2p and 2p + 1
    for level in range(depth, 0, -1):
        down = []
        for p, read in enumerate(plan_.tiles[level - 1]):
            codes = tile(read) if read.width else None
            if codes is not None and codes.dtype == jnp.uint32:
                # no lookup reads 32-bit units: the field alone, narrowed to 16 bits
                codes = _field(codes, read).astype(jnp.uint16)
                read = Read(16, read.unit, 0, read.width)
            cos, sin = trig[level - 1](codes, read, asm)
            down += [tiles[p] * cos, tiles[p] * sin]
        tiles = down
    return tiles


def _scores(refs: rotated.KernelRefs, *, plan_, trig, sm_scale, asm):
    head_dim = refs.q.shape[1]
    key_refs = dict(zip(plan_.views, refs.keys, strict=True))
    q_tiles = [refs.q[:, pl.ds(t * COLUMNS, COLUMNS)].astype(OPERAND)
               for t in range(head_dim // COLUMNS)]

    def scores(load):
        y = unit_vectors(plan_, trig, load, key_refs, asm)
        dots = sum(dot_nt(q, t.astype(OPERAND)) for q, t in zip(q_tiles, y, strict=True))
        return dots * (sm_scale * load(refs.norm).astype(jnp.float32))[None, :]

    return scores


def key_view(codes: jax.Array, bits: int) -> jax.Array:
    """The ``bits``-bit units of ``uint32`` words (the words themselves at 32)."""
    return codes if bits == 32 else unit_view(codes, UNITS[bits])


#: ``(block_s, num_warps, num_stages)`` of a decode: 1.39 ms against 1.52-1.56 for the
#: library's 128:2:3 at B = 32, S = 32k (polarquant:b3, H100, docs/kernels.md)
BLOCKING = (32, 2, 3)


def reader(head_dim: int, angle_bits: int, centroids: tuple[tuple[float, ...], ...],
           offsets: tuple[int, ...]) -> rotated.KeyReader:
    """How the kernel reads the angle codes of a layout it can read (:func:`plan`): one
    view of the words per unit width its reads use, the rotated query's columns in
    :func:`query_columns` order."""
    plan_ = plan(head_dim, angle_bits, offsets)
    return rotated.KeyReader(
        name="polar_decode_attention", size=angle_bits * head_dim // 32, dtype=jnp.uint32,
        width=COLUMNS, columns=query_columns(head_dim),
        views=lambda codes: [key_view(codes, bits) for bits in plan_.views],
        scores=functools.partial(_scores, plan_=plan_, trig=trig_tables(centroids)),
        blocking=BLOCKING)
