"""Pallas kernel: decode attention read straight from packed INT-N codes (flash-decoding).

Grid ``(B, K, splits)``: one program per (row, kv head, slice of the cache). A program
holds *all* query heads of its kv head (GQA: every code word is read once, not once per
query head), walks its slice in blocks of ``block_s`` tokens with an online softmax, and
writes a partial ``(o, m, l)`` that :func:`reference.merge_partials` combines exactly
across slices and with the raw regions of the cache.

Codes are read as they are stored and never dequantized elementwise. With
``q . k_hat = scale * (q . c) + zero * sum(q)`` and the output
``sum_s p_s (zero_s + scale_s c_s)``, the integer codes go straight into float16
matmuls (exact below ``2**11``). The packed uint32 words are read as bytes
(``LAYOUTS``: "bytes", the default): bit plane ``j`` of a ``[block_s, D * bits / 8]``
byte tile, one shift and mask away, is a full-width operand, so a block costs
``8 / bits`` matmuls per role; the query's columns are permuted to the dims those
planes hold (:func:`byte_permutation`) and the output's back, outside the loop. Reading
whole uint32 words ("words") instead gives ``32 / bits`` matmuls of ``W`` columns per
role and measured 3.6x slower on the H200 (docs/kernels.md). No value is ever sliced,
gathered or concatenated inside the kernel (the Triton lowering supports none of these):
the query is consumed in column slices of its ref.

For SAW keys the query is rotated inside the kernel (``q R^T`` one slot of columns at a
time, from the ``[D, D]`` matrix of its kv head), so the rotated keys are never
un-rotated and no separate pass touches the query.

Operands of the dots are float16 (``OPERAND``), accumulation float32; the reference
is exact float32, and the tests state the tolerance. Dots of fewer than 16 columns
(the "words" layout of INT4 at head dim 64) are too narrow for Triton's matrix
instructions and run as broadcast multiply-adds in float32 on the same float16-rounded
operands.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG = float(jnp.finfo(jnp.float32).min)
#: the smallest matrix-instruction tile edge of the Triton lowering
MIN_DOT = 16
#: matmul operand type: codes (< 2**8) are exact in it, and its 10-bit mantissa keeps
#: the rounded query and probabilities within ~5e-4 relative (bfloat16: ~4e-3) at the
#: same tensor-core speed; accumulation is float32
OPERAND = jnp.float16
#: "bytes": the packed words read as bytes (``8 / bits`` matmuls of ``D * bits / 8``
#: columns per block); "words": as uint32 (``32 / bits`` matmuls of ``W`` columns)
LAYOUTS = ("bytes", "words")


def pad_query_rows(q: jax.Array, width: int) -> jax.Array:
    """``q [B, K, G, D]`` zero-padded to the power-of-two row count the kernel needs:
    at least 16 when its matmul operands are ``width >= 16`` columns wide (the smallest
    matrix-instruction tile), else just the next power of two (broadcast path)."""
    group = q.shape[2]
    rows = max(MIN_DOT, group) if width >= MIN_DOT else group
    rows = 1 << (rows - 1).bit_length()
    return jnp.pad(q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))


def operand_width(head_dim: int, bits: int, layout: str) -> int:
    """Columns of one matmul operand: bytes (``D * bits / 8``) or words per token."""
    return head_dim * bits // (8 if layout == "bytes" else 32)


def byte_view(codes: jax.Array) -> jax.Array:
    """``uint32[..., W]`` packed words as ``uint8[..., 4 W]`` (little-endian bytes)."""
    b = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    return b.reshape(*codes.shape[:-1], 4 * codes.shape[-1])


def byte_permutation(head_dim: int, bits: int) -> np.ndarray:
    """Which dim each kernel column holds when planar words are read as bytes.

    Word ``w`` slot ``i`` holds dim ``i * W + w`` (:mod:`kvjax.packing`); byte ``k`` of
    the word holds slots ``k * c .. k * c + c - 1`` (``c = 8 / bits`` codes per byte).
    Column ``j * nb + b`` (bit plane ``j`` of byte ``b = 4 w + k``, ``nb = 4 W``) is
    therefore dim ``(k * c + j) * W + w``.
    """
    words = head_dim * bits // 32
    per_byte = 8 // bits
    nb = 4 * words
    b = np.arange(nb)
    w, k = b // 4, b % 4
    return np.concatenate([(k * per_byte + j) * words + w for j in range(per_byte)])


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [M, K] @ b[N, K]^T`` in float32 from float16 operands."""
    if min(a.shape[0], a.shape[1], b.shape[0]) >= MIN_DOT:
        return plgpu.dot(a.astype(OPERAND), b.astype(OPERAND), trans_b=True)
    a32 = a.astype(OPERAND).astype(jnp.float32)
    b32 = b.astype(OPERAND).astype(jnp.float32)
    return jnp.sum(a32[:, None, :] * b32[None, :, :], axis=-1)


