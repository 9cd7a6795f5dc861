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

TurboQuant-QJL, ``turboquant:bB,qjl`` (B >= 2): the MSE stage gets ``B - 1`` bits and the
residual ``r = x - x_mse`` a 1-bit QJL sketch, ``sign(G r)`` for a seeded Gaussian
``G[D, D]`` (per layer, kv head, K|V), with ``|r|`` in fp16. For a query ``q``,

    <q, r>  ~  sqrt(pi / 2) / D * |r| * <G q, sign(G r)>

is unbiased over the draw of ``G`` (for a Gaussian row g, ``E[<g, q> sign(<g, r>)] =
sqrt(2 / pi) <q, r> / |r|``); for one fixed ``G`` it is not, and its error shrinks like
``|q| |r| / sqrt(D)``. :meth:`TurboQuantCodec.scores` computes ``<q, x_mse>`` plus that
estimate with ``G q`` formed once per query; ``decode`` returns the matching
reconstruction ``x_mse + sqrt(pi / 2) / D |r| G^T sign(G r)``, whose inner products are
the same estimates. Extra codes: ``qjl`` uint32[..., T, D / 32] (the signs) and
``residual_norm`` float16[..., T, 1]; bits ``B + 32 / D`` at D a multiple of 32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax import lloyd
from kvjax.codebooks import lloyd_codebook
from kvjax.codec import (
    EXACT,
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
    """TurboQuant-MSE with ``bits`` per rotated coordinate (``turboquant:bB``), or
    TurboQuant-QJL with ``qjl=True`` (``turboquant:bB,qjl``); see the module docstring."""

    name: ClassVar[str] = "turboquant"

    bits: int
    qjl: bool = False

    def __post_init__(self) -> None:
        check_range(self.bits, "bits", self.name, MIN_BITS + int(self.qjl), MAX_BITS)
        if not isinstance(self.qjl, bool):
            raise CodecError(f"{self.name}: qjl must be a bool, got {self.qjl!r}")

    @property
    def scores_reconstruct(self) -> bool:  # type: ignore[override]
        """False with QJL: attention calls :meth:`scores`, the estimator."""
        return not self.qjl

    @property
    def mse_bits(self) -> int:
        """Bits of the Lloyd-Max stage: B, or B - 1 beside the QJL sketch."""
        return self.bits - int(self.qjl)

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

    def value_codec(self) -> Codec:
        """Group-wise INT of V: ``kivi:max(B, 2),g32,token``."""
        return KiviCodec(bits=max(self.bits, 2), group=VALUE_GROUP, per_token=True)

    def check_head_dim(self, head_dim: int) -> None:
        """A power of two (the rotation)."""
        check_power_of_two(self, head_dim)

    def init(self, key: jax.Array, head_dim: int) -> Params:
        """``{"signs": float32[D]}``, the rotation's seeded sign flips, and with QJL
        ``"sketch": float32[D, D]``, the Gaussian ``G``."""
        self.check_head_dim(head_dim)
        rotation_key, sketch_key = jax.random.split(key)
        params = {"signs": random_signs(rotation_key, head_dim)}
        if self.qjl:
            params["sketch"] = jax.random.normal(sketch_key, (head_dim, head_dim), jnp.float32)
        return params

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        codes = self._encode_mse(params, x)
        if self.qjl:
            residual = x - self._decode_mse(params, codes)
            rnorm = jnp.linalg.norm(residual, axis=-1, keepdims=True)
            rnorm = round_to_dtype(jnp.minimum(rnorm, FP16_MAX), jnp.float16)
            projected = jnp.einsum("...d,ed->...e", residual, params["sketch"],
                                   precision=EXACT)
            codes["qjl"] = pack_bits((projected >= 0).astype(jnp.uint32), 1)
            codes["residual_norm"] = rnorm.astype(jnp.float16)
        return codes

    def _encode_mse(self, params: Params, x: jax.Array) -> Codes:
        head_dim = x.shape[-1]
        codebook = rotated_coordinate_codebook(head_dim, self.mse_bits)
        norm = jnp.linalg.norm(jnp.clip(x, -FP16_MAX, FP16_MAX), axis=-1, keepdims=True)
        norm = jnp.minimum(norm, FP16_MAX)
        norm = jnp.where(norm > 0, jnp.maximum(norm, FP16_TINY), 0.0)
        norm = round_to_dtype(norm, jnp.float16)
        unit = x / jnp.where(norm > 0, norm, 1.0)
        y = randomized_hadamard(unit, params["signs"])
        idx = lloyd.quantize(y, codebook)
        return {"codes": pack_bits(idx, self.mse_bits), "norm": norm.astype(jnp.float16)}

    def _decode_mse(self, params: Params, codes: Codes) -> jax.Array:
        head_dim = params["signs"].shape[-1]
        codebook = rotated_coordinate_codebook(head_dim, self.mse_bits)
        idx = unpack_bits(codes["codes"], self.mse_bits, head_dim)
        y = lloyd.dequantize(idx, codebook)
        x = inverse_randomized_hadamard(y, params["signs"])
        return codes["norm"].astype(jnp.float32) * x

    def _qjl_sign_vectors(self, params: Params, codes: Codes) -> tuple[jax.Array, jax.Array]:
        """``(sign(G r) as +-1 float32 [..., D], sqrt(pi/2) / D * |r| [..., 1])``."""
        head_dim = params["signs"].shape[-1]
        bits = unpack_bits(codes["qjl"], 1, head_dim).astype(jnp.float32)
        scale = math.sqrt(math.pi / 2) / head_dim
        return 2.0 * bits - 1.0, scale * codes["residual_norm"].astype(jnp.float32)

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """``|x| * s * H(c[idx])`` (plus, with QJL, the unbiased residual estimate
        ``sqrt(pi/2) / D |r| G^T sign(G r)``), cast to ``dtype``."""
        x = self._decode_mse(params, codes)
        if self.qjl:
            signs, scale = self._qjl_sign_vectors(params, codes)
            x = x + scale * jnp.einsum("...e,ed->...d", signs, params["sketch"],
                                       precision=EXACT)
        return x.astype(dtype)

    def scores(self, params: Params, q: jax.Array, codes: Codes) -> jax.Array:
        """``<q, x_mse>`` plus, with QJL, the estimator of ``<q, r>`` from ``G q``."""
        q = q.astype(jnp.float32)
        out = jnp.einsum("...qd,...sd->...qs", q, self._decode_mse(params, codes),
                         precision=EXACT)
        if self.qjl:
            signs, scale = self._qjl_sign_vectors(params, codes)
            gq = jnp.einsum("...qd,ed->...qe", q, params["sketch"], precision=EXACT)
            out = out + jnp.einsum("...qe,...se->...qs", gq, signs,
                                   precision=EXACT) * jnp.swapaxes(scale, -1, -2)
        return out

    def bits_per_element(self, head_dim: int) -> float:
        """Packed indices (word padding included) plus the fp16 norm; with QJL the sign
        words and the fp16 residual norm too."""
        self.check_head_dim(head_dim)
        bits = 32 * packed_words(head_dim, self.mse_bits) + 16
        if self.qjl:
            bits += 32 * packed_words(head_dim, 1) + 16
        return exact_bits(bits, head_dim)
