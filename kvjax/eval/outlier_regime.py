"""The outlier regime: keys with large, position-stable components in a few channels.

Models of the Qwen2 family carry a k-projection bias that, after RoPE, leaves a few
chunks of every key far above the rest: in the lowest-frequency rotary pairs the bias
barely rotates over thousands of positions, so it is the same for every token. Measured
on Qwen2-0.5B (14 query / 2 kv heads, D = 64): one layer's largest 4-element chunk norm
is 54x the median chunk norm, and in the early layers 5-25% of the chunks exceed 3x the
median. Per-channel grouping (KIVI) absorbs such a component; a per-vector range, or a
norm a rotation spreads over every coordinate, does not.

This module builds the regime reproducibly, from one recipe (:class:`BiasProfile`):

- :func:`key_bias`: the pre-RoPE k-projection bias of every layer and kv head, injected
  into the embedded model by ``models.load("smollm2-135m-biased")``;
- :func:`synthetic_keys`: keys ``RoPE(W x + b)`` with heavy-tailed ``x`` (Student t) and
  the same kind of bias, with queries and values, for model-free probes;
- :func:`chunk_statistics`: the two numbers above, per layer, to check the regime;
- :func:`attention_error`: what a cache spec does to attention over such keys (through
  the cache itself, so the cache's key transforms are measured as used).

The recipe: a layer's bias sits in ``chunks`` of the head's 4-element chunks (the lowest
frequency pairs first: chunk ``D/8 - 1`` holds pairs ``D/2 - 4 .. D/2 - 1``, chunk
``D/4 - 1`` their partners), with a norm of ``ratio`` times :data:`REFERENCE_CHUNK_NORM`
per chunk and a seeded direction per (layer, head, chunk). Early layers (the first
fifth) draw ``ratio`` in 10..25 and 1..4 chunks, one of them (:attr:`BiasProfile.peak_layer`)
has 54, the others 4..10 and 1..2 chunks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: the median 4-element chunk norm of the embedded model's keys (SmolLM2-135M on the
#: Shakespeare corpus, every layer 2.0..3.9): the unit of the bias ratios
REFERENCE_CHUNK_NORM = 3.0
#: the chunk an element belongs to: 4 consecutive channels (HQMQ's quaternion chunk)
CHUNK = 4


@dataclasses.dataclass(frozen=True)
class BiasProfile:
    """The per-layer bias of the outlier regime (module docstring).

    ``ratios[L]``: each biased chunk's norm over :data:`REFERENCE_CHUNK_NORM`;
    ``chunks[L]``: how many chunks of every head carry it; ``seed`` draws the directions.
    """

    ratios: tuple[float, ...]
    chunks: tuple[int, ...]
    seed: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.ratios)

    @property
    def peak_layer(self) -> int:
        """The layer with the largest ratio."""
        return int(np.argmax(self.ratios))


def default_profile(num_layers: int, seed: int = 0) -> BiasProfile:
    """The profile fitted to Qwen2-0.5B's statistics (module docstring) for a model of
    ``num_layers`` layers; the same for the same arguments."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    rng = np.random.default_rng([seed, num_layers])
    early = max(1, num_layers // 5)
    ratios, chunks = [], []
    for layer in range(num_layers):
        if layer < early:
            ratios.append(float(rng.uniform(10, 25)))
            chunks.append(int(rng.integers(1, 5)))
        else:
            ratios.append(float(rng.uniform(4, 10)))
            chunks.append(int(rng.integers(1, 3)))
    ratios[min(2, num_layers - 1)] = 54.0
    return BiasProfile(ratios=tuple(ratios), chunks=tuple(chunks), seed=seed)


def biased_chunks(head_dim: int, count: int) -> list[int]:
    """The chunk indices that carry a bias, lowest rotary frequencies first: the last
    chunk of each half, then the one before each."""
    if head_dim % (2 * CHUNK):
        raise ValueError(f"head_dim {head_dim} must be a multiple of {2 * CHUNK}")
    half = head_dim // CHUNK // 2
    order = [c for back in range(half) for c in (half - 1 - back, 2 * half - 1 - back)]
    return order[:count]


def key_bias(profile: BiasProfile, num_kv_heads: int, head_dim: int,
             unit: float = REFERENCE_CHUNK_NORM) -> np.ndarray:
    """``float32[L, K * D]``: the pre-RoPE k-projection bias of every layer (heads
    concatenated, as a model's ``bk``); each biased chunk has norm ``ratio * unit``."""
    rng = np.random.default_rng([profile.seed, 7])
    out = np.zeros((profile.num_layers, num_kv_heads, head_dim), np.float32)
    for layer, (ratio, count) in enumerate(zip(profile.ratios, profile.chunks, strict=True)):
        for head in range(num_kv_heads):
            for chunk in biased_chunks(head_dim, count):
                direction = rng.standard_normal(CHUNK)
                direction /= np.linalg.norm(direction)
                # heads differ a little in size, as a trained model's do
                size = ratio * unit * rng.uniform(0.8, 1.0)
                out[layer, head, chunk * CHUNK:(chunk + 1) * CHUNK] = size * direction
    return out.reshape(profile.num_layers, num_kv_heads * head_dim)


def rope(x: np.ndarray | jax.Array, positions: np.ndarray | jax.Array,
         theta: float) -> jax.Array:
    """HF-convention RoPE (``rotate_half`` on the two halves) of ``x[..., T, D]`` at
    ``positions[T]``, float32."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = jnp.asarray(positions, jnp.float32)[:, None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    x = jnp.asarray(x, jnp.float32)
    rotated = jnp.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


def synthetic_keys(seed: int, *, tokens: int, head_dim: int = 64, ratio: float = 20.0,
                   chunks: int = 2, heads: int = 1, queries: int = 16, dof: float = 4.0,
                   theta: float = 1e5) -> dict[str, np.ndarray]:
    """Keys, values and queries of the outlier regime, ``[heads, tokens|queries, D]``.

    Keys are ``RoPE(W x + b)``: ``x`` Student-t with ``dof`` degrees of freedom (heavy
    tails), ``W`` Gaussian, ``b`` of norm ``ratio`` times the median chunk norm of
    ``W x`` in each of ``chunks`` lowest-frequency chunks (:func:`biased_chunks`).
    Values are ``W_v x`` (no bias); queries ``RoPE(W_q x_q)`` at the last positions, so
    they attend over the whole sequence. Deterministic in ``seed``.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, list[np.ndarray]] = {"keys": [], "values": [], "queries": []}
    positions = np.arange(tokens)
    for _ in range(heads):
        w_k, w_v, w_q = (rng.standard_normal((head_dim, head_dim)) / math.sqrt(head_dim)
                         for _ in range(3))
        x = rng.standard_t(dof, (tokens, head_dim))
        k0 = x @ w_k.T
        unit = float(np.median(np.linalg.norm(k0.reshape(tokens, -1, CHUNK), axis=-1)))
        bias = np.zeros(head_dim)
        for chunk in biased_chunks(head_dim, chunks):
            direction = rng.standard_normal(CHUNK)
            bias[chunk * CHUNK:(chunk + 1) * CHUNK] = ratio * unit * direction / np.linalg.norm(
                direction)
        out["keys"].append(np.asarray(rope(k0 + bias, positions, theta)))
        out["values"].append(rng.standard_t(dof, (tokens, head_dim)) @ w_v.T)
        xq = rng.standard_t(dof, (queries, head_dim))
        out["queries"].append(np.asarray(rope(xq @ w_q.T, positions[-queries:], theta)))
    return {name: np.stack(arrays).astype(np.float32) for name, arrays in out.items()}


