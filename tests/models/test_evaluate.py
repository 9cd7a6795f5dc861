"""models.evaluate's calibration activations and layer sensitivities on a tiny random
llama."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import dense
from kvjax.spec import CacheConfig, parse_cache, parse_codec
from models import llama
from models.config import ModelConfig
from models.evaluate import cache_perplexity, collect_activations, layer_sensitivity

CONFIG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=64)


def test_activations_are_the_stored_keys_values_and_the_queries_moments():
    params = llama.init_params(jax.random.PRNGKey(0), CONFIG)
    windows = jax.random.randint(jax.random.PRNGKey(1), (3, 12), 0, CONFIG.vocab_size)
    acts = collect_activations(params, CONFIG, windows, batch_size=2)
    assert acts.shape == (2, 2, 8) and acts.tokens == 36

    cache = llama.new_cache(CONFIG, CacheConfig(k="f32", v="f32"), batch=3, max_len=12,
                            dtype=jnp.float32)
    queries = jnp.zeros((2, 3, 12, 4, 8))

    def record(state, i, q, view, step):
        return state.at[i].set(q)

    _, cache, queries = llama.hidden_states(params, CONFIG, windows, cache,
                                            observe=(record, queries))
    for layer in range(2):
        keys = dense(cache.layer(layer).k, cache.lengths)  # [B, K, S, D]
        values = dense(cache.layer(layer).v, cache.lengths)
        for head in range(2):
            np.testing.assert_allclose(acts.keys[layer, head],
                                       keys[:, head].reshape(-1, 8), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(acts.values[layer, head],
                                       values[:, head].reshape(-1, 8), rtol=1e-5, atol=1e-5)
            # query heads 2h and 2h+1 share kv head h
            q = np.asarray(queries[layer][:, :, 2 * head:2 * head + 2]).reshape(-1, 8)
            np.testing.assert_allclose(acts.query_moment[layer, head], q.T @ q, rtol=1e-4,
                                       atol=1e-4)


def test_layer_sensitivity_measures_each_unit_against_the_precise_cache():
    params = llama.init_params(jax.random.PRNGKey(0), CONFIG)
    windows = jax.random.randint(jax.random.PRNGKey(2), (1, 16), 0, CONFIG.vocab_size)
    s = layer_sensitivity(params, CONFIG, windows, ["int:2", "int:8"])
    assert s.candidates == ("int:2", "int:8")
    assert s.bits["k"] == tuple(parse_codec(c).bits_per_element(8) for c in s.candidates)
    assert s.loss.shape == (2, 2, 2) and np.all(s.loss[:, :, 1] == 0)
    reference = CacheConfig(k="bf16")
    precise = cache_perplexity(params, CONFIG, CacheConfig(k="int:8"), windows,
                               reference=reference).kl_mean
    one = cache_perplexity(params, CONFIG, parse_cache("int:8 layers[1]:v=int:2"), windows,
                           reference=reference).kl_mean
    assert s.base == precise and s.loss[1, 1, 0] == pytest.approx(one - precise)
    assert np.all(s.loss[:, :, 0] > 0)
