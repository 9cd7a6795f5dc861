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

from kvjax.codec import CodecError, Codes, Example, Option, packed_words, register
from kvjax.codecs.rotated import QJL_OPTION, RotatedCodec
from kvjax.primitives import lloyd
from kvjax.primitives.codebooks import lloyd_codebook
from kvjax.primitives.packing import pack_bits, unpack_bits

MIN_BITS, MAX_BITS = 1, 8


def rotated_coordinate_codebook(head_dim: int, bits: int) -> lloyd.LloydMaxQuantizer:
    """The Lloyd-Max codebook of one coordinate of a uniform point on S^{head_dim - 1}."""
    return lloyd_codebook(lloyd.sphere_coordinate(head_dim), bits)


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
        codebook = rotated_coordinate_codebook(y.shape[-1], self.mse_bits)
        return {"codes": pack_bits(lloyd.quantize(y, codebook), self.mse_bits)}

    def decode_unit(self, codes: Codes, head_dim: int) -> jax.Array:
        """The codebook's centroids of the indices."""
        codebook = rotated_coordinate_codebook(head_dim, self.mse_bits)
        return lloyd.dequantize(unpack_bits(codes["codes"], self.mse_bits, head_dim), codebook)

    def unit_bits(self, head_dim: int) -> int:
        """The packed words' bits."""
        return 32 * packed_words(head_dim, self.mse_bits)
