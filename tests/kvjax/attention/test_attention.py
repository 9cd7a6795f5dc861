"""Reference attention over the compressed cache vs plain dense attention, and the XLA
paths (windowed bfloat16 attention, the bf16 cache's decode) against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax.attention import REGISTRY, Call, attend, decode_attention, dense_attention
from kvjax.attention.xla import windowed_attention
from kvjax.spec import parse_cache
from tests.kvjax.attention.helpers import build_layer


def _bf16_exact(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    return jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)


def _lossless(sinks=0, window=0):
    return kc.CacheConfig(k="bf16", v="bf16", residual_window=window, sink_tokens=sinks)


def _run_chunks(config, k, v, q, chunks, valids, *, max_len, sliding_window=None):
    """Append chunk by chunk; return each chunk's attention output and the cache."""
    batch, _, heads, head_dim = k.shape
    cache = kc.init_cache(jax.random.key(0), config, num_layers=1, batch=batch,
                          num_kv_heads=heads, head_dim=head_dim, max_len=max_len,
                          dtype=jnp.float32)
    outs, pos = [], 0
    for n, valid in zip(chunks, valids, strict=True):
        step = kc.make_step(cache, n, jnp.array(valid))
        view = kc.append(cache.layer(0), k[:, pos:pos + n], v[:, pos:pos + n], step)
        outs.append(attend(q[:, pos:pos + n], view, step, sliding_window=sliding_window))
        cache = kc.commit(cache.with_layer(0, view), step)
        pos += n
    return outs, cache


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("sinks,window", [(0, 0), (2, 3)])
def test_lossless_cache_attention_equals_dense(group, sinks, window):
    rng = np.random.default_rng(group)
    heads, head_dim, total = 2, 16, 23
    k = _bf16_exact(rng, (1, total, heads, head_dim))
    v = _bf16_exact(rng, (1, total, heads, head_dim))
    q = jnp.asarray(rng.standard_normal((1, total, heads * group, head_dim)), jnp.float32)
    chunks = [5, 1, 9, 1, 7]
    outs, _ = _run_chunks(_lossless(sinks, window), k, v, q, chunks, [[n] for n in chunks],
                          max_len=29)
    got = jnp.concatenate(outs, axis=1)
    want = dense_attention(q, k, v, q_positions=jnp.arange(total)[None],
                           kv_lengths=jnp.array([total]))
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


def test_ragged_rows_and_empty_rows():
    rng = np.random.default_rng(7)
    heads, head_dim = 1, 8
    k = _bf16_exact(rng, (3, 6, heads, head_dim))
    v = _bf16_exact(rng, (3, 6, heads, head_dim))
    q = jnp.asarray(rng.standard_normal((3, 6, 4, head_dim)), jnp.float32)
    outs, cache = _run_chunks(_lossless(), k, v, q, [6], [[6, 3, 0]], max_len=8)
    out = np.asarray(outs[0])
    assert np.isfinite(out).all()
    assert not out[2].any()  # a row with nothing stored attends to nothing
    for b, n in ((0, 6), (1, 3)):
        want = dense_attention(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n],
                               q_positions=jnp.arange(n)[None], kv_lengths=jnp.array([n]))
        np.testing.assert_allclose(out[b:b + 1, :n], want, atol=2e-6, rtol=2e-6)
    # one decode token per row after the ragged prefill
    step = kc.make_step(cache, 1)
    kn = _bf16_exact(rng, (3, 1, heads, head_dim))
    view = kc.append(cache.layer(0), kn, kn, step)
    qn = jnp.asarray(rng.standard_normal((3, 4, head_dim)), jnp.float32)
    dec = decode_attention(qn, view, step, impl="reference")
    assert np.isfinite(np.asarray(dec)).all()
    np.testing.assert_allclose(dec, attend(qn[:, None], view, step)[:, 0])
    full_k = jnp.concatenate([k[2:3, :0], kn[2:3]], axis=1)
    np.testing.assert_allclose(  # the empty row now holds exactly one token
        dec[2], jnp.broadcast_to(full_k[0, 0, 0], (4, head_dim)), atol=1e-6)


