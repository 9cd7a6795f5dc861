"""KIVI (Liu et al., 2024): keys per channel, values per token, asymmetric N-bit.

KIVI's observation is that key outliers live in a few fixed *channels*: quantizing a
key per token lets those channels set every token's range and crushes the others, while
grouping a channel over ``G`` consecutive tokens gives each channel a range of its own.
Values have no such channel structure and matter per token (attention mixes them row
by row), so they are quantized per token, in groups of ``G`` channels.

Spec grammar::

    kivi:N[,gG][,token]     N in 2..8 (bits), G in 1..4096 (default 32)

    kivi:2,g32          key variant: per channel over blocks of G tokens
    kivi:2,g32,token    value variant: per token over groups of G channels

The cache spec ``kivi:2,g32`` pairs the key variant for K with :meth:`KiviCodec.value_codec`
(the token variant, same N and G) for V, as the paper does.

Key variant, ``block_tokens = G``; codes of ``x[..., T, D]`` with ``B = T // G``::

    codes  uint32[..., B, G, W]    W = ceil(D * N / 32): each token's D codes packed
    scale  float16[..., B, D]      one (scale, zero) per (block, channel)
    zero   float16[..., B, D]

    bits = 32 * W / D + 32 / G

The cache keeps an unfinished group of keys raw until G tokens have arrived (KIVI's
residual), so this codec only ever sees whole groups.

Value variant, ``block_tokens = 1``. When G does not divide D the last channel group is
shorter (``ceil(D / G')`` groups of ``G' = min(G, D)`` channels, the last one ragged)
rather than an error: head dims such as 80 or 112 then work with the paper's G = 32,
and the fp16 pairs of the ragged group are counted like the others::

    codes     uint32[..., T, W]
    scale     float16[..., T, ceil(D / G')]
    zero      float16[..., T, ceil(D / G')]
    head_dim  uint8[..., T, 0, D]   zero bytes; records D (see ``head_dim_marker``)

    bits = 32 * W / D + 32 * ceil(D / G') / D

With ``G >= D`` the value variant is exactly ``int:N``.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax.codec import (
    FP16_MAX,
    Codec,
    Codes,
    Example,
    GroupIntFormat,
    Limits,
    Option,
    Params,
    packed_words,
    register,
)
from kvjax.codecs.intn import (
    BITS_OPTION,
    asymmetric_params,
    dequantize,
    exact_bits,
    quantize,
    token_codes,
)
from kvjax.primitives.packing import pack_codes, unpack_codes

MIN_GROUP, MAX_GROUP = 1, 4096
DEFAULT_GROUP = 32


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class KiviCodec(Codec):
    """KIVI asymmetric quantization: per channel over ``group`` tokens, or per token.

    ``per_token=False`` (the default, spec ``kivi:N,gG``) is KIVI's key quantizer,
    ``per_token=True`` (spec ``kivi:N,gG,token``) its value quantizer.
    """

    name: ClassVar[str] = "kivi"
    #: fp16 zero points (a group's smallest element) bound every element
    limits: ClassVar[Limits] = Limits(element=FP16_MAX)
    options: ClassVar[tuple[Option, ...]] = (
        BITS_OPTION,
        Option.flag("group", "g", "group size", "G", lo=MIN_GROUP, hi=MAX_GROUP, always=True),
        Option.word("per_token", "token", "per-token variant"),
    )
    examples: ClassVar[tuple[Example, ...]] = (
        Example("kivi:2,g32", rel_mse=0.2), Example("kivi:3,g7,token", rel_mse=0.015, head_dim=80),
        Example("kivi:4", rel_mse=0.012),
    )

    bits: int
    group: int = DEFAULT_GROUP
    per_token: bool = False

    @property
    def block_tokens(self) -> int:  # type: ignore[override]
        """``G`` for keys (a channel's range spans G tokens), 1 for values."""
        return 1 if self.per_token else self.group

    def value_codec(self) -> KiviCodec:
        """The per-token variant with the same bits and group size."""
        return dataclasses.replace(self, per_token=True)

    # -- protocol -----------------------------------------------------------------------
    def _channel_group(self, head_dim: int) -> tuple[int, int]:
        """``(G', number of channel groups)`` of the value variant."""
        size = min(self.group, head_dim)
        return size, math.ceil(head_dim / size)

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        del params
        if self.per_token:
            return self._encode_tokens(x)
        return self._encode_channels(x)

    def _encode_channels(self, x: jax.Array) -> Codes:
        *lead, t, d = x.shape
        blocks = x.reshape(*lead, t // self.group, self.group, d)
        scale, zero = asymmetric_params(
            jnp.min(blocks, axis=-2), jnp.max(blocks, axis=-2), self.bits
        )
        q = quantize(blocks, scale[..., None, :], zero[..., None, :], self.bits)
        return {"codes": pack_codes(q, self.bits), "scale": scale, "zero": zero}

    def _encode_tokens(self, x: jax.Array) -> Codes:
        *lead, t, d = x.shape
        size, count = self._channel_group(d)
        # repeating the last channel fills the ragged group without moving its min/max
        padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size * count - d)], mode="edge")
        groups = padded.reshape(*lead, t, count, size)
        scale, zero = asymmetric_params(
            jnp.min(groups, axis=-1), jnp.max(groups, axis=-1), self.bits
        )
        q = quantize(groups, scale[..., None], zero[..., None], self.bits)
        q = q.reshape(*lead, t, size * count)[..., :d]
        return token_codes(q, scale, zero, self.bits)

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """``zero + q * scale`` with each code's (block, channel) or (token, group) pair."""
        del params
        if self.per_token:
            d = codes["head_dim"].shape[-1]
            size, _ = self._channel_group(d)
            q = unpack_codes(codes["codes"], self.bits, d)
            scale = jnp.repeat(codes["scale"], size, axis=-1)[..., :d]
            zero = jnp.repeat(codes["zero"], size, axis=-1)[..., :d]
            return dequantize(q, scale, zero).astype(dtype)
        d = codes["scale"].shape[-1]
        q = unpack_codes(codes["codes"], self.bits, d)
        x = dequantize(q, codes["scale"][..., None, :], codes["zero"][..., None, :])
        *lead, blocks, group, _ = x.shape
        return x.reshape(*lead, blocks * group, d).astype(dtype)

    def kernel_formats(self) -> tuple[GroupIntFormat, ...]:
        """The value variant's codes with their per-group scales and zeros."""
        return (GroupIntFormat(bits=self.bits, group=self.group),) if self.per_token else ()

    def bits_per_element(self, head_dim: int) -> float:
        """Packed codes (word padding included) plus the fp16 scale/zero pairs."""
        self.check_head_dim(head_dim)
        code_bits = Fraction(32 * packed_words(head_dim, self.bits), head_dim)
        if self.per_token:
            _, count = self._channel_group(head_dim)
            return exact_bits(code_bits + Fraction(2 * 16 * count, head_dim), 1)
        return exact_bits(code_bits + Fraction(2 * 16, self.group), 1)
