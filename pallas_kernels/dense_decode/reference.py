"""Pure-jnp specification of the dense decode-attention kernel.

:func:`dense_decode` has the signature of :func:`.api.dense_decode` and returns the same
partial softmax ``(o, m, l)``, exactly: the stored values widened to float32, every
product float32 at HIGHEST precision. The kernel rounds the query and the
probabilities to the values' 16-bit type; its tests state the tolerance that costs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dense_decode.api import check_arrays
from pallas_kernels.flash import NUM_WARPS, layer_arrays, paged_rows, visible_slots
from pallas_kernels.partial import dense_partial


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_s", "splits", "num_warps", "num_stages",
                     "interpret", "page_tokens"),
)
def dense_decode(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    lengths: jax.Array,
    layer: jax.Array | None = None,
    pages: jax.Array | None = None,
    *,
    sm_scale: float,
    page_tokens: int = 0,
    block_s: int | None = None,
    splits: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The specification of :func:`.api.dense_decode`: same arguments, same checks, the
    exact partial. The blocking and interpret arguments only shape the kernel's
    schedule and are ignored here."""
    del block_s, splits, num_warps, num_stages, interpret
    check_arrays(q, keys, values, lengths, layer, pages, page_tokens)
    pool_tokens = keys.shape[-2]
    keys, values = (a.astype(jnp.float32) for a in paged_rows(
        layer_arrays((keys, values), layer), pages, page_tokens, pool_tokens))
    valid = visible_slots(lengths, keys.shape[2])
    return dense_partial(q.astype(jnp.float32), keys, values, valid, sm_scale=sm_scale)
