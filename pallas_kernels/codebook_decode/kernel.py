"""Pallas kernel: decode attention read straight from rotated codebook keys and
group-wise INT values (flash-decoding, :mod:`pallas_kernels.flash`); the key side of a
kernel over rotated keys (:mod:`pallas_kernels.rotated`).

Keys are stored rotated, ``k = |k| R^T y`` with ``R`` the codec's randomized
Walsh-Hadamard rotation and every coordinate of ``y`` a sign-magnitude code into a
symmetric codebook. With ``q . k = |k| (R q) . y`` the query is rotated once, before the
kernel, and the kernel never un-rotates a key: a bit plane of the codes becomes float16
codebook values by a byte-permute lookup in registers
(:func:`pallas_kernels.units.codebook_plane`), goes into a float16 matmul with the
rotated query's matching columns, and the block's dots are scaled by the stored norms.
With QJL, the estimator's term is added in the same pass
(:func:`pallas_kernels.rotated.logits`).

Values are ``zero_g + scale_g * c`` per group ``g`` of channels, dequantized in
registers by the shared value side (:mod:`pallas_kernels.group_values`).

Operands of the dots are float16, accumulation float32; the reference is exact float32.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import rotated
from pallas_kernels.flash import BLOCKING, OPERAND, dot_nt
from pallas_kernels.units import code_layout, codebook_plane, sign_plane, unit_view


def _scores(refs: rotated.KernelRefs, *, key_bits, magnitudes, sm_scale, asm):
    head_dim = refs.q.shape[1]
    layout, k_planes, _ = code_layout(head_dim, key_bits)
    k_width = head_dim // k_planes
    kh_ref, kb_ref = refs.keys
    q_slots = [refs.q[:, pl.ds(j * k_width, k_width)].astype(OPERAND)
               for j in range(k_planes)]
    logits = rotated.logits(refs, sm_scale=sm_scale, asm=asm)

    def key_tiles(load):
        # loaded once per block, whatever the number of planes read from them
        if layout == "halves":
            return load(kh_ref), None
        if layout == "bytes":
            return load(kb_ref), None
        # split: the low 2-bit words as halves, the top-bit words after them as bytes
        return (load(kh_ref, pl.ds(0, head_dim // 8)),
                load(kb_ref, pl.ds(head_dim // 4, head_dim // 8)))

    def key_plane(tiles, j):
        codes, signs = tiles
        if layout == "bytes":
            return sign_plane(codes, j, magnitudes[0], asm)
        return codebook_plane(codes, j, key_bits, magnitudes, asm, signs=signs)

    def scores(load):
        tiles = key_tiles(load)
        dots = sum(dot_nt(q_slots[j], key_plane(tiles, j)) for j in range(k_planes))
        return logits(dots, load)

    return scores


#: ``(block_s, num_warps, num_stages)`` of a decode over 3-bit (split) codes: 0.85 ms
#: against 1.09 for the library's 128:2:3 at B = 32, S = 32k, 0.23 against 0.28 at B = 1,
#: S = 128k (H100, docs/kernels.md); 4-bit codes are fastest at 128:2:3 (0.69 ms against
#: 0.76-0.99 for 32 to 128 tokens with 2 or 4 warps)
SPLIT_BLOCKING = (32, 2, 3)


def reader(head_dim: int, key_bits: int, magnitudes: tuple[float, ...]) -> rotated.KeyReader:
    """How the kernel reads ``key_bits``-bit codes at ``head_dim``: the planar words (3
    bits split) as 16-bit and as 8-bit units, the rotated query's columns in the order
    of their planes (:func:`~pallas_kernels.units.code_layout`)."""
    layout, planes, columns = code_layout(head_dim, key_bits)
    return rotated.KeyReader(
        name="codebook_decode_attention", size=key_bits * head_dim // 32, dtype=jnp.uint32,
        width=head_dim // planes, columns=columns,
        views=lambda codes: (unit_view(codes, "halves"), unit_view(codes, "bytes")),
        scores=functools.partial(_scores, key_bits=key_bits, magnitudes=magnitudes),
        blocking=SPLIT_BLOCKING if layout == "split" else BLOCKING)
