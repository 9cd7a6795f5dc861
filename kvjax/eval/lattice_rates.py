"""Rate measurements of HyperQuant's lattice quantizers: Monte-Carlo normalized second
moments, the Rice rate, scalar entropy and cost of not stripping at one SNR against the
lattice's high-rate ideal, and the rate the whole codec realizes against its target.

``experiments/hyperquant_tables.py`` runs them with the paper's settings and sets the
results against the paper's numbers.

Seeds. Every fresh draw comes from ``fold_in(key(seed), part)`` (1: ``G``, 2: the
vectors at one SNR, 4: the codec's data, 5: its parameters), never from the
calibration's own vectors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codecs.hyperquant import (
    CALIBRATION_VECTORS,
    MAX_RATE,
    MIN_RATE,
    HyperQuantCodec,
    alpha_for_snr,
    block_payload,
    calibration,
    quantize_symbols,
    substreams,
)
from kvjax.primitives import rice
from kvjax.primitives.lattices import Lattice, lattice, zigzag

#: the lattices, best first (the paper's order; a lattice's index seeds its ``G`` draws)
LATTICE_ORDER = ("e8", "d4", "a2", "z")
#: the operating point of the paper's rate table
SNR_DB = 21.0
#: lower end of the rates where the high-rate ideal is compared (the paper's weight sweep)
HIGH_RATE = 3.0
#: tokens per block: the codec's default, which its calibration tables are measured at
BLOCK_TOKENS = 8


# -- formulas ------------------------------------------------------------------------------


def rd_rate(snr_db: float | np.ndarray) -> float | np.ndarray:
    """Gaussian rate-distortion rate per dimension, ``1/2 log2 SNR`` (linear SNR)."""
    return 0.5 * np.log2(10.0 ** (np.asarray(snr_db, np.float64) / 10.0))


def ideal_rate(second_moment: float, snr_db: float | np.ndarray) -> float | np.ndarray:
    """High-rate rate of an entropy-coded lattice quantizer with normalized second moment
    ``G``: ``R_D + 1/2 log2(2 pi e G)`` bits per dimension."""
    return rd_rate(snr_db) + 0.5 * math.log2(2.0 * math.pi * math.e * second_moment)


def granular_gain_db(second_moment: float) -> float:
    """Granular gain over the integer lattice, ``10 log10((1/12) / G)`` dB."""
    return 10.0 * math.log10((1.0 / 12.0) / second_moment)


def entropy_bits(counts: np.ndarray) -> float:
    """Plug-in entropy (bits) of a histogram."""
    counts = np.asarray(counts, np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-np.sum(p * np.log2(p)))


def pinned_bits(lat: Lattice) -> float:
    """Bits per element that membership pins (what :meth:`Lattice.strip` removes)."""
    return lat.stripped_bits / lat.dim


def raw_classes(lat: Lattice) -> tuple[int, ...]:
    """Coordinate classes of the raw codes: ``a2``'s ``n_x`` and ``n_y`` have spreads
    ``alpha`` and ``alpha / sqrt 3``; every other lattice's coordinates are alike."""
    return (0, 1) if lat.name == "a2" else (0,) * lat.dim


# -- second moments ------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 2))
def _normalized_errors(name: str, key: jax.Array, count: int) -> jax.Array:
    """``|U|^2 / (n V^(2/n))`` of ``count`` uniform draws on the Voronoi cell (their mean
    is ``G``)."""
    lat = lattice(name)
    u = lat.voronoi_sample(key, (count,))
    return jnp.sum(u * u, axis=-1) / (lat.dim * lat.covolume ** (2.0 / lat.dim))


