"""Bit packing and mixed-radix packing: exact round trips, layouts, jit/vmap, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.primitives import packing as pk

WIDTHS = list(range(1, 33))


def random_codes(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    return rng.integers(0, 2**bits, size=(3, n), dtype=np.uint64).astype(np.uint32)


@functools.partial(jax.jit, static_argnums=0)
def _pack_unpack_every_width(n, codes):
    out = []
    for bits, c in zip(WIDTHS, codes, strict=True):
        words = pk.pack_bits(c, bits)
        out.append((words, pk.unpack_bits(words, bits, n)))
    return out


@functools.cache
def round_trips(n):
    """``{bits: (words, unpacked)}`` of :func:`random_codes` for every width, from one
    compiled program (eager dispatch would compile each width's primitives on their own,
    32 widths times 5 sizes; test_jit_and_vmap checks eager == jit)."""
    codes = tuple(jnp.asarray(random_codes(bits, n)) for bits in WIDTHS)
    out = _pack_unpack_every_width(n, codes)
    return {bits: jax.tree.map(np.asarray, r) for bits, r in zip(WIDTHS, out, strict=True)}


@pytest.mark.parametrize("bits", WIDTHS)
@pytest.mark.parametrize("n", [1, 7, 64, 96, 130])
def test_pack_round_trip_every_width(bits, n):
    codes = random_codes(bits, n)
    words, back = round_trips(n)[bits]
    assert words.dtype == jnp.uint32
    assert words.shape == (3, pk.num_words(n, bits)) == (3, -(-n * bits // 32))
    np.testing.assert_array_equal(back, codes)


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


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_packing_is_elementwise(bits):
    # a reduction over the slots would be a GPU kernel of its own in every decode step's
    # append; shifts and ORs fuse into the quantizer that produces the codes
    pack = pk.pack_split if bits == 3 else functools.partial(pk.pack_bits, bits=bits)
    traced = jax.make_jaxpr(pack)(jax.ShapeDtypeStruct((2, 128), jnp.uint32))
    names = {eqn.primitive.name for eqn in traced.jaxpr.eqns}
    assert not any(n.startswith("reduce") for n in names), names


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


def test_fields_of_mixed_widths_round_trip_back_to_back():
    rng = np.random.default_rng(5)
    widths = [(3, 7), (5, 32), (1, 1), (0, 4), (9, 13), (2, 20)]
    fields = [(jnp.asarray(rng.integers(0, 2**b, size=(2, n), dtype=np.uint64)
                           .astype(np.uint32)), b) for n, b in widths]
    words = pk.pack_fields(fields)
    total = pk.fields_bits(widths)
    assert total == 3 * 7 + 5 * 32 + 1 + 9 * 13 + 2 * 20
    assert words.shape == (2, -(-total // 32))
    for (codes, _), back in zip(fields, pk.unpack_fields(words, widths), strict=True):
        np.testing.assert_array_equal(back, codes)
    for unit, dtype in ((8, jnp.uint8), (16, jnp.uint16)):
        units = pk.to_units(words, total, unit)
        assert units.dtype == dtype and units.shape[-1] == -(-total // unit)
        np.testing.assert_array_equal(pk.from_units(units, total, unit), words)
    assert int(pk.to_units(jnp.asarray([0x04030201], jnp.uint32), 32)[1]) == 2
    # bit order: the first field's first code in the lowest bits of word 0
    one = pk.pack_fields([(jnp.asarray([5], jnp.uint32), 3), (jnp.asarray([1], jnp.uint32), 1)])
    assert int(one[0]) == 5 | 1 << 3
    with pytest.raises(ValueError, match="stream"):
        pk.unpack_fields(words[:, :-1], widths)
    stored = pk.pack_field_bytes(fields)
    np.testing.assert_array_equal(stored, pk.to_units(words, total))
    for (codes, _), back in zip(fields, pk.unpack_field_bytes(stored, widths), strict=True):
        np.testing.assert_array_equal(back, codes)


@pytest.mark.parametrize("alphabet", [24 * 24, 24 * 96, 24 * 192, 24 * 7, 3, 64, 1])
def test_radix_fields_split_the_odd_part(alphabet):
    n = 32
    rng = np.random.default_rng(alphabet)
    idx = rng.integers(0, alphabet, size=(3, n)).astype(np.uint32)
    idx[0] = alphabet - 1
    fields = pk.radix_fields(jnp.asarray(idx), alphabet)
    widths = pk.radix_widths(n, alphabet)
    assert [(int(c.shape[-1]), b) for c, b in fields] == widths
    back = pk.radix_indices(pk.unpack_fields(pk.pack_fields(fields), widths), n, alphabet) \
        if fields else pk.radix_indices([], n, alphabet)
    np.testing.assert_array_equal(np.broadcast_to(back, idx.shape), idx if alphabet > 1 else 0)
    bits = pk.fields_bits(widths)
    assert n * np.log2(alphabet) <= bits < n * np.log2(alphabet) + 4
    if alphabet in (576, 2304, 4608):  # odd part 9: five base-9 digits per 16 bits
        assert widths[0] == (6, 16) and widths[1] == (1, 7)


@pytest.mark.parametrize("n", [16, 64, 128])
def test_two_bit_codes_lie_in_byte_planes(n):
    """Byte ``u`` of the words, field ``j``, holds code ``j * n / 4 + u``."""
    codes = np.random.default_rng(2).integers(0, 4, (3, n))
    words = pk.pack_codes(jnp.asarray(codes), 2)
    assert words.shape == (3, n // 16)
    data = np.asarray(words).view(np.uint8).reshape(3, n // 4).astype(np.int64)
    for j in range(4):
        np.testing.assert_array_equal((data >> (2 * j)) & 3, codes[:, j * n // 4:(j + 1) * n // 4])
    np.testing.assert_array_equal(pk.unpack_codes(words, 2, n), codes)


@pytest.mark.parametrize("n", [32, 128])
def test_split_codes_round_trip_with_byte_planes_below(n):
    codes = np.random.default_rng(3).integers(0, 8, (3, n))
    words = pk.pack_codes(jnp.asarray(codes), 3)
    assert words.shape == (3, 3 * n // 32)
    np.testing.assert_array_equal(pk.unpack_codes(words, 3, n), codes)
    # the low words are the 2-bit layout of the low bits
    np.testing.assert_array_equal(words[:, :n // 16], pk.pack_codes(jnp.asarray(codes & 3), 2))


@pytest.mark.parametrize("bits,count", [(1, 1024), (4, 128), (4, 6), (3, 40), (5, 13)])
def test_code_position_reads_back_what_pack_bits_wrote(bits, count):
    codes = np.random.default_rng(bits * count).integers(0, 1 << bits, count)
    words = np.asarray(pk.pack_bits(jnp.asarray(codes, jnp.uint32), bits)).astype(np.uint64)
    padded = np.append(words, np.uint64(0))  # a dense code may run into the next word
    index = np.arange(count)
    word, bit = pk.code_position(index, count, bits)
    high = padded[np.minimum(word + 1, len(words))] << np.uint64(32)
    window = (padded[word] | high) >> bit.astype(np.uint64)
    np.testing.assert_array_equal(window & np.uint64((1 << bits) - 1), codes)
    assert pk.is_planar(count, bits) == (bits in (1, 4) and count % (32 // bits) == 0)
