"""The outlier regime's recipe, synthetic keys and attention probe."""

import numpy as np
import pytest

from kvjax.eval import outlier_regime as regime


def test_default_profile_is_fixed_and_shaped_like_the_measured_model():
    profile = regime.default_profile(30)
    assert profile == regime.default_profile(30) != regime.default_profile(30, seed=1)
    assert profile.peak_layer == 2 and max(profile.ratios) == 54.0
    early = range(30 // 5)
    assert all(10 <= profile.ratios[i] <= 25 for i in early if i != 2)
    assert all(1 <= profile.chunks[i] <= 4 for i in early)
    assert all(4 <= r <= 10 for r in profile.ratios[6:])
    with pytest.raises(ValueError):
        regime.default_profile(0)


def test_biased_chunks_take_the_lowest_rotary_frequencies_first():
    assert regime.biased_chunks(64, 4) == [7, 15, 6, 14]
    assert regime.biased_chunks(128, 2) == [15, 31]
    with pytest.raises(ValueError, match="multiple"):
        regime.biased_chunks(36, 1)


def test_key_bias_puts_the_ratio_in_the_chosen_chunks():
    profile = regime.BiasProfile(ratios=(20.0, 5.0), chunks=(2, 1))
    bias = regime.key_bias(profile, num_kv_heads=3, head_dim=64, unit=1.0)
    assert bias.shape == (2, 3 * 64)
    norms = np.linalg.norm(bias.reshape(2, 3, 16, 4), axis=-1)
    assert set(np.nonzero(norms[0, 0])[0]) == {7, 15}
    assert set(np.nonzero(norms[1, 2])[0]) == {7}
    assert np.all((norms[0][:, [7, 15]] > 16) & (norms[0][:, [7, 15]] <= 20 + 1e-4))


def test_synthetic_keys_reproduce_the_statistics():
    data = regime.synthetic_keys(0, tokens=512, heads=2, ratio=30.0, chunks=2)
    assert data["keys"].shape == (2, 512, 64) and data["queries"].shape == (2, 16, 64)
    stats = regime.chunk_statistics(data["keys"])
    assert 20 < stats["max_over_median"] < 45
    # two chunks in sixteen carry the bias
    assert 0.11 < stats["fraction_over"] < 0.16
    again = regime.synthetic_keys(0, tokens=512, heads=2, ratio=30.0, chunks=2)
    np.testing.assert_array_equal(again["keys"], data["keys"])


def test_rope_keeps_norms_and_rotates_pairs():
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    y = np.asarray(regime.rope(x, np.arange(5), 1e4))
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    np.testing.assert_allclose(y[0], x[0])


def test_attention_error_of_a_lossless_cache_is_zero_and_offsets_hurt_int4():
    data = regime.synthetic_keys(1, tokens=256, heads=2, ratio=25.0, chunks=2, queries=4)
    args = (data["keys"], data["values"], data["queries"])
    lossless = regime.attention_error("f32", *args)
    assert lossless["output_rel_error"] < 1e-5 and lossless["top1_agreement"] == 1.0
    plain = regime.attention_error("int:4", *args)
    centered = regime.attention_error("int:4 center=first", *args)
    assert centered["output_rel_error"] < plain["output_rel_error"] / 3
    with pytest.raises(ValueError, match="at least 2"):
        regime.attention_error("f32", *(a[:, :1] for a in args[:2]), args[2])
