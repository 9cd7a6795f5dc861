"""The array-level entry of the PolarQuant decode-attention kernel: :func:`polar_decode`.

One decode query per row attends to PolarQuant keys at full depth (every coordinate of
the rotated unit vector rebuilt from ``D - 1`` polar angles) and group-wise INT values:
arrays in (packed angle codes, fp16 norms, value codes, scales and zeros, per-row token
counts, the rotation's signs), the partial softmax ``(o, m, l)`` over the coded tokens
out (:mod:`pallas_kernels.partial`). The entry checks its keys' options and hands the
rest to the pipeline every kernel over rotated keys shares (:func:`pallas_kernels.
rotated.decode`), with how the kernel reads the codes (:func:`.kernel.reader`).
:func:`.reference.polar_decode` has the same signature and is the specification.

The keys' options (:meth:`kvjax.codec.PolarFormat.options`) describe the codes fully:
``angle_bits`` ``B`` (``B + 1`` bits per level-1 angle, ``B - 1`` deeper), each level's
``centroids`` and each angle's bit ``offsets`` in a token's words; the kernel plans its
reads from the offsets (:func:`.kernel.plan`) and refuses a layout it cannot read.

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query rows per kv head, ``S`` code
slots, ``W`` uint32 words per token, ``D`` head dim, ``L`` layers.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import rotated
from pallas_kernels.polar_decode.kernel import plan, reader, uniform_error

#: nominal angle widths ``B`` the kernel reads: a deeper level's cosines and sines are
#: register lookups of at most 8 entries, level 1's of up to 32 centroids folded onto 8
ANGLE_BITS = (1, 2, 3, 4)
#: the smallest head dim: 16 columns of at least one level-1 pair each
MIN_HEAD_DIM = 32
#: how far the level-1 lookup (folded where it assumes uniform centroids) may stray
#: from the centroids' own cosines and sines: far below its float16 tables' rounding
UNIFORM_TOLERANCE = 1e-6


def _reason(head_dim: int, value_bits: int, value_group: int, angle_bits: int,
            offsets) -> str | None:
    if offsets is None:
        return ("the angle codes are one dense stream (below full depth, or no column "
                "layout at this head_dim and width)")
    if angle_bits not in ANGLE_BITS:
        return (f"{angle_bits}-bit angles: the lookups read tables of at most 8 values "
                f"(angle bits {ANGLE_BITS})")
    return rotated.unsupported(head_dim, value_bits, value_group, MIN_HEAD_DIM)


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
    are left to :func:`key_reader` (a ``ValueError``)."""
    reason = _reason(head_dim, value_bits, value_group, angle_bits, offsets)
    if reason is not None or _malformed(head_dim, angle_bits, centroids, offsets):
        return reason
    return _layout_reason(head_dim, angle_bits, centroids, offsets)


def key_reader(q: jax.Array, angle_bits: int, centroids: tuple[tuple[float, ...], ...],
               offsets: tuple[int, ...] | None, value_bits: int, value_group: int,
               qjl_arrays: tuple) -> rotated.KeyReader:
    """The kernel's reader of these keys for the query rows ``q``, after the checks of
    :func:`polar_decode` (and of its reference) that concern the key options and the
    QJL arrays (``(k_qjl, k_residual_norm, qjl_sketch)``, all None):
    ``NotImplementedError`` where the kernel cannot read the codes, ``ValueError`` where
    the options are malformed."""
    head_dim = rotated.head_dim_of(q)
    reason = _reason(head_dim, value_bits, value_group, angle_bits, offsets)
    if reason is None and any(a is not None for a in qjl_arrays):
        reason = "PolarQuant keys have no QJL residual term"
    if reason is not None:
        raise NotImplementedError(f"polar_decode: {reason}")
    problem = _malformed(head_dim, angle_bits, centroids, offsets)
    if problem is not None:
        raise ValueError(f"polar_decode: {problem}")
    reason = _layout_reason(head_dim, angle_bits, centroids, offsets)
    if reason is not None:
        raise NotImplementedError(f"polar_decode: {reason}")
    return reader(head_dim, angle_bits, centroids, offsets)


def random_inputs(key: jax.Array, *, batch: int, heads: int, group: int, slots: int,
                  head_dim: int, angle_bits: int, value_bits: int,
                  value_group: int = 32) -> dict[str, jax.Array]:
    """Random array arguments of :func:`polar_decode` for a shape:
    :func:`pallas_kernels.rotated.random_inputs` with ``angle_bits * D / 32`` words of
    angle codes per token."""
    return rotated.random_inputs(key, batch=batch, heads=heads, group=group, slots=slots,
                                 head_dim=head_dim, key_words=angle_bits * head_dim // 32,
                                 value_bits=value_bits, value_group=value_group)


@functools.partial(jax.jit, static_argnames=("angle_bits", "centroids", "offsets",
                                             *rotated.STATIC_ARGNAMES))
def polar_decode(
    q: jax.Array, k_codes: jax.Array, k_norm: jax.Array, v_codes: jax.Array,
    v_scale: jax.Array, v_zero: jax.Array, lengths: jax.Array, layer: jax.Array | None = None,
    k_signs: jax.Array | None = None, k_qjl: jax.Array | None = None,
    k_residual_norm: jax.Array | None = None, qjl_sketch: jax.Array | None = None,
    pages: jax.Array | None = None,   # int32 [B, P]: block tables into a paged pool
    *,
    angle_bits: int,                            # B: level 1 B + 1 bits, deeper B - 1
    centroids: tuple[tuple[float, ...], ...],   # each level's centroids, level 1 first
    offsets: tuple[int, ...],                   # each angle's bit in a token's words
    value_bits: int, value_group: int, sm_scale: float, block_s: int | None = None,
    splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    interpret: bool | None = None, page_tokens: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of the query rows over PolarQuant keys at full depth.

    A key is ``|k| R^T y``: ``y`` the unit vector of ``D - 1`` polar angles, angle ``a``
    (level order: level 1's ``D / 2`` first, the top angle last) the centroid of the
    code at bit ``offsets[a]`` of the token's words in ``k_codes``, uint32 ``[B, K, S,
    W]`` (``[L, B, K, S, W]`` with ``layer``), ``W = D B / 32`` (``-1``: a level of no
    bits, its one centroid); ``y[2j] = r_j cos phi_j``, ``y[2j + 1] = r_j sin phi_j``
    with ``r_j`` the product of the cosines (left child) and sines (right child) of
    ``j``'s ancestors; ``R`` the randomized Hadamard rotation of ``k_signs``. There is no
    QJL variant: its arrays must be None. A value is ``zero_g + scale_g * c`` per group
    of ``value_group`` channels. The other arguments, the result and the errors are
    those of every entry over rotated keys (:mod:`pallas_kernels.rotated`);
    :func:`unsupported` says which codes the kernel cannot read.
    """
    return rotated.decode(
        key_reader(q, angle_bits, centroids, offsets, value_bits, value_group,
                   (k_qjl, k_residual_norm, qjl_sketch)),
        q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer, k_signs, k_qjl,
        k_residual_norm, qjl_sketch, pages, value_bits=value_bits, value_group=value_group,
        sm_scale=sm_scale, block_s=block_s, splits=splits, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, page_tokens=page_tokens)
