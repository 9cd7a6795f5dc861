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

Fields: :func:`pack_fields` writes several code arrays of different widths into one
dense stream (codes of 3 bits, then codes of 6 bits, ...), so a record of mixed fields
wastes bits only at the end of the stream, not at the end of every field;
:func:`pack_field_bytes` stores that stream in whole bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

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


def code_position(index, num_codes: int, bits: int):
    """Where :func:`pack_bits` puts code ``index`` of ``num_codes``: ``(word, bit)``, the
    word and the bit its lowest bit sits at (a dense code may run into the next word).
    ``index`` an int or an int array (for a reader that gathers single codes)."""
    _check_bits(bits)
    if is_planar(num_codes, bits):
        words = num_codes // (_WORD // bits)
        return index % words, (index // words) * bits
    return index * bits // _WORD, index * bits % _WORD


def _or_shifted(parts: jax.Array, width: int, axis: int) -> jax.Array:
    """``parts`` (uint32) ORed along ``axis``, part ``i`` shifted left by ``i * width``
    bits (the parts occupy disjoint bits). Shifts and ORs of slices, not a sum over the
    axis: elementwise, so XLA fuses the packing into whatever computes the codes, where
    a reduction is a GPU kernel of its own (two per layer in every decode step's append
    of an INT cache)."""
    parts = jnp.moveaxis(parts, axis, 0)
    out = parts[0]
    for i in range(1, parts.shape[0]):
        out = out | (parts[i] << jnp.uint32(i * width))
    return out


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
        return _or_shifted(c.reshape(*c.shape[:-1], per, w), bits, axis=-2)
    return pack_fields([(c, bits)])


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
    return unpack_fields(words, [(num_codes, bits)])[0]


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


# -- streams of fields of mixed widths ---------------------------------------------------


def _field_layout(widths: Sequence[tuple[int, int]]):
    """Per code: bit width and bit offset of a stream of ``(count, bits)`` fields."""
    for count, bits in widths:
        _check_bits(bits)
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"field sizes must be non-negative ints, got {count!r}")
    per_code = np.concatenate(
        [np.full(count, bits, np.int64) for count, bits in widths] or [np.zeros(0, np.int64)])
    offsets = np.concatenate([[0], np.cumsum(per_code)[:-1]]).astype(np.int64)
    return per_code, offsets, int(per_code.sum())


def fields_bits(widths: Sequence[tuple[int, int]]) -> int:
    """Total bits of a stream of ``(count, bits)`` fields."""
    return _field_layout(widths)[2]


def pack_fields(fields: Sequence[tuple[jax.Array, int]]) -> jax.Array:
    """Pack ``[(codes[..., n_i], bits_i), ...]`` back to back into ``uint32[..., words]``.

    Bit-dense and little endian like the dense layout of :func:`pack_bits`; ``words =
    ceil(sum(n_i * bits_i) / 32)``. Values are masked to their width.
    """
    widths = [(int(c.shape[-1]), bits) for c, bits in fields]
    per_code, offsets, total = _field_layout(widths)
    lead = jnp.broadcast_shapes(*(c.shape[:-1] for c, _ in fields))
    codes = jnp.concatenate(
        [jnp.broadcast_to(c.astype(jnp.uint32), (*lead, c.shape[-1])) for c, _ in fields],
        axis=-1)
    return pack_at(codes, per_code, offsets, total)


def _check_slots(widths, offsets, total_bits: int):
    widths = np.asarray(widths, np.int64)
    offsets = np.asarray(offsets, np.int64)
    if widths.shape != offsets.shape or widths.ndim != 1:
        raise ValueError(f"one width and one offset per code, got {widths.shape} and "
                         f"{offsets.shape}")
    if np.any(widths < 1) or np.any(widths > _WORD) or np.any(offsets < 0) or np.any(
            offsets + widths > total_bits):
        raise ValueError(f"codes of widths 1..{_WORD} inside a stream of {total_bits} bits")
    taken = np.zeros(total_bits, np.int64)
    for o, w in zip(offsets.tolist(), widths.tolist(), strict=True):
        taken[o:o + w] += 1
    if np.any(taken > 1):
        raise ValueError("codes of a stream overlap")
    return widths, offsets


