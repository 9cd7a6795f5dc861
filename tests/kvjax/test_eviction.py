"""kvjax.eviction: the policies' selections, the attention mass they score by, and the
cache they leave (kvjax.cache.evict_into)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax import eviction as ev
from kvjax.eviction import Eviction, EvictionSpecError, attention_mass, parse_eviction
from kvjax.spec import parse_cache


def test_budgets_as_tokens_and_as_shares():
    assert parse_eviction("h2o:64").kept(jnp.array([10, 64, 100])).tolist() == [10, 64, 64]
    share = parse_eviction("snapkv:25%")
    assert share.kept(jnp.array([4, 10, 100, 0])).tolist() == [1, 3, 25, 0]
    assert share.capacity(100) == 25 and share.capacity(10) == 3
    assert parse_eviction("all").kept(jnp.array([7])).tolist() == [7]
    with pytest.raises(EvictionSpecError, match="one of them"):
        Eviction("h2o")


def test_streaming_keeps_the_sinks_and_the_most_recent():
    policy = parse_eviction("streaming:6,s2")
    lengths = np.array([12, 4])
    sel = policy.select(jnp.zeros((2, 3, 16)), jnp.asarray(lengths), policy.capacity(16))
    assert sel.shape == (2, 3, 6)
    assert sel[0, 0].tolist() == [0, 1, 8, 9, 10, 11]
    # a prompt that fits the budget keeps everything; the spare entries point past S
    assert sel[1, 2].tolist() == [0, 1, 2, 3, 16, 16]


def test_h2o_keeps_the_recent_half_and_the_heaviest_of_the_rest():
    policy = parse_eviction("h2o:4")
    mass = np.zeros((1, 2, 10), np.float32)
    mass[0, 0, [1, 3]] = [5.0, 7.0]
    mass[0, 1, [0, 2]] = [2.0, 9.0]
    sel = policy.select(jnp.asarray(mass), jnp.array([10]), 4)
    # each head keeps positions 8, 9 (recent) and its own two heavy hitters
    assert sel[0, 0].tolist() == [1, 3, 8, 9]
    assert sel[0, 1].tolist() == [0, 2, 8, 9]
    fixed = parse_eviction("h2o:4,r1").select(jnp.asarray(mass), jnp.array([10]), 4)
    assert 9 in fixed[0, 0].tolist() and 8 not in fixed[0, 0].tolist()


def test_snapkv_keeps_the_window_and_pooled_votes():
    policy = parse_eviction("snapkv:5,w2,p3")
    mass = np.zeros((1, 1, 20), np.float32)
    mass[0, 0, 6] = 10.0  # pooling spreads the vote to 5 and 7
    sel = policy.select(jnp.asarray(mass), jnp.array([20]), 5)
    assert sel[0, 0].tolist() == [5, 6, 7, 18, 19]
    unpooled = parse_eviction("snapkv:5,w2,p1").select(jnp.asarray(mass), jnp.array([20]), 5)
    assert {6, 18, 19} <= set(unpooled[0, 0].tolist())


def test_a_budget_below_the_window_keeps_the_most_recent():
    sel = parse_eviction("snapkv:2,w8").select(jnp.zeros((1, 1, 12)), jnp.array([12]), 2)
    assert sel[0, 0].tolist() == [10, 11]


def test_select_compiles_with_traced_lengths():
    policy = parse_eviction("h2o:25%")
    mass = jax.random.uniform(jax.random.key(0), (3, 2, 32))
    lengths = jnp.array([32, 9, 20])
    eager = policy.select(mass, lengths, policy.capacity(32))
    jitted = jax.jit(lambda m, n: policy.select(m, n, policy.capacity(32)))(mass, lengths)
    np.testing.assert_array_equal(eager, jitted)
    kept = np.asarray(policy.kept(lengths))
    for b in range(3):  # real entries first and ascending, the rest past every position
        real = np.asarray(eager[b])[:, :kept[b]]
        assert (real < lengths[b]).all() and (np.diff(real, axis=-1) > 0).all()
        assert (np.asarray(eager[b])[:, kept[b]:] == 32).all()


def _naive_mass(q, keys, q_pos, key_len, weights, scale):
    q, keys = np.asarray(q, np.float64), np.asarray(keys, np.float64)
    batch, tokens, heads_q, _ = q.shape
    heads = keys.shape[1]
    group = heads_q // heads
    out = np.zeros(keys.shape[:3])
    for b in range(batch):
        for n in range(heads_q):
            k = keys[b, n // group]
            for t in range(tokens):
                s = k @ q[b, t, n] * scale
                seen = (np.arange(k.shape[0]) <= q_pos[b, t]) & (np.arange(k.shape[0]) < key_len[b])
                p = np.where(seen, np.exp(s - s[seen].max()), 0.0)
                out[b, n // group] += weights[b, t] * p / p.sum()
    return out


def test_attention_mass_matches_the_softmax_by_blocks(monkeypatch):
    monkeypatch.setattr(ev, "QUERY_BLOCK", 4)  # 10 queries: three blocks, one padded
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 10, 4, 8)).astype(np.float32)
    keys = rng.standard_normal((2, 2, 16, 8)).astype(np.float32)
    q_pos = np.stack([np.arange(10) + 2, np.arange(10)])
    key_len = np.array([12, 10])
    weights = (rng.random((2, 10)) > 0.3).astype(np.float32)
    got = attention_mass(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(q_pos),
                         jnp.asarray(key_len), jnp.asarray(weights), 8 ** -0.5)
    want = _naive_mass(q, keys, q_pos, key_len, weights, 8 ** -0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # every weighted query spreads exactly its weight over its kv head's positions
    np.testing.assert_allclose(np.asarray(got).sum(axis=(1, 2)), 4 * weights.sum(axis=1),
                               rtol=1e-5)
    # a block of queries that all weigh nothing is skipped, not mis-scored
    weights[:, :8] = 0
    got = attention_mass(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(q_pos),
                         jnp.asarray(key_len), jnp.asarray(weights), 8 ** -0.5)
    want = _naive_mass(q, keys, q_pos, key_len, weights, 8 ** -0.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_query_weights_select_the_observers():
    positions = jnp.arange(10)[None, :].repeat(2, 0)
    lengths = jnp.array([10, 6])
    h2o = parse_eviction("h2o:4").query_weights(positions, lengths)
    snap = parse_eviction("snapkv:4,w3").query_weights(positions, lengths)
    assert h2o.sum(axis=1).tolist() == [10, 6]
    assert np.nonzero(np.asarray(snap[1]))[0].tolist() == [3, 4, 5]
    assert not parse_eviction("streaming:4").observes and parse_eviction("h2o:4").observes


def _prompts_cache(rng, lengths, *, heads=2, head_dim=8, layers=2, max_len=16):
    cache = kc.init_cache(jax.random.key(0), parse_cache("f32"), num_layers=layers,
                          batch=len(lengths), num_kv_heads=heads, head_dim=head_dim,
                          max_len=max_len, dtype=jnp.float32)
    shape = (len(lengths), max_len, heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    step = kc.make_step(cache, max_len, np.asarray(lengths))
    for i in range(layers):
        cache = cache.with_layer(i, kc.append(cache.layer(i), k * (i + 1), v - i, step))
    return kc.commit(cache, step), k, v


def _target(spec, cache, room=3):
    config = parse_cache(spec)
    return kc.init_cache(jax.random.key(1), config, num_layers=cache.num_layers,
                         batch=cache.batch, num_kv_heads=2, head_dim=8,
                         max_len=config.evict.capacity(cache.max_len) + room,
                         dtype=jnp.float32)


def test_evict_into_stores_the_selected_tokens_per_head():
    rng = np.random.default_rng(1)
    lengths = [16, 7]
    prompts, k, v = _prompts_cache(rng, lengths)
    mass = jnp.asarray(rng.random((2, 2, 2, 16)).astype(np.float32))
    out = kc.evict_into(prompts, mass, _target("f32 evict=h2o:6", prompts))
    assert out.lengths.tolist() == [6, 6] and out.evicted.tolist() == [10, 1]
    policy = out.config.evict
    for i in range(2):
        sel = np.asarray(policy.select(mass[i], prompts.lengths, 6))
        keys = np.asarray(kc.dense(out.layer(i).k, out.lengths))
        values = np.asarray(kc.dense(out.layer(i).v, out.lengths))
        for b, n in enumerate(lengths):
            kept = min(n, 6)
            for h in range(2):
                pos = sel[b, h, :kept]
                np.testing.assert_array_equal(keys[b, h, :kept], k[b, pos, h] * (i + 1))
                np.testing.assert_array_equal(values[b, h, :kept], v[b, pos, h] - i)
    bits = kc.stored_bits(out)
    # f32 stores 32 bits per kept element; the sequence counts the evicted ones too
    assert bits["bits_per_element"] == 32.0
    assert bits["sequence_bits_per_element"] == pytest.approx(32.0 * 12 / 23)


def test_evict_into_encodes_only_the_kept_tokens_with_the_target_codec():
    rng = np.random.default_rng(2)
    prompts, k, _ = _prompts_cache(rng, [16, 16])
    out = kc.evict_into(prompts, None, _target("int:4 evict=streaming:8,s2", prompts))
    # the same codec appending the kept tokens (positions 0, 1, 10 .. 15) directly
    direct = kc.init_cache(jax.random.key(1), parse_cache("int:4"), num_layers=2, batch=2,
                           num_kv_heads=2, head_dim=8, max_len=11, dtype=jnp.float32)
    kept = jnp.asarray(np.concatenate([k[:, :2], k[:, 10:]], axis=1))
    step = kc.make_step(direct, 8)
    direct = kc.commit(direct.with_layer(0, kc.append(direct.layer(0), kept, kept, step)),
                       step)
    np.testing.assert_array_equal(kc.dense(out.layer(0).k, out.lengths),
                                  kc.dense(direct.layer(0).k, direct.lengths))
    assert out.evicted.tolist() == [8, 8]


def test_evict_into_rejects_a_target_without_the_clause():
    prompts, _, _ = _prompts_cache(np.random.default_rng(3), [4, 4])
    target = _target("f32 evict=all", prompts)
    with pytest.raises(ValueError, match="no evict= clause"):
        kc.evict_into(prompts, None, dataclasses.replace(target, config=parse_cache("f32")))


def test_a_tiny_share_keeps_the_one_token_capacity_promises():
    tiny = parse_eviction("snapkv:0.001%")
    lengths = jnp.asarray([0, 5, 40, 100_000])
    np.testing.assert_array_equal(tiny.kept(lengths), [0, 1, 1, 1])
    assert [tiny.capacity(int(n)) for n in (5, 40, 100_000)] == [1, 1, 1]


@pytest.mark.parametrize("text,name", [("snapkv:2147483648", "budget"),
                                       ("h2o:64,r99999999999999999999", "recent"),
                                       ("snapkv:64,w1073741825", "window")])
def test_counts_past_the_spec_bound_are_refused_at_parse_time(text, name):
    with pytest.raises(EvictionSpecError, match=f"the {name} of .* is past the most"):
        parse_eviction(text)
