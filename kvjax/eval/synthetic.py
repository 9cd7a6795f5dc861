"""Model-free synthetic probes of a key codec on iid Gaussian keys (OCTOPUS, section 4.1).

Two probes, each a pure function of (codec, sizes, seed):

- :func:`reconstruction`: how well the codec keeps keys and the inner products that
  attention takes with them (cosine, per-coordinate MSE, ``|q.k - s(q, k)|``) and what
  it stores (bits per element, measured and by formula).
- :func:`needle`: whether one key among many Gaussian distractors still draws the
  softmax attention of a noisy copy of itself after compression.

Both run every seed inside one ``jax.jit`` (a ``lax.scan`` over seed indices), so a run
compiles once per codec and sizes; eager JAX on CPU would spend its time compiling
primitives. Inner products always go through :meth:`Codec.scores`, the path attention
uses, so codecs with an estimator of their own are measured as used.

Seeds. Trial ``s`` of ``seed`` draws everything from ``fold_in(key(seed), s)``, split
into a data key (keys, queries, needle), a parameter key (``codec.init``: codecs with
seeded rotations get a fresh one per trial) and a key for block padding. The data key
does not depend on the codec, so every codec sees the same keys for the same seed and
results pair up across codecs.

Block padding. A codec that quantizes blocks of ``block_tokens`` tokens (KIVI keys)
needs a whole number of blocks. When the real keys do not fill the last block it is
completed with extra Gaussian keys from the padding key, drawn like the real ones (so
the last block's ranges look like every other block's, which zero rows would not), and
every metric and softmax covers the real keys only.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codec import EXACT, Codec, measured_bits_per_element
from kvjax.probe import row_cosine
from kvjax.spec import parse_codec

# -- shared helpers -----------------------------------------------------------------


def _count(name: str, value: Any, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def _codec(codec: str | Codec, head_dim: Any) -> Codec:
    codec = parse_codec(codec)
    # CodecError is a ValueError that names the codec and what it accepts
    codec.check_head_dim(head_dim)
    return codec


def _trial_keys(seed: jax.Array, trial: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(data, params, padding)`` keys of trial ``trial`` of ``seed`` (module docstring)."""
    data, params, padding = jax.random.split(jax.random.fold_in(jax.random.key(seed), trial), 3)
    return data, params, padding


def _padding(codec: Codec, n: int) -> int:
    return -n % codec.block_tokens


def _with_padding(codec: Codec, key: jax.Array, x: jax.Array) -> jax.Array:
    """``x[n, D]`` followed by Gaussian rows up to a whole number of codec blocks."""
    extra = _padding(codec, x.shape[0])
    if not extra:
        return x
    return jnp.concatenate([x, jax.random.normal(key, (extra, x.shape[1]), x.dtype)])


def _over_seeds(trial_fn, seed: jax.Array, seeds: int):
    """``(metrics, codes) = trial_fn(seed, s)`` for ``s < seeds``: stacked metrics and the
    last trial's codes (every trial's codes have the same shapes and dtypes).

    A sequential scan, one trial per step: on the 2-core CPU it both compiled and ran
    faster than vmapping the seeds (whole or in batches), and its memory does not grow
    with ``seeds``. Carrying the codes hands real stored arrays to the bit count without
    compiling a second copy of the trial.
    """
    _, codes_shape = jax.eval_shape(trial_fn, seed, jnp.uint32(0))
    codes0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), codes_shape)

    def step(_, trial):
        metrics, codes = trial_fn(seed, trial)
        return codes, metrics

    codes, per_seed = jax.lax.scan(step, codes0, jnp.arange(seeds, dtype=jnp.uint32))
    return per_seed, codes


def _summary(per_seed: dict[str, jax.Array]) -> dict[str, Any]:
    """Mean, median and population std (ddof=0) over seeds of each metric, plus the raw
    values. The median is kept because needle masses are skewed: a needle of small norm
    loses much of its mass, which pulls the mean well below the typical trial."""
    out: dict[str, Any] = {}
    for name, values in per_seed.items():
        values = np.asarray(values, np.float64)
        out[name] = float(values.mean())
        out[f"{name}_median"] = float(np.median(values))
        out[f"{name}_std"] = float(values.std())
    out["per_seed"] = {name: np.asarray(v).tolist() for name, v in per_seed.items()}
    return out