def second_moment_mc(name: str, samples: int, seed: int, chunk: int = 1 << 18) -> dict:
    """Monte-Carlo ``G`` of lattice ``name`` from ``samples`` Voronoi-cell draws (in chunks
    of ``chunk`` so memory stays small): estimate, standard error and the exact value, with
    their granular gains."""
    lat = lattice(name)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 1),
                             LATTICE_ORDER.index(name))
    total = total_sq = 0.0
    done = 0
    for i in range(-(-samples // chunk)):
        count = min(chunk, samples - done)
        v = np.asarray(_normalized_errors(name, jax.random.fold_in(key, i), count),
                       np.float64)
        total += v.sum()
        total_sq += (v * v).sum()
        done += count
    mean = total / done
    var = max(total_sq / done - mean * mean, 0.0) * done / max(done - 1, 1)
    se = math.sqrt(var / done)
    exact = lat.second_moment
    return {"lattice": name, "dim": lat.dim, "samples": done, "estimate": mean, "se": se,
            "exact": exact, "rel_error": mean / exact - 1.0,
            "z_score": (mean - exact) / se if se > 0 else 0.0,
            "gain_db": granular_gain_db(mean), "gain_db_exact": granular_gain_db(exact)}


# -- the Rice rate and the cost of not stripping at one SNR --------------------------------


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _block_measurements(name: str, head_dim: int, vectors: int, key: jax.Array,
                        alpha: jax.Array):
    """One chunk of fresh Gaussian vectors at scale ``alpha``: per block (8 tokens) the
    stripped Rice bits, the raw codes' Rice bits with a parameter per coordinate class and
    with one parameter, the squared quantization error, and the stripped and raw symbols
    ``[blocks, elements]``."""
    lat = lattice(name)
    blocks = vectors // BLOCK_TOKENS
    elements = BLOCK_TOKENS * head_dim
    n_sub, size = substreams(elements, lat.dim)
    x = jax.random.normal(key, (blocks, BLOCK_TOKENS, head_dim), jnp.float32)
    y = alpha * x * (math.sqrt(head_dim) / jnp.linalg.norm(x, axis=-1, keepdims=True))
    codes, symbols = quantize_symbols(lat, y, None)
    error = y - lat.point(codes).reshape(y.shape)
    symbols = symbols.reshape(blocks, elements)
    stripped = block_payload(lat, symbols, n_sub)[2]
    raw = zigzag(codes).reshape(blocks, n_sub, size)
    classes = np.tile(np.asarray(raw_classes(lat)), size // lat.dim)
    per_class = sum(
        jnp.min(rice.parameter_costs(raw, jnp.asarray(classes == c)), axis=-1)
        for c in np.unique(classes))
    one = jnp.min(rice.parameter_costs(raw), axis=-1)
    return (stripped, jnp.sum(per_class, -1), jnp.sum(one, -1),
            jnp.sum(error * error, axis=(-2, -1)), symbols, raw.reshape(blocks, elements))


class _Histograms:
    """Symbol counts per coordinate of a lattice point, grown as symbols arrive."""

    def __init__(self, dim: int):
        self.counts = [np.zeros(0, np.int64) for _ in range(dim)]

    def add(self, symbols: np.ndarray) -> None:
        cols = symbols.reshape(-1, len(self.counts))
        for j, old in enumerate(self.counts):
            new = np.bincount(cols[:, j])
            if len(new) < len(old):
                new = np.pad(new, (0, len(old) - len(new)))
            self.counts[j] = new + np.pad(old, (0, len(new) - len(old)))

    def position_entropy(self) -> float:
        """Mean over the coordinates of each one's marginal entropy (bits per symbol)."""
        return float(np.mean([entropy_bits(c) for c in self.counts]))

    def class_entropy(self, classes: Sequence[int]) -> float:
        """Mean per symbol of the entropy of each class's pooled symbols."""
        total = 0.0
        for c in sorted(set(classes)):
            members = [j for j, k in enumerate(classes) if k == c]
            width = max(len(self.counts[j]) for j in members)
            pooled = sum(np.pad(self.counts[j], (0, width - len(self.counts[j])))
                         for j in members)
            total += len(members) * entropy_bits(pooled)
        return total / len(classes)

    def plugin_bias(self) -> float:
        """Miller-Madow size of the plug-in entropy's downward bias, ``(K - 1) / (2 N ln 2)``
        bits, largest over the coordinates."""
        return max((np.count_nonzero(c) - 1) / (2.0 * c.sum() * math.log(2.0))
                   for c in self.counts)


def operating_point(name: str, head_dim: int, vectors: int, seed: int,
                    snr_db: float = SNR_DB, chunk: int = 8192) -> dict:
    """For one lattice and head dim: the stripped and raw Rice rates of ``vectors`` fresh
    Gaussian vectors at ``snr_db``, their scalar entropies, the lattice ideal and the
    calibration's rate there, and the cost of not stripping."""
    lat = lattice(name)
    elements = BLOCK_TOKENS * head_dim
    chunk = max(BLOCK_TOKENS, min(chunk, vectors) // BLOCK_TOKENS * BLOCK_TOKENS)
    vectors = max(chunk, vectors // chunk * chunk)
    alpha = alpha_for_snr(lat, snr_db)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 2), head_dim)
    stripped, raw_class, raw_one, sq_error = [], [], [], []
    hist, raw_hist = _Histograms(lat.dim), _Histograms(lat.dim)
    for i in range(vectors // chunk):
        s, rc, r1, sq, sym, raw = _block_measurements(name, head_dim, chunk,
                                                  jax.random.fold_in(key, i),
                                                  jnp.float32(alpha))
        stripped.append(np.asarray(s))
        raw_class.append(np.asarray(rc))
        raw_one.append(np.asarray(r1))
        sq_error.append(np.asarray(sq, np.float64))
        hist.add(np.asarray(sym))
        raw_hist.add(np.asarray(raw))
    stripped_bits = np.concatenate(stripped).astype(np.float64)
    raw_class_bits = np.concatenate(raw_class).astype(np.float64)
    raw_one_bits = np.concatenate(raw_one).astype(np.float64)
    blocks = len(stripped_bits)
    cal = calibration(name, head_dim, BLOCK_TOKENS, False)
    rice_rate = stripped_bits.mean() / elements
    entropy = hist.position_entropy()
    ideal = float(ideal_rate(lat.second_moment, snr_db))
    # the curve's local slope turns a rate gap into an SNR gap
    slope = float(np.interp(snr_db + 0.5, cal.snr_db, cal.rate)
                  - np.interp(snr_db - 0.5, cal.snr_db, cal.rate))
    cost = raw_class_bits - stripped_bits
    # the SNR convention alpha^2 / noise_power assumes the high-rate error power
    mse = np.concatenate(sq_error).sum() / (blocks * elements)
    return {
        "lattice": name, "head_dim": head_dim, "snr_db": snr_db, "alpha": alpha,
        "vectors": vectors, "blocks": blocks, "block_elements": elements,
        "mse_over_noise_power": mse / lat.noise_power,
        "snr_measured_db": 10.0 * math.log10(alpha * alpha / mse),
        "n_sub": substreams(elements, lat.dim)[0],
        "rice_calibration": float(np.interp(snr_db, cal.snr_db, cal.rate)),
        "rice_direct": rice_rate,
        "rice_direct_se": float(stripped_bits.std(ddof=1) / math.sqrt(blocks) / elements),
        "slope_bps_per_db": slope,
        "scalar_entropy": entropy,
        "class_entropy": hist.class_entropy(lat.symbol_class),
        "entropy_bias_bound": hist.plugin_bias(),
        "rd_rate": float(rd_rate(snr_db)), "ideal": ideal,
        "rice_minus_entropy": rice_rate - entropy, "entropy_minus_ideal": entropy - ideal,
        "rice_minus_ideal": rice_rate - ideal,
        "raw_rice": raw_class_bits.mean() / elements,
        "raw_rice_one_parameter": raw_one_bits.mean() / elements,
        "raw_scalar_entropy": raw_hist.position_entropy(),
        "strip_cost": cost.mean() / elements,
        "strip_cost_se": float(cost.std(ddof=1) / math.sqrt(blocks) / elements),
        "strip_cost_max_block_deviation": float(
            np.abs(cost - pinned_bits(lat) * elements).max()),
        "strip_cost_one_parameter": (raw_one_bits - stripped_bits).mean() / elements,
        "strip_entropy_cost": raw_hist.position_entropy() - entropy,
        "pinned_bits": pinned_bits(lat),
    }


def excess_over_ideal(name: str, head_dim: int, low: float = HIGH_RATE,
                      high: float = MAX_RATE) -> dict:
    """Calibrated Rice rate - ``R_ideal`` over calibrated rates ``low..high`` bps: its
    smallest and largest value and where they fall. The integer Rice parameter makes it
    ripple with the SNR, one period per parameter step (about 6 dB); below ~3 bps the
    high-rate ideal itself stops being a bound worth comparing to."""
    lat = lattice(name)
    cal = calibration(name, head_dim, BLOCK_TOKENS, False)
    keep = (cal.rate >= low) & (cal.rate <= high)
    snr = cal.snr_db[keep]
    excess = cal.rate[keep] - ideal_rate(lat.second_moment, snr)
    lo, hi = int(np.argmin(excess)), int(np.argmax(excess))
    return {"lattice": name, "head_dim": head_dim, "rates": [low, high],
            "min": float(excess[lo]), "min_snr_db": float(snr[lo]),
            "max": float(excess[hi]), "max_snr_db": float(snr[hi])}


# -- realized vs target rate ---------------------------------------------------------------


def target_rates(count: int) -> list[float]:
    """``count`` targets evenly over ``MIN_RATE..MAX_RATE`` (1.5..5 bps)."""
    if count == 1:
        return [3.0]
    return [round(float(t), 4) for t in np.linspace(MIN_RATE, MAX_RATE, count)]


def realized_rate(name: str, target: float, head_dim: int, vectors: int, seed: int,
                  dither: bool = False) -> dict:
    """Encode ``vectors`` fresh Gaussian vectors with ``HyperQuantCodec(name, target)``
    (jitted) and read the realized payload per element from the stored words."""
    codec = HyperQuantCodec(lattice=name, rate=target, dither=dither)
    plan = codec.plan(head_dim)
    vectors = max(BLOCK_TOKENS, vectors // BLOCK_TOKENS * BLOCK_TOKENS)
    base = jax.random.key(seed)
    x = jax.random.normal(jax.random.fold_in(base, 4), (vectors, head_dim), jnp.float32)
    params = codec.init(jax.random.fold_in(base, 5), head_dim)
    codes = jax.jit(codec.encode)(params, x)
    bits = np.asarray(codec.payload_bits(codes), np.float64)
    elements = BLOCK_TOKENS * head_dim
    realized = bits.sum() / (vectors * head_dim)
    se = float(bits.std(ddof=1) / math.sqrt(len(bits)) / elements) if len(bits) > 1 else 0.0
    # the table the target is read from has a sampling error of its own
    cal = calibration(name, head_dim, BLOCK_TOKENS, dither)
    cal_se = cal.std_at(plan.snr_db) / math.sqrt(CALIBRATION_VECTORS // BLOCK_TOKENS) / elements
    combined = math.hypot(se, cal_se)
    return {"lattice": name, "target": target, "dither": dither, "head_dim": head_dim,
            "vectors": vectors, "blocks": len(bits), "snr_db": plan.snr_db,
            "alpha": plan.alpha, "budget_bits": 32 * plan.words, "realized": realized,
            "error": realized - target, "se": se, "calibration_se": cal_se,
            "z": (realized - target) / combined if combined > 0 else 0.0,
            "fallback_blocks": codec.fallback_blocks(codes)}


def sweep_summary(rows: Sequence[dict]) -> list[dict]:
    """Per lattice (and dither): the largest ``|realized - target|``, the mean error, the
    largest error in standard errors (the fresh sample's and the calibration table's
    together), and the fallback blocks over the sweep."""
    out = []
    for name in LATTICE_ORDER:
        for dither in (False, True):
            sel = [r for r in rows if r["lattice"] == name and r["dither"] == dither]
            if not sel:
                continue
            errors = np.array([r["error"] for r in sel])
            z = np.array([r["z"] for r in sel])
            out.append({"lattice": name, "dither": dither, "targets": len(sel),
                        "max_abs_error": float(np.abs(errors).max()),
                        "mean_error": float(errors.mean()),
                        "max_abs_z": float(np.abs(z).max()),
                        "typical_se": float(np.median([math.hypot(r["se"], r["calibration_se"])
                                                       for r in sel])),
                        "fallback_blocks": int(sum(r["fallback_blocks"] for r in sel)),
                        "blocks": int(sum(r["blocks"] for r in sel))})
    return out
