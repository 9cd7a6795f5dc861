"""Baseline codecs (bf16, fp8, int:N, kivi:N,gG[,token]): accuracy bounds, a numpy
reference, exact bit accounting, packing, jit/vmap, non-finite and degenerate inputs,
and the spec grammar.

Eager JAX compiles every primitive for every new shape, and each ``jax.jit`` of a codec
costs a compilation; on the 2-core CI machines that dominates the run time. So most
tests read from a few cached batches: one jit encodes and decodes a whole array with
*every* codec at once (:func:`roundtrip_all`), and each parametrized test checks its own
codec's slice. Only the tests about eager behaviour (errors, eager == jit) run eagerly.
"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import Codec, CodecError, measured_bits_per_element
from kvjax.codecs import Bf16Codec, Fp8Codec, IntCodec, KiviCodec
from kvjax.spec import parse_cache, parse_codec, registered
from tests.kvjax.codecs.compiled import FAST_COMPILE

INT_BITS = list(range(2, 9))
KIVI_SPECS = [
    "kivi:2,g32",
    "kivi:3,g32",
    "kivi:4,g16",
    "kivi:3,g7",
    "kivi:8,g1",
    "kivi:2,g32,token",
    "kivi:3,g7,token",
    "kivi:5,g128,token",
]
SPECS = ["bf16", "fp8", *[f"int:{n}" for n in INT_BITS], *KIVI_SPECS]
INTEGER_SPECS = [s for s in SPECS if s.startswith(("int", "kivi"))]
CODECS = tuple(parse_codec(s) for s in SPECS)
HEAD_DIMS = [64, 128, 80]  # 80: codes of 3, 5 and 7 bits do not fill whole words
TOKENS = 224  # whole blocks for every key group above (1, 7, 16, 32)
OUTLIER_CHANNELS = [3, 17, 40]
CONSTANTS = [0.0, 3.3, -1234.5, 1e-3, 60000.0, -7.25]
ZERO_ROWS = [0, 9, 31, 200]
BAD_AT = (5, 7)  # (token, channel) of the non-finite or too large element
SLICES = [
    "gauss0", "gauss1", "outliers", *[f"const{i}" for i in range(len(CONSTANTS))],
    "zero_rows", "clean", "tiny", "tinier", "nan", "nan_as_zero", "inf", "-inf", "huge",
]
FINITE = [name for name in SLICES if name not in ("nan", "inf", "-inf", "huge")]
def gaussian(seed, shape):
    """Seeded standard normal float32 array."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def roundtrip_all(codecs, x):
    """``{spec: (codes, x_hat)}`` for every codec of ``codecs`` in one compilation."""
    out = {}
    for codec in codecs:
        codes = codec.encode({}, x)
        out[codec.spec] = (codes, codec.decode({}, codes))
    return out


def make_batch(d):
    """``x[len(SLICES), TOKENS, d]``: one named slice per kind of input."""
    rng = np.random.default_rng(d)
    clean = rng.standard_normal((TOKENS, d)).astype(np.float32)
    slices = {
        "gauss0": 3.0 * rng.standard_normal((TOKENS, d)) + 0.5,
        "gauss1": 3.0 * rng.standard_normal((TOKENS, d)) + 0.5,
        "outliers": clean * np.where(np.isin(np.arange(d), OUTLIER_CHANNELS), 10.0, 1.0),
        "clean": clean,
    }
    for i, c in enumerate(CONSTANTS):
        slices[f"const{i}"] = np.full((TOKENS, d), c)
    # metadata in fp16's subnormal range: scales and zeros on its absolute grid
    slices["tiny"] = 1e-6 * clean
    slices["tinier"] = 2e-8 * clean
    slices["zero_rows"] = clean.copy()
    slices["zero_rows"][ZERO_ROWS] = 0.0
    for name, bad in [("nan", np.nan), ("nan_as_zero", 0.0), ("inf", np.inf),
                      ("-inf", -np.inf), ("huge", 1e8)]:
        slices[name] = clean.copy()
        slices[name][BAD_AT] = bad
    return np.stack([slices[name] for name in SLICES]).astype(np.float32)


