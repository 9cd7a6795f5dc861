"""KV-cache memory read from the cache's own shapes: bytes at a capacity, per token, and
the largest context that fits a budget.

Every figure here is the bytes of the arrays that :func:`kvjax.cache.init_cache`
allocates for a :class:`~kvjax.spec.CacheConfig`, read from ``jax.eval_shape`` of it:
abstract arrays, so nothing is allocated or encoded and a 128k-token cache of a 70B
model costs a trace. :func:`cache_bytes` is that sum (it equals
:func:`kvjax.cache.memory_bytes` of the real cache); :func:`bytes_per_token` is the
growth of the same sum between two capacities a whole number of codec blocks apart, and
:func:`max_context` searches over capacity with it. Nothing restates where the cache
keeps its sinks, window, block slots, raw layers or bookkeeping.

:data:`MODEL_SHAPES` is the one table of model shapes: the memory table and the
benchmarks read it.

Units: bytes throughout; callers convert (the memory table reports GiB = 2**30 bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import init_cache
from kvjax.sharding import DATA, bytes_per_device, parse_mesh
from kvjax.spec import CacheConfig, parse_cache


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The shape of a model: its attention shape, which is all that sets its KV-cache
    size, and the rest of its architecture, which a random-weight model of the same
    size needs.

    ``num_params`` (total parameters, embeddings included) sizes the bf16 weights that
    share the accelerator with the cache; the other fields give that count exactly
    (embeddings, attention and MLP weights, biases and norms of a llama-like model).
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    rope_theta: float
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    @property
    def weight_bytes_bf16(self) -> int:
        """Bytes of the weights stored as bfloat16."""
        return 2 * self.num_params


#: shapes from the models' Hugging Face ``config.json`` files (``num_hidden_layers``,
#: ``num_attention_heads``, ``num_key_value_heads``, head dim = ``hidden_size /
#: num_attention_heads``, vocabulary, hidden and MLP sizes, RoPE base) and their
#: published parameter counts
MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(name="smollm2-135m", num_layers=30, num_heads=9, num_kv_heads=3,
                   head_dim=64, num_params=134_515_008, family="llama", vocab_size=49152,
                   hidden_size=576, intermediate_size=1536, rope_theta=100000.0,
                   tie_word_embeddings=True),
        ModelShape(name="llama-3-8b", num_layers=32, num_heads=32, num_kv_heads=8,
                   head_dim=128, num_params=8_030_261_248, family="llama",
                   vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   rope_theta=500000.0),
        # v0.3; v0.1 has the same attention shape (and a 4096-token sliding window)
        ModelShape(name="mistral-7b", num_layers=32, num_heads=32, num_kv_heads=8,
                   head_dim=128, num_params=7_248_023_552, family="mistral",
                   vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                   rope_theta=1000000.0),
        ModelShape(name="qwen2.5-7b", num_layers=28, num_heads=28, num_kv_heads=4,
                   head_dim=128, num_params=7_615_616_512, family="qwen2",
                   vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                   rope_theta=1000000.0, attention_bias=True),
        ModelShape(name="llama-3-70b", num_layers=80, num_heads=64, num_kv_heads=8,
                   head_dim=128, num_params=70_553_706_496, family="llama",
                   vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                   rope_theta=500000.0),
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


def _nbytes(tree: Any) -> int:
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=4096)
def _sizes(config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
           capacity: int, batch: int, dtype: np.dtype) -> tuple[int, int, int]:
    """(bytes of the whole cache, of its K stores, of its V stores) that
    :func:`kvjax.cache.init_cache` allocates, from its abstract arrays.

    Cached: a table asks for the same cache at several figures (a bf16 reference per
    model, the per-token step that :func:`max_context` starts from).
    """
    cache = _shape(config, num_layers, num_kv_heads, head_dim, capacity, batch, dtype)
    return (_nbytes(cache), sum(_nbytes(seg.k) for seg in cache.segments),
            sum(_nbytes(seg.v) for seg in cache.segments))


@functools.lru_cache(maxsize=256)
def _shape(config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
           capacity: int, batch: int, dtype: np.dtype) -> Any:
    return jax.eval_shape(lambda: init_cache(
        jax.random.key(0), config, num_layers=num_layers, batch=batch,
        num_kv_heads=num_kv_heads, head_dim=head_dim, max_len=capacity, dtype=dtype))


def _checked(config: CacheConfig | str, num_layers, num_kv_heads, head_dim,
             batch) -> tuple[CacheConfig, tuple[int, int, int], int]:
    config = parse_cache(config)
    dims = tuple(_positive(name, value) for name, value in (
        ("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)))
    return config, dims, _positive("batch", batch)


def _whole_blocks(config: CacheConfig, num_layers: int) -> int:
    """The fewest tokens that make whole blocks of every codec the layers use: a
    capacity that many tokens longer holds exactly that many more tokens as codes."""
    codecs = {codec for pair in config.layer_codecs(num_layers) for codec in pair}
    return math.lcm(*(codec.block_tokens for codec in codecs))


def row_bytes(
    config: CacheConfig | str,
    *,
    context: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    mesh: str | dict | None = None,
    dtype: Any = jnp.bfloat16,
) -> tuple[int, int]:
    """``(per_row, fixed)``: the bytes one more row of ``context`` tokens adds to a cache
    and the bytes it holds whatever its rows (codec parameters, bookkeeping), from its
    own arrays. Over a mesh of shape ``mesh`` (``"data=D,model=M"``) what each device
    holds: of one more row on every device (``D`` rows in all) and of its heads'
    parameters; ``fixed + n * per_row`` bytes then serve ``n * D`` rows."""
    rows = parse_mesh(mesh)[DATA]

    def size(batch: int) -> int:
        return cache_bytes(config, context=context, num_layers=num_layers,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, batch=batch * rows,
                           dtype=dtype, mesh=mesh)

    per_row = size(2) - size(1)
    return per_row, size(1) - per_row


def pool_pages(
    config: CacheConfig | str,
    *,
    budget: float,
    rows: int,
    context: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.bfloat16,
) -> int:
    """The most pages a paged cache (a spec with ``page=N``) of ``rows`` rows of up to
    ``context`` tokens can keep in ``budget`` bytes with its rows' own arrays (raw
    window, sinks, flags, block tables) and codec parameters, read from
    ``jax.eval_shape`` of :func:`kvjax.cache.init_cache` (``num_pages=``); 0 when not
    even one fits. The comparison at equal memory: a contiguous cache's rows from
    :func:`row_bytes`, a paged one's pool from here."""
    config, (layers, heads, dim), rows = _checked(config, num_layers, num_kv_heads,
                                                  head_dim, rows)
    if not config.page_tokens:
        raise ValueError(f"cache spec '{config.spec}' is not paged (add page=N)")
    context = _positive("context", context)

    def size(pages: int) -> int:
        return _nbytes(jax.eval_shape(lambda: init_cache(
            jax.random.key(0), config, num_layers=layers, batch=rows, num_kv_heads=heads,
            head_dim=dim, max_len=context, dtype=dtype, num_pages=pages)))

    page = size(2) - size(1)
    return max(0, int((budget - (size(1) - page)) // page))


def cache_bytes(
    config: CacheConfig | str,
    *,
    context: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    batch: int = 1,
    dtype: Any = jnp.bfloat16,
    mesh: str | dict | None = None,
) -> int:
    """Bytes of the cache that :func:`kvjax.cache.init_cache` allocates for ``batch`` rows
    of ``context`` tokens: every array, codes, raw sinks and window, raw layers, codec
    parameters and bookkeeping, read from ``jax.eval_shape`` of it. ``dtype`` is the
    raw tokens' type. Equals :func:`kvjax.cache.memory_bytes` of that cache. ``mesh``
    (``"data=2,model=4"``): what each device holds of it split over a mesh of that shape,
    rows over data and kv heads over model (:func:`kvjax.sharding.bytes_per_device`).
    """
    config, dims, batch = _checked(config, num_layers, num_kv_heads, head_dim, batch)
    context = _positive("context", context)
    if config.sink_tokens > context:
        raise ValueError(f"sink_tokens={config.sink_tokens} exceeds the context of "
                         f"{context} tokens")
    if mesh is not None:
        return bytes_per_device(mesh, _shape(config, *dims, context, batch, jnp.dtype(dtype)))
    return _sizes(config, *dims, context, batch, jnp.dtype(dtype))[0]


def bytes_per_token(
    config: CacheConfig | str,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> dict[str, float]:
    """Cache bytes that one more token of context costs across all layers and kv heads.

    The growth of :func:`cache_bytes` of one row between two capacities ``block_tokens``
    apart, past the sinks and the window: ``block_tokens`` is the least common multiple
    of the block sizes of every codec the layers use (1 for per-token codecs, ``G`` for
    KIVI keys), so those tokens are whole blocks of codes and the figure is exact,
    fractional when a block's metadata does not split evenly over its tokens. Codec
    parameters and bookkeeping do not grow with the context and are not counted.

    Returns ``k_bytes``, ``v_bytes`` and ``bytes`` (per token, all layers and heads),
    ``block_tokens``, and ``bits_per_element`` with its ``k_`` and ``v_`` parts (stored
    bits over ``num_layers * num_kv_heads * head_dim`` elements per role; the total
    averages K and V).
    """
    config, dims, _ = _checked(config, num_layers, num_kv_heads, head_dim, 1)
    tokens = _whole_blocks(config, dims[0])
    # past sinks, window and a whole block, where the raw buffer has reached its full
    # size (a cache shorter than that sizes it by its capacity)
    start = config.sink_tokens + config.residual_window + tokens
    dtype = jnp.dtype(jnp.bfloat16)
    _, k0, v0 = _sizes(config, *dims, start, 1, dtype)
    _, k1, v1 = _sizes(config, *dims, start + tokens, 1, dtype)
    k, v = (k1 - k0) / tokens, (v1 - v0) / tokens
    elements = dims[0] * dims[1] * dims[2]
    return {
        "k_bytes": k,
        "v_bytes": v,
        "bytes": k + v,
        "block_tokens": tokens,
        "k_bits_per_element": 8 * k / elements,
        "v_bits_per_element": 8 * v / elements,
        "bits_per_element": 8 * (k + v) / (2 * elements),
    }


def max_context(
    config: CacheConfig | str,
    *,
    budget_bytes: int | float,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    batch: int = 1,
    dtype: Any = jnp.bfloat16,
) -> int:
    """The largest ``context`` whose :func:`cache_bytes` is at most ``budget_bytes``.

    Returns 0 when not even the smallest cache (one token, or the sinks) fits. The
    search asks :func:`cache_bytes` only: it starts from the capacity that the bytes of
    two capacities ``block_tokens`` apart (:func:`bytes_per_token`) point to, checks
    it, and bisects the last step; it is exact because the cache's bytes never decrease
    as its capacity grows.
    """
    config, dims, batch = _checked(config, num_layers, num_kv_heads, head_dim, batch)
    dtype = jnp.dtype(dtype)

    def size(context: int) -> int:
        return _sizes(config, *dims, context, batch, dtype)[0]

    lo = max(1, config.sink_tokens)
    if size(lo) > budget_bytes:
        return 0
    hi = None
    tokens = _whole_blocks(config, dims[0])
    start = max(lo, config.sink_tokens + config.residual_window)
    if size(start) > budget_bytes:
        hi = start
    else:
        growth = size(start + tokens) - size(start)
        if growth <= 0:
            raise ValueError(f"cache '{config.spec}' does not grow with its capacity")
        lo = start + tokens * int((budget_bytes - size(start)) // growth)
        if size(lo) > budget_bytes:  # never with whole blocks; the search stays exact
            lo, hi = start, lo
    step = tokens
    while hi is None:
        if size(lo + step) <= budget_bytes:
            lo, step = lo + step, 2 * step
        else:
            hi = lo + step
    while hi - lo > 1:  # size(lo) fits, size(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= budget_bytes else (lo, mid)
    return lo
