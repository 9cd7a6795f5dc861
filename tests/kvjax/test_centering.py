"""Key centering and smoothing: the statistics, the cache's transform, its exactness for
every attention implementation, its bits, and calibration."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax import centering
from kvjax.attention import attend
from kvjax.spec import parse_cache

HEADS, DIM = 2, 64


def _biased_keys(seed, batch, tokens, heads=HEADS, dim=DIM):
    """Gaussian K/V ``[B, T, K, D]`` whose keys carry a large per-channel offset."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((batch, tokens, heads, dim)).astype(np.float32)
    k[..., 3] += 40.0
    k[..., 40] -= 25.0
    v = rng.standard_normal((batch, tokens, heads, dim)).astype(np.float32)
    return jnp.asarray(k), jnp.asarray(v)


def _filled(spec, k, v, *, max_len=None, calibration=None, valid=None, dtype=jnp.float32,
            chunks=1):
    """A one-layer cache after appending ``k, v`` in ``chunks`` equal chunks."""
    batch, tokens = k.shape[:2]
    cache = kc.init_cache(jax.random.key(3), parse_cache(spec), num_layers=1, batch=batch,
                          num_kv_heads=k.shape[2], head_dim=k.shape[3],
                          max_len=max_len or tokens, dtype=dtype, calibration=calibration)
    size = tokens // chunks
    for c in range(chunks):
        part = slice(c * size, (c + 1) * size)
        step = kc.make_step(cache, size, valid)
        cache = kc.commit(cache.with_layer(0, kc.append(cache.layer(0), k[:, part],
                                                         v[:, part], step)), step)
    return cache


# -- the statistics --------------------------------------------------------------------


def test_statistics_are_weighted_mean_and_rms():
    x = jnp.asarray([[1.0, 10.0], [3.0, 10.0], [100.0, -5.0]])
    mean, rms = centering.statistics(x, jnp.asarray([1, 1, 0]))
    np.testing.assert_allclose(mean, [2.0, 10.0])
    np.testing.assert_allclose(rms, [1.0, 0.0])
    mean, rms = centering.statistics(x, jnp.zeros(3))
    np.testing.assert_array_equal(mean, [0.0, 0.0])


