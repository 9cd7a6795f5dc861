"""Bit packing of integer codes into uint32 words, and mixed-radix packing.

Two layouts, both exact and jit/vmap compatible, chosen by :func:`pack_bits`:

* **planar** (when ``32 % bits == 0`` and the code count is a multiple of
  ``32 // bits``): with ``W`` words, code ``i`` sits in word ``i % W`` at bit slot
  ``i // W``. Extracting one slot from all words yields a *contiguous* run of codes,
  so a GPU kernel unpacks with one shift and mask per slot and never interleaves
  (for 4-bit codes of ``D = 128`` dims: slot 0 of the 16 words holds dims 0..15).
* **dense** (any other width, 1..32 bits): codes follow each other bit by bit, little
  endian, straddling word boundaries; ``ceil(n * bits / 32)`` words, no wasted bits
  except at the very end.

Mixed radix: ``k`` indices of an alphabet of size ``A`` (not a power of two, e.g. the
``24 * S`` joint codebook of HQMQ) are combined into one integer below ``A**k`` and then
bit-packed at ``ceil(log2(A**k))`` bits, which gets within a fraction of a bit of the
entropy ``log2 A`` per index (see :func:`best_radix_group`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_WORD = 32


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= _WORD:
        raise ValueError(f"bit width must be an int in 1..{_WORD}, got {bits!r}")


def is_planar(num_codes: int, bits: int) -> bool:
    """Whether :func:`pack_bits` uses the planar layout for this size."""
    return _WORD % bits == 0 and num_codes % (_WORD // bits) == 0


def num_words(num_codes: int, bits: int) -> int:
    """Number of uint32 words :func:`pack_bits` produces for ``num_codes`` codes."""
    _check_bits(bits)
    return math.ceil(num_codes * bits / _WORD)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Pack unsigned codes ``[..., n]`` (each ``< 2**bits``) into ``uint32[..., words]``.

    Values are masked to ``bits`` bits; the caller guarantees the range.
    """
    _check_bits(bits)
    n = codes.shape[-1]
    c = codes.astype(jnp.uint32)
    if bits < _WORD:
        c = c & jnp.uint32((1 << bits) - 1)
    if is_planar(n, bits):
        per = _WORD // bits
        w = n // per
        slots = c.reshape(*c.shape[:-1], per, w)
        shifts = (jnp.arange(per, dtype=jnp.uint32) * bits)[:, None]
        # slots occupy disjoint bits, so the sum is an OR
        return jnp.sum(slots << shifts, axis=-2, dtype=jnp.uint32)
    words = num_words(n, bits)
    offset = jnp.arange(n, dtype=jnp.int32) * bits
    word, shift = offset // _WORD, (offset % _WORD).astype(jnp.uint32)
    lo = c << shift
    # the part that spills into the next word; shifting a uint32 by 32 is undefined
    spill = shift.astype(jnp.int32) + bits > _WORD
    hi = jnp.where(spill, c >> jnp.where(spill, _WORD - shift, 0), 0).astype(jnp.uint32)
    out = jnp.zeros((*c.shape[:-1], words + 1), jnp.uint32)
    out = out.at[..., word].add(lo).at[..., word + 1].add(hi)
    return out[..., :words]


def unpack_bits(words: jax.Array, bits: int, num_codes: int) -> jax.Array:
    """Inverse of :func:`pack_bits`: ``uint32[..., words] -> uint32[..., num_codes]``."""
    _check_bits(bits)
    if words.shape[-1] != num_words(num_codes, bits):
        raise ValueError(
            f"{words.shape[-1]} words cannot hold exactly {num_codes} codes of {bits} bits"
        )
    words = words.astype(jnp.uint32)
    mask = jnp.uint32((1 << bits) - 1) if bits < _WORD else jnp.uint32(0xFFFFFFFF)
    if is_planar(num_codes, bits):
        per = _WORD // bits
        shifts = (jnp.arange(per, dtype=jnp.uint32) * bits)[:, None]
        slots = (words[..., None, :] >> shifts) & mask
        return slots.reshape(*words.shape[:-1], num_codes)
    offset = jnp.arange(num_codes, dtype=jnp.int32) * bits
    word, shift = offset // _WORD, (offset % _WORD).astype(jnp.uint32)
    padded = jnp.concatenate([words, jnp.zeros_like(words[..., :1])], axis=-1)
    lo = padded[..., word] >> shift
    spill = shift.astype(jnp.int32) + bits > _WORD
    hi = jnp.where(spill, padded[..., word + 1] << jnp.where(spill, _WORD - shift, 0), 0)
    return (lo | hi.astype(jnp.uint32)) & mask


