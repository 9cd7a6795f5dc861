"""The inline PTX of :mod:`pallas_kernels.units`, run by a small emulator of the handful
of instructions it uses, against the jnp forms that interpret mode runs: the compiled
kernels' bit tricks checked on a CPU, lane by lane, whatever elements Triton packs into a
register."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.primitives.packing import pack_codes, unpack_codes
from pallas_kernels import units
from pallas_kernels.units import Ptx

MASK = 0xFFFFFFFF


def _f16(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint16).view(np.float16).astype(np.float64)


def _lanes(a, op):
    """A float16x2 operation on uint32 registers."""
    lo = [_f16(x & np.uint64(0xFFFF)) for x in a]
    hi = [_f16(x >> np.uint64(16)) for x in a]
    out_lo = np.float16(op(*lo)).view(np.uint16).astype(np.uint64)
    out_hi = np.float16(op(*hi)).view(np.uint16).astype(np.uint64)
    return out_lo | (out_hi << np.uint64(16))


def _prmt(a, b, c):
    source = [(x >> np.uint64(8 * i)) & np.uint64(0xFF) for x in (a, b) for i in range(4)]
    source = np.stack(source).astype(np.uint64)
    out = np.zeros_like(a)
    for i in range(4):
        sel = (c >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = np.take_along_axis(source, (sel & np.uint64(7))[None].astype(np.int64),
                                  axis=0)[0]
        sign = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        byte = np.where(sel & np.uint64(8), sign, byte).astype(np.uint64)
        out |= byte << np.uint64(8 * i)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    one = np.uint64(1)
    for bit in range(32):
        k = np.uint64(bit)
        index = (((a >> k) & one) << np.uint64(2)) | (((b >> k) & one) << one) | ((c >> k) & one)
        out |= ((np.uint64(lut) >> index) & one) << k
    return out


def emulate(ptx: Ptx, operands: list[np.ndarray]) -> list[np.ndarray]:
    """Run ``ptx`` on uint64-held 32-bit registers ``$k`` (outputs first, then
    ``operands``); returns the output registers."""
    outputs = ptx.constraints.count("=")
    regs = {f"${outputs + k}": np.asarray(v, np.uint64) for k, v in enumerate(operands)}
    n = len(operands[0])

    def val(x):
        if x in regs:
            return regs[x]
        return np.full(n, int(x, 0), np.uint64)

    for line in ptx.code.strip("{} ").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *a = [x.strip() for x in args.split(",")]
        v = [val(x) for x in a]
        if op == "mov.b32":
            r = v[0]
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & np.uint64(MASK)
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "lop3.b32":
            r = _lop3(v[0], v[1], v[2], int(a[3], 0))
        elif op == "prmt.b32":
            r = _prmt(v[0], v[1], v[2])
        elif op == "mad.lo.u32":
            r = (v[0] * v[1] + v[2]) & np.uint64(MASK)
        elif op == "mul.lo.u32":
            r = (v[0] * v[1]) & np.uint64(MASK)
        elif op == "sub.rn.f16x2":
            r = _lanes(v, lambda x, y: x - y)
        elif op == "fma.rn.f16x2":
            r = _lanes(v, lambda x, y, z: x * y + z)
        else:
            raise AssertionError(f"the emulator has no {op}")
        regs[d] = np.asarray(r, np.uint64) & np.uint64(MASK)
    return [regs[f"${k}"] for k in range(outputs)]


def pack(elements: np.ndarray, per_call: int) -> list[np.ndarray]:
    """Registers of a tile's elements, ``per_call`` to a call: 16-bit elements two to a
    register, bytes four."""
    if elements.dtype == np.float16:
        elements = elements.view(np.uint16)
    e = elements.reshape(-1, per_call).astype(np.uint64)
    shift = [np.uint64(8 * k) for k in range(4)]
    if elements.dtype.itemsize == 1:
        return [e[:, 0] | e[:, 1] << shift[1] | e[:, 2] << shift[2] | e[:, 3] << shift[3]]
    return [e[:, k] | e[:, k + 1] << shift[2] for k in range(0, per_call, 2)]


def run(ptx: Ptx, tiles: list[np.ndarray]) -> np.ndarray:
    """``ptx`` over whole tiles: the float16 result, element by element."""
    operands = [r for t in tiles for r in pack(t, ptx.pack)]
    out = emulate(ptx, operands)
    lanes = [np.stack([r & np.uint64(0xFFFF), r >> np.uint64(16)], axis=-1) for r in out]
    return np.concatenate(lanes, axis=-1).reshape(tiles[0].shape).astype(np.uint16).view(
        np.float16)


RNG = np.random.default_rng(0)
SHAPE = (8, 16)


def halves():
    return RNG.integers(0, 1 << 16, SHAPE, dtype=np.uint16)


def bytes_():
    return RNG.integers(0, 1 << 8, SHAPE, dtype=np.uint8)


def f16(scale):
    return (RNG.standard_normal(SHAPE) * scale).astype(np.float16)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("plane,ptx", [(units.int_plane, units.int_ptx),
                                       (units.biased_int_plane, units.biased_int_ptx)])
def test_int_ptx(bits, plane, ptx):
    tile = halves()
    for j in range(16 // bits):
        want = np.asarray(plane(jnp.asarray(tile), j, bits, asm=False))
        np.testing.assert_array_equal(run(ptx(j, bits), [tile]), want)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_biased_planes_are_bias_plus_code(bits):
    """Every plane of every unit reads its code exactly, shifted by the plane's bias."""
    tile = halves()
    for j in range(16 // bits):
        got = np.asarray(units.biased_int_plane(jnp.asarray(tile), j, bits, asm=False))
        code = (tile.astype(np.int64) >> (j * bits)) & ((1 << bits) - 1)
        np.testing.assert_array_equal(got.astype(np.float64) - units.plane_bias(j, bits), code)


@pytest.mark.parametrize("unit,bits,split", [
    (16, 2, False), (16, 4, False), (16, 8, False), (16, 3, True),
    (8, 2, False), (8, 8, False), (8, 3, True),
])
def test_group_int_ptx(unit, bits, split):
    tile = halves() if unit == 16 else bytes_()
    top, scale, zero = bytes_(), f16(0.1), f16(1.0)
    ptx = units.group_int_ptx if unit == 16 else units.group_int_bytes_ptx
    for j in range(unit // (bits - split)):
        want = np.asarray(units.group_int_plane(tile, j, bits, scale, zero, asm=False,
                                                top=top if split else None))
        got = run(ptx(j, bits, split), [tile, *([top] if split else []), scale, zero])
        # one fused rounding against the jnp form's float32 sum rounded to float16
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                   rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bits,split", [(1, False), (2, False), (3, False), (4, False),
                                       (3, True)])
