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
and one exact float16 subtraction leaves ``c``. The query's columns are permuted to the
dims the planes hold (:func:`unit_permutation`) and the output's back, outside the
loop. "bytes" reads 8-bit units and converts them (``8 / bits`` matmuls, kept to
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
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.partial import NEG

#: the smallest matrix-instruction tile edge of the Triton lowering
MIN_DOT = 16
#: matmul operand type: codes (< 2**8) are exact in it, and its 10-bit mantissa keeps
#: the rounded query and probabilities within ~5e-4 relative (bfloat16: ~4e-3) at the
#: same tensor-core speed; accumulation is float32
OPERAND = jnp.float16
#: code units the packed words are read in, and their width in bits
LAYOUTS = {"halves": 16, "bytes": 8}
#: float16 bit pattern of 1024.0: OR-ing a code c < 1024 into its mantissa gives 1024 + c
F16_1024 = 0x6400


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
        _unit_bits(self.layout)


def pad_query_rows(q: jax.Array, width: int) -> jax.Array:
    """``q [B, K, G, D]`` zero-padded to the power-of-two row count the kernel needs:
    at least 16 when its matmul operands are ``width >= 16`` columns wide (the smallest
    matrix-instruction tile), else just the next power of two (broadcast path)."""
    group = q.shape[2]
    rows = max(MIN_DOT, group) if width >= MIN_DOT else group
    rows = 1 << (rows - 1).bit_length()
    return jnp.pad(q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))


