"""Naive token-wise asymmetric N-bit integer quantization: ``int:N`` (N in 2..8).

Every vector (one token of one head) gets its own range: ``zero = min``,
``scale = (max - min) / (2**N - 1)``, both stored as fp16 (below fp16's smallest normal
on its subnormal grid, the scale rounded up there: :func:`fp16_scale`), and each element
becomes ``q = round((x - zero) / scale)`` clipped to ``[0, 2**N - 1]``, bit-packed with
:func:`kvjax.primitives.packing.pack_codes` (planar for N in 2, 4, 8, split for N = 3 at
D a multiple of 32, else dense). This is the "naive int" baseline of the HQMQ paper and
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
    FP16_MAX,
    FP16_STEP,
    FP16_TINY,
    Codec,
    Codes,
    Example,
    IntFormat,
    Limits,
    Option,
    Params,
    packed_words,
    register,
    round_to_dtype,
)
from kvjax.primitives.packing import pack_codes, unpack_codes

MIN_BITS, MAX_BITS = 2, 8


# -- helpers shared by the scalar codecs (int, kivi, hqmq) --------------------------------


def head_dim_marker(x: jax.Array) -> jax.Array:
    """A zero-byte ``uint8[..., T, 0, D]`` array whose last axis records ``D``.

    Packed words alone do not determine ``D`` (``ceil(D * N / 32)`` words fit several
    ``D``), and :meth:`Codec.decode` gets only params and codes, so codecs whose other
    arrays lose ``D`` carry it in a shape. It costs no storage and follows the
    ``[..., T // block_tokens]`` leading-axes rule like every other leaf.
    """
    return jnp.zeros((*x.shape[:-1], 0, x.shape[-1]), jnp.uint8)


def fp16_scale(scale: jax.Array) -> jax.Array:
    """A non-negative grid step as the fp16 value that is stored (returned as float32).

    In fp16's normal range it is rounded to nearest. Below :data:`~kvjax.codec.FP16_TINY`
    it is rounded *up* to the next multiple of :data:`~kvjax.codec.FP16_STEP`: there the
    grid is absolute, and rounding a scale of 1.4 steps down to 1 would make the top
    codes clip 30% of the range, while rounding up only widens the steps by at most
    ``FP16_STEP``. So a tiny range keeps codes that span it, and its error stays on the
    order of ``FP16_STEP`` instead of the whole vector (a floor at ``FP16_TINY``, the
    smallest normal, would round every code of a vector near 1e-6 to the zero point).
    """
    up = jnp.ceil(scale * np.float32(1.0 / FP16_STEP)) * np.float32(FP16_STEP)
    return jnp.where(scale < FP16_TINY, up, round_to_dtype(scale, jnp.float16))


def asymmetric_params(lo: jax.Array, hi: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """fp16 ``(scale, zero)`` of an asymmetric ``bits``-bit grid spanning ``[lo, hi]``.

    Inputs lie within fp16 range (the codecs' :attr:`~kvjax.codec.Codec.limits`), so
    ``hi - lo`` over the level count stays finite in fp16 for ``bits >= 2``. A constant
    range gives scale 0, which :func:`quantize` guards. Scale and zero below fp16's
    smallest normal are stored on its subnormal grid (:func:`fp16_scale`).
    """
    # a compiler that sees a constant divisor may multiply by its rounded reciprocal
    # instead (XLA does under jit), changing the last bit; multiplying explicitly gives
    # the same scale eagerly, under jit and in a numpy reference
    scale = fp16_scale((hi - lo) * np.float32(1.0 / (2**bits - 1)))
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
        "codes": pack_codes(q, bits),
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

    Constant vectors get scale 0 and decode to their fp16-rounded value. The fp16 zero
    point (the smallest element) bounds every element by ``FP16_MAX``.
    """

    name: ClassVar[str] = "int"
    limits: ClassVar[Limits] = Limits(element=FP16_MAX)
    options: ClassVar[tuple[Option, ...]] = (BITS_OPTION,)
    examples: ClassVar[tuple[Example, ...]] = (
        Example("int:4", rel_mse=0.012), Example("int:3", rel_mse=0.055, head_dim=80),
    )

    bits: int

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        del params
        lo = jnp.min(x, axis=-1, keepdims=True)
        hi = jnp.max(x, axis=-1, keepdims=True)
        scale, zero = asymmetric_params(lo, hi, self.bits)
        return token_codes(quantize(x, scale, zero, self.bits), scale, zero, self.bits)

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """``zero + q * scale`` per vector, cast to ``dtype``."""
        del params
        q = unpack_codes(codes["codes"], self.bits, codes["head_dim"].shape[-1])
        return dequantize(q, codes["scale"], codes["zero"]).astype(dtype)

    def bits_per_element(self, head_dim: int) -> float:
        """Packed codes (word padding included) plus fp16 scale and zero per vector."""
        self.check_head_dim(head_dim)
        return exact_bits(32 * packed_words(head_dim, self.bits) + 2 * 16, head_dim)

    # -- kernel formats -------------------------------------------------------------
    def kernel_formats(self) -> tuple[IntFormat, ...]:
        """The stored arrays are token-wise ``bits``-bit codes with fp16 scale and zero."""
        return (IntFormat(bits=self.bits),)
