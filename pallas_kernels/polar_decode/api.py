"""The array-level entry of the PolarQuant decode-attention kernel: :func:`polar_decode`.

One decode query per row attends to PolarQuant keys at full depth (every coordinate of
the rotated unit vector rebuilt from ``D - 1`` polar angles) and group-wise INT values:
arrays in (packed angle codes, fp16 norms, value codes, scales and zeros, per-row token
counts, the rotation's signs), the partial softmax ``(o, m, l)`` over the coded tokens
out (:mod:`pallas_kernels.partial`). The entry owns the whole pipeline: checks, the
query's rotation (once per call, by XLA), its column order and row padding, the
blocking, the ``pallas_call`` (:func:`.kernel.codes_partial`) and the exact merge of the
splits. :func:`.reference.polar_decode` has the same signature and is the specification.

The keys' options (:meth:`kvjax.codec.PolarFormat.options`) describe the codes fully:
``angle_bits`` ``B`` (``B + 1`` bits per level-1 angle, ``B - 1`` deeper), each level's
``centroids`` and each angle's bit ``offsets`` in a token's words; the kernel plans its
reads from the offsets (:func:`.kernel.plan`) and refuses a layout it cannot read.

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query rows per kv head, ``S`` code
slots, ``W`` uint32 words per token, ``n`` channel groups of a value, ``D`` head dim,
``L`` layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.primitives.rotations import random_signs
from pallas_kernels import group_values
from pallas_kernels.codebook_decode.api import query_sides
from pallas_kernels.flash import (
    MIN_DOT,
    NUM_WARPS,
    default_blocking,
    default_splits,
    pad_query_rows,
)
from pallas_kernels.partial import empty_partial, merge_partials
from pallas_kernels.polar_decode.kernel import codes_partial, plan, query_columns, uniform_error

#: nominal angle widths ``B`` the kernel reads: a level's cosines and sines are select
#: chains over at most 8 values
ANGLE_BITS = (1, 2, 3, 4)
#: the smallest head dim: 16 columns of at least one level-1 pair each
MIN_HEAD_DIM = 32
#: how far the level-1 lookup (uniform centroids) may stray from the centroids' own
#: cosines and sines: far below the float16 operands' rounding
UNIFORM_TOLERANCE = 1e-6


def _reason(head_dim: int, value_bits: int, value_group: int, angle_bits: int,
            offsets) -> str | None:
    if offsets is None:
        return ("the angle codes are one dense stream (below full depth, or no column "
                "layout at this head_dim and width)")
    if angle_bits not in ANGLE_BITS:
        return (f"{angle_bits}-bit angles: the lookups are select chains over at most 8 "
                f"values (angle bits {ANGLE_BITS})")
    if head_dim < MIN_HEAD_DIM or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= {MIN_HEAD_DIM}"
    return group_values.unsupported(value_bits, value_group, head_dim)


def _malformed(head_dim: int, angle_bits: int, centroids, offsets) -> str | None:
    levels = head_dim.bit_length() - 1
    if len(centroids) != levels:
        return f"{levels} levels of centroids at head_dim {head_dim}, got {len(centroids)}"
    sizes = [1 << (angle_bits + 1)] + [1 << max(angle_bits - 1, 0)] * (levels - 1)
    for level, (c, size) in enumerate(zip(centroids, sizes, strict=True), start=1):
        if len(c) != size:
            return f"level {level} has {size} centroids at {angle_bits} bits, got {len(c)}"
    if len(offsets) != head_dim - 1:
        return f"{head_dim - 1} angle offsets at head_dim {head_dim}, got {len(offsets)}"
    return None


def _layout_reason(head_dim: int, angle_bits: int, centroids, offsets) -> str | None:
    layout = plan(head_dim, angle_bits, tuple(offsets))
    if isinstance(layout, str):
        return f"layout: {layout}"
    error = uniform_error(tuple(centroids[0]))
    if error > UNIFORM_TOLERANCE:
        return (f"the level-1 centroids are not uniform on [0, 2 pi) (cosines off by "
                f"{error:.1e})")
    return None


def unsupported(head_dim: int, value_bits: int, value_group: int, *, angle_bits: int,
                centroids: tuple[tuple[float, ...], ...], offsets: tuple[int, ...] | None,
                **_) -> str | None:
    """Why the kernel cannot read these codes (None: it can); the keyword arguments are
    the entry's key options (:meth:`kvjax.codec.PolarFormat.options`). Malformed options
    are left to :func:`check_arrays` (a ``ValueError``)."""
    reason = _reason(head_dim, value_bits, value_group, angle_bits, offsets)
    if reason is not None or _malformed(head_dim, angle_bits, centroids, offsets):
        return reason
    return _layout_reason(head_dim, angle_bits, centroids, offsets)


def check_arrays(q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer, k_signs,
                 k_qjl, k_residual_norm, qjl_sketch, angle_bits, centroids, offsets,
                 value_bits, value_group) -> None:
    """The checks of :func:`polar_decode` (and of its reference): ``NotImplementedError``
    where the kernel cannot serve the arrays, ``ValueError`` where they are malformed."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, K, G, D], got shape {q.shape}")
    batch, heads, _, head_dim = q.shape
    reason = _reason(head_dim, value_bits, value_group, angle_bits, offsets)
    if reason is None and any(a is not None for a in (k_qjl, k_residual_norm, qjl_sketch)):
        reason = "PolarQuant keys have no QJL residual term"
    if reason is not None:
        raise NotImplementedError(f"polar_decode: {reason}")
    problem = _malformed(head_dim, angle_bits, centroids, offsets)
    if problem is not None:
        raise ValueError(f"polar_decode: {problem}")
    reason = _layout_reason(head_dim, angle_bits, centroids, offsets)
    if reason is not None:
        raise NotImplementedError(f"polar_decode: {reason}")
    lead = 5 if layer is not None else 4
    stack = "[L, B, K, S, ...]" if layer is not None else "[B, K, S, ...]"
    k_words = angle_bits * head_dim // 32
    tokens = k_codes.shape[:-1]
    if (k_codes.ndim != lead or tokens[-3:-1] != (batch, heads)
            or k_codes.shape[-1] != k_words):
        raise ValueError(f"k_codes must be {stack} with B, K = {batch}, {heads} and "
                         f"{k_words} words, got shape {k_codes.shape}")
    if k_codes.dtype != jnp.uint32:
        raise ValueError(f"k_codes must be uint32 packed words, got {k_codes.dtype}")
    group_values.check_arrays(v_codes, v_scale, v_zero, tokens, head_dim, value_bits,
                              value_group)
    shapes = [("k_norm", k_norm, tokens), ("lengths", lengths, (batch,))]
    if k_signs is not None:
        shapes.append(("k_signs", k_signs, (heads, head_dim)))
    for name, a, shape in shapes:
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {a.shape}")


