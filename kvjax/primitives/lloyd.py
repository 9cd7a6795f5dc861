"""Lloyd-Max scalar quantizers for a known 1-D density, designed by numerical integration.

After a random rotation every coordinate of a unit vector in ``R^D`` follows the same
marginal (:func:`sphere_coordinate`), so one optimal scalar codebook serves all
coordinates (TurboQuant, OCTOPUS). :func:`lloyd_max` designs that codebook offline in
numpy float64; :func:`quantize` / :func:`dequantize` apply it in ``jax.numpy``.

Densities are :class:`Density` values: frozen and hashable, so a designed quantizer can be
cached per ``(density, bits)`` and a density can sit in a static ``jax.jit`` argument.
Built-in families are :func:`uniform`, :func:`gaussian`, :func:`sphere_coordinate` and
:func:`beta`; :meth:`Density.custom` names a user pdf in a module-level registry.

Integration. Every density is integrated in a variable ``t`` with ``x = phi(t)``, in
which the weight ``w(t) = f(phi(t)) phi'(t)`` is bounded: the identity for most
families, ``x = sin(t)`` for the sphere marginal (whose ``dim = 2`` density is infinite at
``+-1``) and a power-law stretch for beta densities with a parameter below 1. On a
uniform ``t`` grid, ``w`` is taken linear on each segment (the trapezoid rule) and
``phi`` replaced by its monotone cubic Hermite interpolant; cell integrals of ``f``,
``x f`` and ``x^2 f`` are then exact polynomial integrals of that model, read off
cumulative tables at the nodes and completed over the partial segment at each threshold.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MAX_BITS",
    "Density",
    "LloydMaxQuantizer",
    "beta",
    "clear_cache",
    "dequantize",
    "gaussian",
    "lloyd_max",
    "octahedral_coordinate",
    "polar_angle",
    "quantize",
    "sphere_block_norm",
    "sphere_coordinate",
    "uniform",
]

MAX_BITS = 12

# Named user pdfs for Density.custom. Densities hold only the name, which keeps them
# hashable and lets the lloyd_max cache key on them.
_CUSTOM_PDFS: dict[str, Callable[[np.ndarray], np.ndarray]] = {}

_FAMILIES = ("uniform", "gaussian", "sphere_coordinate", "beta", "polar_angle",
             "sphere_block_norm", "octahedral_coordinate", "custom")


@dataclasses.dataclass(frozen=True)
class Density:
    """A probability density on the interval ``[lo, hi]``, identified by value.

    ``name`` selects the family and ``params`` holds its parameters (a tuple of hashable
    values). Use the constructors :func:`uniform`, :func:`gaussian`,
    :func:`sphere_coordinate`, :func:`beta` or :meth:`Density.custom` rather than building
    one by hand.
    """

    name: str
    params: tuple
    lo: float
    hi: float

    def __post_init__(self) -> None:
        if self.name not in _FAMILIES:
            raise ValueError(f"unknown density family {self.name!r}; known: {_FAMILIES}")
        if not isinstance(self.params, tuple):
            raise ValueError(f"Density params must be a tuple, got {type(self.params).__name__}")
        hash(self.params)  # a TypeError here beats a confusing one inside the cache
        _check_interval(self.lo, self.hi)
        if self.name == "custom" and (len(self.params) != 1 or self.params[0] not in _CUSTOM_PDFS):
            raise ValueError(f"no custom pdf registered as {self.params!r}; use Density.custom")

    @staticmethod
    def custom(
        name: str,
        pdf: Callable[[np.ndarray], np.ndarray],
        lo: float,
        hi: float,
        *,
        overwrite: bool = False,
    ) -> Density:
        """Register ``pdf`` under ``name`` and return the density it defines on ``[lo, hi]``.

        ``pdf`` maps a float64 array to non-negative values (unnormalized is fine; the
        quantizer design normalizes numerically) and must be finite on ``[lo, hi]``, the
        endpoints included: custom densities are integrated without a change of variables.
        Jumps are allowed but cost accuracy (first- instead of second-order integration).

        The registry is keyed by ``name`` alone, so results cached by :func:`lloyd_max`
        are tied to the name. Registering a *different* callable under a taken name
        raises ``ValueError`` unless ``overwrite=True``, which replaces it and clears the
        :func:`lloyd_max` cache so that no stale codebook survives.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"custom density name must be a non-empty str, got {name!r}")
        if not callable(pdf):
            raise ValueError("custom density pdf must be callable")
        _check_interval(lo, hi)  # before registering, so a bad call leaves no trace
        old = _CUSTOM_PDFS.get(name)
        if old is not None and old is not pdf:
            if not overwrite:
                raise ValueError(
                    f"a different custom pdf is already registered as {name!r}; "
                    "pass overwrite=True to replace it"
                )
            clear_cache()
        _CUSTOM_PDFS[name] = pdf
        return Density("custom", (name,), float(lo), float(hi))

    def pdf(self, x: np.ndarray) -> np.ndarray:
        """Density at ``x`` (float64 numpy), zero outside ``[lo, hi]``.

        Built-in families return the normalized density (integrating to 1 over
        ``[lo, hi]``; for :func:`gaussian` up to the ``~2e-33`` mass beyond 12 sigma).
        Custom densities return whatever their callable returns. Where a family has an
        integrable singularity (``sphere_coordinate(2)`` at ``+-1``, :func:`beta` with a
        parameter below 1) the value there is ``inf``.
        """
        x = np.asarray(x, dtype=np.float64)
        inside = (x >= self.lo) & (x <= self.hi)
        if self.name == "custom":
            values = np.asarray(_CUSTOM_PDFS[self.params[0]](x), dtype=np.float64)
            return np.where(inside, np.broadcast_to(values, x.shape), 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.name == "uniform":
                values = np.full_like(x, 1.0 / (self.hi - self.lo))
            elif self.name == "gaussian":
                (sigma,) = self.params
                values = np.exp(-0.5 * (x / sigma) ** 2) / (sigma * math.sqrt(2.0 * math.pi))
            elif self.name == "sphere_coordinate":
                (dim,) = self.params
                xc = np.clip(x, -1.0, 1.0)
                # (1 - x)(1 + x) keeps relative precision near +-1, where 1 - x^2 cancels.
                values = _sphere_norm(dim) * ((1.0 - xc) * (1.0 + xc)) ** ((dim - 3) / 2.0)
            elif self.name == "beta":
                a, b = self.params
                width = self.hi - self.lo
                u = np.clip((x - self.lo) / width, 0.0, 1.0)
                values = u ** (a - 1.0) * (1.0 - u) ** (b - 1.0) / (_beta_fn(a, b) * width)
            elif self.name == "polar_angle":
                (m,) = self.params
                values = np.sin(2.0 * np.clip(x, 0.0, math.pi / 2)) ** (m - 1) / _polar_norm(m)
            elif self.name == "sphere_block_norm":
                dim, k = self.params
                r = np.clip(x, 0.0, 1.0)
                values = (2.0 * r ** (k - 1) * ((1.0 - r) * (1.0 + r)) ** ((dim - k - 2) / 2.0)
                          / _beta_fn(k / 2.0, (dim - k) / 2.0))
            else:  # octahedral_coordinate
                values = _octahedral_marginal(x)
        return np.where(inside, values, 0.0)

    # --- Change of variables x = phi(t) used for integration (see module docstring). ---

    def _t_range(self) -> tuple[float, float]:
        if self.name == "sphere_coordinate":
            (dim,) = self.params
            # The mass sits within ~1/sqrt(dim) of 0; beyond sin(t) = 14/sqrt(dim - 3) the
            # weight is below exp(-98), so the range is cut there to put the grid's
            # resolution on the bulk when dim is large.
            s = 14.0 / math.sqrt(dim - 3) if dim > 3 else 1.0
            tmax = math.asin(s) if s < 1.0 else math.pi / 2
            return -tmax, tmax
        if self.name == "beta":
            return 0.0, 1.0
        return self.lo, self.hi

    def _beta_m(self) -> float:
        a, b = self.params
        return max(1.0, 1.0 / a, 1.0 / b)

    def _phi(self, t: np.ndarray) -> np.ndarray:
        if self.name == "sphere_coordinate":
            return np.sin(t)
        if self.name == "beta":
            m = self._beta_m()
            sm, rm = t**m, (1.0 - t) ** m
            return self.lo + (self.hi - self.lo) * (sm / (sm + rm))
        return t

    def _dphi(self, t: np.ndarray) -> np.ndarray:
        if self.name == "sphere_coordinate":
            return np.cos(t)
        if self.name == "beta":
            m = self._beta_m()
            sm, rm = t**m, (1.0 - t) ** m
            return (self.hi - self.lo) * m * (t * (1.0 - t)) ** (m - 1.0) / (sm + rm) ** 2
        return np.ones_like(t)

    def _weight(self, t: np.ndarray) -> np.ndarray:
        """``w(t) = f(phi(t)) phi'(t)``, bounded on the whole ``t`` range."""
        if self.name == "sphere_coordinate":
            # f(x) dx = c (1 - x^2)^((dim-3)/2) dx = c cos(t)^(dim-2) dt, bounded for all
            # dim >= 2 (constant for dim = 2, whose x-density is infinite at +-1).
            (dim,) = self.params
            return _sphere_norm(dim) * np.cos(t) ** (dim - 2)
        if self.name == "beta":
            # u = s^m / (s^m + (1-s)^m) ~ s^m at 0 and 1 - (1-s)^m at 1 turns
            # u^(a-1) (1-u)^(b-1) du into m s^(ma-1) (1-s)^(mb-1) D^-(a+b) ds with
            # D = s^m + (1-s)^m >= 2^(1-m): bounded since m >= 1/a and m >= 1/b. The
            # exponents are clipped at 0 so that rounding in m * a cannot make 0^-tiny.
            a, b = self.params
            m = self._beta_m()
            ea, eb = max(m * a - 1.0, 0.0), max(m * b - 1.0, 0.0)
            den = t**m + (1.0 - t) ** m
            return m * t**ea * (1.0 - t) ** eb * den ** (-(a + b)) / _beta_fn(a, b)
        return self.pdf(t)


def _check_interval(lo: float, hi: float) -> None:
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"Density needs finite lo < hi, got [{lo}, {hi}]")


