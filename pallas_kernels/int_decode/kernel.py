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
    group_heads,
    leading_inputs,
    query_rows,
    split_len,
    split_softmax,
    stacked_spec,
    ungroup_rows,
)
from pallas_kernels.units import (
    biased_int_plane,
    int_plane,
    operand_width,
    plane_bias,
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
    biased: "halves" planes read as ``bias + code`` (:func:`~pallas_kernels.units.
    biased_int_plane`), the biases taken out of the matmuls' results once per row;
    False subtracts them from every pair of codes (:func:`~pallas_kernels.units.
    int_plane`).
    """

    layout: str = "halves"
    asm: bool = True
    rotate_in_kernel: bool = False
    biased: bool = True
    heads: int = 1

    def __post_init__(self):
        unit_bits(self.layout)
        if self.heads < 1:
            raise ValueError(f"heads per program must be positive, got {self.heads}")
        if self.heads > 1 and self.rotate_in_kernel:
            raise ValueError("the query is rotated in the kernel only by programs of one "
                             "kv head")


def _kernel(n_ref, layer_ref, q_ref, *refs, bits, width, block_s, split_len, splits, sm_scale,
            rotated, offset, asm, biased, group, page_tokens):
    refs = list(refs)
    rot_ref = refs.pop(0) if rotated else None
    if offset is None:
        kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, o_ref, m_ref, l_ref = refs
    else:
        (kc_ref, ks_ref, vc_ref, vs_ref, o_ref, m_ref, l_ref), kz_ref, vz_ref = refs, None, None
    planes = 8 * jnp.dtype(kc_ref.dtype).itemsize // bits
    heads, rows = q_ref.shape[:2]
    # each query row's kv head (padding rows: the last one's; their query is zero)
    row_head = jnp.minimum(jnp.arange(rows, dtype=jnp.int32) // group, heads - 1)

    def q_slot(h, j):
        """Head ``h``'s query slot of plane ``j``: ``[rows, width]``, zero outside its
        rows (rotated for SAW keys)."""
        if rotated:
            # float16 operands like every other matmul here: the rotated query is rounded
            # to float16 right after anyway, and a float32 product costs several passes
            return dot_nt(q_ref[h].astype(OPERAND),
                          rot_ref[pl.ds(j * width, width), :]).astype(OPERAND)
        return q_ref[h, :, pl.ds(j * width, width)].astype(OPERAND)

    # one head: the query slots stay in registers; several: each slot is read from the
    # (cached) query block where it is used, as holding them all would cost H times the
    # registers
    held = [q_slot(0, j) for j in range(planes)] if heads == 1 else None
    plane_sums = [sum(jnp.sum((held[j] if held else q_slot(h, j)).astype(jnp.float32), axis=1)
                      for h in range(heads)) for j in range(planes)]
    q_sum = sum(plane_sums)
    if biased:
        # plane j reads bias_j + code: the biases' share of q . k, from the same float16
        # query, taken out once per block
        biases = [plane_bias(j, bits) for j in range(planes)]
        q_bias = sum(b * s for b, s in zip(biases, plane_sums, strict=True))
        plane = functools.partial(biased_int_plane, bits=bits, asm=asm)
    else:
        biases, q_bias = [0.0] * planes, 0.0
        plane = functools.partial(int_plane, bits=bits, asm=asm)
    if offset is not None:
        q_bias = q_bias + float(offset) * q_sum

    def per_token(load, ref):
        """A token's scale or zero for every query row: ``[1, block]`` for one head, a
        ``[rows, block]`` gather of each row's head for several."""
        if heads == 1:
            return load(ref, head=0).astype(jnp.float32)[None, :]
        return load(ref, head=row_head).astype(jnp.float32)

    def scores(load):
        dots = 0.0
        for h in range(heads):
            kc = load(kc_ref, head=h)
            dots = dots + sum(dot_nt(held[j] if held else q_slot(h, j), plane(kc, j))
                              for j in range(planes))
        ks = per_token(load, ks_ref)
        if offset is not None:
            # scale * (code - offset), with the offset's share from the same float16 query
            return (dots - q_bias[:, None]) * (ks * sm_scale)
        if biased:
            dots = dots - q_bias[:, None]
        return (dots * ks + q_sum[:, None] * per_token(load, kz_ref)) * sm_scale

    def accumulate(acc, p, correction, load):
        o_slots, o_zero, pv_sum = acc
        pv = (p * per_token(load, vs_ref)).astype(OPERAND)
        if offset is None:
            o_zero = o_zero * correction + jnp.sum(p * per_token(load, vz_ref), axis=1)
        if offset is not None or biased:
            # biased codes are ~offset or ~bias, their differences small: the biases'
            # share must come from the same rounded operand, or its rounding error would
            # not cancel
            pv_sum = pv_sum * correction + jnp.sum(pv.astype(jnp.float32), axis=1)
        o_slots = [o * correction[:, None] for o in o_slots]
        for h in range(heads):
            vc = load(vc_ref, head=h)
            # a head's values meet only its own rows' probabilities
            pv_h = pv if heads == 1 else jnp.where((row_head == h)[:, None], pv,
                                                   jnp.zeros_like(pv))
            o_slots = [o + dot_nn(pv_h, plane(vc, j)) for j, o in enumerate(o_slots)]
        return tuple(o_slots), o_zero, pv_sum

    zeros = jnp.zeros((rows,), jnp.float32)
    init = (tuple(jnp.zeros((rows, width), jnp.float32) for _ in range(planes)), zeros, zeros)
    (o_slots, o_zero, pv_sum), m, l = split_softmax(
        n_ref, layer_ref, rows=rows, slots=kc_ref.shape[2], block_s=block_s,
        split_len=split_len, splits=splits, scores=scores, accumulate=accumulate, init=init,
        page_tokens=page_tokens)
    # every value is zero + scale * code: the zeros' share is the same in every column
    for j in range(planes):
        shift = biases[j] + (0.0 if offset is None else float(offset))
        o_ref[:, pl.ds(j * width, width)] = o_slots[j] + (o_zero - shift * pv_sum)[:, None]
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=("bits", "offset", "sm_scale", "block_s", "splits", "num_warps",
                     "num_stages", "interpret", "research", "page_tokens"),
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
    pages: jax.Array | None = None,
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
    page_tokens: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-split partial softmaxes over the coded tokens (see the module docstring).

    Shapes as :func:`.api.int_decode`, except the codes always stacked (``[L, B, K, S,
    W]``; ``layer`` None reads a stack of one) and no check of what the kernel supports
    (:func:`.api.int_decode` does them). Returns ``o [B, K, splits, G, D]``, ``m, l [B,
    K, splits, G]`` (float32), one partial per split. A program serves
    ``research.heads`` kv heads, its query rows padded to what the kernel needs (a power
    of two, at least 16 when :func:`operand_width` is). With ``offset`` the zeros are
    None and every token is ``scale * (code - offset)``. A SAW ``rotation`` ``[K, D,
    D]`` is applied to the query by one XLA product before the kernel, together with the
    column permutation (``research.rotate_in_kernel``: inside every program, measured
    1.6x slower at one row and 128k tokens: each of the ~500 programs re-reads and
    multiplies the ``[D, D]`` matrix; docs/kernels.md). With ``pages`` (block tables
    ``[B, P]`` of ``page_tokens`` pages) the stacks are a paged pool ``[L, 1, K, S,
    ...]`` that every row reads through its table.
    """
    layout, heads = research.layout, research.heads
    batch, kv_heads, group, head_dim = q.shape
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
    q = q.astype(jnp.float32)
    if rotation is None:
        q = q[..., perm]
    else:
        # rows of R permuted like the kernel's columns: one product rotates and permutes
        rotation = rotation[:, perm, :]
        if not research.rotate_in_kernel:
            q = jnp.einsum("bkrd,ked->bkre", q, rotation.astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
            rotation = None
    rotated = rotation is not None
    rows = query_rows(heads * group, width)
    row_slots = slots_total if pages is None else pages.shape[1] * page_tokens
    kernel = functools.partial(
        _kernel, bits=bits, width=width, block_s=block_s, page_tokens=page_tokens,
        split_len=split_len(row_slots, splits, block_s), splits=splits,
        sm_scale=sm_scale, rotated=rotated, offset=offset,
        asm=not interpret and research.asm, biased=research.biased and layout == "halves",
        group=group,
    )
    args, in_specs = leading_inputs(n_comp, layer, group_heads(q, heads, rows), splits,
                                    pages)
    if rotated:
        in_specs.append(pl.BlockSpec((None, head_dim, head_dim), lambda b, h, j: (h, 0, 0)))
        args.append(rotation.astype(OPERAND))
    shared = pages is not None
    code_spec = stacked_spec(layers, slots_total, k_codes.shape[4], heads=heads,
                             shared=shared)
    meta_spec = stacked_spec(layers, slots_total, heads=heads, shared=shared)
    for codes, scale, zero in ((k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero)):
        present = [(codes, code_spec), (scale, meta_spec)]
        if offset is None:
            present.append((zero, meta_spec))
        args += [a for a, _ in present]
        in_specs += [spec for _, spec in present]
    o, m, l = decode_call(kernel, args, in_specs, batch=batch, heads=kv_heads // heads,
                          splits=splits, rows=rows, head_dim=head_dim, num_warps=num_warps,
                          num_stages=num_stages, interpret=interpret,
                          name="int_decode_attention")
    o, m, l = (ungroup_rows(a, heads, group) for a in (o, m, l))
    return o[..., np.argsort(perm)], m, l
