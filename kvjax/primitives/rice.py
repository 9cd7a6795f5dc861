"""Rice coding of non-negative integer symbols in sub-streams, vectorized in JAX.

A Rice code with parameter ``k`` writes a symbol ``u`` as its quotient ``q = u >> k`` in
unary (``q`` zeros and a terminating one) and its ``k`` low bits: ``q + 1 + k`` bits.
Symbols are grouped in *sub-streams*, each with its own parameter(s) and start bit
offset, so any sub-stream decodes independently.

Layout of one sub-stream. Its ``S`` remainders come first, ``k`` bits each (least
significant first, so that a reader takes a remainder as a masked window of the stream
without reversing its bits), then its ``S`` unary quotients. The bit count is exactly that of the
textbook interleaved Rice code (the same codewords, reordered), but both directions
become data-parallel: the remainders sit at offsets known from ``k`` alone, and the
``i``-th quotient ends at the ``i``-th one of the unary region, which a cumulative sum
finds for every symbol at once. Encoding is lengths -> cumulative sums -> one scatter
of the set bits into 32-bit words (bit ``p`` of a stream is bit ``p % 32`` of word
``p // 32``); decoding is a gather for the remainders and a cumulative sum plus a
scatter for the quotients. No serial scan either way.

Sub-streams of a buffer follow each other with no gap; their start offsets are returned
by the encoder and must be given to the decoder. A buffer has a fixed number of words:
bits past its end are dropped and the encoder reports the length the code needed, so a
caller detects overflow by comparing it with the capacity.

Lengths never wrap. A symbol near ``2^32`` at ``k = 0`` has a codeword of ``2^32`` bits,
and a block of them far more. Every length, cost, offset and total here is an int32 that
is exact up to :data:`EXACT_BELOW` and reads :data:`SATURATED` (the largest int32) where
it would not fit; one between the two reads either way (sums are checked against a
float32 copy, whose rounding decides there), never wrapped. Both are beyond any buffer
(at most :data:`MAX_WORDS` words, ``2^29`` bits), so an over-long code is reported as not
fitting, and a parameter under which some codeword is that long is never the cheapest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

#: largest Rice parameter (parameters are stored in 4-bit fields)
MAX_PARAMETER = 15
#: what a length, cost or bit position too large for an int32 reads (the largest int32)
SATURATED = 2**31 - 1
#: lengths below this are exact; from it up to :data:`SATURATED` they may read either
EXACT_BELOW = 2**29
#: largest buffer in words: its ``2^29`` bits stay below every inexact length
MAX_WORDS = EXACT_BELOW // 32


def saturating_add(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a + b`` of non-negative int32 lengths, :data:`SATURATED` where it would not fit."""
    a = jnp.asarray(a, jnp.int32)
    b = jnp.asarray(b, jnp.int32)
    return jnp.where(a > SATURATED - b, SATURATED, a + b)


def _checked(exact: jax.Array, approx: jax.Array) -> jax.Array:
    """An int32 sum where its float32 copy shows that it cannot have wrapped (below
    ``2 EXACT_BELOW``: the int32 sum is then below ``2^31`` whatever float32 rounding
    did), else :data:`SATURATED`."""
    return jnp.where(approx < 2.0 * EXACT_BELOW, exact, SATURATED)


def saturating_sum(lengths: jax.Array, axis: int | tuple[int, ...] = -1) -> jax.Array:
    """Sum of non-negative int32 ``lengths`` over ``axis``: exact below
    :data:`EXACT_BELOW`, else exact or :data:`SATURATED` (a plain sum would wrap to a
    small or negative number)."""
    lengths = jnp.asarray(lengths, jnp.int32)
    # two plain reductions compile far faster than a reduction with a saturating add
    return _checked(jnp.sum(lengths, axis=axis), jnp.sum(lengths.astype(jnp.float32), axis))


def saturating_cumsum(lengths: jax.Array, axis: int = -1) -> jax.Array:
    """Inclusive cumulative sum of non-negative int32 ``lengths``, saturating as
    :func:`saturating_sum` does."""
    lengths = jnp.asarray(lengths, jnp.int32)
    return _checked(jnp.cumsum(lengths, axis=axis),
                    jnp.cumsum(lengths.astype(jnp.float32), axis=axis))


