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

Values are ``zero_g + scale_g * c`` per group ``g`` of channels, dequantized in
registers by the shared value side (:mod:`pallas_kernels.group_values`).

Operands of the dots are float16, accumulation float32; the reference is exact float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import group_values
from pallas_kernels.flash import (
    OPERAND,
    decode_call,
    dot_nt,
    leading_inputs,
    split_len,
    split_softmax,
    stacked_spec,
)
from pallas_kernels.group_values import Accumulator
from pallas_kernels.units import code_layout, codebook_plane, sign_plane, unit_view

#: the QJL estimator's constant: <q, r> ~ sqrt(pi / 2) / D |r| <G q, sign(G r)>
QJL_CONSTANT = math.sqrt(math.pi / 2)


def _kernel(n_ref, layer_ref, q_ref, *refs, key_bits, magnitudes, qjl, value_bits,
            value_group, block_s, split_len, sm_scale, asm):
    refs = list(refs)
    gq_ref = refs.pop(0) if qjl else None
    kh_ref, kb_ref, norm_ref = refs[:3]
    refs = refs[3:]
    if qjl:
        qjl_ref, rnorm_ref = refs[:2]
        refs = refs[2:]
    *value_refs, o_ref, m_ref, l_ref = refs
    rows, head_dim = q_ref.shape
    layout, k_planes, _ = code_layout(head_dim, key_bits)
    k_width = head_dim // k_planes
    qjl_scale = QJL_CONSTANT / head_dim
    values = Accumulator(value_refs, rows=rows, head_dim=head_dim, value_bits=value_bits,
                         value_group=value_group, asm=asm)

    q_slots = [q_ref[:, pl.ds(j * k_width, k_width)].astype(OPERAND) for j in range(k_planes)]
    if qjl:
        sign_width = head_dim // 8
        gq_slots = [gq_ref[:, pl.ds(j * sign_width, sign_width)].astype(OPERAND)
                    for j in range(8)]

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
        s = dots * load(norm_ref).astype(jnp.float32)[None, :]
        if qjl:
            bits = load(qjl_ref)
            residual = sum(dot_nt(gq_slots[j], sign_plane(bits, j, -1.0, asm))
                           for j in range(8))
            rnorm = load(rnorm_ref).astype(jnp.float32)
            s = s + residual * (qjl_scale * rnorm)[None, :]
        return s * sm_scale

    o, m, l = split_softmax(
        n_ref, layer_ref, rows=rows, slots=norm_ref.shape[1], block_s=block_s,
        split_len=split_len, scores=scores, accumulate=values.accumulate, init=values.init)
    values.store(o_ref, o)
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
        value_group=value_group, block_s=block_s,
        split_len=split_len(slots, splits, block_s), sm_scale=sm_scale,
        asm=asm and not interpret)
    halves, bytes_ = unit_view(k_codes, "halves"), unit_view(k_codes, "bytes")
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
    value_args, value_specs = group_values.inputs(v_codes, v_scale, v_zero, layers, slots)
    args += value_args
    in_specs += value_specs
    return decode_call(kernel, args, in_specs, batch=batch, heads=heads, splits=splits,
                       rows=rows, head_dim=head_dim, num_warps=num_warps,
                       num_stages=num_stages, interpret=interpret,
                       name="codebook_decode_attention")
