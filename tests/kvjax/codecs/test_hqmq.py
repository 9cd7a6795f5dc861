"""HQMQ (Hurwitz-quaternion multiplicative quantization) and the Med-C outlier wrapper:
quaternion algebra, the 2T group, encode vs brute force, bit accounting (the paper's
Table 21 and the stored bits), error trends, jit/vmap/seeds, bad input and specs."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import CodecError, measured_bits_per_element
from kvjax.codecs import HqmqCodec, IntCodec, MedOutlierCodec
from kvjax.codecs import hqmq as hqmq_module
from kvjax.primitives.packing import unpack_bits
from kvjax.primitives.quaternion import (
    conjugate,
    haar_quaternions,
    hamilton,
    hurwitz_units,
    nearest_hurwitz,
    right_multiplication_matrix,
)
from kvjax.spec import parse_cache, parse_codec
from tests.kvjax.codecs.compiled import encode_decode

KEY = jax.random.key(0)


def gaussian(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def rel_mse(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.sum((x - y) ** 2) / np.sum(x**2))


def roundtrip(codec, x, key=KEY):
    params = codec.init(key, x.shape[-1])
    return params, *encode_decode(codec, params, jnp.asarray(x))


# -- quaternions and 2T -------------------------------------------------------------------


def test_hurwitz_units_form_the_group_2t():
    units = hurwitz_units()
    assert units.shape == (24, 4)
    np.testing.assert_allclose(np.linalg.norm(units, axis=1), 1.0)
    assert len({tuple(u) for u in units}) == 24
    products = np.asarray(hamilton(jnp.asarray(units)[:, None], jnp.asarray(units)[None]))
    as_set = {tuple(u) for u in units}
    assert all(tuple(p) in as_set for p in products.reshape(-1, 4))
    cos = units @ units.T
    off = cos[~np.eye(24, dtype=bool)]
    # minimum pairwise angle 60 degrees: no two distinct units closer than cos = 1/2
    assert off.max() == pytest.approx(0.5)


def test_hamilton_product_rules_and_isometry():
    one, i, j, k = (jnp.eye(4)[n] for n in range(4))
    np.testing.assert_allclose(hamilton(i, j), k)
    np.testing.assert_allclose(hamilton(j, i), -k)
    np.testing.assert_allclose(hamilton(i, i), -one)
    np.testing.assert_allclose(hamilton(hamilton(i, j), k), -one)
    q = haar_quaternions(jax.random.key(3), 50)
    a, b = gaussian((50, 4), 1), gaussian((50, 4), 2)
    # left and right multiplication by a unit quaternion keep inner products
    for left in (True, False):
        qa = hamilton(q, a) if left else hamilton(a, q)
        qb = hamilton(q, b) if left else hamilton(b, q)
        np.testing.assert_allclose(jnp.sum(qa * qb, -1), jnp.sum(a * b, -1), rtol=1e-5,
                                   atol=1e-5)
    np.testing.assert_allclose(hamilton(q, conjugate(q)), jnp.tile(one, (50, 1)), atol=1e-6)
    m = right_multiplication_matrix(q)
    np.testing.assert_allclose(jnp.einsum("nr,nrc->nc", a, m), hamilton(a, q), atol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(q, axis=-1), 1.0, rtol=1e-6)


def test_nearest_hurwitz_is_the_best_of_all_24():
    u = gaussian((2000, 4), 4)
    index, score = nearest_hurwitz(u)
    dots = np.asarray(u) @ hurwitz_units().T
    np.testing.assert_array_equal(np.asarray(index), dots.argmax(axis=1))
    np.testing.assert_allclose(score, dots.max(axis=1), rtol=1e-6)


# -- encode ------------------------------------------------------------------------------


@pytest.mark.parametrize("secondary", [24, 7])
def test_encode_picks_the_brute_force_codeword(secondary, monkeypatch):
    codec = HqmqCodec(secondary=secondary, radius_bits=4)
    params = codec.init(jax.random.key(secondary), 8)
    u = gaussian((300, 4), secondary)
    u = u / jnp.linalg.norm(u, axis=-1, keepdims=True)
    joint = hamilton(jnp.asarray(hurwitz_units())[None], params["secondary"][:, None])
    brute = np.argmax(np.asarray(u) @ np.asarray(joint).reshape(-1, 4).T, axis=1)
    # 300 chunks in batches of 64: the bounded-memory path, remainder included
    monkeypatch.setattr(hqmq_module, "ENCODE_BATCH", 64)
    np.testing.assert_array_equal(np.asarray(codec.nearest_codeword(params["secondary"], u)),
                                  brute)


# -- bits ----------------------------------------------------------------------------------

TABLE_21 = [  # config, per-element bits, with 16/D (the paper's Table 21 at D = 128)
    ("s24_r3", 3.04, 3.17), ("s24_r4", 3.29, 3.42), ("s48_r4", 3.54, 3.67),
    ("s96_r4", 3.79, 3.92), ("s192_r4", 4.04, 4.17), ("s192_r6", 4.54, 4.67),
]


@pytest.mark.parametrize(("config", "per_element", "with_scale"), TABLE_21)
def test_bits_match_table_21_and_the_stored_arrays(config, per_element, with_scale):
    s, r = (int(part[1:]) for part in config.split("_"))
    codec = parse_codec(f"hqmq:s{s},r{r}")
    fractional = codec.fractional_bits_per_element(128)
    assert round(fractional, 2) == with_scale
    assert round(fractional - 16 / 128, 2) == per_element
    _, codes, _ = roundtrip(codec, gaussian((3, 8, 128)))
    measured = measured_bits_per_element(codes, 3 * 8 * 128)
    assert measured == codec.bits_per_element(128)
    # the mixed-radix stream stays within 0.1 bit of the fractional count
    assert fractional <= measured < fractional + 0.1


def test_padding_wrapper_for_head_dims_not_divisible_by_4():
    codec = HqmqCodec(secondary=24, radius_bits=4)
    x = gaussian((2, 5, 45), 7)
    _, codes, x_hat = roundtrip(codec, x)
    assert x_hat.shape == x.shape
    assert rel_mse(x, x_hat) < 0.06
    assert measured_bits_per_element(codes, x.size) == codec.bits_per_element(45)
    assert codec.padding_overhead(45) == pytest.approx(48 / 45 - 1)
    assert codec.fractional_bits_per_element(45) == pytest.approx(
        (12 * (np.log2(576) + 4) + 16) / 45)


# -- accuracy ------------------------------------------------------------------------------


def test_error_falls_with_secondary_codebook_and_radius_bits():
    x = gaussian((4, 32, 64), 5)
    err = {(s, r): rel_mse(x, roundtrip(HqmqCodec(secondary=s, radius_bits=r), x)[2])
           for s, r in [(24, 6), (96, 6), (192, 6), (192, 3), (192, 4)]}
    assert err[(24, 6)] > err[(96, 6)] > err[(192, 6)]
    assert err[(192, 3)] > err[(192, 4)] > err[(192, 6)]
    assert err[(192, 6)] < 0.012


def test_round_trip_bound_and_zero_rows():
    codec = HqmqCodec(secondary=96, radius_bits=4)
    x = np.array(gaussian((2, 16, 128), 6))
    x[0, 3] = 0.0
    x[1, 7, :64] = 0.0
    x_hat = np.asarray(roundtrip(codec, jnp.asarray(x))[2])
    assert not x_hat[0, 3].any()
    assert not x_hat[1, 7, :64].any()
    assert rel_mse(x, x_hat) < 0.02
    cos = np.sum(x * x_hat, -1) / np.maximum(
        np.linalg.norm(x, axis=-1) * np.linalg.norm(x_hat, axis=-1), 1e-30)
    assert cos[np.linalg.norm(x, axis=-1) > 0].min() > 0.97


@pytest.mark.parametrize(("spec", "needle"), [
    ("hqmq:s0", "1..4096"), ("hqmq:s5000", "1..4096"), ("hqmq:r0", "1..12"),
    ("hqmq:r13", "1..12"), ("hqmq:4", "unexpected"), ("hqmq:x3", "unknown option"),
    ("hqmq:s24,s48", "twice"), ("hqmq:sx", "unknown option"),
])
def test_bad_specs(spec, needle):
    with pytest.raises(CodecError, match=needle):
        parse_codec(spec)


def test_spec_grammar():
    assert parse_codec("hqmq") == HqmqCodec(secondary=96, radius_bits=4)
    assert parse_codec("hqmq:r6,s192") == HqmqCodec(secondary=192, radius_bits=6)
    for spec in ("hqmq:s24,r3", "hqmq:s192,r6,med3", "int:4,med2.5,mb16,mp5", "fp8:med3"):
        codec = parse_codec(spec)
        assert codec.spec == spec and parse_codec(codec.spec) == codec
    config = parse_cache("hqmq:s48,r4,med3")
    k, v = config.k, config.v
    assert k == v == MedOutlierCodec(base=HqmqCodec(secondary=48, radius_bits=4))


# -- Med-C outliers -------------------------------------------------------------------------


def planted(tokens=32, head_dim=64, chunks=(), seed=9, scale=50.0):
    """Gaussian vectors with the chunks ``(token, chunk)`` scaled by ``scale``."""
    x = np.array(gaussian((tokens, head_dim), seed))
    for t, c in chunks:
        x[t, 4 * c:4 * c + 4] *= scale
    return jnp.asarray(x)


def test_planted_outliers_are_flagged_and_kept_exactly():
    codec = parse_codec("hqmq:s24,r4,med3")  # block 32, 3% of 32 * 16 chunks: 16 slots
    spots = [(0, 0), (3, 5), (3, 6), (17, 15), (31, 2)]
    x = planted(chunks=spots)
    _, codes, x_hat = roundtrip(codec, x)
    stored, overflow = codec.outlier_counts(codes)
    assert int(stored[0]) == len(spots) and int(overflow[0]) == 0
    flags = np.asarray(unpack_bits(codes["flags"][0], 1, 32 * 16))
    assert sorted(np.nonzero(flags)[0].tolist()) == sorted(t * 16 + c for t, c in spots)
    for t, c in spots:
        np.testing.assert_array_equal(
            x_hat[t, 4 * c:4 * c + 4], x[t, 4 * c:4 * c + 4].astype(jnp.float16))
    # without the outliers the same vectors lose far more
    plain = roundtrip(parse_codec("hqmq:s24,r4"), x)[2]
    assert rel_mse(x, x_hat) < rel_mse(x, plain) / 10
    assert measured_bits_per_element(codes, x.size) == codec.bits_per_element(64)


def test_overflow_keeps_the_largest_and_counts_the_rest():
    codec = parse_codec("int:8,med3,mb4,mp5")  # 4 tokens * 16 chunks * 5%: 4 slots
    assert codec.capacity(64) == 4
    x = np.array(gaussian((4, 64), 9))
    for t, c in itertools.product([0, 1, 2], [1, 8]):  # 6 planted chunks, 2 per token
        x[t, 4 * c:4 * c + 4] = 20.0 * (t + 1)  # token 2's are the largest, then token 1's
    _, codes, x_hat = roundtrip(codec, jnp.asarray(x))
    stored, overflow = codec.outlier_counts(codes)
    assert int(stored[0]) == 4 and int(overflow[0]) == 2
    for t, c in [(2, 1), (2, 8), (1, 1), (1, 8)]:
        np.testing.assert_array_equal(x_hat[t, 4 * c:4 * c + 4],
                                      x[t, 4 * c:4 * c + 4].astype(np.float16))
    # the two that did not fit went to int:8 with their token: quantized, not lost
    for c in (1, 8):
        got, want = np.asarray(x_hat[0, 4 * c:4 * c + 4]), x[0, 4 * c:4 * c + 4]
        np.testing.assert_allclose(got, want, atol=np.ptp(x[0]) / 255)


@pytest.mark.parametrize("base", ["int:4", "hqmq:s24,r4"])
def test_uncapped_capacity_stores_every_chunk_over_the_threshold(base):
    """``mp100``, the paper's uncapped Med-C: a slot for every chunk, so the 40 planted
    chunks (more than the default 3%'s 16 slots) are all stored, exactly up to fp16."""
    rng = np.random.default_rng(3)
    spots = sorted({(int(t), int(c)) for t, c in zip(rng.integers(0, 32, 60),
                                                     rng.integers(0, 16, 60), strict=True)})[:40]
    x = planted(chunks=spots, scale=30.0)
    capped = parse_codec(f"{base},med3")
    _, codes, _ = roundtrip(capped, x)
    stored, overflow = capped.outlier_counts(codes)
    assert int(stored[0]) == capped.capacity(64) == 16 and int(overflow[0]) == 40 - 16

    codec = parse_codec(f"{base},med3,mp100")
    assert codec.spec == f"{base},med3,mp100" and codec.capacity(64) == 32 * 16
    _, codes, x_hat = roundtrip(codec, x)
    stored, overflow = codec.outlier_counts(codes)
    assert int(stored[0]) == 40 and int(overflow[0]) == 0
    flags = np.asarray(unpack_bits(codes["flags"][0], 1, 32 * 16))
    assert np.nonzero(flags)[0].tolist() == [t * 16 + c for t, c in spots]
    for t, c in spots:
        np.testing.assert_array_equal(
            x_hat[t, 4 * c:4 * c + 4], x[t, 4 * c:4 * c + 4].astype(jnp.float16))
    # a slot per chunk is stored, and counted: 64 bits per 4 elements, flags and count
    assert measured_bits_per_element(codes, x.size) == codec.bits_per_element(64)
    extra = codec.bits_per_element(64) - codec.base.bits_per_element(64)
    assert extra == pytest.approx(16 + 1 / 4 + 32 / (32 * 64))
    # the paper's count at the measured fraction is far below what the slots cost
    assert codec.paper_bits_per_element(64, 40 / (32 * 16)) < codec.base.bits_per_element(
        64) + 1.5


@pytest.mark.parametrize("base", ["int:4", "hqmq:s24,r4"])
def test_pooled_slots_carry_forward_what_earlier_blocks_left(base):
    """``mpool``: the row's slots are one pool and a block may use, beyond its own 16,
    the slots the blocks before it left; never later blocks' (so the first block still
    overflows), and the pool holds the same slots as the fixed layout."""
    spots = {0: 20, 1: 2, 2: 0, 3: 40}  # planted chunks per block of 32 tokens
    rng = np.random.default_rng(5)
    chunks = []
    for block, count in spots.items():
        cells = rng.choice(32 * 16, count, replace=False)
        chunks += [(32 * block + int(i) // 16, int(i) % 16) for i in cells]
    x = planted(tokens=128, chunks=chunks, scale=30.0)
    fixed = parse_codec(f"{base},med3")
    codec = parse_codec(f"{base},med3,mpool")
    assert codec.spec == f"{base},med3,mpool" and codec.row_pool == "outliers"
    assert parse_codec(f"{base},mpool,med3").spec == codec.spec
    stored, overflow = (np.asarray(a) for a in fixed.outlier_counts(roundtrip(fixed, x)[1]))
    assert stored.tolist() == [16, 2, 0, 16] and overflow.tolist() == [4, 0, 0, 24]

    _, codes, x_hat = roundtrip(codec, x)
    stored, overflow = (np.asarray(a) for a in codec.outlier_counts(codes))
    # block 3 may take 4 * 16 - 18 slots: its own and the 30 that blocks 1, 2 left
    assert stored.tolist() == [16, 2, 0, 40] and overflow.tolist() == [4, 0, 0, 0]
    assert np.asarray(codes["start"])[:, 0].tolist() == [0, 16, 18, 18]
    assert codes["outliers"].shape == (4, 16, 4)
    block3 = [(t, c) for t, c in chunks if t >= 96]
    for t, c in block3:
        np.testing.assert_array_equal(
            x_hat[t, 4 * c:4 * c + 4], x[t, 4 * c:4 * c + 4].astype(jnp.float16))
    # one more word per block, the block's first slot, and nothing else
    assert measured_bits_per_element(codes, x.size) == codec.bits_per_element(64)
    assert codec.bits_per_element(64) - fixed.bits_per_element(64) == 32 / (32 * 64)


def test_pooled_blocks_encoded_after_others_continue_their_pool():
    """What a cache does: encoding a row's later blocks after its earlier ones (told how
    many blocks and slots those hold) places them as one encode of the whole row."""
    codec = parse_codec("int:4,med2,mb8,mp5,mpool")
    x = jnp.asarray(np.array(gaussian((2, 48, 32), 11)) * np.where(
        np.random.default_rng(2).random((2, 48, 32)) < 0.08, 8.0, 1.0))
    params = codec.init(jax.random.key(0), 32)
    whole = codec.encode(params, x)
    first, slot, chunks = codec.encode_after(params, x[:, :16], jnp.zeros(2, jnp.int32),
                                             jnp.zeros(2, jnp.int32))
    fill = codec.pool_fill(first, jnp.full(2, 2, jnp.int32))
    np.testing.assert_array_equal(fill, whole["start"][:, 2, 0])
    later, slot, chunks = codec.encode_after(params, x[:, 16:], jnp.full(2, 2, jnp.int32),
                                             fill)
    for name in ("flags", "start", "overflow"):
        np.testing.assert_array_equal(later[name], whole[name][:, 2:])
    pool = np.asarray(whole["outliers"]).reshape(2, -1, 4)
    for row in range(2):
        kept = np.asarray(slot[row]) < pool.shape[1]
        np.testing.assert_array_equal(pool[row, np.asarray(slot[row])[kept]],
                                      np.asarray(chunks[row])[kept])
    assert np.asarray(codec.pool_fill(first, jnp.zeros(2, jnp.int32))).tolist() == [0, 0]
    with pytest.raises(CodecError, match="pooled"):
        parse_codec("int:4,med2").encode_after(params, x, 0, 0)


def test_outliers_per_block_and_all_zero_blocks():
    codec = parse_codec("int:4,med3,mb8")
    x = np.array(gaussian((2, 16, 32), 10))
    x[0, 8:] = 0.0  # a block of zeros: median 0, nothing above it
    x[1, 2, 0:4] *= 40
    params, codes, x_hat = roundtrip(codec, jnp.asarray(x))
    stored, overflow = codec.outlier_counts(codes)
    assert stored.shape == (2, 2)
    assert int(stored[0, 1]) == 0 and not np.asarray(x_hat[0, 8:]).any()
    assert int(stored[1, 0]) >= 1 and int(overflow.sum()) == 0
    np.testing.assert_array_equal(x_hat[1, 2, 0:4], x[1, 2, 0:4].astype(np.float16))
    with pytest.raises(CodecError, match="multiple"):
        codec.encode(params, jnp.asarray(x[:, :12]))


@pytest.mark.parametrize(("spec", "needle"), [
    ("int:4,mb16", "expected medC"), ("int:4,med0", r"\(0, 10000\]"),
    ("int:4,med3,mp0", r"\(0, 100\]"), ("int:4,med3,mb0", r"integer in 1\.\.1024"),
    ("int:4,med3,mb2.5", "integer"), ("kivi:2,g32,med3", "token-wise"),
    ("bf16:med3", "lossy"), ("int:4,med", "number"),
])
def test_bad_outlier_specs(spec, needle):
    with pytest.raises(CodecError, match=needle):
        parse_codec(spec)


def test_paper_bit_formula():
    codec = parse_codec("hqmq:s96,r6,med3")
    base = codec.base.fractional_bits_per_element(128)
    assert codec.paper_bits_per_element(128, 0.03) == pytest.approx(
        0.97 * base + 0.48 + 0.25)
    assert isinstance(codec.base, HqmqCodec) and isinstance(
        parse_codec("int:4,med3").base, IntCodec)


# -- the learned secondary codebook (``learn``) ---------------------------------------------


def _anisotropic(tokens, seed):
    """Vectors whose chunk directions crowd a few regions of S^3, as a model's keys do."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, 64)).astype(np.float32) * np.tile([4.0, 1, 0.3, 0.1], 16)
    return x + np.tile([2.0, 0, 0, 0], 16)


def test_a_learned_codebook_cuts_the_error_on_held_out_vectors_at_equal_bits():
    train, test = _anisotropic(2048, 0), jnp.asarray(_anisotropic(256, 1))
    haar, learned = parse_codec("hqmq:s24,r3"), parse_codec("hqmq:s24,r3,learn")
    assert learned.needs_fit and not haar.needs_fit
    assert learned.bits_per_element(64) == haar.bits_per_element(64)
    start = haar.init(KEY, 64)
    fitted = learned.fit(KEY, train)
    np.testing.assert_allclose(np.linalg.norm(fitted["secondary"], axis=-1), 1, atol=1e-5)

    def error(codec, params):
        codes, x_hat = encode_decode(codec, params, test)
        assert measured_bits_per_element(codes, test.size) == codec.bits_per_element(64)
        return float(jnp.mean((x_hat - test) ** 2) / jnp.mean(test**2))

    assert error(learned, fitted) < 0.7 * error(haar, start)
    again = learned.fit(KEY, train)
    np.testing.assert_array_equal(again["secondary"], fitted["secondary"])
    assert learned.kernel_formats()[0].codewords(fitted).shape == (24 * 24, 4)


def test_a_fit_never_loses_to_its_starting_codebook_on_its_own_data():
    """Each Lloyd step cannot lower the weighted sum of best inner products."""
    train = jnp.asarray(_anisotropic(512, 2))
    codec = parse_codec("hqmq:s8,r4,learn")

    def objective(secondary):
        chunks = train.reshape(-1, 4)
        radius = jnp.linalg.norm(chunks, axis=-1)
        u = chunks / radius[:, None]
        words = codec.codewords({"secondary": secondary})
        return float(jnp.sum(radius**2 * jnp.max(u @ words.T, axis=-1)))

    start = codec.init(KEY, 64)["secondary"]
    assert objective(codec.fit(KEY, train)["secondary"]) >= objective(start)
    with pytest.raises(CodecError, match="no fitted parameters"):
        parse_codec("hqmq").fit(KEY, train)


def test_the_score_objective_lowers_the_query_weighted_error_it_is_fitted_for():
    rng = np.random.default_rng(4)
    train = jnp.asarray(_anisotropic(512, 3))
    queries = rng.standard_normal((256, 64)).astype(np.float32)
    queries *= np.tile([0.1, 3.0, 0.2, 1.0], 16)  # weights the chunks' axes unlike x does
    moment = jnp.asarray(queries.T @ queries)
    lloyd = parse_codec("hqmq:s8,r4,learn").fit(KEY, train, moment)
    scored = parse_codec("hqmq:s8,r4,learn,score").fit(KEY, train, moment)

    def score_error(codec, params):
        error = codec.decode(params, codec.encode(params, train)) - train
        return float(jnp.mean(jnp.einsum("ni,ij,nj->n", error, moment, error)))

    codec = parse_codec("hqmq:s8,r4,learn")
    assert score_error(codec, scored) < score_error(codec, lloyd)
    np.testing.assert_allclose(np.linalg.norm(scored["secondary"], axis=-1), 1, atol=1e-5)
    # values have no queries: the score objective falls back to the reconstruction
    values = parse_codec("hqmq:s8,r4,learn,score").fit(KEY, train)
    np.testing.assert_array_equal(values["secondary"], codec.fit(KEY, train)["secondary"])
    with pytest.raises(CodecError, match="score is an objective of learn"):
        parse_codec("hqmq:s8,r4,score")
