"""The array-level entry of the HQMQ decode-attention kernel: :func:`hqmq_decode`.

One decode query per row attends to HQMQ keys and values: arrays in (the byte streams
and fp16 scales of K and V, per-row token counts, the codeword tables of each kv head),
the partial softmax ``(o, m, l)`` over the coded tokens out (:mod:`pallas_kernels.partial`).
The streams' :class:`kvjax.primitives.quaternion.HqmqLayout` says where each chunk's fields lie.
:func:`.reference.hqmq_decode` has the same signature and is the specification.

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query rows per kv head, ``S`` code
slots, ``H`` bytes per token, ``N`` codewords (``24 S``), ``D`` head dim, ``L`` layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.primitives.quaternion import HqmqLayout
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
from pallas_kernels.hqmq_decode.kernel import (
    COMPONENTS,
    DIGITS,
    LOOKUPS,
    codes_partial,
)
from pallas_kernels.partial import empty_partial, merge_partials

#: tokens per block: at 128 (the INT kernel's) the four component tiles of keys and
#: values spill, 20x slower on the H200; 16 to 64 measure within 8% (docs/kernels.md)
BLOCK_S = 16
#: pipeline depth with Med-C outliers: one stage (10.4 ms against 17.8 at two or three,
#: B=32, S=32k on the H200), where the outlier tiles' registers leave no room to prefetch
OUTLIER_STAGES = 1


def unsupported(layout: HqmqLayout | None, head_dim: int,
                outlier_blocks: tuple[int, ...] = ()) -> str | None:
    """Why the kernel cannot read streams of this layout with Med-C outliers in blocks
    of ``outlier_blocks`` tokens (one per role that has them; None: it can)."""
    if layout is None:
        return ("the stream's fields are not whole bytes and nibbles (the kernel reads "
                "8-bit low index bits and 4-bit radii: hqmq:s96,r4)")
    chunks = layout.chunks
    if -(-head_dim // COMPONENTS) != chunks or chunks < MIN_DOT or chunks & (chunks - 1):
        return (f"head_dim {head_dim}: the kernel reads a power-of-two number >= {MIN_DOT} "
                "of chunks of 4 (head dims 61..64, 125..128, ...)")
    if len(set(outlier_blocks)) > 1:
        return f"K and V outlier blocks differ ({outlier_blocks[0]}, {outlier_blocks[1]})"
    for block in outlier_blocks:
        if block < MIN_DOT or block & (block - 1):
            return (f"outlier blocks of {block} tokens (the kernel reads a power of two >= "
                    f"{MIN_DOT})")
    return None


def check_outliers(name: str, outliers, stream, layout: HqmqLayout) -> int | None:
    """The checks of one role's Med-C arrays; returns the outlier block (tokens)."""
    flags, chunks, *start = outliers
    lead = stream.shape[:-2]
    slots = stream.shape[-2]
    if flags.ndim != stream.ndim or flags.shape[:-2] != lead or flags.dtype != jnp.uint32:
        raise ValueError(f"{name}_outlier_flags must be uint32 [..., NB, W] beside a stream "
                         f"of shape {stream.shape}, got {flags.dtype} {flags.shape}")
    blocks = flags.shape[-2]
    block = slots // blocks if blocks else 0
    if not blocks or block * blocks != slots:
        raise ValueError(f"{name}_outlier_flags: {blocks} blocks do not split {slots} tokens")
    reason = unsupported(layout, layout.chunks * COMPONENTS, (block,))
    if reason is not None:
        raise NotImplementedError(f"hqmq_decode: {reason}")
    if (block * layout.chunks) % 32 or flags.shape[-1] != block * layout.chunks // 32:
        raise ValueError(f"{name}_outlier_flags must hold {block * layout.chunks // 32} "
                         f"words per block (a bit per chunk), got {flags.shape[-1]}")
    # pooled: the chunks are one pool per row, of any number of entries
    entries = chunks.shape[-2:-1] if start else flags.shape[-2:-1]
    if (chunks.shape[:-1] != flags.shape[:-2] + entries or chunks.shape[-1] % COMPONENTS
            or not chunks.shape[-1] or not chunks.shape[-2]):
        raise ValueError(f"{name}_outliers must be [..., NB, 4 P] beside flags of shape "
                         f"{flags.shape}, got {chunks.shape}")
    if start and (start[0].shape != (*flags.shape[:-1], 1) or start[0].dtype != jnp.uint32):
        raise ValueError(f"{name}_outlier_start must be uint32 [..., NB, 1] beside flags of "
                         f"shape {flags.shape}, got {start[0].dtype} {start[0].shape}")
    return block


