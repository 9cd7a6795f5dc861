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
* walks the column-held levels down: per tile a shift and a mask give the codes, a
  select chain their cosines and sines, two products the children's radii; level 1 ends
  in ``2^b`` tiles of ``y``, tile ``t`` holding dims ``c * 2^b + t``;
* rounds those to float16 for one matmul each with the rotated query's matching columns
  and scales the block's dots by the stored norms.

Cosines and sines: level 1's codebook is uniform on ``[0, 2 pi)`` (``N`` centroids
``(k + 1/2) 2 pi / N``), so both are ``+-`` one of ``N / 4`` magnitudes, picked by the low
bits (mirrored in odd quadrants) and signed by the two quadrant bits; a deeper level's
``2^(B-1)`` cosines and sines are tables of their own. All of it is float32 until the
matmul operand: ``y`` is as exact as the float16 rounding of its entries.

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
from pallas_kernels.units import select_table as _select
from pallas_kernels.units import unit_view

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


@dataclasses.dataclass(frozen=True)
class Trig:
    """Cosines and sines of a level's centroids as the kernel looks them up: at level 1
    (``uniform``) ``magnitudes[m] = cos(centroid m)`` for the first quadrant's ``N / 4``
    centroids; deeper, the tables ``cos`` and ``sin`` of every centroid."""

    uniform: bool
    magnitudes: tuple[float, ...] = ()
    cos: tuple[float, ...] = ()
    sin: tuple[float, ...] = ()

    @classmethod
    def of(cls, level: int, centroids: tuple[float, ...]) -> Trig:
        """The tables of level ``level``'s centroids."""
        if level == 1:
            quarter = max(len(centroids) // 4, 1)
            return cls(True, magnitudes=tuple(math.cos(c) for c in centroids[:quarter]))
        return cls(False, cos=tuple(math.cos(c) for c in centroids),
                   sin=tuple(math.sin(c) for c in centroids))

    def __call__(self, code: jax.Array | None) -> tuple:
        """``(cos, sin)`` of the centroids of a tile of codes, float32 (Python floats for
        a level that stores no bits: its one centroid)."""
        if code is None:
            return self.cos[0], self.sin[0]
        if not self.uniform:
            return _select(self.cos, code), _select(self.sin, code)
        # code k = 4 quadrants of q = N/4: cos is +-magnitudes[m], sin the same at k - q
        q = len(self.magnitudes)
        low = code & jnp.asarray(q - 1, code.dtype)
        h0 = (code >> jnp.asarray(q.bit_length() - 1, code.dtype)) & jnp.asarray(1, code.dtype)
        h1 = (code >> jnp.asarray(q.bit_length(), code.dtype)) & jnp.asarray(1, code.dtype)
        mirror = h0 * jnp.asarray(q - 1, code.dtype)
        cos = _select(self.magnitudes, low ^ mirror)
        sin = _select(self.magnitudes, low ^ mirror ^ jnp.asarray(q - 1, code.dtype))
        return jnp.where((h0 ^ h1) != 0, -cos, cos), jnp.where(h1 != 0, -sin, sin)


def trig_tables(centroids: tuple[tuple[float, ...], ...]) -> tuple[Trig, ...]:
    """:class:`Trig` of every level."""
    return tuple(Trig.of(level, c) for level, c in enumerate(centroids, start=1))


@functools.cache
def uniform_error(centroids: tuple[float, ...]) -> float:
    """Largest difference between the level-1 lookup's cosines and sines and those of
    the centroids themselves (the lookup assumes uniform centroids)."""
    trig = Trig.of(1, centroids)
    with jax.ensure_compile_time_eval():  # concrete numbers, even while tracing
        cos, sin = trig(jnp.arange(len(centroids), dtype=jnp.uint32))
        cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    c = np.asarray(centroids, np.float64)
    return float(max(np.max(np.abs(cos - np.cos(c))), np.max(np.abs(sin - np.sin(c)))))


def _field(tile: jax.Array, read: Read) -> jax.Array:
    """Bits ``shift .. shift + width`` of every unit of a tile."""
    shifted = tile >> jnp.asarray(read.shift, tile.dtype) if read.shift else tile
    return shifted & jnp.asarray((1 << read.width) - 1, tile.dtype)


def unit_vectors(plan_: Plan, trig: tuple[Trig, ...], load, refs: dict) -> list[jax.Array]:
    """The ``2^b`` float32 tiles ``[block, 16]`` of a block's unit vectors ``y`` (see the
    module docstring); ``refs[bits]`` is the ref of the ``bits``-bit view."""
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
            cos, sin = trig[level - 1](_field(column(read), read) if read.width else None)
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
            cos, sin = trig[level - 1](_field(tile(read), read) if read.width else None)
            down += [tiles[p] * cos, tiles[p] * sin]
        tiles = down
    return tiles


def _scores(refs: rotated.KernelRefs, *, plan_, trig, sm_scale, asm):
    del asm  # every lookup of this key side is a chain of selects, no inline PTX
    head_dim = refs.q.shape[1]
    key_refs = dict(zip(plan_.views, refs.keys, strict=True))
    q_tiles = [refs.q[:, pl.ds(t * COLUMNS, COLUMNS)].astype(OPERAND)
               for t in range(head_dim // COLUMNS)]

    def scores(load):
        y = unit_vectors(plan_, trig, load, key_refs)
        dots = sum(dot_nt(q, t.astype(OPERAND)) for q, t in zip(q_tiles, y, strict=True))
        return dots * (sm_scale * load(refs.norm).astype(jnp.float32))[None, :]

    return scores


def key_view(codes: jax.Array, bits: int) -> jax.Array:
    """The ``bits``-bit units of ``uint32`` words (the words themselves at 32)."""
    return codes if bits == 32 else unit_view(codes, UNITS[bits])


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
        scores=functools.partial(_scores, plan_=plan_, trig=trig_tables(centroids)))