# -- reconstruction -----------------------------------------------------------------


def _reconstruction_trial(codec, head_dim, keys, queries, seed, trial):
    data, params_key, pad_key = _trial_keys(seed, trial)
    # one draw for keys and queries: every random op costs compile time on CPU
    x = jax.random.normal(data, (keys + queries, head_dim), jnp.float32)
    k, q = x[:keys], x[keys:]
    params = codec.init(params_key, head_dim)
    codes = codec.encode(params, _with_padding(codec, pad_key, k))
    k_hat = codec.decode(params, codes, jnp.float32)[:keys]
    approx = codec.scores(params, q, codes)[:, :keys]
    exact = jnp.einsum("qd,kd->qk", q, k, precision=EXACT)
    metrics = {
        "cosine": jnp.mean(row_cosine(k, k_hat)),
        "mse": jnp.mean((k - k_hat) ** 2),
        "ip_abs_err": jnp.mean(jnp.abs(exact - approx)),
    }
    return metrics, codes


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _reconstruction_run(codec, head_dim, keys, queries, seeds, seed):
    def trial(seed, s):
        return _reconstruction_trial(codec, head_dim, keys, queries, seed, s)

    return _over_seeds(trial, seed, seeds)


def reconstruction(
    codec: str | Codec,
    *,
    head_dim: int = 128,
    keys: int = 1024,
    queries: int = 16,
    seeds: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """Key reconstruction and inner-product error of ``codec`` on Gaussian keys.

    The OCTOPUS synthetic protocol (d=128, n=1024 keys, 16 queries, 64 seeds): per trial,
    ``k ~ N(0, I_D) [keys, D]`` and ``q ~ N(0, I_D) [queries, D]``, codec parameters from
    ``codec.init`` with the trial's parameter key. Averaged over trials (with their std,
    ddof=0, as ``<metric>_std``, and every trial's value under ``per_seed``):

    - ``cosine``: mean cosine of ``k`` with its decode ``k_hat``;
    - ``mse``: mean of ``(k - k_hat)**2`` over keys and coordinates (unnormalized: the
      keys have unit variance per coordinate);
    - ``ip_abs_err``: mean ``|q.k - s(q, k)|`` with ``s`` the codec's
      :meth:`Codec.scores` over the codes, not decode-then-dot: an estimator is
      measured as attention uses it.

    ``bits_per_element`` is measured from the bytes of the stored code arrays (of the
    ``keys`` plus block padding, see the module docstring) and
    ``bits_per_element_formula`` is :meth:`Codec.bits_per_element`. Raises ``ValueError``
    for sizes below 1 and the codec's :class:`~kvjax.codec.CodecError` (a ``ValueError``)
    for a head dim it cannot encode.
    """
    codec = _codec(codec, head_dim)
    keys, queries = _count("keys", keys), _count("queries", queries)
    seeds, seed = _count("seeds", seeds), _count("seed", seed, lo=0)
    per_seed, codes = _reconstruction_run(codec, head_dim, keys, queries, seeds, seed)
    stored = keys + _padding(codec, keys)
    return {
        "codec": codec.spec,
        "head_dim": head_dim,
        "keys": keys,
        "queries": queries,
        "seeds": seeds,
        "seed": seed,
        "bits_per_element": measured_bits_per_element(codes, stored * head_dim),
        "bits_per_element_formula": float(codec.bits_per_element(head_dim)),
        **_summary(per_seed),
    }


# -- needle -------------------------------------------------------------------------


def needle_problem(
    key: jax.Array, distractors: int, head_dim: int, noise: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One needle instance: ``(keys [distractors + 1, D], query [D], needle position)``.

    Every key is ``N(0, I_D)``; the needle ``k*`` is the key at a uniform random
    position, and the query is ``k* + noise * ||k*|| * e`` with ``e`` a uniform random
    unit vector, so ``noise`` is the query's relative distance from the needle.
    """
    vectors_key, position_key = jax.random.split(key)
    n = distractors + 1
    # one draw for the keys and the noise direction: every random op costs compile time
    x = jax.random.normal(vectors_key, (n + 1, head_dim), jnp.float32)
    keys, e = x[:n], x[n] / jnp.linalg.norm(x[n])
    position = jax.random.randint(position_key, (), 0, n)
    target = keys[position]
    return keys, target + noise * jnp.linalg.norm(target) * e, position


def needle_mass(scores: jax.Array, position: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(softmax mass at position, whether it holds the largest score)`` of ``scores[n]``.

    ``scores`` are the attention logits, already scaled (``q.k_i / sqrt(D)``): the
    scaling is part of the protocol, so callers state it where they compute scores.
    """
    return jax.nn.softmax(scores)[position], jnp.argmax(scores) == position


def _needle_trial(codec, head_dim, distractors, noise, seed, trial):
    data, params_key, pad_key = _trial_keys(seed, trial)
    keys, query, position = needle_problem(data, distractors, head_dim, noise)
    n = distractors + 1
    params = codec.init(params_key, head_dim)
    codes = codec.encode(params, _with_padding(codec, pad_key, keys))
    scale = 1.0 / math.sqrt(head_dim)
    # padding rows sit after the n real keys and are left out of the softmax
    approx = codec.scores(params, query[None], codes)[0, :n] * scale
    exact = jnp.einsum("d,kd->k", query, keys, precision=EXACT) * scale
    mass, top1 = needle_mass(approx, position)
    ref_mass, ref_top1 = needle_mass(exact, position)
    metrics = {"mass": mass, "top1": top1, "reference": ref_mass, "reference_top1": ref_top1}
    return metrics, codes


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _needle_run(codec, head_dim, distractors, noise, seeds, seed):
    def trial(seed, s):
        return _needle_trial(codec, head_dim, distractors, noise, seed, s)

    return _over_seeds(trial, seed, seeds)[0]


def needle(
    codec: str | Codec,
    *,
    head_dim: int = 128,
    distractors: int = 2048,
    noise: float = 0.1,
    seeds: int = 128,
    seed: int = 0,
) -> dict[str, Any]:
    """Softmax attention mass that a noisy query puts on its needle among distractors.

    The OCTOPUS needle probe (one key among 2048 Gaussian distractors, a 10% noisy
    query, 128 seeds). The paper leaves the query noise and the score scaling unstated;
    this protocol fixes them (:func:`needle_problem`): ``n = distractors + 1`` keys
    ``N(0, I_D)``, the needle at a uniform random position, the query
    ``q = k* + noise * ||k*|| * e`` (``e`` a uniform random unit vector), and scores
    ``s_i = s(q, k_i) / sqrt(D)`` with ``s`` the codec's :meth:`Codec.scores` over the
    codes of all ``n`` keys, encoded together. With the defaults, exact float32 keys
    keep 0.9255 of the mass on average over trials 0..127 of seed 0 (0.927 +- 0.001
    over 4096 trials of seed 1; the paper states 0.960), so compare codecs by their
    ratio to ``reference``, not to the paper's number.

    Returns ``mass`` (mean softmax mass on the needle) and ``top1`` (fraction of trials
    where the needle has the largest score), with ``_std`` (ddof=0) and ``per_seed``
    values, and the same for exact keys (float32 dot products at HIGHEST precision):
    ``reference``, ``reference_top1``; ``ratio`` is ``mass / reference``. A codec that
    quantizes blocks of tokens gets the last block completed with extra Gaussian keys
    (module docstring); the softmax covers exactly the ``n`` real keys. Raises
    ``ValueError`` for ``distractors < 0``, ``seeds < 1`` or a negative or non-finite
    ``noise``, and the codec's ``CodecError`` for a head dim it cannot encode.
    """
    codec = _codec(codec, head_dim)
    distractors = _count("distractors", distractors, lo=0)
    seeds, seed = _count("seeds", seeds), _count("seed", seed, lo=0)
    if isinstance(noise, bool) or not isinstance(noise, int | float | np.floating | np.integer):
        raise ValueError(f"noise must be a number >= 0, got {noise!r}")
    if not math.isfinite(noise) or noise < 0:
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    per_seed = _needle_run(codec, head_dim, distractors, float(noise), seeds, seed)
    out = {
        "codec": codec.spec,
        "head_dim": head_dim,
        "distractors": distractors,
        "keys": distractors + 1,
        "noise": float(noise),
        "seeds": seeds,
        "seed": seed,
        **_summary(per_seed),
    }
    out["ratio"] = out["mass"] / out["reference"]
    return out
