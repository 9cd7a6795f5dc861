"""Probes of the rotation-preconditioned key codecs (TurboQuant, PolarQuant, OCTOPUS) on
Gaussian keys, beyond :mod:`kvjax.eval.synthetic`'s reconstruction and needle: how much a
codec's score of a key with itself shrinks, codecs against a reference family at equal
stored bits, OCTOPUS's split of bits between triplet direction and norm, and its local
3x3 joint rounding against the full grid of directions.

Each ``*_part`` function returns JSON-ready rows; ``experiments/octopus_synthetic.py``
runs them with the OCTOPUS paper's settings and writes the tables.

Seeds. Trial ``s`` of ``seed`` draws its data and its codec parameters (rotation signs,
QJL sketch) from ``fold_in(key(seed), s)``: every trial is new data and a new rotation,
and every codec sees the same data in the same trial.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax.codecs.octopus import (
    direction_codebook,
    joint_round,
    norm_codebook,
    octahedral_decode,
    to_triplets,
)
from kvjax.eval.synthetic import needle, reconstruction
from kvjax.primitives.rotations import random_signs, randomized_hadamard
from kvjax.spec import parse_codec

#: the nominal bit widths, split offsets and direction bits of the OCTOPUS paper
BITS = (2, 3, 4)
DELTAS = (-2, -1, 0, 1, 2)
GRID_BITS = (2, 3, 4, 5)
#: the widest direction or norm codebook of a split
MAX_SPLIT_BITS = 8


def family(spec: str) -> str:
    """``turboquant``, ``turboquant-qjl``, ``polarquant``, ``octopus``, ``octopus-qjl``, or
    ``octopus-split`` for an OCTOPUS split other than the nominal one."""
    codec = parse_codec(spec)
    if codec.name == "octopus" and codec.nominal_bits is None:
        return "octopus-split"
    return codec.name + ("-qjl" if getattr(codec, "qjl", False) else "")


def nominal(spec: str) -> int | None:
    """The nominal bit width B of a ``...:bB`` spec, else None."""
    codec = parse_codec(spec)
    if codec.name == "octopus":
        return codec.nominal_bits
    return getattr(codec, "bits", None)


def _progress(items, desc: str, progress: bool):
    return tqdm(items, desc=desc, unit="codec", disable=not progress, leave=False)


# -- keys ----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _self_scores(codec, head_dim: int, keys: int, seeds: int, seed: jax.Array) -> jax.Array:
    """``s(k, k) / |k|^2`` per trial (mean over ``keys`` Gaussian keys), ``s`` the codec's
    :meth:`~kvjax.codec.Codec.scores`, each key encoded as its own one-token cache."""

    def trial(s):
        data, params_key = jax.random.split(jax.random.fold_in(jax.random.key(seed), s))
        x = jax.random.normal(data, (keys, 1, head_dim), jnp.float32)
        params = codec.init(params_key, head_dim)
        score = codec.scores(params, x, codec.encode(params, x))[:, 0, 0]
        return jnp.mean(score / jnp.sum(x[:, 0] ** 2, axis=-1))

    return jax.lax.map(trial, jnp.arange(seeds, dtype=jnp.uint32))


def self_score_gain(spec: str, *, head_dim: int = 128, keys: int = 1024, seeds: int = 8,
                    seed: int = 0) -> float:
    """Mean over trials of ``s(k, k) / |k|^2``: how far the codec's score of a key with
    itself falls short of the exact ``|k|^2`` (1: unbiased). A needle's logit is about
    this times its exact value, so it tells how much mass a needle loses to the codec's
    shrinkage rather than to noise. Trials draw from ``fold_in(key(seed), s)`` as their own
    data (not the keys protocol's)."""
    codec = parse_codec(spec)
    return float(np.mean(_self_scores(codec, head_dim, keys, seeds, jnp.uint32(seed))))


def keys_part(specs: Sequence[str], *, head_dim: int = 128, keys: int = 1024,
              queries: int = 16, seeds: int = 64, seed: int = 0, gain_seeds: int = 8,
              progress: bool = True) -> list[dict]:
    """One row per codec of the keys protocol, with :func:`self_score_gain` over
    ``gain_seeds`` trials (None when 0); raises if the stored bits differ from the
    codec's formula."""
    rows = []
    for spec in _progress(specs, "keys", progress):
        start = time.perf_counter()
        r = reconstruction(spec, head_dim=head_dim, keys=keys, queries=queries, seeds=seeds,
                           seed=seed)
        if r["bits_per_element"] != r["bits_per_element_formula"]:
            raise RuntimeError(f"{spec}: stored {r['bits_per_element']} bits per element, "
                               f"the formula says {r['bits_per_element_formula']}")
        gain = (self_score_gain(spec, head_dim=head_dim, keys=keys, seeds=gain_seeds,
                                seed=seed) if gain_seeds else None)
        rows.append({
            "codec": r["codec"], "family": family(spec), "b": nominal(spec),
            "bits": r["bits_per_element"], "bits_formula": r["bits_per_element_formula"],
            **{f"{m}{s}": r[f"{m}{s}"] for m in ("cosine", "mse", "ip_abs_err")
               for s in ("", "_std", "_median")},
            "self_score_gain": gain, "per_seed": r["per_seed"],
            "seconds": time.perf_counter() - start,
        })
    return rows


def metric_ratio(rows: Sequence[dict], num: str, den: str, metric: str) -> dict | None:
    """Ratio of the means of ``metric`` for codecs ``num`` over ``den``, with the range of
    the per-seed ratios (the codecs see the same data in each trial)."""
    by = {r["codec"]: r for r in rows}
    if num not in by or den not in by:
        return None
    a = np.asarray(by[num]["per_seed"][metric], np.float64)
    b = np.asarray(by[den]["per_seed"][metric], np.float64)
    per = a / b
    return {"num": num, "den": den, "metric": metric,
            "ratio": float(a.mean() / b.mean()), "seed_min": float(per.min()),
            "seed_max": float(per.max()), "bits_num": by[num]["bits"],
            "bits_den": by[den]["bits"]}


def linear(points: Sequence[tuple[float, float]], at: float) -> float | None:
    """Linear interpolation of ``(bits, value)`` points at ``at`` bits; None outside their
    range. For a per-coordinate MSE this is what mixing two bit widths over the
    coordinates achieves."""
    points = sorted(points)
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= at <= x1:
            w = (at - x0) / (x1 - x0)
            return float((1 - w) * y0 + w * y1)
    return None


def loglinear(points: Sequence[tuple[float, float]], at: float) -> float | None:
    """Geometric interpolation of ``(bits, value)`` points at ``at`` bits (log value linear
    in bits between the two points around it); None outside their range."""
    points = sorted(points)
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= at <= x1:
            w = (at - x0) / (x1 - x0)
            return float(math.exp((1 - w) * math.log(y0) + w * math.log(y1)))
    return None


#: (metric, reference family, compared families) of the equal-bits view: PolarQuant and
#: OCTOPUS against TurboQuant-MSE, OCTOPUS-QJL against TurboQuant-QJL
EQUAL_BITS = (("mse", "turboquant", ("polarquant", "octopus")),
              ("ip_abs_err", "turboquant", ("polarquant", "octopus")),
              ("ip_abs_err", "turboquant-qjl", ("octopus-qjl",)))


def equal_bits(rows: Sequence[dict],
               comparisons: Sequence[tuple[str, str, Sequence[str]]] = EQUAL_BITS
               ) -> list[dict]:
    """For each ``(metric, reference family, compared families)`` of ``comparisons``: each
    compared row's metric against the reference family's, log-interpolated (and linearly
    interpolated) in stored bits to the row's own stored bits (rows outside the
    reference's range are left out). Rows are :func:`keys_part`'s."""
    out = []
    for metric, reference, families in comparisons:
        points = [(r["bits"], r[metric]) for r in rows if r["family"] == reference]
        for r in sorted(rows, key=lambda r: r["bits"]):
            ref = loglinear(points, r["bits"]) if r["family"] in families else None
            if ref is not None:
                lin = linear(points, r["bits"])
                out.append({"codec": r["codec"], "bits": r["bits"], "metric": metric,
                            "value": r[metric], "reference": reference,
                            "reference_value": ref, "ratio": r[metric] / ref,
                            "reference_linear": lin, "ratio_linear": r[metric] / lin})
    return out


# -- needle --------------------------------------------------------------------------------


def needle_part(specs: Sequence[str], *, head_dim: int = 128, distractors: int = 2048,
                noise: float = 0.1, seeds: int = 128, seed: int = 0,
                progress: bool = True) -> dict:
    """``{"reference": exact float32 keys, "rows": one per codec}``: softmax mass on the
    needle (mean, median, std over trials), its ratio to the reference, top-1 rate."""
    rows, reference = [], None
    for spec in _progress(specs, "needle", progress):
        start = time.perf_counter()
        r = needle(spec, head_dim=head_dim, distractors=distractors, noise=noise,
                   seeds=seeds, seed=seed)
        ref = {"mass": r["reference"], "mass_median": r["reference_median"],
               "mass_std": r["reference_std"], "top1": r["reference_top1"],
               "per_seed": r["per_seed"]["reference"]}
        if reference is None:
            reference = ref
        elif not np.allclose(reference["per_seed"], ref["per_seed"], rtol=1e-6, atol=1e-7):
            raise RuntimeError(f"{spec}: the exact-key reference differs between codecs")
        rows.append({
            "codec": r["codec"], "family": family(spec), "b": nominal(spec),
            "bits": float(parse_codec(spec).bits_per_element(head_dim)),
            "mass": r["mass"], "mass_median": r["mass_median"], "mass_std": r["mass_std"],
            "ratio": r["ratio"], "median_ratio": r["mass_median"] / r["reference_median"],
            "top1": r["top1"], "per_seed": r["per_seed"]["mass"],
            "seconds": time.perf_counter() - start,
        })
    return {"reference": reference, "rows": rows}


# -- split ---------------------------------------------------------------------------------


def split_configs(bits: Sequence[int] = BITS,
                  deltas: Sequence[int] = DELTAS) -> list[tuple[int, int, int, int]]:
    """``(b, delta, direction bits, norm bits)`` on the diagonal ``(b + delta, b - delta)``,
    where both widths lie in 0..8."""
    return [(b, d, b + d, b - d) for b in bits for d in deltas
            if 0 <= b + d <= MAX_SPLIT_BITS and 0 <= b - d <= MAX_SPLIT_BITS]


def split_spec(direction_bits: int, norm_bits: int) -> str:
    """``octopus:dX,nY`` (parse_codec names the nominal split ``octopus:bB``)."""
    return f"octopus:d{direction_bits},n{norm_bits}"


def equal_rate_splits(b: int) -> list[tuple[int, int]]:
    """The OCTOPUS splits at ``turboquant:bB``'s 3b bits per triplet that are compared with
    it: ``(b, b)`` and ``(b + 1, b - 2)`` (when ``b >= 2``)."""
    return [(b, b), *([(b + 1, b - 2)] if b >= 2 else [])]


def split_part(bits: Sequence[int] = BITS, deltas: Sequence[int] = DELTAS, *,
               head_dim: int = 128, keys: int = 1024, queries: int = 16, seeds: int = 16,
               seed: int = 0, equal_rate: bool = True, progress: bool = True) -> dict:
    """``{"rows": the diagonal, "rate": the equal-rate comparison}`` on the keys protocol.

    Each diagonal row has the MSE relative to the uniform split of its ``b`` (``vs_uniform``
    = MSE / MSE(delta=0) - 1) and to ``(b + 1, b - 1)`` (``vs_plus1``), where those were run.
    With ``equal_rate``, ``rate`` holds, per ``b``, ``turboquant:bB`` and the OCTOPUS splits
    that spend its ``3 b`` bits per triplet, ``(b, b)`` and ``(b + 1, b - 2)``.
    """
    configs = split_configs(bits, deltas)
    specs = [split_spec(d, n) for _, _, d, n in configs]
    if equal_rate:
        for b in bits:
            specs += [f"turboquant:b{b}", *(split_spec(d, n) for d, n in equal_rate_splits(b))]
    results = {}
    for spec in _progress(list(dict.fromkeys(specs)), "split", progress):  # no repeats
        r = reconstruction(spec, head_dim=head_dim, keys=keys, queries=queries, seeds=seeds,
                           seed=seed)
        if r["bits_per_element"] != r["bits_per_element_formula"]:
            raise RuntimeError(f"{spec}: stored bits differ from the formula")
        results[spec] = r
    rows = []
    for b, delta, d, n in configs:
        r = results[split_spec(d, n)]
        rows.append({"b": b, "delta": delta, "direction_bits": d, "norm_bits": n,
                     "codec": r["codec"], "bits_per_triplet": 2 * d + n,
                     "bits": r["bits_per_element"], "mse": r["mse"], "mse_std": r["mse_std"],
                     "mse_per_seed": r["per_seed"]["mse"]})
    for row in rows:
        for key, ref_delta in (("vs_uniform", 0), ("vs_plus1", 1)):
            ref = [r["mse"] for r in rows if r["b"] == row["b"] and r["delta"] == ref_delta]
            row[key] = row["mse"] / ref[0] - 1 if ref else None
    rate = []
    if equal_rate:
        for b in bits:
            tq = results[f"turboquant:b{b}"]
            for d, n in ((None, None), *equal_rate_splits(b)):
                r = results[f"turboquant:b{b}" if d is None else split_spec(d, n)]
                rate.append({"b": b, "codec": r["codec"],
                             "split": None if d is None else [d, n],
                             "bits_per_triplet": None if d is None else 2 * d + n,
                             "bits": r["bits_per_element"], "mse": r["mse"],
                             "vs_turboquant": r["mse"] / tq["mse"]})
    return {"rows": rows, "rate": rate}


# -- grid ----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1))
def rotated_triplets(count: int, head_dim: int = 128, seed: int = 0) -> jax.Array:
    """``count`` triplets ``[count, 3]`` of rotated unit Gaussian vectors: each vector's
    ``floor(D / 3)`` whole triplets (the zero-padded last one left out), one seeded
    sign-flipped Walsh-Hadamard rotation for all."""
    per_vector = head_dim // 3
    vectors = -(-count // per_vector)
    data_key, sign_key = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(data_key, (vectors, head_dim), jnp.float32)
    y = randomized_hadamard(x / jnp.linalg.norm(x, axis=-1, keepdims=True),
                            random_signs(sign_key, head_dim))
    return to_triplets(y)[:, :per_vector].reshape(-1, 3)[:count]


@jax.jit
def _triplet_error(t, indices, direction_centroids, norm_centroids) -> jax.Array:
    """``|t - rho_hat m(xi_hat, eta_hat)|^2`` per triplet."""
    i_xi, i_eta, i_rho = indices
    m = octahedral_decode(direction_centroids[i_xi], direction_centroids[i_eta])
    return jnp.sum((t - norm_centroids[i_rho][..., None] * m) ** 2, axis=-1)


def grid_norm_bits(direction_bits: int) -> list[int]:
    """The norm widths tried with ``direction_bits``: ``b_dir - 2`` (the paper's split)
    and 2."""
    return sorted({max(direction_bits - 2, 0), 2})


def _timed_round(t, direction, norm, full_grid: bool, timing: bool):
    """``joint_round``'s indices (compiled), and with ``timing`` the best of 3 further runs
    in seconds (else None)."""
    fn = jax.jit(lambda t: joint_round(t, direction, norm, full_grid=full_grid))
    out = jax.block_until_ready(fn(t))  # compiles
    if not timing:
        return out, None
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(fn(t))
        best = min(best, time.perf_counter() - start)
    return out, best


def grid_part(direction_bits: Sequence[int] = GRID_BITS, *, head_dim: int = 128,
              triplets: int = 10_000, seed: int = 0, timing: bool = True,
              norm_bits: Sequence[int] | None = None) -> list[dict]:
    """Local 3x3 joint rounding against the full grid. One row per (direction bits, norm
    bits), the norm bits :func:`grid_norm_bits` unless ``norm_bits`` is given: the
    fraction of triplets whose three indices agree (``identical``), whose direction
    indices agree, the two total squared errors and their ratio, the largest per-triplet
    excess of the local error, and with ``timing`` each search's compiled run time (best
    of 3)."""
    t = rotated_triplets(triplets, head_dim, seed)
    rows = []
    for d in direction_bits:
        for n in grid_norm_bits(d) if norm_bits is None else norm_bits:
            direction, norm = direction_codebook(d), norm_codebook(head_dim, n)
            local, seconds_local = _timed_round(t, direction, norm, False, timing)
            full, seconds_full = _timed_round(t, direction, norm, True, timing)
            same = np.stack([np.asarray(a) == np.asarray(b) for a, b in zip(local, full,
                                                                              strict=True)])
            tables = (jnp.asarray(direction.centroids, jnp.float32),
                      jnp.asarray(norm.centroids, jnp.float32))
            e_local = np.asarray(_triplet_error(t, local, *tables), np.float64)
            e_full = np.asarray(_triplet_error(t, full, *tables), np.float64)
            rows.append({
                "direction_bits": d, "norm_bits": n, "triplets": int(t.shape[0]),
                "candidates_full": 4 ** d, "identical": float(same.all(axis=0).mean()),
                "identical_direction": float(same[:2].all(axis=0).mean()),
                "error_local": float(e_local.sum()), "error_full": float(e_full.sum()),
                "ratio": float(e_local.sum() / e_full.sum()),
                "max_excess": float(np.max(e_local - e_full)),
                "seconds_local": seconds_local, "seconds_full": seconds_full,
            })
    return rows
