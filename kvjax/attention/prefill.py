"""A chunk's attention through the fused flash-attention kernel of
:mod:`pallas_kernels.chunk_attention`: registered as ``"chunk_flash"``
(:mod:`kvjax.attention.registry`), the first choice of ``"auto"`` for chunks on a GPU.

It serves what ``"xla"``'s windowed attention serves for chunks of several tokens (a
codec whose scores are ``q . decode(codes)``), with the scores of a block of queries
against a block of keys kept in registers instead of written to memory window by window.
Where K and V hold every token in the one dense 16-bit region of their codes (no sinks,
no raw window: slot ``s`` is position ``s``), the kernel reads the layer's stack in place
at the layer's index; otherwise the layer's history is first decoded to bfloat16 in
position order and the kernel reads that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.attention.dispatch import Call
from kvjax.attention.fused import dense_reads
from kvjax.attention.reference import group_queries, ungroup_output
from kvjax.cache import Segment, dense
from pallas_kernels.chunk_attention import api


def supports(call: Call) -> str | None:
    """None where :func:`run` serves the call, else why not."""
    if call.num_tokens == 1:
        return "it attends chunks of several query tokens, got one (a decode)"
    for role, codec in (("K", call.layer.k.codec), ("V", call.layer.v.codec)):
        if not codec.scores_reconstruct:
            return f"{role} codec '{codec.spec}' scores keys by an estimator of its own"
    # the history decoded to bfloat16 meets the kernel's rules wherever the codes do not
    return api.unsupported(jnp.bfloat16, call.head_dim)


def _in_place(layer: Segment, head_dim: int):
    """The K and V dense formats the kernel reads the layer's codes in place by, or why
    it cannot (a string)."""
    for role, store in (("K", layer.k), ("V", layer.v)):
        if store.sinks or store.raw_capacity:
            return f"{role} keeps tokens in sinks or a raw window beside its codes"
    return dense_reads(layer.k.codec, layer.v.codec, head_dim, unsupported=api.unsupported)


def in_place_reason(layer: Segment, head_dim: int) -> str | None:
    """Why the kernel cannot read the layer's keys and values where they are stored, as
    the codes of a dense 16-bit region holding every token at its position (None: it
    can)."""
    formats = _in_place(layer, head_dim)
    return formats if isinstance(formats, str) else None


def kernel_arrays(layer: Segment, lengths: jax.Array, head_dim: int):
    """``(keys, values, layer index)`` for the kernel: the stacks of the layer's codes and
    the view's index in them (None for a view of its own), read in place, where
    :func:`in_place_reason` allows; else the stored tokens decoded to bfloat16 ``[B, K,
    max_len, D]`` in position order (zeros past each row's length)."""
    formats = _in_place(layer, head_dim)
    if not isinstance(formats, str):
        k_fmt, v_fmt = formats
        # in a scan over layers the codes are the segment's whole stack (Store.layer)
        return k_fmt.values(layer.k.codes), v_fmt.values(layer.v.codes), layer.k.layer
    return (dense(layer.k, lengths, jnp.bfloat16), dense(layer.v, lengths, jnp.bfloat16),
            None)


def run(call: Call, **options) -> jax.Array:
    """``[B, T, N, D]`` float32 attention of the chunk's queries over every stored token
    they may see. ``options`` go to the kernel's entry (blocking, ``interpret``)."""
    q, layer, num_tokens = call.q, call.layer, call.num_tokens
    qg = group_queries(q, layer.k.raw.shape[1])  # rows ordered g * T + t
    group = qg.shape[2] // num_tokens
    q_pos = jnp.tile(call.step.positions(num_tokens), (1, group))
    keys, values, index = kernel_arrays(layer, call.lengths, call.head_dim)
    o = api.chunk_attention(qg, keys, values, q_pos, call.lengths, index,
                            sm_scale=call.scale, sliding_window=call.sliding_window,
                            **options)
    return ungroup_output(o, num_tokens)
