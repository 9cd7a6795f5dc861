"""Packed code words as float16 matmul operands: the unit views, the column order they
give, and the bit tricks that turn a bit plane of a tile into float16 values.

Codes reach a kernel as ``uint32`` words, viewed (by XLA, before the kernel: a bitcast)
as 16-bit or 8-bit units (:func:`unit_view`). Bit plane ``j`` of a ``[block_s, units]``
tile, the ``bits``-wide field at bit ``j * bits`` of every unit, is one matmul operand of
``units`` columns: no value is interleaved or gathered, and :func:`unit_permutation`
says which dim each column holds, so the query's columns are permuted to match outside
the loop. A plane becomes float16 by bit operations only (int-to-float conversions run
at a quarter of the integer rate):

* :func:`int_plane`: integer codes ``c``; ``(unit >> j * bits) & mask | 0x6400`` is the
  bit pattern of the float16 ``1024 + c``, and one exact float16 subtraction leaves ``c``.
  :func:`biased_int_plane` skips the subtraction (and, for the planes that fit in the
  mantissa, the shift): ``bias + c``, the bias taken out of the matmul's result.
* :func:`codebook_plane`: sign-magnitude codes of a symmetric codebook, in 16-bit units
  or bytes; the magnitude ranks select the float16 bytes of the codebook's magnitudes
  from registers with ``prmt`` (a byte permute), and the sign bit is moved onto
  float16's (codes of 2 or 3 bits in bytes look up their sign too, in a table of the
  magnitudes and their negatives).
* :func:`table_plane`: any field of up to 3 bits as an entry of a table of up to 8
  floats, by the same register lookup: the fields of four units become one ``prmt``
  selector (8 entries) or a ``mad`` spreads each to a selector pair (4 entries); 1.25
  to 2.5 instructions per element, where a chain of selects
  (:func:`select_table`, the jnp form) takes two per entry.
* :func:`sign_plane`: one bit per dim, as ``+-base``.

Each has a jnp form (interpret mode, and the ``asm=False`` research path) and an inline
PTX form that handles two (or four) units per 32-bit register.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as plgpu

from kvjax.primitives.packing import byte_plane_order, is_byte_planar
from pallas_kernels.flash import OPERAND

#: code units the packed words are read in, and their width in bits
LAYOUTS = {"halves": 16, "bytes": 8}
#: float16 bit pattern of 1024.0: OR-ing a code c < 1024 into its mantissa gives 1024 + c
F16_1024 = 0x6400
#: ``lop3`` truth table of ``a ^ (b & c)``
XOR_AND = 0x78


def unit_bits(layout: str) -> int:
    """Bits of one unit of ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {layout!r}")
    return LAYOUTS[layout]


def operand_width(head_dim: int, bits: int, layout: str = "halves") -> int:
    """Columns of one matmul operand: code units per token (``D * bits / unit``)."""
    return head_dim * bits // unit_bits(layout)