def test_sliding_window_matches_dense():
    rng = np.random.default_rng(8)
    k = _bf16_exact(rng, (2, 12, 2, 8))
    v = _bf16_exact(rng, (2, 12, 2, 8))
    q = jnp.asarray(rng.standard_normal((2, 12, 4, 8)), jnp.float32)
    outs, _ = _run_chunks(_lossless(window=2), k, v, q, [7, 5], [[7, 7], [5, 5]],
                          max_len=12, sliding_window=4)
    want = dense_attention(q, k, v, q_positions=jnp.broadcast_to(jnp.arange(12), (2, 12)),
                           kv_lengths=jnp.array([12, 12]), sliding_window=4)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("spec,tol", [("int:8", 0.02), ("int:4", 0.3), ("fp8", 0.1),
                                      ("kivi:4,g4", 0.3)])
def test_quantized_attention_is_close_and_improves_with_a_window(spec, tol):
    rng = np.random.default_rng(9)
    k = _bf16_exact(rng, (1, 32, 2, 32))
    v = _bf16_exact(rng, (1, 32, 2, 32))
    q = jnp.asarray(3 * rng.standard_normal((1, 1, 4, 32)), jnp.float32)
    want = dense_attention(q, k, v, q_positions=jnp.array([[31]]), kv_lengths=jnp.array([32]))
    errs = []
    for window in (0, 16):
        config = parse_cache(spec, residual_window=window)
        cache = kc.init_cache(jax.random.key(0), config, num_layers=1, batch=1,
                              num_kv_heads=2, head_dim=32, max_len=32, dtype=jnp.float32)
        cache = kc.commit(cache.with_layer(0, kc.append(cache.layer(0), k[:, :31], v[:, :31],
                                                        kc.make_step(cache, 31))),
                          kc.make_step(cache, 31))
        step = kc.make_step(cache, 1)
        view = kc.append(cache.layer(0), k[:, 31:], v[:, 31:], step)
        got = attend(q, view, step, impl="reference")
        errs.append(float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)))
    assert 0 < errs[0] < tol
    assert errs[1] < errs[0]


def test_bad_impl_head_dim_and_group():
    cache = kc.init_cache(jax.random.key(0), _lossless(), num_layers=1, batch=1,
                          num_kv_heads=2, head_dim=8, max_len=4)
    step = kc.make_step(cache, 1)
    view = kc.append(cache.layer(0), jnp.ones((1, 1, 2, 8)), jnp.ones((1, 1, 2, 8)), step)
    with pytest.raises(ValueError, match="impl"):
        attend(jnp.ones((1, 1, 2, 8)), view, step, impl="magic")
    with pytest.raises(ValueError, match="head_dim"):
        attend(jnp.ones((1, 1, 2, 4)), view, step)
    with pytest.raises(ValueError, match="kv heads"):
        attend(jnp.ones((1, 1, 3, 8)), view, step)


@pytest.mark.parametrize("spec_k,spec_v,sinks,window,sliding", [
    ("bf16", "bf16", 2, 3, None),
    ("int:4", "int:4", 3, 4, None),       # sinks shift the code blocks off the window grid
    ("kivi:2,g16", "kivi:2,g16,token", 0, 5, None),   # K: blocks of 16 tokens
    ("saw:h32,kv", "fp8", 0, 0, 6),
])
def test_windowed_attention_matches_reference(spec_k, spec_v, sinks, window, sliding):
    """impl="xla" for chunks: bfloat16 operands over windows of the cache with an online
    softmax, against the float32 reference, chunk after chunk of ragged rows."""
    rng = np.random.default_rng(3)
    heads, head_dim, group, total = 2, 32, 3, 60
    k = jnp.asarray(rng.standard_normal((2, total, heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, total, heads, head_dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, total, heads * group, head_dim)), jnp.float32)
    config = kc.CacheConfig(k=spec_k, v=spec_v, residual_window=window, sink_tokens=sinks)
    cache = kc.init_cache(jax.random.key(0), config, num_layers=1, batch=2,
                          num_kv_heads=heads, head_dim=head_dim, max_len=64)
    windowed = jax.jit(windowed_attention, static_argnums=(4, 5, 6))
    pos = 0
    for n, valid in [(30, [30, 0]), (30, [29, 17])]:   # one shape: one compilation
        step = kc.make_step(cache, n, jnp.array(valid))
        view = kc.append(cache.layer(0), k[:, pos:pos + n], v[:, pos:pos + n], step)
        chunk = q[:, pos:pos + n]
        want = attend(chunk, view, step, sliding_window=sliding)
        lengths = jnp.minimum(step.start + step.valid, view.k.max_len)
        outs = [attend(chunk, view, step, sliding_window=sliding, impl="xla")[:, :, None]]
        for size in (5,):   # several windows, not a multiple of any block
            outs.append(windowed(chunk, view, step, lengths, head_dim**-0.5, sliding,
                                 size)[:, :, None])
        got = jnp.concatenate(outs, axis=2)
        real = np.arange(n)[None, :] < np.asarray(valid)[:, None]  # padding: meaningless
        assert not np.array_equal(got[real][:, 0], np.asarray(want)[real])
        np.testing.assert_allclose(np.asarray(got)[real],
                                   np.broadcast_to(np.asarray(want)[:, :, None], got.shape)[real],
                                   atol=3e-2)
        cache = kc.commit(cache.with_layer(0, view), step)
        pos += n


