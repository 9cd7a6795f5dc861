"""The octahedral map: round trip on the sphere (poles and vertices included) and the
square's area element, against the closed form of the fold."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.primitives.octahedral import octahedral_decode, octahedral_encode


def test_octahedral_map_round_trip_and_area():
    n = np.random.default_rng(4).standard_normal((5000, 3))
    n /= np.linalg.norm(n, axis=1, keepdims=True)
    n[:4] = [[0, 0, 1], [0, 0, -1], [1, 0, 0], [0, -1, 0]]  # vertices, both poles
    xi, eta = octahedral_encode(jnp.asarray(n))
    assert np.abs(np.asarray(xi)).max() <= 1 and np.abs(np.asarray(eta)).max() <= 1
    np.testing.assert_allclose(octahedral_decode(xi, eta), n, atol=2e-6)
    # the square's area element: solid angle 1 / |p|^3 per unit area, summing to 4 pi,
    # 1/8 of it per triangle, and 3 sqrt 3 times denser at a face centre than at a vertex
    grid = (np.arange(800) + 0.5) / 400 - 1
    gx, gy = np.meshgrid(grid, grid)
    p = np.asarray(octahedral_decode(jnp.asarray(gx), jnp.asarray(gy)))
    lifted = np.stack([gx, gy, 1 - np.abs(gx) - np.abs(gy)], -1)
    folded = np.stack([(1 - np.abs(gy)) * np.sign(gx), (1 - np.abs(gx)) * np.sign(gy),
                       lifted[..., 2]], -1)
    raw = np.where(lifted[..., 2:] >= 0, lifted, folded)
    np.testing.assert_allclose(p, raw / np.linalg.norm(raw, axis=-1, keepdims=True), atol=1e-6)
    area = np.linalg.norm(raw, axis=-1) ** -3.0
    assert area.sum() / 400**2 == pytest.approx(4 * math.pi, rel=1e-3)
    upper_quadrant = (gx > 0) & (gy > 0) & (gx + gy < 1)
    assert area[upper_quadrant].sum() / area.sum() == pytest.approx(1 / 8, rel=2e-3)
    assert area.max() / area.min() == pytest.approx(3 * math.sqrt(3), rel=0.01)