# -- mixed radix ---------------------------------------------------------------------


def radix_group_bits(alphabet: int, group: int) -> int:
    """Bits needed for ``group`` indices of an alphabet of size ``alphabet`` combined."""
    return max(1, math.ceil(group * math.log2(alphabet) - 1e-12))


def best_radix_group(alphabet: int, max_group: int = 16) -> int:
    """The group size ``k`` (fitting in 32 bits) with the fewest bits per index."""
    if alphabet < 2:
        raise ValueError(f"alphabet must be >= 2, got {alphabet}")
    best, best_cost = 1, float("inf")
    for k in range(1, max_group + 1):
        if alphabet**k > 2**_WORD:
            break
        cost = radix_group_bits(alphabet, k) / k
        if cost < best_cost - 1e-12:
            best, best_cost = k, cost
    return best


def _check_radix(alphabet: int, group: int) -> None:
    if not isinstance(alphabet, int) or alphabet < 2:
        raise ValueError(f"alphabet must be an int >= 2, got {alphabet!r}")
    if not isinstance(group, int) or group < 1 or alphabet**group > 2**_WORD:
        raise ValueError(f"{group} indices of alphabet {alphabet} do not fit in 32 bits")


def radix_combine(indices: jax.Array, alphabet: int, group: int) -> jax.Array:
    """``[..., n]`` indices (each ``< alphabet``) -> ``uint32[..., n // group]``.

    Index ``j`` of a group is digit ``j`` (least significant first) in base ``alphabet``.
    Horner's rule keeps every intermediate below ``alphabet**group <= 2**32``.
    """
    _check_radix(alphabet, group)
    n = indices.shape[-1]
    if n % group:
        raise ValueError(f"{n} indices do not split into groups of {group}")
    digits = indices.astype(jnp.uint32).reshape(*indices.shape[:-1], n // group, group)
    acc = digits[..., group - 1]
    for j in range(group - 2, -1, -1):
        acc = acc * jnp.uint32(alphabet) + digits[..., j]
    return acc


def radix_split(values: jax.Array, alphabet: int, group: int) -> jax.Array:
    """Inverse of :func:`radix_combine`: ``uint32[..., m] -> uint32[..., m * group]``."""
    _check_radix(alphabet, group)
    v = values.astype(jnp.uint32)
    digits = []
    for _ in range(group):
        digits.append(v % jnp.uint32(alphabet))
        v = v // jnp.uint32(alphabet)
    return jnp.stack(digits, axis=-1).reshape(*values.shape[:-1], values.shape[-1] * group)


def pack_radix(indices: jax.Array, alphabet: int, group: int | None = None) -> jax.Array:
    """Mixed-radix combine then bit-pack: ``[..., n] -> uint32[..., words]``."""
    group = group or best_radix_group(alphabet)
    return pack_bits(radix_combine(indices, alphabet, group), radix_group_bits(alphabet, group))


def unpack_radix(
    words: jax.Array, alphabet: int, num_indices: int, group: int | None = None
) -> jax.Array:
    """Inverse of :func:`pack_radix`."""
    group = group or best_radix_group(alphabet)
    combined = unpack_bits(words, radix_group_bits(alphabet, group), num_indices // group)
    return radix_split(combined, alphabet, group)


def radix_words(num_indices: int, alphabet: int, group: int | None = None) -> int:
    """uint32 words :func:`pack_radix` produces."""
    group = group or best_radix_group(alphabet)
    if num_indices % group:
        raise ValueError(f"{num_indices} indices do not split into groups of {group}")
    return num_words(num_indices // group, radix_group_bits(alphabet, group))
