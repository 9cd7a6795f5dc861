"""Low-dimensional lattice quantizers in integer coordinates, and their bit-stripping.

Four lattices, each in an *integer realization*: a lattice point is stored as an integer
code vector ``c`` and sits at :meth:`Lattice.point` ``(c)`` in space.

========  ===  ==========================================  ===============  ========
lattice   n    codes ``c`` (membership)                     point            G
========  ===  ==========================================  ===============  ========
``z``     1    any integer                                 ``c``            1/12
``a2``    2    ``(n_x, n_y)``, ``n_x = n_y (mod 2)``       ``(n_x, sqrt3 n_y)``  0.0802
``d4``    4    ``sum c = 0 (mod 2)``                       ``c``            0.0766
``e8``    8    all ``c_i`` of one parity ``p``, ``sum c = 0 (mod 4)``  ``c`` = 2 E8  0.0717
========  ===  ==========================================  ===============  ========

``e8`` is ``2 E8``: E8 is D8 (even coordinate sum) together with D8 + 1/2; doubling makes
both cosets integral, the half-integer coset becoming the odd vectors. Its covolume is
``2^8``, so the per-coordinate error of a uniformly dithered quantizer is
``G 2^2 = 0.287`` (the same ``G`` in any scaling; :attr:`Lattice.noise_power`).

Closest points (Conway and Sloane, *Sphere Packings, Lattices and Groups*, ch. 20):
``D_n``: round every coordinate and, if the sum is odd, re-round the coordinate that was
furthest from its integer the other way; ``E8 = D8 u (D8 + 1/2)``: the closer of the two
cosets' closest points; ``A2`` in these coordinates is the union of the rectangular
lattice ``2Z x 2 sqrt3 Z`` and its translate by ``(1, sqrt3)``, whose closest points are
coordinate-wise roundings. Each is exact (ties aside, a measure-zero set).

Bit-stripping. Membership pins bits of ``c`` that a coder need not spend; :meth:`strip`
maps ``c`` to non-negative symbols ``u`` (one per coordinate) with those bits removed,
and :meth:`unstrip` inverts it exactly (``zigzag`` folds signs: 0, -1, 1, -2 -> 0, 1, 2, 3):

* ``d4``: ``c_0, c_1, c_2`` as they are; ``c_3``'s parity equals that of ``c_0 + c_1 + c_2``,
  so only ``t = (c_3 - p) / 2`` is kept: 1 bit per 4 coordinates.
* ``e8``: ``t_i = (c_i - p) / 2`` removes the common parity (7 bits once ``p`` is known);
  ``sum t`` is even, so ``t_7``'s parity is pinned and ``t_7' = (t_7 - q) / 2`` is kept,
  with ``p`` folded into its low bit: ``comb = 2 zigzag(t_7') + p``. 8 bits per 8
  coordinates, and ``comb`` lives at the scale of the other symbols (one Rice parameter).
* ``a2``: ``n_y``'s parity is that of ``n_x``: ``t_y = (n_y - (n_x mod 2)) / 2``; 1 bit per 2.
* ``z``: nothing to strip.

:attr:`Lattice.symbol_class` says which Rice parameter each symbol uses (class 1:
``d4``'s halved symbol with ``k - 1``, ``a2``'s ``n_x`` with a parameter of its own).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

SQRT3 = math.sqrt(3.0)


def zigzag(v: jax.Array) -> jax.Array:
    """Signed int32 -> uint32 as 0, -1, 1, -2, 2 -> 0, 1, 2, 3, 4."""
    v = v.astype(jnp.int32)
    return ((v << 1) ^ (v >> 31)).astype(jnp.uint32)


def unzigzag(u: jax.Array) -> jax.Array:
    """Inverse of :func:`zigzag` (uint32 -> int32)."""
    u = u.astype(jnp.uint32)
    return ((u >> 1).astype(jnp.int32)) ^ (-(u & 1).astype(jnp.int32))


def _parity(v: jax.Array) -> jax.Array:
    """``v mod 2`` in {0, 1} for signed ints (two's complement keeps the low bit)."""
    return v & 1


def _closest_dn(x: jax.Array) -> jax.Array:
    """Closest point of ``D_n`` (integer vectors with an even sum) to ``x[..., n]``."""
    f = jnp.round(x)
    odd = _parity(jnp.sum(f, axis=-1).astype(jnp.int32)) == 1
    delta = x - f
    worst = jnp.argmax(jnp.abs(delta), axis=-1)
    step = jnp.where(jnp.take_along_axis(delta, worst[..., None], -1) >= 0, 1.0, -1.0)
    bump = jax.nn.one_hot(worst, x.shape[-1], dtype=x.dtype) * step
    return f + jnp.where(odd[..., None], bump, 0.0)


def _closest_z(y: jax.Array) -> jax.Array:
    return jnp.round(y)


def _closest_d4(y: jax.Array) -> jax.Array:
    return _closest_dn(y)


def _closest_e8(y: jax.Array) -> jax.Array:
    x = y / 2.0
    a = _closest_dn(x)
    b = _closest_dn(x - 0.5) + 0.5
    da = jnp.sum((x - a) ** 2, axis=-1, keepdims=True)
    db = jnp.sum((x - b) ** 2, axis=-1, keepdims=True)
    return 2.0 * jnp.where(da <= db, a, b)


def _closest_a2(y: jax.Array) -> jax.Array:
    """Codes ``(n_x, n_y)`` of the closest point ``(n_x, sqrt3 n_y)``."""
    px, py = y[..., 0], y[..., 1] / SQRT3
    even = jnp.stack([2.0 * jnp.round(px / 2), 2.0 * jnp.round(py / 2)], -1)
    odd = jnp.stack([2.0 * jnp.round((px - 1) / 2) + 1, 2.0 * jnp.round((py - 1) / 2) + 1], -1)
    scale = jnp.array([1.0, SQRT3], y.dtype)
    de = jnp.sum((y - even * scale) ** 2, axis=-1, keepdims=True)
    do = jnp.sum((y - odd * scale) ** 2, axis=-1, keepdims=True)
    return jnp.where(de <= do, even, odd)


def _strip_z(c):
    return zigzag(c)


def _unstrip_z(u):
    return unzigzag(u)


def _strip_d4(c):
    p = _parity(c[..., 0] + c[..., 1] + c[..., 2])
    t = (c[..., 3] - p) >> 1
    return zigzag(jnp.concatenate([c[..., :3], t[..., None]], -1))


def _unstrip_d4(u):
    s = unzigzag(u)
    p = _parity(s[..., 0] + s[..., 1] + s[..., 2])
    return jnp.concatenate([s[..., :3], (2 * s[..., 3] + p)[..., None]], -1)


def _strip_e8(c):
    p = _parity(c[..., :1])
    t = (c - p) >> 1
    q = _parity(jnp.sum(t[..., :7], axis=-1, keepdims=True))
    t7 = (t[..., 7:] - q) >> 1
    comb = (zigzag(t7) << 1) | p.astype(jnp.uint32)
    return jnp.concatenate([zigzag(t[..., :7]), comb], -1)


def _unstrip_e8(u):
    p = (u[..., 7:] & 1).astype(jnp.int32)
    t = unzigzag(u[..., :7])
    q = _parity(jnp.sum(t, axis=-1, keepdims=True))
    t7 = 2 * unzigzag(u[..., 7:] >> 1) + q
    return 2 * jnp.concatenate([t, t7], -1) + p


def _strip_a2(c):
    nx, ny = c[..., 0], c[..., 1]
    ty = (ny - _parity(nx)) >> 1
    return zigzag(jnp.stack([ty, nx], -1))


def _unstrip_a2(u):
    s = unzigzag(u)
    ty, nx = s[..., 0], s[..., 1]
    return jnp.stack([nx, 2 * ty + _parity(nx)], -1)


def _member_z(c):
    return jnp.ones(c.shape[:-1], bool)


def _member_d4(c):
    return _parity(jnp.sum(c, -1)) == 0


def _member_e8(c):
    p = _parity(c)
    return jnp.all(p == p[..., :1], -1) & ((jnp.sum(c, -1) & 3) == 0)


def _member_a2(c):
    return _parity(c[..., 0]) == _parity(c[..., 1])


@dataclasses.dataclass(frozen=True)
class Lattice:
    """One lattice in its integer realization (see the module docstring).

    Attributes:
        name: ``"z"``, ``"a2"``, ``"d4"`` or ``"e8"``.
        dim: its dimension ``n``; vectors are quantized ``n`` coordinates at a time.
        second_moment: the normalized second moment ``G`` (Conway and Sloane, Table 2.3).
        covolume: volume of a Voronoi cell in point coordinates.
        period: a box ``[0, period)`` (per coordinate, in point coordinates) that is a
            fundamental domain of a sublattice, so a uniform draw in it, reduced modulo
            the lattice, is uniform on the Voronoi cell (dither, Monte-Carlo ``G``).
        symbol_class: per coordinate of a point, which Rice parameter its stripped
            symbol uses (0: the stream's ``k``; 1: the second parameter).
        stripped_bits: bits per point that :meth:`strip` removes.
    """

    name: str
    dim: int
    second_moment: float
    covolume: float
    period: tuple[float, ...]
    symbol_class: tuple[int, ...]
    stripped_bits: int

    @property
    def noise_power(self) -> float:
        """Per-coordinate mean squared error of the quantizer on a uniform input,
        ``G * covolume^(2/n)``, in point coordinates."""
        return self.second_moment * self.covolume ** (2.0 / self.dim)

    @property
    def point_scale(self) -> np.ndarray:
        """Per-coordinate factor from code to point coordinates."""
        return np.array([1.0, SQRT3] if self.name == "a2" else [1.0] * self.dim, np.float32)

    def closest(self, y: jax.Array) -> jax.Array:
        """Codes (int32 ``[..., n]``) of the lattice point closest to ``y[..., n]``."""
        y = jnp.asarray(y, jnp.float32)
        if y.shape[-1] != self.dim:
            raise ValueError(f"{self.name}: expected [..., {self.dim}], got {y.shape}")
        return _CLOSEST[self.name](y).astype(jnp.int32)

    def point(self, codes: jax.Array) -> jax.Array:
        """Point coordinates (float32) of integer codes."""
        return codes.astype(jnp.float32) * jnp.asarray(self.point_scale)

    def is_member(self, codes: jax.Array) -> jax.Array:
        """Whether integer codes ``[..., n]`` satisfy the membership constraints."""
        return _MEMBER[self.name](jnp.asarray(codes, jnp.int32))

    def strip(self, codes: jax.Array) -> jax.Array:
        """Membership-pinned bits removed: uint32 symbols ``[..., n]``."""
        return _STRIP[self.name](jnp.asarray(codes, jnp.int32))

    def unstrip(self, symbols: jax.Array) -> jax.Array:
        """Exact inverse of :meth:`strip` (int32 codes)."""
        return _UNSTRIP[self.name](jnp.asarray(symbols, jnp.uint32)).astype(jnp.int32)

    def voronoi_sample(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """Uniform draws on the Voronoi cell, float32 ``[*shape, n]`` (point coordinates)."""
        box = jax.random.uniform(key, (*shape, self.dim), jnp.float32)
        box = box * jnp.asarray(self.period, jnp.float32)
        return box - self.point(self.closest(box))


_CLOSEST = {"z": _closest_z, "a2": _closest_a2, "d4": _closest_d4, "e8": _closest_e8}
_STRIP = {"z": _strip_z, "a2": _strip_a2, "d4": _strip_d4, "e8": _strip_e8}
_UNSTRIP = {"z": _unstrip_z, "a2": _unstrip_a2, "d4": _unstrip_d4, "e8": _unstrip_e8}
_MEMBER = {"z": _member_z, "a2": _member_a2, "d4": _member_d4, "e8": _member_e8}

LATTICES: dict[str, Lattice] = {
    "z": Lattice("z", 1, 1.0 / 12.0, 1.0, (1.0,), (0,), 0),
    # the hexagonal lattice: 5 / (36 sqrt 3)
    "a2": Lattice("a2", 2, 5.0 / (36.0 * SQRT3), 2.0 * SQRT3, (2.0, 2.0 * SQRT3), (0, 1), 1),
    "d4": Lattice("d4", 4, 0.0766032, 2.0, (2.0,) * 4, (0, 0, 0, 1), 1),
    # 2 E8: covolume 2^8; 4 Z^8 lies inside it
    "e8": Lattice("e8", 8, 929.0 / 12960.0, 256.0, (4.0,) * 8, (0,) * 8, 8),
}


@functools.cache
def lattice(name: str) -> Lattice:
    """The :class:`Lattice` called ``name`` (``z``, ``a2``, ``d4``, ``e8``)."""
    try:
        return LATTICES[name]
    except KeyError:
        raise ValueError(
            f"unknown lattice '{name}'; valid: {', '.join(LATTICES)}") from None