def _sphere_norm(dim: int) -> float:
    # 1 / integral of (1 - x^2)^((dim-3)/2) over [-1, 1], via lgamma to survive large dim.
    return math.exp(math.lgamma(dim / 2.0) - math.lgamma((dim - 1) / 2.0)) / math.sqrt(math.pi)


def _beta_fn(a: float, b: float) -> float:
    return math.exp(math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))


def _polar_norm(m: int) -> float:
    # integral of sin(2 psi)^(m - 1) over [0, pi/2] = sqrt(pi) Gamma(m/2) / (2 Gamma((m+1)/2))
    return 0.5 * math.sqrt(math.pi) * math.exp(math.lgamma(m / 2.0) - math.lgamma((m + 1) / 2.0))


def _octahedral_marginal(x: np.ndarray) -> np.ndarray:
    """Marginal density of one octahedral coordinate of a uniform direction on S^2.

    The octahedral map sends the upper face point ``p = (xi, eta, 1 - |xi| - |eta|)`` (and,
    folded, the lower one) to ``(xi, eta)``; a patch ``d xi d eta`` subtends the solid angle
    ``d xi d eta / |p|^3`` (the face ``|x| + |y| + |z| = 1`` projects onto the plane with
    area factor ``sqrt 3`` and sits at distance ``1 / sqrt 3`` along its normal). So
    ``(xi, eta)`` has density ``1 / (4 pi |p|^3)`` on the square, where for the folded
    half ``|p|^2 = (1-|eta|)^2 + (1-|xi|)^2 + (1-|xi|-|eta|)^2``. In ``eta`` both pieces
    are ``Q(eta)^(-3/2)`` with ``Q = 2 eta^2 + b eta + c`` quadratic, whose antiderivative
    ``2 (4 eta + b) / ((8 c - b^2) sqrt(Q))`` gives the marginal in closed form.
    """
    a = np.clip(np.abs(x), 0.0, 1.0)

    def integral(b, c, lo, hi):
        def anti(t):
            return 2.0 * (4.0 * t + b) / ((8.0 * c - b * b) * np.sqrt(2.0 * t * t + b * t + c))
        return anti(hi) - anti(lo)

    upper = integral(-2.0 * (1.0 - a), a * a + (1.0 - a) ** 2, 0.0, 1.0 - a)
    folded = integral(-2.0 * (2.0 - a), 1.0 + 2.0 * (1.0 - a) ** 2, 1.0 - a, 1.0)
    return (upper + folded) / (2.0 * math.pi)