def pack_at(codes: jax.Array, widths, offsets, total_bits: int) -> jax.Array:
    """Codes ``[..., n]`` written at static bit ``offsets`` (each ``widths`` bits wide,
    little endian, none overlapping) of a stream of ``total_bits`` bits, as ``uint32[...,
    ceil(total_bits / 32)]``; bits no code covers are 0. :func:`pack_fields` is the case of
    codes back to back; a layout that places each code where a reader wants it (a kernel
    reading fields of aligned units) is any other. Values are masked to their width."""
    per_code, offsets = _check_slots(widths, offsets, total_bits)
    lead = codes.shape[:-1]
    codes = codes.astype(jnp.uint32)
    mask = np.where(per_code < _WORD, (1 << np.minimum(per_code, 31)) - 1, 0xFFFFFFFF)
    codes = codes & jnp.asarray(mask.astype(np.uint32))
    words = -(-total_bits // _WORD)
    word = offsets // _WORD
    shift = (offsets % _WORD).astype(np.uint32)
    spill = (offsets % _WORD) + per_code > _WORD
    lo = codes << jnp.asarray(shift)
    back = np.where(spill, _WORD - shift, 0).astype(np.uint32)
    hi = jnp.where(jnp.asarray(spill), codes >> jnp.asarray(back), jnp.uint32(0))
    out = jnp.zeros((*lead, words + 1), jnp.uint32)
    # codes occupy disjoint bits, so adding is OR-ing
    out = out.at[..., word].add(lo).at[..., word + 1].add(hi)
    return out[..., :words]


def unpack_fields(words: jax.Array, widths: Sequence[tuple[int, int]]) -> list[jax.Array]:
    """Inverse of :func:`pack_fields` given the ``(count, bits)`` of every field."""
    per_code, offsets, total = _field_layout(widths)
    if words.shape[-1] != -(-total // _WORD):
        raise ValueError(f"{words.shape[-1]} words do not hold a stream of {total} bits")
    codes = unpack_at(words, per_code, offsets)
    out, start = [], 0
    for count, _ in widths:
        out.append(codes[..., start:start + count])
        start += count
    return out


def unpack_at(words: jax.Array, widths, offsets) -> jax.Array:
    """Inverse of :func:`pack_at`: the codes ``uint32[..., n]`` at bit ``offsets`` of
    ``uint32[..., W]`` words."""
    per_code, offsets = _check_slots(widths, offsets, _WORD * words.shape[-1])
    word = offsets // _WORD
    shift = (offsets % _WORD).astype(np.uint32)
    spill = (offsets % _WORD) + per_code > _WORD
    padded = jnp.concatenate([words.astype(jnp.uint32), jnp.zeros_like(words[..., :1])],
                             axis=-1)
    lo = padded[..., word] >> jnp.asarray(shift)
    back = np.where(spill, _WORD - shift, 0).astype(np.uint32)
    hi = jnp.where(jnp.asarray(spill), padded[..., word + 1] << jnp.asarray(back),
                   jnp.uint32(0))
    mask = np.where(per_code < _WORD, (1 << np.minimum(per_code, 31)) - 1, 0xFFFFFFFF)
    return (lo | hi) & jnp.asarray(mask.astype(np.uint32))


_UNIT_DTYPES = {8: jnp.uint8, 16: jnp.uint16}


def to_units(words: jax.Array, total_bits: int, unit: int = 8) -> jax.Array:
    """The first ``ceil(total_bits / unit)`` bytes (``unit=8``) or 16-bit halves
    (``unit=16``) of a stream of ``uint32`` words, little endian.

    Storing a stream in bytes instead of words saves the last word's unused bytes.
    """
    if unit not in _UNIT_DTYPES:
        raise ValueError(f"unit must be 8 or 16 bits, got {unit!r}")
    if words.shape[-1] != -(-total_bits // _WORD):
        raise ValueError(f"{words.shape[-1]} words do not hold a stream of {total_bits} bits")
    per = _WORD // unit
    w = words.astype(jnp.uint32)
    shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(unit)
    parts = (w[..., None] >> shifts) & jnp.uint32((1 << unit) - 1)
    parts = parts.reshape(*w.shape[:-1], per * w.shape[-1])
    return parts[..., : -(-total_bits // unit)].astype(_UNIT_DTYPES[unit])


def from_units(units: jax.Array, total_bits: int, unit: int = 8) -> jax.Array:
    """Inverse of :func:`to_units`: the stream's ``uint32`` words."""
    if unit not in _UNIT_DTYPES:
        raise ValueError(f"unit must be 8 or 16 bits, got {unit!r}")
    if units.shape[-1] != -(-total_bits // unit):
        raise ValueError(f"{units.shape[-1]} units do not hold a stream of {total_bits} bits")
    per, words = _WORD // unit, -(-total_bits // _WORD)
    u = units.astype(jnp.uint32)
    u = jnp.pad(u, [(0, 0)] * (u.ndim - 1) + [(0, per * words - u.shape[-1])])
    u = u.reshape(*u.shape[:-1], words, per)
    return _or_shifted(u, unit, axis=-1)


def pack_field_bytes(fields: Sequence[tuple[jax.Array, int]]) -> jax.Array:
    """:func:`pack_fields` stored in whole bytes (:func:`to_units`): ``uint8[...,
    ceil(sum(n_i * bits_i) / 8)]``."""
    total = fields_bits([(int(c.shape[-1]), bits) for c, bits in fields])
    return to_units(pack_fields(fields), total)


def unpack_field_bytes(units: jax.Array, widths: Sequence[tuple[int, int]]) -> list[jax.Array]:
    """Inverse of :func:`pack_field_bytes` given the ``(count, bits)`` of every field."""
    return unpack_fields(from_units(units, fields_bits(widths)), widths)


# -- mixed-radix fields: an alphabet's odd part in radix groups, its power of two in bits --


def radix_plan(num_indices: int, alphabet: int):
    """``(odd, low_bits, group, full_groups, rest)`` of :func:`radix_fields`: ``alphabet =
    odd * 2**low_bits``, the odd digits combined ``group`` at a time in ``full_groups``
    groups and one of ``rest``."""
    if not isinstance(alphabet, int) or alphabet < 1:
        raise ValueError(f"alphabet must be a positive int, got {alphabet!r}")
    low = (alphabet & -alphabet).bit_length() - 1
    odd = alphabet >> low
    group = best_radix_group(odd) if odd > 1 else 1
    return odd, low, group, num_indices // group, num_indices % group


def radix_widths(num_indices: int, alphabet: int) -> list[tuple[int, int]]:
    """The ``(count, bits)`` fields :func:`radix_fields` produces."""
    odd, low, group, full, rest = radix_plan(num_indices, alphabet)
    widths = []
    if odd > 1:
        widths.append((full, radix_group_bits(odd, group)))
        if rest:
            widths.append((1, radix_group_bits(odd, rest)))
    if low:
        widths.append((num_indices, low))
    return [(count, bits) for count, bits in widths if count]


def radix_fields(indices: jax.Array, alphabet: int) -> list[tuple[jax.Array, int]]:
    """``[..., n]`` indices below ``alphabet`` as fields for :func:`pack_fields`.

    ``alphabet = odd * 2**low``: each index splits into ``index >> low`` (a digit in
    base ``odd``) and its ``low`` low bits. The digits are combined ``k`` at a time
    (:func:`best_radix_group` of ``odd``, the last group shorter) and the low bits stored
    plainly, so the stream costs ``log2(alphabet)`` bits per index plus the fraction of
    a bit that the odd part's groups round up to. For HQMQ's ``24 * S`` that odd part is
    ``3 * odd(S)``: 9 for S in 24, 48, 96, 192, whose digits pack 5 to 16 bits (3.2
    bits against log2 9 = 3.17).
    """
    n = indices.shape[-1]
    odd, low, group, full, rest = radix_plan(n, alphabet)
    idx = indices.astype(jnp.uint32)
    fields = []
    if odd > 1:
        digits = idx >> jnp.uint32(low)
        if full:
            fields.append((radix_combine(digits[..., :full * group], odd, group),
                           radix_group_bits(odd, group)))
        if rest:
            fields.append((radix_combine(digits[..., full * group:], odd, rest),
                           radix_group_bits(odd, rest)))
    if low:
        fields.append((idx & jnp.uint32((1 << low) - 1), low))
    return fields


def radix_indices(codes: Sequence[jax.Array], num_indices: int, alphabet: int) -> jax.Array:
    """Inverse of :func:`radix_fields` from the fields' codes (as :func:`unpack_fields`
    returns them)."""
    odd, low, group, full, rest = radix_plan(num_indices, alphabet)
    codes = list(codes)
    if not codes:  # an alphabet of one index
        return jnp.zeros((num_indices,), jnp.uint32)
    lead = codes[0].shape[:-1]
    hi = jnp.zeros((*lead, num_indices), jnp.uint32)
    if odd > 1:
        parts = []
        if full:
            parts.append(radix_split(codes.pop(0), odd, group))
        if rest:
            parts.append(radix_split(codes.pop(0), odd, rest))
        hi = jnp.concatenate(parts, axis=-1)
    if low:
        return (hi << jnp.uint32(low)) | codes.pop(0).astype(jnp.uint32)
    return hi


# -- sign-magnitude codes with the sign bit on planes of its own ---------------------------


def is_split_planar(num_codes: int, bits: int) -> bool:
    """Whether :func:`pack_split` serves this size: 3-bit codes whose low 2 bits pack
    planar (``num_codes`` a multiple of 32, so the top bits fill whole words too)."""
    return bits == 3 and num_codes % _WORD == 0


def is_byte_planar(num_codes: int, bits: int) -> bool:
    """Whether :func:`pack_codes` writes 2-bit codes in byte planes
    (:func:`byte_plane_order`): ``num_codes`` a multiple of 16, whole words."""
    return bits == 2 and is_planar(num_codes, 2)


def byte_plane_order(num_codes: int) -> np.ndarray:
    """The 2-bit byte-plane order: the code index at each position of the planar
    layout (:func:`pack_bits`) such that byte ``u`` of the packed words holds, in its
    2-bit field ``j``, code ``j * n / 4 + u``. A kernel that reads the words as bytes then
    finds in bit plane ``j`` the contiguous quarter ``j`` of the vector (one channel group
    of a value, for groups of ``n / 4`` or more)."""
    n = num_codes
    if not is_byte_planar(n, 2):
        raise ValueError(f"byte planes hold 2-bit codes in multiples of 16, got {n}")
    words = n // 16
    position = np.arange(n)
    slot, word = position // words, position % words  # planar: slot s of word w
    byte, field = slot // 4, slot % 4
    return field * (n // 4) + 4 * word + byte


def pack_split(codes: jax.Array) -> jax.Array:
    """3-bit codes ``[..., n]`` as ``uint32[..., 3n / 32]`` that a kernel reads without
    crossing a word: the low 2 bits as :func:`pack_codes` packs 2-bit codes (byte planes,
    ``n / 16`` words), then the top bits, ``n / 32`` words in which byte ``u`` holds, at
    bit ``j``, the top bit of the code in 2-bit slot ``j`` of 16-bit unit ``u`` of the low
    words. Exactly the dense layout's ``3 n`` bits, in another order."""
    n = codes.shape[-1]
    if not is_split_planar(n, 3):
        raise ValueError(f"the split layout packs 3-bit codes in multiples of {_WORD}, got {n}")
    c = codes.astype(jnp.uint32)[..., byte_plane_order(n)]
    low = pack_bits(c & jnp.uint32(3), 2)
    words = n // 16
    # planar 2-bit: position s * words + w sits in word w, slot s; unit u = 2 w + k holds
    # slots 8 k .. 8 k + 7, so its top byte gathers slots 8 k + j at bit j
    top = ((c >> jnp.uint32(2)) & jnp.uint32(1)).reshape(*c.shape[:-1], 2, 8, words)
    byte = _or_shifted(top, 1, axis=-2)
    units = jnp.swapaxes(byte, -1, -2).reshape(*c.shape[:-1], n // 8)  # u = 2 w + k
    return jnp.concatenate([low, from_units(units.astype(jnp.uint8), n)], axis=-1)


def unpack_split(words: jax.Array, num_codes: int) -> jax.Array:
    """Inverse of :func:`pack_split`: ``uint32[..., 3n / 32] -> uint32[..., n]``."""
    n = num_codes
    if not is_split_planar(n, 3) or words.shape[-1] != 3 * n // _WORD:
        raise ValueError(f"{words.shape[-1]} words do not hold {n} split 3-bit codes")
    w = words.astype(jnp.uint32)
    low = unpack_bits(w[..., : n // 16], 2, n)
    units = to_units(w[..., n // 16:], n).astype(jnp.uint32)  # [..., n / 8], u = 2 w + k
    units = jnp.swapaxes(units.reshape(*w.shape[:-1], n // 16, 2), -1, -2)  # [k, w]
    top = (units[..., None, :] >> jnp.arange(8, dtype=jnp.uint32)[:, None]) & jnp.uint32(1)
    planar = low | (top.reshape(*w.shape[:-1], n) << jnp.uint32(2))
    return planar[..., np.argsort(byte_plane_order(n))]


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """A vector's ``bits``-bit codes ``[..., n]`` in the layout kernels read best: split
    (:func:`pack_split`) for 3 bits where it applies, byte planes
    (:func:`byte_plane_order`) for 2 bits, else :func:`pack_bits` (planar where it
    applies, else dense). Every choice holds ``n * bits`` bits in ``ceil(n * bits / 32)``
    words."""
    n = codes.shape[-1]
    if is_split_planar(n, bits):
        return pack_split(codes)
    if is_byte_planar(n, bits):
        return pack_bits(codes[..., byte_plane_order(n)], bits)
    return pack_bits(codes, bits)


def unpack_codes(words: jax.Array, bits: int, num_codes: int) -> jax.Array:
    """Inverse of :func:`pack_codes`."""
    if is_split_planar(num_codes, bits):
        return unpack_split(words, num_codes)
    codes = unpack_bits(words, bits, num_codes)
    if is_byte_planar(num_codes, bits):
        return codes[..., np.argsort(byte_plane_order(num_codes))]
    return codes