def code_lengths(symbols: jax.Array, k: jax.Array) -> jax.Array:
    """Bits of each symbol's Rice codeword, ``(u >> k) + 1 + k`` (int32, saturating at
    :data:`SATURATED`); ``k`` in ``0..15``."""
    u = jnp.asarray(symbols, jnp.uint32)
    k = jnp.asarray(k, jnp.uint32)
    quotient = jnp.minimum(u >> k, jnp.uint32(SATURATED) - 1 - k)
    return (quotient + 1 + k).astype(jnp.int32)


def code_length(symbols: jax.Array, k: jax.Array) -> jax.Array:
    """Bits of the whole code of ``symbols[..., n_sub, S]`` with parameters ``k`` (as
    :func:`encode` takes them): int32 ``[...]``, saturating (:func:`saturating_sum`)."""
    return saturating_sum(code_lengths(symbols, k), axis=(-2, -1))


def parameter_costs(symbols: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Total code length of ``symbols[..., S]`` under every parameter ``0..15``:
    int32 ``[..., 16]``, saturating (:func:`saturating_sum`); ``mask[..., S]`` (bool)
    selects the symbols that count."""
    u = jnp.asarray(symbols, jnp.uint32)[..., None]
    lengths = code_lengths(u, jnp.arange(MAX_PARAMETER + 1, dtype=jnp.uint32))
    if mask is not None:
        lengths = jnp.where(jnp.asarray(mask)[..., None], lengths, 0)
    return saturating_sum(lengths, axis=-2)


def best_parameter(symbols: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """The Rice parameter (int32 ``[...]``) that codes ``symbols[..., S]`` in the fewest bits
    (the first of those, so 0 when every parameter's code saturates)."""
    return jnp.argmin(parameter_costs(symbols, mask), axis=-1).astype(jnp.int32)


def encode(symbols: jax.Array, k: jax.Array, num_words: int):
    """Rice-code sub-streams into a fixed buffer of 32-bit words.

    Args:
        symbols: uint32 ``[..., n_sub, S]``: ``n_sub`` sub-streams of ``S`` symbols.
        k: Rice parameter of every symbol, int ``[..., n_sub, S]`` in ``0..15`` (a
            sub-stream may mix parameters, e.g. one per symbol class).
        num_words: buffer capacity in uint32 words, at most :data:`MAX_WORDS`.

    Returns:
        ``(words, offsets, total)``: uint32 ``[..., num_words]``, the int32 start bit of
        each sub-stream ``[..., n_sub]``, and the int32 bits the whole code needs
        ``[...]`` (above ``32 * num_words`` the tail was dropped; offsets and the total
        saturate as :func:`saturating_sum` does).
    """
    if not 1 <= num_words <= MAX_WORDS:
        raise ValueError(f"rice.encode: num_words must be in 1..{MAX_WORDS}, got {num_words}")
    symbols = jnp.asarray(symbols, jnp.uint32)
    k = jnp.broadcast_to(jnp.asarray(k, jnp.int32), symbols.shape)
    lead = symbols.shape[:-2]
    flat = _encode_block_batch(symbols.reshape(-1, *symbols.shape[-2:]),
                               k.reshape(-1, *k.shape[-2:]), num_words)
    words, offsets, total = flat
    return (words.reshape(*lead, num_words), offsets.reshape(*lead, symbols.shape[-2]),
            total.reshape(lead))


def decode(words: jax.Array, offsets: jax.Array, k: jax.Array) -> jax.Array:
    """Inverse of :func:`encode`: symbols uint32 ``[..., n_sub, S]`` from the words, the
    sub-streams' start bits ``[..., n_sub]`` and every symbol's parameter ``k[..., n_sub, S]``."""
    words = jnp.asarray(words, jnp.uint32)
    offsets = jnp.asarray(offsets, jnp.int32)
    k = jnp.asarray(k, jnp.int32)
    lead = k.shape[:-2]
    words = jnp.broadcast_to(words, (*lead, words.shape[-1]))
    offsets = jnp.broadcast_to(offsets, (*lead, k.shape[-2]))
    out = _decode_block_batch(words.reshape(-1, words.shape[-1]),
                              offsets.reshape(-1, offsets.shape[-1]),
                              k.reshape(-1, *k.shape[-2:]))
    return out.reshape(k.shape)


def used_bits(words: jax.Array) -> jax.Array:
    """One past the highest set bit of ``words[..., W]`` (int32 ``[...]``): the length of a
    Rice-coded buffer, whose last bit is always a unary terminator."""
    words = jnp.asarray(words, jnp.uint32)
    top = 32 - jax.lax.clz(words).astype(jnp.int32)  # 0 for a zero word
    index = jnp.arange(words.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(top > 0, 32 * index + top, 0), axis=-1)


def _layout(k: jax.Array, lengths: jax.Array):
    """Start offsets, remainder starts and unary starts of a block's sub-streams and its
    total length, from the parameters and codeword lengths ``[n_sub, S]`` (saturating)."""
    stream_len = saturating_sum(lengths, axis=-1)
    ends = saturating_cumsum(stream_len)
    # exclusive sums by shifting: ``ends - stream_len`` is wrong once they saturate
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    # k <= 15 per symbol: these small sums cannot wrap
    remainder_start = saturating_add(offsets[:, None], jnp.cumsum(k, axis=-1) - k)
    unary_start = saturating_add(offsets, jnp.sum(k, axis=-1))
    return offsets, remainder_start, unary_start, ends[-1]


_BIT = jnp.arange(MAX_PARAMETER, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnums=2)
@functools.partial(jax.vmap, in_axes=(0, 0, None))
def _encode_block_batch(u: jax.Array, k: jax.Array, num_words: int):
    capacity = 32 * num_words
    lengths = code_lengths(u, k)
    offsets, rem_start, unary_start, total = _layout(k, lengths)
    # remainder bits, least significant first: bit b of a symbol is (u >> b) & 1
    has_bit = _BIT < k[..., None]
    rem_bits = (u[..., None] >> _BIT.astype(jnp.uint32)) & 1
    # starts past the buffer are held at its end, so adding the bit index cannot wrap
    rem_pos = jnp.minimum(rem_start, capacity)[..., None] + _BIT
    rem_pos = jnp.where(has_bit & (rem_bits == 1), rem_pos, capacity)
    # the terminating one of each quotient (a saturated position lies past the buffer)
    term_pos = saturating_add(unary_start[:, None], saturating_cumsum(lengths - k)) - 1
    pos = jnp.concatenate([rem_pos.reshape(-1), term_pos.reshape(-1)])
    pos = jnp.where(pos < capacity, pos, capacity)
    values = jnp.left_shift(jnp.uint32(1), (pos & 31).astype(jnp.uint32))
    words = jnp.zeros(num_words, jnp.uint32).at[pos >> 5].add(values, mode="drop")
    return words, offsets.astype(jnp.int32), total.astype(jnp.int32)


@jax.jit
@jax.vmap
def _decode_block_batch(words: jax.Array, offsets: jax.Array, k: jax.Array) -> jax.Array:
    size = k.shape[-1]
    bits = ((words[:, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1).reshape(-1)
    bits = bits.astype(jnp.int32)
    capacity = bits.shape[0]
    rem_start = offsets[:, None] + jnp.cumsum(k, axis=-1) - k
    unary_start = offsets + jnp.sum(k, axis=-1)
    # remainders: a gather of k bits per symbol
    has_bit = _BIT < k[..., None]
    rem_bit = bits[jnp.clip(rem_start[..., None] + _BIT, 0, capacity - 1)]
    rem = jnp.sum(jnp.where(has_bit, rem_bit << _BIT, 0), axis=-1)
    # quotients: the i-th one at or after a sub-stream's unary start ends its i-th symbol
    ones_before = jnp.cumsum(bits) - bits  # ones strictly before each position
    base = ones_before[jnp.clip(unary_start, 0, capacity - 1)]  # [n_sub]
    rank = ones_before[None, :] - base[:, None]  # [n_sub, capacity]
    is_end = (bits[None, :] == 1) & (rank >= 0) & (rank < size)
    target = jnp.where(is_end, rank, size)
    position = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), target.shape)
    ends = jax.vmap(lambda t, p: jnp.zeros(size, jnp.int32).at[t].set(p, mode="drop"))(
        target, position)
    previous = jnp.concatenate([unary_start[:, None] - 1, ends[:, :-1]], axis=-1)
    q = ends - previous - 1
    # in uint32: a symbol at or above 2^31 is a valid code at k >= 1
    return (q.astype(jnp.uint32) << k.astype(jnp.uint32)) | rem.astype(jnp.uint32)
