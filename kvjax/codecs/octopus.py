"""OCTOPUS, ``octopus:bB[,qjl]``: rotated coordinates quantized three at a time, as a
triplet norm and an octahedrally mapped direction.

Triplets. The rotated unit vector ``y`` (:mod:`kvjax.codecs.rotated`) is cut into
``n = ceil(D / 3)`` contiguous triplets ``t_i`` (the last zero-padded), each split into its
norm ``rho_i = |t_i|`` and direction ``t_i / rho_i`` on S^2 (a zero triplet takes the
direction ``(0, 0, 1)``).

Norm law. ``rho^2`` of three coordinates of a uniform point on S^{D-1} is
``Beta(3/2, (D-3)/2)``: ``f(rho) = 2 rho^2 (1 - rho^2)^((D-5)/2) / B(3/2, (D-3)/2)`` on
``[0, 1]``, mean square ``3 / D`` (:func:`kvjax.primitives.lloyd.sphere_block_norm`).

Direction. The octahedral map sends a unit ``n`` to ``p = n / |n|_1`` on the octahedron
and reads ``(xi, eta) = (p_x, p_y)`` on the upper half (``p_z >= 0``); the lower half is
folded out to the square's corners, ``(xi, eta) = ((1 - |p_y|) sgn p_x, (1 - |p_x|)
sgn p_y)``. Decoding lifts ``(xi, eta, 1 - |xi| - |eta|)``, unfolds it where the third
coordinate is negative, and normalizes: exact inverse, O(1) arithmetic. For a uniform
direction ``(xi, eta)`` has density ``1 / (4 pi |p|^3)`` on ``[-1, 1]^2``; one coordinate's
marginal has a closed form (:func:`kvjax.primitives.lloyd.octahedral_coordinate`, derived there),
used where the paper fits the empirical marginal: the same law without sampling noise.
Both coordinates share one Lloyd-Max codebook.

Bits. A triplet gets ``d`` bits per octahedral coordinate and ``n`` for its norm,
``2 d + n`` in all. ``octopus:bB`` is the paper's split ``(d, n) = (B + 1, B - 1)``: the norm
of a triplet carries little of the error (``E rho^2 = 3 / D``), so a direction bit buys
more than a norm bit; ``octopus:dX,nY`` sets any split (``X`` or ``Y`` may be 0: one level,
the law's mean). Note the split is not rate-neutral: ``(B + 1, B - 1)`` spends ``3 B + 1``
bits per triplet, ``B + 1/3`` per coordinate (plus the pad at ``D = 128``), which is more
than TurboQuant or PolarQuant spend at the same ``B``.

Joint rounding. The scalar seeds ``(i_xi, i_eta)`` are refined over the 3x3 neighbours
(clamped to the codebook) by the exact triplet error: for a candidate direction ``m``
(the decoded, normalized codeword) the best stored norm is the codebook level nearest to
``<t, m>``, and the error is ``|t - rho_hat m|^2 = |t|^2 - 2 rho_hat <t, m> + rho_hat^2``; the
candidate with the least error wins (the first on ties). :func:`joint_round` also runs the
full grid of ``4^d`` directions for comparison.

Codes of ``x[..., T, D]``::

    codes     uint8[..., T, ceil(n (2 d + n_bits) / 8)]   per triplet: i_xi, i_eta, i_rho
    norm      float16[..., T, 1]

Byte layout. With 4-bit coordinates (``octopus:b3``, ``octopus:b4,qjl``) and a norm width
that divides a byte, the same bits are laid out for a kernel that reads ``P``-byte windows
of a token's bytes (:func:`byte_layout`): one byte per triplet holds its two coordinates as
sign-magnitude codes (:func:`kvjax.codecs.turboquant.to_sign_magnitude`: low nibble
``xi``, high nibble ``eta``; the codebook is symmetric), the norm codes share bytes ``8 /
n_bits`` to a byte, and every triplet's norm code sits in the same column of some window
as its direction byte, so a reader combines whole windows elementwise. Other splits keep
the dense stream (all ``i_xi``, then all ``i_eta``, then all ``i_rho``).

``octopus:bB,qjl`` (OCTOPUS-QJL, B >= 2): the OCTOPUS stage at ``B - 1``, i.e. split
``(B, B - 2)``, plus the 1-bit QJL sketch of the residual with its norm; attention uses
the estimator (:mod:`kvjax.codecs.rotated`). It is matched to ``turboquant:bB,qjl``, which
also gives its MSE stage ``B - 1`` bits.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codec import CodecError, Codes, Example, OctopusFormat, Option, register
from kvjax.codecs.rotated import QJL_OPTION, RotatedCodec
from kvjax.codecs.turboquant import from_sign_magnitude, to_sign_magnitude
from kvjax.primitives import lloyd
from kvjax.primitives.codebooks import lloyd_codebook
from kvjax.primitives.octahedral import octahedral_decode, octahedral_encode
from kvjax.primitives.packing import (
    fields_bits,
    from_units,
    pack_at,
    pack_field_bytes,
    to_units,
    unpack_at,
    unpack_field_bytes,
)

MAX_BITS = 8
MIN_NOMINAL, MAX_NOMINAL = 1, 7
#: offsets of the local candidate set around the scalar seed
LOCAL = tuple((dx, dy) for dx in (-1, 0, 1) for dy in (-1, 0, 1))
#: smallest head dim: the triplet norm's law needs ``D >= 5`` (a bounded density) and the
#: rotation a power of two
MIN_HEAD_DIM = 8
#: the byte layout's coordinate width (two codes to a byte) and its norm widths (whole
#: codes to a byte; 0: no norm codes)
BYTE_DIRECTION_BITS = 4
BYTE_NORM_BITS = (0, 1, 2, 4, 8)
#: window widths the byte layout tries, widest first (a kernel's matmul wants 16 columns)
WINDOWS = (16, 8, 4, 2, 1)


def direction_codebook(bits: int) -> lloyd.LloydMaxQuantizer:
    """Lloyd-Max codebook of one octahedral coordinate of a uniform direction."""
    return lloyd_codebook(lloyd.octahedral_coordinate(), bits)


def norm_codebook(head_dim: int, bits: int) -> lloyd.LloydMaxQuantizer:
    """Lloyd-Max codebook of the norm of three coordinates of a uniform unit vector."""
    return lloyd_codebook(lloyd.sphere_block_norm(head_dim, 3), bits)


def to_triplets(y: jax.Array) -> jax.Array:
    """``y[..., D] -> [..., ceil(D / 3), 3]``, zero-padded."""
    head_dim = y.shape[-1]
    pad = -head_dim % 3
    if pad:
        y = jnp.concatenate([y, jnp.zeros((*y.shape[:-1], pad), y.dtype)], axis=-1)
    # explicit sizes: a ``-1`` cannot be inferred when a leading axis is empty
    return y.reshape(*y.shape[:-1], y.shape[-1] // 3, 3)


@dataclasses.dataclass(frozen=True)
class ByteLayout:
    """Where the byte layout (see the module docstring) puts each triplet's codes in a
    token's ``size`` bytes.

    ``direction[t]``: the byte of triplet ``t``'s two coordinates; ``norm[t]``: the
    ``(byte, slot)`` of its norm code (bits ``slot * n_bits`` up; empty without norm
    bits); ``windows``: ``(start, column, first, count)`` per window of ``width`` bytes
    starting at byte ``start``, whose columns ``column .. column + count - 1`` hold the
    direction bytes of triplets ``first .. first + count - 1`` (its other columns are
    other codes' bytes). Every norm code lies in its triplet's column of some window:
    ``byte - column`` is a window start in ``[0, size - width]``.
    """

    width: int
    size: int
    direction: tuple[int, ...]
    norm: tuple[tuple[int, int], ...]
    windows: tuple[tuple[int, int, int, int], ...]

    def column(self, t: int) -> int:
        """The window column of triplet ``t``."""
        _, column, first, _ = next(w for w in self.windows if w[2] <= t < w[2] + w[3])
        return column + t - first


def _arrange(triplets: int, norm_bytes: int, width: int, before: int) -> ByteLayout:
    """Whole windows of direction bytes, ``before`` of them ahead of the norm bytes, the
    rest after, and the last ``triplets % width`` direction bytes at the end, read by a
    window flush with the end; norm code ``t`` in byte ``t % norm_bytes``, slot ``t //
    norm_bytes`` of the norm bytes (so a window's run of triplets meets the norm bytes
    in a few runs, each one window start)."""
    size = triplets + norm_bytes
    full, tail = divmod(triplets, width)
    windows = [(w * width + (norm_bytes if w >= before else 0), 0, w * width, width)
               for w in range(full)]
    if tail:
        windows.append((size - width, width - tail, full * width, tail))
    direction = [start + column + j for start, column, first, count in windows
                 for j in range(count)]
    norm = tuple((before * width + t % norm_bytes, t // norm_bytes)
                 for t in range(triplets)) if norm_bytes else ()
    return ByteLayout(width, size, tuple(direction), norm, tuple(windows))


@functools.cache
def byte_layout(triplets: int, norm_bits: int) -> ByteLayout:
    """The byte layout of ``triplets`` triplets with ``norm_bits``-bit norm codes (one of
    :data:`BYTE_NORM_BITS`): the widest window of :data:`WINDOWS` that leaves every norm
    code in its triplet's column of a window inside the token's bytes."""
    if norm_bits not in BYTE_NORM_BITS:
        raise ValueError(f"norm codes of {norm_bits} bits do not fill bytes")
    per_byte = 8 // norm_bits if norm_bits else 0
    norm_bytes = -(-triplets // per_byte) if per_byte else 0
    size = triplets + norm_bytes
    for width in WINDOWS:
        if width > size:
            continue
        for before in range(triplets // width + 1):
            layout = _arrange(triplets, norm_bytes, width, before)
            if all(0 <= byte - layout.column(t) <= size - width
                   for t, (byte, _) in enumerate(layout.norm)):
                return layout
    # one-byte windows read every byte where it is
    raise AssertionError("unreachable")


def kernel_layout(head_dim: int, direction_bits: int, norm_bits: int) -> ByteLayout | None:
    """The byte layout of a split's codes at ``head_dim``, or None where they are one
    dense stream."""
    if direction_bits != BYTE_DIRECTION_BITS or norm_bits not in BYTE_NORM_BITS:
        return None
    return byte_layout(-(-head_dim // 3), norm_bits)


def direction_magnitudes(bits: int) -> tuple[float, ...]:
    """The ``2^(bits-1)`` magnitudes of the (symmetric) coordinate codebook, ascending."""
    centroids = direction_codebook(bits).centroids
    return tuple(float(c) for c in centroids[len(centroids) // 2:])


def norm_levels(head_dim: int, bits: int) -> tuple[float, ...]:
    """The ``2^bits`` triplet norm levels, ascending."""
    return tuple(float(c) for c in norm_codebook(head_dim, bits).centroids)


def joint_round(
    t: jax.Array,
    direction: lloyd.LloydMaxQuantizer,
    norm: lloyd.LloydMaxQuantizer,
    full_grid: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Indices ``(i_xi, i_eta, i_rho)`` (int32, ``t.shape[:-1]``) of triplets ``t[..., 3]``
    minimizing ``|t - rho_hat m(i_xi, i_eta)|^2``: over the 3x3 neighbours of the scalar
    seed, or with ``full_grid`` over every direction codeword."""
    levels = direction.centroids.shape[0]
    table = jnp.asarray(direction.centroids, jnp.float32)
    if full_grid:
        grid = jnp.arange(levels, dtype=jnp.int32)
        cand_xi = jnp.broadcast_to(jnp.repeat(grid, levels), (*t.shape[:-1], levels**2))
        cand_eta = jnp.broadcast_to(jnp.tile(grid, levels), (*t.shape[:-1], levels**2))
    else:
        xi, eta = octahedral_encode(t)
        seed_xi = lloyd.quantize(xi, direction).astype(jnp.int32)[..., None]
        seed_eta = lloyd.quantize(eta, direction).astype(jnp.int32)[..., None]
        cand_xi = jnp.clip(seed_xi + jnp.asarray([dx for dx, _ in LOCAL]), 0, levels - 1)
        cand_eta = jnp.clip(seed_eta + jnp.asarray([dy for _, dy in LOCAL]), 0, levels - 1)
    m = octahedral_decode(table[cand_xi], table[cand_eta])
    proj = jnp.einsum("...c,...kc->...k", t, m, precision=jax.lax.Precision.HIGHEST)
    cand_rho = lloyd.quantize(proj, norm).astype(jnp.int32)
    rho = lloyd.dequantize(cand_rho, norm)
    best = jnp.argmin(rho * rho - 2.0 * rho * proj, axis=-1)[..., None]

    def pick(a):
        return jnp.take_along_axis(a, best, axis=-1)[..., 0]

    return pick(cand_xi), pick(cand_eta), pick(cand_rho)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class OctopusCodec(RotatedCodec):
    """OCTOPUS with ``direction_bits`` per octahedral coordinate and ``norm_bits`` per
    triplet norm (plus the QJL sketch with ``qjl``); see the module docstring."""

    name: ClassVar[str] = "octopus"
    #: ``bB`` (the nominal split, :meth:`nominal`) or ``dX,nY``; the spec writes ``bB``
    #: whenever the split is the nominal one
    options: ClassVar[tuple[Option, ...]] = (
        Option.flag("nominal_bits", "b", "nominal bits", "B", required=False,
                    note=f"B in {MIN_NOMINAL}..{MAX_NOMINAL} ({MIN_NOMINAL + 1}.."
                         f"{MAX_NOMINAL + 1} with qjl)"),
        Option.flag("direction_bits", "d", "bits per octahedral coordinate", "X", lo=0,
                    hi=MAX_BITS, required=False),
        Option.flag("norm_bits", "n", "bits per triplet norm", "Y", lo=0, hi=MAX_BITS,
                    required=False),
        QJL_OPTION,
    )
    examples: ClassVar[tuple[Example, ...]] = (
        Example("octopus:b2", rel_mse=0.11, seeded=True, bad_head_dims=(96, 1, 2, 4)),
        Example("octopus:d3,n0", rel_mse=0.25, seeded=True, bad_head_dims=(80,)),
        Example("octopus:b3,qjl", rel_mse=0.2, seeded=True, bad_head_dims=(48,)),
    )

    direction_bits: int
    norm_bits: int

    def validate(self) -> None:
        """At least one of the two widths is nonzero."""
        if self.direction_bits + self.norm_bits == 0:
            raise CodecError(f"{self.name}: direction_bits and norm_bits are both 0")

    @classmethod
    def nominal(cls, bits: int, qjl: bool = False) -> OctopusCodec:
        """``octopus:bB[,qjl]``: the split ``(B + 1, B - 1)`` of the stage's ``B``
        (``B - 1`` beside the QJL sketch)."""
        lo, hi = MIN_NOMINAL + int(qjl), MAX_NOMINAL + int(qjl)
        if not isinstance(bits, int) or isinstance(bits, bool) or not lo <= bits <= hi:
            raise CodecError(f"{cls.name}: nominal bits B must be an integer in {lo}..{hi}"
                             f"{' with qjl' if qjl else ''}, got {bits!r}")
        stage = bits - int(qjl)
        return cls(direction_bits=stage + 1, norm_bits=stage - 1, qjl=qjl)

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> OctopusCodec:
        """``bB`` alone, or ``dX`` and ``nY`` together."""
        split = values.keys() & {"direction_bits", "norm_bits"}
        if "nominal_bits" in values and not split:
            return cls.nominal(values["nominal_bits"], qjl=values.get("qjl", False))
        if "nominal_bits" not in values and len(split) == 2:
            return cls(**values)
        raise CodecError(f"{cls.name}: expected bB (nominal bits) or both dX and nY (bits "
                         "per octahedral coordinate and per triplet norm)")

    def spec_values(self) -> dict[str, Any]:
        """``bB`` for the nominal split, else ``dX,nY``; ``qjl``."""
        nominal = self.nominal_bits
        split = ({"nominal_bits": nominal} if nominal is not None else
                 {"direction_bits": self.direction_bits, "norm_bits": self.norm_bits})
        return {**split, "qjl": self.qjl}

    @property
    def nominal_bits(self) -> int | None:
        """``B`` when the split is the nominal one, else None."""
        if self.norm_bits != self.direction_bits - 2:
            return None
        return self.direction_bits - 1 + int(self.qjl)

    @property
    def value_bits(self) -> int:
        """``B``, or for an explicit split the rounded bits per coordinate of a triplet."""
        nominal = self.nominal_bits
        if nominal is not None:
            return nominal
        return max(1, round((2 * self.direction_bits + self.norm_bits) / 3))

    def check_head_dim(self, head_dim: int) -> None:
        """A power of two (the rotation) of at least :data:`MIN_HEAD_DIM` (the triplet
        norm law)."""
        super().check_head_dim(head_dim)
        if head_dim < MIN_HEAD_DIM:
            raise CodecError(f"{self.spec}: head_dim must be a power of two >= "
                             f"{MIN_HEAD_DIM} (the law of a triplet's norm needs D >= 5), "
                             f"got {head_dim}")

    def _widths(self, head_dim: int) -> list[tuple[int, int]]:
        triplets = -(-head_dim // 3)
        return [(triplets, b) for b in (self.direction_bits, self.direction_bits,
                                         self.norm_bits) if b > 0]

    @property
    def byte_aligned(self) -> bool:
        """Whether the codes take the byte layout (see the module docstring)."""
        return kernel_layout(MIN_HEAD_DIM, self.direction_bits, self.norm_bits) is not None

    def _slots(self, head_dim: int) -> tuple[ByteLayout, list[int], list[int]]:
        """The byte layout and each code's width and bit offset (all ``i_xi``, all
        ``i_eta``, all ``i_rho``)."""
        layout = kernel_layout(head_dim, self.direction_bits, self.norm_bits)
        byte = np.asarray(layout.direction) * 8
        offsets = [*byte.tolist(), *(byte + 4).tolist(),
                   *[8 * b + self.norm_bits * slot for b, slot in layout.norm]]
        widths = [4] * (2 * len(byte)) + [self.norm_bits] * len(layout.norm)
        return layout, widths, offsets

    def encode_unit(self, y: jax.Array) -> Codes:
        """``codes``: the triplets' jointly rounded indices, in the byte layout or one
        dense byte stream (see the module docstring)."""
        head_dim = y.shape[-1]
        t = to_triplets(y)
        i_xi, i_eta, i_rho = joint_round(t, direction_codebook(self.direction_bits),
                                         norm_codebook(head_dim, self.norm_bits))
        if self.byte_aligned:
            layout, widths, offsets = self._slots(head_dim)
            sign = functools.partial(to_sign_magnitude, bits=BYTE_DIRECTION_BITS)
            codes = [sign(i_xi), sign(i_eta), *([i_rho] if self.norm_bits else [])]
            words = pack_at(jnp.concatenate(codes, axis=-1), widths, offsets, 8 * layout.size)
            return {"codes": to_units(words, 8 * layout.size)}
        fields = [(i, b) for i, b in ((i_xi, self.direction_bits),
                                      (i_eta, self.direction_bits),
                                      (i_rho, self.norm_bits)) if b > 0]
        return {"codes": pack_field_bytes(fields)}

    def _indices(self, codes: Codes, head_dim: int) -> list[jax.Array]:
        """The stored ``i_xi``, ``i_eta``, ``i_rho`` (those of nonzero width)."""
        if self.byte_aligned:
            layout, widths, offsets = self._slots(head_dim)
            flat = unpack_at(from_units(codes["codes"], 8 * layout.size), widths, offsets)
            parts = jnp.split(flat, len(widths) // len(layout.direction), axis=-1)
            sign = functools.partial(from_sign_magnitude, bits=BYTE_DIRECTION_BITS)
            return [sign(parts[0]), sign(parts[1]), *parts[2:]]
        return unpack_field_bytes(codes["codes"], self._widths(head_dim))

    def decode_unit(self, codes: Codes, head_dim: int) -> jax.Array:
        """``rho_hat * m(xi_hat, eta_hat)`` per triplet, the pad dropped."""
        fields = iter(self._indices(codes, head_dim))
        triplets = -(-head_dim // 3)
        lead = codes["codes"].shape[:-1]
        zeros = jnp.zeros((*lead, triplets), jnp.int32)
        i_xi = next(fields) if self.direction_bits else zeros
        i_eta = next(fields) if self.direction_bits else zeros
        i_rho = next(fields) if self.norm_bits else zeros
        direction = direction_codebook(self.direction_bits)
        m = octahedral_decode(lloyd.dequantize(i_xi, direction),
                              lloyd.dequantize(i_eta, direction))
        rho = lloyd.dequantize(i_rho, norm_codebook(head_dim, self.norm_bits))
        return (rho[..., None] * m).reshape(*lead, 3 * triplets)[..., :head_dim]

    def unit_bits(self, head_dim: int) -> int:
        """The index stream in whole bytes."""
        return 8 * -(-fields_bits(self._widths(head_dim)) // 8)

    def kernel_formats(self) -> tuple[OctopusFormat, ...]:
        """The rotated triplet codes, read by the OCTOPUS decode kernel where they take
        the byte layout."""
        return (OctopusFormat(direction_bits=self.direction_bits, norm_bits=self.norm_bits,
                              qjl=self.qjl, layout=kernel_layout,
                              magnitudes=direction_magnitudes, norms=norm_levels),)
