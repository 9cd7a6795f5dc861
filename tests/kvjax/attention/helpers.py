"""A one-layer cache after a prefill and one decode append, built in one compiled program."""

import functools

import jax
import jax.numpy as jnp

from kvjax import cache as kc


def build_layer(codec_k, codec_v, *, lengths, window, sinks, heads, head_dim, seed=1):
    """A one-layer cache after a prefill of ``lengths`` tokens and one decode append:
    ``(layer view, step of the decode append, a spare PRNG key)``."""
    return _build_layer(codec_k, codec_v, tuple(lengths), window, sinks, heads, head_dim,
                        seed)


@functools.partial(jax.jit, static_argnums=tuple(range(8)))
def _build_layer(codec_k, codec_v, lengths, window, sinks, heads, head_dim, seed):
    batch = len(lengths)
    max_len = max(lengths) + 1
    config = kc.CacheConfig(k=codec_k, v=codec_v, residual_window=window, sink_tokens=sinks)
    cache = kc.init_cache(jax.random.key(seed), config, num_layers=1, batch=batch,
                          num_kv_heads=heads, head_dim=head_dim, max_len=max_len,
                          dtype=jnp.bfloat16)
    keys = jax.random.split(jax.random.key(seed + 1), 4)
    total = max(lengths)
    k = jax.random.normal(keys[0], (batch, total + 1, heads, head_dim))
    v = jax.random.normal(keys[1], (batch, total + 1, heads, head_dim))
    step = kc.make_step(cache, total, jnp.array(lengths))
    view = kc.append(cache.layer(0), k[:, :total], v[:, :total], step)
    cache = kc.commit(cache.with_layer(0, view), step)
    step = kc.make_step(cache, 1)
    view = kc.append(cache.layer(0), k[:, total:], v[:, total:], step)
    return view, step, keys[2]
