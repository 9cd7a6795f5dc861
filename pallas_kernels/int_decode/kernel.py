"""Pallas kernel: decode attention read straight from packed INT-N codes (flash-decoding).

Grid ``(B, K, splits)``: one program per (row, kv head, slice of the cache). A program
holds *all* query heads of its kv head (GQA: every code word is read once, not once per
query head), walks its slice in blocks of ``block_s`` tokens with an online softmax, and
writes a partial ``(o, m, l)`` that :func:`pallas_kernels.partial.merge_partials` combines
exactly across slices and with the raw regions of the cache. :mod:`.api` is the entry that
callers use; :func:`codes_partial` here is the bare ``pallas_call``.

Codes are never dequantized elementwise. With ``q . k_hat = scale * (q . c) + zero *
sum(q)`` and the output ``sum_s p_s (zero_s + scale_s c_s)``, the integer codes go
straight into float16 matmuls (exact below ``2**11``). The packed uint32 words are read
in 16-bit units (``LAYOUTS``: "halves", the default): bit plane ``j`` of a ``[block_s,
D * bits / 16]`` tile is a full-width matmul operand, so a block costs ``16 / bits``
matmuls per role. A plane becomes float16 without any int-to-float conversion (those
run at a quarter of the integer rate and bounded the first version of this kernel):
``(unit >> j * bits) & mask | 0x6400`` is the bit pattern of the float16 ``1024 + c``,
and one exact float16 subtraction leaves ``c`` (:mod:`pallas_kernels.units`). The
query's columns are permuted to the dims the planes hold and the output's back, outside
the loop. "bytes" reads 8-bit units and converts them (``8 / bits`` matmuls, kept to
measure the trick against as a :class:`Research` variant; docs/kernels.md). No value is
ever sliced, gathered or concatenated inside the kernel (the Triton lowering supports
none of these): the query is consumed in column slices of its ref.

For SAW keys the query is rotated once, ``q R^T``, by the same XLA product that permutes
its columns (or, in the ``rotate_in_kernel`` research variant, inside every program), so
the rotated keys are never un-rotated.

Operands of the dots are float16 (``OPERAND``), accumulation float32; the reference
is exact float32, and the tests state the tolerance. Dots of fewer than 16 columns
(INT2 at head dim 64) are too narrow for Triton's matrix instructions and run as
broadcast multiply-adds in float32 on the same float16 operands.
"""

from __future__ import annotations

import dataclasses
import functools

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
    int_plane,
    operand_width,
    unit_bits,
    unit_permutation,
    unit_view,
)


# The variants below lost to the production kernel on the H200 (docs/kernels.md); they stay
# callable, behind this one benchmark-only value, so that the measurements that chose the
# production path can be repeated in the same run as it (experiments/bench_decode.py
# --variant). The library never passes one.
@dataclasses.dataclass(frozen=True)
class Research:
    """A benchmark-only variant of the kernel; ``Research()`` is the production kernel.

    layout: "halves" (16-bit code units turned into float16 by bit operations) or "bytes"
    (8-bit units with int-to-float conversions).
    asm: unpack "halves" two units per 32-bit register in inline PTX (compiled only;
    interpret mode always uses the jnp operations); False uses the jnp operations.
    rotate_in_kernel: a SAW query rotation multiplied inside every program instead of by
    one XLA product before the kernel.
    """

    layout: str = "halves"
    asm: bool = True
    rotate_in_kernel: bool = False

    def __post_init__(self):
        unit_bits(self.layout)


