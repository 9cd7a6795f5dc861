"""Median-multiplier outlier extraction (the HQMQ paper's Med-C) around any token-wise
codec: ``SPEC,medC[,mbN][,mpP][,mpool]``, e.g. ``hqmq:s96,r4,med3`` or ``int:4,med3``.

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

Pooled capacity (``mpool``): the capacity is chosen per block from the data. The
``K`` slots of every block form one pool per row, and a block may take, beyond its own
``K``, the slots that the blocks before it left unused: block ``b``'s chunks fill the
pool from ``start[b]`` (the slots blocks ``0 .. b-1`` took) up to at most ``(b + 1) K``.
A block never takes slots from later blocks, so a decoded token always finds the
share it would have had in the fixed layout, and the pool holds exactly the fixed
layout's slots plus one word per block (``start``). A block with many outliers after
quiet ones keeps them all; the first block of a row can still overflow. A cache that
appends blocks one by one places each after its row's last
(:meth:`MedOutlierCodec.encode_after`), as one encode of the whole row would.

Codes of ``x[..., T, D]``, ``NB = T // N`` blocks, ``C4 = ceil(D / 4)`` chunks::

    base      the base codec's codes, leaves reshaped [..., NB, N, ...]
    flags     uint32[..., NB, ceil(N * C4 / 32)]   1 bit per chunk, token-major
    outliers  float16[..., NB, K, 4]               K slots, in chunk order of the flags
    overflow  uint32[..., NB, 1]
    start     uint32[..., NB, 1]               pooled only: the block's first slot of
                                               ``outliers`` seen as ``NB K`` slots

Bits per element: the base codec's plus ``(32 * flag words + 64 K + 32) / (N * D)``,
and ``32 / (N * D)`` more pooled.
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
        Option.word("pooled", "mpool", "outlier slots pooled per row"),
    )
    examples: ClassVar[tuple[Example, ...]] = (
        Example("int:4,med3,mb8,mp5", rel_mse=0.012),
        Example("hqmq:s24,r4,med2.5", rel_mse=0.05, seeded=True),
        # uncapped: a slot for every chunk
        Example("int:4,med2,mb4,mp100", rel_mse=0.012),
        # the row's slots pooled: a block may use what earlier blocks left
        Example("int:4,med2.5,mb8,mp5,mpool", rel_mse=0.012),
    )

    base: Codec
    multiplier: float = DEFAULT_MULTIPLIER
    block: int = DEFAULT_BLOCK
    capacity_pct: float = DEFAULT_CAPACITY_PCT
    pooled: bool = False

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

    @property
    def row_pool(self) -> str | None:
        """``"outliers"`` when pooled: that leaf of the codes is one pool per row (its
        ``NB`` entries are not the blocks' own; a cache keeps it whole, see
        :meth:`encode_after`)."""
        return "outliers" if self.pooled else None

    def capacity(self, head_dim: int) -> int:
        """Outlier slots per block (pooled: that many per block slot of the row's
        pool): every chunk of the block at ``mp100``."""
        return max(1, math.ceil(self.capacity_pct / 100 * self.block * num_chunks(head_dim)))

    # -- protocol ---------------------------------------------------------------------
    def init(self, key: jax.Array, head_dim: int) -> Params:
        """The base codec's parameters."""
        return self.base.init(key, head_dim)

    def _placement(self, count: jax.Array, first_block: jax.Array, fill: jax.Array,
                   head_dim: int) -> tuple[jax.Array, jax.Array]:
        """Per block of ``count [..., NB]`` chunks over the threshold: (its first slot,
        its capacity), int32 ``[..., NB]``. Fixed: block ``b``'s own ``K`` slots,
        ``b K``. Pooled: the row's blocks before it (``first_block`` of them stored
        already, holding ``fill`` slots) leave block ``a`` the slots up to ``(a + 1)
        K``, the unused ones of earlier blocks included."""
        k = self.capacity(head_dim)
        nb = count.shape[-1]
        j = jnp.arange(nb, dtype=jnp.int32)
        if not self.pooled:
            return jnp.broadcast_to(j * k, count.shape), jnp.full(count.shape, k, jnp.int32)
        bound = (first_block[..., None] + j + 1) * k  # slots blocks 0..a may use together
        taken = jnp.cumsum(count, axis=-1) - count  # over-threshold chunks before block b
        # start_{b+1} = min(start_b + count_b, bound_b): a running minimum of
        # (the bound before block j) - (chunks before j), offset by the chunks before b
        before = jnp.concatenate([fill[..., None], (bound - k)[..., 1:] - taken[..., 1:]],
                                 axis=-1)
        start = taken + jax.lax.cummin(before, axis=before.ndim - 1)
        return start, bound - start

    def _blocks(self, params: Params, x: jax.Array, first_block: jax.Array,
                fill: jax.Array) -> tuple[Codes, jax.Array, jax.Array]:
        """The codes of ``x``'s blocks but the outlier slots, and where each chunk goes:
        ``(codes, slot int32 [..., NB * n * C4], chunks float16 [..., NB * n * C4, 4])``,
        the slot past every pool for chunks not stored as outliers (:meth:`_placement`
        says which slots a block's outliers take, in the flags' order)."""
        head_dim, tokens = x.shape[-1], x.shape[-2]
        lead, nb, n = x.shape[:-2], tokens // self.block, self.block
        c4 = num_chunks(head_dim)
        chunks = to_chunks(x).reshape(*lead, nb, n * c4, 4)
        norm = jnp.linalg.norm(chunks, axis=-1)  # [..., NB, n * c4]
        threshold = self.multiplier * jnp.median(norm, axis=-1, keepdims=True)
        over = norm > threshold
        count = jnp.sum(over, axis=-1, dtype=jnp.int32)
        start, capacity = self._placement(count, first_block, fill, head_dim)
        # the largest chunks over the threshold fill the block's capacity
        order = jnp.argsort(jnp.where(over, -norm, jnp.inf), axis=-1)
        # each chunk's place in that order: one scatter instead of a second sort
        places = jnp.broadcast_to(jnp.arange(order.shape[-1], dtype=jnp.int32), order.shape)
        rank = jnp.put_along_axis(jnp.zeros_like(places), order, places, axis=-1,
                                  inplace=False)
        stored = over & (rank < capacity[..., None])
        slot = start[..., None] + jnp.cumsum(stored, axis=-1, dtype=jnp.int32) - 1
        slot = jnp.where(stored, slot, jnp.iinfo(jnp.int32).max)
        overflow = count - jnp.sum(stored, axis=-1, dtype=jnp.int32)

        inliers = jnp.where(stored[..., None], 0.0, chunks)
        inliers = inliers.reshape(*lead, tokens, 4 * c4)[..., :head_dim]
        base = self.base._encode(params, inliers)
        base = jax.tree.map(lambda a: a.reshape(*lead, nb, n, *a.shape[len(lead) + 1:]), base)
        codes = {
            "base": base,
            "flags": pack_bits(stored.astype(jnp.uint32), 1),
            "overflow": overflow[..., None].astype(jnp.uint32),
        }
        if self.pooled:
            codes["start"] = start[..., None].astype(jnp.uint32)
        return (codes, slot.reshape(*lead, nb * n * c4),
                chunks.reshape(*lead, nb * n * c4, 4).astype(jnp.float16))

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        lead, nb = x.shape[:-2], x.shape[-2] // self.block
        zero = jnp.zeros(lead, jnp.int32)
        codes, slot, chunks = self._blocks(params, x, zero, zero)
        k = self.capacity(x.shape[-1])
        pool = write_slots(jnp.zeros((*lead, nb * k, 4), jnp.float16), slot, chunks)
        return {**codes, "outliers": pool.reshape(*lead, nb, k, 4)}

    def encode_after(self, params: Params, x: jax.Array, first_block: jax.Array,
                     fill: jax.Array) -> tuple[Codes, jax.Array, jax.Array]:
        """Pooled codes of ``x[..., T, D]``'s blocks continuing a row that holds
        ``first_block`` blocks whose outliers take ``fill`` slots of its pool (int32
        ``[...]``): ``(codes without "outliers", slot, chunks)`` as
        :func:`write_slots` puts into the row's pool (``"outliers"`` of its codes,
        ``[..., NB, K, 4]`` seen as ``NB K`` slots). Input checks as :meth:`encode`."""
        if not self.pooled:
            raise CodecError(f"{self.spec}: encode_after is for pooled outliers (mpool)")
        x = self.saturate(self._check_input(x))
        out = self._blocks(params, x, jnp.asarray(first_block, jnp.int32),
                           jnp.asarray(fill, jnp.int32))
        return jax.lax.optimization_barrier(out)

    def pool_fill(self, codes: Codes, blocks: jax.Array) -> jax.Array:
        """Slots of the pool taken by the first ``blocks`` blocks of pooled ``codes``
        (``[..., NB, ...]`` leaves, ``blocks`` int32 broadcast against ``[...]``)."""
        last = jnp.maximum(blocks - 1, 0)[..., None, None]
        start = jnp.take_along_axis(codes["start"], jnp.broadcast_to(
            last, (*codes["start"].shape[:-2], 1, 1)), axis=-2)[..., 0, 0]
        flags = jnp.take_along_axis(codes["flags"], jnp.broadcast_to(
            last, (*codes["flags"].shape[:-2], 1, 1)), axis=-2)[..., 0, :]
        used = jnp.sum(jax.lax.population_count(flags), axis=-1)
        return jnp.where(blocks > 0, start + used, 0).astype(jnp.int32)

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """The base codec's vectors with the flagged chunks replaced by their fp16 values."""
        base = codes["base"]
        lead_nb = codes["overflow"].shape[:-1]
        lead, nb, n = lead_nb[:-1], lead_nb[-1], self.block
        flat = jax.tree.map(lambda a: a.reshape(*lead, nb * n, *a.shape[len(lead) + 2:]), base)
        x = self.base.decode(params, flat, jnp.float32)
        x = replace_outliers(x, codes["flags"], codes["outliers"], n, codes.get("start"))
        return x.astype(dtype)

    def kernel_formats(self) -> tuple[KernelFormat, ...]:
        """The base's HQMQ format with these outliers (:class:`~kvjax.codec.OutlierBlocks`:
        its codes decode a flagged chunk to zero, the kernel adds the stored chunk); no
        other base's formats (their codes of a zeroed chunk are not zero)."""
        return tuple(dataclasses.replace(f, outliers=OutlierBlocks(self.block, self.pooled))
                     for f in self.base.kernel_formats() if isinstance(f, HqmqFormat))

    def outlier_counts(self, codes: Codes) -> tuple[jax.Array, jax.Array]:
        """Per block: (chunks stored as outliers, chunks over the threshold that did not
        fit in the slots and went to the base codec)."""
        stored = jnp.sum(jax.lax.population_count(codes["flags"]), axis=-1)
        return stored, codes["overflow"][..., 0]

    def bits_per_element(self, head_dim: int) -> float:
        """Base codec bits plus flags, outlier slots and the overflow count per block
        (pooled: and the block's first slot)."""
        self.check_head_dim(head_dim)
        base = self.base.bits_per_element(head_dim)
        elements = self.block * head_dim
        extra = 32 * num_words(self.block * num_chunks(head_dim), 1) + 64 * self.capacity(
            head_dim) + 32 * (2 if self.pooled else 1)
        return exact_bits(round(base * elements) + extra, elements)

    def paper_bits_per_element(self, head_dim: int, fraction: float) -> float:
        """The paper's variable-length count at an outlier fraction ``fraction`` of the
        chunks: ``(1 - p) b_base + 16 p + 1/4``, ``b_base`` the base codec's fractional
        bits where it has them (HQMQ), its stored bits otherwise."""
        base = getattr(self.base, "fractional_bits_per_element", self.base.bits_per_element)
        return (1 - fraction) * base(head_dim) + 16 * fraction + 0.25


def write_slots(pool: jax.Array, slot: jax.Array, chunks: jax.Array) -> jax.Array:
    """``pool [..., P, 4]`` with ``chunks[..., i, :]`` written at slot ``slot[..., i]``;
    a slot outside ``0 .. P - 1`` writes nothing."""
    lead = pool.shape[:-2]

    def flat(a: jax.Array) -> jax.Array:
        return a.reshape(math.prod(lead), *a.shape[len(lead):])

    out = jax.vmap(lambda p, s, c: p.at[s].set(c.astype(p.dtype), mode="drop"))(
        flat(pool), flat(slot), flat(chunks))
    return out.reshape(pool.shape)


