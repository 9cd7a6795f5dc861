"""The rotation-preconditioned family's common frame: norm, rotation, QJL residual, V codec.

TurboQuant, PolarQuant and OCTOPUS differ only in how they quantize the *rotated unit
vector*. Everything around that is shared, so that a comparison between them isolates
the K quantizer (the OCTOPUS paper's protocol):

* ``x[..., D]`` (``D`` a power of two) is stored as its norm ``|x|`` (fp16) and the unit
  vector rotated by ``y = H(s * x / |x|)``, ``H`` the orthonormal Walsh-Hadamard
  transform and ``s`` seeded signs drawn per (layer, kv head, K|V). After the rotation
  every coordinate of ``y`` follows (closely; exactly for a uniformly random rotation)
  the marginal of one coordinate of a uniform point on S^{D-1}, whatever ``x`` was, so
  data-free codebooks designed for that law fit every input.
* With ``qjl``, the residual ``r = x - x_hat`` of the quantizer gets a 1-bit sketch
  ``sign(G r)`` for a seeded Gaussian ``G[D, D]`` and its norm ``|r|`` (fp16). For a
  query ``q``, ``<q, r> ~ sqrt(pi / 2) / D * |r| * <G q, sign(G r)>`` is unbiased over the
  draw of ``G`` (for a Gaussian row ``g``, ``E[<g, q> sign(<g, r>)] = sqrt(2 / pi) <q, r> /
  |r|``); for one fixed ``G`` it is not, and its error shrinks like ``|q| |r| / sqrt(D)``.
  :meth:`RotatedCodec.scores` adds that estimate to ``<q, x_hat>`` with ``G q`` formed once
  per query; ``decode`` returns the matching reconstruction ``x_hat + sqrt(pi / 2) / D |r|
  G^T sign(G r)``, whose inner products are the same estimates. The OCTOPUS paper
  sketches with a second randomized Hadamard instead of a Gaussian ``G``; the Gaussian
  makes the estimator exactly unbiased and is the same for every codec of the family.
* Values are stored by the group-wise INT of the OCTOPUS paper's LLM recipe,
  ``kivi:max(B, 2),g32,token``, for every member at nominal bit width ``B``.

Codes shared by every member: ``norm`` float16[..., T, 1], and with QJL ``qjl``
uint32[..., T, D / 32] (the signs) and ``residual_norm`` float16[..., T, 1].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.codec import (
    EXACT,
    FP16_MAX,
    Codec,
    CodecError,
    Codes,
    Limits,
    Option,
    Params,
    packed_words,
    round_to_dtype,
)
from kvjax.codecs.intn import exact_bits
from kvjax.codecs.kivi import KiviCodec
from kvjax.primitives.packing import pack_bits, unpack_bits
from kvjax.primitives.rotations import (
    inverse_randomized_hadamard,
    random_signs,
    randomized_hadamard,
)

#: channel group of the value codec (the paper's V group of 32)
VALUE_GROUP = 32
#: the ``qjl`` option of the members that have a QJL variant
QJL_OPTION = Option.word("qjl", "qjl", "QJL residual sketch")


def check_power_of_two(codec: Codec, head_dim: int) -> None:
    """The Walsh-Hadamard rotation needs ``head_dim`` a power of two."""
    Codec.check_head_dim(codec, head_dim)
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise CodecError(f"{codec.spec}: head_dim must be a power of two >= 2 (the "
                         f"Walsh-Hadamard rotation), got {head_dim}")


def stored_norm(x: jax.Array) -> jax.Array:
    """``|x|`` over the last axis as the fp16 value that is stored (returned as float32).

    ``x`` is within the codec's limits (a norm of at most ``FP16_MAX``, so no square
    overflows float32). A norm below fp16's smallest normal is kept on its subnormal
    grid: absolute precision ``FP16_STEP / 2`` rather than a floor that would inflate a
    vector near 1e-6 several times over.
    """
    return round_to_dtype(jnp.linalg.norm(x, axis=-1, keepdims=True), jnp.float16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RotatedCodec(Codec):
    """Base of the family: subclasses quantize the rotated unit vector through
    :meth:`encode_unit` / :meth:`decode_unit` and count its bits in :meth:`unit_bits`."""

    qjl: bool = False

    @property
    def limits(self) -> Limits:  # type: ignore[override]
        """The fp16 norm bounds ``|x|`` by ``FP16_MAX``; with QJL by half that: the fp16
        residual norm ``|x - x_hat|`` can exceed ``|x|`` (about ``1.28 |x|`` at 1 bit
        per coordinate, for a vector that rotates onto one axis)."""
        return Limits(norm=FP16_MAX / 2 if self.qjl else FP16_MAX)

    @property
    def scores_reconstruct(self) -> bool:  # type: ignore[override]
        """False with QJL: attention calls :meth:`scores`, the estimator."""
        return not self.qjl

    @property
    def value_bits(self) -> int:
        """The nominal bit width ``B``, which sets the V codec."""
        raise NotImplementedError

    # -- what a member defines --------------------------------------------------------
    def encode_unit(self, y: jax.Array) -> Codes:
        """Codes of rotated unit vectors ``y[..., T, D]``."""
        raise NotImplementedError

    def decode_unit(self, codes: Codes, head_dim: int) -> jax.Array:
        """The quantized rotated unit vectors ``y_hat[..., T, D]``."""
        raise NotImplementedError

    def unit_bits(self, head_dim: int) -> int:
        """Stored bits per vector of :meth:`encode_unit`'s codes."""
        raise NotImplementedError

    # -- the shared frame -------------------------------------------------------------
    def value_codec(self) -> Codec:
        """Group-wise INT of V: ``kivi:max(B, 2),g32,token``."""
        return KiviCodec(bits=max(self.value_bits, 2), group=VALUE_GROUP, per_token=True)

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
        if params["signs"].shape[-1] != x.shape[-1]:
            raise CodecError(f"{self.spec}: vectors of head_dim {x.shape[-1]} given to "
                             f"parameters made for head_dim {params['signs'].shape[-1]}")
        norm = stored_norm(x)
        y = randomized_hadamard(x / jnp.where(norm > 0, norm, 1.0), params["signs"])
        codes = self.encode_unit(y)
        codes["norm"] = norm.astype(jnp.float16)
        if self.qjl:
            residual = x - self.decode_quantized(params, codes)
            rnorm = round_to_dtype(jnp.linalg.norm(residual, axis=-1, keepdims=True),
                                   jnp.float16)
            projected = jnp.einsum("...d,ed->...e", residual, params["sketch"],
                                   precision=EXACT)
            codes["qjl"] = pack_bits((projected >= 0).astype(jnp.uint32), 1)
            codes["residual_norm"] = rnorm.astype(jnp.float16)
        return codes

    def decode_quantized(self, params: Params, codes: Codes) -> jax.Array:
        """``|x| * s * H(y_hat)``: the reconstruction without the QJL term, float32."""
        head_dim = params["signs"].shape[-1]
        x = inverse_randomized_hadamard(self.decode_unit(codes, head_dim), params["signs"])
        return codes["norm"].astype(jnp.float32) * x

    def _qjl_sign_vectors(self, params: Params, codes: Codes) -> tuple[jax.Array, jax.Array]:
        """``(sign(G r) as +-1 float32 [..., D], sqrt(pi/2) / D * |r| [..., 1])``."""
        head_dim = params["signs"].shape[-1]
        bits = unpack_bits(codes["qjl"], 1, head_dim).astype(jnp.float32)
        scale = math.sqrt(math.pi / 2) / head_dim
        return 2.0 * bits - 1.0, scale * codes["residual_norm"].astype(jnp.float32)

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """``|x| * s * H(y_hat)`` (plus, with QJL, the unbiased residual estimate
        ``sqrt(pi/2) / D |r| G^T sign(G r)``), cast to ``dtype``."""
        x = self.decode_quantized(params, codes)
        if self.qjl:
            signs, scale = self._qjl_sign_vectors(params, codes)
            x = x + scale * jnp.einsum("...e,ed->...d", signs, params["sketch"],
                                       precision=EXACT)
        return x.astype(dtype)

    def scores(self, params: Params, q: jax.Array, codes: Codes) -> jax.Array:
        """``<q, x_hat>`` plus, with QJL, the estimator of ``<q, r>`` from ``G q``."""
        q = q.astype(jnp.float32)
        out = jnp.einsum("...qd,...sd->...qs", q, self.decode_quantized(params, codes),
                         precision=EXACT)
        if self.qjl:
            signs, scale = self._qjl_sign_vectors(params, codes)
            gq = jnp.einsum("...qd,ed->...qe", q, params["sketch"], precision=EXACT)
            out = out + jnp.einsum("...qe,...se->...qs", gq, signs,
                                   precision=EXACT) * jnp.swapaxes(scale, -1, -2)
        return out

    def bits_per_element(self, head_dim: int) -> float:
        """The quantizer's bits plus the fp16 norm; with QJL the sign words and the fp16
        residual norm too."""
        self.check_head_dim(head_dim)
        bits = self.unit_bits(head_dim) + 16
        if self.qjl:
            bits += 32 * packed_words(head_dim, 1) + 16
        return exact_bits(bits, head_dim)
