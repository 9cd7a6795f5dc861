"""A paged cache (``page=N``) holds and reads what a contiguous one does, whichever pool
pages its block tables name; pages it lacks are flagged, never written over."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax.attention import attend
from kvjax.attention.dispatch import NoImplementationError
from kvjax.spec import CacheSpecError, parse_cache

BATCH, HEADS, HEAD_DIM, LAYERS, MAX_LEN = 2, 2, 32, 2, 100
#: (tokens, valid per row) of each append: two ragged chunks, then two decode steps
APPENDS = [(40, [40, 23]), (40, [30, 40]), (1, [1, 1]), (1, [1, 0])]


def _new(spec, num_pages=None, head_dim=HEAD_DIM):
    return kc.init_cache(jax.random.key(1), parse_cache(spec), num_layers=LAYERS,
                         batch=BATCH, num_kv_heads=HEADS, head_dim=head_dim,
                         max_len=MAX_LEN, num_pages=num_pages)


def _run(cache, impls=("reference", "auto"), appends=APPENDS):
    """Every append of ``appends`` through both layers; the attention outputs of each by
    each of ``impls`` (default: the reference and the "auto" list, XLA's windows for
    chunks off a GPU), and the cache."""
    outs = []
    key = jax.random.key(0)
    head_dim = cache.segments[0].k.raw.shape[-1]
    for n, (tokens, valid) in enumerate(appends):
        k, v, q = (jax.random.normal(jax.random.fold_in(key, 3 * n + i), shape)
                   for i, shape in enumerate([(BATCH, tokens, HEADS, head_dim)] * 2
                                             + [(BATCH, tokens, 2 * HEADS, head_dim)]))
        step = kc.make_step(cache, tokens, jnp.asarray(valid))

        def body(carry, _, view, k=k, v=v, q=q, step=step):
            view = kc.append(view, k, v, step)
            return carry + [attend(q, view, step, impl=name) for name in impls], view

        got, cache = kc.scan_layers(body, [], cache, [None] * LAYERS)
        cache = kc.commit(cache, step)
        outs += got
    return outs, cache


def _scrambled(cache):
    """Tables naming pages in no order, with spare pages between (a pool of 9)."""
    tables = np.full(cache.pages.shape, -1, np.int32)
    pages = cache.pages.shape[1]
    tables[0] = [7, 1, 3, 5][:pages]
    tables[1] = [0, 2, 8, 6][:pages]
    return kc.with_pages(cache, tables)


@pytest.mark.parametrize("spec", ["int:4 window=8", "kivi:2,g32 window=4 sinks=2",
                                  "turboquant:b4", "octopus:b2,qjl window=2"])
def test_paged_caches_attend_as_the_contiguous_one(spec):
    want, contiguous = _run(_new(spec))
    own, identity = _run(_new(spec + " page=32"))
    scrambled_out, scrambled = _run(_scrambled(_new(spec + " page=32", num_pages=9)))
    for a, b, c in zip(want, own, scrambled_out, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)
        np.testing.assert_allclose(c, a, atol=1e-5)
    for cache in (identity, scrambled):
        kc.check(cache)
        for i in range(LAYERS):
            for role in ("k", "v"):
                np.testing.assert_array_equal(
                    kc.dense(getattr(cache.layer(i), role), cache.lengths),
                    kc.dense(getattr(contiguous.layer(i), role), contiguous.lengths))
    assert kc.stored_bits(identity) == kc.stored_bits(contiguous)
    assert kc.stored_bits(scrambled) == kc.stored_bits(contiguous)


def test_default_tables_give_each_row_its_own_pages_in_order():
    cache = _new("int:4 window=4 sinks=4 page=16")
    assert kc.row_pages(cache.config, MAX_LEN) == 6  # ceil((100 - 4 - 4) / 16)
    np.testing.assert_array_equal(cache.pages, np.arange(12).reshape(2, 6))
    # int:4 blocks are one token: a page holds 16 block slots, the pool 12 pages
    assert jax.tree.leaves(cache.segments[0].k.codes)[0].shape[:4] == (LAYERS, 1, HEADS,
                                                                       12 * 16)
    empty = _new("int:4 page=16", num_pages=5)
    assert (np.asarray(empty.pages) == -1).all()


def test_a_row_without_a_page_is_flagged_and_writes_no_other_page():
    cache = _new("int:4 page=32", num_pages=5)
    cache = kc.with_pages(cache, [[0, 1, 3, -1], [2, -1, -1, -1]])
    free_page = np.s_[:, :, :, 4 * 32:5 * 32]  # int:4: 32 one-token blocks a page
    before = np.asarray(jax.tree.leaves(cache.segments[0].k.codes)[0][free_page])
    _, cache = _run(cache)
    # row 1 holds 71 tokens on one page of 32: its blocks past it went nowhere
    with pytest.raises(ValueError, match=r"no page: rows \[1\] were given tokens past "
                                         r"the pages of their block tables"):
        kc.check(cache)
    np.testing.assert_array_equal(jax.tree.leaves(cache.segments[0].k.codes)[0][free_page],
                                  before)  # the free page is untouched
    flags = np.asarray(cache.segments[0].k.saturated)
    assert (flags & kc.DROPPED_NO_PAGE).any(axis=0).tolist() == [False, True]


def test_copied_pages_read_back_as_the_source():
    _, cache = _run(_new("int:4 window=8 page=32", num_pages=8))
    source_table = np.asarray(cache.pages)
    copied = kc.copy_pages(cache, jnp.asarray(source_table[0, :2]), jnp.asarray([6, 7]))
    # row 0 reading from the copies: its tokens come back the same
    moved = kc.with_pages(copied, np.where(np.arange(BATCH)[:, None] == 0,
                                           [[6, 7, *source_table[0, 2:]]], source_table))
    for role in ("k", "v"):
        np.testing.assert_array_equal(kc.dense(getattr(moved.layer(1), role), moved.lengths),
                                      kc.dense(getattr(cache.layer(1), role), cache.lengths))


@pytest.mark.parametrize("spec,impl", [("int:4 window=8", "int_decode"),
                                       ("k=saw:h32,signs v=int:4", "int_decode"),
                                       ("bf16 window=4 sinks=2", "dense_decode"),
                                       ("turboquant:b3,qjl window=2", "codebook_decode"),
                                       ("octopus:b3 sinks=2", "octopus_decode"),
                                       ("polarquant:b3", "polar_decode"),
                                       ("hqmq:s96,r4,med3,mb16 window=2", "hqmq_decode"),
                                       ("hyperquant:e8,3bps sinks=2", "rice_decode")])
def test_kernels_read_pages_through_the_tables(spec, impl):
    """Chunks and decode steps of a kernel that reads pages (Pallas interpret mode off a
    GPU) over scattered tables, against the reference over the contiguous cache."""
    # the polar kernel's full-depth layout, and HQMQ's 16 chunks of 4 at the least
    head_dim = 64 if impl in ("polar_decode", "hqmq_decode") else HEAD_DIM
    want, _ = _run(_new(spec, head_dim=head_dim), impls=("reference",))
    got, cache = _run(_scrambled(_new(spec + " page=32", num_pages=9, head_dim=head_dim)),
                      impls=(impl,))
    kc.check(cache)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, atol=2e-2)


def test_the_flash_chunk_kernel_refuses_pages_and_auto_falls_back():
    """``chunk_flash`` reads a 16-bit cache where every token sits at its position: a
    paged one's do not, and "auto" then takes the dense kernel through the tables."""
    cache = _new("bf16 page=32")
    step = kc.make_step(cache, 4, jnp.asarray([4, 4]))
    view = kc.append(cache.layer(0), *(jnp.ones((BATCH, 4, HEADS, HEAD_DIM)),) * 2, step)
    q = jnp.ones((BATCH, 4, 2 * HEADS, HEAD_DIM))
    with pytest.raises(NoImplementationError, match="is paged: its tokens are not at"):
        attend(q, view, step, impl="chunk_flash")
    attend(q, view, step, impl="auto")


