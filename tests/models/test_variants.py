"""Derived models: the biased SmolLM2 reproduces the outlier regime in CI time."""

import jax.numpy as jnp
import numpy as np
import pytest

import models
from kvjax.eval.outlier_regime import biased_chunks, chunk_statistics, default_profile
from kvjax.spec import parse_cache
from models import llama
from models.evaluate import cache_perplexity, load_model_and_windows

BIASED = "smollm2-135m-biased"


@pytest.fixture(scope="module")
def biased():
    return load_model_and_windows(BIASED, "shakespeare", 2, 256)


def test_the_variant_is_a_known_name_with_the_base_context():
    assert BIASED in models.known_names()
    assert models.context_length(BIASED) == models.context_length("smollm2-135m")
    with pytest.raises(ValueError, match=BIASED):
        models.load("no-such-model")


def test_the_bias_sits_in_the_profiles_chunks(biased):
    config, params = biased[:2]
    assert config.attention_bias
    layers = params["layers"]
    assert not np.any(np.asarray(layers["bq"])) and not np.any(np.asarray(layers["bv"]))
    profile = default_profile(config.num_layers)
    norms = np.linalg.norm(np.asarray(layers["bk"]).reshape(
        config.num_layers, config.num_kv_heads, -1, 4), axis=-1)
    for layer in (0, profile.peak_layer, config.num_layers - 1):
        chosen = biased_chunks(config.head_dim, profile.chunks[layer])
        assert set(np.nonzero(norms[layer, 0])[0]) == set(chosen)


def test_keys_and_perplexity_show_the_regime(biased):
    """The statistics of the keys are those of the measured Qwen2 model in kind; the
    model itself is barely changed; int:4 collapses and centering rescues it."""
    config, params, _, _, wins = biased
    cache = llama.new_cache(config, parse_cache("f32"), batch=wins.shape[0],
                            max_len=wins.shape[1], dtype=jnp.float32)
    _, cache = llama.jit_forward(params, config, jnp.asarray(wins), cache, None)
    stats = [chunk_statistics(_keys(cache, i)) for i in range(6)]
    assert stats[default_profile(config.num_layers).peak_layer]["max_over_median"] > 30
    assert all(0.05 <= s["fraction_over"] <= 0.3 for s in stats)

    def ppl(spec):
        return cache_perplexity(params, config, parse_cache(spec), wins).ppl

    base = load_model_and_windows("smollm2-135m", "shakespeare", 2, 256)
    fp = ppl("bf16")
    assert abs(fp / cache_perplexity(base[1], base[0], parse_cache("bf16"), base[4]).ppl
               - 1) < 0.03
    assert ppl("int:4") > 1.5 * fp
    assert ppl("int:4 center=first") < 1.15 * fp


def _keys(cache, layer):
    from kvjax.cache import dense

    return np.asarray(dense(cache.layer(layer).k, cache.lengths))