def unit_view(codes: jax.Array, layout: str = "halves") -> jax.Array:
    """``uint32[..., W]`` packed words as their little-endian 16- or 8-bit units."""
    unit = unit_bits(layout)
    dtype = jnp.uint16 if unit == 16 else jnp.uint8
    b = jax.lax.bitcast_convert_type(codes, dtype)
    return b.reshape(*codes.shape[:-1], (32 // unit) * codes.shape[-1])


def unit_permutation(head_dim: int, bits: int, layout: str = "halves") -> np.ndarray:
    """Which dim each kernel column holds when the words of
    :func:`kvjax.primitives.packing.pack_codes` (planar) are read in units.

    Word ``w`` slot ``i`` holds position ``i * W + w`` (:func:`~kvjax.primitives.packing.
    pack_bits`); unit ``k`` of the word holds slots ``k * c .. k * c + c - 1`` (``c = unit /
    bits`` codes per unit). Column ``j * nu + u`` (bit plane ``j`` of unit ``u = (32 /
    unit) w + k``, ``nu`` units per token) is therefore position ``(k * c + j) * W + w``:
    the dim itself, except for 2-bit codes, which ``pack_codes`` places in byte planes
    (:func:`~kvjax.primitives.packing.byte_plane_order` maps positions to dims).
    """
    unit = unit_bits(layout)
    words = head_dim * bits // 32
    per_unit, per_word = unit // bits, 32 // unit
    u = np.arange(per_word * words)
    w, k = u // per_word, u % per_word
    position = np.concatenate([(k * per_unit + j) * words + w for j in range(per_unit)])
    if is_byte_planar(head_dim, bits):
        return byte_plane_order(head_dim)[position]
    return position


def code_layout(head_dim: int, bits: int) -> tuple[str, int, np.ndarray]:
    """``(view, planes, permutation)`` of ``bits``-bit codes: the unit view the kernel
    reads them in ("halves", "bytes" or "split"), its bit planes, and the dim of each
    kernel column. 3-bit codes are split (:func:`kvjax.primitives.packing.pack_split`):
    planes of their low 2 bits in halves, the top bits beside them in bytes."""
    if bits == 1:
        return "bytes", 8, unit_permutation(head_dim, 1, "bytes")
    if bits == 3:
        return "split", 8, unit_permutation(head_dim, 2, "halves")
    return "halves", 16 // bits, unit_permutation(head_dim, bits, "halves")


def f16_bits(value: float) -> int:
    """The float16 bit pattern of ``value`` (rounded to nearest)."""
    return int(np.float16(value).view(np.uint16))


@dataclasses.dataclass(frozen=True)
class Ptx:
    """Inline PTX run elementwise over tiles: ``pack`` elements per call, packed into
    32-bit registers (two 16-bit or four 8-bit elements to a register), outputs first
    (``$0``...), then every argument's registers in order."""

    code: str
    constraints: str
    pack: int


def run_ptx(ptx: Ptx, args: list[jax.Array]) -> jax.Array:
    """The float16 tile of ``args[0]``'s shape that ``ptx`` computes."""
    [out] = plgpu.elementwise_inline_asm(
        ptx.code, args=args, constraints=ptx.constraints, pack=ptx.pack,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, OPERAND)])
    return out


def int_ptx(j: int, bits: int) -> Ptx:
    """:func:`int_plane` on two 16-bit units: a shift, one ``lop3`` and one
    ``sub.f16x2`` make two codes."""
    mask = (1 << bits) - 1
    bias = F16_1024 * 0x10001
    return Ptx("{ .reg .b32 t, b; "
               f"shr.b32 t, $1, {j * bits}; "
               f"lop3.b32 t, t, {mask | mask << 16:#010x}, {bias:#010x}, 0xea; "
               f"mov.b32 b, {bias:#010x}; "
               "sub.rn.f16x2 $0, t, b; }", "=r,r", 2)


def int_plane(tile: jax.Array, j: int, bits: int, asm: bool) -> jax.Array:
    """Bit plane ``j`` of a tile of code units as float16 codes.

    ``asm``: 16-bit units two at a time in one 32-bit register (:func:`int_ptx`: the
    same arithmetic as the jnp path, which Triton would run one 16-bit unit per
    instruction). Compiled only (interpret mode has no PTX).
    """
    if asm and tile.dtype == jnp.uint16:
        return run_ptx(int_ptx(j, bits), [tile])
    mask = (1 << bits) - 1
    shifted = tile >> jnp.asarray(j * bits, tile.dtype) if j else tile
    if tile.dtype == jnp.uint16:
        biased = (shifted & jnp.asarray(mask, tile.dtype)) | jnp.asarray(F16_1024, tile.dtype)
        return jax.lax.bitcast_convert_type(biased, OPERAND) - jnp.asarray(1024, OPERAND)
    return (shifted & jnp.asarray(mask, tile.dtype)).astype(OPERAND)


#: bits of a float16's mantissa: a field OR-ed into it at bit ``o`` reads as a multiple of
#: ``2 ** (o - MANTISSA)`` of the exponent's power of two
MANTISSA = 10


