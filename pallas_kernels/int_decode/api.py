"""The array-level entry of the INT-N decode-attention kernel: :func:`int_decode`.

One decode query per row attends to packed token-wise integer codes (``int:N``, SAW),
in the style of JAX's ``pallas/ops/gpu/decode_attention.py``: arrays in (codes, fp16
scales and zeros, per-row token counts, optional rotations), the partial softmax
``(o, m, l)`` over the coded tokens out (:mod:`pallas_kernels.partial`), so that a caller
merges it with whatever else its rows attend to. The entry owns the whole pipeline:
checks, query-row padding, the default blocking and split count, the ``pallas_call``
(:func:`.kernel.codes_partial`) and the exact merge of the splits.
:func:`.reference.int_decode` has the same signature and is the specification.

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query rows per kv head, ``S`` code
slots, ``W`` uint32 words per token (``D * bits / 32``), ``D`` head dim, ``L`` layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.primitives.packing import is_planar
from kvjax.primitives.rotations import block_hadamard, random_signs
from pallas_kernels.flash import (
    BLOCK_ROWS,
    MIN_DOT,
    NUM_WARPS,
    check_lengths,
    check_pages,
    check_query,
    check_stack,
    page_block,
    schedule,
)
from pallas_kernels.int_decode.kernel import Research, codes_partial
from pallas_kernels.partial import empty_partial, merge_partials, unrotate_output

#: bit widths whose planar packing puts whole dims in each bit slot of a 32-bit word
KERNEL_BITS = (2, 4, 8)


def unsupported(bits: int, head_dim: int) -> str | None:
    """Why the kernel cannot read ``bits``-bit codes of ``head_dim`` dims (None: it can)."""
    if bits not in KERNEL_BITS:
        return f"{bits}-bit codes are not planar-packed (kernel bits: {KERNEL_BITS})"
    if head_dim < MIN_DOT or head_dim & (head_dim - 1) or not is_planar(head_dim, bits):
        return f"head_dim {head_dim} is not a power of two >= {MIN_DOT}"
    return None


def check_arrays(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lengths, layer,
                 q_rotation, v_rotation, bits: int, offset: int | None = None,
                 pages=None, page_tokens: int = 0) -> int:
    """The checks of :func:`int_decode` (and of its reference): ``NotImplementedError``
    where the kernel cannot serve the arrays, ``ValueError`` where they are malformed.
    Returns the token capacity of a row (:func:`~pallas_kernels.flash.check_pages`)."""
    if offset is None and (k_zero is None or v_zero is None):
        raise ValueError("k_zero and v_zero are needed unless offset is given (codes "
                         "scale * (code - offset))")
    if offset is not None and (k_zero is not None or v_zero is not None):
        raise ValueError("with offset the codes are scale * (code - offset): pass no zeros")
    if offset is not None and not 0 <= offset < 1 << bits:
        raise ValueError(f"offset {offset} is not a {bits}-bit code")
    batch, heads, head_dim = check_query("int_decode", q,
                                         functools.partial(unsupported, bits))
    words = head_dim * bits // 32
    check_stack("k_codes", k_codes, 1 if pages is not None else batch, heads, layer, words,
                f"W = {words} words of {bits}-bit codes of {head_dim} dims")
    codes_shape = k_codes.shape
    for name, a, shape in (("v_codes", v_codes, codes_shape),
                           ("k_scale", k_scale, codes_shape[:-1]),
                           ("k_zero", k_zero, codes_shape[:-1]),
                           ("v_scale", v_scale, codes_shape[:-1]),
                           ("v_zero", v_zero, codes_shape[:-1])):
        if a is not None and a.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    check_lengths(lengths, batch, q.shape[2])
    for name, a in (("k_codes", k_codes), ("v_codes", v_codes)):
        if a.dtype != jnp.uint32:
            raise ValueError(f"{name} must be uint32 packed words, got {a.dtype}")
    for name, r in (("q_rotation", q_rotation), ("v_rotation", v_rotation)):
        if r is not None and r.shape != (heads, head_dim, head_dim):
            raise ValueError(f"{name} must be [K, D, D] = {(heads, head_dim, head_dim)}, "
                             f"got {r.shape}")
    return check_pages(pages, page_tokens, batch, k_codes.shape[-2])


@functools.partial(
    jax.jit,
    static_argnames=("bits", "offset", "sm_scale", "block_s", "splits", "num_warps",
                     "num_stages", "interpret", "research", "page_tokens"),
)
def int_decode(
    q: jax.Array,        # [B, K, G, D] float: the query rows that read kv head k
    k_codes: jax.Array,  # uint32 [B, K, S, W] ([L, B, K, S, W] with layer): planar codes
    k_scale: jax.Array,  # [B, K, S] ([L, ...]) fp16 or float32: key = zero + scale * code
    k_zero: jax.Array | None,  # [B, K, S] ([L, ...]) fp16 or float32; None with offset
    v_codes: jax.Array,  # uint32, like k_codes
    v_scale: jax.Array,  # like k_scale
    v_zero: jax.Array | None,  # like k_zero
    lengths: jax.Array,  # int32 [B], or [B, G] per query row: coded tokens seen, the first of S
    layer: jax.Array | None = None,       # int32 []: the layer of stacked codes to read
    q_rotation: jax.Array | None = None,  # [K, D, D]: keys stored as R k; reads R q
    v_rotation: jax.Array | None = None,  # [K, D, D]: values stored as R v; R^T o out
    pages: jax.Array | None = None,  # int32 [B, P]: block tables into a paged pool
    *,
    bits: int,               # code width: 2, 4 or 8 (planar-packed)
    offset: int | None = None,  # no zeros: every token is scale * (code - offset)
    sm_scale: float,         # logits are sm_scale * q . k
    block_s: int | None = None,     # tokens per block (default_blocking)
    splits: int | None = None,      # slices of S, one program each (default_splits)
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,  # pipeline stages (default_blocking)
    interpret: bool | None = None,  # Pallas interpret mode; default: off a GPU
    research: Research | None = None,  # benchmark-only kernel variant; None: production
    page_tokens: int = 0,    # tokens of a page, with pages
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of the query rows over the first ``lengths[b]`` coded tokens.

    Returns ``o [B, K, G, D]``, ``m [B, K, G]``, ``l [B, K, G]`` in float32
    (:mod:`pallas_kernels.partial`); a row with no coded token gets ``o = 0, l = 0,
    m = NEG``. Codes are :func:`kvjax.primitives.packing.pack_bits` words of the
    token-wise integer codes, each token ``zero + scale * code`` (with ``offset``, and no
    zeros: ``scale * (code - offset)``, signed codes stored with a bias). With ``layer``, the
    codes, scales and zeros are a whole stack of layers and the kernel reads layer
    ``layer`` in place (a cache segment's codes inside a scan over layers). Operands of
    the kernel's matmuls are float16, accumulation float32 (see :mod:`.kernel`).
    With ``pages`` the codes, scales and zeros are a paged pool ``[L, 1, K, S, ...]``
    (every page's tokens in page order) and row ``b``'s token ``t`` is the pool's token
    ``pages[b, t // page_tokens] * page_tokens + t % page_tokens``.
    Raises ``NotImplementedError`` when the kernel cannot serve these arrays
    (:func:`unsupported`), ``ValueError`` when they are malformed.
    """
    slots = check_arrays(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lengths,
                         layer, q_rotation, v_rotation, bits, offset, pages, page_tokens)
    batch, heads = q.shape[:2]
    if slots == 0:
        # no code slot at all (a residual window as long as the cache)
        return empty_partial(q)
    research = research or Research()
    if research.heads > 1 and (lengths.ndim > 1
                               or research.heads * q.shape[2] > BLOCK_ROWS):
        raise ValueError("programs of several kv heads hold every query row of their "
                         f"heads in one block of at most {BLOCK_ROWS} rows, for one decode "
                         "query per row: per-row lengths need Research(heads=1)")
    if heads % research.heads:
        raise ValueError(f"{heads} kv heads do not split into programs of "
                         f"{research.heads}")
    block_s, num_stages, splits, interpret = schedule(
        batch, heads // research.heads, slots, block_s=block_s, num_stages=num_stages,
        splits=splits, num_warps=num_warps, interpret=interpret, group=q.shape[2])
    block_s = page_block(block_s, page_tokens)
    o, m, l = codes_partial(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lengths, q_rotation, layer,
        pages, bits=bits, offset=offset, sm_scale=sm_scale, block_s=block_s, splits=splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret, research=research,
        page_tokens=page_tokens,
    )
    o, m, l = merge_partials((o, m, l), axis=2)
    if v_rotation is not None:
        o = unrotate_output(o, v_rotation)
    return o, m, l


