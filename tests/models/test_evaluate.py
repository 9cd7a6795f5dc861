"""models.evaluate's calibration activations on a tiny random llama."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import dense
from kvjax.spec import CacheConfig
from models import llama
from models.config import ModelConfig
from models.evaluate import collect_activations

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
