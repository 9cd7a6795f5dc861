"""A compressed KV cache: a fixed-capacity pytree that a ``jax.jit`` decode loop carries.

Layout of one row (one sequence) of one layer, for K and for V separately::

    positions  0 .. s-1          s .. s+c-1                  s+c .. len-1
               sink tokens       compressed blocks           raw recent tokens
               (raw, s = sinks)  (codec codes, c = n_comp)   (residual window + the
                                                              unfinished codec block)

``n_comp = floor(max(0, len - s - W) / block) * block`` with ``W`` the residual window
and ``block`` the codec's ``block_tokens``: a token is compressed once it is more than
``W`` tokens old *and* its block is complete (KIVI key groups). So the raw region holds
at most ``W + block - 1`` tokens and every array has a fixed shape under ``jit``.

Layers are grouped into *segments*: maximal runs of consecutive layers that share a
(K codec, V codec) pair. A per-layer policy such as "keep K raw on the first and last
layer" therefore stores those layers' K as bf16 and the rest as codes, with no wasted
arrays; :func:`scan_layers` runs one ``lax.scan`` per segment.

Storage is head-major (``[B, K, S, ...]``) so that one kv head's codes are contiguous
for the fused kernels. Model code passes K/V token-major, ``[B, T, K, D]``.

Bad input. An append that would exceed ``max_len``, or whose ``valid`` count is negative
or longer than its chunk, raises ``ValueError`` when the counts and lengths are concrete.
Under ``jit`` each row appends ``clip(valid, 0, min(T, max_len - length))`` tokens of a
chunk of ``T``: the tokens past capacity are dropped and the row's ``overflowed`` flag is
set, a count outside ``0..T`` is clamped and ``bad_valid`` is set; a stored token is never
written over and a length never decreases. Non-finite K/V are stored as finite numbers
(NaN -> 0, Inf -> largest finite) and the row's ``nonfinite`` flag is set. Finite values
that the storage cannot hold are saturated and flagged in ``saturated``: beyond the raw
dtype's largest finite value (clipped to it) or, for a token being encoded, outside the
codec's :attr:`~kvjax.codec.Codec.limits` (see :meth:`~kvjax.codec.Codec.saturate`).
:func:`check` raises ``ValueError`` naming the rows and the cause of every flag set;
generation and evaluation call it.

Pages. With a spec's ``page=N`` clause the compressed blocks of every row live in one
pool of pages of ``N`` tokens per layer and role (codes ``[L, 1, K, P * N / block,
...]``: one row of every page's blocks, which a kernel reads as it reads a row),
and each row's block table (:attr:`KVCache.pages`, shared by all layers and roles) names
the pool page of each of its logical pages: rows of different lengths hold only the
pages they use, rows may share the pages of a common prefix, and a row joins or leaves
without moving anyone's codes (:mod:`kvjax.paging` hands pages out). Sinks, the raw
window and the flags stay per row. Every reader goes through the table
(:meth:`Store.blocks`, :meth:`Store.write_blocks`); a contiguous cache is the case of
one page per row in order. A block written to a logical page its row's table leaves
empty is dropped and flagged (:data:`DROPPED_NO_PAGE`), never written over another
row's page.

Key transforms. With a cache spec's ``center=`` / ``smooth=`` clauses every K store
keeps ``shift`` and ``scale`` vectors per (row, kv head) and stores ``(k - shift) /
scale`` in all its regions (:mod:`kvjax.centering`): attention multiplies the query by
``scale`` (:func:`kvjax.attention.attend`) and is then exact; every reader here returns
the stored (transformed) keys, and :func:`restore` (or ``dense(..., restore=True)``) maps
them back to the keys that were appended.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import centering
from kvjax.codec import EXACT, Codec, codes_nbytes, round_to_dtype
from kvjax.primitives.quaternion import num_chunks
from kvjax.spec import CacheConfig

_ROLE_IDS = {"k": 0, "v": 1}


def _register(cls, data: tuple[str, ...], meta: tuple[str, ...]):
    return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))


@functools.partial(
    _register,
    data=("codes", "params", "raw", "sink", "nonfinite", "saturated", "layer", "shift",
          "scale", "pages"),
    meta=("codec", "window", "sinks", "max_len", "center", "smooth", "page_blocks"),
)
@dataclasses.dataclass(frozen=True)
class Store:
    """K (or V) of a run of layers. Leading axes ``[L, B, K]`` (``L`` absent in a layer view).

    codes: codec codes, leaves ``[L, B, K, NB, ...]`` for ``NB`` block slots.
    params: codec parameters, leaves ``[L, K, ...]``.
    raw: ``[L, B, K, R, D]`` recent tokens, position-ordered from the first uncompressed.
    sink: ``[L, B, K, sinks, D]``.
    nonfinite: ``[L, B]`` set when a row received NaN/Inf.
    saturated: ``[L, B]`` uint8, a bit per cause of a row's finite values being altered to
    fit the storage: :data:`SATURATED_RAW` (clipped to the raw dtype's range),
    :data:`SATURATED_CODEC` (an encoded token outside the codec's limits),
    :data:`DROPPED_NO_PAGE` (a paged token with no page), :data:`STATISTICS_OUTLIERS`
    (a first chunk's outlying keys left out of ``center=first`` / ``smooth=first``).
    layer: ``None``, or in the layer views :func:`scan_layers` makes, the int32 index of
    the view's layer in ``codes``, which then keep their ``L`` axis: appending writes the
    new blocks into the whole stack in place and readers index it
    (:meth:`layer_codes`), so no step copies a layer's codes (the bulk of the cache).
    shift, scale: ``None``, or for a K store with a key transform (``center`` /
    ``smooth``: ``"first"`` or ``"calib"``, the cache spec's clauses) bf16 ``[L, B, K,
    D]``: the stored keys are ``(k - shift) / scale`` (module docstring); ``scale`` is
    None without smoothing, ``shift`` None without centering.
    page_blocks: 0 (contiguous), or in a paged cache the codec blocks of a page: the
    codes are then a pool of pages shared by every row, stored as one row of all pages'
    slots in page order, leaves ``[L, 1, K, P * page_blocks, ...]`` for ``P`` pages
    (module docstring, *Pages*).
    pages: ``None``, or in a layer view of a paged cache its rows' block tables ``[B,
    row pages]`` (:attr:`KVCache.pages`): row ``b``'s block slot ``s`` lives in pool page
    ``p = pages[b, s // page_blocks]``, at the pool's slot ``p * page_blocks + s %
    page_blocks``.
    """

    codes: Any
    params: Any
    raw: jax.Array
    sink: jax.Array
    nonfinite: jax.Array
    saturated: jax.Array
    codec: Codec
    window: int
    sinks: int
    max_len: int
    layer: Any = None
    shift: Any = None
    scale: Any = None
    center: str = ""
    smooth: str = ""
    page_blocks: int = 0
    pages: Any = None

    def layer_codes(self) -> Any:
        """This layer's codes, leaves ``[B, K, NB, ...]`` (in a paged cache gathered from
        the pool through the block tables: a copy of the layer)."""
        if self.page_blocks:
            return self.blocks(jnp.int32(0), self.slots)
        if self.layer is None:
            return self.codes
        return jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, self.layer, 0, keepdims=False),
            self.codes)

    def blocks(self, first: jax.Array, span: int) -> Any:
        """The codes of each row's block slots ``first .. first + span - 1`` (``first`` a
        traced scalar within ``0 .. slots - span``), leaves ``[B, K, span, ...]``."""
        if not self.page_blocks:
            return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, first, span, axis=2),
                                self.layer_codes())
        at = self.pool_slots(first + jnp.arange(span, dtype=jnp.int32)[None, :])
        index = self._pool_index(at)
        # advanced indices split by a slice put their broadcast dims first: [B, n, K, ...]
        return jax.tree.map(lambda a: jnp.swapaxes(a[index], 1, 2), self.codes)

    def write_blocks(self, slot: jax.Array, values: Any) -> Any:
        """The codes after writing ``values`` (leaves ``[B, K, n, ...]``) to each row's
        block slots ``slot [B, n]`` (slots out of range are dropped), in place in the
        whole stack of a layer view."""
        if not self.page_blocks:
            return jax.tree.map(lambda buf, val: _rows_set(buf, slot, val, self.layer),
                                self.codes, values)
        index = self._pool_index(self.pool_slots(slot))
        return jax.tree.map(
            lambda buf, val: buf.at[index].set(jnp.swapaxes(val, 1, 2).astype(buf.dtype),
                                               mode="drop"),
            self.codes, values)

    def _pool_index(self, at: jax.Array) -> tuple:
        """The index of pool slots ``at [B, n]`` into a paged store's codes leaves."""
        lead = () if self.layer is None else (self.layer,)
        return (*lead, jnp.zeros_like(at), slice(None), at)

    @property
    def pool_pages(self) -> int:
        """Pages in a paged store's pool (0 for a contiguous one)."""
        if not self.page_blocks:
            return 0
        # codes lead with the layers in a segment's stack and in a scan's layer view
        stacked = self.raw.ndim == 5 or self.layer is not None
        return jax.tree.leaves(self.codes)[0].shape[3 if stacked else 2] // self.page_blocks

    def pool_slots(self, slot: jax.Array) -> jax.Array:
        """The pool slots ``[B, n]`` of each row's block slots ``slot [B or 1, n]`` in a
        paged store; a slot out of ``0 .. slots - 1`` or on a page its row has none of
        (table entry < 0) gets the slot past the pool: writes there are dropped, reads
        clipped."""
        table, per = self.pages, self.page_blocks
        slot = jnp.broadcast_to(slot, (table.shape[0], slot.shape[-1]))
        page = jnp.take_along_axis(table, jnp.clip(slot // per, 0, table.shape[1] - 1),
                                   axis=1)
        missing = (slot < 0) | (slot >= self.slots) | (page < 0)
        return jnp.where(missing, self.pool_pages * per, page * per + slot % per)

    @property
    def block(self) -> int:
        return self.codec.block_tokens

    @property
    def slots(self) -> int:
        """Compressed block slots per (row, head)."""
        return max(0, self.max_len - self.sinks - self.window) // self.block

    @property
    def raw_capacity(self) -> int:
        """Raw token slots: the window plus an unfinished block, but never more than the
        non-sink capacity (a window longer than the cache holds every token raw)."""
        return min(self.window + self.block - 1, self.max_len - self.sinks)

    def counts(self, lengths: jax.Array):
        """Per row: (valid sink tokens, compressed tokens, raw tokens)."""
        n_sink = jnp.minimum(lengths, self.sinks)
        n_comp = _compressed_tokens(lengths, self.sinks, self.window, self.block)
        return n_sink, n_comp, lengths - n_sink - n_comp


def _compressed_tokens(lengths, sinks, window, block):
    eligible = jnp.maximum(lengths - sinks - window, 0)
    return eligible // block * block


@functools.partial(_register, data=("k", "v"), meta=("start", "stop", "attention"))
@dataclasses.dataclass(frozen=True)
class Segment:
    """K and V storage of layers ``start .. stop-1`` (a *layer view* when sliced to one);
    ``attention``: the cache spec's implementations (``attn=``), which
    :func:`kvjax.attention.attend` runs by default."""

    k: Store
    v: Store
    start: int
    stop: int
    attention: tuple[str, ...] = ("auto",)


#: :attr:`Store.saturated` bit: a value beyond the raw dtype's range was clipped to it
SATURATED_RAW = 1
#: :attr:`Store.saturated` bit: a token encoded into codes was outside the codec's limits
SATURATED_CODEC = 2
#: :attr:`Store.saturated` bit: a paged row's block had no page to go to and was dropped
#: (its block table did not cover the tokens it was given)
DROPPED_NO_PAGE = 4
#: :attr:`Store.saturated` bit: a row's first chunk of keys held values so far from the
#: rest (:data:`kvjax.centering.ROBUST_LIMIT` robust deviations) that the ``first``
#: statistics left them out; what is stored is exact about the robust centre
STATISTICS_OUTLIERS = 8


@functools.partial(
    _register, data=("segments", "lengths", "overflowed", "bad_valid", "evicted", "pages"),
    meta=("config", "num_layers"),
)
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The whole cache: segments of layers, per-row lengths and flags.

    ``overflowed[B]``: an append had more real tokens than the row had room for (the
    excess was dropped). ``bad_valid[B]``: an append's ``valid`` count was negative or
    longer than its chunk (it was clamped). ``evicted[B]``: tokens of the row's prompt
    that eviction dropped (:func:`evict_into`); the next token's position is
    ``lengths + evicted`` (:meth:`positions`), while attention's causal order counts
    stored tokens only. ``pages[B, row pages]``: in a paged cache (a spec's ``page=``
    clause) each row's block table, the pool page of each of its logical pages (``-1``:
    none), which every layer and role shares (:mod:`kvjax.paging`); None otherwise.
    """

    segments: tuple[Segment, ...]
    lengths: jax.Array
    overflowed: jax.Array
    bad_valid: jax.Array
    config: CacheConfig
    num_layers: int
    evicted: jax.Array | None = None
    pages: jax.Array | None = None

    def positions(self, step: Step, num_tokens: int) -> jax.Array:
        """``[B, T]`` positions in the sequence (for the rotary embedding) of the tokens
        of ``step``'s chunk: their stored positions plus the row's evicted tokens."""
        positions = step.positions(num_tokens)
        return positions if self.evicted is None else positions + self.evicted[:, None]

    @property
    def max_len(self) -> int:
        return self.segments[0].k.max_len

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    def layer(self, i: int) -> Segment:
        """The layer view of layer ``i`` (leading ``L`` axis removed)."""
        seg = self._segment_of(i)
        return _with_tables(jax.tree.map(lambda a: a[i - seg.start], seg), self.pages)

    def with_layer(self, i: int, view: Segment) -> KVCache:
        """A cache whose layer ``i`` is replaced by ``view``."""
        seg = self._segment_of(i)
        new = jax.tree.map(lambda a, b: a.at[i - seg.start].set(b), seg,
                           _with_tables(view, None))
        segs = tuple(new if s is seg else s for s in self.segments)
        return dataclasses.replace(self, segments=segs)

    def _segment_of(self, i: int) -> Segment:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range 0..{self.num_layers - 1}")
        return next(s for s in self.segments if s.start <= i < s.stop)


def init_cache(
    key: jax.Array,
    config: CacheConfig,
    *,
    num_layers: int,
    batch: int,
    num_kv_heads: int,
    head_dim: int,
    max_len: int,
    dtype: Any = jnp.bfloat16,
    calibration: centering.KeyCalibration | None = None,
    fitted: Any = None,
    num_pages: int | None = None,
) -> KVCache:
    """An empty cache for ``batch`` rows of up to ``max_len`` tokens.

    Codec parameters are drawn per (layer, kv head, K|V) from ``key``; raw tokens
    (window, sinks, raw layers' storage excluded) are kept in ``dtype``.
    ``calibration`` (:func:`key_calibration`) supplies the key transform of a config with
    ``center=calib`` or ``smooth=calib``; it must then match the layers, heads and dim.
    Codecs that need fitted parameters take them from ``fitted``
    (:class:`kvjax.calibration.Fitted`; :func:`kvjax.calibration.fitted_of` reads the
    checkpoint of the config's ``fit=`` clause, as :func:`models.llama.new_cache` does);
    parameters fitted for another codec or shape are refused.

    A paged config (``page=N``) keeps the coded tokens of every row in one pool of
    ``num_pages`` pages per layer and role: by default each row's own
    :func:`row_pages` pages, each row's block table naming them in order; with
    ``num_pages`` given the tables start empty (``-1``) and the caller assigns pages
    (:func:`with_pages`, :class:`kvjax.paging.PagePool`).
    """
    for name, value in (("num_layers", num_layers), ("batch", batch),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("max_len", max_len)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    per_row = row_pages(config, max_len)
    if num_pages is not None:
        if not config.page_tokens:
            raise ValueError(f"num_pages={num_pages} given for cache spec '{config.spec}', "
                             "which is not paged (add page=N)")
        if not isinstance(num_pages, int | np.integer) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
    if config.sink_tokens > max_len:
        raise ValueError(f"sink_tokens={config.sink_tokens} exceeds max_len={max_len}")
    if config.calibrated:
        if calibration is None:
            raise ValueError(f"cache spec '{config.spec}' takes its key transform from a "
                             "calibration: pass calibration= (kvjax.cache.key_calibration)")
        if calibration.shape != (num_layers, num_kv_heads, head_dim):
            raise ValueError(f"the key calibration is for [layers, kv heads, head dim] = "
                             f"{list(calibration.shape)}, the cache has "
                             f"{[num_layers, num_kv_heads, head_dim]}")
    per_layer = config.layer_codecs(num_layers)
    for k_codec, v_codec in set(per_layer):
        k_codec.check_head_dim(head_dim)
        v_codec.check_head_dim(head_dim)
        for codec in (k_codec, v_codec):
            if config.page_tokens and config.page_tokens % codec.block_tokens:
                raise ValueError(f"page={config.page_tokens} is not a multiple of "
                                 f"{codec.spec}'s block of {codec.block_tokens} tokens")
            if config.page_tokens and codec.row_pool:
                raise ValueError(f"{codec.spec} keeps one outlier pool per row: it is "
                                 "not stored in pages (drop the page= clause)")
    if fitted is None and any(c.needs_fit for pair in per_layer for c in pair):
        raise ValueError(
            f"cache spec '{config.spec}' has a codec that takes fitted parameters: pass "
            "fitted= (kvjax.calibration.fitted_of(config) reads its fit=DIR clause)"
            if config.fit else
            f"cache spec '{config.spec}' has a codec that takes fitted parameters: add "
            "fit=DIR (python -m kvjax calibrate --fit SPEC --out DIR writes them)")

    segments, start = [], 0
    while start < num_layers:
        stop = start
        while stop < num_layers and per_layer[stop] == per_layer[start]:
            stop += 1
        stores = {}
        for role, codec in zip(("k", "v"), per_layer[start], strict=True):
            stores[role] = _empty_store(
                key, codec, role, range(start, stop), config, batch, num_kv_heads,
                head_dim, max_len, dtype, fitted,
                pool=(batch * per_row if num_pages is None else int(num_pages)),
            )
        stores["k"] = _with_key_transform(stores["k"], config, calibration,
                                          range(start, stop))
        segments.append(Segment(k=stores["k"], v=stores["v"], start=start, stop=stop,
                                attention=config.attention))
        start = stop
    return KVCache(
        segments=tuple(segments),
        lengths=jnp.zeros((batch,), jnp.int32),
        overflowed=jnp.zeros((batch,), bool),
        bad_valid=jnp.zeros((batch,), bool),
        config=config,
        num_layers=num_layers,
        evicted=jnp.zeros((batch,), jnp.int32),
        pages=None if not config.page_tokens else (
            jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
            if num_pages is None else jnp.full((batch, per_row), -1, jnp.int32)),
    )


def row_pages(config: CacheConfig, max_len: int) -> int:
    """Pages of ``config.page_tokens`` tokens that hold a row's coded tokens at most (0
    for a contiguous config): its tokens past the sinks and the residual window."""
    if not config.page_tokens:
        return 0
    coded = max(0, max_len - config.sink_tokens - config.residual_window)
    return -(-coded // config.page_tokens)


def with_pages(cache: KVCache, pages: jax.Array) -> KVCache:
    """``cache`` with the block tables ``pages [B, row pages]`` (int32 pool pages, ``-1``
    for none) of a paged cache."""
    if cache.pages is None:
        raise ValueError(f"cache spec '{cache.config.spec}' is not paged: it has no block "
                         "tables")
    pages = jnp.asarray(pages, jnp.int32)
    if pages.shape != cache.pages.shape:
        raise ValueError(f"block tables of shape {tuple(pages.shape)} for a cache whose "
                         f"tables are {tuple(cache.pages.shape)}")
    return dataclasses.replace(cache, pages=pages)


@jax.jit
def copy_pages(cache: KVCache, source: jax.Array, target: jax.Array) -> KVCache:
    """``cache`` with pool pages ``source [n]`` copied onto pages ``target [n]`` in every
    layer and role (a copy-on-write of shared pages; a target past the pool is
    skipped)."""
    def copy(store: Store) -> Store:
        per = jnp.arange(store.page_blocks, dtype=jnp.int32)[None, :]
        into = (target[:, None] * store.page_blocks + per).ravel()
        into = jnp.where(jnp.repeat(target, store.page_blocks) < store.pool_pages, into,
                         store.pool_pages * store.page_blocks)
        src = (source[:, None] * store.page_blocks + per).ravel()
        codes = jax.tree.map(lambda a: a.at[:, :, :, into].set(a[:, :, :, src], mode="drop"),
                             store.codes)
        return dataclasses.replace(store, codes=codes)

    return dataclasses.replace(cache, segments=tuple(
        dataclasses.replace(seg, k=copy(seg.k), v=copy(seg.v)) for seg in cache.segments))


@jax.jit
def reset_rows(cache: KVCache, rows: jax.Array, lengths: jax.Array | None = None) -> KVCache:
    """``cache`` with the rows ``rows [B]`` (bool) empty again, as :func:`init_cache`
    makes them: no tokens, no flags, the raw window and sinks zero, a key transform of
    ``first`` neutral until the row's next first append. Their codes stay where they are
    (no read goes past a row's length); a paged row keeps its block table
    (:func:`with_pages` gives it another). A serving engine refills a retired row so.

    ``lengths [B]``: the tokens each reset row starts with instead of none, for a paged
    row whose table begins with pages it shares (a prompt prefix another row wrote):
    only whole pages of a spec without sinks or a raw window, so that every one of
    those tokens is in the codes."""
    def clear(store: Store) -> Store:
        def where(a, value):  # the stacks' rows are their second axis
            mask = rows.reshape((1, -1) + (1,) * (a.ndim - 2))
            return jnp.where(mask, jnp.asarray(value, a.dtype), a)

        return dataclasses.replace(
            store, raw=where(store.raw, 0), sink=where(store.sink, 0),
            nonfinite=where(store.nonfinite, False), saturated=where(store.saturated, 0),
            shift=(store.shift if store.shift is None or store.center != "first"
                   else where(store.shift, 0.0)),
            scale=(store.scale if store.scale is None or store.smooth != "first"
                   else where(store.scale, 1.0)))

    def zero(a):
        return None if a is None else jnp.where(rows, jnp.zeros_like(a), a)

    start = zero(cache.lengths) if lengths is None else jnp.where(rows, lengths,
                                                                   cache.lengths)
    return dataclasses.replace(
        cache, segments=tuple(dataclasses.replace(seg, k=clear(seg.k), v=clear(seg.v))
                              for seg in cache.segments),
        lengths=start.astype(cache.lengths.dtype), overflowed=zero(cache.overflowed),
        bad_valid=zero(cache.bad_valid), evicted=zero(cache.evicted))


#: a store's arrays with a row axis (their second: the stacks lead with the layers),
#: besides its codes when they are contiguous
_STORE_ROWS = ("raw", "sink", "nonfinite", "saturated", "shift", "scale")
#: a cache's arrays of one entry per row
_CACHE_ROWS = ("lengths", "overflowed", "bad_valid", "evicted", "pages")


def _map_rows(cache: KVCache, fn, part: KVCache | None = None) -> KVCache:
    """``cache`` with ``fn(array, part's array or None, axis)`` in place of every array
    with a row axis: the per-row arrays of :data:`_STORE_ROWS` and :data:`_CACHE_ROWS`
    and contiguous codes; a paged pool (shared by every row) is ``part``'s when given,
    and codec parameters stay."""
    def store(st: Store, new: Store | None) -> Store:
        def one(name):
            a, b = getattr(st, name), None if new is None else getattr(new, name)
            return None if a is None else fn(a, b, 1)

        if st.page_blocks:
            codes = st.codes if new is None else new.codes
        elif new is None:
            codes = jax.tree.map(lambda a: fn(a, None, 1), st.codes)
        else:
            codes = jax.tree.map(lambda a, b: fn(a, b, 1), st.codes, new.codes)
        return dataclasses.replace(st, codes=codes, **{n: one(n) for n in _STORE_ROWS})

    segments = tuple(dataclasses.replace(
        seg, k=store(seg.k, None if part is None else new.k),
        v=store(seg.v, None if part is None else new.v))
        for seg, new in zip(cache.segments, (part or cache).segments, strict=True))
    rows = {n: None if getattr(cache, n) is None
            else fn(getattr(cache, n), None if part is None else getattr(part, n), 0)
            for n in _CACHE_ROWS}
    return dataclasses.replace(cache, segments=segments, **rows)


def take_rows(cache: KVCache, rows: jax.Array) -> KVCache:
    """The cache of rows ``rows [n]`` (distinct indices) of ``cache``: every per-row
    array gathered, a paged store's pool (shared by every row) and the codec parameters
    as they are. :func:`put_rows` writes such a cache back; between the two, the rows
    run as a cache of ``n`` rows (a prefill of a few rows among many)."""
    return _map_rows(cache, lambda a, _, axis: jnp.take(a, rows, axis=axis))


def put_rows(cache: KVCache, rows: jax.Array, part: KVCache) -> KVCache:
    """``cache`` with rows ``rows [n]`` (distinct) replaced by ``part``'s (a
    :func:`take_rows` cache of them, run since), and a paged store's pool taken from
    ``part`` whole (the rows wrote their pages there)."""
    def put(a, b, axis):
        return a.at[rows].set(b) if axis == 0 else a.at[:, rows].set(b)

    return _map_rows(cache, put, part)


def _with_tables(view: Segment, pages: jax.Array | None) -> Segment:
    """A layer view whose paged stores carry the block tables ``pages`` (None: none, as
    the segments' stacks hold them)."""
    def put(store: Store) -> Store:
        return dataclasses.replace(store, pages=pages if store.page_blocks else None)

    return dataclasses.replace(view, k=put(view.k), v=put(view.v))


def _layer_params(key, codec, role, layer, heads, head_dim, fitted):
    """Every kv head's parameters (leaves ``[K, ...]``) of one layer's K or V."""
    seeded = jax.tree.map(lambda *h: jnp.stack(h),
                          *[codec.init(_param_key(key, layer, head, role), head_dim)
                            for head in range(heads)])
    if not codec.needs_fit:
        return seeded
    params = fitted.layer_params(role, layer, codec, heads, head_dim)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), seeded)
    if jax.tree.map(lambda a: (a.shape, a.dtype), params) != shapes:
        raise ValueError(f"layer {layer}'s fitted {role.upper()} parameters do not have "
                         f"the shapes {codec.spec} takes")
    return params


def _raw_dtype(codec: Codec, dtype: Any) -> Any:
    """The raw tokens' dtype of a store of ``codec``: ``dtype``, or a lossless codec's
    own storage where it is wider (an ``f32`` store keeps float32 whatever the cache's
    raw dtype: every token is rounded to the raw dtype before it is encoded, and its
    bits must be what the values carry)."""
    storage = getattr(codec, "storage", None)
    if codec.lossy or storage is None or jnp.dtype(storage).itemsize <= jnp.dtype(
            dtype).itemsize:
        return dtype
    return jnp.dtype(storage)


def _empty_store(key, codec, role, layers, config, batch, heads, head_dim, max_len, dtype,
                 fitted, pool):
    dtype = _raw_dtype(codec, dtype)
    params = jax.tree.map(
        lambda *a: jnp.stack(a),
        *[_layer_params(key, codec, role, layer, heads, head_dim, fitted) for layer in layers],
    )
    store = Store(
        codes=None, params=params, raw=None, sink=None, nonfinite=None, saturated=None,
        codec=codec,
        window=config.residual_window, sinks=config.sink_tokens, max_len=max_len,
        page_blocks=config.page_tokens // codec.block_tokens,
    )
    n = len(layers)
    # the shapes of the codes come from encoding one dummy block
    template = jax.eval_shape(
        lambda p, x: _encode_heads(codec, p, x),
        jax.tree.map(lambda a: a[0], params),
        jax.ShapeDtypeStruct((batch, heads, store.block, head_dim), jnp.float32),
    )
    # contiguous: each row its slots; paged: one row of every page's slots
    lead = ((1, heads, pool * store.page_blocks) if store.page_blocks
            else (batch, heads, store.slots))
    codes = jax.tree.map(lambda s: jnp.zeros((n, *lead, *s.shape[3:]), s.dtype), template)
    return dataclasses.replace(
        store,
        codes=codes,
        raw=jnp.zeros((n, batch, heads, store.raw_capacity, head_dim), dtype),
        sink=jnp.zeros((n, batch, heads, config.sink_tokens, head_dim), dtype),
        nonfinite=jnp.zeros((n, batch), bool),
        saturated=jnp.zeros((n, batch), jnp.uint8),
    )


def _with_key_transform(store: Store, config: CacheConfig, calibration, layers) -> Store:
    """``store`` with the key transform's vectors: calibrated ones broadcast to every row,
    or neutral ones that a row's first append replaces (``first``)."""
    n, batch, heads = store.raw.shape[:3]
    head_dim = store.raw.shape[-1]
    shape = (n, batch, heads, head_dim)

    def vectors(mode: str, calibrated, neutral: float):
        if not mode:
            return None
        if mode == "calib":
            per_layer = jnp.asarray(calibrated[layers.start:layers.stop])
            return jnp.broadcast_to(per_layer[:, None], shape).astype(centering.DTYPE)
        return jnp.full(shape, neutral, centering.DTYPE)

    return dataclasses.replace(
        store, center=config.center, smooth=config.smooth,
        shift=vectors(config.center, calibration and calibration.center, 0.0),
        scale=vectors(config.smooth, calibration and calibration.scale(bool(config.center)),
                      1.0))


def _param_key(key, layer, head, role):
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, layer), head),
                              _ROLE_IDS[role])


