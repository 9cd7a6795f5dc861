"""Attention over a compressed cache: the pure-jnp reference that kernels are tested against.

Queries ``q[B, T, N, D]`` at absolute positions ``start + t`` attend causally
(bottom-right aligned: the last query sees every stored token) to the stored tokens of
one layer view: raw sinks, compressed blocks and the raw recent region. Query head ``n``
reads kv head ``n // G`` (``G = N / K``), as in HF's ``repeat_kv``.

A chunk is appended *before* it attends, so its queries see the cache as it stores the
chunk: tokens outside the residual window (counted from the end of the chunk) are read
back from their codes. This is what makes a prefill perplexity measure the codec.

Numerics: scores and softmax in float32, masked logits set to ``finfo(float32).min``
(not ``-inf``), and a query with no visible key returns zeros rather than NaN.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from kvjax.cache import Segment, Step, Store, decode_heads, decode_window, dense, token_parts
from kvjax.codec import EXACT

#: the masked logit (finite, so a row with no visible key stays NaN-free)
NEG = float(jnp.finfo(jnp.float32).min)

#: "reference": this module's float32 jnp attention; "pallas": the fused decode kernel of
#: :mod:`pallas_kernels.int_decode` where it applies (one query token per row over
#: int:N / SAW codes), else the reference with a warning that says why; "xla": bfloat16
#: matmul operands with float32 accumulation and softmax over windows of the cache
#: (:func:`_windowed_attention`) for one query token per row over a ``bf16`` cache (on
#: a GPU, cuDNN where the cache is one dense region) and for any chunk of several
#: tokens, else (other one-token decodes, estimator codecs) the
#: reference; "auto": on a GPU the kernel where it applies, else the "xla" paths, else
#: silently the reference; on a CPU the reference. Models use "auto".
IMPLS = ("reference", "pallas", "auto", "xla")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl '{impl}'; available: {', '.join(IMPLS)}")


def _pallas_decode(q, layer, lengths, scale, sliding_window, *, warn: bool):
    """The fused kernel's output, or None when it does not apply (warned if ``warn``)."""
    from pallas_kernels.int_decode import api

    reason = api.why_not(layer, q.shape[1], sliding_window)
    if reason is not None:
        if warn:
            warnings.warn(f"impl='pallas': the int_decode kernel does not apply ({reason}); "
                          "using the reference attention", stacklevel=3)
        return None
    return api.decode_attention(q[:, 0], layer, lengths, scale=scale)[:, None]


def _bf16_decode(q, layer, step, lengths, scale, sliding_window):
    """Decode over a cache whose K and V are both stored by the ``bf16`` codec, or None
    where it does not apply: on a GPU, when every token sits in the one dense region (no
    sinks, no residual window, no sliding window), cuDNN's fused attention; otherwise
    :func:`_windowed_attention`. The reference upcasts every stored value to float32
    first; this is the bf16 cache's speed path, what a compressed cache's decode is
    compared with end to end."""
    from kvjax.codecs import Bf16Codec

    k_store, v_store = layer.k, layer.v
    if (q.shape[1] != 1 or not isinstance(k_store.codec, Bf16Codec)
            or not isinstance(v_store.codec, Bf16Codec)):
        return None
    if jax.default_backend() == "gpu" and sliding_window is None and all(
            s.sinks == 0 and s.raw_capacity == 0 for s in (k_store, v_store)):
        # every token is in the one dense region, position == slot: cuDNN's fused
        # attention (twice as fast as XLA matmuls at B=8, S=32k on the H200)
        qg = group_queries(q, k_store.raw.shape[1]).astype(jnp.bfloat16)
        o = _cudnn_decode(qg, k_store.codec.values(k_store.layer_codes()),
                          v_store.codec.values(v_store.layer_codes()), lengths, scale)
        return ungroup_output(o, 1)
    return _windowed_attention(q, layer, step, lengths, scale, sliding_window)


#: key positions per step of :func:`_windowed_attention` (its float32 scores are
#: ``[B, N, T, WINDOW]``: 64 MiB per row for a 1024-token chunk of 32 query heads)
WINDOW = 512