@functools.partial(
    jax.jit,
    static_argnames=("angle_bits", "centroids", "offsets", "value_bits", "value_group",
                     "sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret"),
)
def polar_decode(
    q: jax.Array,        # [B, K, G, D] float: the query rows that read kv head k
    k_codes: jax.Array,  # uint32 [B, K, S, W] ([L, B, K, S, W] with layer), W = D B / 32
    k_norm: jax.Array,   # [B, K, S] ([L, ...]) fp16: each key's norm
    v_codes: jax.Array,  # uint32 [B, K, S, Wv]: value codes, planar (split at 3 bits)
    v_scale: jax.Array,  # [B, K, S, n] fp16: per channel group
    v_zero: jax.Array,   # [B, K, S, n] fp16
    lengths: jax.Array,  # int32 [B]: coded tokens per row, the first lengths[b] of S
    layer: jax.Array | None = None,            # int32 []: the layer of stacked codes
    k_signs: jax.Array | None = None,          # [K, D] +-1: keys stored as H(s * k / |k|)
    k_qjl: jax.Array | None = None,            # no QJL variant: must be None
    k_residual_norm: jax.Array | None = None,  # must be None
    qjl_sketch: jax.Array | None = None,       # must be None
    *,
    angle_bits: int,                            # B: level 1 B + 1 bits, deeper B - 1
    centroids: tuple[tuple[float, ...], ...],   # each level's centroids, level 1 first
    offsets: tuple[int, ...],                   # each angle's bit in a token's words
    value_bits: int,                  # 2, 3, 4 or 8
    value_group: int,                 # channels per value scale and zero
    sm_scale: float,                  # logits are sm_scale * score
    block_s: int | None = None,       # tokens per block (default_blocking)
    splits: int | None = None,        # slices of S, one program each (default_splits)
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,    # pipeline stages (default_blocking)
    interpret: bool | None = None,    # Pallas interpret mode; default: off a GPU
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of the query rows over the first ``lengths[b]`` coded tokens.

    A key is ``|k| R^T y``: ``y`` the unit vector of ``D - 1`` polar angles, angle ``a``
    (level order: level 1's ``D / 2`` first, the top angle last) the centroid of the
    code at bit ``offsets[a]`` of the token's words (``-1``: a level of no bits, its one
    centroid), ``y[2j] = r_j cos phi_j``, ``y[2j + 1] = r_j sin phi_j`` with ``r_j`` the
    product of the cosines (left child) and sines (right child) of ``j``'s ancestors;
    ``R`` the randomized Hadamard rotation of ``k_signs``. A value is ``zero_g + scale_g
    * c`` per group of ``value_group`` channels. Returns ``o [B, K, G, D]``, ``m [B, K,
    G]``, ``l [B, K, G]`` in float32; a row with no coded token gets ``o = 0, l = 0, m =
    NEG``. Raises ``NotImplementedError`` when the kernel cannot serve these arrays
    (:func:`unsupported`), ``ValueError`` when they are malformed.
    """
    check_arrays(q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer, k_signs,
                 k_qjl, k_residual_norm, qjl_sketch, angle_bits, centroids, offsets,
                 value_bits, value_group)
    batch, heads, group, head_dim = q.shape
    slots = k_codes.shape[-2]
    if slots == 0:
        return empty_partial(q)
    block_s, num_stages = default_blocking(block_s, num_stages)
    splits = splits or default_splits(batch, heads, slots, block_s, num_warps)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    q_rot, _ = query_sides(q, k_signs, None)
    width = max(MIN_DOT, group_values.plane_width(head_dim, value_bits))
    q_rot = pad_query_rows(q_rot, width)[..., query_columns(head_dim)]
    o, m, l = codes_partial(
        q_rot, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer,
        angle_bits=angle_bits, centroids=centroids, offsets=offsets, value_bits=value_bits,
        value_group=value_group, sm_scale=sm_scale, block_s=block_s, splits=splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    o = group_values.restore_columns(o, head_dim, value_bits)
    return merge_partials((o[..., :group, :], m[..., :group], l[..., :group]), axis=2)


def random_inputs(key: jax.Array, *, batch: int, heads: int, group: int, slots: int,
                  head_dim: int, angle_bits: int, value_bits: int,
                  value_group: int = 32) -> dict[str, jax.Array]:
    """Random array arguments of :func:`polar_decode` for a shape: uniformly random
    packed words, fp16 norms, scales and zeros, seeded rotation signs, a normal query,
    every row full. The kernel's speed depends on the bytes, not the values: benchmarks
    time these."""
    keys = jax.random.split(key, 7)
    tokens = (batch, heads, slots)
    groups = head_dim // value_group

    def fp16(k, shape, scale):
        return (jax.random.uniform(k, shape) * scale).astype(jnp.float16)

    return {
        "q": jax.random.normal(keys[0], (batch, heads, group, head_dim), jnp.float32),
        "k_codes": jax.random.bits(keys[1], (*tokens, angle_bits * head_dim // 32),
                                   jnp.uint32),
        "k_norm": fp16(keys[2], tokens, 10.0),
        "v_codes": jax.random.bits(keys[3], (*tokens, value_bits * head_dim // 32),
                                   jnp.uint32),
        "v_scale": fp16(keys[4], (*tokens, groups), 0.1),
        "v_zero": fp16(keys[5], (*tokens, groups), -0.5),
        "lengths": jnp.full((batch,), slots, jnp.int32),
        "k_signs": jnp.stack([random_signs(k, head_dim)
                              for k in jax.random.split(keys[6], heads)]),
    }
