"""The array-level entry of the Rice decode-attention kernel: :func:`rice_decode`.

One decode query per row attends to HyperQuant keys and values stored as Rice-coded
blocks (:mod:`kvjax.codecs.hyperquant`, E8 without dither), in the codec's rotated
frame: the caller rotates the query (:meth:`~kvjax.codec.RiceFormat.rotate`) and the
output back (:meth:`~kvjax.codec.RiceFormat.unrotate`), once per call.
:func:`.reference.rice_decode` has the same signature and is the specification.

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query rows per kv head, ``NB``
blocks of ``tN`` tokens, ``W`` words per block, ``D`` head dim, ``L`` layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash import (
    MIN_DOT,
    check_lengths,
    check_pages,
    check_query,
    check_stack,
    pad_query_rows,
    page_block,
    schedule,
)
from pallas_kernels.partial import empty_partial, merge_partials
from pallas_kernels.rice_decode.kernel import GROUP, codes_partial

#: tokens per Rice block the kernel reads
RICE_BLOCK = 8
#: tokens per block of the kernel: two Rice blocks, with four warps (measured on the
#: H200: 46 ms at B = 32, S = 32k against 99 ms for 32 tokens and two warps, whose
#: larger per-thread tiles spill)
BLOCK_S = 16
WARPS = 4
#: pipeline stages: one, so that no load of the scratch tile is issued ahead of the
#: stores and the barrier that precede it in program order
NUM_STAGES = 1


def unsupported(layout, head_dim: int) -> str | None:
    """Why the kernel cannot read Rice blocks of this layout (a
    :class:`kvjax.primitives.rice_blocks.RiceLayout`; None: it can)."""
    if layout is None:
        return "the codes are not Rice-coded E8 blocks without dither"
    if layout.lattice != "e8":
        return f"lattice {layout.lattice}: the kernel reads E8 streams"
    if layout.head_dim != head_dim or head_dim < MIN_DOT or head_dim & (head_dim - 1):
        return f"head_dim {head_dim}: the kernel reads power-of-two head dims >= {MIN_DOT}"
    if layout.block != RICE_BLOCK:
        return (f"blocks of {layout.block} tokens (the kernel reads the default "
                f"{RICE_BLOCK}, whose calibrations ship with the package)")
    if layout.substream % head_dim or layout.n_sub > MIN_DOT:
        return "sub-streams that are not whole tokens"
    return None


def check_arrays(q, k_stream, k_index, k_norm, v_stream, v_index, v_norm, lengths, layer,
                 layout, pages=None, page_tokens: int = 0) -> int:
    """The checks of :func:`rice_decode` (and of its reference): ``NotImplementedError``
    where the kernel cannot serve the arrays, ``ValueError`` where they are malformed.
    Returns the token capacity of a row (:func:`~pallas_kernels.flash.check_pages`)."""
    batch, heads, head_dim = check_query("rice_decode", q,
                                         functools.partial(unsupported, layout))
    check_stack("k_stream", k_stream, 1 if pages is not None else batch, heads, layer,
                layout.words, f"W = {layout.words} words per block", axes="NB, W")
    shape = k_stream.shape
    blocks = shape[:-1]
    for name, a, want, dtype in (
            ("v_stream", v_stream, shape, jnp.uint32),
            ("k_stream", k_stream, shape, jnp.uint32),
            ("k_index", k_index, (*blocks, layout.n_sub), jnp.uint32),
            ("v_index", v_index, (*blocks, layout.n_sub), jnp.uint32),
            ("k_norm", k_norm, (*blocks, layout.block), None),
            ("v_norm", v_norm, (*blocks, layout.block), None)):
        if a.shape != want:
            raise ValueError(f"{name} must have shape {want}, got {a.shape}")
        if dtype is not None and a.dtype != dtype:
            raise ValueError(f"{name} must be {jnp.dtype(dtype).name}, got {a.dtype}")
    check_lengths(lengths, batch, q.shape[2])
    if head_dim % GROUP:
        raise NotImplementedError(f"rice_decode: head_dim {head_dim} is not whole E8 points")
    if pages is not None and page_tokens % layout.block:
        raise NotImplementedError(f"rice_decode: pages of {page_tokens} tokens hold no whole "
                                  f"Rice blocks of {layout.block}")
    return check_pages(pages, page_tokens, batch, k_stream.shape[-2] * layout.block)


@functools.partial(
    jax.jit,
    static_argnames=("layout", "sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret", "page_tokens"),
)
def rice_decode(
    q: jax.Array,         # [B, K, G, D] float: query rows in the codec's rotated frame
    k_stream: jax.Array,  # uint32 [B, K, NB, W] ([L, B, K, NB, W] with layer)
    k_index: jax.Array,   # uint32 [B, K, NB, n_sub]: start bit | k << 24 per sub-stream
    k_norm: jax.Array,    # [B, K, NB, tN] fp16: the tokens' norms
    v_stream: jax.Array,  # like k_stream
    v_index: jax.Array,   # like k_index
    v_norm: jax.Array,    # like k_norm
    lengths: jax.Array,   # int32 [B], or [B, G] per query row: coded tokens seen
    layer: jax.Array | None = None,  # int32 []: the layer of stacked codes to read
    pages: jax.Array | None = None,  # int32 [B, P]: block tables into a paged pool
    *,
    layout,               # kvjax.primitives.rice_blocks.RiceLayout of the blocks
    sm_scale: float,      # logits are sm_scale * q . k
    block_s: int | None = None,
    splits: int | None = None,
    num_warps: int = WARPS,
    num_stages: int | None = None,
    interpret: bool | None = None,  # Pallas interpret mode; default: off a GPU
    page_tokens: int = 0,  # tokens of a page, with pages
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of the (rotated) query rows over the first ``lengths[b]`` coded
    tokens: ``o [B, K, G, D]`` (rotated frame), ``m [B, K, G]``, ``l [B, K, G]`` in
    float32; a row with no coded token gets ``o = 0, l = 0, m = NEG``. Each token is its
    block's :func:`kvjax.primitives.rice_blocks.rotated_tokens`. Raises
    ``NotImplementedError`` when the kernel cannot serve these arrays
    (:func:`unsupported`), ``ValueError`` when they are malformed. With ``pages`` the
    blocks are a paged pool ``[L, 1, K, NB, ...]`` that row ``b`` reads through its
    table (its token ``t`` at the pool's ``pages[b, t // page_tokens] * page_tokens + t
    % page_tokens``; a page holds whole Rice blocks)."""
    capacity = check_arrays(q, k_stream, k_index, k_norm, v_stream, v_index, v_norm,
                            lengths, layer, layout, pages, page_tokens)
    if block_s is not None and (block_s % layout.block or block_s < MIN_DOT
                                or block_s & (block_s - 1)):
        raise ValueError(f"block_s {block_s}: a power of two >= {MIN_DOT} of whole blocks "
                         f"of {layout.block} tokens")
    batch, heads, group, _ = q.shape
    if capacity == 0:
        return empty_partial(q)
    block_s, num_stages, splits, interpret = schedule(
        batch, heads, capacity, block_s=block_s, num_stages=num_stages or NUM_STAGES,
        splits=splits, num_warps=num_warps, interpret=interpret, group=q.shape[2], block=BLOCK_S)
    block_s = page_block(block_s, page_tokens)
    rows = pad_query_rows(q.astype(jnp.float32), layout.head_dim)
    o, m, l = codes_partial(
        rows, k_stream, k_index, k_norm, v_stream, v_index, v_norm, lengths, layer, pages,
        layout=layout, sm_scale=sm_scale, block_s=block_s, splits=splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        page_tokens=page_tokens)
    return merge_partials((o[..., :group, :], m[..., :group], l[..., :group]), axis=2)