def _windowed_attention(q, layer, step, lengths, scale, sliding_window, window=WINDOW):
    """Attention of any chunk with bfloat16 matmul operands, walking the cache in windows
    of :data:`WINDOW` positions with an online softmax (float32 max, sum and output), or
    None where a codec's scores are not ``q . decode(codes)`` (an estimator of its own).

    Each ``window`` positions' K and V are decoded to bfloat16 (:func:`kvjax.cache.decode_window`);
    windows past the chunk's last query (causal) or before its first one's sliding window
    are never visited. Memory stays at one window whatever the context; the reference
    materializes float32 scores against the whole capacity, which a long prompt cannot
    afford on any device.
    """
    k_store, v_store = layer.k, layer.v
    if not (k_store.codec.scores_reconstruct and v_store.codec.scores_reconstruct):
        return None
    bf16, f32 = jnp.bfloat16, jnp.float32
    num_tokens = q.shape[1]
    qg = group_queries(q, k_store.raw.shape[1]).astype(bf16)  # [B, K, R, D]
    group = qg.shape[2] // num_tokens
    q_pos = jnp.tile(step.positions(num_tokens), (1, group))  # [B, R]
    size = min(window, k_store.max_len)
    lo = 0
    if sliding_window is not None:
        lo = jnp.maximum(jnp.min(q_pos) - sliding_window + 1, 0) // size
    hi = jnp.minimum(jnp.max(q_pos), k_store.max_len - 1) // size + 1

    def body(i, carry):
        m, l, o = carry
        first = (i * size).astype(jnp.int32)
        keys, ok = decode_window(k_store, lengths, first, size, bf16)
        vals, _ = decode_window(v_store, lengths, first, size, bf16)
        kpos = first + jnp.arange(size, dtype=jnp.int32)
        visible = ok[:, None, :] & (kpos[None, None, :] <= q_pos[:, :, None])
        if sliding_window is not None:
            visible &= kpos[None, None, :] > q_pos[:, :, None] - sliding_window
        visible = visible[:, None]  # [B, 1, R, W]
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


def _cudnn_decode(qg, keys, values, lengths, scale):
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


def group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """``q[B, T, N, D] -> [B, K, G*T, D]`` (rows ordered ``g * T + t``)."""
    batch, num_tokens, num_heads, head_dim = q.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split over {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    q = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim)
    return q.transpose(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * num_tokens, head_dim)


def ungroup_output(o: jax.Array, num_tokens: int) -> jax.Array:
    """Inverse of :func:`group_queries`: ``[B, K, G*T, D] -> [B, T, N, D]``."""
    batch, heads, rows, head_dim = o.shape
    group = rows // num_tokens
    o = o.reshape(batch, heads, group, num_tokens, head_dim).transpose(0, 3, 1, 2, 4)
    return o.reshape(batch, num_tokens, heads * group, head_dim)


def softmax_combine(scores: jax.Array, mask: jax.Array, v: jax.Array) -> jax.Array:
    """``softmax(scores) @ v`` over the masked key axis, in float32.

    scores ``[B, K, R, S]``, mask broadcastable to it, v ``[B, K, S, D]``; rows with no
    visible key give zeros.
    """
    logits = jnp.where(mask, scores, NEG)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkrs,bksd->bkrd", p, v.astype(jnp.float32), precision=EXACT)
    return out / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)


def _key_scores(store: Store, qg: jax.Array, lengths: jax.Array):
    """Scores of grouped queries against every key slot, with slot positions and validity."""
    scores, positions, valid = [], [], []
    for kind, payload, pos, ok in token_parts(store, lengths):
        if pos.shape[1] == 0:
            continue
        if kind == "codes":
            s = jax.vmap(store.codec.scores, in_axes=(0, 1, 1), out_axes=1)(
                store.params, qg, payload
            )
        else:
            keys = payload.astype(jnp.float32)
            s = jnp.einsum("bkrd,bksd->bkrs", qg, keys, precision=EXACT)
        scores.append(s)
        positions.append(pos)
        valid.append(ok)
    return (jnp.concatenate(scores, -1), jnp.concatenate(positions, -1),
            jnp.concatenate(valid, -1))