def test_codebook_ptx(bits, split):
    magnitudes = tuple(float(m) for m in np.sort(RNG.uniform(0.01, 0.3, 1 << (bits - 1))))
    tile, signs = halves(), bytes_()
    for j in range(16 // (bits - split)):
        want = np.asarray(units.codebook_plane(tile, j, bits, magnitudes, asm=False,
                                               signs=signs if split else None))
        if split:
            got = run(units.codebook_ptx(j, bits, magnitudes), [tile, signs])
        else:
            got = run(units.codebook_table_ptx(16, j, bits, magnitudes), [tile])
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("base", [-1.0, 0.0707])
def test_sign_ptx(base):
    tile = bytes_()
    for j in range(8):
        want = np.asarray(units.sign_plane(tile, j, base, asm=False))
        np.testing.assert_array_equal(run(units.sign_ptx(j, base), [tile]), want)


def table(count):
    return tuple(float(v) for v in RNG.uniform(-2.0, 2.0, count))


def field_of(tile, offset, width):
    return (tile.astype(np.int64) >> offset) & ((1 << width) - 1)


def lookup(tile, offset, width, values):
    """``values[field]`` in numpy, past the end 0: what both forms should give."""
    padded = np.zeros(1 << width)
    padded[:len(values)] = values
    return padded[field_of(tile, offset, width)].astype(np.float16)


@pytest.mark.parametrize("unit", [8, 16])
@pytest.mark.parametrize("width,count", [(1, 2), (2, 4), (2, 3), (3, 8), (3, 5)])
def test_table_ptx(unit, width, count):
    """Every offset, straddling ones in 16-bit units included; short tables read 0."""
    values = table(count)
    for offset in range(unit - width + 1):
        tile = halves() if unit == 16 else bytes_()
        want = np.asarray(units.table_plane(tile, offset, width, values, asm=False))
        np.testing.assert_array_equal(want, lookup(tile, offset, width, values))
        got = run(units.table_ptx(unit, offset, width, values), [tile])
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("unit", [8, 16])
def test_table_ptx_sign(unit):
    """An 8-entry lookup with the bit above the field as the sign, at every offset."""
    values = table(8)
    for offset in range(unit - 3):
        tile = halves() if unit == 16 else bytes_()
        negative = field_of(tile, offset + 3, 1) != 0
        magnitude = lookup(tile, offset, 3, values)
        got = run(units.table_ptx(unit, offset, 3, values, sign=True), [tile])
        np.testing.assert_array_equal(got, np.where(negative, -magnitude, magnitude))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_bytes_ptx(bits):
    magnitudes = tuple(float(m) for m in np.sort(RNG.uniform(0.01, 0.3, 1 << (bits - 1))))
    tile = bytes_()
    for j in range(8 // bits):
        want = np.asarray(units.codebook_plane(tile, j, bits, magnitudes, asm=False))
        code = field_of(tile, j * bits, bits)
        rank, negative = code & ((1 << (bits - 1)) - 1), code >> (bits - 1)
        value = np.asarray(magnitudes)[rank]
        np.testing.assert_array_equal(
            want, np.where(negative != 0, -value, value).astype(np.float16))
        np.testing.assert_array_equal(run(units.codebook_table_ptx(8, j, bits, magnitudes),
                                          [tile]), want)


def test_signed_table_covers_a_half_circle():
    """``cos`` and ``sin`` of 16 uniform angles ``(k + 1/2) 2 pi / 16`` are 4-bit
    sign-magnitude codes over the first 8: angle ``k + 8`` is angle ``k`` plus ``pi``."""
    angles = (np.arange(16) + 0.5) * 2 * np.pi / 16
    tile = halves()
    for trig in (np.cos, np.sin):
        first = tuple(float(v) for v in trig(angles[:8]))
        for j in range(4):
            want = trig(angles[field_of(tile, 4 * j, 4)])
            got = run(units.codebook_table_ptx(16, j, 4, first), [tile])
            np.testing.assert_allclose(got.astype(np.float64), want, atol=1e-3)
            got = run(units.table_ptx(16, 4 * j, 3, first, sign=True), [tile])
            np.testing.assert_allclose(got.astype(np.float64), want, atol=1e-3)


def instructions(ptx: Ptx) -> int:
    """Instructions of ``ptx`` per call, less the ``mov`` of constants."""
    lines = [x.strip() for x in ptx.code.strip("{} ").split(";")]
    return sum(1 for x in lines if x and not x.startswith((".reg", "mov.b32")))


def test_instruction_counts():
    """The counts the docstrings give, per call of four elements."""
    four, eight = table(4), table(8)
    assert [instructions(units.table_ptx(8, o, 2, four)) for o in (0, 3)] == [5, 6]
    assert [instructions(units.table_ptx(8, o, 3, eight)) for o in (0, 3)] == [7, 8]
    # 16-bit units: byte-aligned, inside a byte, straddling bytes
    assert [instructions(units.table_ptx(16, o, 2, four)) for o in (8, 3, 7)] == [6, 7, 8]
    assert [instructions(units.table_ptx(16, o, 3, eight)) for o in (8, 3, 6)] == [8, 9, 10]
    assert [instructions(units.codebook_table_ptx(8, j, 2, four[:2])) for j in (0, 1)] == [5, 6]
    assert [instructions(units.codebook_table_ptx(8, j, 3, four)) for j in (0, 1)] == [7, 8]
    assert [instructions(units.codebook_table_ptx(8, j, 4, eight)) for j in (0, 1)] == [10, 10]


def test_lookups_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match=r"offsets 0\.\.13"):
        units.table_ptx(16, 14, 3, table(8))
    with pytest.raises(ValueError, match=r"offsets 0\.\.6"):
        units.table_plane(bytes_(), 7, 2, table(4), asm=False)
    with pytest.raises(ValueError, match="entries"):
        units.table_ptx(8, 0, 2, table(5))
    with pytest.raises(ValueError, match="entries"):
        units.table_ptx(8, 0, 4, table(16))
    with pytest.raises(ValueError, match="8-entry"):
        units.table_ptx(8, 0, 2, table(4), sign=True)
    with pytest.raises(ValueError, match="uint8 or uint16"):
        units.table_plane(halves().astype(np.uint32), 0, 2, table(4), asm=False)
    with pytest.raises(ValueError, match="plane 2"):
        units.codebook_plane(bytes_(), 2, 3, table(4), asm=False)
    with pytest.raises(ValueError, match="16-bit"):
        units.codebook_plane(bytes_(), 0, 3, table(4), asm=False, signs=bytes_())


def test_a_wrong_table_or_offset_fails():
    """A lookup one bit off, or with two entries swapped, or without its sign, is
    caught."""
    values = table(8)
    swapped = (values[1], values[0], *values[2:])
    for unit, tile in ((8, bytes_()), (16, halves())):
        want = np.asarray(units.table_plane(tile, 3, 3, values, asm=False))
        assert np.array_equal(run(units.table_ptx(unit, 3, 3, values), [tile]), want)
        assert not np.array_equal(run(units.table_ptx(unit, 4, 3, values), [tile]), want)
        assert not np.array_equal(run(units.table_ptx(unit, 3, 3, swapped), [tile]), want)
    tile = bytes_()
    want = np.asarray(units.codebook_plane(tile, 1, 4, values, asm=False))
    assert not np.array_equal(run(units.table_ptx(8, 4, 3, values), [tile]), want)


def test_the_emulator_can_fail():
    """A wrong shift is caught: the comparison is not vacuous."""
    tile = halves()
    want = np.asarray(units.int_plane(tile, 1, 4, asm=False))
    assert not np.array_equal(run(units.int_ptx(2, 4), [tile]), want)


@pytest.mark.parametrize("bits", [3, 2, 4])
def test_split_layout_columns(bits):
    """Column ``u`` of plane ``j`` of the kernel's views is dim ``perm[j * width + u]``:
    read the codes the kernel's way (halves for the low bits, bytes for the top bit)."""
    head_dim = 128
    codes = np.random.default_rng(0).integers(0, 1 << bits, (5, head_dim))
    words = pack_codes(jnp.asarray(codes), bits)
    np.testing.assert_array_equal(unpack_codes(words, bits, head_dim), codes)
    view, planes, perm = units.code_layout(head_dim, bits)
    width = head_dim // planes
    halves = np.asarray(units.unit_view(words, "halves"))
    bytes_ = np.asarray(units.unit_view(words, "bytes"))
    for j in range(planes):
        if view == "split":
            low = (halves[:, :width] >> (2 * j)) & 3
            got = low | ((bytes_[:, head_dim // 4:][:, :width] >> j) & 1) << 2
        else:
            got = (halves >> (bits * j)) & ((1 << bits) - 1)
        np.testing.assert_array_equal(got, codes[:, perm[j * width:(j + 1) * width]])