@pytest.mark.parametrize("spec,impl", [("int:4", "int_decode"), ("bf16", "dense_decode")])
def test_kernels_read_a_page_two_rows_share(spec, impl):
    """Row 0 writes 40 tokens; row 1 starts with row 0's first page in its table and 32
    tokens (what a serving engine does for a shared prompt prefix), then both append a
    chunk and a decode step: the kernel reads the shared page as the reference does."""
    cache = kc.with_pages(_new(spec + " page=32", num_pages=9),
                          [[7, 1, 3, 5], [-1, -1, -1, -1]])
    _, cache = _run(cache, impls=(), appends=[(40, [40, 0])])
    cache = kc.with_pages(cache, [[7, 1, 3, 5], [7, 2, 8, 6]])
    cache = kc.reset_rows(cache, jnp.asarray([False, True]), jnp.asarray([0, 32]))
    appends = [(20, [20, 20]), (1, [1, 1])]
    want, _ = _run(cache, impls=("reference",), appends=appends)
    got, after = _run(cache, impls=(impl,), appends=appends)
    kc.check(after)
    np.testing.assert_array_equal(after.lengths, [61, 53])
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, atol=2e-2)
    # the shared page holds row 0's tokens: row 1 reading it sees them
    for role in ("k", "v"):
        dense = kc.dense(getattr(after.layer(0), role), after.lengths)
        np.testing.assert_array_equal(dense[1, :, :32], dense[0, :, :32])


def test_page_spec_and_bad_paging_are_clear():
    config = parse_cache("int:4 window=8 page=64")
    assert config.page_tokens == 64 and config.spec == "int:4 window=8 page=64"
    assert parse_cache(config.spec) == config
    with pytest.raises(CacheSpecError, match="a page holds at least one token"):
        parse_cache("int:4 page=0")
    with pytest.raises(CacheSpecError, match="page_tokens must be a non-negative int"):
        parse_cache("int:4").__class__(k="int:4", page_tokens=-1)
    with pytest.raises(ValueError, match="page=48 is not a multiple of kivi:2,g32's block "
                                         "of 32 tokens"):
        _new("kivi:2,g32 page=48")
    with pytest.raises(ValueError, match="keeps one outlier pool per row"):
        _new("hqmq:s7,r3,med2,mb4,mpool page=16")
    with pytest.raises(ValueError, match="not paged"):
        _new("int:4", num_pages=4)
    with pytest.raises(ValueError, match="num_pages must be a positive int"):
        _new("int:4 page=16", num_pages=0)
    cache = _new("int:4 page=16")
    with pytest.raises(ValueError, match=r"block tables of shape \(2, 3\) for a cache whose "
                                         r"tables are \(2, 7\)"):
        kc.with_pages(cache, np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="is not paged"):
        kc.with_pages(_new("int:4"), np.zeros((2, 3), np.int32))
