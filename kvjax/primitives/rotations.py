"""Seeded, exactly invertible rotations of the last axis of ``x[..., D]``.

Rotating key/value vectors before scalar quantization spreads outlier channels over all
coordinates, so that every coordinate follows (nearly) the same known marginal and one
codebook fits them all. Two families:

* **Randomized Hadamard** ``H(x * s)``: a fixed orthonormal Walsh-Hadamard transform
  ``H`` after a seeded vector of random signs ``s``. Costs ``O(D log D)`` and stores only
  ``D`` signs. ``H`` is symmetric and orthogonal, hence self-inverse, so the inverse is
  ``s * H(y)``. :func:`block_hadamard` restricts the mixing to independent blocks
  (block-diagonal ``H``) for dims that are not a power of two or for kernels that rotate
  one tile at a time.
* **Haar-random orthogonal** ``Q`` (:func:`haar_orthogonal`): the exactly uniform random
  rotation, a dense ``D x D`` matrix applied as ``x @ Q`` and undone as ``x @ Q.T``.

All functions are pure and trace under ``jax.jit`` and ``jax.vmap``; sizes (``D``,
``block``, ``d``) must be static Python ints. Transforms compute in float32 whatever the
input dtype, because bf16 butterflies lose the exact invertibility the codecs rely on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = [
    "block_hadamard",
    "haar_orthogonal",
    "hadamard",
    "inverse_randomized_hadamard",
    "random_signs",
    "randomized_hadamard",
]


def _is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


def _last_dim(x: jax.Array, fn: str) -> int:
    if x.ndim == 0:
        raise ValueError(f"{fn} needs an array with a last axis, got a scalar")
    return x.shape[-1]


def hadamard(x: jax.Array) -> jax.Array:
    """Orthonormal Walsh-Hadamard transform of the last axis of ``x[..., D]``.

    Applies ``H_D / sqrt(D)``, where ``H_D`` is the Sylvester Hadamard matrix
    (``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``), in ``log2(D)`` butterfly stages
    without forming the matrix. The transform is symmetric and orthogonal, so applying it
    twice returns the input (up to float32 rounding).

    Args:
      x: array ``[..., D]`` of any real dtype; ``D`` must be a power of two.

    Returns:
      float32 array of the same shape.

    Raises:
      ValueError: if ``D`` is not a power of two.
    """
    y = jnp.asarray(x, jnp.float32)
    _check_power_of_two_dim(y, "hadamard")
    return _rotate(y, None)


def _check_power_of_two_dim(x: jax.Array, fn: str) -> None:
    d = _last_dim(x, fn)
    if not _is_power_of_two(d):
        raise ValueError(f"{fn} needs the last dimension D to be a power of two, got D={d}")


def _fwht_stages(y: jax.Array) -> jax.Array:
    d = y.shape[-1]
    lead = y.shape[:-1]
    h = 1
    while h < d:
        # Stage h pairs entries i and i + h inside every run of 2h entries; viewing the axis
        # as [D / 2h, 2, h] makes the pair partner a separate axis of size 2, so each stage
        # is one add, one subtract and reshapes that XLA fuses.
        y = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        h *= 2
    # One scale at the end instead of 1/sqrt(2) per stage: fewer roundings.
    return y * jnp.float32(1.0 / (d**0.5))


# The public functions validate in Python and then call these jitted kernels, so that an
# eager call compiles one fused kernel per shape instead of dispatching (and compiling)
# every butterfly primitive separately; inside an outer jit they simply inline.
@functools.partial(jax.jit, static_argnames="block")
def _rotate(x: jax.Array, block: int | None) -> jax.Array:
    if block is None:
        return _fwht_stages(x)
    lead, d = x.shape[:-1], x.shape[-1]
    return _fwht_stages(x.reshape(*lead, d // block, block)).reshape(*lead, d)


def random_signs(key: jax.Array, d: int) -> jax.Array:
    """Seeded vector of ``d`` independent, equally likely signs ``+1.0`` / ``-1.0``.

    Args:
      key: a JAX PRNG key (``jax.random.key`` or the legacy ``PRNGKey``).
      d: length, a positive int.

    Returns:
      float32 array ``[d]``. The same key always gives the same signs.
    """
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ValueError(f"random_signs needs a positive int length, got d={d!r}")
    return jax.random.rademacher(key, (d,), dtype=jnp.float32)


def block_hadamard(x: jax.Array, block: int) -> jax.Array:
    """Block-diagonal orthonormal Hadamard transform of the last axis of ``x[..., D]``.

    Each consecutive run of ``block`` entries is transformed by :func:`hadamard`
    independently; ``D`` itself need not be a power of two. ``block == D`` is the full
    transform and ``block == 1`` the identity (cast to float32). Self-inverse.

    Args:
      x: array ``[..., D]``.
      block: block size, a power of two dividing ``D``.

    Returns:
      float32 array of the same shape.

    Raises:
      ValueError: if ``block`` is not a power of two or does not divide ``D``.
    """
    x = jnp.asarray(x, jnp.float32)
    _check_block(x, block, "block_hadamard")
    return _rotate(x, block)


def _check_block(x: jax.Array, block: int | None, fn: str) -> None:
    if block is None:
        _check_power_of_two_dim(x, fn)
        return
    d = _last_dim(x, fn)
    if not _is_power_of_two(block):
        raise ValueError(f"{fn} needs a power-of-two block size, got block={block!r}")
    if d % block != 0:
        raise ValueError(f"{fn} block size {block} must divide the last dimension, got D={d}")


def _check_signs(x: jax.Array, signs: jax.Array, fn: str) -> None:
    d = _last_dim(x, fn)
    if jnp.ndim(signs) == 0 or jnp.shape(signs)[-1] != d:
        raise ValueError(
            f"{fn} needs signs with last dimension D={d}, got shape {jnp.shape(signs)}"
        )


def randomized_hadamard(x: jax.Array, signs: jax.Array, block: int | None = None) -> jax.Array:
    """Randomized Hadamard rotation ``H(x * signs)`` of the last axis of ``x[..., D]``.

    Args:
      x: array ``[..., D]``.
      signs: ``+-1`` array whose last axis is ``D`` (e.g. from :func:`random_signs`),
        broadcast against ``x``.
      block: ``None`` for the full transform (``D`` a power of two), else the block size
        of :func:`block_hadamard`.

    Returns:
      float32 array of the same shape; undo it with :func:`inverse_randomized_hadamard`.
    """
    x = jnp.asarray(x, jnp.float32)
    _check_signs(x, signs, "randomized_hadamard")
    _check_block(x, block, "randomized_hadamard")
    return _randomized(x, jnp.asarray(signs, jnp.float32), block)


@functools.partial(jax.jit, static_argnames="block")
def _randomized(x: jax.Array, signs: jax.Array, block: int | None) -> jax.Array:
    return _rotate(x * signs, block)


@functools.partial(jax.jit, static_argnames="block")
def _inverse_randomized(y: jax.Array, signs: jax.Array, block: int | None) -> jax.Array:
    return _rotate(y, block) * signs


def inverse_randomized_hadamard(
    y: jax.Array, signs: jax.Array, block: int | None = None
) -> jax.Array:
    """Exact inverse of :func:`randomized_hadamard` with the same ``signs`` and ``block``.

    Because ``H`` is self-inverse and ``signs * signs == 1``, the inverse is
    ``signs * H(y)``.

    Returns:
      float32 array of the same shape as ``y``.
    """
    y = jnp.asarray(y, jnp.float32)
    _check_signs(y, signs, "inverse_randomized_hadamard")
    _check_block(y, block, "inverse_randomized_hadamard")
    return _inverse_randomized(y, jnp.asarray(signs, jnp.float32), block)


def haar_orthogonal(key: jax.Array, d: int) -> jax.Array:
    """Haar-distributed (uniformly random) orthogonal matrix ``Q`` of shape ``[d, d]``.

    Built from the QR factorization of a standard Gaussian matrix. QR alone is not Haar:
    the factorization fixes the signs of ``R``'s diagonal by convention, which biases the
    columns of ``Q`` (Householder QR, for instance, makes ``Q[0, 0] <= 0`` always).
    Flipping each column of ``Q`` by the sign of the matching diagonal entry of ``R``
    makes the factorization the unique one with a positive diagonal, whose ``Q`` is
    exactly Haar (Mezzadri, 2007).

    Apply to row vectors as ``x @ Q``; invert with ``y @ Q.T``.

    Args:
      key: a JAX PRNG key.
      d: matrix size, a positive int.

    Returns:
      float32 array ``[d, d]`` with ``Q @ Q.T == I`` up to float32 rounding.
    """
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ValueError(f"haar_orthogonal needs a positive int size, got d={d!r}")
    return _haar(key, d)


@functools.partial(jax.jit, static_argnums=1)
def _haar(key: jax.Array, d: int) -> jax.Array:
    g = jax.random.normal(key, (d, d), dtype=jnp.float32)
    q, r = jnp.linalg.qr(g)
    # A zero diagonal entry has probability zero; mapping it to +1 rather than
    # jnp.sign's 0 keeps Q orthogonal even then.
    flip = jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0).astype(jnp.float32)
    return q * flip[None, :]