def chunk_statistics(keys: np.ndarray | jax.Array, threshold: float = 3.0
                     ) -> dict[str, float]:
    """Of keys ``[..., D]`` (one layer, any leading axes): the largest chunk norm over
    the median chunk norm, and the fraction of chunks above ``threshold`` times it."""
    keys = np.asarray(keys, np.float32)
    norms = np.linalg.norm(keys.reshape(*keys.shape[:-1], -1, CHUNK), axis=-1)
    median = float(np.median(norms))
    if median == 0:
        return {"max_over_median": math.inf, "fraction_over": 1.0}
    return {"max_over_median": float(norms.max() / median),
            "fraction_over": float(np.mean(norms > threshold * median))}


def attention_error(cache_spec: str, keys: np.ndarray, values: np.ndarray,
                    queries: np.ndarray, *, seed: int = 0,
                    calibration: Any = None) -> dict[str, float]:
    """What a cache of ``cache_spec`` does to attention over ``keys, values [K, S, D]``
    (``K`` kv heads) for ``queries [K, Q, D]``, each a decode step at the last position.

    The cache is filled as a model fills it (the first ``S - 1`` tokens as one chunk,
    then the last one with its query) and attended by the float32 ``"reference"``
    implementation, one row per query. Returns the relative error of the outputs against
    exact float32 attention (Frobenius over the head dim, averaged over queries and
    heads), the share of (query, head) pairs whose highest-scoring key is the same
    over the decoded keys as over the exact ones, and the keys' reconstruction error
    split in two, each over the RMS of the keys' own token-to-token variation: the
    ``key_error_common`` part (the error's mean over tokens: it moves every score of a
    query alike, which softmax ignores) and the ``key_error_varying`` part (the rest,
    which attention sees). Codec parameters come from ``seed``;
    ``calibration`` serves ``calib`` clauses (:func:`kvjax.cache.key_calibration`).
    """
    from kvjax.attention import attend
    from kvjax.cache import append, commit, dense, init_cache, make_step
    from kvjax.spec import parse_cache

    heads, tokens, head_dim = keys.shape
    rows = queries.shape[1]
    if tokens < 2:
        raise ValueError(f"need at least 2 tokens, got {tokens}")
    cache = init_cache(jax.random.key(seed), parse_cache(cache_spec), num_layers=1,
                       batch=rows, num_kv_heads=heads, head_dim=head_dim, max_len=tokens,
                       dtype=jnp.float32, calibration=calibration)

    def token_major(x):  # [K, n, D] -> [rows, n, K, D], the same for every row
        return jnp.broadcast_to(jnp.swapaxes(jnp.asarray(x, jnp.float32), 0, 1)[None],
                                (rows, x.shape[1], heads, head_dim))

    k, v = token_major(keys), token_major(values)
    step = make_step(cache, tokens - 1)
    cache = commit(cache.with_layer(0, append(cache.layer(0), k[:, :-1], v[:, :-1], step)),
                   step)
    step = make_step(cache, 1)
    layer = append(cache.layer(0), k[:, -1:], v[:, -1:], step)
    q = jnp.swapaxes(jnp.asarray(queries, jnp.float32), 0, 1)[:, None]  # [Q, 1, K, D]
    got = attend(q, layer, step, impl="reference")[:, 0]  # [Q, K, D]

    scale = head_dim**-0.5
    scores = jnp.einsum("kqd,ksd->qks", jnp.asarray(queries), jnp.asarray(keys)) * scale
    exact = jnp.einsum("qks,ksd->qkd", jax.nn.softmax(scores, axis=-1), jnp.asarray(values))
    error = jnp.linalg.norm(got - exact, axis=-1) / jnp.linalg.norm(exact, axis=-1)
    decoded = dense(layer.k, step.start + step.valid, restore_keys=True)[0]  # [K, S, D]
    approx = jnp.einsum("kqd,ksd->qks", jnp.asarray(queries), decoded)
    top1 = jnp.mean(jnp.argmax(approx, -1) == jnp.argmax(scores, -1))
    exact_keys = jnp.asarray(keys)
    key_error = decoded - exact_keys
    common = jnp.mean(key_error, axis=1, keepdims=True)
    content = jnp.sqrt(jnp.mean(jnp.square(exact_keys - exact_keys.mean(1, keepdims=True))))
    return {"output_rel_error": float(jnp.mean(error)), "top1_agreement": float(top1),
            "key_error_common": float(jnp.sqrt(jnp.mean(jnp.square(common))) / content),
            "key_error_varying": float(jnp.sqrt(jnp.mean(jnp.square(key_error - common)))
                                       / content)}


__all__ = [
    "CHUNK",
    "REFERENCE_CHUNK_NORM",
    "BiasProfile",
    "attention_error",
    "biased_chunks",
    "chunk_statistics",
    "default_profile",
    "key_bias",
    "rope",
    "synthetic_keys",
]
