"""The array-level entry of the dense decode-attention kernel: :func:`dense_decode`.

One decode query per row attends to keys and values stored as 16-bit floats (the
``bf16`` and ``fp16`` codecs' codes), from a stack of layers read in place at the
layer's index. :func:`.reference.dense_decode` has the same signature and is the
specification.

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query rows per kv head, ``S``
slots, ``D`` head dim, ``L`` layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dense_decode.kernel import values_partial
from pallas_kernels.flash import (
    MIN_DOT,
    NUM_WARPS,
    check_lengths,
    check_pages,
    check_query,
    check_stack,
    pad_query_rows,
    page_block,
    schedule,
)
from pallas_kernels.partial import empty_partial, merge_partials

#: the storage types the kernel's matmuls take as they are
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unsupported(dtype, head_dim: int) -> str | None:
    """Why the kernel cannot read values of ``dtype`` at ``head_dim`` (None: it can)."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"values stored as {jnp.dtype(dtype).name}: it reads bfloat16 or float16"
    if head_dim < MIN_DOT or head_dim & (head_dim - 1):
        return f"head_dim {head_dim}: it reads power-of-two head dims >= {MIN_DOT}"
    return None


def check_arrays(q, keys, values, lengths, layer, pages=None, page_tokens: int = 0) -> int:
    """The checks of :func:`dense_decode` (and of its reference): ``NotImplementedError``
    where the kernel cannot serve the arrays, ``ValueError`` where they are malformed.
    Returns the token capacity of a row (:func:`~pallas_kernels.flash.check_pages`)."""
    batch, heads, head_dim = check_query(
        "dense_decode", q, functools.partial(unsupported, keys.dtype))
    check_stack("keys", keys, 1 if pages is not None else batch, heads, layer, head_dim,
                f"D = {head_dim}", axes="S, D")
    if values.shape != keys.shape or values.dtype != keys.dtype:
        raise ValueError(f"values must match keys ({keys.shape} {keys.dtype.name}), got "
                         f"{values.shape} {values.dtype.name}")
    check_lengths(lengths, batch, q.shape[2])
    return check_pages(pages, page_tokens, batch, keys.shape[-2])


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret", "page_tokens"),
)
def dense_decode(
    q: jax.Array,        # [B, K, G, D] float: the query rows that read kv head k
    keys: jax.Array,     # [B, K, S, D] ([L, B, K, S, D] with layer) bfloat16 or float16
    values: jax.Array,   # like keys
    lengths: jax.Array,  # int32 [B], or [B, G] per query row: tokens seen, the first of S
    layer: jax.Array | None = None,  # int32 []: the layer of the stacks to read
    pages: jax.Array | None = None,  # int32 [B, P]: block tables into a paged pool
    *,
    sm_scale: float,     # logits are sm_scale * q . k
    page_tokens: int = 0,  # tokens of a page, with pages
    block_s: int | None = None,
    splits: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    interpret: bool | None = None,  # Pallas interpret mode; default: off a GPU
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of the query rows over the first ``lengths[b]`` stored tokens:
    ``o [B, K, G, D]``, ``m [B, K, G]``, ``l [B, K, G]`` in float32; a row with no token
    gets ``o = 0, l = 0, m = NEG``. The query is rounded to the values' type for the
    matmuls, which accumulate in float32. Raises ``NotImplementedError`` when the kernel
    cannot serve these arrays (:func:`unsupported`), ``ValueError`` when they are
    malformed. With ``pages`` the keys and values are a paged pool ``[L, 1, K, S, D]``
    (every page's tokens in page order) and row ``b``'s token ``t`` is the pool's token
    ``pages[b, t // page_tokens] * page_tokens + t % page_tokens``."""
    slots = check_arrays(q, keys, values, lengths, layer, pages, page_tokens)
    batch, heads, group, head_dim = q.shape
    if slots == 0:
        return empty_partial(q)
    block_s, num_stages, splits, interpret = schedule(
        batch, heads, slots, block_s=block_s, num_stages=num_stages, splits=splits,
        num_warps=num_warps, interpret=interpret, group=q.shape[2])
    block_s = page_block(block_s, page_tokens)
    rows = pad_query_rows(q.astype(jnp.float32), head_dim)
    o, m, l = values_partial(rows, keys, values, lengths, layer, pages, sm_scale=sm_scale,
                             block_s=block_s, splits=splits, num_warps=num_warps,
                             num_stages=num_stages, interpret=interpret,
                             page_tokens=page_tokens)
    return merge_partials((o[..., :group, :], m[..., :group], l[..., :group]), axis=2)
