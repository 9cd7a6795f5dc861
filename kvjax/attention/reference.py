"""The float32 reference attention over a compressed cache: the specification.

Queries ``q[B, T, N, D]`` at absolute positions ``start + t`` attend causally
(bottom-right aligned: the last query sees every stored token) to the stored tokens of
one layer view: raw sinks, compressed blocks and the raw recent region. Query head ``n``
reads kv head ``n // G`` (``G = N / K``), as in HF's ``repeat_kv``.

A chunk is appended *before* it attends, so its queries see the cache as it stores the
chunk: tokens outside the residual window (counted from the end of the chunk) are read
back from their codes. This is what makes a prefill perplexity measure the codec.

Numerics: scores and softmax in float32, masked logits set to ``finfo(float32).min``
(not ``-inf``), and a query with no visible key returns zeros rather than NaN. Every codec
is served: keys are scored by the codec's own :meth:`~kvjax.codec.Codec.scores` (an
estimator where the codec has one) and values decoded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.attention.dispatch import Call
from kvjax.cache import Store, decode_heads, dense, token_parts
from kvjax.codec import EXACT
from pallas_kernels.partial import NEG


def group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """``q[B, T, N, D] -> [B, K, G*T, D]`` (rows ordered ``g * T + t``)."""
    batch, num_tokens, num_heads, head_dim = q.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split over {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    q = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim)
    return q.transpose(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * num_tokens, head_dim)


def row_positions(positions: jax.Array, group: int) -> jax.Array:
    """The position of each grouped query row: ``positions [B, T] -> [B, G*T]`` in
    :func:`group_queries`' row order (``g * T + t``)."""
    return jnp.tile(positions.astype(jnp.int32), (1, group))


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


def supports(call: Call) -> str | None:
    """The reference serves every call."""
    del call
    return None


def run(call: Call) -> jax.Array:
    """Float32 attention of ``call.q [B, T, N, D]`` over every stored token it may see."""
    q, layer, step = call.q, call.layer, call.step
    num_tokens = q.shape[1]
    qg = group_queries(q.astype(jnp.float32), layer.k.raw.shape[1])
    scores, key_pos, key_ok = _key_scores(layer.k, qg, call.lengths)
    values = _values_at(layer.v, call.lengths, key_pos, layer.k.block)

    q_pos = row_positions(step.positions(num_tokens), qg.shape[2] // num_tokens)  # [B, R]
    visible = key_ok[:, None, :] & (key_pos[:, None, :] <= q_pos[:, :, None])
    if call.sliding_window is not None:
        visible &= key_pos[:, None, :] > q_pos[:, :, None] - call.sliding_window
    out = softmax_combine(scores * call.scale, visible[:, None], values)
    return ungroup_output(out, num_tokens)


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
    p = row_positions(q_positions, qg.shape[2] // num_tokens)[:, :, None]
    visible = (s < kv_lengths[:, None, None]) & (s <= p)
    if sliding_window is not None:
        visible &= s > p - sliding_window
    out = softmax_combine(scores, visible[:, None], vt)
    return ungroup_output(out, num_tokens).astype(q.dtype)