def check_arrays(q, k_stream, k_scale, v_stream, v_scale, lengths, layer, k_table, v_table,
                 layout: HqmqLayout | None, k_outliers=None, v_outliers=None, pages=None,
                 page_tokens: int = 0) -> tuple[int | None, int]:
    """The checks of :func:`hqmq_decode` (and of its reference): ``NotImplementedError``
    where the kernel cannot serve the arrays, ``ValueError`` where they are malformed.
    Returns the Med-C outlier block in tokens (None without outliers) and the token
    capacity of a row (:func:`~pallas_kernels.flash.check_pages`)."""
    batch, heads, head_dim = check_query("hqmq_decode", q,
                                         functools.partial(unsupported, layout))
    check_stack("k_stream", k_stream, 1 if pages is not None else batch, heads, layer,
                layout.size, f"H = {layout.size} bytes", axes="S, H")
    shape = k_stream.shape
    for name, a, want in (("v_stream", v_stream, shape), ("k_scale", k_scale, shape[:-1]),
                          ("v_scale", v_scale, shape[:-1])):
        if a.shape != want:
            raise ValueError(f"{name} must have shape {want}, got {a.shape}")
    check_lengths(lengths, batch, q.shape[2])
    for name, a in (("k_stream", k_stream), ("v_stream", v_stream)):
        if a.dtype != jnp.uint8:
            raise ValueError(f"{name} must be uint8 bytes, got {a.dtype}")
    for name, t in (("k_table", k_table), ("v_table", v_table)):
        if t.ndim != 3 or t.shape[:2] != (heads, COMPONENTS):
            raise ValueError(f"{name} must be [K, 4, N] codewords, got {t.shape}")
        if t.shape[2] != layout.odd << layout.low_bits:
            raise ValueError(f"{name} holds {t.shape[2]} codewords; the layout's indices "
                             f"reach {layout.odd << layout.low_bits}")
    blocks = tuple(check_outliers(name, o, k_stream, layout)
                   for name, o in (("k", k_outliers), ("v", v_outliers)) if o is not None)
    reason = unsupported(layout, head_dim, blocks)
    if reason is None and pages is not None and any(len(o) == 3 for o in (
            k_outliers, v_outliers) if o is not None):
        reason = "pooled outliers are one pool per row, not pages"
    if reason is None and pages is not None and blocks and page_tokens % blocks[0]:
        reason = f"pages of {page_tokens} tokens hold no whole outlier blocks of {blocks[0]}"
    if reason is not None:
        raise NotImplementedError(f"hqmq_decode: {reason}")
    capacity = check_pages(pages, page_tokens, batch, k_stream.shape[-2])
    return (blocks[0] if blocks else None), capacity


def pairs(k_flags, k_outliers, v_flags, v_outliers, k_start=None, v_start=None):
    """Each role's Med-C ``(flags, chunks)`` (pooled: ``(flags, chunks, start)``) or None;
    a ValueError for half a pair or a start without them."""
    out = []
    for name, flags, chunks, start in (("k", k_flags, k_outliers, k_start),
                                       ("v", v_flags, v_outliers, v_start)):
        if (flags is None) != (chunks is None):
            raise ValueError(f"{name}_outlier_flags and {name}_outliers go together")
        if start is not None and flags is None:
            raise ValueError(f"{name}_outlier_start needs {name}_outlier_flags and "
                             f"{name}_outliers")
        arrays = (flags, chunks) if start is None else (flags, chunks, start)
        out.append(None if flags is None else arrays)
    return out


