"""OCTOPUS and PolarQuant, and the frame they share with TurboQuant: their laws (triplet
norm, octahedral coordinate, polar angles) against Monte-Carlo, the octahedral map,
Lloyd-Max optimality of their codebooks, joint rounding against the full grid, error and
bit accounting, jit/vmap/seeds, QJL, specs."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import EXACT, CodecError, measured_bits_per_element
from kvjax.codecs import KiviCodec, OctopusCodec, PolarQuantCodec
from kvjax.codecs.octopus import (
    direction_codebook,
    joint_round,
    norm_codebook,
    to_triplets,
)
from kvjax.codecs.polarquant import inverse_polar_transform, level_codebook, polar_transform
from kvjax.primitives import lloyd
from kvjax.primitives.octahedral import octahedral_decode, octahedral_encode
from kvjax.primitives.rotations import random_signs, randomized_hadamard
from kvjax.spec import parse_cache, parse_codec
from tests.kvjax.codecs.compiled import encode_decode


def gaussian(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def rotated_units(n, d, seed):
    """Anisotropic vectors (channel scales 0.2 .. 5), normalized and rotated with random
    signs per vector: what the codecs quantize."""
    x = np.asarray(gaussian((n, d), seed)) * np.geomspace(0.2, 5.0, d)
    signs = jax.vmap(lambda k: random_signs(k, d))(jax.random.split(jax.random.key(seed), n))
    return np.asarray(randomized_hadamard(x / np.linalg.norm(x, axis=1, keepdims=True), signs))


def bin_means(density, edges):
    """The density's mean over each bin, by the trapezoid rule on a fine grid."""
    out = []
    for a, b in itertools.pairwise(edges):
        fine = np.linspace(a, b, 2001)
        out.append(np.trapezoid(density.pdf(fine), fine) / (b - a))
    return np.array(out)


def assert_histogram_matches(samples, density, edges, tol):
    hist, _ = np.histogram(samples, bins=edges)
    hist = hist / (len(samples) * np.diff(edges))
    expected = bin_means(density, edges)
    assert np.abs(hist - expected).max() < tol * expected.max()


def relative_error(codec, x, seed=0):
    params = codec.init(jax.random.key(seed), x.shape[-1])
    codes, x_hat = encode_decode(codec, params, x)
    return float(jnp.sum((x_hat - x) ** 2) / jnp.sum(x**2)), codes


# -- laws -------------------------------------------------------------------------------


