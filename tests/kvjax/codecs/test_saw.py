"""Tests of the SAW-INT4 codec (block-diagonal Hadamard rotation + token-wise INT-N)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import CodecError, measured_bits_per_element
from kvjax.codecs import IntCodec, SawCodec
from kvjax.primitives.rotations import hadamard
from kvjax.spec import parse_cache, parse_codec
from tests.kvjax.codecs.compiled import encode_decode

KEY = jax.random.key(0)


def gaussian(shape, seed=0):
    return np.array(jax.random.normal(jax.random.key(seed), shape), np.float32)


def with_outlier_channels(tokens, d, channels=(3, 17, 40), scale=30.0, seed=0):
    x = gaussian((tokens, d), seed)
    x[:, list(channels)] *= scale
    return x


def roundtrip(codec, x, key=KEY):
    params = codec.init(key, x.shape[-1])
    codes, x_hat = encode_decode(codec, params, jnp.asarray(x))
    return params, codes, np.asarray(x_hat)


@pytest.mark.parametrize("spec,expected,canonical", [
    ("saw", SawCodec(), "saw:b4"),
    ("saw:h64", SawCodec(block=64), "saw:h64,b4"),
    ("saw:h16,b8,signs", SawCodec(block=16, bits=8, signs=True), "saw:h16,b8,signs"),
    ("saw:kv,h128", SawCodec(block=128, rotate_values=True), "saw:h128,b4,kv"),
    ("saw:b3,kv", SawCodec(bits=3, rotate_values=True), "saw:b3,kv"),
])
def test_spec_grammar(spec, expected, canonical):
    codec = parse_codec(spec)
    assert codec == expected
    assert codec.spec == canonical
    assert parse_codec(codec.spec) == codec


@pytest.mark.parametrize("head_dim,block", [(64, 64), (128, 128), (256, 128), (96, 32),
                                            (48, 16), (80, 16), (16, 16)])
def test_default_block_is_the_largest_that_divides_the_head_dim(head_dim, block):
    codec = parse_codec("saw")
    assert codec.block is None and codec.rotation_block(head_dim) == block
    explicit = SawCodec(block=block)
    assert explicit.rotation_block(head_dim) == block and explicit != codec
    params = codec.init(KEY, head_dim)
    x = gaussian((9, head_dim))
    np.testing.assert_array_equal(np.asarray(codec.rotate(params, x)),
                                  np.asarray(explicit.rotate(params, x)))
    assert codec.bits_per_element(head_dim) == IntCodec(bits=4).bits_per_element(head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_saw_round_trips_and_scores_like_its_block(head_dim):
    """Plain ``saw`` at the two common head dims: the codes, reconstruction, scores and
    the kernel format's rotation are those of the block it resolves to."""
    codec = SawCodec(signs=True, rotate_values=True)
    explicit = dataclasses.replace(codec, block=head_dim)
    x = with_outlier_channels(24, head_dim)
    params, codes, x_hat = roundtrip(codec, x)
    _, codes_h, x_hat_h = roundtrip(explicit, x)
    assert jax.tree.all(jax.tree.map(np.array_equal, codes, codes_h))
    np.testing.assert_array_equal(x_hat, x_hat_h)
    assert measured_bits_per_element(codes, x.size) == codec.bits_per_element(head_dim)
    q = jnp.asarray(gaussian((3, head_dim), seed=1))
    np.testing.assert_array_equal(np.asarray(codec.scores(params, q, codes)),
                                  np.asarray(explicit.scores(params, q, codes)))
    [fmt] = codec.kernel_formats()
    [fmt_h] = explicit.kernel_formats()
    np.testing.assert_array_equal(np.asarray(fmt.rotation(params, head_dim)),
                                  np.asarray(fmt_h.rotation(params, head_dim)))
    # the rotation is worth having at either head dim
    _, _, x_int = roundtrip(IntCodec(bits=4), x)
    assert np.mean((x_hat - x) ** 2) < 0.5 * np.mean((x_int - x) ** 2)


@pytest.mark.parametrize("spec,needle", [
    ("saw:h48", "16, 32, 64, 128"),
    ("saw:h256", "16, 32, 64, 128"),
    ("saw:b1", "2..8"),
    ("saw:b9", "2..8"),
    ("saw:h64,h64", "twice"),
    ("saw:signs,signs", "twice"),
    ("saw:rot", "unknown option"),
])
def test_bad_specs(spec, needle):
    with pytest.raises(CodecError, match=needle):
        parse_codec(spec)


def test_keys_only_by_default():
    config = parse_cache("saw:h64")
    k, v = config.k, config.v
    assert k == SawCodec(block=64) and v == IntCodec(bits=4)
    config = parse_cache("saw:h64,kv")
    k, v = config.k, config.v
    assert k == v == SawCodec(block=64, rotate_values=True)