def _kernel(n_ref, layer_ref, q_ref, *refs, bits, width, block_s, split_len, sm_scale,
            rotated, offset, asm):
    refs = list(refs)
    rot_ref = refs.pop(0) if rotated else None
    if offset is None:
        kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, o_ref, m_ref, l_ref = refs
    else:
        (kc_ref, ks_ref, vc_ref, vs_ref, o_ref, m_ref, l_ref), kz_ref, vz_ref = refs, None, None
    planes = 8 * jnp.dtype(kc_ref.dtype).itemsize // bits
    rows = q_ref.shape[0]

    # the query, one [rows, width] column slot per plane (rotated for SAW keys)
    if rotated:
        # float16 operands like every other matmul here: the rotated query is rounded
        # to float16 right after anyway, and a float32 product costs several passes
        q = q_ref[...].astype(OPERAND)
        q_slots = [dot_nt(q, rot_ref[pl.ds(j * width, width), :]) for j in range(planes)]
    else:
        q_slots = [q_ref[:, pl.ds(j * width, width)] for j in range(planes)]
    q_slots = [qj.astype(OPERAND) for qj in q_slots]
    q_sum = sum(jnp.sum(qj.astype(jnp.float32), axis=1) for qj in q_slots)

    def scores(load):
        kc = load(kc_ref)
        ks = load(ks_ref).astype(jnp.float32)
        dots = sum(dot_nt(q_slots[j], int_plane(kc, j, bits, asm)) for j in range(planes))
        if offset is not None:
            # scale * (code - offset), with the offset's share from the same float16 query
            return (dots - float(offset) * q_sum[:, None]) * (ks[None, :] * sm_scale)
        kz = load(kz_ref).astype(jnp.float32)
        return (dots * ks[None, :] + q_sum[:, None] * kz[None, :]) * sm_scale

    def accumulate(acc, p, correction, load):
        o_slots, o_zero = acc
        vc = load(vc_ref)
        vs = load(vs_ref).astype(jnp.float32)
        pv = (p * vs[None, :]).astype(OPERAND)
        if offset is None:
            zero = p * load(vz_ref).astype(jnp.float32)[None, :]
        else:
            # biased codes are ~offset, their differences small: the offset's share must
            # come from the same rounded operand, or its rounding error would not cancel
            zero = -float(offset) * pv.astype(jnp.float32)
        o_zero = o_zero * correction + jnp.sum(zero, axis=1)
        o_slots = tuple(o_slots[j] * correction[:, None] + dot_nn(pv, int_plane(vc, j, bits, asm))
                        for j in range(planes))
        return o_slots, o_zero

    init = (tuple(jnp.zeros((rows, width), jnp.float32) for _ in range(planes)),
            jnp.zeros((rows,), jnp.float32))
    (o_slots, o_zero), m, l = split_softmax(
        n_ref, layer_ref, rows=rows, slots=kc_ref.shape[1], block_s=block_s,
        split_len=split_len, scores=scores, accumulate=accumulate, init=init)
    # every value is zero + scale * code: the zeros' share is the same in every column
    for j in range(planes):
        o_ref[:, pl.ds(j * width, width)] = o_slots[j] + o_zero[:, None]
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=("bits", "offset", "sm_scale", "block_s", "splits", "num_warps",
                     "num_stages", "interpret", "research"),
)
def codes_partial(
    q: jax.Array,
    k_codes: jax.Array,
    k_scale: jax.Array,
    k_zero: jax.Array,
    v_codes: jax.Array,
    v_scale: jax.Array,
    v_zero: jax.Array,
    n_comp: jax.Array,
    rotation: jax.Array | None = None,
    layer: jax.Array | None = None,
    *,
    bits: int,
    offset: int | None = None,
    sm_scale: float,
    block_s: int = 64,
    splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    research: Research = Research(),
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-split partial softmaxes over the coded tokens (see the module docstring).

    Shapes as :func:`.api.int_decode`, except ``q [B, K, R, D]`` with ``R`` query rows
    per kv head already padded to what the kernel needs (a power of two, at least 16 when
    :func:`operand_width` is; :func:`pad_query_rows`), the codes always stacked
    (``[L, B, K, S, W]``; ``layer`` None reads a stack of one), and no check of what the
    kernel supports (:func:`.api.int_decode` does them). Returns ``o [B, K, splits, R,
    D]``, ``m, l [B, K, splits, R]`` (float32), one partial per split. With ``offset``
    the zeros are None and every token is ``scale * (code - offset)``. A SAW
    ``rotation`` ``[K, D, D]`` is applied to the query by one XLA product before the
    kernel, together with the column permutation (``research.rotate_in_kernel``: inside
    every program, measured 1.6x slower at one row and 128k tokens: each of the ~500
    programs re-reads and multiplies the ``[D, D]`` matrix; docs/kernels.md).
    """
    layout = research.layout
    batch, heads, rows, head_dim = q.shape
    if layer is None:
        # one layer's arrays: a stack of one (a reshape, no copy)
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = (
            None if a is None else a[None]
            for a in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero))
        layer = 0
    layers = k_codes.shape[0]
    slots_total = k_codes.shape[3]
    k_codes, v_codes = unit_view(k_codes, layout), unit_view(v_codes, layout)
    width = operand_width(head_dim, bits, layout)
    perm = unit_permutation(head_dim, bits, layout)
    if rotation is None:
        q = q[..., perm]
    else:
        # rows of R permuted like the kernel's columns: one product rotates and permutes
        rotation = rotation[:, perm, :]
        if not research.rotate_in_kernel:
            q = jnp.einsum("bkrd,ked->bkre", q.astype(jnp.float32),
                           rotation.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
            rotation = None
    rotated = rotation is not None
    kernel = functools.partial(
        _kernel, bits=bits, width=width, block_s=block_s,
        split_len=split_len(slots_total, splits, block_s),
        sm_scale=sm_scale, rotated=rotated, offset=offset,
        asm=not interpret and research.asm,
    )
    args, in_specs = leading_inputs(n_comp, layer, q)
    if rotated:
        in_specs.append(pl.BlockSpec((None, head_dim, head_dim), lambda b, h, j: (h, 0, 0)))
        args.append(rotation.astype(OPERAND))
    code_spec = stacked_spec(layers, slots_total, k_codes.shape[4])
    meta_spec = stacked_spec(layers, slots_total)
    for codes, scale, zero in ((k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero)):
        present = [(codes, code_spec), (scale, meta_spec)]
        if offset is None:
            present.append((zero, meta_spec))
        args += [a for a, _ in present]
        in_specs += [spec for _, spec in present]
    o, m, l = decode_call(kernel, args, in_specs, batch=batch, heads=heads, splits=splits,
                          rows=rows, head_dim=head_dim, num_warps=num_warps,
                          num_stages=num_stages, interpret=interpret,
                          name="int_decode_attention")
    o = o[..., np.argsort(perm)]
    return o, m, l