def _positive_float(value: float, what: str) -> float:
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return v


def uniform(lo: float = 0.0, hi: float = 1.0) -> Density:
    """Uniform density on ``[lo, hi]``."""
    return Density("uniform", (), float(lo), float(hi))


def gaussian(sigma: float = 1.0) -> Density:
    """Centered normal density with standard deviation ``sigma``, truncated to ``+-12 sigma``.

    The truncated tails hold ``~2e-33`` of the mass, far below the float64 resolution of
    the quantities the design computes.
    """
    sigma = _positive_float(sigma, "gaussian sigma")
    return Density("gaussian", (sigma,), -12.0 * sigma, 12.0 * sigma)


def sphere_coordinate(dim: int) -> Density:
    """Marginal of one coordinate of a uniform random point on the unit sphere in ``R^dim``.

    The density on ``[-1, 1]`` is ``c (1 - x^2)^((dim - 3) / 2)`` with
    ``c = Gamma(dim/2) / (sqrt(pi) Gamma((dim-1)/2))``; mean 0, variance ``1 / dim``.
    ``dim = 3`` is uniform; ``dim = 2`` is the arcsine density, infinite (but integrable)
    at ``+-1``.

    The singularity is handled exactly: :func:`lloyd_max` integrates in ``t`` with
    ``x = sin(t)``, under which ``f(x) dx = c cos(t)^(dim - 2) dt`` is bounded for every
    ``dim >= 2``; the grid is uniform in ``t`` (so it is dense in ``x`` near ``+-1``). For
    ``dim > 199`` the ``t`` range stops where the weight falls below ``exp(-98)``.
    """
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 2:
        raise ValueError(f"sphere_coordinate needs an int dim >= 2, got {dim!r}")
    return Density("sphere_coordinate", (dim,), -1.0, 1.0)


