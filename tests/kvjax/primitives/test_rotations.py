"""Tests for kvjax.primitives.rotations: exactness, invertibility, seeding, tracing, errors.

Inputs are numpy arrays and each D uses one input shape (identity rows stacked on random
rows), because every new shape costs an XLA compile and compiles dominate the run time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.primitives.rotations import (
    block_hadamard,
    haar_orthogonal,
    hadamard,
    inverse_randomized_hadamard,
    random_signs,
    randomized_hadamard,
)

DIMS = [1, 2, 4, 64, 128]
BLOCKS = [1, 2, 16, 64]
DIM_BLOCKS = [(d, b) for d in DIMS for b in BLOCKS if b <= d]
ROWS = 5


def sylvester(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def rand(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def probe(d: int, seed: int = 0) -> np.ndarray:
    """``[d + ROWS, d]``: identity rows, whose images form the transform's matrix, then
    random rows."""
    return np.concatenate([np.eye(d, dtype=np.float32), rand((ROWS, d), seed)])


def assert_orthogonal(m, atol=1e-5) -> None:
    m = np.asarray(m, dtype=np.float64)
    np.testing.assert_allclose(m @ m.T, np.eye(m.shape[0]), atol=atol)
    np.testing.assert_allclose(m.T @ m, np.eye(m.shape[0]), atol=atol)


def assert_norms_kept(x, y, rtol=1e-5) -> None:
    np.testing.assert_allclose(
        np.linalg.norm(np.asarray(y, np.float64), axis=-1),
        np.linalg.norm(np.asarray(x, np.float64), axis=-1),
        rtol=rtol,
    )


# --- hadamard -------------------------------------------------------------------------


@pytest.mark.parametrize("d", DIMS)
def test_hadamard_orthogonal_symmetric_self_inverse(d):
    x = probe(d)
    y = hadamard(x)
    assert y.dtype == jnp.float32 and y.shape == x.shape
    m = np.asarray(y[:d])
    assert_orthogonal(m)
    np.testing.assert_allclose(m, m.T, atol=1e-7)
    np.testing.assert_allclose(hadamard(y), x, atol=1e-5)
    assert_norms_kept(x, y)


def test_hadamard_matches_dense_sylvester():
    d = 16
    x = probe(d, seed=1)
    dense = sylvester(d) / np.sqrt(d)
    y = np.asarray(hadamard(x))
    np.testing.assert_allclose(y[:d], dense, atol=1e-6)
    np.testing.assert_allclose(y[d:], x[d:].astype(np.float64) @ dense.T, atol=1e-5)


def test_hadamard_casts_to_float32():
    x = np.arange(8, dtype=np.int32)
    y = hadamard(x)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, sylvester(8) @ np.arange(8) / np.sqrt(8), atol=1e-5)
    assert hadamard(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.float32


@pytest.mark.parametrize("d", [0, 3, 6, 96, 100])
def test_hadamard_bad_dim(d):
    with pytest.raises(ValueError, match=f"D={d}"):
        hadamard(np.zeros((2, d), np.float32))


def test_hadamard_scalar_rejected():
    with pytest.raises(ValueError, match="last axis"):
        hadamard(np.float32(1.0))


def test_hadamard_jit_and_vmap():
    x = rand((4, 6, 64), seed=2)
    eager = hadamard(x)
    np.testing.assert_allclose(jax.jit(hadamard)(x), eager, atol=1e-6)
    np.testing.assert_allclose(jax.vmap(hadamard, in_axes=1, out_axes=1)(x), eager, atol=1e-6)


# --- block_hadamard -------------------------------------------------------------------


@pytest.mark.parametrize(("d", "block"), DIM_BLOCKS)
def test_block_hadamard(d, block):
    x = probe(d, seed=3)
    y = block_hadamard(x, block)
    dense = np.kron(np.eye(d // block), sylvester(block) / np.sqrt(block))
    np.testing.assert_allclose(y[:d], dense, atol=1e-6)
    assert_orthogonal(y[:d])
    np.testing.assert_allclose(block_hadamard(y, block), x, atol=1e-5)
    assert_norms_kept(x, y)
    if block == d:
        np.testing.assert_allclose(y, hadamard(x), atol=1e-6)
    if block == 1:
        np.testing.assert_array_equal(y, x)


def test_block_hadamard_non_power_of_two_dim():
    z = rand((2, 96), seed=5)  # D = 96 is not a power of two but a multiple of 32
    y = np.asarray(block_hadamard(z, 32))
    dense = sylvester(32) / np.sqrt(32)
    for i in range(0, 96, 32):
        np.testing.assert_allclose(y[:, i : i + 32], z[:, i : i + 32] @ dense.T, atol=1e-5)


@pytest.mark.parametrize(("d", "block"), [(64, 3), (64, 0), (64, 128), (96, 64), (64, 48)])
def test_block_hadamard_bad_block(d, block):
    with pytest.raises(ValueError, match="block"):
        block_hadamard(np.zeros((2, d), np.float32), block)


# --- randomized Hadamard --------------------------------------------------------------


@pytest.mark.parametrize(("d", "block"), [(d, None) for d in DIMS] + DIM_BLOCKS)
def test_randomized_hadamard_round_trip(d, block):
    signs = random_signs(jax.random.key(7), d)
    x = probe(d, seed=8)
    y = randomized_hadamard(x, signs, block)
    assert y.dtype == jnp.float32 and y.shape == x.shape
    assert_orthogonal(y[:d])
    assert_norms_kept(x, y)
    np.testing.assert_allclose(inverse_randomized_hadamard(y, signs, block), x, atol=1e-5)


def test_randomized_hadamard_definition():
    d = 16
    signs = random_signs(jax.random.key(0), d)
    x = probe(d, seed=1)
    s = np.asarray(signs, np.float64)
    dense = sylvester(d) / np.sqrt(d)
    # H(x * s) for row vectors x: x @ diag(s) @ H (H is symmetric).
    np.testing.assert_allclose(randomized_hadamard(x, signs), x @ np.diag(s) @ dense, atol=1e-5)
    np.testing.assert_allclose(inverse_randomized_hadamard(x, signs), x @ dense * s, atol=1e-5)


def test_randomized_hadamard_bad_signs_and_block():
    with pytest.raises(ValueError, match="signs"):
        randomized_hadamard(np.zeros((2, 64), np.float32), np.ones(32, np.float32))
    with pytest.raises(ValueError, match="D=48"):
        randomized_hadamard(np.zeros((2, 48), np.float32), np.ones(48, np.float32))
    with pytest.raises(ValueError, match="block"):
        inverse_randomized_hadamard(np.zeros((2, 64), np.float32), np.ones(64), block=5)


def test_randomized_hadamard_jit_and_vmap_over_keys():
    d, batch = 128, 3
    keys = jax.random.split(jax.random.key(11), batch)
    signs = jax.vmap(random_signs, in_axes=(0, None))(keys, d)
    assert signs.shape == (batch, d)
    np.testing.assert_array_equal(signs[1], random_signs(keys[1], d))
    x = rand((batch, 4, d), seed=12)

    @jax.jit
    def round_trip(x, signs):
        fwd = jax.vmap(randomized_hadamard, in_axes=(0, 0, None))(x, signs, 16)
        return fwd, jax.vmap(inverse_randomized_hadamard, in_axes=(0, 0, None))(fwd, signs, 16)

    y, back = round_trip(x, signs)
    np.testing.assert_allclose(back, x, atol=1e-5)
    s = np.asarray(signs, np.float64)
    dense = np.kron(np.eye(d // 16), sylvester(16) / 4.0)
    for i in range(batch):
        np.testing.assert_allclose(y[i], (x[i] * s[i]) @ dense, atol=1e-5)


# --- random_signs ---------------------------------------------------------------------


def test_random_signs_values_and_determinism():
    s = random_signs(jax.random.key(3), 4096)
    assert s.dtype == jnp.float32 and s.shape == (4096,)
    assert set(np.unique(np.asarray(s)).tolist()) == {-1.0, 1.0}
    assert abs(float(np.mean(s))) < 0.1  # 4096 fair signs: sd of the mean ~ 0.016
    np.testing.assert_array_equal(s, random_signs(jax.random.key(3), 4096))
    assert not np.array_equal(s, random_signs(jax.random.key(4), 4096))
    # The legacy uint32 key format works too.
    legacy = random_signs(jax.random.PRNGKey(3), 4096)
    np.testing.assert_array_equal(legacy, random_signs(jax.random.PRNGKey(3), 4096))


@pytest.mark.parametrize("d", [0, -1, 2.0])
def test_random_signs_bad_length(d):
    with pytest.raises(ValueError):
        random_signs(jax.random.key(0), d)


# --- haar_orthogonal ------------------------------------------------------------------


@pytest.mark.parametrize("d", DIMS)
def test_haar_orthogonal_is_orthogonal_and_invertible(d):
    q = haar_orthogonal(jax.random.key(d), d)
    assert q.shape == (d, d) and q.dtype == jnp.float32
    assert_orthogonal(q)
    qd = np.asarray(q, np.float64)
    x = rand((9, d), seed=13).astype(np.float64)
    assert_norms_kept(x, x @ qd, rtol=1e-5)
    np.testing.assert_allclose(x @ qd @ qd.T, x, atol=1e-5)


def test_haar_orthogonal_determinism_and_jit():
    q = haar_orthogonal(jax.random.key(5), 32)
    np.testing.assert_array_equal(q, haar_orthogonal(jax.random.key(5), 32))
    assert not np.allclose(q, haar_orthogonal(jax.random.key(6), 32))
    jitted = jax.jit(haar_orthogonal, static_argnums=1)(jax.random.key(5), 32)
    np.testing.assert_allclose(jitted, q, atol=1e-5)


def test_haar_orthogonal_distribution():
    # Over 4000 keys (deterministic, so no flakiness): Haar entries are symmetric with
    # E[Q_ij^2] = 1/d, and the trace has mean 0 and E[tr(Q)^2] = 1. QR without the sign
    # correction fails the symmetry checks (Householder QR gives Q[0, 0] <= 0 always).
    d, n = 8, 4000
    keys = jax.random.split(jax.random.key(2024), n)
    qs = np.asarray(jax.vmap(haar_orthogonal, in_axes=(0, None))(keys, d), np.float64)
    sd_sq = np.sqrt(2.0 / n) / d  # sd of a mean of n values of Q_ij^2 (~ Beta(1/2, 7/2))
    assert abs(np.mean(qs[:, 0, 0] ** 2) - 1.0 / d) < 5 * sd_sq
    np.testing.assert_allclose(np.mean(qs**2, axis=0), 1.0 / d, atol=6 * sd_sq)
    assert np.abs(np.mean(qs, axis=0)).max() < 6 / np.sqrt(n * d)
    assert abs(np.mean(qs[:, 0, 0] > 0) - 0.5) < 0.05
    tr = np.trace(qs, axis1=1, axis2=2)
    assert abs(tr.mean()) < 5 / np.sqrt(n)
    assert abs(np.mean(tr**2) - 1.0) < 0.15


@pytest.mark.parametrize("d", [0, -3, 4.0])
def test_haar_orthogonal_bad_size(d):
    with pytest.raises(ValueError):
        haar_orthogonal(jax.random.key(0), d)
