"""Bit packing and mixed-radix packing: exact round trips, layouts, jit/vmap, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import packing as pk


@pytest.mark.parametrize("bits", list(range(1, 33)))
@pytest.mark.parametrize("n", [1, 7, 64, 96, 130])
def test_pack_round_trip_every_width(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 2**bits, size=(3, n), dtype=np.uint64).astype(np.uint32)
    words = pk.pack_bits(jnp.asarray(codes), bits)
    assert words.dtype == jnp.uint32
    assert words.shape == (3, pk.num_words(n, bits)) == (3, -(-n * bits // 32))
    np.testing.assert_array_equal(np.asarray(pk.unpack_bits(words, bits, n)), codes)


def test_extreme_codes_and_dense_bit_order():
    # all-ones codes fill every used bit; 3-bit codes straddle word boundaries
    ones = jnp.full((11,), 7, jnp.uint32)
    words = np.asarray(pk.pack_bits(ones, 3))
    assert words.tolist() == [2**32 - 1, 1]
    seq = jnp.arange(11, dtype=jnp.uint32) % 8
    as_int = sum(int(c) << (3 * i) for i, c in enumerate(np.asarray(seq)))
    packed = np.asarray(pk.pack_bits(seq, 3))
    assert as_int == int(packed[0]) | (int(packed[1]) << 32)


def test_planar_layout_keeps_dims_contiguous_per_slot():
    codes = jnp.arange(128, dtype=jnp.uint32) % 16
    words = np.asarray(pk.pack_bits(codes, 4))
    assert words.shape == (16,) and pk.is_planar(128, 4)
    slot0 = words & 0xF
    np.testing.assert_array_equal(slot0, np.arange(16) % 16)
    slot1 = (words >> 4) & 0xF
    np.testing.assert_array_equal(slot1, np.arange(16, 32) % 16)


def test_values_are_masked_to_width():
    words = pk.pack_bits(jnp.array([0x1F, 0x0], jnp.uint32), 4)
    np.testing.assert_array_equal(np.asarray(pk.unpack_bits(words, 4, 2)), [0xF, 0])


def test_jit_and_vmap():
    rng = np.random.default_rng(0)
    codes = jnp.asarray(rng.integers(0, 32, size=(4, 5, 40)), jnp.uint32)
    f = jax.jit(lambda c: pk.pack_bits(c, 5))
    g = jax.vmap(lambda c: pk.pack_bits(c, 5))
    np.testing.assert_array_equal(f(codes), pk.pack_bits(codes, 5))
    np.testing.assert_array_equal(g(codes), pk.pack_bits(codes, 5))
    back = jax.jit(lambda w: pk.unpack_bits(w, 5, 40))(f(codes))
    np.testing.assert_array_equal(back, codes)


@pytest.mark.parametrize("bad", [0, 33, 2.0, -1])
def test_bad_widths(bad):
    with pytest.raises(ValueError, match="bit width"):
        pk.pack_bits(jnp.zeros(4, jnp.uint32), bad)


def test_unpack_checks_word_count():
    with pytest.raises(ValueError, match="words"):
        pk.unpack_bits(jnp.zeros(3, jnp.uint32), 4, 32)


@pytest.mark.parametrize("alphabet", [3, 5, 24, 100, 2304, 4608, 65537])
def test_mixed_radix_round_trip(alphabet):
    group = pk.best_radix_group(alphabet)
    assert alphabet**group <= 2**32
    rng = np.random.default_rng(alphabet)
    idx = rng.integers(0, alphabet, size=(2, 3, group * 6)).astype(np.uint32)
    idx[0, 0, :group] = alphabet - 1  # the largest combined value
    words = pk.pack_radix(jnp.asarray(idx), alphabet)
    assert words.shape[-1] == pk.radix_words(group * 6, alphabet)
    np.testing.assert_array_equal(np.asarray(pk.unpack_radix(words, alphabet, group * 6)), idx)
    assert pk.radix_group_bits(alphabet, group) / group < np.log2(alphabet) + 1.0


def test_mixed_radix_beats_bit_packing_for_24s():
    # HQMQ's joint codebook of 24 * 96 entries: 11.17 bits of entropy per index
    group = pk.best_radix_group(2304)
    assert pk.radix_group_bits(2304, group) / group == 11.5 < 12


def test_mixed_radix_errors():
    with pytest.raises(ValueError, match="fit in 32 bits"):
        pk.radix_combine(jnp.zeros(6, jnp.uint32), 2304, 3)
    with pytest.raises(ValueError, match="groups"):
        pk.radix_combine(jnp.zeros(5, jnp.uint32), 24, 2)
    with pytest.raises(ValueError, match="alphabet"):
        pk.best_radix_group(1)
