"""A chunk's attention through the fused flash-attention kernel of
:mod:`pallas_kernels.chunk_attention`: registered as ``"chunk_flash"``
(:mod:`kvjax.attention.registry`), the first choice of ``"auto"`` for chunks over a
16-bit cache on a GPU.

It serves chunks of several tokens whose K and V hold every token in the one dense
16-bit region of their codes (no sinks, no raw window: slot ``s`` is position ``s``):
the kernel reads the layer's stack in place at the layer's index, with the scores of a
block of queries against a block of keys kept in registers, a sliding window included.
A compressed cache's chunks are the fused kernels' over codes
(:func:`kvjax.attention.fused.merged_attention`), which walk the packed codes tile by
tile: no layer is ever decoded whole, so a prefill's memory does not grow with the
history.
"""

from __future__ import annotations

import jax

from kvjax.attention.dispatch import Call
from kvjax.attention.fused import dense_reads
from kvjax.attention.reference import group_queries, row_positions, ungroup_output
from kvjax.cache import Segment
from pallas_kernels.chunk_attention import api


def _in_place(layer: Segment, head_dim: int):
    """The K and V dense formats the kernel reads the layer's codes in place by, or why
    it cannot (a string)."""
    for role, store in (("K", layer.k), ("V", layer.v)):
        if store.sinks or store.raw_capacity:
            return f"{role} keeps tokens in sinks or a raw window beside its codes"
        if store.page_blocks:
            return f"{role} is paged: its tokens are not at their positions"
    return dense_reads(layer.k.codec, layer.v.codec, head_dim, unsupported=api.unsupported)


def in_place_reason(layer: Segment, head_dim: int) -> str | None:
    """Why the kernel cannot read the layer's keys and values where they are stored, as
    the codes of a dense 16-bit region holding every token at its position (None: it
    can)."""
    formats = _in_place(layer, head_dim)
    return formats if isinstance(formats, str) else None


def supports(call: Call) -> str | None:
    """None where :func:`run` serves the call, else why not."""
    if call.num_tokens == 1:
        return "it attends chunks of several query tokens, got one (a decode)"
    return in_place_reason(call.layer, call.head_dim)


def run(call: Call, **options) -> jax.Array:
    """``[B, T, N, D]`` float32 attention of the chunk's queries over every stored token
    they may see. ``options`` go to the kernel's entry (blocking, ``interpret``)."""
    q, layer, num_tokens = call.q, call.layer, call.num_tokens
    k_fmt, v_fmt = _in_place(layer, call.head_dim)
    qg = group_queries(q, layer.k.raw.shape[1])  # rows ordered g * T + t
    q_pos = row_positions(call.step.positions(num_tokens), qg.shape[2] // num_tokens)
    # in a scan over layers the codes are the segment's whole stack (Store.layer)
    o = api.chunk_attention(qg, k_fmt.values(layer.k.codes), v_fmt.values(layer.v.codes),
                            q_pos, call.lengths, layer.k.layer, sm_scale=call.scale,
                            sliding_window=call.sliding_window, **options)
    return ungroup_output(o, num_tokens)
