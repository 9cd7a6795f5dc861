"""Pallas kernel: flash attention of a chunk of queries over keys and values stored as
16-bit floats, read in place from a stack of layers.

What it is for: a long prompt is prefilled chunk by chunk, and each chunk's queries
attend to every token before them. Attention that walks the cache in windows with XLA
matmuls writes each window's float32 scores ``[B, K, R, W]`` to memory and reads them
back for the softmax; here a program keeps the scores of its block of query rows
against one block of keys in registers, folds them into an online softmax and moves
on, so only the output is ever written.

Grid ``(B, K, query blocks)`` (or ``(query blocks, K, B)``: :data:`ORDERS`): a program
holds ``block_q`` query rows of one (row, kv head) and walks the key blocks any of them
can see, from the sliding window's start
(or 0) to the block's largest position (or the row's length). Blocks every row sees
whole run without masks; the blocks at the window's edge, on the causal diagonal and at
the row's length are masked, and load nothing past the length. The matmul operands are
the stored values themselves (bfloat16 or float16) and the query and probabilities
rounded to the same type; accumulation and the softmax are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.flash import dot_nn, dot_nt, softmax_step, stacked_spec
from pallas_kernels.partial import NEG

#: the grid's order: ``"rows"`` ``(B, K, query blocks)``, ``"queries"`` ``(query blocks,
#: K, B)``. A GPU starts a grid's programs with the first axis varying fastest (CUDA's
#: usual block order, not a promise), so under ``"queries"`` the programs in flight
#: together would be the query blocks of a few (row, kv head) pairs, which read the same
#: keys and values (one pair's 32k keys and values are 16 MB: a few pairs fit the L2);
#: under ``"rows"`` they are the same query block of every pair, each with its own.
#: ``experiments/bench_prefill.py`` measures both.
ORDERS = ("rows", "queries")


def key_blocks(first, last, length, *, block_k: int, window: int | None, slots: int):
    """The key blocks a program walks, as block indices ``lo <= u0 <= u1 <= hi``: its rows
    see keys in blocks ``lo .. hi - 1`` only; those before ``u0`` need the window's mask,
    those from ``u1`` on the causal and length masks, and ``u0 .. u1 - 1`` none (every
    row sees every key in them). ``first``, ``last``: the smallest and largest query
    position of the program's rows; ``length``: the row's stored keys (at most
    ``slots``, the stack's key axis). Also what the kernel's tests check the walk by."""
    stop = jnp.clip(last + 1, 0, length)  # no row sees a key at or past it
    start = 0 if window is None else jnp.clip(first - window + 1, 0, stop)
    lo, hi = start // block_k, pl.cdiv(stop, block_k)
    u0 = lo
    if window is not None:
        # a key every row's window holds is past the last row's window start
        u0 = jnp.clip(pl.cdiv(jnp.maximum(last - window + 1, 0), block_k), lo, hi)
    if slots < block_k:
        # a stack shorter than one block has no whole block (and no unmasked tile shape)
        return lo, u0, u0, hi
    # a key every row sees causally is at or before the first row's position
    u1 = jnp.clip(jnp.clip(first + 1, 0, length) // block_k, u0, hi)
    return lo, u0, u1, hi


def _kernel(n_ref, layer_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, *, block_k, sm_scale,
            window):
    rows, head_dim = q_ref.shape
    slots = k_ref.shape[1]
    dtype = k_ref.dtype
    n = n_ref[0]
    layer = layer_ref[0]
    pos = pos_ref[...]
    q = q_ref[...]
    lo, u0, u1, hi = key_blocks(jnp.min(pos), jnp.max(pos), n, block_k=block_k,
                                window=window, slots=slots)

    def body(j, carry, masked):
        acc, m_prev, l_prev = carry
        k0 = j * block_k
        tile = pl.ds(k0, block_k)
        if masked:
            kpos = k0 + jnp.arange(block_k, dtype=jnp.int32)
            inside = kpos < n
            # nothing past the length is read: those slots may hold anything, NaN too
            keys = plgpu.load(k_ref.at[layer, tile, :], mask=inside[:, None], other=0)
            vals = plgpu.load(v_ref.at[layer, tile, :], mask=inside[:, None], other=0)
            visible = inside[None, :] & (kpos[None, :] <= pos[:, None])
            if window is not None:
                visible &= kpos[None, :] > pos[:, None] - window
        else:
            keys, vals = k_ref[layer, tile, :], v_ref[layer, tile, :]
        p, correction, m_next, l_next = softmax_step(dot_nt(q, keys) * sm_scale, m_prev,
                                                     l_prev, visible if masked else None)
        acc = acc * correction[:, None] + dot_nn(p.astype(dtype), vals)
        return acc, m_next, l_next

    carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    if window is not None:
        # without a window the walk starts unmasked at 0 (no loop of static bounds 0, 0)
        carry = jax.lax.fori_loop(lo, u0, functools.partial(body, masked=True), carry)
    if slots >= block_k:
        carry = jax.lax.fori_loop(u0, u1, functools.partial(body, masked=False), carry)
    acc, _, l = jax.lax.fori_loop(u1, hi, functools.partial(body, masked=True), carry)
    # a row that saw no key has acc = 0 and l = 0: its output is 0
    o_ref[...] = acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[:, None]


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "window", "block_q", "block_k", "num_warps", "num_stages",
                     "order", "interpret"),
)
def chunk_call(q, positions, keys, values, lengths, layer=None, *, sm_scale: float,
               window: int | None, block_q: int, block_k: int, num_warps: int,
               num_stages: int, interpret: bool, order: str = "rows"):
    """The ``pallas_call``: ``q [B, K, R, D]`` in the stored type with ``R`` a multiple of
    ``block_q``, ``positions [B, R]`` int32, ``keys`` and ``values`` ``[L, B, K, S, D]``
    (``layer`` None: ``[B, K, S, D]``), ``lengths [B]`` int32 at most ``S``. Returns the
    normalized output ``[B, K, R, D]`` float32; ``order`` one of :data:`ORDERS`; no check
    (:func:`.api.chunk_attention` does them)."""
    batch, heads, rows, head_dim = q.shape
    if layer is None:
        keys, values, layer = keys[None], values[None], 0
    layers, slots = keys.shape[0], keys.shape[3]
    kernel = functools.partial(_kernel, block_k=block_k, sm_scale=sm_scale, window=window)
    query_block = pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i: (b, h, i, 0))
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, i: (b,)),
        pl.BlockSpec((1,), lambda b, h, i: (0,)),
        pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),
        query_block,
        stacked_spec(layers, slots, head_dim),
        stacked_spec(layers, slots, head_dim),
    ]
    grid = (batch, heads, rows // block_q)
    if order == "queries":
        def swap(spec):
            return pl.BlockSpec(spec.block_shape,
                                lambda i, h, b, index=spec.index_map: index(b, h, i))
        in_specs, query_block, grid = [swap(s) for s in in_specs], swap(query_block), grid[::-1]
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=query_block,
        out_shape=jax.ShapeDtypeStruct((batch, heads, rows, head_dim), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="chunk_attention",
    )(lengths.astype(jnp.int32), jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
      positions.astype(jnp.int32), q, keys, values)