@functools.cache
def batch(d):
    """Every codec's round trip of :func:`make_batch` under jit, as numpy arrays.

    Slices never share a quantization group, so each slice is an independent input;
    non-finite ones are sanitized (as under any jit), not rejected.
    """
    x = make_batch(d)
    return x, jax.tree.map(np.asarray, roundtrip_all(CODECS, jnp.asarray(x)))


def at(name):
    """Index of a named slice of :func:`make_batch`."""
    return SLICES.index(name)


def assert_codes_equal(a, b):
    """Same leaves, shapes, dtypes and bits."""
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


FP16_TINY = np.float32(np.finfo(np.float16).smallest_normal)
FP16_STEP = np.float32(np.finfo(np.float16).smallest_subnormal)


def to_fp16(x):
    """Round to fp16, subnormals included, as stored zeros are."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def scale_to_fp16(scale):
    """The documented rule of stored scales: fp16 to nearest in the normal range, rounded
    up to a multiple of the smallest subnormal below it (so the top code never clips)."""
    scale = np.asarray(scale, np.float32)
    up = np.ceil(scale / FP16_STEP) * FP16_STEP
    return np.where(scale < FP16_TINY, up, to_fp16(scale)).astype(np.float32)


def element_grid(codec, codes, shape):
    """The stored fp16 (scale, zero) of every element of ``x[shape]``, expanded from the
    documented layout without the codec's own decode."""
    scale = np.asarray(codes["scale"], np.float32)
    zero = np.asarray(codes["zero"], np.float32)
    d = shape[-1]
    if isinstance(codec, IntCodec):
        return np.broadcast_to(scale, shape), np.broadcast_to(zero, shape)
    if codec.per_token:
        size = min(codec.group, d)
        return np.repeat(scale, size, axis=-1)[..., :d], np.repeat(zero, size, axis=-1)[..., :d]
    return np.repeat(scale, codec.group, axis=-2), np.repeat(zero, codec.group, axis=-2)


def element_ranges(codec, x):
    """Per element, the (min, max) of the set it is quantized with, read off the paper's
    definition: the vector (int), G tokens of one channel (KIVI keys), G channels of
    one token (KIVI values, the last group ragged)."""
    if isinstance(codec, IntCodec):
        lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
        return np.broadcast_to(lo, x.shape), np.broadcast_to(hi, x.shape)
    lo, hi = np.empty_like(x), np.empty_like(x)
    if codec.per_token:
        for start in range(0, x.shape[-1], codec.group):
            part = x[..., start : start + codec.group]
            lo[..., start : start + codec.group] = part.min(-1, keepdims=True)
            hi[..., start : start + codec.group] = part.max(-1, keepdims=True)
        return lo, hi
    for start in range(0, x.shape[-2], codec.group):
        part = x[..., start : start + codec.group, :]
        lo[..., start : start + codec.group, :] = part.min(-2, keepdims=True)
        hi[..., start : start + codec.group, :] = part.max(-2, keepdims=True)
    return lo, hi