def beta(a: float, b: float, lo: float = 0.0, hi: float = 1.0) -> Density:
    """Beta(a, b) density stretched to ``[lo, hi]``: ``∝ u^(a-1) (1-u)^(b-1)``, ``u ∈ [0, 1]``.

    Any ``a, b > 0``. A parameter below 1 makes the density infinite at that end;
    :func:`lloyd_max` then integrates in ``s`` with ``u = s^m / (s^m + (1-s)^m)``,
    ``m = max(1, 1/a, 1/b)``, which makes the integrand bounded (``m = 1`` is the
    identity). ``beta((d-1)/2, (d-1)/2, -1, 1)`` is the same law as
    ``sphere_coordinate(d)``.
    """
    a = _positive_float(a, "beta a")
    b = _positive_float(b, "beta b")
    return Density("beta", (a, b), float(lo), float(hi))


def polar_angle(m: int) -> Density:
    """The angle ``psi = atan2(|b|, |a|)`` of two independent blocks ``a, b`` of ``m``
    Gaussian coordinates each: density ``∝ sin(2 psi)^(m - 1)`` on ``[0, pi/2]``.

    With ``|a| = R cos psi`` and ``|b| = R sin psi`` the joint density of the two norms,
    ``∝ |a|^(m-1) |b|^(m-1) exp(-R^2 / 2)``, times the polar Jacobian ``R`` separates into
    a function of ``R`` and ``(cos psi sin psi)^(m - 1)``. This is the law of the level
    ``l`` angles of PolarQuant's recursive polar transform (``m = 2^(l-1)``, ``l >= 2``) of
    a rotated vector: scale-free, so the same for a uniform point on the sphere. ``m = 1``
    is uniform. The mass sits within ``~1 / sqrt(m)`` of ``pi / 4``; for large ``m`` the
    interval is cut where the density falls below ``exp(-98)`` of its peak.
    """
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"polar_angle needs an int m >= 1, got {m!r}")
    half = math.pi / 4
    if m > 1:  # sin(2 psi)^(m-1) = cos(2 delta)^(m-1) at psi = pi/4 + delta
        half = min(half, 0.5 * math.acos(math.exp(-98.0 / (m - 1))))
    return Density("polar_angle", (m,), math.pi / 4 - half, math.pi / 4 + half)


