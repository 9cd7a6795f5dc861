"""kvjax.primitives.lloyd: Lloyd-Max designs against closed forms, densities, caching, errors."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.primitives import lloyd
from kvjax.primitives.lloyd import (
    Density,
    LloydMaxQuantizer,
    beta,
    clear_cache,
    dequantize,
    gaussian,
    lloyd_max,
    quantize,
    sphere_coordinate,
    uniform,
)


def design(density: Density, bits: int, **kw) -> LloydMaxQuantizer:
    """lloyd_max plus the invariants every design must satisfy."""
    q = lloyd_max(density, bits, **kw)
    n = 2**bits
    assert q.converged
    assert q.centroids.shape == (n,) and q.thresholds.shape == (n - 1,)
    assert np.all(np.isfinite(q.centroids)) and np.all(np.diff(q.centroids) > 0)
    np.testing.assert_array_equal(q.thresholds, 0.5 * (q.centroids[:-1] + q.centroids[1:]))
    assert density.lo <= q.centroids[0] and q.centroids[-1] <= density.hi
    assert q.mse > 0 and q.bits == bits
    return q


# --- exact Lloyd references from closed-form cell integrals ---------------------------

_erfc = np.vectorize(math.erfc)


def _gaussian_cells(thr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.concatenate(([-np.inf], thr))
    b = np.concatenate((thr, [np.inf]))

    def upper(x):  # P(X > x), accurate in the right tail
        return 0.5 * _erfc(x / math.sqrt(2.0))

    p = np.where(a >= 0, upper(a) - upper(b), upper(-b) - upper(-a))
    pdf = lambda x: np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return p, pdf(a) - pdf(b)


def _arcsine_cells(thr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # x = sin(theta) makes the arcsine law uniform in theta on [-pi/2, pi/2].
    th = np.concatenate(([-math.pi / 2], np.arcsin(thr), [math.pi / 2]))
    return np.diff(th) / math.pi, -np.diff(np.cos(th)) / math.pi


def reference_lloyd(cells, init: np.ndarray, iters: int = 20000) -> np.ndarray:
    c = init.astype(np.float64)
    for _ in range(iters):
        p, m = cells(0.5 * (c[:-1] + c[1:]))
        new = m / p
        if np.max(np.abs(new - c)) < 1e-15:
            return new
        c = new
    raise AssertionError("reference Lloyd did not converge")


# --- closed forms ---------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_uniform_unit_interval(bits):
    n = 2**bits
    q = design(uniform(0.0, 1.0), bits)
    np.testing.assert_allclose(q.centroids, (2 * np.arange(n) + 1) / (2 * n), atol=1e-6)
    np.testing.assert_allclose(q.thresholds, np.arange(1, n) / n, atol=1e-6)
    np.testing.assert_allclose(q.mse, 1.0 / (12 * n * n), rtol=1e-6)


def test_uniform_other_interval():
    q = design(uniform(-3.0, 5.0), 3)
    np.testing.assert_allclose(q.centroids, -3.0 + 8.0 * (2 * np.arange(8) + 1) / 16, atol=1e-6)
    np.testing.assert_allclose(q.mse, 64.0 / (12 * 64), rtol=1e-6)


def test_gaussian_one_bit():
    q = design(gaussian(), 1)
    np.testing.assert_allclose(
        q.centroids, [-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)], atol=1e-6
    )
    np.testing.assert_allclose(q.thresholds, [0.0], atol=1e-12)
    np.testing.assert_allclose(q.mse, 1 - 2 / math.pi, atol=1e-6)


def test_gaussian_two_bit_known_optimum():
    q = design(gaussian(), 2)
    np.testing.assert_allclose(q.centroids, [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-3)
    np.testing.assert_allclose(q.mse, 0.1175, atol=1e-3)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gaussian_matches_exact_reference(bits):
    q = design(gaussian(), bits)
    ref = reference_lloyd(_gaussian_cells, np.asarray(q.centroids) * 1.01)
    np.testing.assert_allclose(q.centroids, ref, atol=1e-7)


def test_gaussian_three_bit_mse_and_monte_carlo():
    q = design(gaussian(), 3)
    np.testing.assert_allclose(q.mse, 0.03454, atol=1e-4)  # Max (1960)
    x = np.random.default_rng(0).standard_normal(200_000)
    idx = np.searchsorted(q.thresholds, x)
    emp = np.mean((x - q.centroids[idx]) ** 2)
    assert abs(emp - q.mse) < 0.02 * q.mse  # sd of the estimate is ~0.3%


def test_gaussian_scales_with_sigma():
    q1, q2 = design(gaussian(1.0), 2), design(gaussian(2.5), 2)
    np.testing.assert_allclose(q2.centroids, 2.5 * q1.centroids, rtol=1e-8)
    np.testing.assert_allclose(q2.mse, 2.5**2 * q1.mse, rtol=1e-8)


@pytest.mark.parametrize("bits", [8, 12])
def test_many_levels_converge_fast(bits):
    # Plain Lloyd needs thousands of steps here (12 bits: not within 10000).
    q = design(gaussian(), bits)
    assert q.iterations <= 20
    # Panter-Dite high-resolution MSE: (sqrt(3) pi / 2) 4^-bits.
    np.testing.assert_allclose(q.mse, math.sqrt(3) * math.pi / 2 * 4.0**-bits, rtol=0.02)
    np.testing.assert_allclose(q.centroids, -q.centroids[::-1], atol=1e-9)


def test_gaussian_twelve_bits_matches_exact_fixed_point():
    # The exact Lloyd map's residual at the design is at the level of the integration error.
    q = design(gaussian(), 12)
    p, m = _gaussian_cells(q.thresholds)
    assert np.max(np.abs(m / p - q.centroids)) < 1e-7


def test_not_converged_is_reported():
    q = lloyd_max(gaussian(), 8, max_iter=1, tol=1e-300)
    assert not q.converged and q.iterations == 1
    assert np.all(np.diff(q.centroids) > 0)


# --- sphere coordinate ----------------------------------------------------------------


def _sphere_abs_mean(dim: int) -> float:
    # E|x_1| for x uniform on S^(dim-1): Gamma(dim/2) / (sqrt(pi) Gamma((dim+1)/2)).
    return math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)


@pytest.mark.parametrize("dim", [3, 16, 128])
def test_sphere_density_normalized_with_variance_one_over_dim(dim):
    d = sphere_coordinate(dim)
    x = np.linspace(-1.0, 1.0, 400_001)
    f = d.pdf(x)
    assert np.all(np.isfinite(f)) and np.all(f >= 0)
    np.testing.assert_allclose(np.trapezoid(f, x), 1.0, atol=1e-8)
    np.testing.assert_allclose(np.trapezoid(x * f, x), 0.0, atol=1e-12)
    np.testing.assert_allclose(np.trapezoid(x * x * f, x), 1.0 / dim, rtol=1e-7)


def test_sphere_density_dim2_singular_but_normalized():
    d = sphere_coordinate(2)
    assert np.isinf(d.pdf(np.array([1.0]))[0])
    t = np.linspace(-math.pi / 2, math.pi / 2, 200_001)  # x = sin(t), dx = cos(t) dt
    w = d.pdf(np.sin(t[1:-1])) * np.cos(t[1:-1])
    # rtol: sin(t) is rounded to 1e-16 absolute, and near t = pi/2 that is ~1e-6 of 1 - x.
    np.testing.assert_allclose(w, 1 / math.pi, rtol=1e-5)
    assert d.pdf(np.array([-1.5, 1.5])).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("dim", [3, 16, 128])
def test_sphere_density_matches_monte_carlo(dim):
    n = 40_000
    g = np.random.default_rng(dim).standard_normal((n, dim))
    x0 = g[:, 0] / np.linalg.norm(g, axis=1)
    half = min(1.0, 4.0 / math.sqrt(dim))
    edges = np.linspace(-half, half, 41)
    counts, _ = np.histogram(x0, bins=edges)
    d = sphere_coordinate(dim)
    fine = np.linspace(-half, half, 40 * 2000 + 1)
    cdf = np.concatenate(
        ([0.0], np.cumsum(0.5 * (d.pdf(fine[1:]) + d.pdf(fine[:-1])) * np.diff(fine)))
    )
    expected = n * np.diff(cdf[::2000])
    assert np.all(np.abs(counts - expected) <= 5 * np.sqrt(expected) + 5)
    # Kolmogorov-Smirnov distance on the histogram grid (1% critical value ~1.63 / sqrt(n)).
    below = np.mean(x0 < -half)
    emp_cdf = below + np.cumsum(counts) / n
    model_cdf = cdf[::2000][1:] + (1.0 - cdf[-1]) / 2
    assert np.max(np.abs(emp_cdf - model_cdf)) < 1.63 / math.sqrt(n)


@pytest.mark.parametrize("dim", [2, 3, 16, 128, 1024])
def test_sphere_one_bit_centroid_is_mean_abs(dim):
    q = design(sphere_coordinate(dim), 1)
    m = _sphere_abs_mean(dim)
    np.testing.assert_allclose(q.centroids, [-m, m], rtol=1e-7)
    np.testing.assert_allclose(q.mse, 1.0 / dim - m * m, rtol=1e-6)


def test_sphere_dim2_matches_exact_arcsine_reference():
    q = design(sphere_coordinate(2), 3)
    ref = reference_lloyd(_arcsine_cells, np.asarray(q.centroids) * 0.99)
    np.testing.assert_allclose(q.centroids, ref, atol=1e-8)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_sphere_dim3_is_uniform(bits):
    np.testing.assert_allclose(
        design(sphere_coordinate(3), bits).centroids,
        design(uniform(-1.0, 1.0), bits).centroids,
        atol=1e-9,
    )


def test_sphere_high_bits_on_large_dim():
    q = design(sphere_coordinate(4096), 12)
    assert q.iterations <= 20
    # Close to a Gaussian of variance 1/dim, with the Panter-Dite MSE.
    np.testing.assert_allclose(q.mse, math.sqrt(3) * math.pi / 2 * 4.0**-12 / 4096, rtol=0.03)


# --- beta ------------------------------------------------------------------------------


def test_beta_special_cases():
    np.testing.assert_allclose(
        design(beta(1.0, 1.0), 3).centroids, design(uniform(), 3).centroids, atol=1e-9
    )
    np.testing.assert_allclose(
        design(beta(0.5, 0.5, -1.0, 1.0), 3).centroids,
        design(sphere_coordinate(2), 3).centroids,
        atol=1e-8,
    )
    np.testing.assert_allclose(
        design(beta(7.5, 7.5, -1.0, 1.0), 2).centroids,
        design(sphere_coordinate(16), 2).centroids,
        atol=1e-9,
    )


def test_beta_asymmetric_one_bit():
    # f(u) = 2u: c1 = 2t/3, c2 = 2(1 + t + t^2) / (3 (1 + t)) and t = (c1 + c2) / 2.
    t = 0.5
    for _ in range(200):
        t = 0.5 * (2 * t / 3 + 2 * (1 + t + t * t) / (3 * (1 + t)))
    q = design(beta(2.0, 1.0), 1)
    np.testing.assert_allclose(q.thresholds, [t], atol=1e-8)
    np.testing.assert_allclose(
        q.centroids, [2 * t / 3, 2 * (1 + t + t * t) / (3 * (1 + t))], atol=1e-8
    )


@pytest.mark.parametrize(("a", "b"), [(0.3, 2.0), (0.05, 0.7), (3.0, 0.2)])
def test_beta_small_parameters(a, b):
    d = beta(a, b, -2.0, 3.0)
    for bits in (2, 6):
        q = design(d, bits)
        assert -2.0 < q.centroids[0] and q.centroids[-1] < 3.0


def test_beta_pdf_normalized():
    d = beta(2.0, 3.0, -1.0, 3.0)
    x = np.linspace(-1.0, 3.0, 100_001)
    np.testing.assert_allclose(np.trapezoid(d.pdf(x), x), 1.0, atol=1e-8)


# --- symmetry -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "density",
    [
        gaussian(),
        uniform(-1.0, 1.0),
        sphere_coordinate(2),
        sphere_coordinate(16),
        beta(2.0, 2.0, -1.0, 1.0),
    ],
    ids=lambda d: f"{d.name}{d.params}",
)
@pytest.mark.parametrize("bits", [1, 3, 8])
def test_symmetric_density_gives_symmetric_codebook(density, bits):
    q = design(density, bits)
    np.testing.assert_allclose(q.centroids, -q.centroids[::-1], atol=1e-9)


# --- custom densities ------------------------------------------------------------------


def _laplace(x):
    return np.exp(-np.abs(x))


def test_custom_density_laplace():
    d = Density.custom("test-laplace", _laplace, -40.0, 40.0)
    assert Density.custom("test-laplace", _laplace, -40.0, 40.0) == d  # same callable: fine
    q1 = design(d, 1)
    np.testing.assert_allclose(q1.centroids, [-1.0, 1.0], atol=1e-6)  # E|X| = 1
    q2 = design(d, 2)
    # Memoryless tail: the outer centroid sits one unit beyond its threshold.
    np.testing.assert_allclose(q2.centroids[-1], q2.thresholds[-1] + 1.0, atol=1e-6)


def test_custom_density_matches_builtin_and_scalar_pdf():
    d = Density.custom("test-flat", lambda x: 3.0, 0.0, 1.0)  # unnormalized, scalar
    np.testing.assert_allclose(design(d, 3).centroids, design(uniform(), 3).centroids, atol=1e-9)


def test_custom_density_reregistration():
    d = Density.custom("test-rereg", lambda x: np.ones_like(x), 0.0, 1.0)
    q = design(d, 1)
    with pytest.raises(ValueError, match="already registered"):
        Density.custom("test-rereg", lambda x: x, 0.0, 1.0)
    d2 = Density.custom("test-rereg", lambda x: x, 0.0, 1.0, overwrite=True)
    assert d2 == d  # same name, so the cache had to be cleared
    q2 = design(d2, 1)
    assert q2 is not q
    np.testing.assert_allclose(q2.centroids, design(beta(2.0, 1.0), 1).centroids, atol=1e-7)


def test_empty_cell_keeps_centroid():
    # Density zero on (1, 2): centroids 1.2, 1.4, 1.6 leave the cell [1.3, 1.5] empty.
    d = Density.custom("test-gap", lambda x: ((x <= 1) | (x >= 2)).astype(float), 0.0, 3.0)
    tab = lloyd._CellIntegrals(d, 3 * 2**10)
    c = np.array([0.5, 1.2, 1.4, 1.6, 2.5]) - tab.centre
    new, p = lloyd._lloyd_step(tab, c)
    assert p[2] == 0.0 and new[2] == c[2]
    assert np.all(np.isfinite(new)) and np.all(np.diff(new) >= 0)
    q = design(d, 3)
    np.testing.assert_allclose(q.mse, 1.0 / (12 * 16), rtol=1e-3)


# --- caching ------------------------------------------------------------------------------


def test_cache_returns_same_object():
    q = lloyd_max(gaussian(), 3)
    assert lloyd_max(gaussian(), 3) is q
    assert lloyd_max(gaussian(1), 3) is q  # equal density, built again
    assert lloyd_max(gaussian(), np.int64(3)) is q
    assert lloyd_max(gaussian(), 3, tol=1e-9) is not q
    clear_cache()
    q_again = lloyd_max(gaussian(), 3)
    assert q_again is not q
    np.testing.assert_array_equal(q_again.centroids, q.centroids)


def test_cached_arrays_are_read_only():
    q = lloyd_max(uniform(), 2)
    with pytest.raises(ValueError):
        q.centroids[0] = 5.0
    with pytest.raises(ValueError):
        q.thresholds[0] = 5.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.mse = 0.0


def test_density_value_semantics():
    assert gaussian(1) == gaussian(1.0) and hash(gaussian(1)) == hash(gaussian(1.0))
    assert sphere_coordinate(16) != sphere_coordinate(17)
    assert len({uniform(), uniform(0, 1), beta(1, 1)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        gaussian().lo = 0.0


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [13, -1, 2.0, True, "3", None])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        lloyd_max(uniform(), bits)


def test_bad_arguments():
    with pytest.raises(ValueError):
        lloyd_max(uniform(), 2, tol=0.0)
    with pytest.raises(ValueError):
        lloyd_max(uniform(), 2, grid=1)
    with pytest.raises(ValueError):
        lloyd_max(uniform(), 2, max_iter=0)
    with pytest.raises(ValueError):
        lloyd_max("uniform", 2)


def test_bad_densities():
    for make in (
        lambda: sphere_coordinate(1),
        lambda: sphere_coordinate(3.0),
        lambda: gaussian(0.0),
        lambda: gaussian(-1.0),
        lambda: beta(0.0, 1.0),
        lambda: uniform(1.0, 0.0),
        lambda: uniform(0.0, math.inf),
        lambda: Density("cauchy", (), -1.0, 1.0),
    ):
        with pytest.raises(ValueError):
            make()
    neg = Density.custom("test-negative", lambda x: x, -1.0, 1.0)
    with pytest.raises(ValueError, match="negative"):
        lloyd_max(neg, 2)
    zero = Density.custom("test-zero", np.zeros_like, 0.0, 1.0)
    with pytest.raises(ValueError, match="zero mass"):
        lloyd_max(zero, 2)


# --- quantize / dequantize -------------------------------------------------------------


@pytest.mark.parametrize(
    ("density", "bits"), [(gaussian(), 3), (sphere_coordinate(128), 4), (uniform(), 9)]
)
def test_quantize_round_trip(density, bits):
    q = design(density, bits)
    n = 2**bits
    idx = quantize(q.centroids, q)
    assert idx.dtype == (jnp.uint8 if bits <= 8 else jnp.int32)
    np.testing.assert_array_equal(idx, np.arange(n))
    values = dequantize(idx, q)
    assert values.dtype == jnp.float32
    np.testing.assert_array_equal(values, q.centroids.astype(np.float32))


def test_quantize_is_nearest_centroid_and_jits():
    q = design(gaussian(), 3)
    x = np.random.default_rng(1).standard_normal((4, 257)).astype(np.float32) * 1.5
    idx = jax.jit(lambda v: quantize(v, q))(x)
    assert idx.shape == x.shape
    nearest = np.argmin(np.abs(x[..., None] - q.centroids.astype(np.float32)), axis=-1)
    np.testing.assert_array_equal(idx, nearest)
    out = jax.jit(lambda i: dequantize(i, q))(idx)
    np.testing.assert_array_equal(out, q.centroids.astype(np.float32)[nearest])
    # Outside the support: clamped to the end cells.
    np.testing.assert_array_equal(quantize(np.array([-1e6, 1e6], np.float32), q), [0, 7])


@pytest.mark.parametrize("bits", [1, 4, 9])
def test_quantize_counts_the_thresholds_below(bits):
    """The cell is the number of thresholds strictly below the value (numpy's left
    search), at the thresholds themselves and past either end too, and the program holds
    no loop."""
    q = design(sphere_coordinate(128), bits)
    thr = q.thresholds.astype(np.float32)
    x = np.concatenate([thr, np.nextafter(thr, np.float32(np.inf)),
                        np.random.default_rng(2).normal(0, 0.2, 999).astype(np.float32),
                        np.array([-np.inf, np.inf, -3.0, 3.0], np.float32)])
    np.testing.assert_array_equal(quantize(x, q), np.searchsorted(thr, x, side="left"))
    assert "while" not in jax.jit(lambda v: quantize(v, q)).lower(x).as_text()
