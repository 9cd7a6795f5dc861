"""The value side of a decode kernel over group-wise INT values (KIVI's value variant,
:class:`kvjax.codec.GroupIntFormat`): every kernel whose values are ``zero_g + scale_g *
c`` per group ``g`` of channels takes its value inputs, its ``accumulate`` step of the
flash-decoding loop (:func:`pallas_kernels.flash.split_softmax`), its checks and its
reference from here, whatever its keys are.

In the kernel a plane of value codes holds the columns of one group in the low halves of
its words and of one group in the high halves (:func:`parity_groups`); each column's
scale and zero are loaded beside it and the plane is dequantized in registers with one
``fma.f16x2`` per two codes (:func:`~pallas_kernels.units.group_int_plane`), so it meets
the probabilities in one matmul. (Scaling the probabilities per group instead, one
matmul per group and plane with the zeros summed apart, ran 1.086 ms against this form's
0.733 at B = 32, S = 32k, TurboQuant 4-bit keys.) The output's columns come out in the
planes' order; :func:`restore_columns` puts them back in dim order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kvjax.primitives.packing import unpack_codes
from pallas_kernels.flash import OPERAND, dot_nn, stacked_spec
from pallas_kernels.units import code_layout, group_int_plane, unit_view

#: value code widths packed planar (2, 4, 8) or split (3)
VALUE_BITS = (2, 3, 4, 8)


def value_groups(head_dim: int, bits: int, group: int) -> np.ndarray:
    """``[planes, width]``: the channel group of each column of each value plane."""
    _, planes, perm = code_layout(head_dim, bits)
    return (perm // group).reshape(planes, -1)


def parity_groups(head_dim: int, bits: int, group: int) -> tuple[tuple[int, int], ...] | None:
    """Per value plane, the channel group of its even and of its odd columns (the low
    and the high halves of the words), or None when a plane's even or odd columns span
    more than one group (the kernel applies one group's scale per half)."""
    out = []
    for plane in value_groups(head_dim, bits, group):
        even, odd = set(plane[0::2].tolist()), set(plane[1::2].tolist())
        if len(even) != 1 or len(odd) != 1:
            return None
        out.append((even.pop(), odd.pop()))
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
    if parity_groups(head_dim, value_bits, value_group) is None:
        return (f"value groups of {value_group} channels mix within a half of the "
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
    return head_dim // code_layout(head_dim, value_bits)[1]


def inputs(v_codes: jax.Array, v_scale: jax.Array, v_zero: jax.Array, layers: int,
           slots: int) -> tuple[list[jax.Array], list]:
    """The value arrays of a ``pallas_call`` (stacked ``[L, B, K, S, ...]``) and their
    block specs, in the order :class:`Accumulator` takes their refs: the codes as 16-bit
    and as 8-bit units (a split 3-bit code reads both), the scales, the zeros."""
    halves, bytes_ = unit_view(v_codes, "halves"), unit_view(v_codes, "bytes")
    groups = v_scale.shape[-1]
    return ([halves, bytes_, v_scale, v_zero],
            [stacked_spec(layers, slots, halves.shape[-1]),
             stacked_spec(layers, slots, bytes_.shape[-1]),
             stacked_spec(layers, slots, groups), stacked_spec(layers, slots, groups)])


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
        self.parity = parity_groups(head_dim, value_bits, value_group)
        self.width = plane_width(head_dim, value_bits)
        self.init = tuple(jnp.zeros((rows, self.width), jnp.float32) for _ in self.parity)

    def _codes(self, load):
        if self.bits != 3:
            return load(self.halves_ref), None
        # split: the low 2-bit words as halves, the top-bit words after them as bytes
        return (load(self.halves_ref, pl.ds(0, self.head_dim // 8)),
                load(self.bytes_ref, pl.ds(self.head_dim // 4, self.head_dim // 8)))

    def accumulate(self, acc, p, correction, load):
        """``acc * correction + p @ values`` per plane, ``p [rows, block_s]``."""
        codes, top = self._codes(load)
        p = p.astype(OPERAND)
        width = self.width

        def param(ref, g):
            # one group's column of a [block_s, groups] ref as a [block_s, width] tile,
            # loaded for each plane apart: tiles kept for every plane of their group
            # held 8 of them in registers at once (255 per thread, 12.5% occupancy, as
            # Nsight Compute showed), and a zero-stride load of the tile was slower
            column = load(ref, pl.ds(g, 1))
            return jnp.broadcast_to(column, (column.shape[0], width))

        even_columns = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1) % 2 == 0
        out = []
        for j, (even, odd) in enumerate(self.parity):
            pairs = []
            for ref in (self.scale_ref, self.zero_ref):
                low = param(ref, even)
                pairs.append(low if odd == even else
                             jnp.where(even_columns, low, param(ref, odd)))
            plane = group_int_plane(codes, j, self.bits, *pairs, self.asm, top=top)
            out.append(acc[j] * correction[:, None] + dot_nn(p, plane))
        return tuple(out)

    def store(self, o_ref, acc) -> None:
        """Write the accumulator's planes to ``o_ref`` (columns in plane order)."""
        for j, tile in enumerate(acc):
            o_ref[:, pl.ds(j * self.width, self.width)] = tile


def restore_columns(o: jax.Array, head_dim: int, value_bits: int) -> jax.Array:
    """A kernel output's columns (the value planes' order) back in dim order."""
    return o[..., np.argsort(code_layout(head_dim, value_bits)[2])]


def dequantize(codes: jax.Array, scale: jax.Array, zero: jax.Array, bits: int, group: int,
               head_dim: int) -> jax.Array:
    """``[..., S, D]`` float32 values ``zero_g + scale_g * c`` per channel group: the
    reference of what the kernels read."""
    c = unpack_codes(codes, bits, head_dim).astype(jnp.float32)
    per_dim = jnp.arange(head_dim) // group
    return (jnp.take(zero.astype(jnp.float32), per_dim, axis=-1)
            + c * jnp.take(scale.astype(jnp.float32), per_dim, axis=-1))
