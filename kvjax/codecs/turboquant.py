"""TurboQuant-MSE, ``turboquant:bB``: a global norm, a random rotation, and one Lloyd-Max
codebook for every rotated coordinate.

A vector ``x`` of ``D`` dims (a power of two) is stored as its norm ``|x|`` (fp16) and the
``B``-bit Lloyd-Max indices of the coordinates of ``y = H(s * x / |x|)``, the frame
shared by the rotation-preconditioned family (:mod:`kvjax.codecs.rotated`). The rotation
makes ``y`` a point on the unit sphere whose coordinates all follow the marginal of one
coordinate of a uniform point on S^{D-1},

    f(t) = Gamma(D/2) / (sqrt(pi) Gamma((D-1)/2)) (1 - t^2)^((D-3)/2),   t in [-1, 1]

(:func:`kvjax.primitives.lloyd.sphere_coordinate`: the squared coordinate is Beta(1/2, (D-1)/2)),
exactly for a uniformly random rotation and closely for the randomized Hadamard one. One
scalar codebook, optimal for that density and data-free, serves every coordinate; it
is designed once per (D, B) and kept on disk (:func:`kvjax.primitives.codebooks.lloyd_codebook`).
Decoding is ``|x| * s * H(c[idx])``; the expected squared error is ``D * mse(B)`` times
``|x|^2`` (``mse`` the codebook's per-coordinate error).

Codes of ``x[..., T, D]``::

    codes     uint32[..., T, W]    W = ceil(D * B / 32), the D indices bit-packed
    norm      float16[..., T, 1]

The codebook is symmetric (``c[2^B - 1 - i] = -c[i]``), so an index is stored in
sign-magnitude form: the top bit the sign, the low ``B - 1`` bits the rank of ``|c|``
among the ``2^(B-1)`` magnitudes. A kernel then looks a code up in a table of the
magnitudes alone, small enough for registers (:class:`~kvjax.codec.CodebookFormat`). The
words are those of :func:`~kvjax.primitives.packing.pack_codes`: planar for B in 1, 2,
4, 8 and, for B = 3 at D a multiple of 32, split (the magnitudes' 2 bits planar, the signs
on words of their own); other widths are bit-dense. Every layout holds exactly ``D * B``
bits (plus the last word's padding).

Bits per element: ``32 W / D + 16 / D``. Values (``value_codec``) are stored by the
group-wise INT of the OCTOPUS paper's LLM recipe: ``kivi:max(B, 2),g32,token``.

TurboQuant-QJL, ``turboquant:bB,qjl`` (B >= 2): the MSE stage gets ``B - 1`` bits and the
residual a 1-bit QJL sketch with its norm (:mod:`kvjax.codecs.rotated`); attention uses
the sketch's unbiased score estimator. Bits ``B + 32 / D`` at D a multiple of 32.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.codec import (
    CodebookFormat,
    CodecError,
    Codes,
    Example,
    Option,
    packed_words,
    register,
)
from kvjax.codecs.rotated import QJL_OPTION, RotatedCodec
from kvjax.primitives import lloyd
from kvjax.primitives.codebooks import lloyd_codebook
from kvjax.primitives.packing import pack_codes, unpack_codes

MIN_BITS, MAX_BITS = 1, 8


def rotated_coordinate_codebook(head_dim: int, bits: int) -> lloyd.LloydMaxQuantizer:
    """The Lloyd-Max codebook of one coordinate of a uniform point on S^{head_dim - 1}."""
    return lloyd_codebook(lloyd.sphere_coordinate(head_dim), bits)


def to_sign_magnitude(index: jax.Array, bits: int) -> jax.Array:
    """Sorted codebook indices as sign-magnitude codes (see the module docstring):
    index ``half + m`` -> ``m``, index ``half - 1 - m`` -> ``half | m``."""
    half = 1 << (bits - 1)
    i = index.astype(jnp.uint32)
    return jnp.where(i >= half, i - half, (2 * half - 1) - i).astype(jnp.uint32)


def from_sign_magnitude(code: jax.Array, bits: int) -> jax.Array:
    """Inverse of :func:`to_sign_magnitude`: sorted codebook indices."""
    half = 1 << (bits - 1)
    c = code.astype(jnp.uint32)
    return jnp.where(c >= half, (2 * half - 1) - c, c + half).astype(jnp.uint32)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class TurboQuantCodec(RotatedCodec):
    """TurboQuant-MSE with ``bits`` per rotated coordinate (``turboquant:bB``), or
    TurboQuant-QJL with ``qjl=True`` (``turboquant:bB,qjl``); see the module docstring."""

    name: ClassVar[str] = "turboquant"
    options: ClassVar[tuple[Option, ...]] = (
        Option.flag("bits", "b", "bits", "B", lo=MIN_BITS, hi=MAX_BITS,
                    note=f"B in {MIN_BITS}..{MAX_BITS} ({MIN_BITS + 1}..{MAX_BITS} with qjl)"),
        QJL_OPTION,
    )
    examples: ClassVar[tuple[Example, ...]] = (
        Example("turboquant:b3", rel_mse=0.045, seeded=True, bad_head_dims=(96, 1)),
        Example("turboquant:qjl,b3", rel_mse=0.25, seeded=True, bad_head_dims=(48,)),
    )

    bits: int

    def validate(self) -> None:
        """The QJL variant needs a bit for its MSE stage."""
        if self.qjl and self.bits < MIN_BITS + 1:
            raise CodecError(f"{self.name}: bits B must be an integer in {MIN_BITS + 1}.."
                             f"{MAX_BITS} with qjl, got {self.bits!r}")

    @property
    def mse_bits(self) -> int:
        """Bits of the Lloyd-Max stage: B, or B - 1 beside the QJL sketch."""
        return self.bits - int(self.qjl)

    @property
    def value_bits(self) -> int:
        """``B``."""
        return self.bits

    def encode_unit(self, y: jax.Array) -> Codes:
        """``codes``: the ``D`` Lloyd-Max indices bit-packed into uint32 words."""
        bits = self.mse_bits
        index = lloyd.quantize(y, rotated_coordinate_codebook(y.shape[-1], bits))
        return {"codes": pack_codes(to_sign_magnitude(index, bits), bits)}

    def decode_unit(self, codes: Codes, head_dim: int) -> jax.Array:
        """The codebook's centroids of the indices."""
        bits = self.mse_bits
        code = unpack_codes(codes["codes"], bits, head_dim)
        return lloyd.dequantize(from_sign_magnitude(code, bits),
                                rotated_coordinate_codebook(head_dim, bits))

    def unit_bits(self, head_dim: int) -> int:
        """The packed words' bits."""
        return 32 * packed_words(head_dim, self.mse_bits)

    def kernel_formats(self) -> tuple[CodebookFormat, ...]:
        """The rotated codebook codes, read by the codebook decode kernel."""
        return (CodebookFormat(bits=self.mse_bits, qjl=self.qjl, magnitudes=magnitudes),)


def magnitudes(head_dim: int, bits: int) -> tuple[float, ...]:
    """The ``2^(B-1)`` magnitudes of the codebook, ascending: what a sign-magnitude code
    looks up."""
    centroids = rotated_coordinate_codebook(head_dim, bits).centroids
    return tuple(float(c) for c in centroids[len(centroids) // 2:])