def plane_shift(j: int, bits: int) -> int:
    """The right shift :func:`biased_int_plane` applies to a 16-bit unit before masking
    plane ``j``: none while the field lies inside float16's mantissa, else the offset of
    the first plane that does not (every later plane then fits again: 8 for 4- and
    8-bit codes, 10 for 2-bit ones)."""
    offset = j * bits
    if offset + bits <= MANTISSA:
        return 0
    return -(-(MANTISSA - bits + 1) // bits) * bits


def plane_bias(j: int, bits: int) -> float:
    """What a zero code of plane ``j`` reads as in :func:`biased_int_plane`: the power of
    two ``2 ** (10 - o)`` whose float16 has the field's bit ``o`` as its units bit."""
    return float(2 ** (MANTISSA - (j * bits - plane_shift(j, bits))))


def _biased_field(j: int, bits: int) -> tuple[int, int, int]:
    """``(shift, mask, pattern)``: plane ``j`` is ``(unit >> shift) & mask | pattern``."""
    shift = plane_shift(j, bits)
    offset = j * bits - shift
    mask = ((1 << bits) - 1) << offset
    pattern = (15 + MANTISSA - offset) << MANTISSA  # the float16 exponent of the bias
    return shift, mask, pattern


def biased_int_ptx(j: int, bits: int) -> Ptx:
    """:func:`biased_int_plane` on two 16-bit units: one ``lop3`` per two codes, after a
    shift for the planes beyond the mantissa."""
    shift, mask, pattern = _biased_field(j, bits)
    source = "$1"
    code = "{ .reg .b32 t; "
    if shift:
        code += f"shr.b32 t, $1, {shift}; "
        source = "t"
    code += f"lop3.b32 $0, {source}, {mask * 0x10001:#010x}, {pattern * 0x10001:#010x}, 0xea; }}"
    return Ptx(code, "=r,r", 2)


def biased_int_plane(tile: jax.Array, j: int, bits: int, asm: bool) -> jax.Array:
    """Bit plane ``j`` of a tile of 16-bit code units as the float16 ``plane_bias(j,
    bits) + c``, by bit operations alone: the field is OR-ed, in place where it fits,
    into the mantissa of a power of two whose units bit it then starts at. No
    subtraction (:func:`int_plane` spends one per two codes): a kernel takes the bias
    out of its matmul's result once per row, and the planes that fit in the mantissa
    need no shift either, so 4-bit codes cost 5-6 instructions per eight, not 11.
    Exact for codes of up to 8 bits. ``asm``: two units per 32-bit register
    (:func:`biased_int_ptx`); compiled only.
    """
    if tile.dtype != jnp.uint16:
        raise ValueError(f"biased planes read 16-bit units, got {tile.dtype}")
    if asm:
        return run_ptx(biased_int_ptx(j, bits), [tile])
    shift, mask, pattern = _biased_field(j, bits)
    shifted = tile >> jnp.asarray(shift, tile.dtype) if shift else tile
    biased = (shifted & jnp.asarray(mask, tile.dtype)) | jnp.asarray(pattern, tile.dtype)
    return jax.lax.bitcast_convert_type(biased, OPERAND)


def group_int_ptx(j: int, bits: int, split: bool) -> Ptx:
    """:func:`group_int_plane`: per 32-bit register of two codes, :func:`int_ptx`'s
    three instructions (three more to merge a split code's top bit) and one
    ``fma.f16x2`` with the two lanes' scales and zeros. Operands: the units, the top
    bytes (split), the scales, the zeros; four elements per call when split (the bytes
    fill one register), else two."""
    width = bits - 1 if split else bits
    mask = (1 << width) - 1
    bias = F16_1024 * 0x10001
    regs = 2 if split else 1  # 32-bit registers per float16 operand (and per output)
    first = 2 * regs + split  # operand number of the scales
    parts = []
    for pair in range(regs):
        lines = [f"shr.b32 t, ${regs + pair}, {j * width};",
                 f"lop3.b32 t, t, {mask | mask << 16:#010x}, {bias:#010x}, 0xea;"]
        if split:
            spread = (0x1100, 0x3322)[pair]
            lines += [f"prmt.b32 u, ${2 * regs}, ${2 * regs}, {spread:#06x};",
                      f"shr.b32 u, u, {6 + j};",
                      "lop3.b32 t, t, u, 0x00040004, 0xf8;"]
        lines += [f"mov.b32 b, {bias:#010x};", "sub.rn.f16x2 t, t, b;",
                  f"fma.rn.f16x2 ${pair}, t, ${first + pair}, ${first + regs + pair};"]
        parts.append(" ".join(lines))
    constraints = ",".join(["=r"] * regs + ["r"] * (regs + split + 2 * regs))
    return Ptx("{ .reg .b32 t, u, b; " + " ".join(parts) + " }", constraints, 2 * regs)


#: ``prmt`` selectors spreading bytes ``2 p`` and ``2 p + 1`` of a register to the low
#: bytes of the two 16-bit lanes, zeros above (operand ``b`` a zero register)
SPREAD_BYTES = (0x4140, 0x4342)


def group_int_bytes_ptx(j: int, bits: int, split: bool) -> Ptx:
    """:func:`group_int_plane` on 8-bit units, four codes per call: per pair of codes a
    ``prmt`` spreads their bytes to the two float16 lanes, then :func:`int_ptx`'s
    arithmetic (and, split, the top byte's bit ``j`` spread alike and merged) and one
    ``fma.f16x2`` with the lanes' scales and zeros. Operands: the code bytes, the top
    bytes (split), the scales (two registers), the zeros (two registers)."""
    width = bits - 1 if split else bits
    mask = (1 << width) - 1
    bias = F16_1024 * 0x10001
    first = 3 + split  # operand number of the scales
    parts = []
    for pair, spread in enumerate(SPREAD_BYTES):
        lines = [f"prmt.b32 t, $2, z, {spread:#06x};"]
        if j * width:
            lines.append(f"shr.b32 t, t, {j * width};")
        lines.append(f"lop3.b32 t, t, {mask | mask << 16:#010x}, {bias:#010x}, 0xea;")
        if split:
            # bit j of the lane's top byte to bit 2, the code's top bit
            move = f"shl.b32 u, u, {2 - j};" if j <= 2 else f"shr.b32 u, u, {j - 2};"
            lines += [f"prmt.b32 u, $3, z, {spread:#06x};", move,
                      "lop3.b32 t, t, u, 0x00040004, 0xf8;"]
        lines += [f"mov.b32 b, {bias:#010x};", "sub.rn.f16x2 t, t, b;",
                  f"fma.rn.f16x2 ${pair}, t, ${first + pair}, ${first + 2 + pair};"]
        parts.append(" ".join(lines))
    constraints = ",".join(["=r"] * 2 + ["r"] * (1 + split + 4))
    return Ptx("{ .reg .b32 t, u, b, z; mov.b32 z, 0; " + " ".join(parts) + " }",
               constraints, 4)


def group_int_plane(tile: jax.Array, j: int, bits: int, scale: jax.Array, zero: jax.Array,
                    asm: bool, top: jax.Array | None = None) -> jax.Array:
    """Bit plane ``j`` of a tile of 16-bit or 8-bit units of integer codes as float16
    values ``zero + scale * c``, with ``scale`` and ``zero`` float16 tiles of the plane's
    shape (each column's channel group's parameters). With ``top`` (a tile of bytes of
    the same shape: 3-bit codes in the split layout of
    :func:`kvjax.primitives.packing.pack_split`) the plane is the low 2 bits and bit ``j``
    of the top byte is the code's top bit.

    ``asm``: :func:`group_int_ptx` (16-bit units) or :func:`group_int_bytes_ptx`; the
    values come out dequantized, so the matmul with the probabilities needs no
    per-group scaling. Every lane is computed from the same lane of every operand: which
    elements Triton packs into a register depends on the tile's layout, not on the
    columns.
    """
    split = top is not None
    if asm:
        ptx = (group_int_ptx(j, bits, split) if tile.dtype == jnp.uint16
               else group_int_bytes_ptx(j, bits, split))
        return run_ptx(ptx, [tile, *([top] if split else []), scale, zero])
    codes = int_plane(tile, j, bits - split, asm=False).astype(jnp.float32)
    if split:
        high = (top >> jnp.asarray(j, top.dtype)) & jnp.asarray(1, top.dtype)
        codes = codes + 4.0 * high.astype(jnp.float32)
    return (zero.astype(jnp.float32) + codes * scale.astype(jnp.float32)).astype(OPERAND)


def _table_registers(magnitudes: tuple[float, ...]) -> list[int]:
    """The float16 bytes of the magnitudes as ``prmt`` sources: low bytes then high
    bytes, four to a register; four magnitudes or fewer share one register pair."""
    halves = [f16_bits(m) for m in magnitudes]
    size = 4 if len(halves) <= 4 else 8
    halves += [0] * (size - len(halves))
    lo = [h & 0xFF for h in halves]
    hi = [h >> 8 for h in halves]

    def words(b):
        return [sum(v << (8 * i) for i, v in enumerate(b[k:k + 4])) for k in range(0, len(b), 4)]

    return words(lo) + words(hi)


def select_table(values: tuple[float, ...], index: jax.Array) -> jax.Array:
    """``values[index]`` as float32, by a chain of selects: gathers do not lower to
    Triton. An index past the end reads ``values[0]``. Two operations (a compare and a
    select) per entry after the first, on every element: the jnp form of the lookups
    here, and the fallback for tables they do not take (more than 8 entries, 32-bit
    units)."""
    out = jnp.full(index.shape, values[0], jnp.float32)
    for i, v in enumerate(values[1:], start=1):
        out = jnp.where(index == i, v, out)
    return out


def _gather_selector(byte: int) -> int:
    """``prmt`` selector taking byte ``byte`` of each of four 16-bit units, held two to a
    register in its operands ``a, b``, to bytes 0..3."""
    return byte | (2 + byte) << 4 | (4 + byte) << 8 | (6 + byte) << 12


def table_ptx(unit: int, offset: int, width: int, table: tuple[float, ...],
              sign: bool = False) -> Ptx:
    """:func:`table_plane` on four units per call (one register of bytes, or two of
    16-bit units), out to two registers of float16 pairs.

    The four fields go to the four bytes of one register (16-bit units: one ``prmt``
    gathers the byte holding each unit's field; a field straddling a byte is shifted
    down first, one more instruction), are shifted and masked there, and become ``prmt``
    selectors into registers holding the table's float16 bytes:

    * up to 4 entries (``width`` <= 2): the low bytes in one register and the high bytes
      in the next, so one ``mad`` turns each field ``f`` into the selector pair ``f, f +
      4`` and one ``prmt`` makes two float16 values; 5 instructions per 4 bytes at bit 0,
      6 at another bit, 6 / 7 / 8 per 4 16-bit units (byte-aligned / inside a byte /
      straddling).
    * 8 entries (``width`` 3): low and high bytes take a register pair each; ``x | x >>
      12`` packs the four fields into one selector (in the order 0, 2, 1, 3), two
      ``prmt`` pick the four low and the four high bytes and two more interleave them; 7
      / 8 per 4 bytes, 8 / 9 / 10 per 4 16-bit units.

    With ``sign`` (8 entries only) the bit above each field is xor-ed onto float16's sign
    bit, on the high bytes before they are interleaved: 2 instructions more (3 where
    that bit is not a byte's top bit). Add 2 (4 entries) or 4 (8 entries) ``mov`` of
    constants, invariant across calls.
    """
    if unit not in (8, 16):
        raise ValueError(f"units of 8 or 16 bits, got {unit}")
    if not 1 <= width <= 3 or not 1 <= len(table) <= 1 << width:
        raise ValueError(f"{len(table)} entries for a {width}-bit field: 1..8 entries, "
                         "at most 2^width")
    if sign and width != 3:
        raise ValueError("a separate sign bit needs an 8-entry table; narrower codes "
                         "take their sign bit into the field and the table")
    code = width + sign
    if offset < 0 or offset + code > unit:
        raise ValueError(f"a {code}-bit field at bit {offset} of a {unit}-bit unit: "
                         f"offsets 0..{unit - code} are supported")
    count = 4 if width <= 2 else 8
    lines = []
    if unit == 8:
        source, shift = "$2", offset
    else:
        byte, shift = divmod(offset, 8)
        source = "g"
        if shift + code <= 8:
            lines.append(f"prmt.b32 g, $2, $3, {_gather_selector(byte):#06x};")
        else:
            # bytes are the prmt's grain: shift the units so the code starts at bit 0
            lines += [f"shr.b32 g, $2, {offset};", f"shr.b32 x, $3, {offset};",
                      f"prmt.b32 g, g, x, {_gather_selector(0):#06x};"]
            shift = 0
    mask = ((1 << width) - 1) * 0x01010101
    if shift:
        lines += [f"shr.b32 x, {source}, {shift};", f"and.b32 x, x, {mask:#010x};"]
    else:
        lines.append(f"and.b32 x, {source}, {mask:#010x};")
    signs = []
    if sign:
        top = shift + width
        signs_from = source
        if top < 7:
            signs.append(f"shl.b32 y, {source}, {7 - top};")
            signs_from = "y"
        # the sign bits in the order the selector put the high bytes in
        signs += [f"prmt.b32 y, {signs_from}, {signs_from}, 0x3120;",
                  f"lop3.b32 hb, hb, y, 0x80808080, {XOR_AND:#x};"]
    return _byte_fields_ptx(lines, table, count, signs, "r" if unit == 8 else "r,r")


def _byte_fields_ptx(lines: list[str], table: tuple[float, ...], count: int,
                     signs: list[str], operands: str) -> Ptx:
    """The :class:`Ptx` of ``lines`` (which leave a field in each byte of register
    ``x``, bits above it zero) followed by their lookup in ``table`` padded to ``count``
    (4 or 8) entries, out to two registers of float16 pairs (bytes 0, 1 and 2, 3).
    ``signs``: lines run between the two halves of an 8-entry lookup, which may flip the
    float16 signs in ``hb`` (the high bytes, in the order 0, 2, 1, 3)."""
    regs = _table_registers(tuple(table) + (0.0,) * (count - len(table)))
    lines = list(lines)
    if count == 4:
        # prmt reads only the low 16 bits of its selector: the high pair is shifted down
        lines += ["mad.lo.u32 x, x, 0x11, 0x40404040;",
                  f"mov.b32 a0, {regs[0]:#010x};", f"mov.b32 a1, {regs[1]:#010x};",
                  "prmt.b32 $0, a0, a1, x;", "shr.b32 x, x, 16;", "prmt.b32 $1, a0, a1, x;"]
        return Ptx("{ .reg .b32 g, x, a0, a1; " + " ".join(lines) + " }",
                   "=r,=r," + operands, 4)
    # fields 1 and 3 leave bits 8 and 24 for 4 and 12; bits 16 and up are ignored
    lines += ["shr.b32 y, x, 12;", "or.b32 x, x, y;",
              f"mov.b32 a0, {regs[0]:#010x};", f"mov.b32 a1, {regs[1]:#010x};",
              f"mov.b32 h0, {regs[2]:#010x};", f"mov.b32 h1, {regs[3]:#010x};",
              "prmt.b32 lb, a0, a1, x;", "prmt.b32 hb, h0, h1, x;", *signs,
              "prmt.b32 $0, lb, hb, 0x6240;", "prmt.b32 $1, lb, hb, 0x7351;"]
    return Ptx("{ .reg .b32 g, x, y, a0, a1, h0, h1, lb, hb; " + " ".join(lines) + " }",
               "=r,=r," + operands, 4)


def table_plane(tile: jax.Array, offset: int, width: int, table: tuple[float, ...],
                asm: bool) -> jax.Array:
    """The ``width``-bit unsigned field at bit ``offset`` of every unit of a uint16 or
    uint8 tile, as float16 ``table[field]``.

    At most 8 entries (``width`` <= 3); fields past the table's end read 0. A field may
    sit anywhere inside its unit, across a byte boundary of a 16-bit unit too. ``asm``:
    :func:`table_ptx`, 1.25 to 2.5 instructions per element where the jnp form's select
    chain takes two per entry (14 for 8).
    """
    unit = {jnp.dtype(jnp.uint8): 8, jnp.dtype(jnp.uint16): 16}.get(jnp.dtype(tile.dtype))
    if unit is None:
        raise ValueError(f"uint8 or uint16 tiles, got {tile.dtype}")
    if asm:
        return run_ptx(table_ptx(unit, offset, width, table), [tile])
    # the same checks as the PTX form, so interpret mode refuses what compiling would
    table_ptx(unit, offset, width, table)
    field = tile >> jnp.asarray(offset, tile.dtype) if offset else tile
    field = field & jnp.asarray((1 << width) - 1, tile.dtype)
    padded = tuple(table) + (0.0,) * ((1 << width) - len(table))
    return select_table(padded, field).astype(OPERAND)


def codebook_table_ptx(unit: int, j: int, bits: int, magnitudes: tuple[float, ...]) -> Ptx:
    """:func:`codebook_plane` on 8- or 16-bit units, four per call (:func:`table_ptx`).
    Codes of 1 to 3 bits are looked up whole in the table of the magnitudes followed by
    their negatives, so the sign costs nothing: 1.25 / 1.5 (2 bits) or 1.75 / 2 (3 bits)
    instructions per code in bytes at bit 0 / elsewhere, 0.25 more in 16-bit units.
    4-bit codes (8 magnitudes) move their sign bit onto the looked-up magnitude: 2.5 per
    code. (The pairwise lookup this replaces in 16-bit units took 4 per 4-bit code.)"""
    if bits == 4:
        return table_ptx(unit, j * bits, 3, magnitudes, sign=True)
    return table_ptx(unit, j * bits, bits, (*magnitudes, *(-m for m in magnitudes)))


def codebook_ptx(j: int, bits: int, magnitudes: tuple[float, ...]) -> Ptx:
    """:func:`codebook_plane` of split codes (3 bits: the 2 magnitude bits in 16-bit
    units, the sign bits in bytes), four units per call: the magnitude ranks of the four
    units are gathered into the bytes of one register, bit ``j`` of each unit's sign
    byte is merged in above them, and the 3-bit fields are looked up in the table of the
    magnitudes and their negatives (:func:`table_ptx`'s 8-entry lookup): 8 to 10
    instructions per four codes, where a lookup per pair with the signs moved onto the
    float16 values took 14 to 16."""
    if bits != 3 or len(magnitudes) != 4:
        raise ValueError(f"split codes are 3 bits with 4 magnitudes, got {bits} bits "
                         f"and {len(magnitudes)}")
    if not 0 <= j < 8:
        raise ValueError(f"a 16-bit unit holds 8 2-bit ranks, not plane {j}")
    byte, shift = divmod(2 * j, 8)
    lines = [f"prmt.b32 g, $2, $3, {_gather_selector(byte):#06x};"]
    if shift:
        lines.append(f"shr.b32 g, g, {shift};")
    lines.append("and.b32 x, g, 0x03030303;")
    signs = "$4"
    if j != 2:
        # bit j of every sign byte to bit 2 of the same byte (the mask drops the rest)
        lines.append(f"{'shl' if j < 2 else 'shr'}.b32 y, $4, {abs(2 - j)};")
        signs = "y"
    lines.append(f"lop3.b32 x, {signs}, 0x04040404, x, 0xea;")
    table = (*magnitudes, *(-m for m in magnitudes))
    return _byte_fields_ptx(lines, table, 8, [], "r,r,r")


def codebook_plane(tile: jax.Array, j: int, bits: int, magnitudes: tuple[float, ...],
                   asm: bool, signs: jax.Array | None = None) -> jax.Array:
    """Bit plane ``j`` of a tile of 16-bit units or bytes of sign-magnitude codes, as
    float16 codebook values ``(-1)^s magnitudes[m]``.

    Without ``signs`` the plane is ``bits`` wide, the top bit the sign (in bytes: the
    two nibbles of a byte are planes 0 and 1 of 4-bit codes). With ``signs`` (16-bit
    units only; a tile of bytes of the same shape: 3-bit codes in the split layout of
    :func:`kvjax.primitives.packing.pack_split`) the plane is the ``bits - 1`` magnitude
    bits and the sign is bit ``j`` of the unit's byte. At most 8 magnitudes (4 bits).
    The sign bit negates whatever the table holds, so a signed table serves as well
    (``cos`` of the first half circle, for the angles of a uniform circular codebook).
    ``asm``: :func:`codebook_table_ptx`, or :func:`codebook_ptx` for split codes.
    """
    mag_bits = bits - 1
    split = signs is not None
    width = bits - split
    if len(magnitudes) != 1 << mag_bits or mag_bits > 3:
        raise ValueError(f"{len(magnitudes)} magnitudes for {bits}-bit codes")
    if tile.dtype == jnp.uint8:
        if split:
            raise ValueError("split codes are read from 16-bit units")
        if not 0 <= j * bits <= 8 - bits:
            raise ValueError(f"a byte holds {8 // bits} {bits}-bit codes, not plane {j}")
    if asm and split:
        return run_ptx(codebook_ptx(j, bits, magnitudes), [tile, signs])
    if asm:
        unit = 8 if tile.dtype == jnp.uint8 else 16
        return run_ptx(codebook_table_ptx(unit, j, bits, magnitudes), [tile])
    offset = j * width
    field = (tile >> jnp.asarray(offset, tile.dtype)) & jnp.asarray((1 << width) - 1, tile.dtype)
    if split:
        rank = field
        negative = ((signs >> jnp.asarray(j, signs.dtype)) & jnp.asarray(1, signs.dtype)) != 0
    else:
        rank = field & jnp.asarray((1 << mag_bits) - 1, tile.dtype)
        negative = (field >> jnp.asarray(mag_bits, tile.dtype)) != 0
    value = select_table(magnitudes, rank)
    return jnp.where(negative, -value, value).astype(OPERAND)


def sign_ptx(j: int, base: float) -> Ptx:
    """:func:`sign_plane`: four bytes per call; each byte's bit ``j`` spread to its
    float16 lane's sign bit (``prmt``, ``shl``) and applied to ``base`` (``lop3``)."""
    pattern = f16_bits(base) * 0x10001
    return Ptx("{ .reg .b32 t, v; "
               f"mov.b32 v, {pattern:#010x}; "
               f"prmt.b32 t, $2, $2, 0x1100; shl.b32 t, t, {7 - j}; "
               f"lop3.b32 $0, v, t, 0x80008000, {XOR_AND:#x}; "
               f"prmt.b32 t, $2, $2, 0x3322; shl.b32 t, t, {7 - j}; "
               f"lop3.b32 $1, v, t, 0x80008000, {XOR_AND:#x}; }}", "=r,=r,r", 4)


def sign_plane(tile: jax.Array, j: int, base: float, asm: bool) -> jax.Array:
    """Bit ``j`` of every byte of a tile of bytes as float16 ``base`` (bit clear) or
    ``-base`` (bit set). ``asm``: :func:`sign_ptx`."""
    if asm:
        return run_ptx(sign_ptx(j, base), [tile])
    bit = (tile >> jnp.asarray(j, tile.dtype)) & jnp.asarray(1, tile.dtype)
    return jnp.where(bit != 0, -base, base).astype(OPERAND)
