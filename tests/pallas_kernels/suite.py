"""The suite every kernel of ``pallas_kernels`` inherits (compiled on a GPU, Pallas
interpret mode elsewhere: the entries' own default).

A kernel's test module subclasses :class:`KernelSuite` as ``Test<Kernel>`` and states:

- ``entry`` and ``reference``: its array-level entry and the pure-jnp reference of the
  same signature (staticmethods);
- ``CASES``: objects with an ``id`` for which ``inputs(case)`` gives the keyword
  arguments of both (odd shapes: S not a multiple of the block, GQA ratios 1/4/7,
  ragged lengths, empty rows); ``lengths(case)`` the per-row token counts;
- ``UNSUPPORTED``: ``(case, reason)`` pairs the entry must refuse with
  ``NotImplementedError`` matching ``reason``;
- ``DROP``: ``(case, shorter lengths)`` whose reference outputs differ by far more than
  the tolerance (so the tolerance can see a dropped block);
- ``TOLERANCE``: the absolute tolerances of the normalized output ``o / l`` and of the
  log-sum-exp ``m + log l`` of non-empty rows;
- ``IMPL`` and ``NEEDLE_SPECS``: its registry name in :mod:`kvjax.attention` and cache
  specs it serves, for the whole-cache case through the attention adapter: a needle key
  at the first, middle and last coded position of ragged rows of up to ~2000 tokens (one
  kv head each) must dominate the output, as in the reference attention.

Every kernel also serves a chunk's queries: ``lengths [B, R]`` per query row (each row
its own causal prefix of the coded tokens), rows blocked into programs of
:data:`~pallas_kernels.flash.BLOCK_ROWS`; checked on the ``DROP`` case's arrays against
the reference, and through the attention adapter for the first ``NEEDLE_SPECS`` on a
cache holding a history before the chunk (whose tokens the window of 16 leaves partly
coded).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax.attention import attend
from kvjax.spec import parse_cache
from pallas_kernels.flash import BLOCK_ROWS

#: ragged rows of the whole-cache case, up to a couple of thousand tokens
NEEDLE_LENGTHS = (1999, 1234, 77)
#: the needle's logit stands this far above the others' typical ones, and its value
#: has this magnitude per dim
NEEDLE_KEY, NEEDLE_VALUE = 4.0, 3.0


@dataclasses.dataclass(frozen=True)
class Shape:
    """The shape of one entry call: rows, kv heads, query rows per kv head, code slots,
    head dim (a kernel's test case adds its codes and blocking)."""

    batch: int
    heads: int
    group: int
    slots: int
    head_dim: int

    @property
    def shape_id(self) -> str:
        return f"B{self.batch}K{self.heads}G{self.group}S{self.slots}D{self.head_dim}"


def layer_stacks(stored, case) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(keys, values, layer)`` of a case: ``stored(case, seed)`` itself, or with
    ``case.layers`` a stack of that many draws read at layer 1."""
    keys, values = stored(case, 0)
    if not case.layers:
        return keys, values, None
    # other layers hold other values: reading the wrong one cannot pass
    stacks = [stored(case, seed) for seed in (1, 0, 2)[:case.layers]]
    keys, values = (jnp.stack([s[r] for s in stacks]) for r in range(2))
    return keys, values, jnp.int32(1)


def normalized(partial) -> np.ndarray:
    """``o / l`` of a partial, in numpy (rows that saw nothing give 0)."""
    o, _, l = (np.asarray(a) for a in partial)
    return o / np.maximum(l, np.finfo(np.float32).tiny)[..., None]


class KernelSuite:
    """Tests every kernel inherits; see the module docstring for what a kernel states."""

    entry = None
    reference = None
    CASES: tuple = ()
    UNSUPPORTED: tuple = ()
    DROP = None
    TOLERANCE: ClassVar[dict[str, float]] = {}
    IMPL = ""
    NEEDLE_SPECS: tuple[str, ...] = ()

    def inputs(self, case) -> dict:
        raise NotImplementedError

    def lengths(self, case) -> list[int]:
        raise NotImplementedError

    def tolerance(self, case) -> dict[str, float]:
        """The tolerances of one case (:data:`TOLERANCE` unless a kernel's cases differ
        in scale)."""
        del case
        return self.TOLERANCE

    def test_entry_matches_reference(self, case):
        kw = self.inputs(case)
        got = self.entry(**kw)
        want = self.reference(**kw)
        out, ref = normalized(got), normalized(want)
        assert np.all(np.isfinite(out))
        tolerance = self.tolerance(case)
        np.testing.assert_allclose(out, ref, atol=tolerance["out"])
        full = np.asarray(self.lengths(case)) > 0
        lse, ref_lse = (np.asarray(p[1])[full] + np.log(np.asarray(p[2])[full])
                        for p in (got, want))
        np.testing.assert_allclose(lse, ref_lse, atol=tolerance["lse"])
        # an empty row attends to nothing: zeros, like the reference
        assert np.all(out[~full] == 0)
        assert np.all(np.asarray(got[2])[~full] == 0)

    def test_unsupported_arrays_raise(self, unsupported):
        case, reason = unsupported
        with pytest.raises(NotImplementedError, match=reason):
            self.entry(**self.inputs(case))

    def test_tolerance_catches_a_dropped_block(self):
        case, shorter = self.DROP
        kw = self.inputs(case)
        full = normalized(self.reference(**kw))
        kw["lengths"] = jnp.asarray(shorter, jnp.int32)
        short = normalized(self.reference(**kw))
        assert np.max(np.abs(full - short)) > 10 * self.TOLERANCE["out"]

    def test_rows_with_their_own_lengths_match_reference(self):
        case = self.DROP[0]
        kw = self.inputs(case)
        q = kw["q"]
        batch, heads, group, _ = q.shape
        rows = BLOCK_ROWS + 6  # two programs' blocks, the second padded
        kw["q"] = jnp.tile(q, (1, 1, -(-rows // group), 1))[:, :, :rows]
        slots = int(max(self.lengths(case)))
        lengths = np.random.default_rng(0).integers(0, slots + 1, (batch, rows))
        lengths[:, :3] = (0, 1, slots)
        kw["lengths"] = jnp.asarray(lengths, jnp.int32)
        got, want = self.entry(**kw), self.reference(**kw)
        out, ref = normalized(got), normalized(want)
        np.testing.assert_allclose(out, ref, atol=self.tolerance(case)["out"])
        seen = np.broadcast_to((lengths > 0)[:, None], (batch, heads, rows))
        lse, ref_lse = (np.asarray(p[1])[seen] + np.log(np.asarray(p[2])[seen])
                        for p in (got, want))
        np.testing.assert_allclose(lse, ref_lse, atol=self.tolerance(case)["lse"])
        assert np.all(out[~seen] == 0) and np.all(np.asarray(got[2])[~seen] == 0)

    def test_chunk_through_the_attention_adapter(self):
        config = parse_cache(self.NEEDLE_SPECS[0])
        view, step, q = _chunk_cache(config)
        got = np.asarray(attend(q, view, step, impl=self.IMPL))
        want = np.asarray(attend(q, view, step, impl="reference"))
        for row, valid in enumerate(np.asarray(step.valid)):
            np.testing.assert_allclose(got[row, :valid], want[row, :valid],
                                       atol=self.TOLERANCE["out"])

    def test_needle_dominates_through_the_attention_adapter(self, needle_spec):
        config = parse_cache(needle_spec)
        heads, group, head_dim = 3, 4, 64
        view, step, q, value, positions = _needle_cache(config, heads, group, head_dim)
        got = np.asarray(attend(q, view, step, impl=self.IMPL))[:, 0]
        want = np.asarray(attend(q, view, step, impl="reference"))[:, 0]
        np.testing.assert_allclose(got, want, atol=self.TOLERANCE["out"])
        # every query head of kv head k sees its needle, wherever it was planted
        n_sink, n_comp, _ = (np.asarray(a) for a in view.k.counts(step.start + step.valid))
        first, middle, last = np.asarray(positions).T
        np.testing.assert_array_equal(first, n_sink)
        np.testing.assert_array_equal(last, n_sink + n_comp - 1)
        assert np.all((first < middle) & (middle < last))
        expect = np.repeat(np.asarray(value), group, axis=1)  # [B, N, D]
        np.testing.assert_allclose(got, expect, atol=0.01 * NEEDLE_VALUE)


def to_pool(a: jax.Array, page_tokens: int, order: np.ndarray, layered: bool,
            per: int = 1) -> jax.Array:
    """A contiguous stack ``[L, B, K, S, ...]`` (``[B, K, S, ...]`` unless ``layered``;
    ``per`` tokens per entry of its ``S`` axis) as a paged pool ``[L, 1, K, pages *
    page entries, ...]``: row ``b``'s page ``p`` at pool page ``order[b, p]``, the
    other pages zero."""
    if not layered:
        a = a[None]
    page = page_tokens // per
    layers, batch, heads, slots, *rest = a.shape
    count = order.shape[1]
    a = jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, count * page - slots),
                    *((0, 0),) * len(rest)))
    a = a.reshape(layers, batch, heads, count, page, *rest)
    pool = jnp.zeros((layers, int(order.max()) + 2, heads, page, *rest), a.dtype)
    pool = pool.at[:, order.reshape(-1)].set(
        jnp.moveaxis(a, 2, 3).reshape(layers, batch * count, heads, page, *rest))
    pool = jnp.moveaxis(pool, 2, 1).reshape(layers, 1, heads, -1, *rest)
    return pool if layered else pool[0]


class PagedSuite:
    """What a kernel that reads paged pools adds to :class:`KernelSuite`: its
    ``PAGED_ARRAYS`` (input name -> tokens per entry of its slot axis), read through
    scattered block tables, give what the contiguous arrays give (its first case, pages
    of ``PAGE_TOKENS``, rows' pages in no order among spare ones, a row's pages past its
    tokens missing)."""

    PAGED_ARRAYS: ClassVar[dict[str, int]] = {}
    PAGE_TOKENS = 32

    def test_paged_pool_matches_the_contiguous_rows(self):
        self.check_paged(self.CASES[0], self.PAGED_ARRAYS)

    def check_paged(self, case, arrays: dict[str, int]):
        """``case`` through pages: the inputs named in ``arrays`` (name -> tokens per
        entry) as a scattered pool, against the contiguous arrays."""
        kw = self.inputs(case)
        batch = kw["q"].shape[0]
        count = -(-case.slots // self.PAGE_TOKENS)
        order = np.random.default_rng(1).permutation(batch * count + 3)[:batch * count]
        order = order.reshape(batch, count).astype(np.int32)
        tables = order.copy()
        for row, length in enumerate(self.lengths(case)):
            tables[row, -(-length // self.PAGE_TOKENS):] = -1  # pages it never reached
        paged = {**kw, "pages": jnp.asarray(tables), "page_tokens": self.PAGE_TOKENS}
        layered = kw.get("layer") is not None
        for name, per in arrays.items():
            if kw.get(name) is not None:
                paged[name] = to_pool(kw[name], self.PAGE_TOKENS, order, layered, per)
        want = normalized(self.reference(**kw))
        np.testing.assert_allclose(normalized(self.reference(**paged)), want, atol=1e-5)
        np.testing.assert_allclose(normalized(self.entry(**paged)), want,
                                   atol=self.tolerance(case)["out"])


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _needle_cache(config, heads, group, head_dim, seed=0):
    """A one-layer cache of ``NEEDLE_LENGTHS`` rows (a paged spec's pages scrambled) after
    a prefill and one decode append whose kv head ``k`` holds a needle at the first
    (k=0), middle (k=1) and last (k=2) coded position of every row; returns ``(view,
    step, q [B, 1, N, D], needle values as the cache decodes them [B, K, D], needle
    positions [B, 3])``. One compiled
    program: built op by op, the cache alone took longer than the kernel."""
    lengths = jnp.asarray(NEEDLE_LENGTHS, jnp.int32)
    batch, total = len(NEEDLE_LENGTHS), max(NEEDLE_LENGTHS)
    cache = kc.init_cache(jax.random.key(seed), config, num_layers=1, batch=batch,
                          num_kv_heads=heads, head_dim=head_dim, max_len=total + 1,
                          dtype=jnp.bfloat16)
    if cache.pages is not None:
        # a paged spec: every row's pages in reverse order, in another row's place
        pool = int(cache.pages.size)
        cache = kc.with_pages(cache, pool - 1 - np.arange(pool).reshape(cache.pages.shape))
    n_sink, n_comp, _ = cache.segments[0].k.counts(lengths + 1)
    positions = jnp.stack([n_sink, n_sink + n_comp // 2, n_sink + n_comp - 1], axis=1)
    keys = jax.random.split(jax.random.key(seed + 1), 4)
    k = jax.random.normal(keys[0], (batch, total + 1, heads, head_dim))
    v = jax.random.normal(keys[1], (batch, total + 1, heads, head_dim))
    direction = jnp.sign(jax.random.normal(keys[2], (heads, head_dim)))
    value = NEEDLE_VALUE * jnp.sign(jax.random.normal(keys[3], (batch, heads, head_dim)))
    rows, kv_heads = jnp.arange(batch)[:, None], jnp.arange(heads)[None, :]
    k = k.at[rows, positions, kv_heads].set(NEEDLE_KEY * direction[None])
    v = v.at[rows, positions, kv_heads].set(value)
    step = kc.make_step(cache, total, lengths)
    view = kc.append(cache.layer(0), k[:, :total], v[:, :total], step)
    cache = kc.commit(cache.with_layer(0, view), step)
    # the decode token of every row (its query's own) comes right after its prompt
    idx = lengths[:, None, None, None]
    step = kc.make_step(cache, 1)
    view = kc.append(cache.layer(0), jnp.take_along_axis(k, idx, axis=1),
                     jnp.take_along_axis(v, idx, axis=1), step)
    q = jnp.broadcast_to(direction[None, None, :, None, :],
                         (batch, 1, heads, group, head_dim)).reshape(batch, 1, -1, head_dim)
    # the needle as the cache holds it (a lossy codec's own rounding of +-3)
    values = kc.dense(view.v, step.start + step.valid)  # [B, K, T, D]
    stored = values[rows, kv_heads, positions]
    return view, step, q, stored, positions


@functools.partial(jax.jit, static_argnums=(0,))
def _chunk_cache(config, seed=0):
    """A one-layer cache (2 kv heads of 3 query heads, head dim 64) holding ragged
    histories (90 and 61 tokens) and then a chunk of 40 (23 real in the second row)
    appended; returns ``(view, step, q [B, 40, 6, 64])`` of that chunk (120 query rows
    per kv head: two programs' blocks)."""
    batch, heads, group, head_dim, history, chunk = 2, 2, 3, 64, 90, 40
    cache = kc.init_cache(jax.random.key(seed), config, num_layers=1, batch=batch,
                          num_kv_heads=heads, head_dim=head_dim, max_len=history + chunk,
                          dtype=jnp.bfloat16)
    keys = jax.random.split(jax.random.key(seed + 1), 5)
    kv = jax.random.normal(keys[0], (2, batch, history + chunk, heads, head_dim))
    step = kc.make_step(cache, history, jnp.asarray([history, 61], jnp.int32))
    view = kc.append(cache.layer(0), kv[0, :, :history], kv[1, :, :history], step)
    cache = kc.commit(cache.with_layer(0, view), step)
    step = kc.make_step(cache, chunk, jnp.asarray([chunk, 23], jnp.int32))
    view = kc.append(cache.layer(0), kv[0, :, history:], kv[1, :, history:], step)
    q = jax.random.normal(keys[1], (batch, chunk, heads * group, head_dim))
    return view, step, q