@pytest.mark.parametrize("spec", ["turboquant:b3,qjl sinks=2 window=3",
                                  "octopus:b2,qjl window=4"])
def test_windowed_attention_scores_estimator_keys_by_their_codec(spec):
    """Keys whose codec scores by an estimator of its own (QJL) are scored by it, window
    by window (several windows, sinks and a raw window beside the codes), as the
    reference does over the whole cache."""
    batch, heads, group, head_dim, n = 2, 2, 2, 64, 24
    keys = jax.random.split(jax.random.key(3), 3)
    k, v = (jax.random.normal(kk, (batch, n, heads, head_dim)) for kk in keys[:2])
    q = jax.random.normal(keys[2], (batch, n, heads * group, head_dim))
    cache = kc.init_cache(jax.random.key(0), parse_cache(spec), num_layers=1, batch=batch,
                          num_kv_heads=heads, head_dim=head_dim, max_len=n)
    assert not cache.segments[0].k.codec.scores_reconstruct
    step = kc.make_step(cache, n, jnp.array([n, 15]))
    view = kc.append(cache.layer(0), k, v, step)
    lengths = step.start + step.valid
    got = jax.jit(windowed_attention, static_argnums=(4, 5, 6))(
        q, view, step, lengths, head_dim**-0.5, None, 5)
    want = attend(q, view, step, impl="reference")
    for row, valid in enumerate(np.asarray(step.valid)):
        np.testing.assert_allclose(np.asarray(got)[row, :valid],
                                   np.asarray(want)[row, :valid], atol=3e-2)
    assert REGISTRY["xla"].supports(Call(q=q, layer=view, step=step, lengths=lengths,
                                         scale=1.0, sliding_window=None)) is None


@pytest.mark.parametrize("window,sinks,lengths", [(0, 0, [37, 5]), (8, 2, [40, 3, 0])])
def test_bf16_decode_path_matches_reference(window, sinks, lengths):
    """impl="xla" over a bf16 cache: bfloat16 operands (the stored values are bfloat16
    already; the query and the probabilities are rounded), float32 softmax."""
    view, step, qkey = build_layer("bf16", "bf16", lengths=lengths, window=window,
                                   sinks=sinks, heads=2, head_dim=64)
    q = jax.random.normal(qkey, (len(lengths), 1, 8, 64))
    want = attend(q, view, step, impl="reference")
    got = attend(q, view, step, impl="xla")
    assert not np.array_equal(got, want)   # a different path, not the reference again
    np.testing.assert_allclose(got, want, atol=2e-2)
    # other codecs: not "xla"'s for a decode; the reference after it
    view4, step4, _ = build_layer("int:4", "int:4", lengths=lengths, window=window,
                                  sinks=sinks, heads=2, head_dim=64)
    np.testing.assert_array_equal(attend(q, view4, step4, impl=("xla", "reference")),
                                  attend(q, view4, step4))
    with pytest.raises(ValueError, match="bf16 cache only"):
        attend(q, view4, step4, impl="xla")
