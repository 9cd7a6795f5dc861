"""KV-cache memory measured from encoded arrays: bytes per token and bytes at a context.

Nothing here is a bits formula. Each codec encodes one block of seeded random vectors
of one kv head, and the bytes of the arrays it returns (:func:`kvjax.codec.codes_nbytes`)
are the cost of that block; :func:`bytes_per_token` scales it to a model's layers and kv
heads, and :func:`cache_bytes` lays it out the way :func:`kvjax.cache.init_cache`
allocates a cache, so that it equals :func:`kvjax.cache.memory_bytes` of a real cache.

Units: bytes throughout; callers convert (the memory table reports GiB = 2**30 bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codec import Codec, codes_nbytes
from kvjax.spec import parse_codec

#: seed of the random vectors that are encoded; the byte counts do not depend on it
DEFAULT_SEED = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The attention shape of a model, which is all that sets its KV-cache size.

    ``num_params`` (total parameters, embeddings included) only sizes the bf16 weights
    that share the accelerator with the cache.
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int

    @property
    def weight_bytes_bf16(self) -> int:
        """Bytes of the weights stored as bfloat16."""
        return 2 * self.num_params


#: attention shapes from the models' Hugging Face ``config.json`` files
#: (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, head dim =
#: ``hidden_size / num_attention_heads``) and their published parameter counts
MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(name="smollm2-135m", num_layers=30, num_heads=9, num_kv_heads=3,
                   head_dim=64, num_params=134_515_008),
        ModelShape(name="llama-3-8b", num_layers=32, num_heads=32, num_kv_heads=8,
                   head_dim=128, num_params=8_030_261_248),
        # v0.3; v0.1 has the same attention shape (and a 4096-token sliding window)
        ModelShape(name="mistral-7b", num_layers=32, num_heads=32, num_kv_heads=8,
                   head_dim=128, num_params=7_248_023_552),
        ModelShape(name="qwen2.5-7b", num_layers=28, num_heads=28, num_kv_heads=4,
                   head_dim=128, num_params=7_615_616_512),
        ModelShape(name="llama-3-70b", num_layers=80, num_heads=64, num_kv_heads=8,
                   head_dim=128, num_params=70_553_706_496),
    )
}


def model_shape(name: str) -> ModelShape:
    """The :class:`ModelShape` registered as ``name``; ``ValueError`` lists the known ones."""
    try:
        return MODEL_SHAPES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown model '{name}'; known models: {', '.join(MODEL_SHAPES)}"
        ) from None


def _positive(name: str, value) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _non_negative(name: str, value) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


@functools.cache
def _measured(codec: Codec, head_dim: int, tokens: int, seed: int) -> tuple[int, int]:
    """(bytes of the codes of ``tokens`` tokens, bytes of the params) for one kv head.

    Cached: a table reuses one encoding across every model of the same head dim and
    every context length.
    """
    codec.check_head_dim(head_dim)
    key_params, key_x = jax.random.split(jax.random.key(seed))
    params = codec.init(key_params, head_dim)
    x = jax.random.normal(key_x, (tokens, head_dim), jnp.float32)
    codes = _encode(codec, params, x)
    return codes_nbytes(codes), codes_nbytes(params)


# one compiled program per codec and shape (dispatching the encoding op by op compiles
# each of its dozens of operations on its own, several times slower)
_encode = jax.jit(lambda codec, params, x: codec.encode(params, x), static_argnums=0)


def _pair_tokens(k_codec: Codec, v_codec: Codec) -> int:
    """Tokens that make whole blocks of both codecs (K and V share one measurement)."""
    return math.lcm(k_codec.block_tokens, v_codec.block_tokens)


def _block_bytes(codec: Codec, head_dim: int, tokens: int, seed: int) -> int:
    """Bytes of one encoded block of one kv head, from an encoding of ``tokens`` tokens.

    Codes are one entry per block, so a multiple of the block divides exactly; measuring
    at the pair's common multiple lets :func:`bytes_per_token` and :func:`cache_bytes`
    share one encoding per codec.
    """
    nbytes = _measured(codec, head_dim, tokens, seed)[0]
    blocks = tokens // codec.block_tokens
    if nbytes % blocks:
        raise ValueError(f"{codec.spec}: {nbytes} bytes do not split into {blocks} blocks")
    return nbytes // blocks


def _resolve(spec: Codec | str, head_dim: int) -> Codec:
    codec = parse_codec(spec)
    # CodecError is a ValueError: a head dim the codec rejects surfaces with its message
    codec.check_head_dim(head_dim)
    return codec


def bytes_per_token(
    k_codec: Codec | str,
    v_codec: Codec | str,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int = DEFAULT_SEED,
) -> dict[str, float]:
    """Cache bytes that one token costs across all layers and kv heads, K and V.

    Both codecs encode ``lcm(K block, V block)`` tokens of seeded Gaussian vectors of one
    kv head (one token for per-token codecs, ``G`` for KIVI keys); the bytes of the
    returned arrays divided by those tokens is the per-head cost, fractional when a
    block's metadata does not split evenly over its tokens. Codec parameters are a
    per-model constant and are not counted here (see :func:`cache_bytes`).

    Returns ``k_bytes``, ``v_bytes`` and ``bytes`` (per token, all layers and heads),
    ``block_tokens`` (the tokens encoded), and ``bits_per_element`` with its ``k_`` and
    ``v_`` parts (stored bits over ``num_layers * num_kv_heads * head_dim`` elements per
    role; the total averages K and V).
    """
    num_layers = _positive("num_layers", num_layers)
    num_kv_heads = _positive("num_kv_heads", num_kv_heads)
    head_dim = _positive("head_dim", head_dim)
    k_codec, v_codec = _resolve(k_codec, head_dim), _resolve(v_codec, head_dim)
    tokens = _pair_tokens(k_codec, v_codec)
    heads = num_layers * num_kv_heads
    k_head = _measured(k_codec, head_dim, tokens, seed)[0] / tokens
    v_head = _measured(v_codec, head_dim, tokens, seed)[0] / tokens
    return {
        "k_bytes": k_head * heads,
        "v_bytes": v_head * heads,
        "bytes": (k_head + v_head) * heads,
        "block_tokens": tokens,
        "k_bits_per_element": 8 * k_head / head_dim,
        "v_bits_per_element": 8 * v_head / head_dim,
        "bits_per_element": 8 * (k_head + v_head) / (2 * head_dim),
    }


def cache_bytes(
    k_codec: Codec | str,
    v_codec: Codec | str,
    *,
    context: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    batch: int = 1,
    residual_window: int = 0,
    sink_tokens: int = 0,
    raw_k_layers: Iterable[int] = (),
    raw_v_layers: Iterable[int] = (),
    raw_codec: Codec | str = "bf16",
    raw_dtype=jnp.bfloat16,
    seed: int = DEFAULT_SEED,
) -> int:
    """Bytes of a cache with capacity ``context`` tokens per row, laid out as the cache is.

    Per (layer, row, kv head) and separately for K and V, as
    :func:`kvjax.cache.init_cache` allocates with ``max_len=context``:

    - ``sink_tokens`` raw tokens and a raw region of ``residual_window + block - 1``
      tokens (the window plus a codec block still being filled: KIVI keys stay raw
      until ``G`` have arrived), each token ``head_dim`` elements of ``raw_dtype``;
    - ``(context - sink_tokens - residual_window) // block`` codec blocks, each costing
      the measured bytes of one encoded block. So the tokens past the sinks and the
      window are held as whole blocks, and a remainder of fewer than ``block`` tokens
      lives in the raw region's spare ``block - 1`` slots;
    - layers in ``raw_k_layers``/``raw_v_layers`` store that role with ``raw_codec``;
    - bookkeeping: the codec parameters (measured from ``codec.init``), one ``nonfinite``
      flag per (layer, role, row), and per row an int32 length and an ``overflowed`` flag.

    The result equals :func:`kvjax.cache.memory_bytes` of such a cache; with a per-token
    codec and no window it is ``batch * context`` times the per-token bytes of
    :func:`bytes_per_token` plus the bookkeeping.
    """
    context = _positive("context", context)
    num_layers = _positive("num_layers", num_layers)
    num_kv_heads = _positive("num_kv_heads", num_kv_heads)
    head_dim = _positive("head_dim", head_dim)
    batch = _positive("batch", batch)
    window = _non_negative("residual_window", residual_window)
    sinks = _non_negative("sink_tokens", sink_tokens)
    if sinks > context:
        raise ValueError(f"sink_tokens={sinks} exceeds the context of {context} tokens")
    raw_token_bytes = head_dim * jnp.dtype(raw_dtype).itemsize

    def layer_set(layers, what):
        out = set()
        for i in layers:
            j = int(i) + num_layers if int(i) < 0 else int(i)
            if not 0 <= j < num_layers:
                raise ValueError(f"{what} names layer {i}, the model has {num_layers} layers")
            out.add(j)
        return out

    raw_layers = {"k": layer_set(raw_k_layers, "raw_k_layers"),
                  "v": layer_set(raw_v_layers, "raw_v_layers")}
    codecs = {"k": _resolve(k_codec, head_dim), "v": _resolve(v_codec, head_dim),
              "raw": _resolve(raw_codec, head_dim)}

    tokens = _pair_tokens(codecs["k"], codecs["v"])

    def per_head(codec: Codec, measure_tokens: int) -> int:
        """Bytes of one (layer, role, kv head): ``batch`` rows of tokens, then params."""
        block = codec.block_tokens
        slots = max(0, context - sinks - window) // block
        raw_tokens = sinks + window + block - 1
        row = slots * _block_bytes(codec, head_dim, measure_tokens, seed)
        params = _measured(codec, head_dim, measure_tokens, seed)[1]
        return batch * (row + raw_tokens * raw_token_bytes) + params

    total = 0
    for role in ("k", "v"):
        n_raw = len(raw_layers[role])
        parts = ((codecs["raw"], codecs["raw"].block_tokens, n_raw),
                 (codecs[role], tokens, num_layers - n_raw))
        for codec, measure_tokens, n_layers in parts:
            if n_layers:
                total += n_layers * num_kv_heads * per_head(codec, measure_tokens)
        total += num_layers * batch  # a nonfinite flag (bool, one byte) per layer and row
    return total + batch * (4 + 1)  # lengths (int32) and overflowed (bool) per row



def max_context(
    k_codec: Codec | str,
    v_codec: Codec | str,
    *,
    budget_bytes: int | float,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    **cache_kw,
) -> int:
    """The largest ``context`` whose :func:`cache_bytes` is at most ``budget_bytes``.

    ``cache_kw`` passes on to :func:`cache_bytes` (``batch``, ``residual_window``, ...).
    Returns 0 when not even a one-token cache fits. The search is exact because the
    cache's bytes never decrease as its capacity grows.
    """
    shape = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)

    def fits(context: int) -> bool:
        return cache_bytes(k_codec, v_codec, context=context, **shape, **cache_kw) <= budget_bytes

    lo = max(1, cache_kw.get("sink_tokens", 0))
    if not fits(lo):
        return 0
    hi = lo
    while fits(hi * 2):
        hi *= 2
    hi *= 2  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
