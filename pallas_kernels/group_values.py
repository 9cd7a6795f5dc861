"""The value side of a decode kernel over group-wise INT values (KIVI's value variant,
:class:`kvjax.codec.GroupIntFormat`): every kernel whose values are ``zero_g + scale_g *
c`` per group ``g`` of channels takes its value inputs, its ``accumulate`` step of the
flash-decoding loop (:func:`pallas_kernels.flash.split_softmax`), its checks and its
reference from here, whatever its keys are.

In the kernel a bit plane of the value codes (:func:`value_layout`) is one matmul
operand: each column's scale and zero are loaded beside it (:func:`plane_groups`: a
plane's columns take one, two or a few channel groups, by column parity or by
contiguous runs) and the plane is dequantized in registers with one ``fma.f16x2`` per two
codes (:func:`~pallas_kernels.units.group_int_plane`), so it meets the probabilities in
one matmul. (Scaling the probabilities per group instead, one matmul per group and plane
with the zeros summed apart, ran 1.086 ms against this form's 0.733 at B = 32, S = 32k,
TurboQuant 4-bit keys.) 4- and 8-bit codes are read as 16-bit units, four (two) planes
of ``D / 4`` (``D / 2``) columns; 2- and 3-bit codes as bytes, four planes of ``D / 4``
columns, each a contiguous quarter of the dims (:func:`kvjax.primitives.packing.
byte_plane_order`): read as 16-bit units they made eight planes of ``D / 8`` columns,
and the per-plane work (parameters, rescaling, a matmul) made 2-bit values cost twice
4-bit ones (1.36 against 0.79 ms at B = 32, S = 32k). A 3-bit code's top bit lies in a
byte of 16-bit-unit-relative order (the keys' readers use it so): the top bytes are
loaded as one tile and interleaved with their own high nibbles, so each byte column
sees its top bits. The output's columns come out in the planes'
order; :func:`restore_columns` puts them back in dim order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kvjax.primitives.packing import unpack_codes
from pallas_kernels.flash import OPERAND, dot_nn, stacked_spec
from pallas_kernels.units import code_layout, group_int_plane, unit_permutation, unit_view

#: value code widths packed planar (2, 4, 8) or split (3)
VALUE_BITS = (2, 3, 4, 8)


#: the most (group, columns) entries a plane's parameters are selected from
MAX_GROUP_ENTRIES = 4


def value_layout(head_dim: int, bits: int) -> tuple[str, int, np.ndarray]:
    """``(view, planes, permutation)`` of value codes as the value side reads them:
    16-bit units at 4 and 8 bits (:func:`~pallas_kernels.units.code_layout`), bytes at 2
    bits, and at 3 bits ("split-bytes") the low 2 bits as bytes with each byte's top
    bits beside it; the permutation gives the dim of each kernel column."""
    if bits in (2, 3):
        return ("bytes" if bits == 2 else "split-bytes", 4,
                unit_permutation(head_dim, 2, "bytes"))
    return code_layout(head_dim, bits)


def value_groups(head_dim: int, bits: int, group: int) -> np.ndarray:
    """``[planes, width]``: the channel group of each column of each value plane."""
    _, planes, perm = value_layout(head_dim, bits)
    return (perm // group).reshape(planes, -1)


def _entries(groups: np.ndarray) -> tuple[tuple[int, int, int, int | None], ...] | None:
    """One plane's columns as ``(group, lo, hi, parity)`` entries: the first covers every
    column, each later one the columns ``lo <= c < hi`` (of ``parity``, if not None)."""
    width = len(groups)
    even, odd = set(groups[0::2].tolist()), set(groups[1::2].tolist())
    if len(even) == 1 and len(odd) == 1:
        (g_even,), (g_odd,) = even, odd
        return ((g_even, 0, width, None),) + (
            ((g_odd, 0, width, 1),) if g_odd != g_even else ())
    starts = [0] + [c for c in range(1, width) if groups[c] != groups[c - 1]]
    runs = [(int(groups[lo]), lo, hi, None)
            for lo, hi in zip(starts, [*starts[1:], width], strict=True)]
    if len({g for g, *_ in runs}) != len(runs):
        return None  # a group in two runs: neither pattern
    return ((runs[0][0], 0, width, None), *runs[1:])


def plane_groups(head_dim: int, bits: int, group: int):
    """Per value plane, its columns' channel groups as ``(group, lo, hi, parity)``
    entries (the first covers the plane, each later one overrides the columns ``lo <= c
    < hi`` of ``parity`` if not None), or None when some plane needs more than
    :data:`MAX_GROUP_ENTRIES` or follows neither pattern."""
    out = []
    for groups in value_groups(head_dim, bits, group):
        entries = _entries(groups)
        if entries is None or len(entries) > MAX_GROUP_ENTRIES:
            return None
        out.append(entries)
    return tuple(out)


def unsupported(value_bits: int, value_group: int, head_dim: int) -> str | None:
    """Why the value side cannot read these codes (None: it can)."""
    if value_bits not in VALUE_BITS:
        return (f"{value_bits}-bit value codes are neither planar nor split "
                f"(value bits {VALUE_BITS})")
    if value_group < 1 or value_group & (value_group - 1) or value_group > head_dim:
        return f"value group {value_group} is not a power of two <= head_dim {head_dim}"
    if head_dim % 32:
        return f"head_dim {head_dim} does not fill whole value words (a multiple of 32)"
    if plane_groups(head_dim, value_bits, value_group) is None:
        return (f"value groups of {value_group} channels mix too finely within the "
                f"{value_bits}-bit value planes")
    return None


def check_arrays(v_codes: jax.Array, v_scale: jax.Array, v_zero: jax.Array,
                 tokens: tuple[int, ...], head_dim: int, value_bits: int,
                 value_group: int) -> None:
    """``ValueError`` unless the value arrays fit ``tokens`` (the keys' leading shape,
    ``[L,] B, K, S``): ``v_codes`` uint32 words, one scale and zero per channel group."""
    groups = head_dim // value_group
    shapes = (("v_codes", v_codes, (*tokens, value_bits * head_dim // 32)),
              ("v_scale", v_scale, (*tokens, groups)), ("v_zero", v_zero, (*tokens, groups)))
    for name, a, shape in shapes:
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    if v_codes.dtype != jnp.uint32:
        raise ValueError(f"v_codes must be uint32 packed words, got {v_codes.dtype}")


def plane_width(head_dim: int, value_bits: int) -> int:
    """Columns of one value plane (the query rows are padded to a matmul of at least
    this width)."""
    return head_dim // value_layout(head_dim, value_bits)[1]


def inputs(v_codes: jax.Array, v_scale: jax.Array, v_zero: jax.Array, layers: int,
           slots: int, shared: bool = False) -> tuple[list[jax.Array], list]:
    """The value arrays of a ``pallas_call`` (stacked ``[L, B, K, S, ...]``, or a paged
    pool ``[L, 1, K, S, ...]`` with ``shared``) and their block specs, in the order
    :class:`Accumulator` takes their refs: the codes as 16-bit and as 8-bit units (a
    split 3-bit code reads both), the scales, the zeros."""
    halves, bytes_ = unit_view(v_codes, "halves"), unit_view(v_codes, "bytes")
    groups = v_scale.shape[-1]
    spec = functools.partial(stacked_spec, layers, slots, shared=shared)
    return ([halves, bytes_, v_scale, v_zero],
            [spec(halves.shape[-1]), spec(bytes_.shape[-1]), spec(groups), spec(groups)])


class Accumulator:
    """The value side inside a kernel: ``init`` (the zero accumulator, one float32 tile
    per value plane), ``accumulate`` (the ``split_softmax`` callback: rescale, add the
    block's probabilities times its dequantized values) and ``store``.

    ``refs``: the four refs of :func:`inputs`; ``rows``: query rows of the program.
    """

    def __init__(self, refs, *, rows: int, head_dim: int, value_bits: int, value_group: int,
                 asm: bool):
        self.halves_ref, self.bytes_ref, self.scale_ref, self.zero_ref = refs
        self.head_dim, self.bits, self.asm = head_dim, value_bits, asm
        self.view = value_layout(head_dim, value_bits)[0]
        self.groups = plane_groups(head_dim, value_bits, value_group)
        self.width = plane_width(head_dim, value_bits)
        self.init = tuple(jnp.zeros((rows, self.width), jnp.float32) for _ in self.groups)

    def _codes(self, load):
        if self.view == "halves":
            return load(self.halves_ref), None
        if self.view == "bytes":
            return load(self.bytes_ref), None
        # split-bytes: byte column c's top bits are in the top byte of its 16-bit unit
        # c // 2, the low nibble for an even c and the high one for an odd c; loaded as
        # one contiguous tile and interleaved with their high nibbles in registers (a
        # load gathering each column's byte issued one load per byte)
        top = load(self.bytes_ref, pl.ds(self.width, self.width // 2))
        top = jnp.stack([top, top >> jnp.asarray(4, top.dtype)], axis=-1)
        top = top.reshape(top.shape[0], self.width)
        return load(self.bytes_ref, pl.ds(0, self.width)), top

    def _params(self, ref, entries, load):
        # each group's column of a [block_s, groups] ref broadcast to the plane's width,
        # loaded for each plane apart: tiles kept for every plane of their group held 8
        # of them in registers at once (255 per thread, 12.5% occupancy, as Nsight
        # Compute showed), and a zero-stride load of the tile was slower
        column = jax.lax.broadcasted_iota(jnp.int32, (1, self.width), 1)
        tile = None
        for g, lo, hi, parity in entries:
            values = load(ref, pl.ds(g, 1))
            values = jnp.broadcast_to(values, (values.shape[0], self.width))
            if tile is None:
                tile = values
                continue
            mask = (column >= lo) & (column < hi) if (lo, hi) != (0, self.width) else None
            if parity is not None:
                odd = column % 2 == parity
                mask = odd if mask is None else mask & odd
            tile = jnp.where(mask, values, tile)
        return tile

    def accumulate(self, acc, p, correction, load):
        """``acc * correction + p @ values`` per plane, ``p [rows, block_s]``."""
        codes, top = self._codes(load)
        p = p.astype(OPERAND)
        out = []
        for j, entries in enumerate(self.groups):
            scale = self._params(self.scale_ref, entries, load)
            zero = self._params(self.zero_ref, entries, load)
            plane = group_int_plane(codes, j, self.bits, scale, zero, self.asm, top=top)
            out.append(acc[j] * correction[:, None] + dot_nn(p, plane))
        return tuple(out)

    def store(self, o_ref, acc) -> None:
        """Write the accumulator's planes to ``o_ref`` (columns in plane order)."""
        for j, tile in enumerate(acc):
            o_ref[:, pl.ds(j * self.width, self.width)] = tile


def restore_columns(o: jax.Array, head_dim: int, value_bits: int) -> jax.Array:
    """A kernel output's columns (the value planes' order) back in dim order."""
    return o[..., np.argsort(value_layout(head_dim, value_bits)[2])]


def dequantize(codes: jax.Array, scale: jax.Array, zero: jax.Array, bits: int, group: int,
               head_dim: int) -> jax.Array:
    """``[..., S, D]`` float32 values ``zero_g + scale_g * c`` per channel group: the
    reference of what the kernels read."""
    c = unpack_codes(codes, bits, head_dim).astype(jnp.float32)
    per_dim = jnp.arange(head_dim) // group
    return (jnp.take(zero.astype(jnp.float32), per_dim, axis=-1)
            + c * jnp.take(scale.astype(jnp.float32), per_dim, axis=-1))