def test_triplet_norm_and_octahedral_coordinates_follow_their_laws():
    d = 64
    g = np.asarray(gaussian((3000, d), 5))
    uniform = g / np.linalg.norm(g, axis=1, keepdims=True)
    # exact for uniform points on the sphere; close after the randomized Hadamard, which
    # is not a Haar rotation (anisotropic inputs leave the triplet norms ~6% off the law)
    for y, tol in ((uniform, 0.04), (rotated_units(3000, d, 1), 0.1)):
        t = to_triplets(jnp.asarray(y))[:, : d // 3].reshape(-1, 3)
        rho = np.linalg.norm(np.asarray(t), axis=-1)
        assert_histogram_matches(rho, lloyd.sphere_block_norm(d, 3), np.linspace(0, 0.6, 25),
                                 tol)
        assert np.mean(rho**2) == pytest.approx(3 / d, rel=0.02)
    # a uniform direction on S^2 (exact), and the rotated triplets' directions (close)
    g = np.asarray(gaussian((200_000, 3), 2))
    for directions, tol in ((g, 0.03), (np.asarray(t), 0.1)):
        xi, eta = octahedral_encode(jnp.asarray(directions))
        for coord in (xi, eta):
            assert_histogram_matches(np.asarray(coord), lloyd.octahedral_coordinate(),
                                     np.linspace(-1, 1, 21), tol)


def test_polar_angles_follow_their_laws_per_level():
    d = 64
    g = np.asarray(gaussian((3000, d), 6))
    uniform = g / np.linalg.norm(g, axis=1, keepdims=True)
    # exact for uniform points; within ~7% after the (non-Haar) randomized Hadamard
    for y, tol in ((uniform, 0.05), (rotated_units(3000, d, 3), 0.1)):
        angles, radii = polar_transform(jnp.asarray(y), 4)
        np.testing.assert_allclose(np.linalg.norm(np.asarray(radii), axis=-1), 1.0, rtol=1e-5)
        level1 = np.asarray(angles[0]).ravel()
        assert level1.min() >= 0 and level1.max() < 2 * math.pi
        assert_histogram_matches(level1, lloyd.uniform(0, 2 * math.pi),
                                 np.linspace(0, 2 * math.pi, 17), tol)
        for level in (2, 3, 4):
            psi = np.asarray(angles[level - 1]).ravel()
            assert 0 <= psi.min() and psi.max() <= math.pi / 2
            assert_histogram_matches(psi, lloyd.polar_angle(2 ** (level - 1)),
                                     np.linspace(0.15, math.pi / 2 - 0.15, 19), tol)


@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize("which", ["octahedral", "triplet_norm", "polar_level3"])
def test_codebooks_meet_the_lloyd_max_conditions(which, bits):
    if which == "octahedral":
        q, density = direction_codebook(bits), lloyd.octahedral_coordinate()
    elif which == "triplet_norm":
        q, density = norm_codebook(128, bits), lloyd.sphere_block_norm(128, 3)
    else:
        q, density = level_codebook(3, bits), lloyd.polar_angle(4)
    c, t = np.asarray(q.centroids), np.asarray(q.thresholds)
    np.testing.assert_allclose(t, 0.5 * (c[1:] + c[:-1]), atol=1e-12)
    x = np.linspace(density.lo, density.hi, 2_000_001)
    f = density.pdf(x)
    assert np.trapezoid(f, x) == pytest.approx(1.0, abs=1e-6)
    cells = np.searchsorted(t, x)
    for i in range(2**bits):
        m = cells == i
        mean = np.trapezoid(x[m] * f[m], x[m]) / np.trapezoid(f[m], x[m])
        assert c[i] == pytest.approx(mean, abs=2e-5 * (density.hi - density.lo))


def test_zero_bit_codebooks_are_the_mean():
    q = norm_codebook(128, 0)
    assert q.bits == 0 and q.thresholds.shape == (0,)
    # E rho^2 = 3 / D, and the variance is the one level's error
    assert q.mse + q.centroids[0] ** 2 == pytest.approx(3 / 128, rel=1e-6)
    assert abs(direction_codebook(0).centroids[0]) < 1e-9
    for bad in (lambda: lloyd.sphere_block_norm(4, 3), lambda: lloyd.sphere_block_norm(8, 0),
                lambda: lloyd.polar_angle(0), lambda: lloyd.polar_angle(2.0)):
        with pytest.raises(ValueError, match="needs"):
            bad()


# -- joint rounding -----------------------------------------------------------------------


@pytest.mark.parametrize("direction_bits", [2, 3, 4])
def test_local_rounding_equals_the_full_grid_and_beats_scalar_rounding(direction_bits):
    t = to_triplets(jnp.asarray(rotated_units(100, 128, 5)))[:, :42].reshape(-1, 3)
    direction, norm = direction_codebook(direction_bits), norm_codebook(128, 2)
    local = jnp.stack(joint_round(t, direction, norm))
    full = jnp.stack(joint_round(t, direction, norm, full_grid=True))
    np.testing.assert_array_equal(local, full)

    def error(i_xi, i_eta, i_rho):
        m = octahedral_decode(lloyd.dequantize(i_xi, direction), lloyd.dequantize(i_eta, direction))
        return np.asarray(jnp.sum((t - lloyd.dequantize(i_rho, norm)[:, None] * m) ** 2, -1))

    xi, eta = octahedral_encode(t)
    scalar = error(lloyd.quantize(xi, direction), lloyd.quantize(eta, direction),
                   lloyd.quantize(jnp.linalg.norm(t, axis=-1), norm))
    joint = error(*local)
    assert np.all(joint <= scalar + 1e-7)
    assert joint.sum() < 0.97 * scalar.sum()


# -- the codecs ------------------------------------------------------------------------------


STORED_BITS = {  # per element at D = 128, byte-rounded streams + the fp16 norm
    "octopus:b2": 2.5, "octopus:d2,n2": 2 + 3 / 16, "octopus:b3": 3.5,
    "octopus:d3,n3": 3 + 3 / 16, "octopus:d0,n3": 1 + 3 / 16, "octopus:d3,n0": 2 + 3 / 16,
    "octopus:b2,qjl": 2.5 + 1 / 8, "turboquant:b2": 2.125, "polarquant:b2": 2.125,
    "polarquant:b3,l4": 4.0, "polarquant:b1": 1.125,
}


def test_bits_match_the_arrays_and_errors_order_as_the_design_says():
    x = gaussian((256, 128), 7)
    err = {}
    for spec, bits in STORED_BITS.items():
        codec = parse_codec(spec)
        err[spec], codes = relative_error(codec, x)
        assert measured_bits_per_element(codes, x.size) == codec.bits_per_element(128) == bits
    # the (b+1, b-1) split beats the uniform one by far more than its extra third of a bit
    assert err["octopus:b2"] < 0.7 * err["octopus:d2,n2"]
    assert err["octopus:b3"] < 0.75 * err["octopus:d3,n3"]
    assert err["octopus:b2"] < 0.8 * err["turboquant:b2"]
    # full-depth PolarQuant spends TurboQuant's bits within B and errs about as much
    assert err["polarquant:b2"] == pytest.approx(err["turboquant:b2"], rel=0.15)
    assert 0.1 < err["turboquant:b2"] < 0.13 and 0.07 < err["octopus:b2"] < 0.095
    # no direction bits: every triplet along one axis; no norm bits: one norm level
    assert err["octopus:d0,n3"] > 0.8 and err["octopus:d3,n0"] > err["octopus:d3,n3"]


@pytest.mark.parametrize("spec", ["octopus:b2", "polarquant:b2,l3", "turboquant:b3"])
def test_parameters_of_another_head_dim_are_an_error(spec):
    codec = parse_codec(spec)
    params = codec.init(jax.random.key(8), 32)
    with pytest.raises(CodecError, match="head_dim"):
        codec.encode(params, jnp.asarray(np.asarray(gaussian((8, 32), 9))[:, :16]))


@pytest.mark.parametrize("spec", ["octopus:b2", "octopus:d3,n0", "octopus:b3,qjl"])
def test_octopus_head_dims_below_its_triplet_law_are_a_codec_error(spec):
    """The triplet norm's law needs D >= 5: head dims 2 and 4 are rejected with that
    rule (not by the codebook builder), by every entry point that takes a head dim."""
    codec = parse_codec(spec)
    for d in (2, 4):
        for call in (codec.check_head_dim, codec.bits_per_element,
                     lambda d: codec.init(jax.random.key(0), d)):
            with pytest.raises(CodecError) as err:
                call(d)
            assert str(err.value) == (f"{spec}: head_dim must be a power of two >= 8 (the "
                                      f"law of a triplet's norm needs D >= 5), got {d}")
    codec.check_head_dim(8)


def test_polar_transform_inverts_and_too_many_levels_is_an_error():
    y = gaussian((5, 32), 10)
    for levels in (1, 3, 5):
        angles, radii = polar_transform(y, levels)
        assert [a.shape[-1] for a in angles] == [32 >> level for level in range(1, levels + 1)]
        np.testing.assert_allclose(inverse_polar_transform(angles, radii), y, atol=1e-5)
    with pytest.raises(CodecError, match="6 levels need head_dim >= 64"):
        parse_codec("polarquant:b2,l6").init(jax.random.key(0), 32)


def test_octopus_qjl_is_unbiased_over_draws():
    codec = parse_codec("octopus:b2,qjl")
    assert (codec.direction_bits, codec.norm_bits) == (2, 0) and not codec.scores_reconstruct
    d = 32
    x, q = gaussian((4, d), 11), gaussian((3, d), 12)

    @jax.jit
    def estimate(key, x, q):
        params = codec.init(key, d)
        codes = codec.encode(params, x)
        via_decode = jnp.matmul(q, codec.decode(params, codes).T, precision=EXACT)
        return codec.scores(params, q, codes), via_decode

    s, via_decode = jax.vmap(estimate, in_axes=(0, None, None))(
        jax.random.split(jax.random.key(13), 2000), x, q)
    np.testing.assert_allclose(s, via_decode, atol=1e-3)
    err = np.asarray(s) - np.asarray(q @ x.T)
    stderr = err.std(axis=0) / np.sqrt(err.shape[0])
    assert np.all(np.abs(err.mean(axis=0)) < 4 * stderr + 1e-3)
    assert np.abs(err).mean() > 0.1  # any one draw errs


@pytest.mark.parametrize(("spec", "needle"), [
    ("octopus", "expected bB"), ("octopus:3", "unexpected value '3'"), ("octopus:b0", "1..7"),
    ("octopus:b8", "1..7"), ("octopus:b1,qjl", "2..8"), ("octopus:b2,d3", "expected bB"),
    ("octopus:d3", "expected bB"), ("octopus:d9,n1", "0..8"), ("octopus:d0,n0", "both 0"),
    ("octopus:b2,qjl,qjl", "'qjl' given twice"), ("polarquant", "expected bB"),
    ("polarquant:b0", "1..7"), ("polarquant:b2,l0", "1..16"),
    ("polarquant:b2,x1", "unknown option 'x1'"), ("polarquant:b2,qjl", "unknown option 'qjl'"),
])
def test_bad_specs(spec, needle):
    with pytest.raises(CodecError, match=needle):
        parse_codec(spec)


def test_specs_round_trip_and_value_codecs():
    for spec in ("octopus:b3", "octopus:b3,qjl", "octopus:d4,n1", "polarquant:b2",
                 "polarquant:b3,l4"):
        assert parse_codec(spec).spec == spec and parse_codec(parse_codec(spec).spec) == \
            parse_codec(spec)
    assert parse_codec("octopus:d4,n2") == OctopusCodec.nominal(3)
    assert parse_codec("octopus:qjl,b3") == OctopusCodec(direction_bits=3, norm_bits=1, qjl=True)
    assert parse_codec("polarquant:l4,b3") == PolarQuantCodec(bits=3, levels=4)
    for spec, v_bits in (("octopus:b3", 3), ("octopus:b2,qjl", 2), ("polarquant:b1", 2),
                         ("octopus:d4,n1", 3)):
        assert parse_cache(spec).v == KiviCodec(bits=v_bits, group=32, per_token=True)