@pytest.mark.parametrize("block", [16, 64, 128])
@pytest.mark.parametrize("signs", [False, True])
def test_rotation_is_orthogonal_and_matches_dense_hadamard(block, signs):
    codec = SawCodec(block=block, signs=signs)
    params = codec.init(KEY, 128)
    x = gaussian((5, 128))
    y = np.asarray(codec.rotate(params, x))
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(codec.unrotate(params, y)), x, atol=1e-5)
    # dense reference: block-diagonal orthonormal Sylvester-Hadamard after the signs
    h = np.asarray(hadamard(np.eye(block, dtype=np.float32)))
    dense = np.kron(np.eye(128 // block), h) @ np.diag(np.asarray(params["signs"]))
    np.testing.assert_allclose(y, x @ dense.T, atol=1e-5)


def test_reconstruction_is_int_of_the_rotated_vector():
    codec = SawCodec(block=64, signs=True)
    x = gaussian((33, 128))
    params, codes, x_hat = roundtrip(codec, x)
    y = codec.rotate(params, x)
    int4 = IntCodec(bits=4)
    y_hat = np.asarray(int4.decode(None, int4.encode(None, y)))
    np.testing.assert_array_equal(np.asarray(codec.decode_rotated(params, codes)), y_hat)
    np.testing.assert_allclose(x_hat, np.asarray(codec.unrotate(params, y_hat)), atol=1e-5)
    # error within half a quantization step of the rotated grid, rotated back (norms kept)
    step = np.asarray(codes["scale"], np.float32)
    err = np.linalg.norm(x_hat - x, axis=-1)
    assert np.all(err <= 0.5 * step[:, 0] * np.sqrt(128) + 1e-3)


@pytest.mark.parametrize("block", [16, 64, 128])
def test_rotation_beats_plain_int4_on_outlier_channels(block):
    x = with_outlier_channels(256, 128)
    _, _, x_saw = roundtrip(SawCodec(block=block), x)
    _, _, x_int = roundtrip(IntCodec(bits=4), x)
    mse_saw, mse_int = np.mean((x_saw - x) ** 2), np.mean((x_int - x) ** 2)
    assert mse_saw < 0.5 * mse_int, (mse_saw, mse_int)


def test_larger_blocks_mix_more():
    x = with_outlier_channels(256, 128)
    errs = [np.mean((roundtrip(SawCodec(block=b), x)[2] - x) ** 2) for b in (16, 64, 128)]
    assert errs[0] > errs[1] > errs[2]


@pytest.mark.parametrize("signs", [False, True])
def test_scores_rotate_the_query_and_equal_decode_then_dot(signs):
    codec = SawCodec(block=32, signs=signs)
    x = gaussian((40, 64))
    params, codes, x_hat = roundtrip(codec, x)
    q = gaussian((3, 64), seed=1)
    got = np.asarray(codec.scores(params, jnp.asarray(q), codes))
    np.testing.assert_allclose(got, q @ x_hat.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("d,bits", [(64, 4), (128, 4), (128, 8), (96, 2), (96, 3)])
def test_bits_formula_equals_measured(d, bits):
    codec = SawCodec(block=32, bits=bits)
    _, codes, _ = roundtrip(codec, gaussian((17, d)))
    assert measured_bits_per_element(codes, 17 * d) == codec.bits_per_element(d)
    assert codec.bits_per_element(d) == IntCodec(bits=bits).bits_per_element(d)
    assert SawCodec().bits_per_element(128) == 4.25


def test_signs_are_ones_without_the_option():
    assert np.all(np.asarray(SawCodec(block=64).init(KEY, 128)["signs"]) == 1.0)


def test_zero_and_constant_rows():
    codec = SawCodec(block=64, signs=True)
    x = gaussian((6, 128))
    x[1] = 0.0
    x[4] = 2.5   # a constant row is not constant once rotated: it quantizes like any other
    _, codes, x_hat = roundtrip(codec, x)
    np.testing.assert_array_equal(x_hat[1], 0.0)
    step = float(np.asarray(codes["scale"], np.float32)[4, 0])
    assert step > 0
    assert np.linalg.norm(x_hat[4] - 2.5) <= 0.5 * step * np.sqrt(128) + 1e-3
    assert np.all(np.isfinite(x_hat))


@pytest.mark.parametrize("d", [48, 80, 100])
def test_head_dim_not_divisible_by_block(d):
    codec = SawCodec(block=32)
    with pytest.raises(CodecError, match="does not divide"):
        codec.init(KEY, d)
    with pytest.raises(CodecError, match="does not divide"):
        codec.bits_per_element(d)
    with pytest.raises(CodecError, match="does not divide"):
        SawCodec(block=128).init(KEY, 64)


@pytest.mark.parametrize("d", [8, 24, 40, 100])
def test_default_block_refuses_a_head_dim_no_block_divides(d):
    codec = parse_codec("saw")
    for check in (codec.check_head_dim, codec.bits_per_element,
                  lambda d: codec.init(KEY, d)):
        with pytest.raises(CodecError, match=f"no rotation block .* divides head_dim {d}"):
            check(d)


# -- fitted variants: residual VQ (cC) and the query-aware basis (hess) --------------------


def clustered(tokens, d, clusters=12, seed=0, spread=0.3):
    """Vectors around a few centers far apart: what centroids can take away."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((clusters, d)).astype(np.float32) * 4
    return (centers[rng.integers(0, clusters, tokens)]
            + rng.standard_normal((tokens, d)).astype(np.float32) * spread)


@pytest.mark.parametrize("spec,index_bits", [("saw:h32,c1", 0), ("saw:h32,c16", 8),
                                             ("saw:h32,c256", 8), ("saw:h32,c2048", 16)])
def test_centroid_bits_are_what_the_arrays_hold(spec, index_bits):
    codec = parse_codec(spec)
    assert codec.needs_fit
    x = clustered(2048, 64)
    params = codec.fit(KEY, x)
    codes, _ = encode_decode(codec, params, jnp.asarray(x[:64]))
    assert measured_bits_per_element(codes, x[:64].size) == codec.bits_per_element(64)
    assert codec.bits_per_element(64) == IntCodec(bits=4).bits_per_element(64) + index_bits / 64
    assert codec.kernel_formats() == ()


def test_fitted_centroids_cut_the_error_on_held_out_vectors():
    train, test = clustered(4096, 64, seed=1), clustered(512, 64, seed=1)[::-1].copy()
    test += np.random.default_rng(9).standard_normal(test.shape).astype(np.float32) * 0.05
    errors = {}
    for spec in ("saw:b2", "saw:b2,c1", "saw:b2,c16", "saw:b2,c256"):
        codec = parse_codec(spec)
        params = codec.fit(KEY, train) if codec.needs_fit else codec.init(KEY, 64)
        _, x_hat = encode_decode(codec, params, jnp.asarray(test))
        errors[spec] = float(np.mean((np.asarray(x_hat) - test) ** 2) / np.mean(test**2))
    assert errors["saw:b2,c16"] < 0.5 * errors["saw:b2"]
    assert errors["saw:b2,c256"] < errors["saw:b2,c16"]


def test_unfitted_parameters_compute_plain_saw():
    x = with_outlier_channels(32, 64)
    _, _, plain = roundtrip(parse_codec("saw:b4"), x)
    for spec in ("saw:b4,c1", "saw:b4,c16,hess"):
        _, _, neutral = roundtrip(parse_codec(spec), x)
        np.testing.assert_allclose(neutral, plain, rtol=1e-6, atol=1e-6)


def test_the_query_aware_basis_is_the_moments_eigenbasis_and_keeps_scores_exact():
    rng = np.random.default_rng(3)
    queries = rng.standard_normal((500, 64)).astype(np.float32) * np.linspace(4, 0.1, 64)
    moment = jnp.asarray(queries.T @ queries)
    codec = parse_codec("saw:h64,hess")
    params = codec.fit(KEY, with_outlier_channels(128, 64), moment)
    basis = np.asarray(params["basis"])
    np.testing.assert_allclose(basis.T @ basis, np.eye(64), atol=1e-4)
    # the first direction is the queries' largest-variance channel
    assert np.argmax(np.abs(basis[:, 0])) == 0
    x = with_outlier_channels(40, 64, seed=4)
    y = np.asarray(codec.rotate(params, jnp.asarray(x)))
    np.testing.assert_allclose(np.asarray(codec.unrotate(params, jnp.asarray(y))), x,
                               rtol=1e-4, atol=1e-3)
    q = jnp.asarray(queries[:5])
    codes = codec.encode(params, jnp.asarray(x))
    expected = np.asarray(q) @ np.asarray(codec.decode(params, codes)).T
    np.testing.assert_allclose(codec.scores(params, q, codes), expected, rtol=1e-4, atol=1e-2)
    assert codec.kernel_formats()  # an orthogonal rotation: the int kernel reads it


def test_fits_are_seeded_and_refuse_too_little_data():
    x = clustered(300, 32)
    codec = parse_codec("saw:h32,c16,hess")
    a, b = codec.fit(KEY, x), codec.fit(KEY, x)
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))
    other = codec.fit(jax.random.key(1), x)
    assert not np.array_equal(np.asarray(other["centroids"]), np.asarray(a["centroids"]))
    with pytest.raises(CodecError, match="300 calibration vectors for 2048 centroids"):
        parse_codec("saw:h32,c2048").fit(KEY, x)
    with pytest.raises(CodecError, match=r"must be \[N, D\]"):
        codec.fit(KEY, x[None])
    with pytest.raises(CodecError, match="no fitted parameters"):
        parse_codec("saw:b4").fit(KEY, x)
