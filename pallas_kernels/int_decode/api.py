"""Layer-level decode attention over an ``int:N`` / SAW cache with the fused kernel.

:func:`decode_attention` takes one decode query per row and a layer view of a
:mod:`kvjax.cache` whose K and V are stored by :class:`~kvjax.codecs.IntCodec` or
:class:`~kvjax.codecs.SawCodec` codes. The kernel reads the coded region; the raw regions
(sinks, and the residual window with the unfinished block) are a few dozen bf16 tokens
and are attended in jnp; the partial softmaxes are merged exactly. :func:`why_not`
says, in one line, why a configuration cannot use the kernel (``None`` when it can), so
callers fall back to the reference with that message.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kvjax.cache import Segment
from kvjax.codecs import IntCodec, SawCodec
from kvjax.primitives.packing import is_planar
from pallas_kernels.int_decode.kernel import (
    MIN_DOT,
    codes_partial,
    operand_width,
    pad_query_rows,
)
from pallas_kernels.int_decode.reference import (
    NEG,
    codes_partial_reference,
    dense_partial,
    merge_partials,
    normalize,
)

#: bit widths whose planar packing puts whole dims in each bit slot of a 32-bit word
KERNEL_BITS = (2, 4, 8)
#: multiprocessors of an H200, and the warps of this kernel one holds at once (its
#: ~120 registers per thread allow 16, measured with Nsight Compute)
SMS = 132
WARPS_PER_SM = 16
#: warps per program: 2 measured fastest (docs/kernels.md)
NUM_WARPS = 2
#: wave occupancy good enough to stop adding splits at
GOOD_WAVES = 0.9
#: at most this many waves when looking for a split count that fills them
MAX_WAVES = 4


def why_not(layer: Segment, num_queries: int, sliding_window: int | None) -> str | None:
    """Why the fused kernel cannot serve this call (``None``: it can)."""
    k, v = layer.k.codec, layer.v.codec
    head_dim = layer.k.raw.shape[-1]
    if num_queries != 1:
        return f"it decodes one query token per row, got {num_queries}"
    if sliding_window is not None:
        return "it has no sliding window"
    for role, codec in (("K", k), ("V", v)):
        if not isinstance(codec, IntCodec | SawCodec):
            return f"{role} uses '{codec.spec}', not int:N or saw"
    if k.bits != v.bits:
        return f"K and V bit widths differ ({k.bits} vs {v.bits})"
    if k.bits not in KERNEL_BITS:
        return f"{k.bits}-bit codes are not planar-packed (kernel bits: {KERNEL_BITS})"
    if head_dim < MIN_DOT or head_dim & (head_dim - 1) or not is_planar(head_dim, k.bits):
        return f"head_dim {head_dim} is not a power of two >= {MIN_DOT}"
    return None


def _per_head(fn, params, x: jax.Array) -> jax.Array:
    """``fn(params_k, x[:, k])`` for every kv head ``k`` of ``x [B, K, G, D]``."""
    return jax.vmap(fn, in_axes=(0, 1), out_axes=1)(params, x)


def _meta(codes) -> tuple[jax.Array, jax.Array, jax.Array]:
    # [..., S, 1] -> [..., S]: drops a unit axis, no copy
    return codes["codes"], codes["scale"][..., 0], codes["zero"][..., 0]


def default_blocking(block_s: int | None, num_stages: int | None) -> tuple[int, int]:
    """Tokens per block and pipeline stages: 128 and 3, measured best on the H200 at
    one row and 128k tokens as at 32 rows and 32k tokens (docs/kernels.md)."""
    return block_s or 128, num_stages or 3


def default_splits(batch: int, heads: int, slots: int, block_s: int,
                   num_warps: int = NUM_WARPS) -> int:
    """Splits of the cache length so the ``batch * heads * splits`` programs fill whole
    waves of the GPU: a last, partial wave runs at the speed of a full one (with 768
    programs, 1.45 waves, Nsight Compute estimated half the time lost to the tail). The
    fewest splits whose waves are at least ``GOOD_WAVES`` full, else the fullest."""
    rows = batch * heads
    wave = SMS * WARPS_PER_SM // num_warps
    most = max(1, min(math.ceil(slots / block_s), MAX_WAVES * wave // rows))

    def fill(splits: int) -> float:
        programs = rows * splits
        return programs / (math.ceil(programs / wave) * wave)

    good = [s for s in range(1, most + 1) if fill(s) >= GOOD_WAVES]
    return good[0] if good else max(range(1, most + 1), key=fill)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "block_s", "splits", "num_warps", "num_stages", "interpret",
                     "use_kernel"),
)
def decode_attention(
    q: jax.Array,
    layer: Segment,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    block_s: int | None = None,
    splits: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int | None = None,
    interpret: bool | None = None,
    use_kernel: bool = True,
) -> jax.Array:
    """Attention of one decode query per row, ``q [B, N, D] -> [B, N, D]``.

    ``layer`` is a layer view that already holds the query's own token (append, then
    attend) and ``lengths [B]`` its rows' token counts. ``interpret`` defaults to True off
    GPU (Pallas interpret mode); ``use_kernel=False`` computes the coded region with the
    pure-jnp reference instead (same merge), the specification the kernel is tested
    against. ``block_s``, ``splits`` and ``num_stages`` default to
    :func:`default_blocking` and :func:`default_splits`. Raises ``ValueError`` with
    :func:`why_not`'s reason when the kernel does not apply.
    """
    reason = why_not(layer, 1, None)
    if reason is not None:
        raise ValueError(f"int_decode kernel does not apply: {reason}")
    batch, num_heads, head_dim = q.shape
    k_store, v_store = layer.k, layer.v
    heads = k_store.raw.shape[1]
    group = num_heads // heads
    sm_scale = head_dim**-0.5 if scale is None else scale
    qg = q.astype(jnp.float32).reshape(batch, heads, group, head_dim)
    n_sink, n_comp, n_raw = k_store.counts(lengths)

    # in a scan over layers the codes are the segment's whole stack (Store.layer)
    k_codes, k_scale, k_zero = _meta(k_store.codes)
    v_codes, v_scale, v_zero = _meta(v_store.codes)
    layer = k_store.layer
    bits = k_store.codec.bits
    # SAW keys are stored rotated: rotate the query once, (R q) . (R k) = q . k
    q_coded = qg
    if isinstance(k_store.codec, SawCodec):
        q_coded = _per_head(k_store.codec.rotate, k_store.params, qg)
    if k_codes.shape[-2] == 0:
        # a residual window as long as the cache: nothing is ever coded
        coded = (jnp.zeros_like(qg), jnp.full(qg.shape[:-1], NEG, jnp.float32),
                 jnp.zeros(qg.shape[:-1], jnp.float32))
    elif use_kernel:
        q_rows = pad_query_rows(q_coded, operand_width(head_dim, bits))
        block_s, stages = default_blocking(block_s, num_stages)
        n_splits = splits or default_splits(batch, heads, k_codes.shape[-2], block_s,
                                            num_warps)
        if interpret is None:
            interpret = jax.default_backend() != "gpu"
        o, m, l = codes_partial(
            q_rows, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_comp, None, layer,
            bits=bits, sm_scale=sm_scale, block_s=block_s, splits=n_splits,
            num_warps=num_warps, num_stages=stages, interpret=interpret,
        )
        coded = merge_partials((o[..., :group, :], m[..., :group], l[..., :group]), axis=2)
    else:
        k_codes, k_scale, k_zero = _meta(k_store.layer_codes())
        v_codes, v_scale, v_zero = _meta(v_store.layer_codes())
        coded = codes_partial_reference(
            q_coded, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_comp, bits=bits,
            sm_scale=sm_scale,
        )
    if isinstance(v_store.codec, SawCodec) and v_store.codec.rotate_values:
        # values were stored as R v: the coded partial's output is R o, rotate it back
        o, m, l = coded
        coded = (_per_head(v_store.codec.unrotate, v_store.params, o), m, l)

    parts = [coded]
    sink_ok = jnp.arange(k_store.sinks)[None, :] < n_sink[:, None]
    raw_ok = jnp.arange(k_store.raw_capacity)[None, :] < n_raw[:, None]
    if k_store.sinks:
        parts.append(dense_partial(qg, k_store.sink, v_store.sink, sink_ok, sm_scale=sm_scale))
    if k_store.raw_capacity:
        parts.append(dense_partial(qg, k_store.raw, v_store.raw, raw_ok, sm_scale=sm_scale))
    out = normalize(*merge_partials(parts))
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)
