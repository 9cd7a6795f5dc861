"""The octahedral map of unit directions in R^3 to the square ``[-1, 1]^2`` and back
(OCTOPUS's direction code, :mod:`kvjax.codecs.octopus`): ``p = n / |n|_1`` on the
octahedron, ``(xi, eta) = (p_x, p_y)`` on its upper half, the lower half folded out to
the square's corners. Exact inverse, O(1) arithmetic; shared by the codec and the
kernels' references, which may not import a codec."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _sign(v: jax.Array) -> jax.Array:
    # sign with sgn(0) = +1: the fold of a point on the equator stays on the square
    return jnp.where(v >= 0, 1.0, -1.0)


def octahedral_encode(n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(xi, eta)`` in ``[-1, 1]^2`` of directions ``n[..., 3]`` (any nonzero length; a
    zero vector gives ``(0, 0)``)."""
    l1 = jnp.sum(jnp.abs(n), axis=-1, keepdims=True)
    p = n / jnp.where(l1 > 0, l1, 1.0)
    x, y, z = p[..., 0], p[..., 1], p[..., 2]
    xi = jnp.where(z >= 0, x, (1.0 - jnp.abs(y)) * _sign(x))
    eta = jnp.where(z >= 0, y, (1.0 - jnp.abs(x)) * _sign(y))
    return xi, eta


def octahedral_decode(xi: jax.Array, eta: jax.Array) -> jax.Array:
    """Unit directions ``[..., 3]`` of octahedral coordinates: the inverse of
    :func:`octahedral_encode` on unit vectors."""
    z = 1.0 - jnp.abs(xi) - jnp.abs(eta)
    x = jnp.where(z >= 0, xi, (1.0 - jnp.abs(eta)) * _sign(xi))
    y = jnp.where(z >= 0, eta, (1.0 - jnp.abs(xi)) * _sign(eta))
    p = jnp.stack([x, y, z], axis=-1)
    return p / jnp.linalg.norm(p, axis=-1, keepdims=True)
