"""The array-level entry of the codebook decode-attention kernel: :func:`codebook_decode`.

One decode query per row attends to rotated scalar-codebook keys (TurboQuant-MSE, and
TurboQuant-QJL's estimator) and group-wise INT values: arrays in (packed codes, fp16
norms, scales and zeros, per-row token counts, the rotation's signs and the QJL sketch),
the partial softmax ``(o, m, l)`` over the coded tokens out
(:mod:`pallas_kernels.partial`). The entry owns the whole pipeline: checks, the query's
rotation and sketch (once per call, by XLA), its column order and row padding, the
blocking, the ``pallas_call`` (:func:`.kernel.codes_partial`) and the exact merge of the
splits. :func:`.reference.codebook_decode` has the same signature and is the
specification.

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query rows per kv head, ``S`` code
slots, ``W`` uint32 words per token, ``n`` channel groups of a value, ``D`` head dim,
``L`` layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.primitives.rotations import random_signs, randomized_hadamard
from pallas_kernels import group_values
from pallas_kernels.codebook_decode.kernel import codes_partial
from pallas_kernels.flash import NUM_WARPS, default_blocking, default_splits, pad_query_rows
from pallas_kernels.partial import EXACT, empty_partial, merge_partials
from pallas_kernels.units import code_layout

#: key code widths the kernel reads: at most 8 magnitudes fit its register lookup
KEY_BITS = (1, 2, 3, 4)
#: the smallest head dim: 1-bit planes and split 3-bit codes fill whole words
MIN_HEAD_DIM = 32


def unsupported(head_dim: int, value_bits: int, value_group: int, *, key_bits: int,
                **_) -> str | None:
    """Why the kernel cannot read these codes (None: it can); the keyword arguments are
    the entry's key options (:meth:`kvjax.codec.CodebookFormat.options`)."""
    if key_bits not in KEY_BITS:
        return (f"{key_bits}-bit key codes: the register lookup holds at most 8 magnitudes "
                f"(key bits {KEY_BITS})")
    if head_dim < MIN_HEAD_DIM or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= {MIN_HEAD_DIM}"
    return group_values.unsupported(value_bits, value_group, head_dim)


