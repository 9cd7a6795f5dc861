"""Pallas kernel: decode attention read straight from rotated OCTOPUS keys and group-wise
INT values (flash-decoding, :mod:`pallas_kernels.flash`).

A key is ``|k| R^T y`` and ``q . k = |k| (R q) . y``: the query is rotated once, before
the kernel. ``y`` is cut into triplets ``t = rho m(xi, eta)``, so ``(R q) . y`` is a sum
over triplets of ``rho (q_x m_x + q_y m_y + q_z m_z)``: three matmuls per window of
triplets, with the rotated query's x, y and z columns of those triplets laid out once per
call (:func:`query_columns`; a column without a triplet, or the pad dim ``D`` of the last
triplet, is zero in the query, so whatever its codes decode to adds nothing).

The codes are in the byte layout of :func:`kvjax.codecs.octopus.byte_layout`, which the
kernel reads as ``P``-byte windows (``P`` a power of two, 16 where the head dim allows):
a direction window's byte in column ``c`` holds the sign-magnitude codes of one
triplet's ``xi`` (low nibble) and ``eta``, and every triplet's norm code lies in the same
column ``c`` of some window of the norm bytes, in one of its ``8 / n`` slots.
:func:`plan` turns the layout into loads: per direction window, runs of columns whose
norm codes come from one (window start, slot), merged by selects on the column index.
Per block and direction window the kernel

* looks both nibbles up signed, by register lookups (:func:`~pallas_kernels.units.
  codebook_plane`: the float16 magnitudes picked by ``prmt``, the sign bit moved onto
  float16's), and lifts them to the octahedron without a select on ``z``
  (:func:`directions`): ``z = 1 - |xi| - |eta|``, ``x = xi + sign(xi) min(z, 0)``
  (the sign by a bit operation), ``y`` alike;
* scales by ``rho / |(x, y, z)|`` (one ``rsqrt``; the norm level by a register lookup
  of the merged norm codes, :func:`norm_levels`);
* rounds ``x, y, z`` to float16 for one matmul each with the query's columns.

The lookups give float16 table values, widened to float32 for the lift and the scale:
the magnitudes and norm levels are rounded to float16 (relative error at most 2^-11)
before anything else, which moves a unit direction's coordinates by at most 5.5e-4
(over all 256 bytes) and the outputs by about 1e-4 more than the matmul operands' own
rounding, well inside the tests' tolerance. ``asm`` (compiled): the lookups' PTX;
interpret mode runs their jnp forms, the same float16 values.

Operations per triplet and token before the matmuls (jnp operations; the lookups at
:func:`~pallas_kernels.units.table_ptx`'s PTX instructions per element; a select chain
takes two per entry after the first):

* the coordinates: 5 (two signed lookups of 2.5) and 2 to widen, where the chains took
  36 (per nibble a shift or mask, the rank's mask, 14 for the chain, a sign test);
* the lift: 9 (two subtractions, a ``min``, per coordinate a mask, an xor and an add;
  ``abs`` folds into the subtractions and mask and xor into one ``lop3`` on the GPU),
  where it took 7 and 4 more to sign ``x, y``;
* the norm level, ``r`` runs in the window: a shift per run off the common slot, ``r -
  1`` selects, the lookup (1.25 to 2; 16 levels: two, a bit test and a select) and 1 to
  widen, where the runs took a mask each (and a shift off slot 0), ``r - 1`` selects
  and the chain: 2, 6 or 30 for 2, 4 or 16 levels;
* the scale and the operands: 13, unchanged (squares, ``rsqrt``, ``rho`` times it, three
  products, three roundings).

At D = 128, averaged over the windows: 29 (no norm codes), 36 (2 levels), 33 (4
levels: ``octopus:b3``, ``b4,qjl``), 37 (16), where the chains took 60, 71, 71, 92.

The block's dots are scaled by the stored norms. With QJL the residual's sign bits add
``sqrt(pi / 2) / D |r| <G q, sign(G r)>`` as in every kernel over rotated keys
(:func:`pallas_kernels.rotated.logits`). A lifted point is never 0 (``|x| + |y| + z
>= 1`` on the octahedron), so every byte, the garbage of a column without a triplet
included, decodes to finite numbers.

Values are the shared group-wise INT side (:mod:`pallas_kernels.group_values`), and the
``pallas_call`` around this key side is that of every kernel over rotated keys
(:mod:`pallas_kernels.rotated`). Operands of the dots are float16, accumulation float32;
the reference is exact float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import rotated
from pallas_kernels.flash import OPERAND, dot_nt
from pallas_kernels.units import codebook_plane, table_plane

#: the coordinates' sign-magnitude codes: a nibble, the top bit the sign
NIBBLE, SIGN, RANK = 4, 8, 7
#: float32's sign bit
F32_SIGN = 0x80000000
#: the most norm levels one register lookup holds, and its field's width; 16 levels are
#: two such lookups
LOOKUP, LOOKUP_BITS = 8, 3


@dataclasses.dataclass(frozen=True)
class Window:
    """One direction window: its first byte, and ``runs`` of columns ``(lo, hi, start,
    slot)``: columns ``lo..hi`` take their norm codes from slot ``slot`` of the norm
    window at byte ``start``."""

    start: int
    runs: tuple[tuple[int, int, int, int], ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The loads of one block: ``width``-byte direction ``windows`` and the distinct
    norm window starts ``norm_loads``."""

    width: int
    windows: tuple[Window, ...]
    norm_loads: tuple[int, ...]


