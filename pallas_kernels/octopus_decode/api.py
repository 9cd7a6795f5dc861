"""The array-level entry of the OCTOPUS decode-attention kernel: :func:`octopus_decode`.

One decode query per row attends to rotated OCTOPUS keys (and OCTOPUS-QJL's estimator)
and group-wise INT values: arrays in (key bytes, fp16 norms, value codes, scales and
zeros, per-row token counts, the rotation's signs and the QJL sketch), the partial
softmax ``(o, m, l)`` over the coded tokens out (:mod:`pallas_kernels.partial`). The entry
checks its keys' options and hands the rest to the pipeline every kernel over rotated
keys shares (:func:`pallas_kernels.rotated.decode`), with how the kernel reads the codes
(:func:`.kernel.reader`). :func:`.reference.octopus_decode` has the same signature and is
the specification.

The keys' options (:meth:`kvjax.codec.OctopusFormat.options`) describe the codes fully:
the coordinates' width and magnitudes, the norm levels and the byte ``layout``
(:class:`kvjax.codecs.octopus.ByteLayout`; None: a dense stream, refused).

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query rows per kv head, ``S`` code
slots, ``N`` bytes per token, ``D`` head dim, ``L`` layers.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import rotated
from pallas_kernels.octopus_decode.kernel import LOOKUP, NIBBLE, reader

#: the smallest head dim: whole value words and QJL sign words
MIN_HEAD_DIM = 32
#: the most norm levels the kernel looks up: two register tables of 8 and a select
MAX_NORMS = 2 * LOOKUP


def _reason(head_dim: int, value_bits: int, value_group: int, direction_bits: int,
            norms, layout) -> str | None:
    if layout is None or direction_bits != NIBBLE:
        return (f"{direction_bits}-bit coordinates or {len(norms)} norm levels: the codes "
                f"are one dense stream, not the byte layout (4-bit coordinates, norm codes "
                f"that fill bytes)")
    if len(norms) > MAX_NORMS:
        return (f"{len(norms)} norm levels: the register lookups read at most "
                f"{MAX_NORMS}")
    return rotated.unsupported(head_dim, value_bits, value_group, MIN_HEAD_DIM)


def unsupported(head_dim: int, value_bits: int, value_group: int, *, direction_bits: int,
                norms: tuple[float, ...], layout, **_) -> str | None:
    """Why the kernel cannot read these codes (None: it can); the keyword arguments are
    the entry's key options (:meth:`kvjax.codec.OctopusFormat.options`)."""
    return _reason(head_dim, value_bits, value_group, direction_bits, norms, layout)


def key_reader(q: jax.Array, direction_bits: int, magnitudes: tuple[float, ...],
               norms: tuple[float, ...], layout, value_bits: int,
               value_group: int) -> rotated.KeyReader:
    """The kernel's reader of these keys for the query rows ``q``, after the checks of
    :func:`octopus_decode` (and of its reference) that concern the key options:
    ``NotImplementedError`` where the kernel cannot read the codes, ``ValueError`` where
    the options are malformed."""
    head_dim = rotated.head_dim_of(q)
    reason = _reason(head_dim, value_bits, value_group, direction_bits, norms, layout)
    if reason is not None:
        raise NotImplementedError(f"octopus_decode: {reason}")
    rotated.check_magnitudes(magnitudes, direction_bits, "coordinates")
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
    return reader(head_dim, layout, magnitudes, norms)


@functools.partial(jax.jit, static_argnames=("direction_bits", "magnitudes", "norms",
                                             "layout", *rotated.STATIC_ARGNAMES))
def octopus_decode(
    q: jax.Array, k_codes: jax.Array, k_norm: jax.Array, v_codes: jax.Array,
    v_scale: jax.Array, v_zero: jax.Array, lengths: jax.Array, layer: jax.Array | None = None,
    k_signs: jax.Array | None = None, k_qjl: jax.Array | None = None,
    k_residual_norm: jax.Array | None = None, qjl_sketch: jax.Array | None = None,
    pages: jax.Array | None = None,   # int32 [B, P]: block tables into a paged pool
    *,
    direction_bits: int,              # bits per octahedral coordinate: 4
    magnitudes: tuple[float, ...],    # the coordinate codebook's 8 magnitudes, ascending
    norms: tuple[float, ...],         # the triplet norm levels
    layout,                           # kvjax.codecs.octopus.ByteLayout of the codes
    value_bits: int, value_group: int, sm_scale: float, block_s: int | None = None,
    splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    interpret: bool | None = None, page_tokens: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of the query rows over rotated OCTOPUS keys.

    A key is ``|k| R^T y``: triplet ``t`` of ``y`` (dims ``3t .. 3t + 2``, the pad past
    ``D`` dropped) is ``rho m``, ``rho`` the norm level of its norm code and ``m`` the
    normalized octahedral lift of its coordinates ``xi``, ``eta`` (sign-magnitude codes
    into ``magnitudes``; :func:`kvjax.primitives.octahedral.octahedral_decode`), the codes where
    ``layout`` puts them in ``k_codes``, uint8 ``[B, K, S, N]`` (``[L, B, K, S, N]`` with
    ``layer``), ``N = layout.size``; ``R`` the randomized Hadamard rotation of
    ``k_signs``. With QJL arrays its score adds ``sqrt(pi / 2) / D * |r| * <G q, sign(G
    r)>``. A value is ``zero_g + scale_g * c`` per group of ``value_group`` channels. The
    other arguments, the result and the errors are those of every entry over rotated
    keys (:mod:`pallas_kernels.rotated`); :func:`unsupported` says which codes the
    kernel cannot read.
    """
    return rotated.decode(
        key_reader(q, direction_bits, magnitudes, norms, layout, value_bits, value_group),
        q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer, k_signs, k_qjl,
        k_residual_norm, qjl_sketch, pages, value_bits=value_bits, value_group=value_group,
        sm_scale=sm_scale, block_s=block_s, splits=splits, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, page_tokens=page_tokens)