def _unit_bits(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {layout!r}")
    return LAYOUTS[layout]


def operand_width(head_dim: int, bits: int, layout: str = "halves") -> int:
    """Columns of one matmul operand: code units per token (``D * bits / unit``)."""
    return head_dim * bits // _unit_bits(layout)


def unit_view(codes: jax.Array, layout: str = "halves") -> jax.Array:
    """``uint32[..., W]`` packed words as their little-endian 16- or 8-bit units."""
    unit = _unit_bits(layout)
    dtype = jnp.uint16 if unit == 16 else jnp.uint8
    b = jax.lax.bitcast_convert_type(codes, dtype)
    return b.reshape(*codes.shape[:-1], (32 // unit) * codes.shape[-1])


def unit_permutation(head_dim: int, bits: int, layout: str = "halves") -> np.ndarray:
    """Which dim each kernel column holds when planar words are read in units.

    Word ``w`` slot ``i`` holds dim ``i * W + w`` (:mod:`kvjax.primitives.packing`); unit ``k`` of
    the word holds slots ``k * c .. k * c + c - 1`` (``c = unit / bits`` codes per unit).
    Column ``j * nu + u`` (bit plane ``j`` of unit ``u = (32 / unit) w + k``, ``nu``
    units per token) is therefore dim ``(k * c + j) * W + w``.
    """
    unit = _unit_bits(layout)
    words = head_dim * bits // 32
    per_unit, per_word = unit // bits, 32 // unit
    u = np.arange(per_word * words)
    w, k = u // per_word, u % per_word
    return np.concatenate([(k * per_unit + j) * words + w for j in range(per_unit)])


def _plane(tile: jax.Array, j: int, bits: int, asm: bool) -> jax.Array:
    """Bit plane ``j`` of a tile of code units as float16 codes.

    ``asm``: 16-bit units two at a time in one 32-bit register, so a shift, one
    ``lop3`` and one ``sub.f16x2`` make two codes (the same arithmetic as the jnp path,
    which Triton would run one 16-bit unit per instruction). Compiled only (interpret
    mode has no PTX).
    """
    mask = (1 << bits) - 1
    if asm and tile.dtype == jnp.uint16:
        code = (
            "{ .reg .b32 t, b; "
            f"shr.b32 t, $1, {j * bits}; "
            f"lop3.b32 t, t, {mask | mask << 16:#010x}, {F16_1024 * 0x10001:#010x}, 0xea; "
            f"mov.b32 b, {F16_1024 * 0x10001:#010x}; "
            "sub.rn.f16x2 $0, t, b; }"
        )
        [out] = plgpu.elementwise_inline_asm(
            code, args=[tile], constraints="=r,r", pack=2,
            result_shape_dtypes=[jax.ShapeDtypeStruct(tile.shape, OPERAND)])
        return out
    shifted = tile >> jnp.asarray(j * bits, tile.dtype) if j else tile
    if tile.dtype == jnp.uint16:
        biased = (shifted & jnp.asarray(mask, tile.dtype)) | jnp.asarray(F16_1024, tile.dtype)
        return jax.lax.bitcast_convert_type(biased, OPERAND) - jnp.asarray(1024, OPERAND)
    return (shifted & jnp.asarray(mask, tile.dtype)).astype(OPERAND)


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [M, K] @ b[N, K]^T`` in float32 from float16 operands."""
    if min(a.shape[0], a.shape[1], b.shape[0]) >= MIN_DOT:
        return plgpu.dot(a, b, trans_b=True)
    return jnp.sum(a.astype(jnp.float32)[:, None, :] * b.astype(jnp.float32)[None, :, :],
                   axis=-1)


def _dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [M, K] @ b[K, N]`` in float32 from float16 operands."""
    if min(a.shape[0], a.shape[1], b.shape[1]) >= MIN_DOT:
        return plgpu.dot(a, b)
    return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None, :, :],
                   axis=1)


def _kernel(n_ref, layer_ref, q_ref, *refs, bits, width, block_s, split_len, sm_scale,
            rotated, asm):
    if rotated:
        rot_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, o_ref, m_ref, l_ref = refs
    else:
        kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, o_ref, m_ref, l_ref = refs
    planes = 8 * jnp.dtype(kc_ref.dtype).itemsize // bits
    rows = q_ref.shape[0]

    # the query, one [rows, width] column slot per plane (rotated for SAW keys)
    if rotated:
        # float16 operands like every other matmul here: the rotated query is rounded
        # to float16 right after anyway, and a float32 product costs several passes
        q = q_ref[...].astype(OPERAND)
        q_slots = [_dot_nt(q, rot_ref[pl.ds(j * width, width), :]) for j in range(planes)]
    else:
        q_slots = [q_ref[:, pl.ds(j * width, width)] for j in range(planes)]
    q_slots = [qj.astype(OPERAND) for qj in q_slots]
    q_sum = sum(jnp.sum(qj.astype(jnp.float32), axis=1) for qj in q_slots)

    n = n_ref[0]
    layer = layer_ref[0]
    start = pl.program_id(2) * split_len
    stop = jnp.minimum(start + split_len, n)
    full = jnp.maximum(stop - start, 0) // block_s

    def body(i, carry, masked):
        o_slots, o_zero, m_prev, l_prev = carry
        t0 = start + i * block_s
        tile = pl.ds(t0, block_s)
        if masked:
            ok = (t0 + jnp.arange(block_s)) < stop

            def load(ref, two_d=False):
                return plgpu.load(ref.at[layer, tile, :] if two_d else ref.at[layer, tile],
                                  mask=ok[:, None] if two_d else ok, other=0)
        else:
            def load(ref, two_d=False):
                return ref[layer, tile, :] if two_d else ref[layer, tile]

        kc = load(kc_ref, two_d=True)
        ks = load(ks_ref).astype(jnp.float32)
        kz = load(kz_ref).astype(jnp.float32)
        dots = None
        for j in range(planes):
            d = _dot_nt(q_slots[j], _plane(kc, j, bits, asm))
            dots = d if dots is None else dots + d
        s = (dots * ks[None, :] + q_sum[:, None] * kz[None, :]) * sm_scale
        if masked:
            s = jnp.where(ok[None, :], s, NEG)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])
        if masked:
            p = jnp.where(ok[None, :], p, 0.0)
        l_next = l_prev * correction + jnp.sum(p, axis=1)

        vc = load(vc_ref, two_d=True)
        vs = load(vs_ref).astype(jnp.float32)
        vz = load(vz_ref).astype(jnp.float32)
        pv = (p * vs[None, :]).astype(OPERAND)
        o_zero = o_zero * correction + jnp.sum(p * vz[None, :], axis=1)
        out = tuple(o_slots[j] * correction[:, None] + _dot_nn(pv, _plane(vc, j, bits, asm))
                    for j in range(planes))
        return out, o_zero, m_next, l_next

    init = (
        tuple(jnp.zeros((rows, width), jnp.float32) for _ in range(planes)),
        jnp.zeros((rows,), jnp.float32),
        jnp.full((rows,), NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    # whole blocks without masks, then the partial last block (if any) with them; a
    # cache shorter than one block has no whole block (and no unmasked tile shape)
    if kc_ref.shape[1] >= block_s:
        carry = jax.lax.fori_loop(0, full, functools.partial(body, masked=False), init)
    else:
        carry, full = init, jnp.zeros_like(full)
    tail = full + (start + full * block_s < stop).astype(full.dtype)
    o_slots, o_zero, m, l = jax.lax.fori_loop(full, tail, functools.partial(body, masked=True),
                                              carry)
    # every value is zero + scale * code: the zeros' share is the same in every column
    o_slots = [o + o_zero[:, None] for o in o_slots]
    for j in range(planes):
        o_ref[:, pl.ds(j * width, width)] = o_slots[j]
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=("bits", "sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret", "research"),
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
    D]``, ``m, l [B, K, splits, R]`` (float32), one partial per split. A SAW
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
            a[None] for a in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero))
        layer = 0
    layers = k_codes.shape[0]
    slots_total = k_codes.shape[3]
    split_len = pl.cdiv(pl.cdiv(slots_total, splits), block_s) * block_s
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
        _kernel, bits=bits, width=width, block_s=block_s, split_len=split_len,
        sm_scale=sm_scale, rotated=rotated, asm=not interpret and research.asm,
    )
    row = lambda b, h, j: (b,)
    per_head_2d = lambda b, h, j: (b, h, 0, 0)
    in_specs = [
        pl.BlockSpec((1,), row),
        pl.BlockSpec((1,), lambda b, h, j: (0,)),
        pl.BlockSpec((None, None, rows, head_dim), per_head_2d),
    ]
    args = [n_comp.astype(jnp.int32), jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
            q.astype(jnp.float32)]
    if rotated:
        in_specs.append(pl.BlockSpec((None, head_dim, head_dim), lambda b, h, j: (h, 0, 0)))
        args.append(rotation.astype(OPERAND))
    code_spec = pl.BlockSpec((layers, None, None, slots_total, k_codes.shape[4]),
                             lambda b, h, j: (0, b, h, 0, 0))
    meta_spec = pl.BlockSpec((layers, None, None, slots_total), lambda b, h, j: (0, b, h, 0))
    in_specs += [code_spec, meta_spec, meta_spec, code_spec, meta_spec, meta_spec]
    args += [k_codes, k_scale, k_zero, v_codes, v_scale, v_zero]
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, splits, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, splits, rows), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, splits, rows), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, j: (b, h, j, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, j: (b, h, j, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, j: (b, h, j, 0)),
    ]
    o, m, l = pl.pallas_call(
        kernel,
        grid=(batch, heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="int_decode_attention",
    )(*args)
    o = o[..., np.argsort(perm)]
    return o, m, l
