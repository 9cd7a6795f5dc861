"""The Rice coder: bit-exact against a serial reference, batches, overflow reports, the
parameter search, and lengths that saturate instead of wrapping for symbols near 2^32."""

import numpy as np
import pytest

from kvjax.primitives import rice


def _reference_encode(u, k, num_words):
    """Textbook bit-serial writer of the layout: per sub-stream remainders, then unary."""
    bits = []
    offsets = []
    for j in range(u.shape[0]):
        offsets.append(len(bits))
        for s, kk in zip(u[j].tolist(), k[j].tolist(), strict=True):
            bits += [(s >> b) & 1 for b in range(kk)]  # least significant first
        for s, kk in zip(u[j].tolist(), k[j].tolist(), strict=True):
            bits += [0] * (s >> kk) + [1]
    total = len(bits)
    bits = (bits + [0] * (32 * num_words))[: 32 * num_words]
    words = [sum(bits[32 * w + b] << b for b in range(32)) for w in range(num_words)]
    return np.array(words, np.uint64).astype(np.uint32), offsets, total


def _reference_decode(words, offsets, k):
    bits = [(int(w) >> b) & 1 for w in words for b in range(32)]
    out = np.zeros(k.shape, np.uint64)
    for j, pos in enumerate(offsets):
        rems = []
        for kk in k[j]:
            r = 0
            for b in range(kk):
                r, pos = r | bits[pos] << b, pos + 1
            rems.append(r)
        for i, kk in enumerate(k[j]):
            q = 0
            while bits[pos] == 0:
                q, pos = q + 1, pos + 1
            pos += 1
            out[j, i] = (q << int(kk)) | rems[i]
    return out


def _streams(kind, rng):
    if kind == "geometric":
        u = rng.geometric(0.15, size=(3, 64)) - 1
        k = rng.integers(0, 5, size=(3, 64))
    elif kind == "zeros_k0":
        u, k = np.zeros((2, 64)), np.zeros((2, 64))
    elif kind == "huge_k15":
        u, k = rng.integers(2**20, 2**22, size=(2, 8)), np.full((2, 8), 15)
    elif kind == "huge_k0":
        u, k = np.array([[700, 0, 1, 300]]), np.zeros((1, 4))
    else:  # mixed parameters per class, as d4/a2 streams have
        u = rng.geometric(0.05, size=(2, 40)) - 1
        k = np.tile([3, 3, 3, 2], (2, 10))
    return u.astype(np.uint32), k.astype(np.int32)


@pytest.mark.parametrize("kind", ["geometric", "zeros_k0", "huge_k15", "huge_k0", "classes"])
def test_rice_matches_serial_reference_and_round_trips(kind):
    u, k = _streams(kind, np.random.default_rng(6))
    need = int(np.asarray(rice.code_lengths(u, k)).sum())
    num_words = need // 32 + 2
    words, offsets, total = rice.encode(u, k, num_words)
    ref_words, ref_offsets, ref_total = _reference_encode(u, k, num_words)
    assert int(total) == ref_total == need
    np.testing.assert_array_equal(np.asarray(offsets), ref_offsets)
    np.testing.assert_array_equal(np.asarray(words), ref_words)
    np.testing.assert_array_equal(np.asarray(rice.decode(words, offsets, k)), u)
    np.testing.assert_array_equal(_reference_decode(np.asarray(words), ref_offsets, k), u)
    assert int(rice.used_bits(words)) == need


def test_rice_batches_and_reports_overflow():
    rng = np.random.default_rng(7)
    u = (rng.geometric(0.2, size=(4, 5, 2, 32)) - 1).astype(np.uint32)
    k = np.full(u.shape, 2, np.int32)
    words, offsets, total = rice.encode(u, k, 40)
    assert words.shape == (4, 5, 40) and offsets.shape == (4, 5, 2) and total.shape == (4, 5)
    np.testing.assert_array_equal(np.asarray(rice.decode(words, offsets, k)), u)
    np.testing.assert_array_equal(np.asarray(total),
                                  np.asarray(rice.code_lengths(u, k)).sum((-2, -1)))
    small, _, total = rice.encode(u, k, 2)  # far too small: the tail is dropped, reported
    assert (np.asarray(total) > 64).all() and small.shape[-1] == 2


def test_best_parameter_is_the_exhaustive_argmin():
    rng = np.random.default_rng(8)
    u = (rng.geometric(rng.uniform(0.02, 0.9, (50, 1)), size=(50, 200)) - 1).astype(np.uint32)
    costs = np.array([[int(((s >> kk) + 1 + kk).sum()) for kk in range(16)] for s in u])
    best = np.asarray(rice.best_parameter(u))
    np.testing.assert_array_equal(costs[np.arange(50), best], costs.min(1))


# -- lengths that do not fit in 31 bits --------------------------------------------------

