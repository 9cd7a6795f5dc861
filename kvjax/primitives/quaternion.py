"""Quaternion algebra for HQMQ: Hamilton product, conjugate, the 24 Hurwitz units (the
binary tetrahedral group 2T) and seeded Haar-random unit quaternions.

A quaternion is a float array whose last axis holds ``(w, x, y, z)`` for
``w + x i + y j + z k``; every function broadcasts over the leading axes.

Nearest unit of 2T. The 24 units are the 8 *axis* units ``+-1, +-i, +-j, +-k`` and the
16 *half* units ``(+-1 +-i +-j +-k) / 2``. For a unit ``u`` the inner product with an
axis unit is ``+-u_c`` and with a half unit ``sum(+-u_c) / 2``, so the best axis unit
takes the largest ``|u_c|`` with its sign and the best half unit takes every component's
sign, scoring ``sum |u_c| / 2``: :func:`nearest_hurwitz` finds the maximizer of all 24
inner products with a dozen comparisons instead of 24 dot products.

Unit indices (:func:`hurwitz_units` returns them in this order): ``2 c + n`` for the axis
unit on component ``c`` with sign ``-1`` if ``n`` else ``+1`` (indices 0..7), and
``8 + m`` for the half unit whose component ``c`` is negative iff bit ``c`` of ``m`` is
set (indices 8..23).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.primitives.packing import unpack_bits

#: order of the binary tetrahedral group 2T
NUM_HURWITZ = 24


def hamilton(a: jax.Array, b: jax.Array) -> jax.Array:
    """The Hamilton product ``a * b`` (broadcast over leading axes)."""
    return jnp.stack(hamilton_components([a[..., i] for i in range(4)],
                                         [b[..., i] for i in range(4)]), axis=-1)


def hamilton_components(a, b) -> list:
    """The Hamilton product of quaternions given as their four components (arrays of
    one shape each, or scalars): the form of :func:`hamilton` for code that keeps each
    component in its own array (a kernel's tiles)."""
    aw, ax, ay, az = a
    bw, bx, by, bz = b
    return [
        aw * bw - ax * bx - ay * by - az * bz,
        aw * bx + ax * bw + ay * bz - az * by,
        aw * by - ax * bz + ay * bw + az * bx,
        aw * bz + ax * by - ay * bx + az * bw,
    ]


def conjugate(q: jax.Array) -> jax.Array:
    """``w - x i - y j - z k``; the inverse of a unit quaternion."""
    return q * jnp.asarray([1.0, -1.0, -1.0, -1.0], q.dtype)


def right_multiplication_matrix(q: jax.Array) -> jax.Array:
    """``M[..., 4, 4]`` with ``x @ M == hamilton(x, q)`` for every row vector ``x``.

    Right multiplication is linear in ``x``; as a matrix it lets one matmul apply all
    of a codebook's elements to a batch of quaternions.
    """
    w, x, y, z = (q[..., i] for i in range(4))
    rows = [  # row r: the coefficients of x_r in the four output components
        [w, x, y, z],
        [-x, w, -z, y],
        [-y, z, w, -x],
        [-z, -y, x, w],
    ]
    return jnp.stack([jnp.stack(r, axis=-1) for r in rows], axis=-2)


def hurwitz_units() -> np.ndarray:
    """The 24 unit Hurwitz quaternions ``float32[24, 4]`` in index order (module doc)."""
    units = np.zeros((NUM_HURWITZ, 4), np.float32)
    for c in range(4):
        units[2 * c, c] = 1.0
        units[2 * c + 1, c] = -1.0
    for m in range(16):
        units[8 + m] = [-0.5 if m >> c & 1 else 0.5 for c in range(4)]
    return units


def nearest_hurwitz(u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For quaternions ``u[..., 4]``: (index ``int32[...]`` of the unit of 2T with the
    largest inner product, that inner product). Ties go to the lower index."""
    a = jnp.abs(u)
    c = jnp.argmax(a, axis=-1)
    axis_score = jnp.max(a, axis=-1)
    negative = jnp.take_along_axis(u, c[..., None], axis=-1)[..., 0] < 0
    axis_index = 2 * c + negative.astype(c.dtype)
    half_score = 0.5 * jnp.sum(a, axis=-1)
    bits = (u < 0).astype(jnp.int32) << jnp.arange(4, dtype=jnp.int32)
    half_index = 8 + jnp.sum(bits, axis=-1)
    # an axis unit has the lower index, so it wins ties
    use_half = half_score > axis_score
    index = jnp.where(use_half, half_index, axis_index).astype(jnp.int32)
    return index, jnp.where(use_half, half_score, axis_score)


def haar_quaternions(key: jax.Array, count: int) -> jax.Array:
    """``count`` i.i.d. Haar-uniform unit quaternions ``float32[count, 4]``: normalized
    standard Gaussians, whose direction is uniform on S^3."""
    g = jax.random.normal(key, (count, 4), jnp.float32)
    return g / jnp.linalg.norm(g, axis=-1, keepdims=True)


def num_chunks(dim: int) -> int:
    """Quaternions of a vector of ``dim`` elements (the last one zero-padded)."""
    return -(-dim // 4)


def to_chunks(x: jax.Array) -> jax.Array:
    """``x[..., D] -> [..., ceil(D / 4), 4]``, zero-padded."""
    c = num_chunks(x.shape[-1])
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 4 * c - x.shape[-1])])
    return x.reshape(*x.shape[:-1], c, 4)


@dataclasses.dataclass(frozen=True)
class HqmqLayout:
    """Where a kernel finds each chunk's fields in an HQMQ byte stream of one token
    (:mod:`kvjax.codecs.hqmq`), for ``chunks`` chunks. Chunk ``c``'s joint index is
    ``digit * 2**low_bits + low``: ``digit`` is place ``c % group`` (least significant
    first) in base ``odd`` of the little-endian group at byte ``2 (c // group)``, two
    bytes wide for the first ``full`` groups and one byte for the last (shorter) one;
    ``low`` (``low_bits`` 8) the byte at ``low_offset + c``; the radius code (``radius_bits``
    4) nibble ``c`` from byte ``radius_offset``, low nibble first. ``size``: bytes per
    token."""

    chunks: int
    odd: int
    group: int
    full: int
    low_bits: int
    radius_bits: int
    low_offset: int
    radius_offset: int
    size: int


def replace_outliers(x: jax.Array, flags: jax.Array, outliers: jax.Array,
                     block: int, start: jax.Array | None = None) -> jax.Array:
    """Vectors ``x [..., NB * block, D]`` (float32) with each flagged chunk of 4 replaced
    by its stored value (Med-C outliers, :mod:`kvjax.codecs.outliers`): ``flags``
    uint32 ``[..., NB, W]`` (a bit per chunk, token-major, :func:`~kvjax.primitives.
    packing.pack_bits`), ``outliers [..., NB, K, 4]`` in the flags' order. ``start``
    (``[..., NB, 1]``, pooled outliers): ``outliers [..., P, K, 4]`` is one pool of ``P
    K`` slots (``P`` need not be ``NB``) and block ``b``'s chunks lie from slot
    ``start[b]`` on."""
    head_dim = x.shape[-1]
    c4 = num_chunks(head_dim)
    lead, nb = flags.shape[:-2], flags.shape[-2]
    stored = unpack_bits(flags, 1, block * c4).astype(bool)
    rank = jnp.cumsum(stored, axis=-1) - 1
    if start is None:
        slot = jnp.clip(rank, 0, outliers.shape[-2] - 1)
        payload = jnp.take_along_axis(outliers.astype(jnp.float32), slot[..., None], axis=-2)
    else:
        pool = outliers.reshape(*lead, outliers.shape[-3] * outliers.shape[-2], 4)
        pool = pool.astype(jnp.float32)
        slot = jnp.clip(start.astype(jnp.int32) + rank, 0, pool.shape[-2] - 1)
        payload = jnp.take_along_axis(pool, slot.reshape(*lead, -1, 1), axis=-2)
        payload = payload.reshape(*lead, nb, block * c4, 4)
    chunks = to_chunks(x).reshape(*lead, nb, block * c4, 4)
    chunks = jnp.where(stored[..., None], payload, chunks)
    return chunks.reshape(*lead, nb * block, 4 * c4)[..., :head_dim]
