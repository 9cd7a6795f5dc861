"""Pallas kernel: decode attention read straight from rotated codebook keys and
group-wise INT values (flash-decoding, :mod:`pallas_kernels.flash`).

Keys are stored rotated, ``k = |k| R^T y`` with ``R`` the codec's randomized
Walsh-Hadamard rotation and every coordinate of ``y`` a sign-magnitude code into a
symmetric codebook. With ``q . k = |k| (R q) . y`` the query is rotated once, before the
kernel, and the kernel never un-rotates a key: a bit plane of the codes becomes float16
codebook values by a byte-permute lookup in registers
(:func:`pallas_kernels.units.codebook_plane`), goes into a float16 matmul with the
rotated query's matching columns, and the block's dots are scaled by the stored norms.
With QJL, the residual's sign bits become ``+-1`` planes (:func:`~pallas_kernels.units.
sign_plane`) in a second matmul with ``G q`` (formed once per call), scaled by
``sqrt(pi / 2) / D`` times the stored residual norms: the estimator's term, in the same
pass.

Values are ``zero_g + scale_g * c`` per group ``g`` of channels. A plane of value codes
holds the columns of one group in the low halves of its words and of one group in the
high halves (:func:`parity_groups`); each column's scale and zero are loaded beside it
and the plane is dequantized in registers with one ``fma.f16x2`` per two codes
(:func:`~pallas_kernels.units.group_int_plane`), so it meets the probabilities in one
matmul. (Scaling the probabilities per group instead, one matmul per group and plane
with the zeros summed apart, ran 1.086 ms against this form's 0.733 at B = 32, S = 32k.)

Operands of the dots are float16, accumulation float32; the reference is exact float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.flash import (
    OPERAND,
    decode_call,
    dot_nn,
    dot_nt,
    leading_inputs,
    split_len,
    split_softmax,
    stacked_spec,
)
from pallas_kernels.units import (
    codebook_plane,
    group_int_plane,
    sign_plane,
    unit_permutation,
    unit_view,
)

#: the QJL estimator's constant: <q, r> ~ sqrt(pi / 2) / D |r| <G q, sign(G r)>
QJL_CONSTANT = math.sqrt(math.pi / 2)


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


def _kernel(n_ref, layer_ref, q_ref, *refs, key_bits, magnitudes, qjl, value_bits,
            parity_groups, block_s, split_len, sm_scale, asm):
    refs = list(refs)
    gq_ref = refs.pop(0) if qjl else None
    kh_ref, kb_ref, norm_ref = refs[:3]
    refs = refs[3:]
    if qjl:
        qjl_ref, rnorm_ref = refs[:2]
        refs = refs[2:]
    vh_ref, vb_ref, vs_ref, vz_ref, o_ref, m_ref, l_ref = refs
    rows, head_dim = q_ref.shape
    layout, k_planes, _ = code_layout(head_dim, key_bits)
    k_width = head_dim // k_planes
    v_planes = len(parity_groups)
    v_width = head_dim // v_planes
    qjl_scale = QJL_CONSTANT / head_dim

    q_slots = [q_ref[:, pl.ds(j * k_width, k_width)].astype(OPERAND) for j in range(k_planes)]
    if qjl:
        sign_width = head_dim // 8
        gq_slots = [gq_ref[:, pl.ds(j * sign_width, sign_width)].astype(OPERAND)
                    for j in range(8)]

    def split(load, halves_ref, bytes_ref):
        # the low 2-bit words as halves, the top-bit words after them as bytes
        return (load(halves_ref, pl.ds(0, head_dim // 8)),
                load(bytes_ref, pl.ds(head_dim // 4, head_dim // 8)))

    def key_tiles(load):
        # loaded once per block, whatever the number of planes read from them
        if layout == "halves":
            return load(kh_ref), None
        if layout == "bytes":
            return load(kb_ref), None
        return split(load, kh_ref, kb_ref)

    def key_plane(tiles, j):
        codes, signs = tiles
        if layout == "bytes":
            return sign_plane(codes, j, magnitudes[0], asm)
        return codebook_plane(codes, j, key_bits, magnitudes, asm, signs=signs)

    def scores(load):
        tiles = key_tiles(load)
        dots = sum(dot_nt(q_slots[j], key_plane(tiles, j)) for j in range(k_planes))
        s = dots * load(norm_ref).astype(jnp.float32)[None, :]
        if qjl:
            bits = load(qjl_ref)
            residual = sum(dot_nt(gq_slots[j], sign_plane(bits, j, -1.0, asm))
                           for j in range(8))
            rnorm = load(rnorm_ref).astype(jnp.float32)
            s = s + residual * (qjl_scale * rnorm)[None, :]
        return s * sm_scale

    def accumulate(acc, p, correction, load):
        vc, top = split(load, vh_ref, vb_ref) if value_bits == 3 else (load(vh_ref), None)
        p = p.astype(OPERAND)

        def param(ref, g):
            # one group's column of a [block_s, groups] ref as a [block_s, width] tile,
            # loaded for each plane apart: tiles kept for every plane of their group
            # held 8 of them in registers at once (255 per thread, 12.5% occupancy, as
            # Nsight Compute showed), and a zero-stride load of the tile was slower
            column = load(ref, pl.ds(g, 1))
            return jnp.broadcast_to(column, (column.shape[0], v_width))

        even_columns = jax.lax.broadcasted_iota(jnp.int32, (1, v_width), 1) % 2 == 0
        out = []
        for j, (even, odd) in enumerate(parity_groups):
            pairs = []
            for ref in (vs_ref, vz_ref):
                low = param(ref, even)
                pairs.append(low if odd == even else
                             jnp.where(even_columns, low, param(ref, odd)))
            plane = group_int_plane(vc, j, value_bits, *pairs, asm, top=top)
            out.append(acc[j] * correction[:, None] + dot_nn(p, plane))
        return tuple(out)

    init = tuple(jnp.zeros((rows, v_width), jnp.float32) for _ in range(v_planes))
    o_slots, m, l = split_softmax(
        n_ref, layer_ref, rows=rows, slots=norm_ref.shape[1], block_s=block_s,
        split_len=split_len, scores=scores, accumulate=accumulate, init=init)
    for j in range(v_planes):
        o_ref[:, pl.ds(j * v_width, v_width)] = o_slots[j]
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=("key_bits", "magnitudes", "value_bits", "value_group", "sm_scale",
                     "block_s", "splits", "num_warps", "num_stages", "interpret", "asm"),
)
def codes_partial(
    q: jax.Array,
    gq: jax.Array | None,
    k_codes: jax.Array,
    k_norm: jax.Array,
    k_qjl: jax.Array | None,
    k_residual_norm: jax.Array | None,
    v_codes: jax.Array,
    v_scale: jax.Array,
    v_zero: jax.Array,
    n_comp: jax.Array,
    layer: jax.Array | None = None,
    *,
    key_bits: int,
    magnitudes: tuple[float, ...],
    value_bits: int,
    value_group: int,
    sm_scale: float,
    block_s: int,
    splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    asm: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-split partial softmaxes over the coded tokens (see the module docstring).

    ``q [B, K, R, D]`` is the rotated query with ``R`` rows padded as the kernel needs,
    its columns in the order of the key planes (:func:`key_layout`); ``gq`` (QJL only)
    is ``G q`` with its columns in the order of the sign planes (``unit_permutation(D,
    1, "bytes")``). Codes are stacked (``[L, B, K, S, ...]``; ``layer`` None reads a
    stack of one). Returns ``o [B, K, splits, R, D]`` with its columns in the order of
    the value planes, ``m, l [B, K, splits, R]`` (float32).
    """
    batch, heads, rows, head_dim = q.shape
    qjl = gq is not None
    stack = [k_codes, k_norm, v_codes, v_scale, v_zero]
    if qjl:
        stack += [k_qjl, k_residual_norm]
    if layer is None:
        stack = [a[None] for a in stack]
        layer = 0
    k_codes, k_norm, v_codes, v_scale, v_zero, *rest = stack
    layers, slots = k_codes.shape[0], k_codes.shape[3]
    kernel = functools.partial(
        _kernel, key_bits=key_bits, magnitudes=magnitudes, qjl=qjl, value_bits=value_bits,
        parity_groups=parity_groups(head_dim, value_bits, value_group), block_s=block_s,
        split_len=split_len(slots, splits, block_s), sm_scale=sm_scale,
        asm=asm and not interpret)
    halves, bytes_ = unit_view(k_codes, "halves"), unit_view(k_codes, "bytes")
    v_halves, v_bytes = unit_view(v_codes, "halves"), unit_view(v_codes, "bytes")
    groups = v_scale.shape[-1]
    args, in_specs = leading_inputs(n_comp, layer, q)
    if qjl:
        # G q: one [R, D] block per program, like the query
        args.append(gq.astype(jnp.float32))
        in_specs.append(in_specs[2])
    args += [halves, bytes_, k_norm]
    in_specs += [stacked_spec(layers, slots, halves.shape[-1]),
                 stacked_spec(layers, slots, bytes_.shape[-1]), stacked_spec(layers, slots)]
    if qjl:
        k_qjl, k_residual_norm = rest
        qjl_bytes = unit_view(k_qjl, "bytes")
        args += [qjl_bytes, k_residual_norm]
        in_specs += [stacked_spec(layers, slots, qjl_bytes.shape[-1]),
                     stacked_spec(layers, slots)]
    args += [v_halves, v_bytes, v_scale, v_zero]
    in_specs += [stacked_spec(layers, slots, v_halves.shape[-1]),
                 stacked_spec(layers, slots, v_bytes.shape[-1]),
                 stacked_spec(layers, slots, groups), stacked_spec(layers, slots, groups)]
    return decode_call(kernel, args, in_specs, batch=batch, heads=heads, splits=splits,
                       rows=rows, head_dim=head_dim, num_warps=num_warps,
                       num_stages=num_stages, interpret=interpret,
                       name="codebook_decode_attention")
