"""k-means and damped eigenbases: what calibrated codecs are fitted with."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.primitives.kmeans import damped_eigenbasis, kmeans, nearest


def test_nearest_is_the_brute_force_argmin():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 50, 8)).astype(np.float32)
    c = rng.standard_normal((7, 8)).astype(np.float32)
    brute = np.argmin(((x[..., None, :] - c) ** 2).sum(-1), axis=-1)
    np.testing.assert_array_equal(nearest(jnp.asarray(x), jnp.asarray(c)), brute)


def test_kmeans_finds_separated_clusters_and_is_seeded():
    rng = np.random.default_rng(1)
    centers = rng.standard_normal((4, 5)).astype(np.float32) * 20
    x = np.concatenate([c + rng.standard_normal((60, 5)).astype(np.float32) * 0.1
                        for c in centers])
    found = np.asarray(kmeans(jax.random.PRNGKey(0), x, 4))
    # every true center has a centroid at the mean of its points
    for c, part in zip(centers, np.split(x, 4), strict=True):
        distance = np.linalg.norm(found - part.mean(0), axis=1)
        assert distance.min() < 1e-3, (c, found)
    again = np.asarray(kmeans(jax.random.PRNGKey(0), x, 4))
    np.testing.assert_array_equal(found, again)


def test_one_cluster_is_the_mean_and_too_few_points_are_refused():
    x = jnp.arange(12.0).reshape(4, 3)
    np.testing.assert_allclose(kmeans(jax.random.PRNGKey(0), x, 1), [[4.5, 5.5, 6.5]])
    with pytest.raises(ValueError, match="4 vectors into 5 clusters"):
        kmeans(jax.random.PRNGKey(0), x, 5)


def test_a_cluster_that_loses_its_points_keeps_its_centroid():
    """Duplicated points: two starting centroids can coincide and one then gets none."""
    x = jnp.asarray([[0.0, 0.0]] * 6 + [[5.0, 5.0]] * 2)
    found = np.asarray(kmeans(jax.random.PRNGKey(3), x, 3))
    assert np.isfinite(found).all()
    assert {tuple(r) for r in found.round(6)} <= {(0.0, 0.0), (5.0, 5.0)}


def test_damped_eigenbasis_is_orthonormal_and_diagonalizes_the_moment():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((200, 6)) * np.array([5, 1, 3, 0.1, 2, 0.5])
    moment = x.T @ x
    basis = np.asarray(damped_eigenbasis(jnp.asarray(moment, jnp.float32)))
    np.testing.assert_allclose(basis.T @ basis, np.eye(6), atol=1e-5)
    diagonal = basis.T @ moment @ basis
    np.testing.assert_allclose(diagonal - np.diag(np.diag(diagonal)), 0,
                               atol=1e-3 * np.abs(diagonal).max())
    assert np.all(np.diff(np.diag(diagonal)) <= 1e-3 * diagonal[0, 0])  # descending


def test_a_rank_deficient_moment_still_gives_an_orthonormal_basis():
    x = np.zeros((10, 4), np.float32)
    x[:, 0] = np.arange(10)
    basis = np.asarray(damped_eigenbasis(jnp.asarray(x.T @ x)))
    np.testing.assert_allclose(basis.T @ basis, np.eye(4), atol=1e-5)
    np.testing.assert_allclose(np.abs(basis[:, 0]), [1, 0, 0, 0], atol=1e-6)
    assert np.isfinite(np.asarray(damped_eigenbasis(jnp.zeros((4, 4))))).all()