SATURATED = rice.SATURATED
#: symbols whose codeword at k = 0..2 is 2^29 bits or more: 2^31 - 1 and above wrapped
#: an int32 length to a small or negative one
HUGE = (2**31 - 1, 2**31, 2**31 + 12345, 2**32 - 1)


def _exact(u: int, k: int) -> int:
    return (u >> k) + 1 + k


def _reads(got, exact) -> bool:
    """Whether a saturating length ``got`` is a valid reading of the true ``exact`` one:
    itself below EXACT_BELOW, SATURATED from 2^31 - 1 on, either in between."""
    got, exact = int(got), int(exact)
    if exact < rice.EXACT_BELOW:
        return got == exact
    return got == SATURATED or (got == exact and exact < SATURATED)


def test_code_lengths_saturate_instead_of_wrapping():
    u = np.array([*HUGE, 0, 5, 2**20], np.uint32)
    k = np.arange(16)[:, None].repeat(len(u), 1)
    got = np.asarray(rice.code_lengths(u[None], k))
    want = [[min(_exact(int(s), kk), SATURATED) for s in u] for kk in range(16)]
    np.testing.assert_array_equal(got, want)
    assert (got > 0).all()


@pytest.mark.parametrize("big", HUGE)
def test_costs_saturate_and_the_search_never_prefers_a_broken_parameter(big):
    """One huge symbol among small ones: a wrapped cost made k = 0 (or 1, 2) look the
    cheapest, though its code is longer than any buffer."""
    rng = np.random.default_rng(big % 1000)
    u = (rng.geometric(0.3, size=(2, 64)) - 1).astype(np.uint32)
    u[0, 17] = big
    u[1] = big  # every symbol huge: every parameter saturates but k = 15 at 2^17 each
    costs = np.asarray(rice.parameter_costs(u))
    exact = np.array([[sum(_exact(int(s), k) for s in row) for k in range(16)] for row in u],
                     dtype=object)
    assert all(_reads(g, e) for g, e in zip(costs.ravel(), exact.ravel(), strict=True))
    assert (costs > 0).all()
    best = np.asarray(rice.best_parameter(u))
    np.testing.assert_array_equal(best, [int(np.argmin(row)) for row in exact])
    assert (best >= 3).all()
    # masked out, the huge symbol costs nothing
    mask = np.ones(u.shape, bool)
    mask[0, 17] = False
    small = np.asarray(rice.parameter_costs(u[:1], mask[:1]))[0]
    np.testing.assert_array_equal(
        small, [sum(_exact(int(s), k) for i, s in enumerate(u[0]) if i != 17)
                for k in range(16)])


@pytest.mark.parametrize("k_big", [0, 1, 2])
def test_an_over_long_code_is_reported_and_writes_nothing_out_of_place(k_big):
    """Three sub-streams, the middle one holding a symbol of a 2^30-bit or longer
    codeword: the total says the code does not fit (never wrapped), the offsets after it
    are past the buffer, and the words are the reference writer's (the first sub-stream
    whole, the second up to the buffer's end)."""
    rng = np.random.default_rng(k_big)
    u = (rng.geometric(0.2, size=(3, 16)) - 1).astype(np.uint32)
    u[1, 0] = 2**32 - 1 - k_big
    k = np.full(u.shape, k_big, np.int32)
    num_words = 8
    words, offsets, total = rice.encode(u, k, num_words)
    lengths = [[_exact(int(s), k_big) for s in row] for row in u]
    streams = [sum(row) for row in lengths]
    assert _reads(total, sum(streams)) and int(total) > 32 * num_words
    offsets_ = np.asarray(offsets)
    assert offsets_[:2].tolist() == [0, streams[0]]
    assert _reads(offsets_[2], streams[0] + streams[1])
    # the reference writer with a quotient that also runs past the buffer, but is short
    # enough to write out
    short = u.copy()
    short[1, 0] = (64 * num_words << k_big) | (int(u[1, 0]) & ((1 << k_big) - 1))
    ref_words, _, _ = _reference_encode(short, k, num_words)
    np.testing.assert_array_equal(np.asarray(words), ref_words)
    # what fits decodes: the first sub-stream
    first = rice.decode(words, offsets[:1], k[:1])
    np.testing.assert_array_equal(np.asarray(first), u[:1])


def test_symbols_above_2_31_round_trip_where_their_code_fits():
    u = np.array([[2**32 - 1, 2**31, 2**31 - 1, 3, 2**31 + 2**15 + 7, 0]], np.uint32)
    k = np.full(u.shape, 15, np.int32)
    need = sum(_exact(int(s), 15) for s in u[0])
    words, offsets, total = rice.encode(u, k, need // 32 + 1)
    assert int(total) == need
    np.testing.assert_array_equal(np.asarray(rice.decode(words, offsets, k)), u)


def test_buffers_beyond_the_largest_are_an_error():
    with pytest.raises(ValueError, match="num_words"):
        rice.encode(np.zeros((1, 4), np.uint32), np.zeros((1, 4), np.int32),
                    rice.MAX_WORDS + 1)