def _encode_heads(codec: Codec, params, x):
    """``x[B, K, T, D]`` -> codes leaves ``[B, K, T // block, ...]`` with per-head params."""
    return jax.vmap(codec.encode, in_axes=(0, 1), out_axes=1)(params, x)


def decode_heads(codec: Codec, params, codes, dtype=jnp.float32):
    """Codes leaves ``[B, K, NB, ...]`` -> ``[B, K, NB * block, D]``."""
    return jax.vmap(lambda p, c: codec.decode(p, c, dtype), in_axes=(0, 1), out_axes=1)(
        params, codes
    )


# -- appending ---------------------------------------------------------------------------


@functools.partial(_register, data=("start", "valid", "overflowed", "bad_valid"), meta=())
@dataclasses.dataclass(frozen=True)
class Step:
    """One append, per row: the length before it (``start``), the tokens it stores
    (``valid``, always within ``0..T`` and the room left), and what :func:`commit` flags:
    real tokens dropped for lack of room (``overflowed``) and a requested count outside
    ``0..T`` (``bad_valid``). :func:`make_step` builds it."""

    start: jax.Array
    valid: jax.Array
    overflowed: jax.Array
    bad_valid: jax.Array

    def positions(self, num_tokens: int) -> jax.Array:
        """``[B, T]`` absolute positions of the chunk's tokens."""
        return self.start[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]


