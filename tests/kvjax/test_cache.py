"""The compressed cache: bookkeeping, chunking invariance, policy, flags, accounting."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax.codec import Codec, CodecError, Limits
from kvjax.codecs.intn import IntCodec
from kvjax.spec import parse_cache, parse_codec


def _bf16_exact(rng, shape):
    """Random float32 values that bf16 represents exactly."""
    x = rng.standard_normal(shape).astype(np.float32)
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


def _new(config, *, batch=2, heads=2, head_dim=16, max_len=40, layers=1, dtype=jnp.float32):
    return kc.init_cache(jax.random.key(0), config, num_layers=layers, batch=batch,
                         num_kv_heads=heads, head_dim=head_dim, max_len=max_len, dtype=dtype)


def _append_all(cache, k, v, valid=None):
    """Append one chunk ``[B, T, K, D]`` to every layer and commit."""
    step = kc.make_step(cache, k.shape[1], valid)
    for i in range(cache.num_layers):
        cache = cache.with_layer(i, kc.append(cache.layer(i), k, v, step))
    return kc.commit(cache, step)


def _expected_dense(codec, params, x, sinks, window, block, prefix=None):
    """What a store must read back after holding ``x[B, K, :prefix, D]``.

    Blocks start at position ``sinks`` whatever the chunking, so the codes of a prefix
    are those of the whole sequence: one encode of ``x`` serves every prefix.
    """
    total = x.shape[2]
    prefix = total if prefix is None else prefix
    whole = max(0, total - sinks) // block * block
    out = np.array(x)
    if whole:
        out[:, :, sinks:sinks + whole] = np.asarray(
            _round_trip(codec, params, jnp.asarray(x[:, :, sinks:sinks + whole])))
    n_comp = max(0, prefix - sinks - window) // block * block
    want = np.array(x[:, :, :prefix])
    want[:, :, sinks:sinks + n_comp] = out[:, :, sinks:sinks + n_comp]
    return want


@functools.partial(jax.jit, static_argnums=0)
def _round_trip(codec, params, x):
    return kc.decode_heads(codec, params, kc._encode_heads(codec, params, x))


CONFIGS = [
    dict(k="int:4", v="int:4", residual_window=0, sink_tokens=0),
    dict(k="int:4", v="fp8", residual_window=5, sink_tokens=0),
    dict(k="int:3", v="int:8", residual_window=3, sink_tokens=2),
    dict(k="kivi:2,g4", v="kivi:2,g4,token", residual_window=0, sink_tokens=0),
    dict(k="kivi:4,g4", v="kivi:4,g4,token", residual_window=6, sink_tokens=3),
    # nested codes in blocks of 4 tokens (median and outlier slots per block)
    dict(k="hqmq:s7,r3,med2,mb4", v="int:4,med3,mb2", residual_window=2, sink_tokens=1),
    # outlier slots pooled per row: a block's entries continue where the row's last ended
    dict(k="hqmq:s7,r3,med2,mb4,mpool", v="int:4,med1.5,mb2,mp10,mpool", residual_window=2,
         sink_tokens=1),
    # per-head rotation signs and a [D, D] sketch among the codec parameters (the frame
    # TurboQuant shares), byte streams of mixed-width fields, fp16 radii beside the angles
    dict(k="octopus:b2,qjl", v="polarquant:b2,l3", residual_window=2, sink_tokens=0),
    # Rice streams in per-block budgets of 4 tokens with dither keyed on the stored norms;
    # int8 lattice codes with a Haar rotation among the parameters
    dict(k="hyperquant:e8,3bps,signs,dither,t4", v="hyperquant:a2,2bps,haar,int8",
         residual_window=3, sink_tokens=1),
]


def _config_id(c):
    return f"{c['k']}|{c['v']}|w{c['residual_window']}s{c['sink_tokens']}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=_config_id)
def test_chunked_appends_read_back_like_one_shot_encoding(cfg):
    config = kc.CacheConfig(**cfg)
    rng = np.random.default_rng(1)
    total = 37
    k = _bf16_exact(rng, (2, total, 2, 16))
    v = _bf16_exact(rng, (2, total, 2, 16))
    cache = _new(config)
    # three chunk sizes (each compiles its own append) whose runs still end at every
    # offset within a block of 4 and straddle the window and sink boundaries
    chunks = [1, 4, 1, 1, 7, 1, 1, 7, 7, 7]
    assert sum(chunks) == total
    pos = 0
    for n in chunks:
        cache = _append_all(cache, k[:, pos:pos + n], v[:, pos:pos + n])
        pos += n
        view = cache.layer(0)
        for role, x in (("k", k), ("v", v)):
            store = getattr(view, role)
            _, n_comp, n_raw = (np.asarray(a) for a in store.counts(cache.lengths))
            assert (n_comp % store.block == 0).all()
            assert (n_raw <= store.raw_capacity).all() and (n_raw >= 0).all()
            got = np.asarray(kc.dense(store, cache.lengths))[:, :, :pos]
            want = _expected_dense(store.codec, store.params, np.swapaxes(x, 1, 2),
                                   config.sink_tokens, config.residual_window, store.block,
                                   prefix=pos)
            np.testing.assert_array_equal(got, want)
    assert np.asarray(cache.lengths).tolist() == [total, total]

    one_shot = _append_all(_new(config), k, v)
    for a, b in zip(jax.tree.leaves(one_shot), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_window_longer_than_the_cache_keeps_every_token_raw():
    config = kc.CacheConfig(k="int:4", v="int:4", residual_window=10**9, sink_tokens=2)
    rng = np.random.default_rng(3)
    cache = _new(config, batch=1, max_len=12)
    store = cache.layer(0).k
    assert store.slots == 0 and store.raw.shape[-2] == 10
    k = _bf16_exact(rng, (1, 12, 2, 16))
    cache = _append_all(cache, k[:, :7], k[:, :7])
    cache = _append_all(cache, k[:, 7:], k[:, 7:])
    got = np.asarray(kc.dense(cache.layer(0).k, cache.lengths))
    np.testing.assert_array_equal(got, np.swapaxes(k, 1, 2))


def test_ragged_rows_hold_their_own_tokens():
    config = kc.CacheConfig(k="int:8", v="int:8", residual_window=2, sink_tokens=1)
    rng = np.random.default_rng(2)
    cache = _new(config, batch=3)
    k = _bf16_exact(rng, (3, 20, 2, 16))
    streams = {b: [] for b in range(3)}
    pos = 0
    for n, valid in [(6, [6, 2, 0]), (5, [1, 5, 3]), (1, [1, 1, 1]), (8, [0, 8, 4])]:
        chunk = k[:, pos:pos + n]
        cache = _append_all(cache, chunk, chunk, valid=jnp.array(valid))
        for b in range(3):
            streams[b].extend(chunk[b, : valid[b]])
        pos += n
    lengths = np.asarray(cache.lengths)
    assert lengths.tolist() == [len(streams[b]) for b in range(3)]
    view = cache.layer(0)
    got = np.asarray(kc.dense(view.k, cache.lengths))
    for b in range(3):
        x = np.swapaxes(np.stack(streams[b])[None], 1, 2)
        want = _expected_dense(view.k.codec, view.k.params, x, 1, 2, 1)
        np.testing.assert_array_equal(got[b : b + 1, :, : lengths[b]], want)
        assert not got[b, :, lengths[b]:].any()


def test_decode_appends_compile_once():
    config = kc.CacheConfig(k="kivi:2,g4", v="kivi:2,g4,token", residual_window=3)
    cache = _new(config, max_len=64)
    traces = []

    @jax.jit
    def step_fn(cache, k):
        traces.append(1)
        step = kc.make_step(cache, 1)
        view = kc.append(cache.layer(0), k, k, step)
        return kc.commit(cache.with_layer(0, view), step)

    rng = np.random.default_rng(3)
    for _ in range(20):
        cache = step_fn(cache, jnp.asarray(rng.standard_normal((2, 1, 2, 16)), jnp.float32))
    assert len(traces) == 1
    assert np.asarray(cache.lengths).tolist() == [20, 20]


def test_overflow_raises_eagerly_and_flags_under_jit():
    config = kc.CacheConfig(k="int:4", v="int:4", residual_window=2)
    cache = _new(config, max_len=8)
    x = jnp.ones((2, 6, 2, 16))
    cache = _append_all(cache, x, x)
    with pytest.raises(ValueError, match="overflow"):
        kc.make_step(cache, 3)
    with pytest.raises(ValueError, match="capacity"):
        kc.make_step(cache, 9)
    before = np.asarray(kc.dense(cache.layer(0).k, cache.lengths))

    @jax.jit
    def jitted(cache, k):
        return _append_all(cache, k, k)

    after = jitted(cache, 5 * jnp.ones((2, 3, 2, 16)))
    assert np.asarray(after.overflowed).all()
    assert np.asarray(after.lengths).tolist() == [8, 8]
    got = np.asarray(kc.dense(after.layer(0).k, after.lengths))
    np.testing.assert_array_equal(got[:, :, :6], before[:, :, :6])  # nothing overwritten
    with pytest.raises(ValueError, match="overflow"):
        kc.check(after)


def test_nonfinite_input_is_flagged_and_stored_finite():
    config = kc.CacheConfig(k="int:4", v="bf16", residual_window=2, sink_tokens=1)
    cache = _new(config)
    x = np.ones((2, 6, 2, 16), np.float32)
    x[1, 3, 0, 5] = np.nan
    x[1, 0, 1, 2] = np.inf
    cache = jax.jit(_append_all)(cache, jnp.asarray(x), jnp.asarray(x))
    for store in (cache.layer(0).k, cache.layer(0).v):
        assert np.isfinite(np.asarray(kc.dense(store, cache.lengths))).all()
        assert np.asarray(store.nonfinite).tolist() == [False, True]
    with pytest.raises(ValueError, match="non-finite"):
        kc.check(cache)


def test_layer_policy_segments_and_scan_match_a_python_loop():
    config = parse_cache("k=int:4 v=int:2 layers[0,-1]:k=bf16 window=1")
    cache = _new(config, layers=5)
    assert [(s.start, s.stop) for s in cache.segments] == [(0, 1), (1, 4), (4, 5)]
    assert cache.layer(0).k.codec == parse_codec("bf16")
    assert cache.layer(2).k.codec == parse_codec("int:4")
    assert cache.layer(4).v.codec == parse_codec("int:2")
    rng = np.random.default_rng(4)
    k = jnp.asarray(rng.standard_normal((2, 7, 2, 16)), jnp.float32)
    scales = jnp.arange(1.0, 6.0)

    def body(carry, scale, view):
        return carry + 1, kc.append(view, k * scale, k, step)

    step = kc.make_step(cache, 7)
    n, scanned = kc.scan_layers(body, 0, cache, scales)
    assert int(n) == 5
    scanned = kc.commit(scanned, step)
    # per-layer inputs: the layers unrolled, each with its own input
    n, unrolled = kc.scan_layers(body, 0, cache, [scales[i] for i in range(5)])
    assert int(n) == 5
    unrolled = kc.commit(unrolled, step)
    looped = cache
    for i in range(5):
        looped = looped.with_layer(i, kc.append(looped.layer(i), k * scales[i], k, step))
    looped = kc.commit(looped, step)
    for a, b, c in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled),
                       jax.tree.leaves(looped), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
    with pytest.raises(ValueError, match="4 per-layer inputs for a cache of 5 layers"):
        kc.scan_layers(body, 0, cache, [scales[i] for i in range(4)])


def test_unrolled_layers_write_their_flags_once_per_segment():
    """Unrolled, each layer's flags land in its own row of the stack, written by one
    stack per segment rather than one update per layer and flag."""
    rng = np.random.default_rng(5)
    k = jnp.asarray(rng.standard_normal((2, 1, 2, 16)), jnp.float32)

    def run(layers, bad_layer):
        cache = _new(parse_cache("int:4"), layers=layers)
        step = kc.make_step(cache, 1)
        scales = [jnp.float32(jnp.nan if i == bad_layer else 1.0) for i in range(layers)]

        def body(carry, scale, view):
            return carry, kc.append(view, k * scale, k, step)

        def go(c):
            return kc.scan_layers(body, 0, c, scales)[1]
        text = str(jax.make_jaxpr(go)(cache))
        return go(cache), text.count("name=dynamic_update_index_in_dim")

    out, updates = run(4, bad_layer=2)
    assert np.asarray(out.segments[0].k.nonfinite).tolist() == [[False] * 2] * 2 + [
        [True] * 2] + [[False] * 2]
    assert not np.asarray(out.segments[0].v.nonfinite).any()
    # per layer: the raw window and the sinks of K and V (int:4 has no parameters)
    assert (updates - run(2, bad_layer=0)[1]) // 2 == 4


def test_bad_policy_and_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="layer 7"):
        _new(parse_cache("int:4 layers[7]:k=bf16"), layers=3)
    with pytest.raises(ValueError, match="residual_window"):
        kc.CacheConfig(k="int:4", v="int:4", residual_window=-1)
    with pytest.raises(ValueError, match="unknown codec"):
        kc.CacheConfig(k="nope:4", v="int:4")
    cache = _new(kc.CacheConfig(k="int:4", v="int:4"))
    step = kc.make_step(cache, 2)
    with pytest.raises(ValueError, match="does not match"):
        kc.append(cache.layer(0), jnp.ones((2, 2, 3, 16)), jnp.ones((2, 2, 3, 16)), step)
    with pytest.raises(ValueError, match="even head_dim"):
        _new(kc.CacheConfig(k=_EvenOnly(), v="int:4"), head_dim=15)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _EvenOnly(Codec):
    """A codec that rejects odd head dims, to see the cache ask before allocating."""

    name = "even-only"

    def check_head_dim(self, head_dim):
        super().check_head_dim(head_dim)
        if head_dim % 2:
            raise CodecError(f"{self.name} needs an even head_dim, got {head_dim}")


def test_memory_and_bits_come_from_the_arrays():
    head_dim, window = 64, 4
    config = kc.CacheConfig(k="int:4", v="int:2", residual_window=window)
    cache = _new(config, head_dim=head_dim, max_len=40, dtype=jnp.bfloat16)
    assert kc.memory_bytes(cache) == sum(a.nbytes for a in jax.tree.leaves(cache))
    x = jnp.ones((2, 36, 2, head_dim))
    cache = _append_all(cache, x, x)
    bits = kc.stored_bits(cache)
    k_codec, v_codec = parse_codec("int:4"), parse_codec("int:2")
    n_comp = 36 - window
    for role, codec in (("k", k_codec), ("v", v_codec)):
        want = (n_comp * codec.bits_per_element(head_dim) + window * 16) / 36
        assert bits[f"{role}_bits_per_element"] == pytest.approx(want, rel=1e-12)
    # with no window every stored token is a code: the formula exactly
    plain = _append_all(_new(kc.CacheConfig(k="int:4", v="int:4"), head_dim=head_dim), x, x)
    assert kc.stored_bits(plain)["bits_per_element"] == pytest.approx(
        k_codec.bits_per_element(head_dim), rel=1e-12)


def test_kivi_unfinished_key_group_stays_raw():
    config = kc.CacheConfig(k="kivi:2,g4", v="kivi:2,g4,token")
    cache = _new(config, max_len=16)
    rng = np.random.default_rng(5)
    x = _bf16_exact(rng, (2, 7, 2, 16))
    cache = _append_all(cache, x, x)
    k_store, v_store = cache.layer(0).k, cache.layer(0).v
    _, n_comp, n_raw = (np.asarray(a) for a in k_store.counts(cache.lengths))
    assert n_comp.tolist() == [4, 4] and n_raw.tolist() == [3, 3]
    got = np.asarray(kc.dense(k_store, cache.lengths))
    np.testing.assert_array_equal(got[:, :, 4:7], np.swapaxes(x, 1, 2)[:, :, 4:7])
    _, v_comp, _ = (np.asarray(a) for a in v_store.counts(cache.lengths))
    assert v_comp.tolist() == [7, 7]


@pytest.mark.parametrize("spec", ["int:4", "kivi:4,g4"])
def test_overflow_under_jit_keeps_every_stored_token(spec):
    # sinks, a window and appends under jit that run past capacity: the first max_len
    # tokens stay where they are, the excess is dropped
    config = kc.CacheConfig(k=spec, v=spec, residual_window=2, sink_tokens=1)
    max_len = 11
    cache = _new(config, max_len=max_len)
    rng = np.random.default_rng(6)
    x = _bf16_exact(rng, (2, 16, 2, 16))
    jitted = jax.jit(_append_all)
    pos = 0
    for n in (5, 3, 3, 3, 2):
        cache = jitted(cache, jnp.asarray(x[:, pos:pos + n]), jnp.asarray(x[:, pos:pos + n]))
        pos += n
    assert np.asarray(cache.lengths).tolist() == [max_len, max_len]
    assert np.asarray(cache.overflowed).all()
    store = cache.layer(0).k
    got = np.asarray(kc.dense(store, cache.lengths))
    want = _expected_dense(store.codec, store.params, np.swapaxes(x, 1, 2)[:, :, :max_len],
                           1, 2, store.block)
    np.testing.assert_array_equal(got, want)


def test_bad_valid_counts_raise_eagerly_and_clamp_under_jit():
    config = kc.CacheConfig(k="int:4", v="int:4", residual_window=2, sink_tokens=1)
    cache = _new(config, batch=3, max_len=10)
    x = jnp.asarray(_bf16_exact(np.random.default_rng(7), (3, 4, 2, 16)))
    cache = _append_all(cache, x, x, valid=jnp.array([3, 3, 3]))
    for valid in ([-1, 2, 0], [0, 5, 1]):
        with pytest.raises(ValueError, match=r"valid counts must be in 0\.\.4, got \["):
            kc.make_step(cache, 4, jnp.array(valid))
    # concrete counts are checked even where the lengths are traced
    with pytest.raises(ValueError, match=r"valid counts must be in 0\.\.4, got \[0, 5, 1\]"):
        jax.jit(lambda c: kc.make_step(c, 4, np.array([0, 5, 1])))(cache)
    before = np.asarray(kc.dense(cache.layer(0).k, cache.lengths))

    # a negative count appends nothing (the length never goes back), one past the chunk
    # appends the whole chunk; both are flagged, apart from overflow
    after = jax.jit(_append_all)(cache, x, x, jnp.array([-2, 9, 4]))
    assert np.asarray(after.lengths).tolist() == [3, 7, 7]
    assert np.asarray(after.bad_valid).tolist() == [True, True, False]
    assert not np.asarray(after.overflowed).any()
    store = after.layer(0).k
    got = np.asarray(kc.dense(store, after.lengths))
    np.testing.assert_array_equal(got[0], before[0])
    stream = np.swapaxes(np.concatenate([x[1:, :3], x[1:]], axis=1), 1, 2)
    want = _expected_dense(store.codec, store.params, stream, 1, 2, 1)
    np.testing.assert_array_equal(got[1:, :, :7], want)
    with pytest.raises(ValueError, match=r"^bad valid counts: rows \[0, 1\] .*clamped$"):
        kc.check(after)

    # a clamped count that also runs past capacity: both causes, in one line
    full = jax.jit(_append_all)(after, x, x, jnp.array([0, 7, 0]))
    assert np.asarray(full.lengths).tolist() == [3, 10, 7]
    with pytest.raises(ValueError) as err:
        kc.check(full)
    message = str(err.value)
    assert "\n" not in message
    assert "cache overflow: rows [1]" in message and "bad valid counts: rows [0, 1]" in message


def test_values_beyond_the_raw_dtype_are_clipped_and_flagged():
    config = kc.CacheConfig(k="int:8", v="bf16", residual_window=2, sink_tokens=1)
    cache = _new(config, dtype=jnp.float16)
    x = np.ones((2, 5, 2, 16), np.float32)
    x[1, 0, 1, 3] = -1e5  # a sink token
    x[1, 4, 0, 0] = 7e4  # stays in the window
    x[0, 2, 0, 0] = np.inf  # NaN/Inf are the nonfinite flag's, not this one's
    cache = _append_all(cache, jnp.asarray(x), jnp.asarray(x))
    for store in (cache.layer(0).k, cache.layer(0).v):
        assert np.asarray(store.saturated).tolist() == [0, kc.SATURATED_RAW]
        got = np.asarray(kc.dense(store, cache.lengths))
        assert got[1, 1, 0, 3] == -65504 and got[1, 0, 4, 0] == 65504
    with pytest.raises(ValueError) as err:
        kc.check(cache)
    assert str(err.value) == (
        "non-finite K/V: rows [0] received NaN or Inf (stored as finite numbers); "
        "out-of-range K/V: values beyond what float16 raw tokens can store were "
        "saturated in rows [1]")


def test_no_range_check_where_nothing_can_exceed_the_storage():
    """A bf16 chunk into a bf16 raw store of bf16 codes cannot hold a value out of range:
    its append runs no range reduction (one per role and layer at every decode step);
    a float32 chunk is still checked, clipped and flagged."""
    config = kc.CacheConfig(k="bf16", v="bf16", residual_window=2)
    cache = _new(config, dtype=jnp.bfloat16)
    x = np.ones((2, 5, 2, 16), np.float32)
    x[1, 3, 0, 0] = 3.4e38  # beyond bfloat16, finite in float32

    def reductions(chunk):
        text = str(jax.make_jaxpr(_append_all)(cache, chunk, chunk))
        return sum(text.count(op) for op in ("reduce_or", "reduce_max"))

    wide, narrow = jnp.asarray(x), jnp.asarray(x).astype(jnp.bfloat16)
    assert reductions(narrow) < reductions(wide)
    flagged = _append_all(cache, wide, wide)
    assert np.asarray(flagged.layer(0).k.saturated).tolist() == [0, kc.SATURATED_RAW]
    clean = _append_all(cache, narrow, narrow)  # as bfloat16 it is inf: nonfinite
    assert not np.asarray(clean.layer(0).k.saturated).any()
    assert np.asarray(clean.layer(0).k.nonfinite).tolist() == [False, True]


class _SmallInt(IntCodec):
    """``int`` storage that holds vectors of norm up to 8 only."""

    name = "small-int"
    limits = Limits(norm=8.0)


def test_tokens_the_codec_saturates_are_flagged_when_encoded():
    codec = _SmallInt(bits=8)
    config = kc.CacheConfig(k=codec, v="int:4", residual_window=2)
    cache = _new(config, max_len=10)
    x = np.full((2, 10, 2, 16), 0.5, np.float32)  # norm 2
    x[1, 1, 1] = 5.0  # norm 20, every element in range
    x[0, 8, 0] = 5.0  # past the tokens row 0 appends
    step = jax.jit(_append_all)
    cache = step(cache, jnp.asarray(x[:, :2]), jnp.asarray(x[:, :2]))
    # still raw: nothing was saturated yet
    assert not np.asarray(cache.layer(0).k.saturated).any()
    cache = step(cache, jnp.asarray(x[:, 2:9]), jnp.asarray(x[:, 2:9]), jnp.array([4, 7]))
    k_store, v_store = cache.layer(0).k, cache.layer(0).v
    assert np.asarray(k_store.saturated).tolist() == [0, kc.SATURATED_CODEC]
    assert not np.asarray(v_store.saturated).any()
    got = np.asarray(kc.dense(k_store, cache.lengths))
    assert np.linalg.norm(got[1, 1, 1]) == pytest.approx(8.0, rel=2e-2)
    with pytest.raises(ValueError, match=r"^out-of-range K/V: values beyond what small-int:8 "
                                         r"can store were saturated in rows \[1\]$"):
        kc.check(cache)


# -- Med-C outlier counts -------------------------------------------------------------------

#: K: blocks of 4 tokens, 16 chunks of 4 dims at D = 16, 2 slots (10%); V: blocks of 2
#: tokens, 8 chunks, 1 slot (3%); layer 0 keeps K raw
MEDC = "k=int:8,med3,mb4,mp10 v=int:4,med3,mb2 layers[0]:k=bf16"
#: (row, token, kv head, chunk) made 100x larger than the rest (all ones, chunk norm 2):
#: every block's median is 2, so exactly these are over the threshold of 6
PLANTED = [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 2),   # K block 0, V block 0 of row 0
           (0, 5, 1, 3),                               # K block 1, V block 2 of row 0
           (1, 2, 0, 0), (1, 3, 0, 1), (1, 3, 0, 2),   # K block 0, V block 1 of row 1
           (1, 5, 1, 0),                               # row 1: K raw, V block 2
           (1, 8, 0, 0)]                               # past row 1's valid tokens


def _medc_cache(valid=(12, 6)):
    x = np.ones((2, 12, 2, 16), np.float32)
    for b, t, h, c in PLANTED:
        x[b, t, h, 4 * c:4 * c + 4] = 100.0
    cache = _new(parse_cache(MEDC), max_len=16, layers=2)
    return _append_all(cache, jnp.asarray(x), jnp.asarray(x), jnp.asarray(valid, jnp.int32))


def test_outlier_overflow_counts_stored_overflowing_and_compressed_chunks():
    counts = kc.outlier_overflow(_medc_cache())
    # K (layer 1 only), row 0 blocks 0-2: 3 over 2 slots, then 1; row 1 block 0: 3 over
    # 2 slots (tokens 4, 5 raw). V (both layers), 1 slot per block: row 0 blocks 0 (3
    # over) and 2 (1 over); row 1 blocks 1 (3 over) and 2 (1 over)
    want = {"k_outliers": 2 + 1 + 2, "k_overflow": 1 + 1,
            "k_chunks": (12 + 4) * 2 * 4,
            "v_outliers": 2 * (1 + 1 + 1 + 1), "v_overflow": 2 * (2 + 2),
            "v_chunks": 2 * (12 + 6) * 2 * 4}
    for key in ("outliers", "overflow", "chunks"):
        want[key] = want[f"k_{key}"] + want[f"v_{key}"]
    assert counts == want


def test_outlier_overflow_counts_only_occupied_slots():
    assert set(kc.outlier_overflow(_new(parse_cache(MEDC), max_len=16)).values()) == {0}
    assert set(kc.outlier_overflow(_new(parse_cache("int:4"), max_len=16)).values()) == {0}
    # codes left in slots past the lengths (here: lengths set back) are not counted
    cache = dataclasses.replace(_medc_cache(), lengths=jnp.asarray([4, 0], jnp.int32))
    counts = kc.outlier_overflow(cache)
    assert (counts["k_outliers"], counts["k_overflow"], counts["k_chunks"]) == (2, 1, 4 * 2 * 4)
    assert (counts["v_outliers"], counts["v_overflow"], counts["v_chunks"]) == (
        2 * 1, 2 * 2, 2 * 4 * 2 * 4)



def test_outlier_overflow_with_sinks_and_a_window():
    """Blocks start after the sink and the last 3 tokens stay raw: K holds row 0's
    tokens 1-8 (planted: token 1 of head 0, token 5 of head 1), row 1 no block; V holds
    row 0's tokens 1-8 and row 1's 1-2 (token 2 of head 0), one over per block."""
    x = np.ones((2, 12, 2, 16), np.float32)
    for b, t, h, c in PLANTED:
        x[b, t, h, 4 * c:4 * c + 4] = 100.0
    cache = _new(parse_cache(f"{MEDC} sinks=1 window=3"), max_len=16, layers=2)
    cache = _append_all(cache, jnp.asarray(x), jnp.asarray(x), jnp.asarray([12, 6]))
    counts = kc.outlier_overflow(cache)
    assert (counts["k_outliers"], counts["k_overflow"], counts["k_chunks"]) == (2, 0, 8 * 2 * 4)
    assert (counts["v_outliers"], counts["v_overflow"], counts["v_chunks"]) == (
        2 * 3, 0, 2 * (8 + 2) * 2 * 4)


@pytest.mark.parametrize("spec", ["f32", "f32 window=4 sinks=2", "k=f32 v=int:4 window=2"])
def test_an_f32_store_is_exact_whatever_the_raw_dtype(spec):
    """The raw dtype follows a lossless codec wider than it: float32 tokens come back
    bit for bit from an f32 store of a bf16 cache, and its 32 bits are what they carry."""
    cache = kc.init_cache(jax.random.key(0), parse_cache(spec), num_layers=1, batch=1,
                          num_kv_heads=1, head_dim=8, max_len=16, dtype=jnp.bfloat16)
    assert cache.segments[0].k.raw.dtype == jnp.float32
    x = jax.random.normal(jax.random.key(1), (1, 10, 1, 8))
    step = kc.make_step(cache, 10)
    cache = kc.commit(cache.with_layer(0, kc.append(cache.layer(0), x, x, step)), step)
    np.testing.assert_array_equal(kc.dense(cache.layer(0).k, cache.lengths)[0, 0, :10],
                                  x[0, :, 0])
    assert kc.stored_bits(cache)["k_bits_per_element"] == 32.0
