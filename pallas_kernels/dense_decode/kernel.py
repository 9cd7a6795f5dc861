"""Pallas kernel: decode attention over keys and values stored as 16-bit floats,
flash-decoding as in :mod:`pallas_kernels.flash`.

What it is for: inside the models' loop over layers a cache's K and V are one stack
``[L, B, K, S, D]`` per segment, and a layer is read at its index. A library attention
such as cuDNN's takes a buffer, so XLA copies the layer's slice of the stack for it on
every step (for a bf16 cache at B = 8, S = 32k, 1 GiB per layer and step); this kernel
takes the stack and the index and reads the layer in place. The operands of its
matmuls are the stored values themselves (bfloat16 or float16) and the query rounded to
the same type; accumulation is float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash import (
    decode_call,
    dot_nn,
    dot_nt,
    leading_inputs,
    split_len,
    split_softmax,
    stacked_spec,
)


def _kernel(n_ref, layer_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_s,
            split_len, splits, sm_scale, page_tokens):
    rows, head_dim = q_ref.shape
    dtype = k_ref.dtype
    q = q_ref[...].astype(dtype)

    def scores(load):
        return dot_nt(q, load(k_ref)) * sm_scale

    def accumulate(acc, p, correction, load):
        return acc * correction[:, None] + dot_nn(p.astype(dtype), load(v_ref))

    acc, m, l = split_softmax(
        n_ref, layer_ref, rows=rows, slots=k_ref.shape[1], block_s=block_s,
        split_len=split_len, splits=splits, scores=scores, accumulate=accumulate,
        init=jnp.zeros((rows, head_dim), jnp.float32), page_tokens=page_tokens)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret", "page_tokens"),
)
def values_partial(q, keys, values, n_comp, layer=None, pages=None, *, sm_scale: float,
                   block_s: int, splits: int, num_warps: int, num_stages: int,
                   interpret: bool, page_tokens: int = 0):
    """Per-split partial softmaxes: ``q [B, K, R, D]`` (``R`` rows padded), ``keys`` and
    ``values`` stacked ``[L, B, K, S, D]`` (``layer`` None reads a stack of one), or a
    paged pool ``[L, 1, K, S, D]`` read through block tables ``pages [B, P]`` of
    ``page_tokens`` pages. Returns ``o [B, K, splits, R, D]``, ``m, l [B, K, splits,
    R]`` (float32); no check (:func:`.api.dense_decode` does them)."""
    batch, heads, rows, head_dim = q.shape
    if layer is None:
        keys, values, layer = keys[None], values[None], 0
    layers, slots = keys.shape[0], keys.shape[3]
    row_slots = slots if pages is None else pages.shape[1] * page_tokens
    kernel = functools.partial(_kernel, block_s=block_s,
                               split_len=split_len(row_slots, splits, block_s),
                               splits=splits, sm_scale=sm_scale, page_tokens=page_tokens)
    args, in_specs = leading_inputs(n_comp, layer, q, splits, pages)
    args += [keys, values]
    in_specs += [stacked_spec(layers, slots, head_dim, shared=pages is not None)] * 2
    return decode_call(kernel, args, in_specs, batch=batch, heads=heads, splits=splits,
                       rows=rows, head_dim=head_dim, num_warps=num_warps,
                       num_stages=num_stages, interpret=interpret,
                       name="dense_decode_attention")
