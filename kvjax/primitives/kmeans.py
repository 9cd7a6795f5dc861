"""Fitting on calibration vectors: k-means codebooks and damped eigenbases, jit-compiled.

:func:`kmeans` is Lloyd's algorithm from k-means++ starting points drawn by a key, a
fixed number of iterations (a loop of known length, so the fit compiles once per shape),
and a cluster that loses every point keeps its centroid. :func:`nearest` assigns
vectors to centroids by squared distance. :func:`damped_eigenbasis` is the orthonormal
eigenvector basis of a second-moment matrix with its diagonal damped, the Hessian-aware
rotation of the SAW paper's ablation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

#: float32 matmuls: GPUs would otherwise use TF32, and distances decide assignments
EXACT = jax.lax.Precision.HIGHEST
#: Lloyd iterations of :func:`kmeans`
ITERATIONS = 25
#: :func:`damped_eigenbasis`' damping, a share of the mean diagonal
DAMPING = 0.01


def nearest(x: jax.Array, centroids: jax.Array) -> jax.Array:
    """``int32[...]``: the index of the centroid (``[C, D]``) nearest to each ``x[..., D]``
    (the first of equally near ones)."""
    x = x.astype(jnp.float32)
    # |x - c|^2 less |x|^2, which is the same for every centroid
    distance = (jnp.sum(centroids * centroids, axis=-1)
                - 2.0 * jnp.matmul(x, centroids.T, precision=EXACT))
    return jnp.argmin(distance, axis=-1).astype(jnp.int32)


def _seeding(key: jax.Array, x: jax.Array, clusters: int) -> jax.Array:
    """k-means++ starting centroids: each next one a data point drawn with probability
    proportional to its squared distance from the nearest one chosen so far (a start in
    every well-separated cluster, where uniform draws often put two in one)."""
    n = x.shape[0]
    first = jax.random.randint(jax.random.fold_in(key, 0), (), 0, n)
    chosen = jnp.zeros((clusters, x.shape[1]), x.dtype).at[0].set(x[first])
    gap = jnp.sum((x - x[first]) ** 2, axis=-1)

    def pick(i, state):
        chosen, gap = state
        # all points equal to chosen ones: any point, uniformly
        weights = jnp.where(jnp.sum(gap) > 0, gap, jnp.ones_like(gap))
        index = jax.random.categorical(jax.random.fold_in(key, i), jnp.log(weights))
        gap = jnp.minimum(gap, jnp.sum((x - x[index]) ** 2, axis=-1))
        return chosen.at[i].set(x[index]), gap

    return jax.lax.fori_loop(1, clusters, pick, (chosen, gap))[0]


@functools.partial(jax.jit, static_argnames=("clusters", "iterations"))
def kmeans(key: jax.Array, x: jax.Array, clusters: int,
           iterations: int = ITERATIONS) -> jax.Array:
    """``float32[clusters, D]`` k-means centroids of ``x[N, D]`` (``N >= clusters``).

    Lloyd's algorithm from k-means++ starting points chosen by ``key``; deterministic
    for a key. One cluster is the mean.
    """
    x = jnp.asarray(x, jnp.float32)
    n = x.shape[0]
    if n < clusters:
        raise ValueError(f"k-means of {n} vectors into {clusters} clusters")
    if clusters == 1:
        return jnp.mean(x, axis=0, keepdims=True)
    start = _seeding(key, x, clusters)

    def step(_, centroids):
        assign = jax.nn.one_hot(nearest(x, centroids), clusters, dtype=jnp.float32)
        counts = jnp.sum(assign, axis=0)
        sums = jnp.matmul(assign.T, x, precision=EXACT)
        return jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1.0)[:, None],
                         centroids)

    return jax.lax.fori_loop(0, iterations, step, start)


@functools.partial(jax.jit, static_argnames=("damping",))
def damped_eigenbasis(moment: jax.Array, damping: float = DAMPING) -> jax.Array:
    """``float32[D, D]`` orthonormal eigenvectors (columns, eigenvalues descending) of
    the second-moment matrix ``moment[D, D]`` (``sum x x^T``, any positive scale) plus
    ``damping`` times its mean diagonal on the diagonal. The damping leaves the
    eigenvectors as they are but keeps directions the data never spans (a rank-deficient
    moment) well defined."""
    moment = jnp.asarray(moment, jnp.float32)
    moment = moment / jnp.maximum(jnp.mean(jnp.diag(moment)), jnp.finfo(jnp.float32).tiny)
    _, vectors = jnp.linalg.eigh(moment + damping * jnp.eye(moment.shape[0]))
    return vectors[:, ::-1]


__all__ = ["DAMPING", "ITERATIONS", "damped_eigenbasis", "kmeans", "nearest"]