def sphere_block_norm(dim: int, k: int) -> Density:
    """Norm of ``k`` coordinates of a uniform point on the unit sphere in ``R^dim``.

    Its square is ``Beta(k/2, (dim-k)/2)`` (a ratio of chi-squares), so on ``[0, 1]``
    ``f(r) = 2 r^(k-1) (1 - r^2)^((dim-k-2)/2) / B(k/2, (dim-k)/2)``; mean square
    ``k / dim``. Needs ``dim >= k + 2`` (a bounded density); OCTOPUS's triplet norm is
    ``k = 3``. For large ``dim`` the interval is cut where ``(1 - r^2)^((dim-k-2)/2)``
    falls below ``exp(-98)``.
    """
    for what, v in (("dim", dim), ("k", k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"sphere_block_norm needs an int {what} >= 1, got {v!r}")
    if dim < k + 2:
        raise ValueError(f"sphere_block_norm needs dim >= k + 2, got dim={dim}, k={k}")
    hi = 1.0
    if dim > k + 2:
        hi = min(1.0, math.sqrt(1.0 - math.exp(-196.0 / (dim - k - 2))))
    return Density("sphere_block_norm", (dim, k), 0.0, hi)


def octahedral_coordinate() -> Density:
    """Marginal of one coordinate ``xi`` of the octahedral map of a uniform direction on
    S^2 (both coordinates share it by symmetry), on ``[-1, 1]``; closed form derived in
    :func:`_octahedral_marginal`. It is ``1 / pi`` at ``0`` and ``+-1`` and peaks near
    ``+-1/2`` rather than being flat: the octahedral map is not equal-area (the solid
    angle per unit square area varies by ``3 sqrt 3`` between a face centre and a vertex).
    """
    return Density("octahedral_coordinate", (), -1.0, 1.0)


@dataclasses.dataclass(frozen=True, eq=False)
class LloydMaxQuantizer:
    """A designed scalar quantizer: value ``x`` maps to ``centroids[searchsorted(thresholds, x)]``.

    Attributes:
      centroids: float64 ``[2**bits]``, sorted reconstruction levels.
      thresholds: float64 ``[2**bits - 1]``, midpoints of consecutive centroids.
      mse: expected squared error ``E[(X - Q(X))^2]`` under the (normalized) density.
      iterations: iterations run (Newton or Lloyd steps, see :func:`lloyd_max`).
      converged: whether the stopping criterion of :func:`lloyd_max` was met.

    The arrays are read-only because :func:`lloyd_max` hands the same cached object to
    every caller. Compared and hashed by identity.
    """

    centroids: np.ndarray
    thresholds: np.ndarray
    mse: float
    iterations: int
    converged: bool

    @property
    def bits(self) -> int:
        """Code width: ``log2(len(centroids))``."""
        return int(self.centroids.shape[0]).bit_length() - 1


class _CellIntegrals:
    """Integrals of ``f``, ``y f`` and ``y^2 f`` over arbitrary cells, ``y = x - centre``.

    Integration model, on a uniform grid in the integration variable ``t``: the weight
    ``w`` is linear on each segment, and ``y = phi(t)`` is replaced by its C1 monotone
    cubic Hermite interpolant. That is the exact law of a *genuine* density, continuous in
    ``x``, so every cell integral is a polynomial integral, the Lloyd map is C1 in the
    thresholds and its Jacobian is exact; :func:`_newton_step` needs both. (Modelling
    ``w``, ``y w`` and ``y^2 w`` as three independent linear pieces is as accurate cell by
    cell but is no density's law: its O(h^2) inconsistency between the moments is
    amplified ``~4**bits`` times in the centroids, 1e-2 at 12 bits for a Gaussian. A
    piecewise-linear ``phi`` is consistent but puts jumps into the density at every node,
    which stalls Newton at 12 bits for the curved substitutions.)

    Tables run from both ends: a cell's integral is a difference of cumulative integrals
    from ``lo`` when it lies in the left half of the mass and from ``hi`` otherwise. A
    one-sided table holds values near the total in the far tail, and their difference
    keeps only ``eps / P`` relative precision for a cell of mass ``P``: ~1e-7 for the
    outer cells of a 12-bit Gaussian codebook, far above the default ``tol``.
    """

    def __init__(self, density: Density, grid: int) -> None:
        t0, t1 = density._t_range()
        t = np.linspace(t0, t1, grid + 1)
        self.h = h = (t1 - t0) / grid
        w = density._weight(t)
        if not (np.all(np.isfinite(w)) and np.all(w >= 0)):
            raise ValueError(f"{density} has a negative or non-finite density on its support")
        mass = float(np.sum(w[1:] + w[:-1])) * 0.5 * h
        if not mass > 0:
            raise ValueError(f"{density} has zero mass on [{density.lo}, {density.hi}]")
        w = w / mass
        # Moments about the interval's centre so that y f and y^2 f carry no large offset.
        self.centre = 0.5 * (density.lo + density.hi)
        y = np.maximum.accumulate(density._phi(t) - self.centre)
        self.y = y
        # Node slopes in units of one segment, limited to 3x the neighbouring secants:
        # with both end slopes in [0, 3 * secant] a cubic Hermite piece is monotone
        # (Fritsch-Carlson), which steep substitutions (beta with a tiny parameter) need.
        # A node slope is shared by both its segments, so the limit keeps phi C1.
        secant = np.diff(y)
        d = h * np.maximum(density._dphi(t), 0.0)
        d[:-1] = np.minimum(d[:-1], 3.0 * secant)
        d[1:] = np.minimum(d[1:], 3.0 * secant)
        y0, y1, d0, d1 = y[:-1], y[1:], d[:-1], d[1:]
        cy = [y0, d0, 3.0 * (y1 - y0) - 2.0 * d0 - d1, 2.0 * (y0 - y1) + d0 + d1]
        cw = [w[:-1], np.diff(w)]
        cm = _polymul(cy, cw)
        cs = _polymul(_polymul(cy, cy), cw)
        self.cy = np.stack(cy)
        self.cw = np.stack(cw)
        # Antiderivative coefficients (of s^(k+1)) of the three integrands, zero-padded.
        anti = np.zeros((3, len(cs), grid))
        for row, coeffs in enumerate((cw, cm, cs)):
            for k, ck in enumerate(coeffs):
                anti[row, k] = ck / (k + 1)
        self.anti = anti
        self.inc = h * anti.sum(axis=1)
        self.fwd = np.zeros((3, grid + 1))
        np.cumsum(self.inc, axis=1, out=self.fwd[:, 1:])
        self.rev = np.zeros_like(self.fwd)
        self.rev[:, :-1] = np.cumsum(self.inc[:, ::-1], axis=1)[:, ::-1]
        self.total = self.fwd[:, -1]
        self.y_lo, self.y_hi = float(y[0]), float(y[-1])

    def _locate(self, thr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Segment ``j`` and position ``s`` in it of each threshold: ``phi_H(j, s) = thr``."""
        n = self.cy.shape[1]
        # side="right" sends a threshold on a run of equal nodes (phi saturating in
        # float64 near an end) to the run's last, non-empty segment.
        j = np.clip(np.searchsorted(self.y, thr, side="right") - 1, 0, n - 1)
        c0, c1, c2, c3 = self.cy[:, j]
        width = self.y[j + 1] - self.y[j]
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.clip(np.where(width > 0, (thr - c0) / width, 0.0), 0.0, 1.0)
        lo, hi = np.zeros_like(s), np.ones_like(s)
        # Safeguarded Newton on the monotone cubic: quadratic convergence from the secant
        # guess, bisection where a step leaves the bracket (flat ends of phi).
        for _ in range(40):
            val = ((c3 * s + c2) * s + c1) * s + c0 - thr
            der = (3.0 * c3 * s + 2.0 * c2) * s + c1
            lo = np.where(val <= 0, s, lo)
            hi = np.where(val >= 0, s, hi)
            with np.errstate(divide="ignore", invalid="ignore"):
                step = s - val / der
            ok = (der > 0) & (step >= lo) & (step <= hi)
            new = np.where(ok, step, 0.5 * (lo + hi))
            new = np.where(val == 0, s, new)
            if np.all(np.abs(new - s) <= 1e-15):
                s = new
                break
            s = new
        return j, s

    def cells(self, thr: np.ndarray) -> np.ndarray:
        """``[3, len(thr) + 1]`` integrals over the cells that sorted ``thr`` cut."""
        j, s = self._locate(thr)
        a = self.anti[:, :, j]
        part = a[:, -1]
        for k in range(a.shape[1] - 2, -1, -1):
            part = part * s + a[:, k]
        part = part * (s * self.h)
        below = self.fwd[:, j] + part  # integral from lo to thr
        above = self.rev[:, j + 1] + (self.inc[:, j] - part)  # integral from thr to hi
        zero = np.zeros((3, 1))
        below = np.concatenate((zero, below, self.total[:, None]), axis=1)
        above = np.concatenate((self.total[:, None], above, zero), axis=1)
        from_lo = below[:, 1:] - below[:, :-1]
        from_hi = above[:, :-1] - above[:, 1:]
        return np.where(above[0, :-1] < below[0, 1:], from_hi, from_lo)

    def density(self, thr: np.ndarray) -> np.ndarray:
        """The model density at each threshold (derivative of the cumulative mass)."""
        j, s = self._locate(thr)
        _, c1, c2, c3 = self.cy[:, j]
        dy = (3.0 * c3 * s + 2.0 * c2) * s + c1
        dw = self.h * (self.cw[0, j] + s * self.cw[1, j])
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(dy > 0, dw / dy, 0.0)


def _polymul(p: list[np.ndarray], q: list[np.ndarray]) -> list[np.ndarray]:
    """Product of two polynomials given as coefficient lists (lowest first) of arrays."""
    out = [np.zeros_like(p[0]) for _ in range(len(p) + len(q) - 1)]
    for i, pi in enumerate(p):
        for k, qk in enumerate(q):
            out[i + k] = out[i + k] + pi * qk
    return out


def _lloyd_step(tab: _CellIntegrals, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One Lloyd update of sorted centroids ``c``; returns ``(T(c), cell masses)``."""
    thr = 0.5 * (c[:-1] + c[1:])
    p, m, _ = tab.cells(thr)
    with np.errstate(divide="ignore", invalid="ignore"):
        new = m / p
    # Empty (or numerically massless) cells keep their centroid. Conditional means lie in
    # their cells, so clipping only removes rounding noise and keeps the order intact.
    new = np.where((p > 0) & np.isfinite(new), new, c)
    lo_edge = np.concatenate(([tab.y_lo], thr))
    hi_edge = np.concatenate((thr, [tab.y_hi]))
    return np.clip(new, lo_edge, hi_edge), p


def _newton_step(tab: _CellIntegrals, c: np.ndarray, tc: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Newton step for the fixed point ``c = T(c)``; the Jacobian of ``T`` is tridiagonal.

    Centroid ``k`` depends on its cell edges ``t_{k-1}, t_k`` only, with
    ``dT_k/dt_k = f(t_k) (t_k - T_k) / P_k`` and ``dT_k/dt_{k-1} = f(t_{k-1}) (T_k -
    t_{k-1}) / P_k``, and each edge is the mean of two centroids.

    Plain Lloyd contracts the smooth, long-wavelength error modes by only
    ``1 - O(4**-bits)`` per step (thousands of steps at 8 bits, hopeless at 12); Newton
    removes them in a handful. The same ill-conditioning (``I - J`` has eigenvalues down
    to ``O(4**-bits)``) means the Jacobian must be the exact one of the *discretized*
    map, so ``f`` is the integration model's density (:class:`_CellIntegrals`).
    """
    n = c.shape[0]
    thr = 0.5 * (c[:-1] + c[1:])
    f = tab.density(thr)
    safe_p = np.where(p > 0, p, np.inf)
    up = np.zeros(n)  # dT_k / dt_k
    down = np.zeros(n)  # dT_k / dt_{k-1}
    up[:-1] = f * (thr - tc[:-1]) / safe_p[:-1]
    down[1:] = f * (tc[1:] - thr) / safe_p[1:]
    # Solve (I - J) delta = T(c) - c, with J[k, k-1] = down_k / 2,
    # J[k, k] = (up_k + down_k) / 2 and J[k, k+1] = up_k / 2, by the Thomas algorithm.
    # I - J is an M-matrix when Lloyd contracts (log-concave densities); a bad step on
    # other densities is rejected by the caller.
    sub = (-0.5 * down).tolist()
    diag = (1.0 - 0.5 * (up + down)).tolist()
    sup = (-0.5 * up).tolist()
    rhs = (tc - c).tolist()
    for k in range(1, n):
        r = sub[k] / diag[k - 1]
        diag[k] -= r * sup[k - 1]
        rhs[k] -= r * rhs[k - 1]
    delta = [0.0] * n
    delta[-1] = rhs[-1] / diag[-1]
    for k in range(n - 2, -1, -1):
        delta[k] = (rhs[k] - sup[k] * delta[k + 1]) / diag[k]
    return c + np.asarray(delta)


def lloyd_max(
    density: Density,
    bits: int,
    *,
    tol: float = 1e-10,
    max_iter: int = 10000,
    grid: int = 2**17,
) -> LloydMaxQuantizer:
    """Design the MSE-optimal (Lloyd-Max) ``bits``-bit scalar quantizer for ``density``.

    Solves the two optimality conditions: thresholds at midpoints of neighbouring
    centroids, and each centroid at the conditional mean of its cell (the Lloyd map
    ``T``). Cell integrals of ``f`` and ``x f`` come from cumulative trapezoid integrals
    on ``grid + 1`` nodes in float64, interpolated at the thresholds (module docstring).

    Iteration: each step computes a Newton step for ``c = T(c)`` (tridiagonal
    Jacobian) and keeps it if its centroids stay sorted inside the support and it shrinks
    ``max |T(c) - c|``; otherwise it takes the plain Lloyd update ``c <- T(c)``. Plain
    Lloyd alone needs thousands of steps at 8 bits and does not converge at 12 within
    ``max_iter``; with Newton a handful suffice. The start is the quantiles of
    ``f^(1/3)`` rather than of ``f``: high-resolution theory puts optimal levels at
    density ``∝ f^(1/3)``, so this starts near the optimum (the two coincide for a
    uniform density, which then needs no iteration).

    Guarantee on return with ``converged=True``: ``thresholds`` are exactly the midpoints
    of ``centroids``, and a Lloyd update would move no centroid by ``tol`` or more, i.e.
    every centroid is within ``tol`` (absolute, in units of ``x``) of the conditional mean
    of its cell under the discretized density. That bounds the residual of the optimality
    conditions, not the distance to the exact fixed point, which can be larger by the
    conditioning of the problem (up to ``~4**bits``; worse for exponential tails, whose
    Lloyd map is nearly neutral). In practice Newton's final step leaves the residual far
    below ``tol``. The discretization is second order for smooth densities: centroid
    errors ``~(t spacing)^2``, about 1.5e-8 for ``gaussian(1)`` at the default grid at any
    ``bits``; a custom pdf with jumps gets first-order errors (~1e-6 at the default grid).

    An empty or numerically massless cell keeps its previous centroid (no NaN), and
    updates are clipped into their cell so the centroids stay sorted.

    Results are cached: a second call with an equal density and equal ``bits``, ``tol``,
    ``max_iter`` and ``grid`` returns the *same* :class:`LloydMaxQuantizer` object (an
    unbounded ``functools.cache`` on the normalized arguments, so ``bits=2`` and
    ``bits=np.int64(2)`` share an entry; :func:`clear_cache` empties it).

    Args:
      density: the source density.
      bits: code width in ``0..12``; the quantizer has ``2**bits`` levels (``0``: the
        one level is the mean, and ``mse`` the variance; bit allocations that give a
        component no bits need it).
      tol: stopping threshold on the largest move a Lloyd update would make.
      max_iter: iteration cap; ``converged`` is False if it is reached first.
      grid: number of integration intervals.

    Raises:
      ValueError: for bits outside ``0..12``, a non-positive tol, max_iter < 1 or
        grid < 2, or a density that is negative, non-finite or massless on its grid.
    """
    if not isinstance(density, Density):
        raise ValueError(f"lloyd_max needs a Density, got {type(density).__name__}")
    if not isinstance(bits, int | np.integer) or isinstance(bits, bool):
        raise ValueError(f"bits must be an int in 0..{MAX_BITS}, got {bits!r}")
    if not 0 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in 0..{MAX_BITS}, got {bits!r}")
    tol = _positive_float(tol, "tol")
    if int(max_iter) < 1 or int(grid) < 2:
        raise ValueError(f"max_iter must be >= 1 and grid >= 2, got {max_iter}, {grid}")
    return _design(density, int(bits), tol, int(max_iter), int(grid))


@functools.cache
def _design(density: Density, bits: int, tol: float, max_iter: int, grid: int) -> LloydMaxQuantizer:
    n = 2**bits
    tab = _CellIntegrals(density, grid)
    if bits == 0:
        (p,), (m,), (s,) = tab.cells(np.zeros(0))
        c = np.array([m / p])
        mse = float(max(s / p - c[0] ** 2, 0.0))
        centroids, thresholds = c + tab.centre, np.zeros(0)
        centroids.setflags(write=False)
        thresholds.setflags(write=False)
        return LloydMaxQuantizer(centroids, thresholds, mse, 0, True)

    # Start at quantiles of f^(1/3) (see lloyd_max). In t,
    # f(x)^(1/3) dx = (w / phi')^(1/3) phi' dt = w^(1/3) phi'^(2/3) dt, bounded like w.
    t = np.linspace(*density._t_range(), grid + 1)
    g = np.cbrt(density._weight(t)) * np.abs(density._dphi(t)) ** (2.0 / 3.0)
    g_cum = np.concatenate(([0.0], np.cumsum(g[1:] + g[:-1])))
    if not g_cum[-1] > 0:
        raise ValueError(f"{density} has zero mass on [{density.lo}, {density.hi}]")
    y = density._phi(t) - tab.centre
    c = np.interp((np.arange(n) + 0.5) / n, g_cum / g_cum[-1], y)
    c = np.maximum.accumulate(c)

    tc, p = _lloyd_step(tab, c)
    resid = float(np.max(np.abs(tc - c)))
    it = 0
    while resid >= tol and it < max_iter:
        it += 1
        cand = _newton_step(tab, c, tc, p)
        if (
            np.all(np.isfinite(cand))
            and np.all(np.diff(cand) > 0)
            and cand[0] >= tab.y_lo
            and cand[-1] <= tab.y_hi
        ):
            tcand, pcand = _lloyd_step(tab, cand)
            rcand = float(np.max(np.abs(tcand - cand)))
            if rcand < resid:
                c, tc, p, resid = cand, tcand, pcand, rcand
                continue
        c = tc
        tc, p = _lloyd_step(tab, c)
        resid = float(np.max(np.abs(tc - c)))

    thr = 0.5 * (c[:-1] + c[1:])
    p, m, s = tab.cells(thr)
    # Per cell: integral of (y - c)^2 f = S - 2 c M + c^2 P.
    mse = float(max(np.sum(s - 2.0 * c * m + c * c * p), 0.0))
    centroids = c + tab.centre
    thresholds = 0.5 * (centroids[:-1] + centroids[1:])
    centroids.setflags(write=False)
    thresholds.setflags(write=False)
    return LloydMaxQuantizer(centroids, thresholds, mse, it, resid < tol)


def clear_cache() -> None:
    """Forget every quantizer cached by :func:`lloyd_max`."""
    _design.cache_clear()


def quantize(x: jax.Array, quantizer: LloydMaxQuantizer) -> jax.Array:
    """Index of the cell of each element of ``x`` (nearest centroid), same shape as ``x``.

    Computed as ``searchsorted(thresholds, x)`` in float32; a value exactly on a threshold
    goes to the lower cell. Returns uint8 for ``bits <= 8`` and int32 otherwise. Traces
    under ``jax.jit`` with the quantizer closed over (it is not a pytree).

    The search compares every element with every threshold (at most a few dozen) in one
    fused pass: jnp's default binary search is a ``while`` loop, one per call site, and a
    model's prefill and decode programs hold one per layer.
    """
    thr = jnp.asarray(quantizer.thresholds, dtype=jnp.float32)
    idx = jnp.searchsorted(thr, jnp.asarray(x, dtype=jnp.float32), side="left",
                           method="compare_all")
    return idx.astype(jnp.uint8 if quantizer.bits <= 8 else jnp.int32)


def dequantize(indices: jax.Array, quantizer: LloydMaxQuantizer) -> jax.Array:
    """Centroid value of each index, as float32, same shape as ``indices``."""
    table = jnp.asarray(quantizer.centroids, dtype=jnp.float32)
    return jnp.take(table, jnp.asarray(indices).astype(jnp.int32), axis=0)