# -- accuracy ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", INTEGER_SPECS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_integer_codecs_match_numpy_reference(spec, d):
    codec = parse_codec(spec)
    x, results = batch(d)
    codes, x_hat = results[spec]
    idx = [at(name) for name in FINITE]
    x, x_hat = x[idx], x_hat[idx]
    codes = {k: v[idx] for k, v in codes.items()}
    levels = 2**codec.bits - 1
    lo, hi = element_ranges(codec, x)
    scale = scale_to_fp16((hi - lo) * np.float32(1 / levels))
    zero = to_fp16(lo)
    stored_scale, stored_zero = element_grid(codec, codes, x.shape)
    np.testing.assert_array_equal(stored_scale, scale)
    np.testing.assert_array_equal(stored_zero, zero)
    q = np.clip(np.round((x - zero) / np.where(scale > 0, scale, 1)), 0, levels)
    # one code step is >= 1/255 of the range, far above this tolerance: equal codes
    np.testing.assert_allclose(x_hat, zero + q * scale, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", INTEGER_SPECS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_integer_codecs_error_within_half_step(spec, d):
    codec = parse_codec(spec)
    x, results = batch(d)
    codes, x_hat = results[spec]
    idx = [at(name) for name in FINITE]
    scale, zero = element_grid(codec, codes, x.shape)
    scale, zero, x, x_hat = scale[idx], zero[idx], x[idx], x_hat[idx]
    levels = 2**codec.bits - 1
    # interior elements round to the nearest grid point (half a step); the extremes may
    # also be off by the fp16 rounding of the zero and of the scale times the levels
    # (a zero in fp16's subnormal range is stored on the subnormal grid, within half a
    # step of it; a subnormal scale is rounded up, which no code pays for beyond scale/2)
    slack = 2.0**-10 * (np.abs(zero) + levels * scale) + FP16_STEP
    excess = np.abs(x - x_hat) - (scale / 2 + slack)
    assert np.all(excess <= 0), float(np.max(excess))


@pytest.mark.parametrize("spec", SPECS)
def test_tiny_vectors_keep_their_error_up_to_fp16_subnormal_steps(spec):
    # the same vectors at 1e-6 and 2e-8: metadata below fp16's smallest normal costs an
    # absolute error of about FP16_STEP per element, never the whole vector
    x, results = batch(64)
    x_hat = results[spec][1]
    err = {name: np.linalg.norm(x_hat[at(name)] - x[at(name)]) for name in SLICES}
    floor = FP16_STEP * np.sqrt(x[0].size)
    for name, factor in (("tiny", 1e-6), ("tinier", 2e-8)):
        assert err[name] <= 1.25 * factor * err["clean"] + floor, name


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_fp8_error_within_e4m3_rounding(d):
    x, results = batch(d)
    codes, x_hat = results["fp8"]
    idx = [at(name) for name in FINITE]
    x, x_hat, scale = x[idx], x_hat[idx], codes["scale"][idx].astype(np.float32)
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    # floored at the smallest normal fp16 so that tiny vectors keep a positive scale
    np.testing.assert_allclose(scale, np.maximum(amax / 448, 2.0**-14), rtol=2.0**-10)
    # 3 mantissa bits: half an ulp is 2**-4 relative; subnormal spacing 2**-9 of the scale
    bound = 2.0**-4 * np.abs(x) + 2.0**-10 * scale + 1e-6 * np.abs(x)
    assert np.all(np.abs(x - x_hat) <= bound)


def test_fp8_small_and_large_vectors():
    x = gaussian(2, (4, 16, 64)) * jnp.asarray([1e-3, 1.0, 500.0, 1e6])[:, None, None]
    codes, x_hat = roundtrip_all((Fp8Codec(),), x)["fp8"]
    x, x_hat = np.asarray(x), np.asarray(x_hat)
    scale = np.asarray(codes["scale"], np.float32)
    bound = 2.0**-4 * np.abs(x) + 2.0**-10 * scale + 1e-6 * np.abs(x)
    assert np.all(np.abs(x - x_hat) <= bound)


def test_fp8_payload_is_e4m3_bytes():
    x = jnp.asarray([[448.0, -448.0, 1.0, 0.0, 0.5, 2.0**-9, -(2.0**-6), 0.0]], jnp.float32)
    codes, _ = roundtrip_all((Fp8Codec(),), x)["fp8"]
    # amax 448 gives scale 1: the payload is the plain e4m3fn encoding of x
    assert float(codes["scale"][0, 0]) == 1.0
    expected = [0x7E, 0xFE, 0x38, 0x00, 0x30, 0x01, 0x88, 0x00]
    assert np.asarray(codes["codes"])[0].tolist() == expected


def test_bf16_is_exact_up_to_bf16_rounding():
    codec = Bf16Codec()
    x, results = batch(64)
    codes, x_hat = results["bf16"]
    assert codes["x"].dtype == jnp.uint16   # the bfloat16 bits
    assert codec.values(codes).dtype == jnp.bfloat16
    idx = [at(name) for name in FINITE]
    expected = np.asarray(jnp.asarray(x[idx]).astype(jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(x_hat[idx], expected)
    # bf16 input (what a model produces) round-trips bit-exactly
    xb = jnp.asarray(x[:2, :8]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(roundtrip_all((codec,), xb)["bf16"][1]),
                                  np.asarray(xb, np.float32))
    assert not codec.lossy and all(c.lossy for c in CODECS if c.name != "bf16")


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_kivi_values_with_one_group_are_int(d):
    _, results = batch(d)  # G = 128 >= D: one (scale, zero) per token, as int:5
    np.testing.assert_array_equal(results["kivi:5,g128,token"][1], results["int:5"][1])


def mse(results, spec, name, x):
    """Mean squared error of one codec on one named slice."""
    return float(np.mean((results[spec][1][at(name)] - x[at(name)]) ** 2))


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_error_decreases_with_bits(d):
    x, results = batch(d)
    for name in ("gauss0", "gauss1"):
        errors = [mse(results, f"int:{n}", name, x) for n in INT_BITS]
        # each extra bit halves the step: about 4x less error, certainly more than 2x
        assert all(b < a / 2 for a, b in itertools.pairwise(errors)), (name, errors)
        assert mse(results, "kivi:3,g32", name, x) < mse(results, "kivi:2,g32", name, x) / 2


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("spec", ["kivi:2,g32", "kivi:3,g32", "kivi:4,g16"])
def test_kivi_keys_beat_per_token_int_on_outlier_channels(spec, d):
    x, results = batch(d)
    codec = parse_codec(spec)
    ratio = {name: mse(results, spec, name, x) / mse(results, f"int:{codec.bits}", name, x)
             for name in ("outliers", "clean")}
    assert ratio["outliers"] < 0.5, ratio
    # the same data without the outlier channels: they are what hurts per-token ranges
    assert ratio["outliers"] < 0.5 * ratio["clean"], ratio


def test_scores_default_uses_decoded_keys():
    codec = parse_codec("kivi:4,g16")
    k, q = gaussian(10, (2, 32, 64)), gaussian(11, (2, 3, 64))

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def both(q, k):
        codes = codec.encode({}, k)
        return codec.scores({}, q, codes), codec.decode({}, codes)

    scores, k_hat = both(q, k)
    expected = np.einsum("bqd,bsd->bqs", np.asarray(q), np.asarray(k_hat))
    np.testing.assert_allclose(np.asarray(scores), expected, rtol=1e-5, atol=1e-5)


# -- bits and packing --------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_bits_formula_equals_measured(spec, d):
    x, results = batch(d)
    codes, _ = results[spec]
    assert parse_codec(spec).bits_per_element(d) == measured_bits_per_element(codes, x.size)


@pytest.mark.parametrize(
    ("spec", "d", "bits"),
    [
        ("bf16", 80, 16.0),
        ("fp8", 128, 8.125),
        ("int:4", 128, 4.25),
        ("int:3", 80, 3.6),  # 240 code bits pad to 256: 3.2 + 32/80
        ("int:8", 64, 8.5),
        ("kivi:2,g32", 128, 3.0),
        ("kivi:2,g128", 80, 2.25),
        ("kivi:2,g32,token", 128, 3.0),
        ("kivi:2,g32,token", 80, 3.2),  # 3 channel groups: 2 + 96/80
        ("kivi:4,g256,token", 80, 4.4),  # one group of 80: same as int:4
    ],
)
def test_bits_formula_known_values(spec, d, bits):
    assert parse_codec(spec).bits_per_element(d) == pytest.approx(bits, abs=1e-12)


@pytest.mark.parametrize("spec", INTEGER_SPECS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_codes_are_packed(spec, d):
    codec = parse_codec(spec)
    codes, _ = batch(d)[1][spec]
    assert codes["codes"].dtype == np.uint32
    assert codes["codes"].shape[-1] == math.ceil(d * codec.bits / 32)
    assert codes["scale"].dtype == codes["zero"].dtype == np.float16


def test_int4_uses_sixteen_words_for_128_dims():
    codes, _ = batch(128)[1]["int:4"]
    assert codes["codes"].shape == (len(SLICES), TOKENS, 16)
    assert codes["codes"].dtype == np.uint32


def test_layouts():
    _, results = batch(80)
    n = len(SLICES)
    shapes = {spec: {k: v.shape for k, v in results[spec][0].items()} for spec in SPECS}
    assert shapes["kivi:2,g32"] == {"codes": (n, 7, 32, 5), "scale": (n, 7, 80),
                                    "zero": (n, 7, 80)}
    assert shapes["kivi:2,g32,token"] == {"codes": (n, TOKENS, 5), "scale": (n, TOKENS, 3),
                                          "zero": (n, TOKENS, 3),
                                          "head_dim": (n, TOKENS, 0, 80)}
    assert shapes["int:4"] == {"codes": (n, TOKENS, 10), "scale": (n, TOKENS, 1),
                               "zero": (n, TOKENS, 1), "head_dim": (n, TOKENS, 0, 80)}
    assert shapes["fp8"] == {"codes": (n, TOKENS, 80), "scale": (n, TOKENS, 1)}
    assert results["fp8"][0]["codes"].dtype == np.uint8
    assert shapes["bf16"] == {"x": (n, TOKENS, 80)}


# -- jit, vmap, determinism ----------------------------------------------------------------


@pytest.mark.parametrize("spec", ["bf16", "fp8", "int:3", "kivi:3,g7", "kivi:2,g32,token"])
def test_jit_and_vmap_match_eager(spec):
    codec = parse_codec(spec)
    x = gaussian(16, (3, 14, 80))
    eager = codec.encode({}, x)
    x_hat = codec.decode({}, eager)
    assert x_hat.shape == x.shape and x_hat.dtype == jnp.float32
    assert codec.decode({}, eager, jnp.bfloat16).dtype == jnp.bfloat16
    # the codec as a static argument, and closed over
    encode = jax.jit(lambda c, p, v: c.encode(p, v), static_argnums=0)
    assert_codes_equal(encode(codec, {}, x), eager)
    decoded = jax.jit(codec.decode)({}, eager)
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(x_hat))
    # vmapped over a leading head axis (as the cache calls it) equals one call per head
    mapped = jax.jit(jax.vmap(codec.encode, in_axes=(None, 0)))({}, x)
    for h in range(x.shape[0]):
        assert_codes_equal(jax.tree.map(lambda a, h=h: a[h], mapped),
                           jax.tree.map(lambda a, h=h: a[h], eager))
    x_hat_mapped = jax.jit(jax.vmap(codec.decode, in_axes=(None, 0)))({}, mapped)
    np.testing.assert_array_equal(np.asarray(x_hat_mapped), np.asarray(x_hat))


def test_encoding_is_deterministic():
    x, results = batch(80)
    again = jax.tree.map(np.asarray, roundtrip_all(CODECS, jnp.asarray(x.copy())))
    for spec in SPECS:
        assert_codes_equal(results[spec][0], again[spec][0])
        np.testing.assert_array_equal(results[spec][1], again[spec][1])


# -- non-finite, out-of-range and degenerate inputs ---------------------------------------


def tokens_for(codec, at_least):
    """The fewest whole blocks of the codec holding ``at_least`` tokens."""
    return codec.block_tokens * max(1, math.ceil(at_least / codec.block_tokens))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_raises_eagerly(spec, bad):
    codec = parse_codec(spec)
    x = np.array(gaussian(19, (tokens_for(codec, 8), 16)))
    x[BAD_AT[0], 3] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.encode({}, jnp.asarray(x))


@pytest.mark.parametrize("spec", [s for s in SPECS if s != "bf16"])
def test_beyond_fp16_metadata_range_raises_eagerly(spec):
    codec = parse_codec(spec)
    x = np.array(gaussian(20, (tokens_for(codec, 8), 16)))
    x[3, 3] = 1e8  # beyond an fp16 zero, and beyond 448 times the largest fp16 scale
    with pytest.raises(CodecError, match="exceeds"):
        codec.encode({}, jnp.asarray(x))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_non_finite_and_huge_input_stays_finite_under_jit(spec, d):
    codec = parse_codec(spec)
    _, results = batch(d)
    x_hat = results[spec][1]
    # the bad element only disturbs its own vector, or its group of keys
    block = codec.block_tokens
    first = BAD_AT[0] // block * block
    others = np.ones(TOKENS, bool)
    others[first : first + block] = False
    for name in ("nan", "inf", "-inf", "huge"):
        assert np.all(np.isfinite(x_hat[at(name)])), name
        np.testing.assert_array_equal(x_hat[at(name)][others], x_hat[at("clean")][others])
    # NaN is encoded as 0; +Inf as the largest float32, which saturates like 1e8 does
    np.testing.assert_array_equal(x_hat[at("nan")], x_hat[at("nan_as_zero")])
    if spec != "bf16":
        np.testing.assert_array_equal(x_hat[at("inf")], x_hat[at("huge")])


@pytest.mark.parametrize("spec", SPECS)
def test_all_zero_rows_decode_to_zero(spec):
    codec = parse_codec(spec)
    x_hat = batch(64)[1][spec][1]
    assert np.all(x_hat[at("const0")] == 0)
    if codec.block_tokens == 1:  # vectors are independent: zero rows among data stay 0
        assert np.all(x_hat[at("zero_rows")][ZERO_ROWS] == 0)


@pytest.mark.parametrize("spec", SPECS)
def test_constant_rows_decode_to_constant(spec):
    x_hat = batch(64)[1][spec][1]
    for i, value in enumerate(CONSTANTS):
        got = x_hat[at(f"const{i}")]
        if spec == "bf16":
            np.testing.assert_array_equal(got, np.float32(jnp.bfloat16(value)))
        elif spec == "fp8":
            # amax maps to 448 up to the fp16 rounding of the scale, unless the scale
            # floor (2**-14) lifts it and the constant lands inside the e4m3 grid instead
            rtol = 2.0**-10 if abs(value) >= 448 * 2.0**-14 else 2.0**-4
            np.testing.assert_allclose(got, value, rtol=rtol)
        else:
            np.testing.assert_array_equal(got, np.float32(np.float16(value)))


# -- shape and head-dim validation -------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_bad_head_dim_and_shapes(spec):
    codec = parse_codec(spec)
    for bad in (0, -4, 2.5, "64"):
        with pytest.raises(CodecError, match="head_dim"):
            codec.check_head_dim(bad)
        with pytest.raises(CodecError, match="head_dim"):
            codec.bits_per_element(bad)
    with pytest.raises(CodecError, match="head_dim"):
        codec.init(jax.random.key(0), 0)
    assert codec.init(jax.random.key(0), 64) == {}
    with pytest.raises(CodecError, match="expected x"):
        codec.encode({}, jnp.zeros((64,)))
    with pytest.raises(CodecError, match="floating"):
        codec.encode({}, jnp.zeros((tokens_for(codec, 1), 64), jnp.int32))


def test_kivi_keys_need_whole_groups():
    codec = parse_codec("kivi:2,g32")
    assert codec.block_tokens == 32
    with pytest.raises(CodecError, match="block of 32 tokens"):
        codec.encode({}, jnp.zeros((48, 64)))
    assert parse_codec("kivi:2,g32,token").block_tokens == 1
    assert parse_codec("int:4").block_tokens == 1


# -- the spec grammar ----------------------------------------------------------------------


def test_registry_holds_the_baselines():
    reg = registered()
    for name, cls in [("bf16", Bf16Codec), ("fp8", Fp8Codec), ("int", IntCodec),
                      ("kivi", KiviCodec)]:
        assert reg[name] is cls


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trip(spec):
    codec = parse_codec(spec)
    assert isinstance(codec, Codec)
    assert codec.spec == spec  # SPECS are all written canonically
    assert parse_codec(codec.spec) == codec
    assert hash(parse_codec(codec.spec)) == hash(codec)
    assert parse_codec(codec.value_codec().spec) == codec.value_codec()


@pytest.mark.parametrize(
    ("spec", "codec"),
    [
        ("kivi:2", KiviCodec(bits=2, group=32)),
        (" kivi:2, g32 ", KiviCodec(bits=2, group=32)),
        ("kivi:token,g16,3", KiviCodec(bits=3, group=16, per_token=True)),
        ("kivi:2,g064", KiviCodec(bits=2, group=64)),
        ("int:04", IntCodec(bits=4)),
    ],
)
def test_spec_spellings_normalize(spec, codec):
    assert parse_codec(spec) == codec
    assert parse_codec(codec.spec) == codec


def test_one_cache_spec_pairs_kivi_keys_with_token_values():
    config = parse_cache("kivi:2,g32")
    k, v = config.k, config.v
    assert k == KiviCodec(bits=2, group=32, per_token=False)
    assert v == KiviCodec(bits=2, group=32, per_token=True)
    assert v.value_codec() == v
    int4 = parse_cache("int:4")
    assert (int4.k, int4.v) == (IntCodec(bits=4), IntCodec(bits=4))
    apart = parse_cache("k=kivi:4,g64 v=fp8")
    assert (apart.k, apart.v) == (KiviCodec(bits=4, group=64), Fp8Codec())


VALID_CODECS = (r"valid codecs: bf16, f32, fp8, hqmq, hyperquant, int, kivi, octopus, polarquant, "
                r"saw, turboquant")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("int:1", r"2\.\.8"),
        ("int:9", r"2\.\.8"),
        ("kivi:9", r"2\.\.8"),
        ("kivi:1,g32", r"2\.\.8"),
        ("kivi:2,g0", r"1\.\.4096"),
        ("kivi:2,g5000", r"1\.\.4096"),
        ("int", r"^int: expected exactly one bit width N in 2\.\.8"),
        ("int:", r"bit width N in 2\.\.8"),
        ("kivi", r"kivi:N\[,gG\]\[,token\]"),
        ("kivi:g32,token", r"kivi:N\[,gG\]\[,token\]"),
        ("int:4,5", r"exactly one bit width"),
        ("kivi:2,3", r"exactly one bit width"),
        ("int:four", r"integer in 2\.\.8, got 'four'"),
        ("kivi:two", r"unknown option 'two'; known: g, token; usage: kivi:N"),
        ("int:4.5", r"integer in 2\.\.8"),
        ("int:4,g32", r"exactly one bit width N in 2\.\.8.*usage: int:N"),
        ("kivi:2,x3", r"unknown option 'x3'; known: g, token"),
        ("kivi:2,tokens", r"unknown option 'tokens'; known: g, token"),
        ("kivi:2,g", r"integer in 1\.\.4096"),
        ("kivi:2,g3.5", r"integer in 1\.\.4096"),
        ("kivi:2,token5", r"takes no value"),
        ("kivi:2,g32,g64", r"given twice"),
        ("kivi:2,token,token", r"given twice"),
        ("kivi:2,,g32", r"empty option"),
        ("int:4,", r"empty option"),
        ("fp8:4", r"takes no options"),
        ("bf16:x", r"takes no options"),
        ("nope:4", VALID_CODECS),
        ("INT:4", VALID_CODECS),
        ("", VALID_CODECS),
        ("   ", VALID_CODECS),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(CodecError, match=match):
        parse_codec(spec)


@pytest.mark.parametrize(
    "make",
    [
        lambda: IntCodec(bits=1),
        lambda: IntCodec(bits=9),
        lambda: IntCodec(bits=4.0),
        lambda: IntCodec(bits=True),
        lambda: KiviCodec(bits=9),
        lambda: KiviCodec(bits=2, group=0),
        lambda: KiviCodec(bits=2, group=4097),
        lambda: KiviCodec(bits=2, per_token="yes"),
    ],
)
def test_bad_fields(make):
    with pytest.raises(CodecError, match=r"must be"):
        make()


def test_f32_is_exact_storage():
    codec = parse_codec("f32")
    assert codec.spec == "f32" and not codec.lossy
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 80)), jnp.float32)
    codes = jax.jit(codec.encode)(codec.init(jax.random.key(0), 80), x)
    np.testing.assert_array_equal(np.asarray(codec.decode({}, codes)), np.asarray(x))
    assert measured_bits_per_element(codes, x.size) == codec.bits_per_element(80) == 32
    with pytest.raises(CodecError, match="no options"):
        parse_codec("f32:2")
