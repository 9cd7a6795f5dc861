"""TurboQuant-MSE, ``turboquant:bB``: a global norm, a random rotation, and one Lloyd-Max
codebook for every rotated coordinate.

A vector ``x`` of ``D`` dims (a power of two) is stored as its norm ``|x|`` (fp16) and the
``B``-bit Lloyd-Max indices of the coordinates of ``y = H(s * x / |x|)``, ``H`` the
orthonormal Walsh-Hadamard transform and ``s`` seeded signs drawn per (layer, kv head,
K|V). The rotation makes ``y`` a point on the unit sphere whose coordinates all follow
the marginal of one coordinate of a uniform point on S^{D-1},

    f(t) = Gamma(D/2) / (sqrt(pi) Gamma((D-1)/2)) (1 - t^2)^((D-3)/2),   t in [-1, 1]

(:func:`kvjax.lloyd.sphere_coordinate`: the squared coordinate is Beta(1/2, (D-1)/2)),
exactly for a uniformly random rotation and closely for the randomized Hadamard one. One
scalar codebook, optimal for that density and data-free, serves every coordinate; it
is designed once per (D, B) and kept on disk (:func:`kvjax.codebooks.lloyd_codebook`).
Decoding is ``|x| * s * H(c[idx])``; the expected squared error is ``D * mse(B)`` times
``|x|^2`` (``mse`` the codebook's per-coordinate error).

Codes of ``x[..., T, D]``::

    codes     uint32[..., T, W]    W = ceil(D * B / 32), the D indices bit-packed
    norm      float16[..., T, 1]

Bits per element: ``32 W / D + 16 / D``. Values (``value_codec``) are stored by the
group-wise INT of the OCTOPUS paper's LLM recipe: ``kivi:max(B, 2),g32,token``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax import lloyd
from kvjax.codebooks import lloyd_codebook
from kvjax.codec import (
    Codec,
    CodecError,
    Codes,
    Params,
    check_range,
    packed_words,
    parse_int,
    register,
    round_to_dtype,
)
from kvjax.codecs.intn import FP16_MAX, FP16_TINY, exact_bits, option_spec
from kvjax.codecs.kivi import KiviCodec
from kvjax.packing import pack_bits, unpack_bits
from kvjax.rotations import inverse_randomized_hadamard, random_signs, randomized_hadamard

MIN_BITS, MAX_BITS = 1, 8
#: channel group of the value codec (the paper's V group of 32)
VALUE_GROUP = 32


def rotated_coordinate_codebook(head_dim: int, bits: int) -> lloyd.LloydMaxQuantizer:
    """The Lloyd-Max codebook of one coordinate of a uniform point on S^{head_dim - 1}."""
    return lloyd_codebook(lloyd.sphere_coordinate(head_dim), bits)


def check_power_of_two(codec: Codec, head_dim: int) -> None:
    """The Walsh-Hadamard rotation needs ``head_dim`` a power of two."""
    Codec.check_head_dim(codec, head_dim)
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise CodecError(f"{codec.spec}: head_dim must be a power of two >= 2 (the "
                         f"Walsh-Hadamard rotation), got {head_dim}")


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class TurboQuantCodec(Codec):
    """TurboQuant-MSE with ``bits`` per rotated coordinate; spec ``turboquant:bB``."""

    name: ClassVar[str] = "turboquant"

    bits: int

    def __post_init__(self) -> None:
        check_range(self.bits, "bits", self.name, MIN_BITS, MAX_BITS)

    @classmethod
    def from_options(cls, options: list[str]) -> TurboQuantCodec:
        """``turboquant:bB``: B bits per rotated coordinate, 1..8."""
        spec = option_spec(cls.name, options)
        if len(options) != 1 or not options[0].startswith("b"):
            raise CodecError(f"{spec}: expected one option bB (B in {MIN_BITS}..{MAX_BITS}), "
                             "e.g. turboquant:b3")
        return cls(bits=parse_int(options[0][1:], "bits B", spec, MIN_BITS, MAX_BITS))

    @property
    def spec(self) -> str:
        """``turboquant:bB``."""
        return f"{self.name}:b{self.bits}"

    def value_codec(self) -> Codec:
        """Group-wise INT of V: ``kivi:max(B, 2),g32,token``."""
        return KiviCodec(bits=max(self.bits, 2), group=VALUE_GROUP, per_token=True)

    def check_head_dim(self, head_dim: int) -> None:
        """A power of two (the rotation)."""
        check_power_of_two(self, head_dim)

    def init(self, key: jax.Array, head_dim: int) -> Params:
        """``{"signs": float32[D]}``, the rotation's seeded sign flips."""
        self.check_head_dim(head_dim)
        return {"signs": random_signs(key, head_dim)}

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        head_dim = x.shape[-1]
        codebook = rotated_coordinate_codebook(head_dim, self.bits)
        norm = jnp.linalg.norm(jnp.clip(x, -FP16_MAX, FP16_MAX), axis=-1, keepdims=True)
        norm = jnp.minimum(norm, FP16_MAX)
        norm = jnp.where(norm > 0, jnp.maximum(norm, FP16_TINY), 0.0)
        norm = round_to_dtype(norm, jnp.float16)
        unit = x / jnp.where(norm > 0, norm, 1.0)
        y = randomized_hadamard(unit, params["signs"])
        idx = lloyd.quantize(y, codebook)
        return {"codes": pack_bits(idx, self.bits), "norm": norm.astype(jnp.float16)}

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """``|x| * s * H(c[idx])``, cast to ``dtype``."""
        head_dim = params["signs"].shape[-1]
        codebook = rotated_coordinate_codebook(head_dim, self.bits)
        idx = unpack_bits(codes["codes"], self.bits, head_dim)
        y = lloyd.dequantize(idx, codebook)
        x = inverse_randomized_hadamard(y, params["signs"])
        return (codes["norm"].astype(jnp.float32) * x).astype(dtype)

    def bits_per_element(self, head_dim: int) -> float:
        """Packed indices (word padding included) plus the fp16 norm."""
        self.check_head_dim(head_dim)
        return exact_bits(32 * packed_words(head_dim, self.bits) + 16, head_dim)
