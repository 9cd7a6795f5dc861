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

from kvjax.codec import CodecError, Codes, check_range, packed_words, parse_int, register
from kvjax.codecs.intn import option_spec
from kvjax.codecs.rotated import RotatedCodec
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

    bits: int

    def __post_init__(self) -> None:
        self._check_qjl()
        check_range(self.bits, "bits", self.name, MIN_BITS + int(self.qjl), MAX_BITS)

    @property
    def mse_bits(self) -> int:
        """Bits of the Lloyd-Max stage: B, or B - 1 beside the QJL sketch."""
        return self.bits - int(self.qjl)

    @property
    def value_bits(self) -> int:
        """``B``."""
        return self.bits

    @classmethod
    def from_options(cls, options: list[str]) -> TurboQuantCodec:
        """``turboquant:bB[,qjl]``: B bits per rotated coordinate (1..8; 2..8 with qjl)."""
        spec = option_spec(cls.name, options)
        rest = [o for o in options if o != "qjl"]
        if len(rest) != 1 or not rest[0].startswith("b") or len(options) - len(rest) > 1:
            raise CodecError(f"{spec}: expected one option bB (B in {MIN_BITS}..{MAX_BITS}) "
                             "and optionally qjl, e.g. turboquant:b3 or turboquant:b3,qjl")
        qjl = len(rest) < len(options)
        return cls(bits=parse_int(rest[0][1:], "bits B", spec, MIN_BITS + int(qjl), MAX_BITS),
                   qjl=qjl)

    @property
    def spec(self) -> str:
        """``turboquant:bB`` or ``turboquant:bB,qjl``."""
        return f"{self.name}:b{self.bits}" + (",qjl" if self.qjl else "")

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