@functools.cache
def plan(layout) -> Plan:
    """The loads that read a :class:`kvjax.codecs.octopus.ByteLayout`."""
    windows = []
    for start, column, first, count in layout.windows:
        runs: list[list[int]] = []
        for j in range(count if layout.norm else 0):
            byte, slot = layout.norm[first + j]
            c = column + j
            source = (byte - c, slot)
            if runs and tuple(runs[-1][2:]) == source and runs[-1][1] == c - 1:
                runs[-1][1] = c
            else:
                runs.append([c, c, *source])
        windows.append(Window(start, tuple(tuple(r) for r in runs)))
    loads = sorted({r[2] for w in windows for r in w.runs})
    return Plan(layout.width, tuple(windows), tuple(loads))


def query_columns(layout, head_dim: int) -> np.ndarray:
    """The dim of the rotated query in each of the kernel's query columns (``head_dim``
    where the column is zero): per direction window, ``width`` columns each of the
    triplets' x, y and z dims, in the window's columns."""
    width = layout.width
    out = []
    for _, column, first, count in layout.windows:
        for k in range(3):
            cols = np.full(width, head_dim)
            dims = 3 * np.arange(first, first + count) + k
            cols[column:column + count] = np.where(dims < head_dim, dims, head_dim)
            out.append(cols)
    return np.concatenate(out)