def check_arrays(q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer, k_signs,
                 k_qjl, k_residual_norm, qjl_sketch, key_bits, magnitudes, value_bits,
                 value_group) -> None:
    """The checks of :func:`codebook_decode` (and of its reference):
    ``NotImplementedError`` where the kernel cannot serve the arrays, ``ValueError``
    where they are malformed."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, K, G, D], got shape {q.shape}")
    batch, heads, _, head_dim = q.shape
    reason = unsupported(head_dim, value_bits, value_group, key_bits=key_bits)
    if reason is not None:
        raise NotImplementedError(f"codebook_decode: {reason}")
    if len(magnitudes) != 1 << (key_bits - 1):
        raise ValueError(f"{key_bits}-bit sign-magnitude codes need "
                         f"{1 << (key_bits - 1)} magnitudes, got {len(magnitudes)}")
    lead = 5 if layer is not None else 4
    stack = "[L, B, K, S, ...]" if layer is not None else "[B, K, S, ...]"
    k_words = key_bits * head_dim // 32
    tokens = k_codes.shape[:-1]
    if (k_codes.ndim != lead or tokens[-3:-1] != (batch, heads)
            or k_codes.shape[-1] != k_words):
        raise ValueError(f"k_codes must be {stack} with B, K = {batch}, {heads} and "
                         f"{k_words} words, got shape {k_codes.shape}")
    group_values.check_arrays(v_codes, v_scale, v_zero, tokens, head_dim, value_bits,
                              value_group)
    shapes = [("k_norm", k_norm, tokens), ("lengths", lengths, (batch,))]
    qjl = [k_qjl is None, k_residual_norm is None, qjl_sketch is None]
    if any(qjl) and not all(qjl):
        raise ValueError("k_qjl, k_residual_norm and qjl_sketch come together")
    if not any(qjl):
        shapes += [("k_qjl", k_qjl, (*tokens, head_dim // 32)),
                   ("k_residual_norm", k_residual_norm, tokens),
                   ("qjl_sketch", qjl_sketch, (heads, head_dim, head_dim))]
    if k_signs is not None:
        shapes.append(("k_signs", k_signs, (heads, head_dim)))
    for name, a, shape in shapes:
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    for name, a in (("k_codes", k_codes), ("k_qjl", k_qjl)):
        if a is not None and a.dtype != jnp.uint32:
            raise ValueError(f"{name} must be uint32 packed words, got {a.dtype}")


def query_sides(q: jax.Array, k_signs: jax.Array | None,
                qjl_sketch: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """``(R q, G q)`` of ``q [B, K, G, D]`` in float32: the query in the keys' rotated
    space (``R`` the randomized Hadamard rotation of ``k_signs [K, D]``; ``q`` itself
    without signs) and, with a sketch ``G [K, D, D]``, its QJL projection (else None)."""
    q = q.astype(jnp.float32)
    q_rot = q if k_signs is None else randomized_hadamard(q, k_signs[None, :, None, :])
    gq = None
    if qjl_sketch is not None:
        gq = jnp.einsum("bkgd,ked->bkge", q, qjl_sketch.astype(jnp.float32), precision=EXACT)
    return q_rot, gq


@functools.partial(
    jax.jit,
    static_argnames=("key_bits", "magnitudes", "value_bits", "value_group", "sm_scale",
                     "block_s", "splits", "num_warps", "num_stages", "interpret"),
)
def codebook_decode(
    q: jax.Array,        # [B, K, G, D] float: the query rows that read kv head k
    k_codes: jax.Array,  # uint32 [B, K, S, W] ([L, B, K, S, W] with layer)
    k_norm: jax.Array,   # [B, K, S] ([L, ...]) fp16: each key's norm
    v_codes: jax.Array,  # uint32 [B, K, S, Wv]: value codes, planar (split at 3 bits)
    v_scale: jax.Array,  # [B, K, S, n] fp16: per channel group
    v_zero: jax.Array,   # [B, K, S, n] fp16
    lengths: jax.Array,  # int32 [B]: coded tokens per row, the first lengths[b] of S
    layer: jax.Array | None = None,            # int32 []: the layer of stacked codes
    k_signs: jax.Array | None = None,          # [K, D] +-1: keys stored as H(s * k / |k|)
    k_qjl: jax.Array | None = None,            # uint32 [B, K, S, D / 32]: sign(G r)
    k_residual_norm: jax.Array | None = None,  # [B, K, S] fp16: |r|
    qjl_sketch: jax.Array | None = None,       # [K, D, D]: G
    *,
    key_bits: int,                    # sign-magnitude code width, 1..4
    magnitudes: tuple[float, ...],    # the codebook's 2^(key_bits-1) magnitudes
    value_bits: int,                  # 2, 4 or 8
    value_group: int,                 # channels per value scale and zero
    sm_scale: float,                  # logits are sm_scale * score
    block_s: int | None = None,       # tokens per block (default_blocking)
    splits: int | None = None,        # slices of S, one program each (default_splits)
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,    # pipeline stages (default_blocking)
    interpret: bool | None = None,    # Pallas interpret mode; default: off a GPU
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of the query rows over the first ``lengths[b]`` coded tokens.

    A key is ``|k| R^T y``: ``y``'s coordinates the codebook values ``(-1)^s
    magnitudes[m]`` of the sign-magnitude codes in ``k_codes`` (planar words; 3 bits in
    the split layout of :func:`kvjax.primitives.packing.pack_split`), ``R`` the
    randomized Hadamard rotation of ``k_signs``. With QJL arrays its score adds
    ``sqrt(pi / 2) / D * |r| * <G q, sign(G r)>``. A value is ``zero_g + scale_g * c``
    per group of ``value_group`` channels. Returns ``o [B, K, G, D]``, ``m [B, K, G]``,
    ``l [B, K, G]`` in float32; a row with no coded token gets ``o = 0, l = 0, m =
    NEG``. Raises ``NotImplementedError`` when the kernel cannot serve these arrays
    (:func:`unsupported`), ``ValueError`` when they are malformed.
    """
    check_arrays(q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer, k_signs, k_qjl,
                 k_residual_norm, qjl_sketch, key_bits, magnitudes, value_bits, value_group)
    batch, heads, group, head_dim = q.shape
    slots = k_codes.shape[-2]
    if slots == 0:
        return empty_partial(q)
    block_s, num_stages = default_blocking(block_s, num_stages)
    splits = splits or default_splits(batch, heads, slots, block_s, num_warps)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    q_rot, gq = query_sides(q, k_signs, qjl_sketch)
    _, planes, key_perm = code_layout(head_dim, key_bits)
    width = max(head_dim // planes, group_values.plane_width(head_dim, value_bits))
    q_rot = pad_query_rows(q_rot, width)[..., key_perm]
    if gq is not None:
        # the sign bits are 1-bit planar words, read as bytes
        gq = pad_query_rows(gq, width)[..., code_layout(head_dim, 1)[2]]
    o, m, l = codes_partial(
        q_rot, gq, k_codes, k_norm, k_qjl, k_residual_norm, v_codes, v_scale, v_zero,
        lengths, layer, key_bits=key_bits, magnitudes=magnitudes, value_bits=value_bits,
        value_group=value_group, sm_scale=sm_scale, block_s=block_s, splits=splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    o = group_values.restore_columns(o, head_dim, value_bits)
    return merge_partials((o[..., :group, :], m[..., :group], l[..., :group]), axis=2)


def random_inputs(key: jax.Array, *, batch: int, heads: int, group: int, slots: int,
                  head_dim: int, key_bits: int, value_bits: int, value_group: int = 32,
                  qjl: bool = False) -> dict[str, jax.Array]:
    """Random arguments of :func:`codebook_decode` for a shape (the static ones
    excepted): uniformly random packed words, fp16 norms, scales and zeros, seeded
    rotation signs (and a Gaussian sketch with ``qjl``), a normal query, every row full.
    The kernel's speed depends on the bytes, not the values: benchmarks time these."""
    keys = jax.random.split(key, 10)
    tokens = (batch, heads, slots)
    groups = head_dim // value_group

    def words(k, count):
        return jax.random.bits(k, (*tokens, count), jnp.uint32)

    def fp16(k, shape, scale):
        return (jax.random.uniform(k, shape) * scale).astype(jnp.float16)

    out = {
        "q": jax.random.normal(keys[0], (batch, heads, group, head_dim), jnp.float32),
        "k_codes": words(keys[1], key_bits * head_dim // 32),
        "k_norm": fp16(keys[2], tokens, 10.0),
        "v_codes": words(keys[3], value_bits * head_dim // 32),
        "v_scale": fp16(keys[4], (*tokens, groups), 0.1),
        "v_zero": fp16(keys[5], (*tokens, groups), -0.5),
        "lengths": jnp.full((batch,), slots, jnp.int32),
        "k_signs": jnp.stack([random_signs(k, head_dim)
                              for k in jax.random.split(keys[6], heads)]),
    }
    if qjl:
        out["k_qjl"] = words(keys[7], head_dim // 32)
        out["k_residual_norm"] = fp16(keys[8], tokens, 3.0)
        out["qjl_sketch"] = jax.random.normal(keys[9], (heads, head_dim, head_dim))
    return out