def _dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [M, K] @ b[K, N]`` in float32 from float16 operands."""
    if min(a.shape[0], a.shape[1], b.shape[1]) >= MIN_DOT:
        return plgpu.dot(a.astype(OPERAND), b.astype(OPERAND))
    a32 = a.astype(OPERAND).astype(jnp.float32)
    b32 = b.astype(OPERAND).astype(jnp.float32)
    return jnp.sum(a32[:, :, None] * b32[None, :, :], axis=1)


def _kernel(n_ref, q_ref, *refs, bits, words, block_s, split_len, sm_scale, rotated):
    if rotated:
        rot_ref, kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, o_ref, m_ref, l_ref = refs
    else:
        kc_ref, ks_ref, kz_ref, vc_ref, vs_ref, vz_ref, o_ref, m_ref, l_ref = refs
    container = kc_ref.dtype
    slots = 8 * jnp.dtype(container).itemsize // bits
    mask = jnp.asarray((1 << bits) - 1, container)
    rows = q_ref.shape[0]

    # the query, one [rows, W] column slot at a time (rotated for SAW keys)
    if rotated:
        # float16 operands like every other matmul here: the rotated query is rounded
        # to float16 right after anyway, and a float32 product costs several passes
        q = q_ref[...]
        q_slots = [_dot_nt(q, rot_ref[pl.ds(j * words, words), :]) for j in range(slots)]
    else:
        q_slots = [q_ref[:, pl.ds(j * words, words)].astype(jnp.float32)
                   for j in range(slots)]
    q_slots = [qj.astype(OPERAND).astype(jnp.float32) for qj in q_slots]
    q_sum = sum(jnp.sum(qj, axis=1) for qj in q_slots)

    n = n_ref[0]
    start = pl.program_id(2) * split_len
    stop = jnp.minimum(start + split_len, n)
    trips = jnp.maximum(pl.cdiv(stop - start, block_s), 0)

    def body(i, carry):
        o_slots, m_prev, l_prev = carry
        t0 = start + i * block_s
        ok = (t0 + jnp.arange(block_s)) < stop
        tile = pl.ds(t0, block_s)
        kc = plgpu.load(kc_ref.at[tile, :], mask=ok[:, None], other=0)
        ks = plgpu.load(ks_ref.at[tile], mask=ok, other=0).astype(jnp.float32)
        kz = plgpu.load(kz_ref.at[tile], mask=ok, other=0).astype(jnp.float32)
        dots = None
        for j in range(slots):
            c = ((kc >> jnp.asarray(j * bits, container)) & mask).astype(jnp.float32)
            d = _dot_nt(q_slots[j], c)
            dots = d if dots is None else dots + d
        s = (dots * ks[None, :] + q_sum[:, None] * kz[None, :]) * sm_scale
        s = jnp.where(ok[None, :], s, NEG)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.where(ok[None, :], jnp.exp(s - m_next[:, None]), 0.0)
        l_next = l_prev * correction + jnp.sum(p, axis=1)

        vc = plgpu.load(vc_ref.at[tile, :], mask=ok[:, None], other=0)
        vs = plgpu.load(vs_ref.at[tile], mask=ok, other=0).astype(jnp.float32)
        vz = plgpu.load(vz_ref.at[tile], mask=ok, other=0).astype(jnp.float32)
        pv = p * vs[None, :]
        pz = jnp.sum(p * vz[None, :], axis=1)[:, None]
        out = []
        for j in range(slots):
            c = ((vc >> jnp.asarray(j * bits, container)) & mask).astype(jnp.float32)
            out.append(o_slots[j] * correction[:, None] + _dot_nn(pv, c) + pz)
        return tuple(out), m_next, l_next

    init = (
        tuple(jnp.zeros((rows, words), jnp.float32) for _ in range(slots)),
        jnp.full((rows,), NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    o_slots, m, l = jax.lax.fori_loop(0, trips, body, init)
    for j in range(slots):
        o_ref[:, pl.ds(j * words, words)] = o_slots[j]
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=("bits", "sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret", "layout"),
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
    *,
    bits: int,
    sm_scale: float,
    block_s: int = 64,
    splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    layout: str = "bytes",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-split partial softmaxes over the coded tokens (see the module docstring).

    Shapes as :func:`reference.codes_partial_reference`, except ``q [B, K, R, D]`` with
    ``R`` query rows per kv head already padded to what the kernel needs (a power of two,
    at least 16 when ``W >= 16``; :mod:`api` does this). Returns ``o [B, K, splits, R,
    D]``, ``m, l [B, K, splits, R]`` (float32).
    """
    batch, heads, rows, head_dim = q.shape
    slots_total = k_codes.shape[2]
    words = k_codes.shape[3]
    split_len = pl.cdiv(pl.cdiv(slots_total, splits), block_s) * block_s
    rotated = rotation is not None
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    perm = None
    if layout == "bytes":
        k_codes, v_codes = byte_view(k_codes), byte_view(v_codes)
        words = k_codes.shape[3]
        perm = byte_permutation(head_dim, bits)
        if rotation is not None:
            rotation = rotation[:, perm, :]
        else:
            q = q[..., perm]
    kernel = functools.partial(
        _kernel, bits=bits, words=words, block_s=block_s, split_len=split_len,
        sm_scale=sm_scale, rotated=rotated,
    )
    row = lambda b, h, j: (b,)
    per_head = lambda b, h, j: (b, h, 0)
    per_head_2d = lambda b, h, j: (b, h, 0, 0)
    in_specs = [
        pl.BlockSpec((1,), row),
        pl.BlockSpec((None, None, rows, head_dim), per_head_2d),
    ]
    args = [n_comp.astype(jnp.int32), q.astype(jnp.float32)]
    if rotated:
        in_specs.append(pl.BlockSpec((None, head_dim, head_dim), lambda b, h, j: (h, 0, 0)))
        args.append(rotation.astype(OPERAND))
    code_spec = pl.BlockSpec((None, None, slots_total, words), per_head_2d)
    meta_spec = pl.BlockSpec((None, None, slots_total), per_head)
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
    if perm is not None:
        o = o[..., np.argsort(perm)]
    return o, m, l