def directions(byte: jax.Array, magnitudes: tuple[float, ...],
               asm: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The lifted, unnormalized ``x, y, z`` (float32) of a tile of direction bytes: each
    nibble's sign-magnitude code looked up signed (:func:`~pallas_kernels.units.
    codebook_plane`, float16 magnitudes), then the octahedral lift.

    The fold needs no select on ``z``: where ``z = 1 - |xi| - |eta| < 0``, ``|x| = 1 -
    |eta| = |xi| + z`` with ``xi``'s sign, so ``x = xi + sign(xi) min(z, 0)`` (and ``y``
    alike), which is ``xi`` itself where ``z >= 0``. ``asm``: the lookups' PTX.
    """
    xi = codebook_plane(byte, 0, NIBBLE, magnitudes, asm).astype(jnp.float32)
    eta = codebook_plane(byte, 1, NIBBLE, magnitudes, asm).astype(jnp.float32)
    z = 1.0 - jnp.abs(xi) - jnp.abs(eta)
    fold = jnp.minimum(z, 0.0)
    return xi + _signed(fold, xi), eta + _signed(fold, eta), z


def _signed(value: jax.Array, sign: jax.Array) -> jax.Array:
    """``value`` negated where ``sign``'s sign bit is set: one ``lop3`` on the float32
    bits, where a compare and a select take two."""
    bits = jax.lax.bitcast_convert_type(sign, jnp.uint32) & jnp.asarray(F32_SIGN, jnp.uint32)
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(value, jnp.uint32) ^ bits, jnp.float32)


def _aligned_slot(runs) -> int:
    """The slot the merged norm codes of a window are read at: the one most runs hold
    already (the lowest of a tie: a lookup at bit 0 saves its own shift), so only the
    others are shifted."""
    slots = [slot for *_, slot in runs]
    return min(set(slots), key=lambda s: (-slots.count(s), s))


def norm_levels(window: Window, norm_tiles: dict, norms: tuple[float, ...],
                column: jax.Array, asm: bool) -> jax.Array | float:
    """The norm level (float32) of each triplet of a direction window, from the norm
    windows ``norm_tiles`` (uint8, by start) its runs read; ``column`` the iota of the
    window's columns. One norm level: a constant.

    The runs' bytes are merged first (each shifted to one common slot, then selected by
    column: the column masks do not depend on the block), so one register lookup
    (:func:`~pallas_kernels.units.table_plane`) reads every column's code; 16 levels
    take two lookups of 8 and a select on the code's top bit. Columns outside every run
    hold no triplet and read the first run's bytes.
    """
    if len(norms) == 1:
        return norms[0]
    bits = (len(norms) - 1).bit_length()
    target = _aligned_slot(window.runs)
    merged = None
    for lo, hi, start, slot in window.runs:
        tile = norm_tiles[start]
        shift = bits * (slot - target)
        if shift > 0:
            tile = tile >> jnp.asarray(shift, tile.dtype)
        elif shift < 0:
            # bits shifted past the byte are masked off by the lookup anyway
            tile = tile << jnp.asarray(-shift, tile.dtype)
        merged = tile if merged is None else jnp.where((column >= lo) & (column <= hi),
                                                       tile, merged)
    offset = bits * target
    if len(norms) <= LOOKUP:
        level = table_plane(merged, offset, bits, norms, asm)
    else:
        low = table_plane(merged, offset, LOOKUP_BITS, norms[:LOOKUP], asm)
        high = table_plane(merged, offset, LOOKUP_BITS, norms[LOOKUP:], asm)
        top = (merged & jnp.asarray(LOOKUP << offset, merged.dtype)) != 0
        level = jnp.where(top, high, low)
    return level.astype(jnp.float32)


def _scores(refs: rotated.KernelRefs, *, plan, magnitudes, norms, sm_scale, asm):
    (codes_ref,) = refs.keys
    width = plan.width
    q_slots = [[refs.q[:, pl.ds((3 * w + k) * width, width)].astype(OPERAND)
                for k in range(3)] for w in range(len(plan.windows))]
    logits = rotated.logits(refs, sm_scale=sm_scale, asm=asm)
    column = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)

    def scores(load):
        # the norm windows are loaded once per block, whichever direction windows read them
        norm_tiles = {start: load(codes_ref, pl.ds(start, width)) for start in plan.norm_loads}
        dots = 0.0
        for w, window in enumerate(plan.windows):
            byte = load(codes_ref, pl.ds(window.start, width))
            x, y, z = directions(byte, magnitudes, asm)
            rho = norm_levels(window, norm_tiles, norms, column, asm)
            scale = rho * jax.lax.rsqrt(x * x + y * y + z * z)
            dots = dots + sum(dot_nt(q_slots[w][k], (part * scale).astype(OPERAND))
                              for k, part in enumerate((x, y, z)))
        return logits(dots, load)

    return scores


#: ``(block_s, num_warps, num_stages)`` of a decode: 1.59 ms against 1.69-1.72 for the
#: library's 128:2:3 at B = 32, S = 32k, 0.31 against 0.35 at B = 1, S = 128k
#: (octopus:b3, H100, docs/kernels.md; three stages at 32 tokens took 2.0 ms)
BLOCKING = (32, 2, 2)


def reader(head_dim: int, layout, magnitudes: tuple[float, ...],
           norms: tuple[float, ...]) -> rotated.KeyReader:
    """How the kernel reads key bytes in ``layout`` (:func:`plan`): the bytes as they
    are, the rotated query's columns laid out by :func:`query_columns`."""
    return rotated.KeyReader(
        name="octopus_decode_attention", size=layout.size, dtype=jnp.uint8,
        width=layout.width, columns=query_columns(layout, head_dim),
        views=lambda codes: (codes,),
        scores=functools.partial(_scores, plan=plan(layout), magnitudes=magnitudes,
                                 norms=norms),
        blocking=BLOCKING)
