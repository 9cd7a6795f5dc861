"""The array-level entry of the OCTOPUS decode-attention kernel: :func:`octopus_decode`.

One decode query per row attends to rotated OCTOPUS keys (and OCTOPUS-QJL's estimator)
and group-wise INT values: arrays in (key bytes, fp16 norms, value codes, scales and
zeros, per-row token counts, the rotation's signs and the QJL sketch), the partial
softmax ``(o, m, l)`` over the coded tokens out (:mod:`pallas_kernels.partial`). The entry
owns the whole pipeline: checks, the query's rotation and sketch (once per call, by
XLA), its column layout and row padding, the blocking, the ``pallas_call``
(:func:`.kernel.codes_partial`) and the exact merge of the splits.
:func:`.reference.octopus_decode` has the same signature and is the specification.

The keys' options (:meth:`kvjax.codec.OctopusFormat.options`) describe the codes fully:
the coordinates' width and magnitudes, the norm levels and the byte ``layout``
(:class:`kvjax.codecs.octopus.ByteLayout`; None: a dense stream, refused).

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query rows per kv head, ``S`` code
slots, ``N`` bytes per token, ``n`` channel groups of a value, ``D`` head dim, ``L``
layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import group_values
from pallas_kernels.codebook_decode.api import query_sides
from pallas_kernels.flash import NUM_WARPS, default_blocking, default_splits, pad_query_rows
from pallas_kernels.octopus_decode.kernel import NIBBLE, codes_partial, query_columns
from pallas_kernels.partial import empty_partial, merge_partials
from pallas_kernels.units import code_layout

#: the smallest head dim: whole value words and QJL sign words
MIN_HEAD_DIM = 32
#: the most norm levels a select chain looks up
MAX_NORMS = 16


def _reason(head_dim: int, value_bits: int, value_group: int, direction_bits: int,
            norms, layout) -> str | None:
    if layout is None or direction_bits != NIBBLE:
        return (f"{direction_bits}-bit coordinates or {len(norms)} norm levels: the codes "
                f"are one dense stream, not the byte layout (4-bit coordinates, norm codes "
                f"that fill bytes)")
    if len(norms) > MAX_NORMS:
        return f"{len(norms)} norm levels: the select chain looks up at most {MAX_NORMS}"
    if head_dim < MIN_HEAD_DIM or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= {MIN_HEAD_DIM}"
    return group_values.unsupported(value_bits, value_group, head_dim)


def unsupported(head_dim: int, value_bits: int, value_group: int, *, direction_bits: int,
                norms: tuple[float, ...], layout, **_) -> str | None:
    """Why the kernel cannot read these codes (None: it can); the keyword arguments are
    the entry's key options (:meth:`kvjax.codec.OctopusFormat.options`)."""
    return _reason(head_dim, value_bits, value_group, direction_bits, norms, layout)


