"""The array-level entry of the codebook decode-attention kernel: :func:`codebook_decode`.

One decode query per row attends to rotated scalar-codebook keys (TurboQuant-MSE, and
TurboQuant-QJL's estimator) and group-wise INT values: arrays in (packed codes, fp16
norms, scales and zeros, per-row token counts, the rotation's signs and the QJL sketch),
the partial softmax ``(o, m, l)`` over the coded tokens out
(:mod:`pallas_kernels.partial`). The entry checks its keys' options and hands the rest
to the pipeline every kernel over rotated keys shares (:func:`pallas_kernels.rotated.
decode`: the remaining checks, the query's rotation and sketch, its column order and
row padding, the blocking, the ``pallas_call`` and the exact merge of the splits), with
how the kernel reads the codes (:func:`.kernel.reader`). :func:`.reference.
codebook_decode` has the same signature and is the specification.

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query rows per kv head, ``S`` code
slots, ``W`` uint32 words per token, ``D`` head dim, ``L`` layers.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import rotated
from pallas_kernels.codebook_decode.kernel import reader

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
    return rotated.unsupported(head_dim, value_bits, value_group, MIN_HEAD_DIM)


def key_reader(q: jax.Array, key_bits: int, magnitudes: tuple[float, ...], value_bits: int,
               value_group: int) -> rotated.KeyReader:
    """The kernel's reader of these keys for the query rows ``q``, after the checks of
    :func:`codebook_decode` (and of its reference) that concern the key options:
    ``NotImplementedError`` where the kernel cannot read the codes, ``ValueError`` where
    the options are malformed."""
    head_dim = rotated.head_dim_of(q)
    reason = unsupported(head_dim, value_bits, value_group, key_bits=key_bits)
    if reason is not None:
        raise NotImplementedError(f"codebook_decode: {reason}")
    rotated.check_magnitudes(magnitudes, key_bits, "codes")
    return reader(head_dim, key_bits, magnitudes)


def random_inputs(key: jax.Array, *, batch: int, heads: int, group: int, slots: int,
                  head_dim: int, key_bits: int, value_bits: int, value_group: int = 32,
                  qjl: bool = False) -> dict[str, jax.Array]:
    """Random arguments of :func:`codebook_decode` for a shape (the static ones
    excepted): :func:`pallas_kernels.rotated.random_inputs` with ``key_bits``-bit codes."""
    return rotated.random_inputs(key, batch=batch, heads=heads, group=group, slots=slots,
                                 head_dim=head_dim, key_words=key_bits * head_dim // 32,
                                 value_bits=value_bits, value_group=value_group, qjl=qjl)


@functools.partial(jax.jit, static_argnames=("key_bits", "magnitudes",
                                             *rotated.STATIC_ARGNAMES))
def codebook_decode(
    q: jax.Array, k_codes: jax.Array, k_norm: jax.Array, v_codes: jax.Array,
    v_scale: jax.Array, v_zero: jax.Array, lengths: jax.Array, layer: jax.Array | None = None,
    k_signs: jax.Array | None = None, k_qjl: jax.Array | None = None,
    k_residual_norm: jax.Array | None = None, qjl_sketch: jax.Array | None = None,
    pages: jax.Array | None = None,   # int32 [B, P]: block tables into a paged pool
    *,
    key_bits: int,                    # sign-magnitude code width, 1..4
    magnitudes: tuple[float, ...],    # the codebook's 2^(key_bits-1) magnitudes
    value_bits: int, value_group: int, sm_scale: float, block_s: int | None = None,
    splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    interpret: bool | None = None, page_tokens: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of the query rows over rotated scalar-codebook keys (TurboQuant).

    A key is ``|k| R^T y``: ``y``'s coordinates the codebook values ``(-1)^s
    magnitudes[m]`` of the sign-magnitude codes in ``k_codes``, uint32 ``[B, K, S, W]``
    (``[L, B, K, S, W]`` with ``layer``), ``W = key_bits * D / 32`` (planar words; 3
    bits in the split layout of :func:`kvjax.primitives.packing.pack_split`), ``R`` the
    randomized Hadamard rotation of ``k_signs``. With QJL arrays its score adds ``sqrt(pi
    / 2) / D * |r| * <G q, sign(G r)>``. A value is ``zero_g + scale_g * c`` per group
    of ``value_group`` channels. The other arguments, the result and the errors are
    those of every entry over rotated keys (:mod:`pallas_kernels.rotated`);
    :func:`unsupported` says which codes the kernel cannot read.
    """
    return rotated.decode(
        key_reader(q, key_bits, magnitudes, value_bits, value_group), q, k_codes, k_norm,
        v_codes, v_scale, v_zero, lengths, layer, k_signs, k_qjl, k_residual_norm, qjl_sketch,
        pages, value_bits=value_bits, value_group=value_group, sm_scale=sm_scale,
        block_s=block_s, splits=splits, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret, page_tokens=page_tokens)
