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

* splits the ``[block, P]`` bytes into the two nibbles, looks the magnitudes ``|xi|``,
  ``|eta|`` up by select chains over the 8 magnitudes, and lifts them to the octahedron:
  ``z = 1 - |xi| - |eta|``, and where ``z < 0`` the fold ``|x| = 1 - |eta|, |y| = 1 -
  |xi|``; the sign bits sign ``x`` and ``y`` (``z`` is unsigned);
* scales by ``rho / |(x, y, z)|`` (one ``rsqrt``, the norm level by a select chain over
  the merged norm codes);
* rounds ``x, y, z`` to float16 for one matmul each with the query's columns.

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
from pallas_kernels.units import select_table as _select

#: the coordinates' sign-magnitude codes: a nibble, the top bit the sign
NIBBLE, SIGN, RANK = 4, 8, 7


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


def _scores(refs: rotated.KernelRefs, *, plan, magnitudes, norms, sm_scale, asm):
    (codes_ref,) = refs.keys
    width = plan.width
    norm_bits = (len(norms) - 1).bit_length()
    q_slots = [[refs.q[:, pl.ds((3 * w + k) * width, width)].astype(OPERAND)
                for k in range(3)] for w in range(len(plan.windows))]
    logits = rotated.logits(refs, sm_scale=sm_scale, asm=asm)
    column = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)

    def coordinate(code):
        # magnitude by its rank, sign by the top bit
        magnitude = _select(magnitudes, code & jnp.asarray(RANK, code.dtype))
        negative = (code & jnp.asarray(SIGN, code.dtype)) != 0
        return magnitude, negative

    def norm_level(window, norm_tiles):
        if not norm_bits:
            return norms[0]
        mask = jnp.asarray((1 << norm_bits) - 1, jnp.uint8)
        code = None
        for lo, hi, start, slot in window.runs:
            run = (norm_tiles[start] >> jnp.asarray(norm_bits * slot, jnp.uint8)) & mask
            # columns outside every run hold no triplet: the first run's codes serve
            code = run if code is None else jnp.where((column >= lo) & (column <= hi), run,
                                                      code)
        return _select(norms, code)

    def scores(load):
        # the norm windows are loaded once per block, whichever direction windows read them
        norm_tiles = {start: load(codes_ref, pl.ds(start, width)) for start in plan.norm_loads}
        dots = 0.0
        for w, window in enumerate(plan.windows):
            byte = load(codes_ref, pl.ds(window.start, width))
            a, a_neg = coordinate(byte & jnp.asarray(2 * SIGN - 1, byte.dtype))
            b, b_neg = coordinate(byte >> jnp.asarray(NIBBLE, byte.dtype))
            z = 1.0 - a - b
            folded = z < 0
            x = jnp.where(folded, 1.0 - b, a)
            y = jnp.where(folded, 1.0 - a, b)
            scale = norm_level(window, norm_tiles) * jax.lax.rsqrt(x * x + y * y + z * z)
            parts = (jnp.where(a_neg, -x, x), jnp.where(b_neg, -y, y), z)
            dots = dots + sum(dot_nt(q_slots[w][k], (part * scale).astype(OPERAND))
                              for k, part in enumerate(parts))
        return logits(dots, load)

    return scores


def reader(head_dim: int, layout, magnitudes: tuple[float, ...],
           norms: tuple[float, ...]) -> rotated.KeyReader:
    """How the kernel reads key bytes in ``layout`` (:func:`plan`): the bytes as they
    are, the rotated query's columns laid out by :func:`query_columns`."""
    return rotated.KeyReader(
        name="octopus_decode_attention", size=layout.size, dtype=jnp.uint8,
        width=layout.width, columns=query_columns(layout, head_dim),
        views=lambda codes: (codes,),
        scores=functools.partial(_scores, plan=plan(layout), magnitudes=magnitudes,
                                 norms=norms))