def _values_at(store: Store, lengths: jax.Array, positions: jax.Array,
               k_block: int) -> jax.Array:
    """Decoded values ``[B, K, S, D]`` at the given key-slot positions ``[B, S]``.

    When V's blocks are as long as K's (``k_block``), its regions (sinks, codes, raw)
    hold the same positions in the same order as the key slots, so the decoded regions
    are simply laid end to end; otherwise (e.g. KIVI's channel-wise K blocks over
    token-wise V) they are placed by position in a dense array and gathered.
    """
    if store.block == k_block:
        parts = [decode_heads(store.codec, store.params, payload) if kind == "codes"
                 else payload.astype(jnp.float32)
                 for kind, payload, pos, _ in token_parts(store, lengths) if pos.shape[1]]
        return jnp.concatenate(parts, axis=2)
    values = dense(store, lengths)
    idx = jnp.clip(positions, 0, store.max_len - 1)
    return jax.vmap(lambda vv, ii: jnp.take(vv, ii, axis=1))(values, idx)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "impl"))
def attend(
    q: jax.Array,
    layer: Segment,
    step: Step,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    impl: str = "reference",
) -> jax.Array:
    """Attention of a chunk's queries ``q[B, T, N, D]`` over a layer view it was appended to.

    ``step`` is the :class:`~kvjax.cache.Step` of that append. ``scale`` defaults to
    ``D ** -0.5``; ``sliding_window`` limits each query to its last ``w`` positions
    (Mistral). Queries past a row's valid count get well-defined but meaningless output.
    ``impl`` picks the fused decode kernel where it applies (:data:`IMPLS`).
    Returns ``[B, T, N, D]`` in ``q.dtype``.
    """
    _check_impl(impl)
    num_tokens, head_dim = q.shape[1], q.shape[-1]
    heads = layer.k.raw.shape[1]
    if head_dim != layer.k.raw.shape[-1]:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {layer.k.raw.shape[-1]}")
    scale = head_dim**-0.5 if scale is None else scale
    lengths = jnp.minimum(step.start + step.valid, layer.k.max_len)
    on_gpu = impl == "auto" and jax.default_backend() == "gpu"
    if impl == "pallas" or on_gpu:
        fused = _pallas_decode(q, layer, lengths, scale, sliding_window,
                               warn=impl == "pallas")
        if fused is not None:
            return fused.astype(q.dtype)
    if impl == "xla" or on_gpu:
        if num_tokens == 1:
            out = _bf16_decode(q, layer, step, lengths, scale, sliding_window)
        else:
            out = _windowed_attention(q, layer, step, lengths, scale, sliding_window)
        if out is not None:
            return out.astype(q.dtype)
    qg = group_queries(q.astype(jnp.float32), heads)
    scores, key_pos, key_ok = _key_scores(layer.k, qg, lengths)
    values = _values_at(layer.v, lengths, key_pos, layer.k.block)

    q_pos = step.positions(num_tokens)  # [B, T]
    group = qg.shape[2] // num_tokens
    q_pos = jnp.tile(q_pos, (1, group))  # rows ordered g * T + t
    visible = key_ok[:, None, :] & (key_pos[:, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        visible &= key_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    out = softmax_combine(scores * scale, visible[:, None], values)
    return ungroup_output(out, num_tokens).astype(q.dtype)


def decode_attention(q: jax.Array, layer: Segment, step: Step, **kw) -> jax.Array:
    """One decode token per row: ``q[B, N, D] -> [B, N, D]`` (see :func:`attend`)."""
    return attend(q[:, None], layer, step, **kw)[:, 0]


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window"))
def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    kv_lengths: jax.Array,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Unquantized causal GQA attention: ``q[B, T, N, D]``, ``k, v[B, S, K, D]``.

    Key ``s`` sits at position ``s`` and is visible to a query at position ``p`` when
    ``s < kv_lengths[b]`` and ``s <= p`` (and ``s > p - sliding_window``).
    """
    num_tokens, head_dim = q.shape[1], q.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    heads = k.shape[2]
    qg = group_queries(q.astype(jnp.float32), heads)
    kt = jnp.swapaxes(k, 1, 2).astype(jnp.float32)
    vt = jnp.swapaxes(v, 1, 2)
    scores = jnp.einsum("bkrd,bksd->bkrs", qg, kt, precision=EXACT) * scale
    s = jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, :]
    group = qg.shape[2] // num_tokens
    p = jnp.tile(q_positions, (1, group))[:, :, None]
    visible = (s < kv_lengths[:, None, None]) & (s <= p)
    if sliding_window is not None:
        visible &= s > p - sliding_window
    out = softmax_combine(scores, visible[:, None], vt)
    return ungroup_output(out, num_tokens).astype(q.dtype)
