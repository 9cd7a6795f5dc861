"""Pure-jnp specification of the chunk-attention kernel.

:func:`chunk_attention` has the signature of :func:`.api.chunk_attention` and returns the
same normalized output, exactly: the stored values widened to float32, every product
float32 at HIGHEST precision (:func:`~pallas_kernels.partial.logits_partial`). The
kernel rounds the query and the probabilities to the values' 16-bit type; its tests
state the tolerance that costs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.chunk_attention.api import check_arrays
from pallas_kernels.flash import layer_arrays
from pallas_kernels.partial import EXACT, logits_partial, normalize


def visible(q_positions: jax.Array, lengths: jax.Array, slots: int,
            sliding_window: int | None = None) -> jax.Array:
    """``[B, R, S]``: whether key slot ``s`` (position ``s``) is visible to query row
    ``r`` of row ``b``: stored (``s < lengths[b]``), not in the row's future and, with a
    sliding window, within it."""
    s = jnp.arange(slots, dtype=jnp.int32)[None, None, :]
    p = q_positions.astype(jnp.int32)[:, :, None]
    ok = (s < lengths[:, None, None]) & (s <= p)
    if sliding_window is not None:
        ok &= s > p - sliding_window
    return ok


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "block_q", "block_k", "num_warps",
                     "num_stages", "interpret"),
)
def chunk_attention(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    q_positions: jax.Array,
    lengths: jax.Array,
    layer: jax.Array | None = None,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """The specification of :func:`.api.chunk_attention`: same arguments, same checks,
    the exact output. The blocking and interpret arguments only shape the kernel's
    schedule and are ignored here."""
    check_arrays(q, keys, values, q_positions, lengths, layer, sliding_window, block_q,
                 block_k)
    del block_q, block_k, num_warps, num_stages, interpret
    f32 = jnp.float32
    slots = keys.shape[-2]
    # slots past a row's length may hold anything (NaN too): they weigh nothing
    stored = (jnp.arange(slots)[None, :] < lengths[:, None])[:, None, :, None]
    keys, values = (jnp.where(stored, a.astype(f32), 0.0)
                    for a in layer_arrays((keys, values), layer))
    s = jnp.einsum("bkrd,bksd->bkrs", q.astype(f32), keys, precision=EXACT) * sm_scale
    return normalize(*logits_partial(s, values, visible(q_positions, lengths, slots,
                                                        sliding_window)))
