"""TurboQuant-MSE (rotation + Lloyd-Max per coordinate) and the on-disk codebook cache:
the sphere-coordinate marginal against Monte-Carlo, Lloyd-Max optimality, error against
theory, bit accounting, jit/vmap/seeds, bad input and specs."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import EXACT, CodecError, measured_bits_per_element
from kvjax.codecs import KiviCodec, TurboQuantCodec
from kvjax.codecs.turboquant import rotated_coordinate_codebook
from kvjax.primitives import codebooks, lloyd
from kvjax.primitives.rotations import random_signs, randomized_hadamard
from kvjax.spec import parse_cache, parse_codec
from tests.kvjax.codecs.compiled import encode_decode


def gaussian(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_rotated_coordinates_follow_the_sphere_marginal():
    d = 64
    # anisotropic vectors (channel scales 0.2 .. 5), rotated with random signs per vector;
    # a single spike would map to +-1/sqrt(D) instead: the Hadamard rotation is not Haar
    x = np.asarray(gaussian((4000, d), 1)) * np.geomspace(0.2, 5.0, d)
    signs = jax.vmap(lambda k: random_signs(k, d))(jax.random.split(jax.random.key(2), 4000))
    y = np.asarray(randomized_hadamard(x / np.linalg.norm(x, axis=1, keepdims=True), signs))
    density = lloyd.sphere_coordinate(d)
    edges = np.linspace(-0.6, 0.6, 25)
    hist, _ = np.histogram(y.ravel(), bins=edges, density=True)
    fine = np.linspace(-0.6, 0.6, 24001)
    pdf = density.pdf(fine)
    expected = np.array([np.trapezoid(pdf[(fine >= a) & (fine <= b)],
                                      fine[(fine >= a) & (fine <= b)]) / (b - a)
                         for a, b in itertools.pairwise(edges)])
    assert np.abs(hist - expected).max() < 0.06 * expected.max()
    # and uniform points on the sphere, the exact case
    g = np.asarray(gaussian((20000, d), 3))
    u = (g / np.linalg.norm(g, axis=1, keepdims=True)).ravel()
    assert np.var(u) == pytest.approx(1 / d, rel=0.02)


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_codebook_meets_the_lloyd_max_conditions(bits):
    d = 64
    q = rotated_coordinate_codebook(d, bits)
    c, t = np.asarray(q.centroids), np.asarray(q.thresholds)
    np.testing.assert_allclose(t, 0.5 * (c[1:] + c[:-1]), atol=1e-12)  # midpoints
    x = np.linspace(-1, 1, 2_000_001)
    f = (1 - x**2) ** ((d - 3) / 2)
    cells = np.searchsorted(t, x)
    for i in range(2**bits):  # each centroid is its cell's conditional mean
        m = cells == i
        assert c[i] == pytest.approx(np.trapezoid(x[m] * f[m], x[m]) / np.trapezoid(f[m], x[m]),
                                     abs=2e-5)
    assert np.allclose(c, -c[::-1])  # the density is symmetric


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_error_matches_theory_and_bits_match_the_arrays(bits):
    codec = TurboQuantCodec(bits=bits)
    x = gaussian((512, 64), bits)
    params = codec.init(jax.random.key(0), 64)
    codes, x_hat = encode_decode(codec, params, x)
    err = float(jnp.sum((x_hat - x) ** 2) / jnp.sum(x**2))
    theory = 64 * rotated_coordinate_codebook(64, bits).mse
    assert err == pytest.approx(theory, rel=0.08)
    assert measured_bits_per_element(codes, x.size) == codec.bits_per_element(64)
    assert codec.bits_per_element(64) == bits + 16 / 64
    # the TurboQuant paper's MSE for unit vectors: 0.117 / 0.03 / 0.009 at 2 / 3 / 4 bits
    assert {2: 0.117, 3: 0.0345, 4: 0.0095}[bits] == pytest.approx(theory, rel=0.05)


@pytest.mark.parametrize(("spec", "needle"), [
    ("turboquant", "expected bB"), ("turboquant:3", "unexpected value '3'"),
    ("turboquant:b0", "1..8"), ("turboquant:b9", "1..8"), ("turboquant:b2,b3", "'b' given twice"),
])
def test_bad_specs(spec, needle):
    with pytest.raises(CodecError, match=needle):
        parse_codec(spec)


def test_spec_and_value_codec():
    codec = parse_codec("turboquant:b3")
    assert codec == TurboQuantCodec(bits=3) and parse_codec(codec.spec) == codec
    assert parse_cache("turboquant:b3").v == KiviCodec(bits=3, group=32, per_token=True)
    assert parse_cache("turboquant:b1").v == KiviCodec(bits=2, group=32, per_token=True)


def test_codebooks_are_designed_once_and_read_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_CODEBOOKS", str(tmp_path))
    codebooks.clear_memo()
    density = lloyd.sphere_coordinate(16)
    first = codebooks.lloyd_codebook(density, 2)
    (path,) = tmp_path.glob("*.npz")
    codebooks.clear_memo()

    def no_design(*args, **kwargs):
        raise AssertionError("designed again instead of read from disk")

    monkeypatch.setattr(codebooks, "lloyd_max", no_design)
    again = codebooks.lloyd_codebook(density, 2)
    np.testing.assert_array_equal(again.centroids, first.centroids)
    assert again.mse == first.mse and again.converged
    path.write_bytes(b"not a codebook")  # a corrupt file is designed again
    codebooks.clear_memo()
    monkeypatch.setattr(codebooks, "lloyd_max", lloyd.lloyd_max)
    np.testing.assert_array_equal(codebooks.lloyd_codebook(density, 2).centroids,
                                  first.centroids)
    codebooks.clear_memo()


def test_qjl_estimator_is_unbiased_over_sketches_and_matches_decode():
    codec = TurboQuantCodec(bits=2, qjl=True)
    d = 32
    x = gaussian((4, d), 11)
    q = gaussian((3, d), 12)

    @jax.jit
    def estimate(key, x, q):
        params = codec.init(key, d)
        codes = codec.encode(params, x)
        s = codec.scores(params, q, codes)
        # the reconstruction's inner products are the same estimates
        return s, jnp.matmul(q, codec.decode(params, codes).T, precision=EXACT)

    s, via_decode = jax.vmap(estimate, in_axes=(0, None, None))(
        jax.random.split(jax.random.key(13), 4000), x, q)
    np.testing.assert_allclose(s, via_decode, atol=1e-3)
    true = np.asarray(q @ x.T)
    err = np.asarray(s) - true
    stderr = err.std(axis=0) / np.sqrt(err.shape[0])
    # unbiased over the draw of the rotation and the sketch ...
    assert np.all(np.abs(err.mean(axis=0)) < 4 * stderr + 1e-3)
    # ... though any one draw errs: the per-draw error is far from zero
    assert np.abs(err).mean() > 0.1
    mse_only = TurboQuantCodec(bits=2)
    assert codec.bits_per_element(d) == 2 + 32 / d
    assert mse_only.scores_reconstruct and not codec.scores_reconstruct


def test_qjl_specs():
    assert parse_codec("turboquant:b3,qjl") == TurboQuantCodec(bits=3, qjl=True)
    assert parse_codec("turboquant:qjl,b3").spec == "turboquant:b3,qjl"
    with pytest.raises(CodecError, match=r"2\.\.8"):
        parse_codec("turboquant:b1,qjl")
    with pytest.raises(CodecError, match="'qjl' given twice"):
        parse_codec("turboquant:b3,qjl,qjl")
