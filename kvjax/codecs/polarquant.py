"""PolarQuant (Han, Kacham, Karbasi, Mirrokni, Zandieh 2025, arXiv 2502.02617),
``polarquant:bB[,lL]``: the rotated unit vector in recursive polar coordinates.

Not the method of Wu et al. (arXiv 2502.00527) that shares the name.

Transform. The rotated unit vector ``y`` (:mod:`kvjax.codecs.rotated`) is cut into pairs;
level 1 replaces each pair ``(y[2j], y[2j+1])`` by its radius and its angle
``atan2(y[2j+1], y[2j])`` in ``[0, 2 pi)``. Level ``l >= 2`` does the same to pairs of the
previous level's radii, whose angles lie in ``[0, pi/2]``. After ``L`` levels ``D / 2^L``
radii remain; at ``L = log2 D`` (the default) the one radius left is ``|y| = 1`` and the
vector is its ``D - 1`` angles alone.

Angle laws. For a Gaussian vector (and so, the angles being scale-free, for a uniform
point on the sphere, which the rotation makes of ``y``) the level-1 angles are uniform on
``[0, 2 pi)`` and a level-``l`` angle has density ``∝ sin(2 psi)^(2^(l-1) - 1)``
(:func:`kvjax.primitives.lloyd.polar_angle`, derived there), independent across angles. Each level
gets its own Lloyd-Max codebook for its law, data-free and kept on disk.

Bits. Han et al. spend more bits on the wide level-1 angles than on the concentrated
deeper ones: (4, 2, 2, 2) bits over ``L = 4`` levels. ``polarquant:bB`` keeps that shape
at a nominal ``B`` bits per coordinate: ``B + 1`` bits per level-1 angle and ``B - 1`` per
deeper angle, so with the default ``L = log2 D`` a vector costs ``(D/2)(B+1) +
(D/2 - 1)(B-1) = D B - B + 1`` bits, the same as TurboQuant's ``D B`` within ``B`` bits.
``polarquant:b3,l4`` is Han et al.'s own setting; its ``D / 16`` radii are stored in
fp16 as theirs are (they are radii of the unit vector here, beside the shared fp16 norm:
16 bits per vector more than theirs).

Codes of ``x[..., T, D]``::

    angles    uint8[..., T, ceil(A / 8)]   A = sum of the angle widths, one dense stream
    radii     float16[..., T, D / 2^L]     only when L < log2 D
    norm      float16[..., T, 1]

Decoding walks the levels back down: each radius splits into ``r cos psi_hat`` and
``r sin psi_hat``.

Column layout. At full depth (the default) with ``D >= 32``, where it fits
(:func:`column_layout`; at ``D = 128`` for every ``B``), the same ``A`` bits are stored
instead as ``angles uint32[..., T, D B / 32]`` in an order a kernel reads with shifts
and masks: the tree is cut into 16 *columns*, column ``c`` owning the subtree of the
angles below node ``c`` of level ``log2 D - 4``, and each column's codes sit in one
8-, 16- or 32-bit unit per region (16 consecutive units, one per column; several
regions when a column needs more bits), so every angle of a level that shares its
position inside the subtree sits at the same bits of the 16 units. The 15 angles above
the columns take one spare slot of each column (the last stays zero), or, where the
columns hold fewer levels, follow the regions back to back. ``A`` rounds up to ``D B``
bits either way, the bytes of the dense stream: the stored bits are the same.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codec import (
    CodecError,
    Codes,
    Example,
    Option,
    PolarFormat,
    register,
    round_to_dtype,
)
from kvjax.codecs.rotated import RotatedCodec
from kvjax.primitives import lloyd
from kvjax.primitives.codebooks import lloyd_codebook
from kvjax.primitives.packing import (
    fields_bits,
    pack_at,
    pack_field_bytes,
    unpack_at,
    unpack_field_bytes,
)

MIN_BITS, MAX_BITS = 1, 7
MAX_LEVELS = 16
#: columns of the column layout: the narrowest float16 matmul operand of a GPU kernel
COLUMNS = 16
#: unit widths a column's codes may occupy, widest first
UNIT_BITS = (32, 16, 8)


def level_codebook(level: int, bits: int) -> lloyd.LloydMaxQuantizer:
    """The Lloyd-Max codebook of a level-``level`` angle: uniform on ``[0, 2 pi)`` at
    level 1, :func:`kvjax.primitives.lloyd.polar_angle` of ``2^(level-1)`` after."""
    if level == 1:
        return lloyd_codebook(lloyd.uniform(0.0, 2.0 * math.pi), bits)
    return lloyd_codebook(lloyd.polar_angle(2 ** (level - 1)), bits)


def angle_widths(head_dim: int, bits: int) -> list[int]:
    """Bits of each of the ``D - 1`` angles of the full-depth tree in level order
    (level 1's ``D / 2`` first, the top angle last): ``B + 1`` at level 1, ``B - 1``
    deeper (0: not stored)."""
    levels = head_dim.bit_length() - 1
    return [bits + 1 if level == 1 else bits - 1
            for level in range(1, levels + 1) for _ in range(head_dim >> level)]


@functools.cache
def column_layout(head_dim: int, bits: int) -> tuple[int, ...] | None:
    """The bit offset of each angle (:func:`angle_widths` order; -1: not stored) in the
    ``D B``-bit stream of the column layout (module docstring), or None where no layout
    of whole units fits at ``head_dim`` and ``bits``.

    The columns hold the most levels that fit, with the top angles in their spare slots
    where those fit too: a kernel reads a column-held level as elementwise tiles and
    each other angle as a column of its own.
    """
    if head_dim < 2 * COLUMNS or head_dim & (head_dim - 1):
        return None
    base = head_dim.bit_length() - 1 - COLUMNS.bit_length() + 1  # log2(D / 16)
    for depth in range(base, 0, -1):
        for slots in (True, False):
            offsets = _columns(head_dim, bits, depth, slots and bits > 1)
            if offsets is not None:
                return offsets
    return None


def _columns(head_dim: int, bits: int, depth: int, slots: bool) -> tuple[int, ...] | None:
    """:func:`column_layout` with levels ``1..depth`` in the columns, and the top angles
    in a slot of each column (``slots``) before the back-to-back rest."""
    levels = head_dim.bit_length() - 1
    base = levels - COLUMNS.bit_length() + 1
    widths = angle_widths(head_dim, bits)
    start = np.cumsum([0] + [head_dim >> level for level in range(1, levels + 1)])

    def held(c: int) -> list[int | None]:
        # node c of level `base` and its subtree down to level 1, level by level
        out = [int(start[level - 1]) + (c << (base - level) | p)
               for level in range(1, depth + 1) for p in range(1 << (base - level))]
        return [a for a in out if widths[a]]

    top = [int(start[level - 1]) + i for level in range(depth + 1, levels + 1)
           for i in range(head_dim >> level) if widths[int(start[level - 1])]]
    columns = [held(c) + ([top[c] if c < len(top) else None] if slots else [])
               for c in range(COLUMNS)]
    rest = top[COLUMNS:] if slots else top
    field_bits = [widths[a] if a is not None else bits - 1 for a in columns[0]]
    total = sum(field_bits)
    if total % 8:
        return None
    units = [32] * (total // 32) + [u for u in UNIT_BITS[1:] if total % (2 * u) >= u]
    fill, place = [0] * len(units), []
    for w in field_bits:  # first fit; every column alike
        u = next((u for u, size in enumerate(units) if fill[u] + w <= size), None)
        if u is None:
            return None
        place.append((u, fill[u]))
        fill[u] += w
    region = np.cumsum([0] + [COLUMNS * size for size in units])
    offsets = [-1] * len(widths)
    for c, angles in enumerate(columns):
        for a, (u, at) in zip(angles, place, strict=True):
            if a is not None:
                offsets[a] = int(region[u]) + c * units[u] + at
    at = int(region[-1])
    for a in rest:
        offsets[a] = at
        at += widths[a]
    if at > head_dim * bits:
        return None
    return tuple(offsets)


def polar_transform(y: jax.Array, levels: int) -> tuple[list[jax.Array], jax.Array]:
    """``([angles of level 1, ..., level L], radii)`` of ``y[..., D]``: level ``l`` has
    ``D / 2^l`` angles, level 1 in ``[0, 2 pi)`` and the others in ``[0, pi/2]``; the radii
    are the ``D / 2^L`` left at the top."""
    angles, r = [], y
    for level in range(1, levels + 1):
        a, b = r[..., 0::2], r[..., 1::2]
        psi = jnp.arctan2(b, a)
        if level == 1:
            psi = jnp.where(psi < 0, psi + 2.0 * math.pi, psi)
        angles.append(psi)
        r = jnp.sqrt(a * a + b * b)
    return angles, r


def inverse_polar_transform(angles: list[jax.Array], radii: jax.Array) -> jax.Array:
    """Inverse of :func:`polar_transform`: each radius becomes ``(r cos psi, r sin psi)``."""
    r = radii
    for psi in reversed(angles):
        pair = jnp.stack([r * jnp.cos(psi), r * jnp.sin(psi)], axis=-1)
        r = pair.reshape(*pair.shape[:-2], 2 * pair.shape[-2])
    return r


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class PolarQuantCodec(RotatedCodec):
    """PolarQuant at nominal ``bits`` per coordinate over ``levels`` levels (``None``: all
    ``log2 D``); see the module docstring."""

    name: ClassVar[str] = "polarquant"
    options: ClassVar[tuple[Option, ...]] = (
        Option.flag("bits", "b", "nominal bits", "B", lo=MIN_BITS, hi=MAX_BITS),
        Option.flag("levels", "l", "levels", "L", lo=1, hi=MAX_LEVELS,
                    note=f"L in 1..{MAX_LEVELS} (default log2 D)"),
    )
    examples: ClassVar[tuple[Example, ...]] = (
        Example("polarquant:b2", rel_mse=0.16, seeded=True, bad_head_dims=(96, 1)),
        Example("polarquant:b2,l3", rel_mse=0.16, seeded=True, bad_head_dims=(96, 1, 4)),
    )

    bits: int
    levels: int | None = None

    def validate(self) -> None:
        """PolarQuant has no QJL variant."""
        if self.qjl is not False:
            raise CodecError(f"{self.name}: no QJL variant")

    @property
    def value_bits(self) -> int:
        """``B``."""
        return self.bits

    def check_head_dim(self, head_dim: int) -> None:
        """A power of two with at least ``2^L`` coordinates."""
        super().check_head_dim(head_dim)
        if self.levels is not None and head_dim < 2**self.levels:
            raise CodecError(f"{self.spec}: {self.levels} levels need head_dim >= "
                             f"{2**self.levels}, got {head_dim}")

    def num_levels(self, head_dim: int) -> int:
        """``L``: the ``levels`` option, else ``log2 head_dim``."""
        return self.levels if self.levels is not None else head_dim.bit_length() - 1

    def column_offsets(self, head_dim: int) -> np.ndarray | None:
        """Each angle's bit offset in the column layout (:func:`column_layout`), or None
        where the codes are one dense stream (below full depth, or no layout fits)."""
        if self.num_levels(head_dim) != head_dim.bit_length() - 1:
            return None
        offsets = column_layout(head_dim, self.bits)
        return None if offsets is None else np.asarray(offsets)

    def level_bits(self, level: int) -> int:
        """``B + 1`` bits at level 1, ``B - 1`` deeper."""
        return self.bits + 1 if level == 1 else self.bits - 1

    def _widths(self, head_dim: int) -> list[tuple[int, int]]:
        levels = self.num_levels(head_dim)
        widths = [(head_dim >> level, self.level_bits(level)) for level in range(1, levels + 1)]
        return [(n, b) for n, b in widths if b > 0]

    def encode_unit(self, y: jax.Array) -> Codes:
        """``angles`` (one byte stream of every level's indices) and, below full depth,
        the fp16 ``radii``."""
        head_dim = y.shape[-1]
        levels = self.num_levels(head_dim)
        angles, radii = polar_transform(y, levels)
        fields = []
        for level, psi in enumerate(angles, start=1):
            bits = self.level_bits(level)
            if bits:
                fields.append((lloyd.quantize(psi, level_codebook(level, bits)), bits))
        offsets = self.column_offsets(head_dim)
        if offsets is not None:
            stored = offsets >= 0
            index = jnp.concatenate([f for f, _ in fields], axis=-1)
            widths = np.asarray(angle_widths(head_dim, self.bits))[stored]
            return {"angles": pack_at(index, widths, offsets[stored], head_dim * self.bits)}
        codes = {"angles": pack_field_bytes(fields)}
        if radii.shape[-1] > 1:
            codes["radii"] = round_to_dtype(radii, jnp.float16).astype(jnp.float16)
        return codes

    def decode_unit(self, codes: Codes, head_dim: int) -> jax.Array:
        """Centroid angles, walked back down from the stored radii (or ``1``)."""
        levels = self.num_levels(head_dim)
        widths = self._widths(head_dim)
        offsets = self.column_offsets(head_dim)
        if offsets is not None:
            stored = offsets >= 0
            flat = unpack_at(codes["angles"],
                             np.asarray(angle_widths(head_dim, self.bits))[stored],
                             offsets[stored])
            split = np.cumsum([n for n, _ in widths])[:-1]
            indices = iter(jnp.split(flat, split, axis=-1))
        else:
            indices = iter(unpack_field_bytes(codes["angles"], widths))
        lead = codes["angles"].shape[:-1]
        angles = []
        for level in range(1, levels + 1):
            bits = self.level_bits(level)
            codebook = level_codebook(level, bits)
            if bits:
                angles.append(lloyd.dequantize(next(indices), codebook))
            else:
                angles.append(jnp.full((*lead, head_dim >> level),
                                       float(codebook.centroids[0]), jnp.float32))
        if "radii" in codes:
            radii = codes["radii"].astype(jnp.float32)
        else:
            radii = jnp.ones((*lead, 1), jnp.float32)
        return inverse_polar_transform(angles, radii)

    def level_centroids(self, head_dim: int) -> tuple[tuple[float, ...], ...]:
        """Every level's centroids, level 1 first (one centroid at a level of no bits)."""
        return tuple(tuple(float(c) for c in level_codebook(level, self.level_bits(level))
                           .centroids) for level in range(1, self.num_levels(head_dim) + 1))

    def kernel_offsets(self, head_dim: int) -> tuple[int, ...] | None:
        """:meth:`column_offsets` as a tuple (a kernel's static argument)."""
        offsets = self.column_offsets(head_dim)
        return None if offsets is None else tuple(int(o) for o in offsets)

    def kernel_formats(self) -> tuple[PolarFormat, ...]:
        """The column layout's angle codes, read by the PolarQuant decode kernel."""
        return (PolarFormat(bits=self.bits, qjl=False, centroids=self.level_centroids,
                            offsets=self.kernel_offsets),)

    def unit_bits(self, head_dim: int) -> int:
        """The angle stream in whole bytes, plus 16 bits per radius below full depth."""
        radii = head_dim >> self.num_levels(head_dim)
        return 8 * -(-fields_bits(self._widths(head_dim)) // 8) + (16 * radii if radii > 1 else 0)
