"""Median-multiplier outlier extraction (the HQMQ paper's Med-C) around any token-wise
codec: ``SPEC,medC[,mbN][,mpP]``, e.g. ``hqmq:s96,r4,med3`` or ``int:4,med3``.

Vectors are cut into chunks of 4 elements (zero-padded at the end). Within a block of
``N`` tokens (default 32) of one row and kv head, a chunk whose norm exceeds ``C`` times
the median chunk norm of the block is an *outlier*: its 4 values are stored as fp16 in
one of the block's outlier slots and a 1-bit flag marks it; the base codec encodes the
vectors with the outlier chunks set to zero (so they do not stretch its ranges) and its
codes of those chunks are ignored at decode.

Streaming. The paper takes the median over everything encoded at once per (layer,
head, K|V); here the unit is the block: a token is compressed when its block of ``N``
tokens is complete, with that block's median (1024 chunk norms at N = 32, D = 128), and
until then it stays raw in the cache (``block_tokens = N``, like KIVI's key groups). The
threshold therefore never carries over from the prefill: every block, prefilled or
decoded, is judged by its own median, and decode tokens are judged exactly as they
would be had they been part of the prompt.

Fixed capacity. A block has ``ceil(P% * N * ceil(D / 4))`` outlier slots (``mpP``,
default 3%). When more chunks exceed the threshold, the largest ones (by norm) fill the
slots and the rest go to the base codec like any other chunk (nothing is dropped: they
are quantized, coarser, and stretch their vector's range); the block's ``overflow``
count records how many chunks that happened to (:meth:`MedOutlierCodec.outlier_counts`;
over a whole cache, :func:`kvjax.cache.outlier_overflow`, which evaluation reports).

Uncapped. The paper's Med-C has no cap: every chunk above ``C`` x the median is stored
exactly. ``mp100`` is that form here: a slot for every chunk of the block (``N *
ceil(D / 4)``), so no chunk ever overflows. The layout stays fixed, so the cache then
holds a 64-bit slot per chunk whether it is an outlier or not, about ``16 + 1/4`` bits
per element over the base codec (``int:4,med3,mp100``: 20.51 bits at N = 32, D = 128),
and :meth:`MedOutlierCodec.bits_per_element` and the cache's stored bits count exactly
that. The paper's count is variable-length: :meth:`MedOutlierCodec.paper_bits_per_element`
at the measured outlier fraction, ``(outliers + overflow) / chunks`` of
:func:`kvjax.cache.outlier_overflow` (the threshold does not depend on the capacity, so
a capped cache measures that fraction too).

Codes of ``x[..., T, D]``, ``NB = T // N`` blocks, ``C4 = ceil(D / 4)`` chunks::

    base      the base codec's codes, leaves reshaped [..., NB, N, ...]
    flags     uint32[..., NB, ceil(N * C4 / 32)]   1 bit per chunk, token-major
    outliers  float16[..., NB, K, 4]               K slots, in chunk order of the flags
    overflow  uint32[..., NB, 1]

Bits per element: the base codec's plus ``(32 * flag words + 64 K + 32) / (N * D)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax.codec import (
    FP16_MAX,
    Codec,
    CodecError,
    Codes,
    Example,
    HqmqFormat,
    KernelFormat,
    Limits,
    Option,
    OutlierBlocks,
    Params,
)
from kvjax.codecs.intn import exact_bits
from kvjax.primitives.packing import num_words, pack_bits
from kvjax.primitives.quaternion import num_chunks, replace_outliers, to_chunks

DEFAULT_MULTIPLIER, DEFAULT_BLOCK, DEFAULT_CAPACITY_PCT = 3.0, 32, 3.0
MIN_BLOCK, MAX_BLOCK = 1, 1024
MAX_MULTIPLIER = 1e4


@dataclasses.dataclass(frozen=True, kw_only=True)
class MedOutlierCodec(Codec):
    """Med-C outlier chunks in fp16 around a token-wise ``base`` codec (module doc)."""

    name: ClassVar[str] = "med"
    #: appended to the base codec's options (:func:`kvjax.spec.parse_codec` splits them off)
    options: ClassVar[tuple[Option, ...]] = (
        Option.flag("multiplier", "med", "outlier multiplier", "C", type=float, lo=0,
                    lo_open=True, hi=MAX_MULTIPLIER, required=True, always=True),
        Option.flag("block", "mb", "outlier block", "N", lo=MIN_BLOCK, hi=MAX_BLOCK),
        Option.flag("capacity_pct", "mp", "outlier capacity %", "P", type=float, lo=0,
                    lo_open=True, hi=100,
                    note="P in (0, 100] (default 3; 100: a slot for every chunk, no cap)"),
    )
    examples: ClassVar[tuple[Example, ...]] = (
        Example("int:4,med3,mb8,mp5", rel_mse=0.012),
        Example("hqmq:s24,r4,med2.5", rel_mse=0.05, seeded=True),
        # uncapped: a slot for every chunk
        Example("int:4,med2,mb4,mp100", rel_mse=0.012),
    )

    base: Codec
    multiplier: float = DEFAULT_MULTIPLIER
    block: int = DEFAULT_BLOCK
    capacity_pct: float = DEFAULT_CAPACITY_PCT

    def validate(self) -> None:
        """The base is a lossy token-wise codec whose scores are ``q . decode``."""
        if not isinstance(self.base, Codec) or isinstance(self.base, MedOutlierCodec):
            raise CodecError(f"med: base must be a codec without outliers, got {self.base!r}")
        if not self.base.lossy or self.base.block_tokens != 1:
            raise CodecError("med: outlier extraction (medC) needs a lossy token-wise codec, "
                             f"got {self.base.spec}")
        if not self.base.scores_reconstruct:
            raise CodecError("med: outlier extraction needs a codec whose scores are "
                             f"q . decode(codes), got {self.base.spec}")

    @classmethod
    def usage(cls, head: str = "SPEC", sep: str = ",") -> str:
        """``SPEC,medC[,mbN][,mpP]`` with the valid values."""
        return super().usage(head, sep)

    @classmethod
    def claims(cls, token: str) -> bool:
        """Whether ``token`` is an outlier option: one that spells ``medC``, ``mbN`` or
        ``mpP``, or any other token that starts with ``med``, ``mb`` or ``mp``, so that a
        misspelled one is reported against the outlier usage rather than the base
        codec's."""
        return any(token.startswith(opt.text) for opt in cls.options)

    @property
    def block_tokens(self) -> int:  # type: ignore[override]
        """Tokens that share a median and the outlier slots."""
        return self.block

    @property
    def limits(self) -> Limits:  # type: ignore[override]
        """The base codec's, with elements bounded by ``FP16_MAX`` (the outlier chunks
        are stored in fp16). Zeroing outlier chunks only shortens a vector, so what the
        base codec encodes stays within its own limits."""
        base = self.base.limits
        return Limits(element=min(base.element, FP16_MAX), norm=base.norm)

    @property
    def spec(self) -> str:
        """``BASE,medC`` (``BASE:medC`` for a base without options), then ``mbN`` and
        ``mpP`` where not the defaults."""
        base = self.base.spec
        return base + ("," if ":" in base else ":") + ",".join(self.spec_options())

    def value_codec(self) -> Codec:
        """Outliers are extracted from V too, around the base's value codec."""
        return dataclasses.replace(self, base=self.base.value_codec())

    def check_head_dim(self, head_dim: int) -> None:
        """The base codec's rule."""
        self.base.check_head_dim(head_dim)

    def capacity(self, head_dim: int) -> int:
        """Outlier slots per block: every chunk of the block at ``mp100``."""
        return max(1, math.ceil(self.capacity_pct / 100 * self.block * num_chunks(head_dim)))

    # -- protocol ---------------------------------------------------------------------
    def init(self, key: jax.Array, head_dim: int) -> Params:
        """The base codec's parameters."""
        return self.base.init(key, head_dim)

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        head_dim, tokens = x.shape[-1], x.shape[-2]
        lead, nb, n = x.shape[:-2], tokens // self.block, self.block
        c4 = num_chunks(head_dim)
        chunks = to_chunks(x).reshape(*lead, nb, n * c4, 4)
        norm = jnp.linalg.norm(chunks, axis=-1)  # [..., NB, n * c4]
        threshold = self.multiplier * jnp.median(norm, axis=-1, keepdims=True)
        over = norm > threshold
        cap = self.capacity(head_dim)
        k = min(cap, n * c4)
        # the k largest chunks above the threshold, then in chunk order (the flags' order)
        top_norm, top_idx = jax.lax.top_k(jnp.where(over, norm, -1.0), k)
        kept = top_norm > threshold
        order = jnp.sort(jnp.where(kept, top_idx, n * c4), axis=-1)
        kept_sorted = order < n * c4
        safe = jnp.minimum(order, n * c4 - 1)
        payload = jnp.take_along_axis(chunks, safe[..., None], axis=-2)
        payload = jnp.where(kept_sorted[..., None], payload, 0.0)
        if cap > k:
            payload = jnp.pad(payload, [(0, 0)] * (payload.ndim - 2) + [(0, cap - k), (0, 0)])
        stored = jnp.zeros(norm.shape, bool)
        stored = jax.vmap(lambda s, i, m: s.at[i].set(m, mode="drop"))(
            stored.reshape(-1, n * c4), order.reshape(-1, k), kept_sorted.reshape(-1, k)
        ).reshape(norm.shape)
        overflow = jnp.sum(over, axis=-1, keepdims=True) - jnp.sum(stored, axis=-1,
                                                                   keepdims=True)

        inliers = jnp.where(stored[..., None], 0.0, chunks)
        inliers = inliers.reshape(*lead, tokens, 4 * c4)[..., :head_dim]
        base = self.base._encode(params, inliers)
        base = jax.tree.map(lambda a: a.reshape(*lead, nb, n, *a.shape[len(lead) + 1:]), base)
        return {
            "base": base,
            "flags": pack_bits(stored.astype(jnp.uint32), 1),
            "outliers": payload.astype(jnp.float16),
            "overflow": overflow.astype(jnp.uint32),
        }

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """The base codec's vectors with the flagged chunks replaced by their fp16 values."""
        base = codes["base"]
        lead_nb = codes["overflow"].shape[:-1]
        lead, nb, n = lead_nb[:-1], lead_nb[-1], self.block
        flat = jax.tree.map(lambda a: a.reshape(*lead, nb * n, *a.shape[len(lead) + 2:]), base)
        x = self.base.decode(params, flat, jnp.float32)
        x = replace_outliers(x, codes["flags"], codes["outliers"], n)
        return x.astype(dtype)

    def kernel_formats(self) -> tuple[KernelFormat, ...]:
        """The base's HQMQ format with these outliers (:class:`~kvjax.codec.OutlierBlocks`:
        its codes decode a flagged chunk to zero, the kernel adds the stored chunk); no
        other base's formats (their codes of a zeroed chunk are not zero)."""
        return tuple(dataclasses.replace(f, outliers=OutlierBlocks(self.block))
                     for f in self.base.kernel_formats() if isinstance(f, HqmqFormat))

    def outlier_counts(self, codes: Codes) -> tuple[jax.Array, jax.Array]:
        """Per block: (chunks stored as outliers, chunks over the threshold that did not
        fit in the slots and went to the base codec)."""
        stored = jnp.sum(jax.lax.population_count(codes["flags"]), axis=-1)
        return stored, codes["overflow"][..., 0]

    def bits_per_element(self, head_dim: int) -> float:
        """Base codec bits plus flags, outlier slots and the overflow count per block."""
        self.check_head_dim(head_dim)
        base = self.base.bits_per_element(head_dim)
        elements = self.block * head_dim
        extra = 32 * num_words(self.block * num_chunks(head_dim), 1) + 64 * self.capacity(
            head_dim) + 32
        return exact_bits(round(base * elements) + extra, elements)

    def paper_bits_per_element(self, head_dim: int, fraction: float) -> float:
        """The paper's variable-length count at an outlier fraction ``fraction`` of the
        chunks: ``(1 - p) b_base + 16 p + 1/4``, ``b_base`` the base codec's fractional
        bits where it has them (HQMQ), its stored bits otherwise."""
        base = getattr(self.base, "fractional_bits_per_element", self.base.bits_per_element)
        return (1 - fraction) * base(head_dim) + 16 * fraction + 0.25