def make_step(cache: KVCache, num_tokens: int, valid: jax.Array | None = None) -> Step:
    """The :class:`Step` for appending a chunk of ``num_tokens`` (``valid[B]`` of them real).

    Raises ``ValueError`` for a chunk longer than ``max_len`` and, when ``valid`` and the
    lengths are concrete, for a count outside ``0..num_tokens`` or a row that would
    overflow. Under ``jit`` a row appends ``clip(valid, 0, min(num_tokens, max_len -
    length))`` tokens, and the step carries the flags that :func:`commit` records.
    """
    if num_tokens > cache.max_len:
        raise ValueError(f"chunk of {num_tokens} tokens exceeds cache capacity {cache.max_len}")
    if valid is None:
        valid = np.full((cache.batch,), num_tokens, np.int32)
    # read concrete counts before the conversion, which a trace would stage
    counts = None if isinstance(valid, jax.core.Tracer) else np.asarray(valid)
    valid = jnp.asarray(valid, jnp.int32)
    if valid.shape != (cache.batch,):
        raise ValueError(f"valid must have shape ({cache.batch},), got {valid.shape}")
    if counts is not None:
        if ((counts < 0) | (counts > num_tokens)).any():
            raise ValueError(f"valid counts must be in 0..{num_tokens}, got {counts.tolist()}")
    if counts is not None and not isinstance(cache.lengths, jax.core.Tracer):
        end = np.asarray(cache.lengths) + counts
        if (end > cache.max_len).any():
            rows = np.nonzero(end > cache.max_len)[0].tolist()
            raise ValueError(
                f"cache overflow: rows {rows} would hold {end.max()} tokens, "
                f"capacity is {cache.max_len}"
            )
    # the tokens each row stores: the real ones (clamped into the chunk), as many as fit
    real = jnp.clip(valid, 0, num_tokens)
    room = cache.max_len - cache.lengths
    return Step(
        start=cache.lengths,
        valid=jnp.minimum(real, room),
        overflowed=real > room,
        bad_valid=(valid < 0) | (valid > num_tokens),
    )


