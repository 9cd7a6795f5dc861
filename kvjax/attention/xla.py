"""The XLA paths: bfloat16 matmul operands with float32 accumulation and softmax.

Registered as ``"xla"`` (:mod:`kvjax.attention.registry`). It serves every chunk of
several tokens (a prefill walks the cache in windows, :func:`windowed_attention`; keys
of an estimator's codec are scored by it), and one-token decodes over a cache whose
K and V are both stored dense in bfloat16 (a codec that offers a bf16
:class:`~kvjax.codec.DenseFormat`): on a GPU, when every token sits in the one dense
region, cuDNN's fused attention (:func:`cudnn_decode`); otherwise the windowed path. The
reference upcasts every stored value to float32 first; this is the bf16 cache's speed
path, what a compressed cache's decode is compared with end to end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.attention.dispatch import Call
from kvjax.attention.reference import group_queries, row_positions, ungroup_output
from kvjax.cache import decode_window, window_scores
from kvjax.codec import Codec, DenseFormat
from pallas_kernels.partial import NEG


def _bf16_values(codec: Codec):
    """The ``values`` of the bfloat16 dense format ``codec`` offers, or None."""
    for fmt in codec.kernel_formats():
        if isinstance(fmt, DenseFormat) and fmt.dtype == jnp.bfloat16:
            return fmt.values
    return None


def supports(call: Call) -> str | None:
    """None where :func:`run` serves the call, else why not."""
    k, v = call.layer.k.codec, call.layer.v.codec
    if call.num_tokens == 1:
        for role, codec in (("K", k), ("V", v)):
            if _bf16_values(codec) is None:
                return (f"a one-token decode runs over a bf16 cache only ({role} is "
                        f"'{codec.spec}')")
        return None
    return None


def run(call: Call) -> jax.Array:
    """``[B, T, N, D]`` float32: cuDNN for a one-token decode over one dense bf16 region
    on a GPU, else :func:`windowed_attention`."""
    q, layer = call.q, call.layer
    k_store, v_store = layer.k, layer.v
    if (call.num_tokens == 1 and jax.default_backend() == "gpu"
            and call.sliding_window is None
            and all(s.sinks == 0 and s.raw_capacity == 0 for s in (k_store, v_store))):
        # every token is in the one dense region, position == slot: cuDNN's fused
        # attention (twice as fast as XLA matmuls at B=8, S=32k on the H200)
        qg = group_queries(q, k_store.raw.shape[1]).astype(jnp.bfloat16)
        o = cudnn_decode(qg, _bf16_values(k_store.codec)(k_store.layer_codes()),
                         _bf16_values(v_store.codec)(v_store.layer_codes()), call.lengths,
                         call.scale)
        return ungroup_output(o, 1)
    return windowed_attention(q, layer, call.step, call.lengths, call.scale,
                              call.sliding_window)


#: key positions per step of :func:`windowed_attention` (its float32 scores are
#: ``[B, N, T, WINDOW]``: 64 MiB per row for a 1024-token chunk of 32 query heads)
WINDOW = 512


def windowed_attention(q, layer, step, lengths, scale, sliding_window, window=WINDOW):
    """Attention of any chunk with bfloat16 matmul operands, walking the cache in windows
    of :data:`WINDOW` positions with an online softmax (float32 max, sum and output).

    Each ``window`` positions' K and V are decoded to bfloat16 (:func:`kvjax.cache.decode_window`);
    windows past the chunk's last query (causal) or before its first one's sliding window
    are never visited. Memory stays at one window whatever the context; the reference
    materializes float32 scores against the whole capacity, which a long prompt cannot
    afford on any device. Keys whose codec scores by an estimator of its own (QJL) are
    scored by it, window by window, in float32 (:func:`kvjax.cache.window_scores`).
    """
    k_store, v_store = layer.k, layer.v
    estimator = not k_store.codec.scores_reconstruct
    bf16, f32 = jnp.bfloat16, jnp.float32
    num_tokens = q.shape[1]
    q_rows = group_queries(q, k_store.raw.shape[1])  # [B, K, R, D]
    qg = q_rows.astype(bf16)
    q_pos = row_positions(step.positions(num_tokens), qg.shape[2] // num_tokens)  # [B, R]
    size = min(window, k_store.max_len)
    lo = 0
    if sliding_window is not None:
        lo = jnp.maximum(jnp.min(q_pos) - sliding_window + 1, 0) // size
    hi = jnp.minimum(jnp.max(q_pos), k_store.max_len - 1) // size + 1

    def body(i, carry):
        m, l, o = carry
        first = (i * size).astype(jnp.int32)
        vals, ok = decode_window(v_store, lengths, first, size, bf16)
        kpos = first + jnp.arange(size, dtype=jnp.int32)
        visible = ok[:, None, :] & (kpos[None, None, :] <= q_pos[:, :, None])
        if sliding_window is not None:
            visible &= kpos[None, None, :] > q_pos[:, :, None] - sliding_window
        visible = visible[:, None]  # [B, 1, R, W]
        if estimator:
            s = window_scores(k_store, q_rows, lengths, first, size) * scale
        else:
            keys, _ = decode_window(k_store, lengths, first, size, bf16)
            s = jnp.einsum("bkrd,bksd->bkrs", qg, keys, preferred_element_type=f32) * scale
        s = jnp.where(visible, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
        o = alpha * o + jnp.einsum("bkrs,bksd->bkrd", p.astype(bf16), vals,
                                   preferred_element_type=f32)
        return m_new, l, o

    rows = (*qg.shape[:3], 1)
    init = (jnp.full(rows, NEG, f32), jnp.zeros(rows, f32), jnp.zeros(qg.shape, f32))
    _, l, o = jax.lax.fori_loop(lo, hi, body, init)
    o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
    return ungroup_output(o, num_tokens)


def cudnn_decode(qg, keys, values, lengths, scale):
    """cuDNN attention of grouped queries ``qg[B, K, G, D]`` over ``keys, values[B, K, S,
    D]`` (the cache's layout, read in place where JAX's cuDNN binding takes it; the
    public API's ``[B, S, K, D]`` costs a transpose) with per-row lengths; float32
    ``[B, K, G, D]``, zeros for an empty row."""
    batch, heads, group, head_dim = qg.shape
    q = qg.reshape(batch, heads * group, 1, head_dim)  # head k * G + g reads kv head k
    seq = jnp.maximum(lengths, 1).astype(jnp.int32)
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        o = cudnn.dot_product_attention(
            q, keys, values, q_seqlen=jnp.ones((batch,), jnp.int32), kv_seqlen=seq,
            scale=scale, mask_type=cudnn.MaskType.PADDING, qkv_layout="BNTH")
    except (ImportError, AttributeError, TypeError):
        o = jnp.swapaxes(jax.nn.dot_product_attention(
            jnp.swapaxes(q, 1, 2), jnp.swapaxes(keys, 1, 2), jnp.swapaxes(values, 1, 2),
            scale=scale, key_value_seq_lengths=seq, implementation="cudnn"), 1, 2)
    o = o.reshape(batch, heads, group, head_dim).astype(jnp.float32)
    return jnp.where((lengths > 0)[:, None, None, None], o, 0.0)