@functools.partial(
    jax.jit,
    static_argnames=("layout", "sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret", "lookup", "digits", "page_tokens"),
)
def hqmq_decode(
    q: jax.Array,         # [B, K, G, D] float: the query rows that read kv head k
    k_stream: jax.Array,  # uint8 [B, K, S, H] ([L, B, K, S, H] with layer)
    k_scale: jax.Array,   # [B, K, S] ([L, ...]) fp16: the largest chunk radius
    v_stream: jax.Array,  # like k_stream
    v_scale: jax.Array,   # like k_scale
    lengths: jax.Array,   # int32 [B], or [B, G] per query row: coded tokens seen, the first of S
    k_table: jax.Array,   # [K, 4, N]: codeword components by joint index, per kv head
    v_table: jax.Array,   # like k_table, the values' codewords
    layer: jax.Array | None = None,  # int32 []: the layer of stacked codes to read
    k_outlier_flags: jax.Array | None = None,  # uint32 [B, K, NB, W] ([L, ...]): Med-C
    k_outliers: jax.Array | None = None,       # [B, K, NB, 4 P] fp16 outlier chunks
    v_outlier_flags: jax.Array | None = None,  # like k_outlier_flags
    v_outliers: jax.Array | None = None,       # like k_outliers
    k_outlier_start: jax.Array | None = None,  # uint32 [B, K, NB, 1]: pooled outliers
    v_outlier_start: jax.Array | None = None,  # like k_outlier_start
    pages: jax.Array | None = None,  # int32 [B, P]: block tables into a paged pool
    *,
    layout: HqmqLayout,      # where the stream holds each chunk's fields
    sm_scale: float,         # logits are sm_scale * q . k
    block_s: int | None = None,
    splits: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    interpret: bool | None = None,  # Pallas interpret mode; default: off a GPU
    lookup: str = LOOKUPS[0],  # how codewords are formed (.kernel's doc)
    digits: str = DIGITS[0],   # how the digit groups are read (.kernel's doc)
    page_tokens: int = 0,      # tokens of a page, with pages
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmax of the query rows over the first ``lengths[b]`` coded tokens:
    ``o [B, K, G, D]``, ``m [B, K, G]``, ``l [B, K, G]`` in float32; a row with no coded
    token gets ``o = 0, l = 0, m = NEG``. Each token is, per chunk ``c``, ``scale *
    k_c / (2**B - 1) * w_c`` with ``w_c`` the codeword of its joint index (the table's
    column) and ``k_c`` its radius code. With Med-C outliers (per role, optional: per
    outlier block of ``S / NB`` tokens a flag bit per chunk, token-major, and ``P`` fp16
    chunks in the flags' order), a flagged chunk is its stored value (its codes decode
    to zero: the codec encoded it zeroed); the blocks are then the outlier blocks. With
    ``*_outlier_start`` the role's chunks ``[B, K, E, 4 P]`` are one pool of ``E P``
    slots per row and an outlier block's chunks lie from slot ``start`` on. With
    ``pages`` the streams, scales and fixed outlier slots are a paged pool ``[L, 1, K,
    ...]`` that row ``b`` reads through its table: its token ``t`` is the pool's token
    ``pages[b, t // page_tokens] * page_tokens + t % page_tokens`` (a page holds whole
    outlier blocks; pooled outliers are per row and refused).
    Raises ``NotImplementedError`` when the kernel
    cannot serve these arrays (:func:`unsupported`), ``ValueError`` when they are
    malformed."""
    k_med, v_med = pairs(k_outlier_flags, k_outliers, v_outlier_flags, v_outliers,
                         k_outlier_start, v_outlier_start)
    block, capacity = check_arrays(q, k_stream, k_scale, v_stream, v_scale, lengths, layer,
                                   k_table, v_table, layout, k_med, v_med, pages, page_tokens)
    if block is not None and block_s not in (None, block):
        raise ValueError(f"block_s {block_s}: with outliers the kernel reads one outlier "
                         f"block of {block} tokens at a time")
    if lookup not in LOOKUPS:
        raise ValueError(f"lookup must be one of {LOOKUPS}, got {lookup!r}")
    if digits not in DIGITS:
        raise ValueError(f"digits must be one of {DIGITS}, got {digits!r}")
    batch, heads, group, head_dim = q.shape
    if capacity == 0:
        return empty_partial(q)
    block_s, num_stages, splits, interpret = schedule(
        batch, heads, capacity, block_s=block_s,
        num_stages=num_stages or (OUTLIER_STAGES if block else None), splits=splits,
        num_warps=num_warps, interpret=interpret, group=q.shape[2], block=block or BLOCK_S)
    block_s = page_block(block_s, page_tokens)
    # a head dim short of whole chunks: the codec zero-pads the last chunk, so the
    # query's padded columns are zero too and the output's are dropped
    width = COMPONENTS * layout.chunks
    q = jnp.pad(q.astype(jnp.float32), [(0, 0)] * 3 + [(0, width - q.shape[-1])])
    rows = pad_query_rows(q, layout.chunks)
    o, m, l = codes_partial(
        rows, k_stream, k_scale, v_stream, v_scale, lengths, k_table, v_table, layer,
        k_med, v_med, pages, layout=layout, sm_scale=sm_scale, block_s=block_s,
        splits=splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        lookup=lookup, digits=digits, page_tokens=page_tokens)
    return merge_partials((o[..., :group, :head_dim], m[..., :group], l[..., :group]),
                          axis=2)