def check_arrays(q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer, k_signs,
                 k_qjl, k_residual_norm, qjl_sketch, direction_bits, magnitudes, norms,
                 layout, value_bits, value_group) -> None:
    """The checks of :func:`octopus_decode` (and of its reference):
    ``NotImplementedError`` where the kernel cannot serve the arrays, ``ValueError``
    where they are malformed."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, K, G, D], got shape {q.shape}")
    batch, heads, _, head_dim = q.shape
    reason = _reason(head_dim, value_bits, value_group, direction_bits, norms, layout)
    if reason is not None:
        raise NotImplementedError(f"octopus_decode: {reason}")
    if len(magnitudes) != 1 << (direction_bits - 1):
        raise ValueError(f"{direction_bits}-bit sign-magnitude coordinates need "
                         f"{1 << (direction_bits - 1)} magnitudes, got {len(magnitudes)}")
    levels = len(norms)
    norm_bits = (levels - 1).bit_length()
    # the layout packs 8 / norm_bits codes to a byte, in as few bytes as they fill
    norm_bytes = len({b for b, _ in layout.norm})
    if (levels & (levels - 1) or norm_bytes != -(-len(layout.direction) * norm_bits // 8)
            or any((slot + 1) * norm_bits > 8 for _, slot in layout.norm)):
        raise ValueError(f"{levels} norm levels do not match the layout's norm codes")
    if len(layout.direction) != -(-head_dim // 3):
        raise ValueError(f"the layout holds {len(layout.direction)} triplets, head_dim "
                         f"{head_dim} has {-(-head_dim // 3)}")
    lead = 5 if layer is not None else 4
    stack = "[L, B, K, S, ...]" if layer is not None else "[B, K, S, ...]"
    tokens = k_codes.shape[:-1]
    if (k_codes.ndim != lead or tokens[-3:-1] != (batch, heads)
            or k_codes.shape[-1] != layout.size):
        raise ValueError(f"k_codes must be {stack} with B, K = {batch}, {heads} and "
                         f"{layout.size} bytes, got shape {k_codes.shape}")
    if k_codes.dtype != jnp.uint8:
        raise ValueError(f"k_codes must be uint8 bytes, got {k_codes.dtype}")
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
        if k_qjl.dtype != jnp.uint32:
            raise ValueError(f"k_qjl must be uint32 packed words, got {k_qjl.dtype}")
    if k_signs is not None:
        shapes.append(("k_signs", k_signs, (heads, head_dim)))
    for name, a, shape in shapes:
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {a.shape}")


@functools.partial(
    jax.jit,
    static_argnames=("direction_bits", "magnitudes", "norms", "layout", "value_bits",
                     "value_group", "sm_scale", "block_s", "splits", "num_warps",
                     "num_stages", "interpret"),
)
def octopus_decode(
    q: jax.Array,        # [B, K, G, D] float: the query rows that read kv head k
    k_codes: jax.Array,  # uint8 [B, K, S, N] ([L, B, K, S, N] with layer): byte layout
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
    direction_bits: int,              # bits per octahedral coordinate: 4
    magnitudes: tuple[float, ...],    # the coordinate codebook's 8 magnitudes, ascending
    norms: tuple[float, ...],         # the triplet norm levels
    layout,                           # kvjax.codecs.octopus.ByteLayout of the codes
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

    A key is ``|k| R^T y``: triplet ``t`` of ``y`` (dims ``3t .. 3t + 2``, the pad past
    ``D`` dropped) is ``rho m``, ``rho`` the norm level of its norm code and ``m`` the
    normalized octahedral lift of its coordinates ``xi``, ``eta`` (sign-magnitude codes
    into ``magnitudes``; :func:`kvjax.codecs.octopus.octahedral_decode`), the codes where
    ``layout`` puts them; ``R`` the randomized Hadamard rotation of ``k_signs``. With QJL
    arrays its score adds ``sqrt(pi / 2) / D * |r| * <G q, sign(G r)>``. A value is
    ``zero_g + scale_g * c`` per group of ``value_group`` channels. Returns ``o [B, K, G,
    D]``, ``m [B, K, G]``, ``l [B, K, G]`` in float32; a row with no coded token gets ``o
    = 0, l = 0, m = NEG``. Raises ``NotImplementedError`` when the kernel cannot serve
    these arrays (:func:`unsupported`), ``ValueError`` when they are malformed.
    """
    check_arrays(q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer, k_signs,
                 k_qjl, k_residual_norm, qjl_sketch, direction_bits, magnitudes, norms,
                 layout, value_bits, value_group)
    batch, heads, group, head_dim = q.shape
    slots = k_codes.shape[-2]
    if slots == 0:
        return empty_partial(q)
    block_s, num_stages = default_blocking(block_s, num_stages)
    splits = splits or default_splits(batch, heads, slots, block_s, num_warps)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    q_rot, gq = query_sides(q, k_signs, qjl_sketch)
    width = max(layout.width, group_values.plane_width(head_dim, value_bits))
    q_rot = pad_query_rows(q_rot, width)
    # one zero column past the dims: what a column without a triplet reads
    q_rot = jnp.pad(q_rot, ((0, 0),) * 3 + ((0, 1),))[..., query_columns(layout, head_dim)]
    if gq is not None:
        # the sign bits are 1-bit planar words, read as bytes
        gq = pad_query_rows(gq, width)[..., code_layout(head_dim, 1)[2]]
    o, m, l = codes_partial(
        q_rot, gq, k_codes, k_norm, k_qjl, k_residual_norm, v_codes, v_scale, v_zero,
        lengths, layer, head_dim=head_dim, layout=layout, magnitudes=magnitudes,
        norms=norms, value_bits=value_bits, value_group=value_group, sm_scale=sm_scale,
        block_s=block_s, splits=splits, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret)
    o = group_values.restore_columns(o, head_dim, value_bits)
    return merge_partials((o[..., :group, :], m[..., :group], l[..., :group]), axis=2)
