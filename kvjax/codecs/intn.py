"""Naive token-wise asymmetric N-bit integer quantization: ``int:N`` (N in 2..8).

Every vector (one token of one head) gets its own range: ``zero = min``,
``scale = (max - min) / (2**N - 1)``, both stored as fp16, and each element becomes
``q = round((x - zero) / scale)`` clipped to ``[0, 2**N - 1]``, bit-packed with
:func:`kvjax.primitives.packing.pack_bits`. This is the "naive int" baseline of the HQMQ paper and
the building block that KIVI reuses along other axes (:mod:`kvjax.codecs.kivi`).

Codes of ``x[..., T, D]``::

    codes     uint32[..., T, W]     W = ceil(D * N / 32), the D codes of a vector packed
    scale     float16[..., T, 1]
    zero      float16[..., T, 1]
    head_dim  uint8[..., T, 0, D]   zero bytes; records D (see :func:`head_dim_marker`)

Bits per element: ``32 * W / D + 32 / D``.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codec import (
    Codec,
    CodecError,
    Codes,
    Example,
    IntFormat,
    Option,
    Params,
    packed_words,
    register,
    round_to_dtype,
)
from kvjax.primitives.packing import pack_bits, unpack_bits

MIN_BITS, MAX_BITS = 2, 8
#: largest finite fp16: the scale and zero are fp16, so no vector may reach beyond it
FP16_MAX = float(jnp.finfo(jnp.float16).max)
FP16_TINY = float(jnp.finfo(jnp.float16).smallest_normal)


# -- helpers shared by the scalar codecs (int, kivi, fp8, bf16) ------------------------


def saturate(x: jax.Array, limit: float, spec: str) -> jax.Array:
    """Clip ``x`` to ``[-limit, limit]``; outside ``jit``, raise if anything exceeds it.

    The metadata (fp16 scales, bf16 storage) cannot represent larger magnitudes, so an
    eager caller gets a :class:`CodecError` instead of a silent wrong answer, while
    under ``jit`` (values unknown) clipping keeps the codes finite.
    """
    if not isinstance(x, jax.core.Tracer) and x.size and bool(jnp.max(jnp.abs(x)) > limit):
        raise CodecError(
            f"{spec}: input magnitude {float(jnp.max(jnp.abs(x))):.4g} exceeds {limit:.6g}, "
            "the largest value this codec's storage can represent"
        )
    return jnp.clip(x, -limit, limit)


def head_dim_marker(x: jax.Array) -> jax.Array:
    """A zero-byte ``uint8[..., T, 0, D]`` array whose last axis records ``D``.

    Packed words alone do not determine ``D`` (``ceil(D * N / 32)`` words fit several
    ``D``), and :meth:`Codec.decode` gets only params and codes, so codecs whose other
    arrays lose ``D`` carry it in a shape. It costs no storage and follows the
    ``[..., T // block_tokens]`` leading-axes rule like every other leaf.
    """
    return jnp.zeros((*x.shape[:-1], 0, x.shape[-1]), jnp.uint8)


def asymmetric_params(lo: jax.Array, hi: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """fp16 ``(scale, zero)`` of an asymmetric ``bits``-bit grid spanning ``[lo, hi]``.

    Inputs must lie within fp16 range (see :func:`saturate`), so ``hi - lo`` over the
    level count stays finite in fp16 for ``bits >= 2``. A constant range gives scale 0,
    which :func:`quantize` guards.
    """
    # a compiler that sees a constant divisor may multiply by its rounded reciprocal
    # instead (XLA does under jit), changing the last bit; multiplying explicitly gives
    # the same scale eagerly, under jit and in a numpy reference
    scale = (hi - lo) * np.float32(1.0 / (2**bits - 1))
    # a subnormal scale would flush to zero in round_to_dtype: floor it at the smallest
    # normal fp16 (ranges that small quantize finer than needed, never coarser)
    scale = jnp.where(scale > 0, jnp.maximum(scale, FP16_TINY), 0.0)
    scale = round_to_dtype(scale, jnp.float16)
    zero = round_to_dtype(lo, jnp.float16)
    return scale.astype(jnp.float16), zero.astype(jnp.float16)


def quantize(x: jax.Array, scale: jax.Array, zero: jax.Array, bits: int) -> jax.Array:
    """Codes ``uint32`` in ``[0, 2**bits - 1]`` of ``x`` on the grid ``zero + q * scale``.

    ``scale``/``zero`` must be the fp16-rounded values that get stored (broadcastable
    to ``x``), so that :func:`dequantize` reproduces exactly the grid the codes index.
    """
    s = scale.astype(jnp.float32)
    z = zero.astype(jnp.float32)
    positive = s > 0
    q = jnp.where(positive, jnp.round((x - z) / jnp.where(positive, s, 1.0)), 0.0)
    return jnp.clip(q, 0, 2**bits - 1).astype(jnp.uint32)


def dequantize(q: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
    """``zero + q * scale`` in float32 (the inverse grid map of :func:`quantize`)."""
    return zero.astype(jnp.float32) + q.astype(jnp.float32) * scale.astype(jnp.float32)


def token_codes(q: jax.Array, scale: jax.Array, zero: jax.Array, bits: int) -> Codes:
    """The stored arrays of per-token codes ``q[..., T, D]`` with their fp16 metadata."""
    return {
        "codes": pack_bits(q, bits),
        "scale": scale,
        "zero": zero,
        "head_dim": head_dim_marker(q),
    }


def exact_bits(bits: int | Fraction, elements: int | Fraction) -> float:
    """``bits / elements`` rounded once from the exact ratio.

    :func:`kvjax.codec.measured_bits_per_element` divides two integers once, so a
    formula summed from separately rounded terms (``3.2 + 0.4``) can differ from it in
    the last place; rounding the exact rational once makes them equal exactly.
    """
    return float(Fraction(bits) / Fraction(elements))


#: the bit width ``N`` of ``int:N`` and ``kivi:N``: the bare number of the spec
BITS_OPTION = Option.value("bits", "bit width", "N", lo=MIN_BITS, hi=MAX_BITS)


# -- the codec --------------------------------------------------------------------------


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class IntCodec(Codec):
    """Token-wise asymmetric ``bits``-bit quantization with fp16 scale and zero per vector.

    Constant vectors get scale 0 and decode to their fp16-rounded value.
    """

    name: ClassVar[str] = "int"
    options: ClassVar[tuple[Option, ...]] = (BITS_OPTION,)
    examples: ClassVar[tuple[Example, ...]] = (
        Example("int:4", rel_mse=0.012), Example("int:3", rel_mse=0.055, head_dim=80),
    )

    bits: int

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        del params
        x = saturate(x, FP16_MAX, self.spec)
        lo = jnp.min(x, axis=-1, keepdims=True)
        hi = jnp.max(x, axis=-1, keepdims=True)
        scale, zero = asymmetric_params(lo, hi, self.bits)
        return token_codes(quantize(x, scale, zero, self.bits), scale, zero, self.bits)

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """``zero + q * scale`` per vector, cast to ``dtype``."""
        del params
        q = unpack_bits(codes["codes"], self.bits, codes["head_dim"].shape[-1])
        return dequantize(q, codes["scale"], codes["zero"]).astype(dtype)

    def bits_per_element(self, head_dim: int) -> float:
        """Packed codes (word padding included) plus fp16 scale and zero per vector."""
        self.check_head_dim(head_dim)
        return exact_bits(32 * packed_words(head_dim, self.bits) + 2 * 16, head_dim)

    # -- kernel formats -------------------------------------------------------------
    def kernel_formats(self) -> tuple[IntFormat, ...]:
        """The stored arrays are token-wise ``bits``-bit codes with fp16 scale and zero."""
        return (IntFormat(bits=self.bits),)