@jax.jit
def commit(cache: KVCache, step: Step) -> KVCache:
    """Advance the lengths and record the step's flags after every layer has appended
    ``step``'s chunk."""
    return dataclasses.replace(
        cache,
        lengths=step.start + step.valid,
        overflowed=cache.overflowed | step.overflowed,
        bad_valid=cache.bad_valid | step.bad_valid,
    )


@jax.jit
def append(layer: Segment, k: jax.Array, v: jax.Array, step: Step) -> Segment:
    """Append a chunk ``k, v [B, T, K, D]`` to a layer view; returns the new view.

    Only the tokens that leave the raw region are encoded (for a one-token decode step,
    at most one codec block), and the compressed slots already written are never read.
    """
    if k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"k and v must both be [B, T, K, D], got {k.shape} and {v.shape}")
    return dataclasses.replace(
        layer, k=_append_store(layer.k, k, step), v=_append_store(layer.v, v, step)
    )


def _rows_set(buf, idx, val, layer=None):
    """Per row ``b``: ``buf[b][:, idx[b]] = val[b]``, dropping out-of-range indices; with
    ``layer``, ``buf[layer, b][:, idx[b]] = val[b]`` in the stacked ``buf`` (one scatter
    into the whole buffer, which XLA does in place)."""
    if layer is None:
        idx = jnp.broadcast_to(idx, (buf.shape[0], idx.shape[-1]))
        return jax.vmap(lambda bb, ii, vv: bb.at[:, ii].set(vv, mode="drop"))(buf, idx, val)
    batch = buf.shape[1]
    idx = jnp.broadcast_to(idx, (batch, idx.shape[-1]))
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], idx.shape)
    # advanced indices split by a slice put their broadcast dims first: [B, n, K, ...]
    return buf.at[layer, rows, :, idx].set(jnp.swapaxes(val, 1, 2), mode="drop")