def random_inputs(key: jax.Array, *, batch: int, heads: int, group: int, slots: int,
                  head_dim: int, bits: int, rotated: bool = False) -> dict[str, jax.Array]:
    """Random arguments of :func:`int_decode` for a shape: uniformly random packed
    words, fp16 scales and zeros, a normal query, every row full (``lengths = S``) and,
    with ``rotated``, a signed block-Hadamard key rotation (SAW's). The kernel's speed
    depends on the bytes, not the values: benchmarks and profilers time these.
    """
    words = head_dim * bits // 32
    keys = jax.random.split(key, 8)
    out = {"q": jax.random.normal(keys[0], (batch, heads, group, head_dim), jnp.float32)}
    for i, role in enumerate("kv"):
        k_codes, k_scale, k_zero = keys[1 + 3 * i: 4 + 3 * i]
        out[f"{role}_codes"] = jax.random.bits(k_codes, (batch, heads, slots, words),
                                               jnp.uint32)
        out[f"{role}_scale"] = (jax.random.uniform(k_scale, (batch, heads, slots))
                                * 0.1).astype(jnp.float16)
        out[f"{role}_zero"] = (jax.random.normal(k_zero, (batch, heads, slots))
                               * 0.1).astype(jnp.float16)
    out["lengths"] = jnp.full((batch,), slots, jnp.int32)
    if rotated:
        signs = random_signs(keys[7], head_dim)
        rotation = block_hadamard(jnp.eye(head_dim) * signs, min(128, head_dim)).T
        out["q_rotation"] = jnp.broadcast_to(rotation, (heads, head_dim, head_dim))
    return out
