"""A model-free probe of a cache's K/V codecs: error, bits and attention error in one call.

The probe runs the codecs through the same path a model uses: it appends K/V to a
one-layer :mod:`kvjax.cache` of the given cache spec (raw regions in float32, so only the
codecs' error is measured), reads the keys back and attends with one decode query per
(kv head, probe query) through :func:`kvjax.attention.attend`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import attend, dense_attention
from kvjax.cache import append, check, commit, dense, init_cache, make_step, stored_bits
from kvjax.codec import EXACT, measured_bits_per_element
from kvjax.spec import CacheConfig, parse_cache

#: the baseline codecs that probes and tables show when no codec is named
BASELINE_CODECS = (
    "bf16", "fp8", "int:8", "int:6", "int:4", "int:3", "int:2",
    "kivi:4,g32", "kivi:2,g32",
)


def gaussian_kv(seed: int, tokens: int, heads: int, head_dim: int) -> tuple[np.ndarray, ...]:
    """Seeded iid standard Gaussian ``k, v [tokens, heads, head_dim]`` (float32)."""
    kk, kv = jax.random.split(jax.random.key(seed))
    shape = (tokens, heads, head_dim)
    return (np.asarray(jax.random.normal(kk, shape)), np.asarray(jax.random.normal(kv, shape)))


def load_kv(path: str) -> tuple[np.ndarray, np.ndarray]:
    """K/V from a ``.npy`` file: ``[2, T, K, D]`` (K and V) or ``[T, K, D]`` (used for both).

    Raises ``ValueError`` naming the file for anything else: not a ``.npy`` file (an
    ``.npz`` archive, text), a malformed or truncated one, pickled objects, values that are
    not real numbers, or another shape; ``OSError`` when it cannot be read.
    """
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":
        kind = "an .npz archive" if magic.startswith(b"PK") else "not a .npy file"
        raise ValueError(f"{path}: {kind}; expected one array saved with numpy.save")
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as err:
        raise ValueError(f"{path}: a malformed .npy file ({err})") from None
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{path}: expected real numbers, got dtype {arr.dtype}")
    if arr.ndim == 4 and arr.shape[0] == 2:
        return arr[0].astype(np.float32), arr[1].astype(np.float32)
    if arr.ndim == 3:
        return arr.astype(np.float32), arr.astype(np.float32)
    raise ValueError(f"{path}: expected an array [2, T, K, D] or [T, K, D], got {arr.shape}")


def _unit(*arrays: jax.Array) -> float:
    """A power of two to divide ``arrays`` by before squaring and summing them in float32.

    1 for ordinary magnitudes, so their metrics are computed exactly as they always were;
    for finite values so large (up to float32's limit) or so small that their squares
    would overflow to Inf or vanish, the power of two at or below their peak: dividing by
    it only shifts exponents, so the metrics are those of the same problem, representable.
    """
    peak = max(float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(a), a, 0)))) for a in arrays)
    if peak == 0 or 2.0**-32 <= peak <= 2.0**32:
        return 1.0
    return float(2.0 ** np.floor(np.log2(peak)))


def _relative_mse(x, x_hat):
    unit = _unit(x)
    x, x_hat = x / unit, x_hat / unit
    return float(jnp.sum((x - x_hat) ** 2) / jnp.maximum(jnp.sum(x**2), 1e-30))


def row_cosine(x: jax.Array, x_hat: jax.Array) -> jax.Array:
    """Cosine of each vector of ``x[..., D]`` with its reconstruction; traceable under jit."""
    num = jnp.sum(x * x_hat, -1)
    den = jnp.linalg.norm(x, axis=-1) * jnp.linalg.norm(x_hat, axis=-1)
    # a zero vector reconstructed as zero is a perfect reconstruction
    return jnp.where(den > 0, num / jnp.maximum(den, 1e-30), jnp.where(num == 0, 1.0, 0.0))


def _mean_cosine(x, x_hat):
    unit = _unit(x, x_hat)  # the cosine does not depend on the scale
    return float(jnp.mean(row_cosine(x / unit, x_hat / unit)))


def _relative_error(approx, exact):
    unit = _unit(approx, exact)
    approx, exact = approx / unit, exact / unit
    return float(jnp.linalg.norm(approx - exact) / jnp.maximum(jnp.linalg.norm(exact), 1e-30))


def probe(
    config: CacheConfig | str,
    *,
    k: np.ndarray,
    v: np.ndarray,
    queries: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure a cache (a :class:`CacheConfig` or a cache spec) on ``k, v [T, K, D]``.

    The cache has one layer, so its window, sinks and the layer rules that select layer 0
    apply. Returns ``k_codec`` and ``v_codec`` (the specs of that layer's codecs),
    ``head_dim``, ``bits_per_element_formula`` (mean of K and V formulas),
    ``bits_per_element_measured`` (from the bytes of K and V codes of a direct encode),
    ``cache_bits_per_element`` (from the cache, unfinished codec blocks kept raw),
    key metrics ``rel_mse``, ``cosine``, ``ip_abs_err`` (mean ``|q.k - q.k_hat|`` over
    Gaussian queries), ``v_rel_mse``, ``v_cosine``, and ``attn_rel_err``: the relative L2
    error of decode attention over the compressed cache against exact attention.
    """
    if k.shape != v.shape or k.ndim != 3:
        raise ValueError(f"k and v must both be [T, K, D], got {k.shape} and {v.shape}")
    tokens, heads, head_dim = k.shape
    if tokens < 1:
        raise ValueError("need at least one token")
    config = parse_cache(config)
    k_codec, v_codec = config.layer_codecs(1)[0]
    for codec in (k_codec, v_codec):
        codec.check_head_dim(head_dim)
    key = jax.random.key(seed)
    cache = init_cache(key, config, num_layers=1, batch=1, num_kv_heads=heads,
                       head_dim=head_dim, max_len=tokens, dtype=jnp.float32)
    kb, vb = jnp.asarray(k)[None], jnp.asarray(v)[None]
    step = make_step(cache, tokens)
    layer = append(cache.layer(0), kb, vb, step)
    cache = commit(cache.with_layer(0, layer), step)
    check(cache)

    # the slots hold exactly the whole codec blocks of the tokens past the sinks and the
    # window, all filled
    measured = [
        measured_bits_per_element(store.codes, heads * store.slots * store.block * head_dim)
        for store in (layer.k, layer.v)
        if store.slots
    ]
    # the keys as appended: a centered or smoothed cache stores them transformed
    k_hat = jnp.swapaxes(dense(layer.k, cache.lengths, restore_keys=True)[:, :, :tokens], 1, 2)
    v_hat = jnp.swapaxes(dense(layer.v, cache.lengths)[:, :, :tokens], 1, 2)

    q = jax.random.normal(jax.random.fold_in(key, 1), (1, 1, heads * queries, head_dim))
    exact = dense_attention(q, kb, vb, q_positions=jnp.array([[tokens - 1]]),
                            kv_lengths=jnp.array([tokens]))
    # the chunk's last query alone, over the cache holding the whole chunk
    last = dataclasses.replace(step, start=step.start + tokens - 1,
                               valid=jnp.ones_like(step.valid))
    approx = attend(q, layer, last, impl=config.attention)
    qh = q[0, 0].reshape(heads, queries, head_dim)
    unit = _unit(kb, k_hat)  # q.k in units of a power of two: no overflow, exact shift back
    ip = jnp.einsum("hqd,thd->hqt", qh, kb[0] / unit, precision=EXACT)
    ip_hat = jnp.einsum("hqd,thd->hqt", qh, k_hat[0] / unit, precision=EXACT)
    return {
        "k_codec": k_codec.spec,
        "v_codec": v_codec.spec,
        "head_dim": head_dim,
        "tokens": tokens,
        "heads": heads,
        "bits_per_element_formula": 0.5 * (k_codec.bits_per_element(head_dim)
                                           + v_codec.bits_per_element(head_dim)),
        "bits_per_element_measured": float(np.mean(measured)) if measured else float("nan"),
        "cache_bits_per_element": stored_bits(cache)["bits_per_element"],
        "rel_mse": _relative_mse(kb, k_hat),
        "cosine": _mean_cosine(kb, k_hat),
        "ip_abs_err": float(jnp.mean(jnp.abs(ip - ip_hat))) * unit,
        "v_rel_mse": _relative_mse(vb, v_hat),
        "v_cosine": _mean_cosine(vb, v_hat),
        "attn_rel_err": _relative_error(approx, exact),
    }