def test_robust_statistics_equal_the_plain_ones_on_clean_keys_and_leave_out_an_outlier():
    k = jnp.swapaxes(_biased_keys(4, batch=2, tokens=64)[0], 1, 2)  # [B, K, T, D]
    weight = jnp.ones((2, 1, 64), bool).at[1, :, 50:].set(False)
    mean, rms = centering.statistics(k, weight)
    r_mean, r_rms, outlying = centering.robust_statistics(k, weight)
    np.testing.assert_allclose(r_mean, mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(r_rms, rms, rtol=1e-6, atol=1e-6)
    assert not np.asarray(outlying).any()
    # one value 1e4 x the channel's spread, and one past float32 in the unweighted tail
    bad = k.at[0, 1, 7, 3].multiply(1e4).at[1, 0, 60, 2].set(3e38)
    r_mean, r_rms, outlying = centering.robust_statistics(bad, weight)
    np.testing.assert_array_equal(np.asarray(outlying), [[False, True], [False, False]])
    np.testing.assert_allclose(r_mean[1], mean[1], rtol=1e-6, atol=1e-6)
    # the other 62 tokens' mean, as if the spoiled one had not been there
    others = np.delete(np.asarray(k[0, 1, :, 3]), 7)
    np.testing.assert_allclose(r_mean[0, 1, 3], others.mean(), rtol=1e-5)
    assert float(r_rms[0, 1, 3]) < 10 * float(rms[0, 1, 3])


def test_robust_median_counts_only_weighted_finite_values():
    x = jnp.asarray([[1.0], [2.0], [jnp.nan], [9.0], [1e30]])
    weight = jnp.asarray([1, 1, 1, 1, 0], bool)
    mean, _, outlying = centering.robust_statistics(x, weight)
    # NaN and the unweighted 1e30 do not count: the mean of 1, 2, 9
    np.testing.assert_allclose(mean, [4.0], rtol=1e-6)
    assert not bool(outlying)


def test_smoothing_scale_has_unit_geometric_mean_and_a_floor():
    rms = jnp.asarray([[4.0, 1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    s = np.asarray(centering.smoothing_scale(rms))
    np.testing.assert_allclose(np.exp(np.log(s[0]).mean()), 1.0, rtol=1e-6)
    # rms ** 0.5: 2, 1, 0.5 keep their ratios; the zero channel is raised to the floor
    np.testing.assert_allclose(s[0, 0] / s[0, 1], 2.0, rtol=1e-6)
    np.testing.assert_allclose(s[0, 3] / s[0, 0], centering.SMOOTH_FLOOR, rtol=1e-6)
    np.testing.assert_array_equal(s[1], 1.0)


def test_first_chunk_weights_skip_the_first_token_of_longer_chunks():
    w = np.asarray(centering.first_chunk_weights(jnp.asarray([3, 1, 0]), 4))
    np.testing.assert_array_equal(w, [[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


def test_key_calibration_checks_and_round_trips(tmp_path):
    center = np.broadcast_to(np.arange(8, dtype=np.float32), (2, 3, 8)).copy()
    calib = centering.KeyCalibration(center=center, rms=np.ones_like(center), tokens=10)
    calib.save(tmp_path / "c.npz")
    back = centering.KeyCalibration.load(tmp_path / "c.npz")
    np.testing.assert_array_equal(back.center, center)
    assert back.tokens == 10 and back.shape == (2, 3, 8)
    # smoothing about zero sees the centre too
    assert not np.allclose(calib.scale(centered=True), calib.scale(centered=False))
    with pytest.raises(ValueError, match="one shape"):
        centering.KeyCalibration(center=center, rms=center[0], tokens=1)
    with pytest.raises(ValueError, match="finite"):
        centering.KeyCalibration(center=center * np.nan, rms=calib.rms, tokens=1)


# -- the cache's transform ---------------------------------------------------------------


def test_first_append_sets_the_vectors_and_every_key_is_stored_transformed():
    k, v = _biased_keys(0, batch=2, tokens=24)
    cache = _filled("f32 center=first smooth=first", k, v)
    store = cache.layer(0).k
    kt = np.asarray(jnp.swapaxes(k, 1, 2))  # [B, K, T, D]
    mean = kt[:, :, 1:].mean(axis=2)  # the first token is left out of the statistics
    np.testing.assert_allclose(store.shift.astype(jnp.float32),
                               np.asarray(jnp.asarray(mean).astype(jnp.bfloat16)), rtol=0)
    shift = np.asarray(store.shift, np.float32)[:, :, None]
    scale = np.asarray(store.scale, np.float32)[:, :, None]
    stored = np.asarray(kc.dense(store, cache.lengths))
    np.testing.assert_allclose(stored, (kt - shift) / scale, rtol=1e-6, atol=1e-6)
    # the stored keys are small: the offsets are gone
    assert np.abs(stored).max() < 10 < np.abs(kt).max()
    restored = kc.dense(store, cache.lengths, restore_keys=True)
    np.testing.assert_allclose(restored, kt, rtol=1e-5, atol=1e-4)
    assert cache.layer(0).v.shift is None and cache.layer(0).v.scale is None


def test_later_appends_keep_the_vectors_and_an_empty_row_waits_for_its_first_token():
    k, v = _biased_keys(1, batch=2, tokens=16)
    cache = _filled("int:4 center=first", k[:, :8], v[:, :8], max_len=16,
                    valid=jnp.asarray([8, 0]))
    first = np.asarray(cache.layer(0).k.shift, np.float32)
    assert np.abs(first[0]).max() > 10 and np.all(first[1] == 0)
    step = kc.make_step(cache, 8)
    cache = kc.commit(cache.with_layer(0, kc.append(cache.layer(0), k[:, 8:], v[:, 8:],
                                                     step)), step)
    now = np.asarray(cache.layer(0).k.shift, np.float32)
    np.testing.assert_array_equal(now[0], first[0])  # row 0 keeps its prompt's centre
    want = np.asarray(jnp.swapaxes(k, 1, 2))[1, :, 9:16].mean(axis=1)
    np.testing.assert_allclose(now[1], want, rtol=1e-2, atol=0.1)  # bf16 storage


def test_nonfinite_first_chunk_keeps_the_centre_finite():
    k, v = _biased_keys(2, batch=1, tokens=8)
    k = k.at[0, 3, 0, 5].set(jnp.nan).at[0, 4, 1, 7].set(jnp.inf)
    cache = _filled("int:4 center=first smooth=first", k, v)
    store = cache.layer(0).k
    assert np.isfinite(np.asarray(store.shift, np.float32)).all()
    assert np.isfinite(np.asarray(store.scale, np.float32)).all()
    with pytest.raises(ValueError, match="non-finite"):
        kc.check(cache)


@pytest.mark.parametrize("spec", ["int:4 center=first", "f32 center=first smooth=first"])
@pytest.mark.parametrize("size", [1e4, 1e30])
def test_one_huge_first_chunk_key_neither_poisons_the_centre_nor_passes_unflagged(spec, size):
    k, v = _biased_keys(5, batch=2, tokens=64)
    clean = _filled(spec, k, v, max_len=128)
    bad_k = k.at[0, 9, 1, 3].multiply(size)
    cache = _filled(spec, bad_k, v, max_len=128)
    np.testing.assert_allclose(np.asarray(cache.layer(0).k.shift, np.float32),
                               np.asarray(clean.layer(0).k.shift, np.float32),
                               rtol=0.05, atol=0.5)
    # every later clean key is stored as well as in the clean cache
    more_k, more_v = _biased_keys(6, batch=2, tokens=64)

    def later_error(c):
        step = kc.make_step(c, 64)
        c = kc.commit(c.with_layer(0, kc.append(c.layer(0), more_k, more_v, step)), step)
        got = np.asarray(kc.dense(c.layer(0).k, c.lengths, restore_keys=True))[0, :, 64:]
        want = np.asarray(jnp.swapaxes(more_k, 1, 2))[0]
        return np.linalg.norm(got - want) / np.linalg.norm(want)

    assert later_error(cache) < 1.1 * later_error(clean) + 1e-3
    with pytest.raises(ValueError, match=r"outlying keys: rows \[0\]"):
        kc.check(cache)
    kc.check(clean)


def test_calibrated_vectors_come_from_the_calibration():
    k, v = _biased_keys(3, batch=2, tokens=8)
    with pytest.raises(ValueError, match="calibration="):
        _filled("int:4 center=calib", k, v)
    center = np.random.default_rng(0).standard_normal((1, HEADS, DIM)).astype(np.float32)
    calib = centering.KeyCalibration(center=center, rms=np.ones_like(center), tokens=8)
    with pytest.raises(ValueError, match="calibration is for"):
        _filled("int:4 center=calib", k[..., :32], v[..., :32], calibration=calib)
    cache = _filled("int:4 center=calib smooth=calib", k, v, calibration=calib)
    store = cache.layer(0).k
    for row in range(2):
        np.testing.assert_allclose(np.asarray(store.shift[row], np.float32), center[0],
                                   rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(np.asarray(store.scale[row], np.float32),
                                   calib.scale(centered=True)[0], rtol=1e-2)


def test_key_calibration_pools_every_stored_key_of_a_head():
    k, v = _biased_keys(4, batch=2, tokens=12)
    cache = _filled("f32", k, v, valid=jnp.asarray([12, 5]))
    calib = kc.key_calibration(cache)
    kt = np.asarray(jnp.swapaxes(k, 1, 2))
    pooled = np.concatenate([kt[0], kt[1, :, :5]], axis=1)  # [K, 17, D]
    np.testing.assert_allclose(calib.center[0], pooled.mean(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(calib.rms[0], pooled.std(axis=1), rtol=1e-4, atol=1e-5)
    assert calib.tokens == 17
    with pytest.raises(ValueError, match="no tokens"):
        kc.key_calibration(_filled("f32", k, v, valid=jnp.asarray([0, 0])))


def test_stored_bits_count_the_vectors_per_row_that_holds_tokens():
    k, v = _biased_keys(5, batch=2, tokens=32)
    valid = jnp.asarray([32, 0])
    plain = kc.stored_bits(_filled("int:4", k, v, valid=valid))
    both = kc.stored_bits(_filled("int:4 center=first smooth=first", k, v, valid=valid))
    # one row holds tokens: two bf16 vectors per head
    assert both["k_bits"] - plain["k_bits"] == 2 * 16 * DIM * HEADS
    assert both["v_bits"] == plain["v_bits"]


def test_spec_clauses_round_trip():
    config = parse_cache("int:4 window=8 center=first smooth=calib")
    assert (config.center, config.smooth) == ("first", "calib") and config.calibrated
    assert parse_cache(config.spec) == config
    assert config.spec.endswith("center=first smooth=calib")
    assert not parse_cache("int:4 center=first").calibrated
    with pytest.raises(ValueError, match="center= takes first or calib"):
        parse_cache("int:4 center=mean")
    with pytest.raises(ValueError, match="valid values"):
        parse_cache("int:4", smooth="yes")


# -- exact for attention ------------------------------------------------------------------


def _decode_outputs(spec, impl, k, v, q, **kw):
    """Attention output of a decode token ``q[B, 1, N, D]`` after a prefill of ``k, v``
    (its last token is the decode append)."""
    tokens = k.shape[1]
    cache = _filled(spec, k[:, :-1], v[:, :-1], max_len=tokens, **kw)
    step = kc.make_step(cache, 1)
    layer = kc.append(cache.layer(0), k[:, -1:], v[:, -1:], step)
    return attend(q, layer, step, impl=impl)


@pytest.mark.parametrize("transform", ["center=first", "smooth=first",
                                       "center=first smooth=first"])
def test_transforms_leave_lossless_attention_unchanged(transform):
    k, v = _biased_keys(6, batch=2, tokens=33)
    q = jax.random.normal(jax.random.key(7), (2, 1, 2 * HEADS, DIM))
    plain = _decode_outputs("f32", "reference", k, v, q)
    got = _decode_outputs(f"f32 {transform}", "reference", k, v, q)
    np.testing.assert_allclose(got, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec,impl", [
    ("int:4 window=8 sinks=2", "int_decode"),
    ("saw:h32 window=8", "int_decode"),
    ("turboquant:b3 window=8", "codebook_decode"),
    ("bf16 window=8", "xla"),
])
def test_kernels_read_transformed_caches_as_the_reference_does(spec, impl):
    """Each implementation over a centered, smoothed cache equals the float32 reference
    over the same cache (the kernels in Pallas interpret mode off a GPU)."""
    k, v = _biased_keys(8, batch=2, tokens=41)
    q = jax.random.normal(jax.random.key(9), (2, 1, 2 * HEADS, DIM))
    spec = f"{spec} center=first smooth=first"
    want = _decode_outputs(spec, "reference", k, v, q, dtype=jnp.bfloat16)
    got = _decode_outputs(spec, impl, k, v, q, dtype=jnp.bfloat16)
    np.testing.assert_allclose(got, want, atol=2e-2)


def test_centering_rescues_a_per_vector_codec_on_offset_keys():
    """The point of it: int:4's range no longer spans the offsets."""
    k, v = _biased_keys(10, batch=1, tokens=65)
    q = jax.random.normal(jax.random.key(11), (1, 1, 2 * HEADS, DIM))
    exact = _decode_outputs("f32", "reference", k, v, q)

    def error(spec):
        got = _decode_outputs(spec, "reference", k, v, q)
        return float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact))

    assert error("int:4 center=first") < error("int:4") / 3


def test_chunk_flash_reads_a_transformed_cache_as_the_reference_does():
    """A prefill chunk of several tokens through the fused chunk kernel (interpret mode
    off a GPU) over centered, smoothed keys."""
    k, v = _biased_keys(12, batch=2, tokens=48)
    spec = "bf16 center=first smooth=first"
    cache = _filled(spec, k[:, :32], v[:, :32], max_len=48, dtype=jnp.bfloat16)
    step = kc.make_step(cache, 16)
    layer = kc.append(cache.layer(0), k[:, 32:], v[:, 32:], step)
    q = jax.random.normal(jax.random.key(13), (2, 16, 2 * HEADS, DIM))
    want = attend(q, layer, step, impl="reference")
    got = attend(q, layer, step, impl="chunk_flash")
    np.testing.assert_allclose(got, want, atol=3e-2)


def test_the_probe_measures_the_keys_as_appended():
    from kvjax.probe import probe

    k, v = _biased_keys(14, batch=1, tokens=64)
    row = probe("f32 center=first smooth=first", k=np.asarray(k[0]), v=np.asarray(v[0]))
    assert row["rel_mse"] < 1e-10 and row["attn_rel_err"] < 1e-5


def _bad_calibration_files(tmp_path):
    """Files a user might pass as --calibration, none of them a key calibration."""
    good = tmp_path / "good.npz"
    np.savez(good, center=np.zeros((2, 2, 8), np.float32), rms=np.ones((2, 2, 8), np.float32),
             tokens=5)
    raw = good.read_bytes()
    files = {
        "missing_rms.npz": dict(center=np.zeros((2, 2, 8)), tokens=5),
        "strings.npz": dict(center=np.array(["a"] * 4), rms=np.ones((2, 2, 8)), tokens=5),
        "nan.npz": dict(center=np.full((2, 2, 8), np.nan), rms=np.ones((2, 2, 8)), tokens=5),
        "negative_rms.npz": dict(center=np.zeros((2, 2, 8)), rms=-np.ones((2, 2, 8)),
                                 tokens=5),
        "shapes.npz": dict(center=np.zeros((2, 2, 8)), rms=np.ones((2, 8)), tokens=5),
        "tokens_array.npz": dict(center=np.zeros((2, 2, 8)), rms=np.ones((2, 2, 8)),
                                 tokens=np.arange(3)),
    }
    out = []
    for name, arrays in files.items():
        np.savez(tmp_path / name, **arrays)
        out.append(tmp_path / name)
    np.save(tmp_path / "single.npy", np.zeros((2, 2, 8)))
    (tmp_path / "objects.npz").write_bytes(b"")  # empty
    (tmp_path / "text.npz").write_text("center rms tokens\n")
    (tmp_path / "truncated.npz").write_bytes(raw[: len(raw) // 2])
    corrupt = bytearray(raw)
    corrupt[len(raw) // 2: len(raw) // 2 + 64] = bytes(64)
    (tmp_path / "corrupt.npz").write_bytes(bytes(corrupt))
    np.savez(tmp_path / "pickled.npz", center=np.array([None, 1], dtype=object),
             rms=np.ones((2, 2, 8)), tokens=5)
    out += [tmp_path / n for n in ("single.npy", "objects.npz", "text.npz", "truncated.npz",
                                    "corrupt.npz", "pickled.npz")]
    out.append(tmp_path)  # a directory
    return out


def test_every_bad_calibration_file_is_one_line_naming_it(tmp_path):
    for path in _bad_calibration_files(tmp_path):
        with pytest.raises(ValueError) as caught:
            centering.KeyCalibration.load(path)
        message = str(caught.value)
        assert len(message.splitlines()) == 1, message
        assert message.startswith(f"{path}: not a key calibration file"), message
    with pytest.raises(FileNotFoundError):
        centering.KeyCalibration.load(tmp_path / "nowhere.npz")