def _rows_take(buf, idx):
    """Per row ``b``: ``buf[b][:, idx[b]]`` (indices clipped into range)."""
    idx = jnp.broadcast_to(idx, (buf.shape[0], idx.shape[-1]))
    if buf.shape[2] == 0:
        return jnp.zeros((*buf.shape[:2], idx.shape[-1], *buf.shape[3:]), buf.dtype)
    return jax.vmap(lambda bb, ii: jnp.take(bb, ii, axis=1, mode="clip"))(buf, idx)


def _append_store(store: Store, x: jax.Array, step: Step) -> Store:
    batch, num_tokens, heads, head_dim = x.shape
    if store.raw.shape[:2] != (batch, heads) or store.raw.shape[-1] != head_dim:
        raise ValueError(
            f"chunk [B={batch}, K={heads}, D={head_dim}] does not match the cache "
            f"[B={store.raw.shape[0]}, K={store.raw.shape[1]}, D={store.raw.shape[-1]}]"
        )
    x = jnp.swapaxes(x, 1, 2)  # [B, K, T, D]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    is_new = t[None, :] < step.valid[:, None]
    finite = jnp.all(jnp.isfinite(x), axis=(1, 3)) | ~is_new
    nonfinite = store.nonfinite | ~jnp.all(finite, axis=1)
    if store.center or store.smooth:
        store, x = _transform_keys(store, x, step)
    # every token is rounded to the raw dtype before it is encoded, so a token encodes
    # the same whether it reaches the codec straight from a chunk or through the window
    limit = float(jnp.finfo(store.raw.dtype).max)
    saturated = store.saturated
    chunk_max = float(jnp.finfo(x.dtype if jnp.issubdtype(x.dtype, jnp.floating)
                                else jnp.float32).max)
    # a chunk whose type holds nothing beyond the raw dtype (a bf16 model's K/V into a bf16
    # cache) needs no check: at decode it would cost a reduction per role and layer
    if limit < chunk_max:
        # finite values beyond the raw dtype are clipped; Inf is the nonfinite flag's
        beyond = jnp.any(jnp.isfinite(x) & (jnp.abs(x) > limit), axis=(1, 3)) & is_new
        saturated = saturated | jnp.where(jnp.any(beyond, axis=1), SATURATED_RAW, 0).astype(
            saturated.dtype)
    x = jnp.clip(jnp.nan_to_num(x.astype(jnp.float32), nan=0.0), -limit, limit)
    x = round_to_dtype(x, store.raw.dtype)
    raw_x = x.astype(store.raw.dtype)

    # sinks: chunk tokens whose position is below `sinks`
    pos = step.positions(num_tokens)
    sink_idx = jnp.where(is_new & (pos < store.sinks), pos, store.sinks)
    sink = _rows_set(store.sink, sink_idx, raw_x) if store.sinks else store.sink

    # the non-sink stream: raw tokens already held, then this chunk's non-sink tokens
    end = step.start + step.valid
    _, old_n_comp, old_raw = store.counts(step.start)
    new_n_comp = _compressed_tokens(end, store.sinks, store.window, store.block)
    skip = jnp.clip(store.sinks - step.start, 0, step.valid)
    staged_len = store.raw_capacity + num_tokens
    i = jnp.arange(staged_len, dtype=jnp.int32)[None, :]
    from_raw = i < old_raw[:, None]
    chunk_idx = i - old_raw[:, None] + skip[:, None]
    staged = jnp.where(
        from_raw[:, None, :, None],
        _rows_take(store.raw.astype(jnp.float32), jnp.minimum(i, store.raw_capacity - 1)),
        _rows_take(x, chunk_idx),
    )  # [B, K, R + T, D] in position order; exact raw values, encoded from float32

    # encode only as many tokens as can possibly leave the raw region in this step
    block = store.block
    max_new = block * ((num_tokens + block - 1) // block)
    codes = store.codes
    if max_new and store.slots:
        leaving = staged[:, :, :max_new]
        j = jnp.arange(max_new // block, dtype=jnp.int32)[None, :]
        n_new_blocks = (new_n_comp - old_n_comp) // block
        slot = jnp.where(j < n_new_blocks[:, None], old_n_comp[:, None] // block + j, store.slots)
        if store.codec.row_pool:
            codes = _append_pooled(store, leaving, old_n_comp // block, n_new_blocks, slot)
        else:
            codes = store.write_blocks(slot, _encode_heads(store.codec, store.params,
                                                           leaving))
        if store.page_blocks:
            # a block whose row has no page for it is lost: flagged, never written over
            at = store.pool_slots(slot)
            lost = jnp.any((slot < store.slots)
                           & (at >= store.pool_pages * store.page_blocks), axis=1)
            saturated = saturated | jnp.where(lost, DROPPED_NO_PAGE, 0).astype(
                saturated.dtype)
        limits = store.codec.limits
        # every staged value is finite and within the raw dtype: a codec whose only limit
        # is an element bound at least that wide cannot be exceeded (bf16 codes of a bf16
        # raw store), and the check would cost a reduction per role and layer
        if math.isfinite(limits.norm) or limits.element < limit:
            # the codec saturated (under jit) whichever written token it cannot represent
            written = jnp.arange(max_new, dtype=jnp.int32)[None, :] < (
                new_n_comp - old_n_comp)[:, None]
            outside = jnp.any(~store.codec.in_range(leaving), axis=1) & written
            saturated = saturated | jnp.where(
                jnp.any(outside, axis=1), SATURATED_CODEC, 0).astype(saturated.dtype)

    # the new raw region starts at the first token that stays uncompressed
    moved = (new_n_comp - old_n_comp)[:, None]
    r = jnp.arange(store.raw_capacity, dtype=jnp.int32)[None, :]
    new_raw_count = end - jnp.minimum(end, store.sinks) - new_n_comp
    raw = _rows_take(staged.astype(store.raw.dtype), moved + r)
    raw = jnp.where((r < new_raw_count[:, None])[:, None, :, None], raw, 0).astype(store.raw.dtype)
    return dataclasses.replace(store, codes=codes, raw=raw, sink=sink, nonfinite=nonfinite,
                               saturated=saturated)


def _append_pooled(store: Store, leaving: jax.Array, first_block: jax.Array,
                   n_new_blocks: jax.Array, slot: jax.Array) -> Any:
    """The codes after writing ``leaving``'s blocks (``[B, K, T, D]``, of which each
    row's first ``n_new_blocks`` are new, going to block ``slot``) for a codec whose
    ``row_pool`` leaf is one pool per row: the codec places the blocks' pool entries
    after those the row's ``first_block`` stored blocks hold (``Codec.encode_after``)."""
    codec, key = store.codec, store.codec.row_pool
    fill = codec.pool_fill(store.layer_codes(), first_block[:, None])  # [B, K]
    encoded, pos, chunks = jax.vmap(codec.encode_after, in_axes=(0, 1, None, 1),
                                    out_axes=1)(store.params, leaving, first_block, fill)
    per_block = {name: leaf for name, leaf in store.codes.items() if name != key}
    codes = jax.tree.map(lambda buf, val: _rows_set(buf, slot, val, store.layer),
                         per_block, encoded)
    # chunks of the blocks past the new ones (unfinished) write nothing
    per_chunk = pos.shape[-1] // slot.shape[-1]
    block_of = jnp.arange(pos.shape[-1], dtype=jnp.int32) // per_chunk
    pos = jnp.where(block_of[None, None, :] < n_new_blocks[:, None, None], pos,
                    jnp.iinfo(jnp.int32).max)
    pool = store.codes[key]
    flat = pool.reshape(*pool.shape[:-3], -1, pool.shape[-1])
    rows = jnp.arange(pos.shape[0])[:, None, None]
    heads = jnp.arange(pos.shape[1])[None, :, None]
    index = (rows, heads, pos) if store.layer is None else (store.layer, rows, heads, pos)
    flat = flat.at[index].set(chunks.astype(flat.dtype), mode="drop")
    return {**codes, key: flat.reshape(pool.shape)}


def _transform_keys(store: Store, x: jax.Array, step: Step) -> tuple[Store, jax.Array]:
    """``(store, (x - shift) / scale)`` for a chunk ``x[B, K, T, D]``, float32; a row's
    first append (``first`` modes) sets its vectors from the chunk before it is stored.
    Non-finite values pass through for the append's own handling."""
    finite = jnp.isfinite(x)
    x = x.astype(jnp.float32)
    shift, scale = store.shift, store.scale
    if "first" in (store.center, store.smooth):
        weight = centering.first_chunk_weights(step.valid, x.shape[2])[:, None, :]
        first = ((step.start == 0) & (step.valid > 0))[:, None, None]

        def unused(_):  # no row's first append: the statistics would be discarded
            zero = jnp.zeros((*x.shape[:2], x.shape[3]), jnp.float32)
            return zero, zero, jnp.zeros(x.shape[:2], bool)

        # a chunk's statistics sort its tokens twice per channel: worth skipping on the
        # chunks after a prompt's first; a single-token step's sort is free, and a
        # conditional there would read its predicate on the host at every decode step
        mean, rms, outlying = (
            centering.robust_statistics(x, weight) if x.shape[2] == 1 else
            jax.lax.cond(jnp.any(first), lambda _: centering.robust_statistics(x, weight),
                         unused, None))
        flagged = jnp.any(outlying, axis=1) & first[:, 0, 0]
        store = dataclasses.replace(store, saturated=store.saturated | jnp.where(
            flagged, STATISTICS_OUTLIERS, 0).astype(store.saturated.dtype))
        big = float(jnp.finfo(centering.DTYPE).max)
        if store.center == "first":
            shift = jnp.where(first, jnp.clip(mean, -big, big).astype(shift.dtype), shift)
        if store.smooth == "first":
            spread = rms if store.center else jnp.sqrt(rms * rms + mean * mean)
            new = jnp.clip(centering.smoothing_scale(spread), 0, big).astype(scale.dtype)
            scale = jnp.where(first, new, scale)
    y = x
    if shift is not None:
        y = y - shift.astype(jnp.float32)[:, :, None]
    if scale is not None:
        y = y / scale.astype(jnp.float32)[:, :, None]
    return dataclasses.replace(store, shift=shift, scale=scale), jnp.where(finite, y, x)


def restore(store: Store, keys: jax.Array) -> jax.Array:
    """The keys as appended from ``keys[B, K, S, D]`` read from a layer view's store
    (``keys * scale + shift``; unchanged for a store without a key transform)."""
    if store.scale is not None:
        keys = keys * store.scale.astype(keys.dtype)[:, :, None]
    if store.shift is not None:
        keys = keys + store.shift.astype(keys.dtype)[:, :, None]
    return keys


@jax.jit
def evict_into(prompts: KVCache, mass: jax.Array | None, target: KVCache) -> KVCache:
    """``target`` (an empty cache whose spec has an ``evict=`` clause) holding the tokens
    of ``prompts`` that the eviction keeps, per layer and kv head.

    ``prompts``: a cache that holds each row's whole prompt exactly (its codec stores
    tokens unchanged, e.g. ``bf16``). ``mass``: ``[L, B, K, S]`` attention mass that the
    prompts' queries gave each position (:func:`kvjax.eviction.attention_mass`, summed
    over the prefill), or None for a policy that does not observe. The kept tokens are
    appended in position order, encoded by ``target``'s codecs only now (evict, then
    quantize), and ``evicted`` counts the dropped ones.
    """
    policy = target.config.evict
    if policy is None:
        raise ValueError(f"cache spec '{target.config.spec}' has no evict= clause")
    if (prompts.num_layers, prompts.batch) != (target.num_layers, target.batch):
        raise ValueError("the prompts' cache and the target differ in layers or rows")
    lengths = prompts.lengths
    capacity = policy.capacity(prompts.max_len)
    if capacity > target.max_len:
        raise ValueError(f"the eviction keeps up to {capacity} tokens, the target holds "
                         f"{target.max_len}")
    kept = policy.kept(lengths)

    def gather(carry, _, view):
        i, keys, values = carry
        k = dense(view.k, lengths, view.k.raw.dtype, restore_keys=True)
        v = dense(view.v, lengths, view.v.raw.dtype)
        scores = jnp.zeros(k.shape[:3], jnp.float32) if mass is None else mass[i]
        index = policy.select(scores, lengths, capacity)[..., None]
        take = functools.partial(jnp.take_along_axis, indices=index, axis=2, mode="clip")
        # [B, K, n, D] -> the token-major [B, n, K, D] that append takes
        keys = keys.at[i].set(jnp.swapaxes(take(k), 1, 2).astype(keys.dtype))
        values = values.at[i].set(jnp.swapaxes(take(v), 1, 2).astype(values.dtype))
        return (i + 1, keys, values), view

    first = prompts.segments[0].k.raw
    shape = (prompts.num_layers, prompts.batch, capacity, first.shape[2], first.shape[-1])
    init = (jnp.int32(0), jnp.zeros(shape, first.dtype), jnp.zeros(shape, first.dtype))
    (_, keys, values), _ = scan_layers(gather, init, prompts)

    step = make_step(target, capacity, kept)

    def store(carry, kv, view):
        return carry, append(view, kv["k"], kv["v"], step)

    # a dict, not a tuple: scan_layers reads a sequence as per-layer inputs
    _, target = scan_layers(store, None, target, {"k": keys, "v": values})
    target = commit(target, step)
    return dataclasses.replace(target, evicted=lengths - kept)


# -- reading -----------------------------------------------------------------------------


def token_parts(store: Store, lengths: jax.Array):
    """The three regions of a layer view's store with their absolute positions.

    Returns ``[(kind, payload, positions[B, n], valid[B, n]), ...]`` for kind in
    ``("sink", "codes", "raw")``; ``payload`` is a dense ``[B, K, n, D]`` array for the raw
    regions and the codes pytree (``n = slots * block``) for the compressed one.
    """
    n_sink, n_comp, n_raw = store.counts(lengths)
    batch = lengths.shape[0]
    sink_pos = jnp.broadcast_to(jnp.arange(store.sinks, dtype=jnp.int32), (batch, store.sinks))
    comp_j = jnp.arange(store.slots * store.block, dtype=jnp.int32)[None, :]
    comp_pos = jnp.broadcast_to(store.sinks + comp_j, (batch, comp_j.shape[1]))
    raw_i = jnp.arange(store.raw_capacity, dtype=jnp.int32)[None, :]
    return [
        ("sink", store.sink, sink_pos, sink_pos < n_sink[:, None]),
        ("codes", store.layer_codes(), comp_pos, comp_j < n_comp[:, None]),
        ("raw", store.raw, (store.sinks + n_comp)[:, None] + raw_i, raw_i < n_raw[:, None]),
    ]


def _window_blocks(store: Store, first: jax.Array, size: int):
    """The code blocks that cover positions ``first .. first + size - 1`` (a pytree of
    ``span`` blocks per row and head, a row pool beside them), and for each of the
    positions its index into those blocks' ``span * block`` tokens (clipped)."""
    block, slots = store.block, store.slots
    span = min(slots, -(-size // block) + 1)
    lo = jnp.clip((first - store.sinks) // block, 0, slots - span)
    codes = store.blocks(lo, span)
    if store.codec.row_pool:  # the blocks read their outliers from the whole pool
        codes = {**codes, store.codec.row_pool: store.layer_codes()[store.codec.row_pool]}
    pos = first + jnp.arange(size, dtype=jnp.int32)
    return codes, jnp.clip(pos - store.sinks - lo * block, 0, span * block - 1)


def _window_regions(store: Store, lengths: jax.Array, first: jax.Array, size: int):
    """Per position of the window: ``(in_codes [B, size], in_sinks [size], raw index [B,
    size], valid [B, size])``."""
    _, n_comp, _ = store.counts(lengths)
    pos = first + jnp.arange(size, dtype=jnp.int32)
    in_codes = pos[None, :] < (store.sinks + n_comp)[:, None]
    raw_idx = jnp.clip(pos[None, :] - (store.sinks + n_comp)[:, None], 0,
                       store.raw_capacity - 1)
    return in_codes, pos < store.sinks, raw_idx, pos[None, :] < lengths[:, None]


def decode_window(store: Store, lengths: jax.Array, first: jax.Array, size: int,
                  dtype=jnp.bfloat16):
    """The stored tokens at positions ``first .. first + size - 1`` of every row, decoded.

    ``first`` is a traced int32 scalar, ``size`` static. Returns ``values[B, K, size, D]``
    and ``valid[B, size]`` (position below the row's length). Only the code blocks that
    cover the window are decoded (one more than ``size / block`` when sinks shift the
    blocks off the window's grid), so a reader walking the cache window by window keeps
    its memory to a window and decodes each block about once.
    """
    in_codes, in_sinks, raw_idx, valid = _window_regions(store, lengths, first, size)
    values = _rows_take(store.raw, raw_idx).astype(dtype)
    if store.slots:
        codes, idx = _window_blocks(store, first, size)
        decoded = decode_heads(store.codec, store.params, codes, dtype)
        values = jnp.where(in_codes[:, None, :, None],
                           jnp.take(decoded, idx, axis=2).astype(dtype), values)
    if store.sinks:
        pos = first + jnp.arange(size, dtype=jnp.int32)
        sink = jnp.take(store.sink, jnp.clip(pos, 0, store.sinks - 1), axis=2)
        values = jnp.where(in_sinks[None, None, :, None], sink.astype(dtype), values)
    return values, valid


def window_scores(store: Store, q: jax.Array, lengths: jax.Array, first: jax.Array,
                  size: int) -> jax.Array:
    """Float32 scores ``[B, K, R, size]`` of query rows ``q [B, K, R, D]`` against the
    stored keys at positions ``first .. first + size - 1`` (as :func:`decode_window`
    reads them): the codes' by the codec's own :meth:`~kvjax.codec.Codec.scores` (an
    estimator where it has one), the raw tokens' by a float32 product. Only the blocks
    that cover the window are read."""
    f32 = jnp.float32
    in_codes, in_sinks, raw_idx, _ = _window_regions(store, lengths, first, size)
    q = q.astype(f32)

    def dot(keys):
        return jnp.einsum("bkrd,bksd->bkrs", q, keys.astype(f32), precision=EXACT)

    s = dot(_rows_take(store.raw, raw_idx))
    if store.slots:
        codes, idx = _window_blocks(store, first, size)
        coded = jax.vmap(store.codec.scores, in_axes=(0, 1, 1), out_axes=1)(
            store.params, q, codes)
        s = jnp.where(in_codes[:, None, None, :], jnp.take(coded, idx, axis=3), s)
    if store.sinks:
        pos = first + jnp.arange(size, dtype=jnp.int32)
        s = jnp.where(in_sinks[None, None, None, :],
                      dot(jnp.take(store.sink, jnp.clip(pos, 0, store.sinks - 1), axis=2)), s)
    return s


@functools.partial(jax.jit, static_argnames=("dtype", "restore_keys"))
def dense(store: Store, lengths: jax.Array, dtype=jnp.float32, restore_keys: bool = False
          ) -> jax.Array:
    """All stored tokens of a layer view's store, decoded, in position order.

    ``[B, K, max_len, D]``; slots at or beyond a row's length are zero. Keys come as
    stored (transformed, where the cache centers or smooths them) unless
    ``restore_keys`` (:func:`restore`).
    """
    batch, heads = store.raw.shape[:2]
    out = jnp.zeros((batch, heads, store.max_len, store.raw.shape[-1]), dtype)
    for kind, payload, pos, valid in token_parts(store, lengths):
        if pos.shape[1] == 0:
            continue
        if kind == "codes":
            values = decode_heads(store.codec, store.params, payload, dtype)
        else:
            values = payload
        out = _rows_set(out, jnp.where(valid, pos, store.max_len), values.astype(dtype))
    if restore_keys:
        filled = jnp.arange(store.max_len)[None, :] < lengths[:, None]
        out = jnp.where(filled[:, None, :, None], restore(store, out.astype(jnp.float32)),
                        0).astype(dtype)
    return out


def check(cache: KVCache) -> None:
    """Raise ``ValueError`` if any row's flag is set (eager only): one line that names
    the rows and the cause of each flag (overflow, bad valid counts, NaN/Inf, values
    saturated to fit the storage, paged tokens without a page, outlying keys left out of
    the first chunk's statistics)."""

    def rows(mask) -> list[int]:
        return np.nonzero(mask)[0].tolist()

    problems = []
    over = np.asarray(cache.overflowed)
    if over.any():
        problems.append(f"cache overflow: rows {rows(over)} received more than "
                        f"{cache.max_len} tokens; the excess was dropped")
    bad_valid = np.asarray(cache.bad_valid)
    if bad_valid.any():
        problems.append(f"bad valid counts: rows {rows(bad_valid)} were given a valid "
                        "count below 0 or above their chunk's length; it was clamped")
    nonfinite = np.zeros(cache.batch, bool)
    unpaged = np.zeros(cache.batch, bool)
    outlying = np.zeros(cache.batch, bool)
    saturated: dict[str, np.ndarray] = {}
    for seg in cache.segments:
        for store in (seg.k, seg.v):
            nonfinite |= np.asarray(store.nonfinite).any(axis=0)
            flags = np.bitwise_or.reduce(np.asarray(store.saturated), axis=0)
            unpaged |= (flags & DROPPED_NO_PAGE) != 0
            outlying |= (flags & STATISTICS_OUTLIERS) != 0
            for bit, what in ((SATURATED_RAW, f"{store.raw.dtype} raw tokens"),
                              (SATURATED_CODEC, store.codec.spec)):
                hit = (flags & bit) != 0
                if hit.any():
                    saturated[what] = saturated.get(what, np.zeros(cache.batch, bool)) | hit
    if nonfinite.any():
        problems.append(f"non-finite K/V: rows {rows(nonfinite)} received NaN or Inf "
                        "(stored as finite numbers)")
    for what, hit in saturated.items():
        problems.append(f"out-of-range K/V: values beyond what {what} can store were "
                        f"saturated in rows {rows(hit)}")
    if outlying.any():
        problems.append(f"outlying keys: rows {rows(outlying)} began with keys more than "
                        f"{centering.ROBUST_LIMIT:g} robust deviations from the rest; "
                        "the first chunk's key statistics left them out")
    if unpaged.any():
        problems.append(f"no page: rows {rows(unpaged)} were given tokens past the pages "
                        "of their block tables; those tokens' codes were dropped")
    if problems:
        raise ValueError("; ".join(problems))


# -- layer iteration ---------------------------------------------------------------------


def scan_layers(
    body: Callable[[Any, Any, Segment], tuple[Any, Segment]],
    carry: Any,
    cache: KVCache,
    xs: Any = None,
) -> tuple[Any, KVCache]:
    """Run ``body(carry, xs_i, layer_view) -> (carry, layer_view)`` over all layers.

    ``xs`` is either a pytree with a leading layer axis (e.g. stacked layer weights),
    sliced per segment with each segment run as one ``lax.scan``, or a sequence of
    ``num_layers`` per-layer pytrees, with the layers unrolled so that each reads its own
    buffers in place. On a GPU the slice a scan (or a static slice) takes of a stacked
    weight is a copy, every layer and step: unrolled over per-layer buffers, a Llama-3-8B
    decode step at B = 1 takes half the time (measured: docs/kernels.md); a scan
    compiles faster. Either way the segment rides in the carry, not in the inputs and
    outputs: a view's codes are the whole stack with the layer's index
    (:attr:`Store.layer`), and only the small per-layer parts (raw window, sinks, flags,
    codec parameters) are sliced out and written back. Passing the cache as scanned
    inputs and outputs instead copies every layer's codes on every step.
    """
    if isinstance(xs, (list, tuple)):
        if len(xs) != cache.num_layers:
            raise ValueError(f"{len(xs)} per-layer inputs for a cache of "
                             f"{cache.num_layers} layers")
        return _unrolled_layers(body, carry, cache, xs)
    new_segments = []
    for seg in cache.segments:
        seg_xs = jax.tree.map(lambda a, seg=seg: a[seg.start : seg.stop], xs)

        def step(state, inputs):
            c, stack = state
            x_i, i = inputs
            c, view = body(c, x_i, _layer_view(stack, i, cache.pages))
            return (c, _write_back(stack, view, i)), None

        layers = jnp.arange(seg.stop - seg.start, dtype=jnp.int32)
        (carry, new_seg), _ = jax.lax.scan(step, (carry, seg), (seg_xs, layers))
        new_segments.append(new_seg)
    return carry, dataclasses.replace(cache, segments=tuple(new_segments))


def _unrolled_layers(body, carry, cache: KVCache, xs) -> tuple[Any, KVCache]:
    new_segments = []
    for seg in cache.segments:
        views = []
        for j in range(seg.stop - seg.start):
            index = jnp.int32(j)
            carry, view = body(carry, xs[seg.start + j], _layer_view(seg, index, cache.pages))
            seg = _write_back(seg, view, index,
                              tuple(name for name in _SMALL if name not in _FLAGS))
            views.append(view)
        new_segments.append(_stack_flags(seg, views))
    return carry, dataclasses.replace(cache, segments=tuple(new_segments))


#: a layer view's own parts, sliced from the segment's stacks (its codes are the stack)
_FLAGS = ("nonfinite", "saturated")
_SMALL = ("params", "raw", "sink", "shift", "scale", *_FLAGS)


def _stack_flags(seg: Segment, views: list[Segment]) -> Segment:
    """``seg`` with the flags of its layers' ``views`` (one per layer, in order) as its
    flag stacks: each layer's written into the stack apart would be two tiny kernels per
    layer and step; stacked they are one (each layer reads only its own)."""
    def stacked(role: str) -> Store:
        store = getattr(seg, role)
        return dataclasses.replace(store, **{
            name: jnp.stack([getattr(getattr(v, role), name) for v in views]).astype(
                getattr(store, name).dtype) for name in _FLAGS})

    return dataclasses.replace(seg, k=stacked("k"), v=stacked("v"))


def _layer_view(seg: Segment, i: jax.Array, pages: jax.Array | None) -> Segment:
    def view(store: Store) -> Store:
        small = {name: jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False),
            getattr(store, name)) for name in _SMALL}
        return dataclasses.replace(store, layer=i, **small)

    return _with_tables(dataclasses.replace(seg, k=view(seg.k), v=view(seg.v)), pages)


def _write_back(seg: Segment, view: Segment, i: jax.Array,
                names: tuple[str, ...] = _SMALL) -> Segment:
    def write(stack: Store, new: Store) -> Store:
        small = {name: jax.tree.map(
            lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), i, 0),
            getattr(stack, name), getattr(new, name)) for name in names}
        return dataclasses.replace(stack, codes=new.codes, **small)

    return dataclasses.replace(seg, k=write(seg.k, view.k), v=write(seg.v, view.v))


# -- accounting --------------------------------------------------------------------------


def row_codes(store: Store, pages: jax.Array | None) -> Any:
    """A segment's stacked codes by row, leaves ``[L, B, K, slots, ...]``: the codes
    themselves, or for a paged store (block tables ``pages``) gathered from its pool."""
    if not store.page_blocks:
        return store.codes

    def one_layer(codes):
        view = dataclasses.replace(store, codes=codes, layer=None, pages=pages)
        return view.blocks(jnp.int32(0), store.slots)

    return jax.vmap(one_layer)(store.codes)


def fallback_blocks(cache: KVCache) -> int:
    """Blocks stored below their codec's nominal precision because a variable-length code
    did not fit its fixed budget (codecs with ``fallback_levels``, e.g. HyperQuant's Rice
    streams); 0 for every fixed-rate codec. Only occupied block slots count (a row's
    first ``n_comp // block``): a paged pool's other pages may hold another row's old
    codes."""
    total = 0
    for seg in cache.segments:
        for store in (seg.k, seg.v):
            levels = getattr(store.codec, "fallback_levels", None)
            if levels is not None and store.slots:
                n_comp = store.counts(cache.lengths)[1]
                occupied = jnp.arange(store.slots)[None, :] < (n_comp // store.block)[:, None]
                below = levels(row_codes(store, cache.pages)) > 0  # [L, B, K, slots]
                total += int(jnp.sum(below & occupied[None, :, None, :]))
    return total


def outlier_overflow(cache: KVCache) -> dict[str, int]:
    """Med-C outlier chunks (:mod:`kvjax.codecs.outliers`) of the blocks the cache holds
    now, over every store whose codec extracts them.

    ``outliers``: chunks stored exactly in a block's outlier slots; ``overflow``: chunks
    over the threshold that did not fit in the slots and went to the base codec;
    ``chunks``: every chunk of 4 dims those codecs compressed, outlier or not (so
    ``(outliers + overflow) / chunks`` is the share over the threshold, the outlier
    fraction of :meth:`~kvjax.codecs.outliers.MedOutlierCodec.paper_bits_per_element`).
    The same with a ``k_`` and a ``v_`` prefix for K and V apart. Only occupied block
    slots count (a row's first ``n_comp // block``): whatever the other slots hold is not
    the row's. All zero without Med-C.
    """
    lengths = np.asarray(cache.lengths, np.int64)
    out = {f"{role}{key}": 0 for role in ("", "k_", "v_")
           for key in ("outliers", "overflow", "chunks")}
    for seg in cache.segments:
        for role in ("k", "v"):
            store = getattr(seg, role)
            per_block = getattr(store.codec, "outlier_counts", None)
            if per_block is None or not store.slots:
                continue
            n_layers, _, heads = store.raw.shape[:3]
            n_comp = np.asarray(store.counts(lengths)[1], np.int64)
            # [B, slots], against the codes' [L, B, K, slots]
            occupied = np.arange(store.slots)[None, :] < (n_comp // store.block)[:, None]
            occupied = occupied[None, :, None, :]
            stored, overflow = (np.asarray(a, np.int64)
                                for a in per_block(row_codes(store, cache.pages)))
            found = {"outliers": int(np.sum(stored * occupied)),
                     "overflow": int(np.sum(overflow * occupied)),
                     "chunks": int(n_comp.sum()) * n_layers * heads
                     * num_chunks(store.raw.shape[-1])}
            for key, value in found.items():
                out[key] += value
                out[f"{role}_{key}"] += value
    return out


def memory_bytes(cache: KVCache) -> int:
    """Bytes of every array the cache holds (codes, raw regions, codec params, lengths)."""
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(cache)))


def stored_bits(cache: KVCache) -> dict[str, float]:
    """Bits the cache spends on the tokens it holds now, measured from its arrays.

    Per-slot costs are the arrays' bytes divided by their slot counts; the occupied
    slots (compressed blocks, raw window, sinks, raw layers) are then summed over rows,
    layers, heads and K/V. Codec parameters are a per-model constant and are excluded
    (see :func:`memory_bytes`); the key transform's vectors (``center=`` / ``smooth=``)
    are counted per row that holds a token, calibrated ones too. Returns ``bits``,
    ``elements`` and ``bits_per_element``, plus ``k_bits``, ``v_bits`` and the
    per-element bits of K and V alone (K and V each hold half of ``elements``), and
    ``sequence_elements`` and ``sequence_bits_per_element``: the elements of the whole
    sequence and the bits over them,
    whose tokens that eviction dropped (:attr:`KVCache.evicted`) cost none (equal to
    ``bits_per_element`` without eviction): the measure that puts eviction and
    quantization on one axis.
    """
    lengths = np.asarray(cache.lengths, np.int64)
    evicted = 0 if cache.evicted is None else np.asarray(cache.evicted, np.int64)
    sequence_elements = 0
    totals = {"k": [0.0, 0], "v": [0.0, 0]}
    for seg in cache.segments:
        for role in ("k", "v"):
            store = getattr(seg, role)
            n_layers, batch, heads = store.raw.shape[:3]
            head_dim = store.raw.shape[-1]
            n_sink, n_comp, n_raw = (np.asarray(a, np.int64) for a in store.counts(lengths))
            per_row_bits = 0.0
            if store.slots:
                # a contiguous store holds each row's slots, a paged one its pool's
                block_slots = (store.pool_pages * store.page_blocks if store.page_blocks
                               else batch * store.slots)
                block_bytes = codes_nbytes(store.codes) / (n_layers * heads * block_slots)
                per_row_bits = 8 * block_bytes * (n_comp // store.block)
            token_bytes = store.raw.dtype.itemsize * head_dim
            per_row_bits = per_row_bits + 8 * token_bytes * (n_raw + n_sink)
            # a row's key transform vectors, once it holds a token
            for vectors in (store.shift, store.scale):
                if vectors is not None:
                    per_row_bits = per_row_bits + 8 * vectors.dtype.itemsize * head_dim * (
                        lengths > 0)
            totals[role][0] += float(np.sum(per_row_bits)) * n_layers * heads
            totals[role][1] += int(lengths.sum()) * n_layers * heads * head_dim
            sequence_elements += int(np.sum(lengths + evicted)) * n_layers * heads * head_dim
    bits = totals["k"][0] + totals["v"][0]
    elements = totals["k"][1] + totals["v"][1]
    out = {"bits": bits, "elements": elements,
           "bits_per_element": bits / elements if elements else float("nan"),
           "sequence_elements": sequence_elements,
           "sequence_bits_per_element": (bits / sequence_elements if sequence_elements
                                         else float("nan"))}
    for role in ("k", "v"):
        b, e = totals[role]
        out[f"{role}_bits"] = b
        out[f"{role}_bits_per_element"] = b / e if e else float("nan")
    return out


def key_calibration(cache: KVCache) -> centering.KeyCalibration:
    """Per (layer, kv head) statistics of every key ``cache`` holds (all rows), for a
    cache spec's ``calib`` modes (:mod:`kvjax.centering`); fill the cache with
    calibration text through a lossless or raw cache (e.g. ``bf16``) first."""
    lengths = cache.lengths
    if int(jnp.sum(lengths)) == 0:
        raise ValueError("the cache holds no tokens to calibrate the keys on")
    centers, spreads = [], []
    for i in range(cache.num_layers):
        keys = dense(cache.layer(i).k, lengths, restore_keys=True)  # [B, K, S, D]
        filled = jnp.arange(cache.max_len)[None, :] < lengths[:, None]  # [B, S]
        # all rows' tokens of a head pooled: heads to the front, rows and tokens joined
        pooled = jnp.swapaxes(keys, 0, 1).reshape(keys.shape[1], -1, keys.shape[-1])
        weight = jnp.broadcast_to(filled[None], (keys.shape[1], *filled.shape))
        mean, rms = centering.statistics(pooled, weight.reshape(keys.shape[1], -1))
        centers.append(mean)
        spreads.append(rms)
    return centering.KeyCalibration(center=np.asarray(jnp.stack(centers)),
                                    rms=np.asarray(jnp.stack(spreads)),
                                    tokens=int(jnp.sum(lengths)))
