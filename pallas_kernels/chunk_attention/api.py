"""The array-level entry of the chunk-attention kernel: :func:`chunk_attention`.

The queries of a prefill chunk, grouped per kv head, attend causally to keys and
values stored as 16-bit floats (the ``bf16`` codec's codes, or a cache decoded to
bfloat16), from a stack of layers read in place at the layer's index.
:func:`.reference.chunk_attention` has the same signature and is the specification.

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query heads per kv head, ``T``
tokens of the chunk, ``R = G * T`` query rows per kv head, ``S`` key slots, ``D`` head
dim, ``L`` layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.chunk_attention.kernel import ORDERS, chunk_call
from pallas_kernels.flash import MIN_DOT, check_query, check_stack, query_rows

#: the storage types the kernel's matmuls take as they are
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
#: query rows per program (at most: fewer rows take the next power of two >= 16)
BLOCK_Q = 64
#: keys per step of a program's walk
BLOCK_K = 64
#: warps per program and software-pipeline stages of the key loop
NUM_WARPS = 4
NUM_STAGES = 2


def unsupported(dtype, head_dim: int) -> str | None:
    """Why the kernel cannot read keys and values of ``dtype`` at ``head_dim`` (None: it
    can)."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"values stored as {jnp.dtype(dtype).name}: it reads bfloat16 or float16"
    if head_dim < MIN_DOT or head_dim & (head_dim - 1):
        return f"head_dim {head_dim}: it reads power-of-two head dims >= {MIN_DOT}"
    return None


def _check_block(name: str, block: int | None) -> None:
    # the Triton lowering tiles in powers of two, and its matmuls need edges >= MIN_DOT
    if block is not None and (block < MIN_DOT or block & (block - 1)):
        raise ValueError(f"{name} must be a power of two >= {MIN_DOT}, got {block}")


def check_arrays(q, keys, values, q_positions, lengths, layer, sliding_window=None,
                 block_q=None, block_k=None) -> None:
    """The checks of :func:`chunk_attention` (and of its reference):
    ``NotImplementedError`` where the kernel cannot serve the arrays, ``ValueError``
    where they are malformed."""
    batch, heads, head_dim = check_query(
        "chunk_attention", q, functools.partial(unsupported, keys.dtype))
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a float array, got {q.dtype.name}")
    check_stack("keys", keys, batch, heads, layer, head_dim, f"D = {head_dim}",
                axes="S, D")
    if values.shape != keys.shape or values.dtype != keys.dtype:
        raise ValueError(f"values must match keys ({keys.shape} {keys.dtype.name}), got "
                         f"{values.shape} {values.dtype.name}")
    rows = (batch, q.shape[2])
    if q_positions.shape != rows or not jnp.issubdtype(q_positions.dtype, jnp.integer):
        raise ValueError(f"q_positions must be integers of shape {rows}, got "
                         f"{q_positions.shape} {q_positions.dtype.name}")
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be integers of shape {(batch,)}, got "
                         f"{lengths.shape} {lengths.dtype.name}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "block_q", "block_k", "num_warps",
                     "num_stages", "order", "interpret"),
)
def chunk_attention(
    q: jax.Array,            # [B, K, G*T, D] float: the chunk's queries of kv head k
    keys: jax.Array,         # [B, K, S, D] ([L, B, K, S, D] with layer) bfloat16 or float16
    values: jax.Array,       # like keys
    q_positions: jax.Array,  # int32 [B, G*T]: the absolute position of each query row
    lengths: jax.Array,      # int32 [B]: keys per row, the chunk's own included
    layer: jax.Array | None = None,  # int32 []: the layer of the stacks to read
    *,
    sm_scale: float,         # logits are sm_scale * q . k
    sliding_window: int | None = None,  # a query sees its last sliding_window positions
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    order: str = "rows",     # the grid's order (kernel.ORDERS)
    interpret: bool | None = None,  # Pallas interpret mode; default: off a GPU
) -> jax.Array:
    """Causal attention of a chunk's query rows over the stored keys: ``o [B, K, G*T, D]``
    float32, normalized; a row that sees no key gets zeros.

    Row ``r`` of kv head ``k`` is query head ``k * G + r // T`` at the chunk's token
    ``r % T`` (the order of :func:`kvjax.attention.reference.group_queries`);
    ``q_positions`` give each row's position, so for a chunk starting at ``start[b]``
    they are ``start[b] + r % T``. Key slot ``s`` holds position ``s``, and is visible to
    row ``r`` of row ``b`` iff ``s < lengths[b]``, ``s <= q_positions[b, r]`` and, with a
    sliding window, ``s > q_positions[b, r] - sliding_window``.

    The query is rounded to the values' type for the matmuls, which accumulate in
    float32; the softmax is float32. ``block_q`` query rows per program (default
    :data:`BLOCK_Q`, fewer for a short chunk), ``block_k`` keys per step (default
    :data:`BLOCK_K`), both powers of two >= 16. Raises ``NotImplementedError`` when the
    kernel cannot serve these arrays (:func:`unsupported`), ``ValueError`` when they are
    malformed.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    check_arrays(q, keys, values, q_positions, lengths, layer, sliding_window, block_q,
                 block_k)
    rows, head_dim = q.shape[2:]
    slots = keys.shape[-2]
    if slots == 0 or rows == 0:
        return jnp.zeros(q.shape, jnp.float32)
    block_q = block_q or min(BLOCK_Q, query_rows(rows, head_dim))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    padded = -(-rows // block_q) * block_q
    # padded rows repeat the last row's position: they widen no program's walk
    q = jnp.pad(q.astype(keys.dtype), ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    positions = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, padded - rows)),
                        mode="edge")
    o = chunk_call(q, positions, keys, values, jnp.clip(lengths, 0, slots), layer,
                   sm_scale=sm_scale, window=sliding_window, block_q=block_q,
                   block_k=block_k or BLOCK_K, num_warps=num_warps or NUM_WARPS,
                   num_stages=num_stages or NUM_STAGES, order=order, interpret=interpret)
    return o[:, :, :rows]
