"""One llama-like decoder core (Llama 2/3, Qwen2/2.5, Qwen3, Mistral) over a kvjax cache.

Written with Flax **linen**, not NNX: a linen module is a pure function of an explicit
params pytree, so one :class:`DecoderLayer` can be applied inside the ``lax.scan`` that
:func:`kvjax.cache.scan_layers` runs over the stacked layer weights and the cache
segments, with the per-layer slice of the weights as a scanned input. NNX modules are
stateful objects and would need ``nnx.split``/``nnx.merge`` around every scan body.

Parameters follow the shared layout that both loaders (HF safetensors, GGUF) produce;
weights are ``[in, out]`` (``y = x @ W``) and every layer leaf is stacked over ``L``::

    embed [V, H]; final_norm [H]; lm_head [H, V] (absent when tied)
    layers: attn_norm [L, H], wq [L, H, N*D], wk/wv [L, H, K*D], wo [L, N*D, H],
            bq [L, N*D], bk/bv [L, K*D] (attention_bias), q_norm/k_norm [L, D] (qk_norm),
            mlp_norm [L, H], w_gate/w_up [L, H, F], w_down [L, F, H]

The names inside :class:`DecoderLayer` are exactly the per-layer names above, so
``params["layers"]`` sliced at one layer is that module's ``{"params": ...}`` as is.

``params["layers"]`` may instead be a tuple of ``L`` per-layer dicts (no leading ``L``),
each leaf its own buffer (:func:`unstack_layers`): the layers are then unrolled and each
reads its weights in place, where a scan over stacked weights copies every layer's
weights on every step on a GPU (:func:`kvjax.cache.scan_layers`). Stacked compiles
faster; per-layer decodes faster. Either layout may hold its projections fused
(:func:`fuse_projections`: ``w_qkv`` for wq|wk|wv, ``b_qkv``, ``w_gate_up`` for
w_gate|w_up, joined along the output axis): fewer, wider matmuls per layer.

Q and K use the HF RoPE convention: ``rotate_half`` on the two halves of each head.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kvjax.attention import attend
from kvjax.cache import KVCache, Step, append, commit, dense, init_cache, make_step
from kvjax.cache import scan_layers as _scan_layers
from kvjax.calibration import fitted_of
from kvjax.eviction import attention_mass
from kvjax.sharding import (
    DATA,
    MODEL,
    ROWS_HEADS,
    axis_sizes,
    cache_specs,
    check_split,
    new_sharded_cache,
    per_shard,
    sharded_cache_shape,
    shardings,
)
from kvjax.spec import CacheConfig
from models.config import ModelConfig, RopeScaling

Params = dict[str, Any]


#: what :func:`fuse_projections` joins: each fused leaf and the leaves it concatenates
#: along their output axis, in order
FUSED = {"w_qkv": ("wq", "wk", "wv"), "b_qkv": ("bq", "bk", "bv"),
         "w_gate_up": ("w_gate", "w_up")}


def layer_shapes(config: ModelConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's parameters (no leading ``L``), by layout name (``fused``:
    with the projections :func:`fuse_projections` joins)."""
    h, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    nd, kd = config.num_heads * d, config.num_kv_heads * d
    shapes = {
        "attn_norm": (h,),
        "wq": (h, nd), "wk": (h, kd), "wv": (h, kd), "wo": (nd, h),
        "mlp_norm": (h,),
        "w_gate": (h, f), "w_up": (h, f), "w_down": (f, h),
    }
    if config.attention_bias:
        shapes.update(bq=(nd,), bk=(kd,), bv=(kd,))
    if config.qk_norm:
        shapes.update(q_norm=(d,), k_norm=(d,))
    if fused:
        for name, parts in FUSED.items():
            if parts[0] in shapes:
                *lead, _ = shapes[parts[0]]
                shapes[name] = (*lead, sum(shapes.pop(part)[-1] for part in parts))
    return shapes


def is_fused(params: Params) -> bool:
    """Whether ``params`` hold their projections joined (:func:`fuse_projections`)."""
    layers = params["layers"]
    first = layers[0] if isinstance(layers, (list, tuple)) else layers
    return "w_qkv" in first


def fuse_projections(params: Params) -> Params:
    """``params`` with each layer's Q, K and V projections joined into one matrix
    ``w_qkv`` (and their biases into ``b_qkv``), and the gate and up projections into
    ``w_gate_up``, stacked or per-layer alike: one matmul instead of three and one
    instead of two per layer, the same products up to the order a wider matmul sums in.
    Already fused: unchanged."""
    if is_fused(params):
        return params

    def fuse(layer):
        layer = dict(layer)
        for name, parts in FUSED.items():
            if parts[0] in layer:
                cat = np.concatenate if isinstance(layer[parts[0]], np.ndarray) \
                    else jnp.concatenate
                layer[name] = cat([layer.pop(part) for part in parts], axis=-1)
        return layer

    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return {**params, "layers": tuple(fuse(layer) for layer in layers)}
    return {**params, "layers": fuse(layers)}


def fused_cuts(config: ModelConfig, name: str) -> list[int]:
    """Where the fused leaf ``name``'s output axis splits into its parts (:data:`FUSED`)."""
    widths = [layer_shapes(config)[part][-1] for part in FUSED[name]]
    return np.cumsum(widths)[:-1].tolist()


def unfuse_projections(params: Params, config: ModelConfig) -> Params:
    """Inverse of :func:`fuse_projections`: each fused leaf split back into its parts."""
    if not is_fused(params):
        return params
    def split(layer):
        layer = dict(layer)
        for name, parts in FUSED.items():
            if name in layer:
                lib = np if isinstance(layer[name], np.ndarray) else jnp
                layer.update(zip(parts, lib.split(layer.pop(name), fused_cuts(config, name),
                                                  axis=-1), strict=True))
        return layer

    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return {**params, "layers": tuple(split(layer) for layer in layers)}
    return {**params, "layers": split(layers)}


def param_shapes(config: ModelConfig, fused: bool = False) -> Params:
    """Shapes of the whole params pytree in the shared layout (``fused``: with the
    projections :func:`fuse_projections` joins)."""
    shapes: Params = {
        "embed": (config.vocab_size, config.hidden_size),
        "layers": {k: (config.num_layers, *s)
                   for k, s in layer_shapes(config, fused).items()},
        "final_norm": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
    return shapes


def unstack_layers(params: Params) -> Params:
    """``params`` with its layers as a tuple of per-layer dicts, each leaf a buffer of its
    own (a copy: drop the stacked params to free them). Already per-layer: unchanged."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    count = len(next(iter(layers.values())))
    return {**params, "layers": tuple(
        {name: leaf[i] for name, leaf in layers.items()} for i in range(count))}


def decode_layout(params: Params) -> Params:
    """``params`` in the layout a GPU decodes fastest: one buffer per layer
    (:func:`unstack_layers`) with the projections joined (:func:`fuse_projections`; a
    Llama-3-8B decode step at B = 1 takes 5.44 ms against 6.16, docs/kernels.md)."""
    return fuse_projections(unstack_layers(params))


def relayout(params: Params, layout: Callable[[Params], Params] = decode_layout) -> Params:
    """``layout(params)`` (default :func:`decode_layout`) for weights on one GPU, built on
    the host and put back, their device buffers freed first: it consumes ``params``.

    Laid out on the device, each layer is copied while the stacked weights still exist;
    once those are freed they leave a hole the weights' size below the copies, and the
    device's free memory is two blocks, not one, so a cache stack that the free total
    holds may find no block to go in. Measured on an H100 at a 90% memory fraction, the
    Llama-3-8B shape's random weights: after :func:`decode_layout` on the device 34.44 GiB
    is the largest block of 56.3 GiB free (the second 24 GiB stack of a 12-row bf16 cache
    at 32k failed to allocate); through the host (24 s) one block of 56.3 GiB. Weights
    elsewhere (the CPU, where the host copy would share their memory, or a mesh): laid
    out in place."""
    leaves = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)]
    device = _one_gpu(leaves)
    if device is None:
        return layout(params)
    # copies, not views of the buffers about to be freed
    host = jax.tree.map(lambda x: np.array(x) if isinstance(x, jax.Array) else x, params)
    for leaf in leaves:
        leaf.delete()
    return jax.block_until_ready(jax.device_put(layout(host), device))


def _one_gpu(arrays: list[jax.Array]):
    """The GPU holding every one of ``arrays``, or None."""
    devices = {d for x in arrays for d in x.devices()}
    if len(devices) != 1 or next(iter(devices)).platform != "gpu":
        return None
    return next(iter(devices))


def stack_layers(params: Params) -> Params:
    """Inverse of :func:`unstack_layers`: the layers stacked over a leading ``L`` axis."""
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        return params
    stack = np.stack if all(isinstance(leaf, np.ndarray) for leaf in layers[0].values()) \
        else jnp.stack
    return {**params, "layers": {name: stack([layer[name] for layer in layers])
                                 for name in layers[0]}}


def add_key_bias(config: ModelConfig, params: Params, bias: Any
                 ) -> tuple[ModelConfig, Params]:
    """``(config, params)`` with ``bias[L, K*D]`` added to every layer's k projection
    (pre-RoPE, as a trained model's ``bk``), stacked and unfused params only; a model
    without attention biases gains zero ``bq``/``bv`` beside it."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)) or is_fused(params):
        raise ValueError("add_key_bias takes stacked, unfused params (before decode_layout)")
    bias = jnp.asarray(bias)
    kd = config.num_kv_heads * config.head_dim
    if bias.shape != (config.num_layers, kd):
        raise ValueError(f"key bias must be [{config.num_layers}, {kd}], got {bias.shape}")
    dtype = layers["wk"].dtype
    layers = dict(layers)
    if not config.attention_bias:
        layers["bq"] = jnp.zeros((config.num_layers, config.num_heads * config.head_dim),
                                 dtype)
        layers["bk"] = jnp.zeros((config.num_layers, kd), dtype)
        layers["bv"] = jnp.zeros((config.num_layers, kd), dtype)
    layers["bk"] = (layers["bk"].astype(jnp.float32) + bias).astype(dtype)
    return (dataclasses.replace(config, attention_bias=True),
            {**params, "layers": layers})


def layer_params(params: Params, i: int) -> Params:
    """Layer ``i``'s weights (no leading ``L``), from stacked or per-layer params."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return layers[i]
    return {name: leaf[i] for name, leaf in layers.items()}


def check_params(params: Params, config: ModelConfig) -> None:
    """Raise ``ValueError`` naming every missing, unexpected or wrongly shaped leaf (the
    layers stacked or per layer)."""
    fused = "layers" in params and len(params["layers"]) > 0 and is_fused(params)
    expected = param_shapes(config, fused)
    problems = []
    if isinstance(params.get("layers"), (list, tuple)):
        layers = params["layers"]
        if len(layers) != config.num_layers:
            problems.append(f"{len(layers)} per-layer dicts, expected {config.num_layers}")
        expected["layers"] = {str(i): layer_shapes(config, fused)
                              for i in range(len(layers))}
        params = {**params, "layers": {str(i): layer for i, layer in enumerate(layers)}}

    def walk(exp, got, prefix):
        for name in sorted(set(exp) | set(got)):
            where = f"{prefix}{name}"
            if name not in got:
                problems.append(f"missing {where} {exp[name]}")
            elif name not in exp:
                problems.append(f"unexpected {where}")
            elif isinstance(exp[name], dict):
                walk(exp[name], got[name], where + ".")
            elif tuple(got[name].shape) != exp[name]:
                problems.append(f"{where} has shape {tuple(got[name].shape)}, "
                                f"expected {exp[name]}")

    walk(expected, params, "")
    if problems:
        raise ValueError("params do not match the model config: " + "; ".join(problems))


#: how each weight splits for tensor parallelism (Megatron's): the Q, K, V, gate and up
#: projections by output columns (whole heads, whole MLP units), the output and down
#: projections by input rows, whose partial sums the layer adds over the model axis;
#: every other leaf (norms, embedding) is whole on every device
SPLIT = {
    "wq": (None, MODEL), "wk": (None, MODEL), "wv": (None, MODEL), "wo": (MODEL, None),
    "bq": (MODEL,), "bk": (MODEL,), "bv": (MODEL,),
    "w_gate": (None, MODEL), "w_up": (None, MODEL), "w_down": (MODEL, None),
}


def check_mesh(config: ModelConfig, mesh: Mesh | None, *, rows: int | None = None) -> None:
    """Raise :class:`kvjax.sharding.MeshError` unless the model's query and kv heads and
    MLP units (and ``rows``) split evenly over the mesh."""
    check_split(mesh, rows=rows, kv_heads=config.num_kv_heads,
                query_heads=config.num_heads, mlp_units=config.intermediate_size)


def shard_config(config: ModelConfig, model: int) -> ModelConfig:
    """The config one device of a ``model``-wide tensor-parallel group computes: its
    share of the query and kv heads and of the MLP units."""
    if model == 1:
        return config
    return dataclasses.replace(config, num_heads=config.num_heads // model,
                               num_kv_heads=config.num_kv_heads // model,
                               intermediate_size=config.intermediate_size // model)


def param_specs(params: Params, model: int = 1) -> Any:
    """A :class:`~jax.sharding.PartitionSpec` per leaf of ``params`` (stacked or per
    layer; :data:`SPLIT`); ``lm_head`` splits over the vocabulary where a ``model``-wide
    axis divides it, and is whole on every device where not."""
    def spec(path, leaf):
        name = path[-1].key
        split = SPLIT.get(name, ())
        if name == "lm_head" and leaf.shape[-1] % model == 0:
            split = (None, MODEL)
        # stacked layer leaves carry a leading layer axis
        lead = (None,) * (leaf.ndim - len(split)) if split else ()
        return P(*lead, *split)

    return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(params: Params, config: ModelConfig, mesh: Mesh) -> Params:
    """``params`` placed on ``mesh`` for :func:`hidden_states` over it: each device holds
    its heads' and MLP units' columns or rows (:data:`SPLIT`), the norms and the
    embedding whole; replicated over the data axis. Fused projections are split back
    (the fused matrices would not split along whole heads)."""
    check_mesh(config, mesh)
    if is_fused(params):
        params = unfuse_projections(params, config)
    specs = param_specs(params, axis_sizes(mesh)[MODEL])
    return jax.device_put(params, shardings(mesh, specs, params))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF RMSNorm: normalize in float32, cast back to ``x.dtype``, then scale by ``weight``."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    """Per-frequency inverse wavelengths ``[D/2]`` (float32), with llama3 scaling if set."""
    d = config.head_dim
    exponents = jnp.arange(0, d, 2, dtype=jnp.float32) / d
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: jax.Array, s: RopeScaling) -> jax.Array:
    # Llama 3.1 stretches only the long wavelengths (those that did not fit in the
    # original context) by `factor`, keeps the short ones, and blends linearly in
    # wavelength-ratio space between the two cut-offs.
    old = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    long_cut = old / s.low_freq_factor
    short_cut = old / s.high_freq_factor
    scaled = jnp.where(wavelen > long_cut, inv_freq / s.factor, inv_freq)
    blend = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * scaled / s.factor + blend * scaled
    between = (wavelen >= short_cut) & (wavelen <= long_cut)
    return jnp.where(between, blended, scaled)


def rope_tables(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``cos, sin [B, T, D]`` (float32) for absolute ``positions [B, T]``."""
    angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(config)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, heads, D]`` by HF's half-split convention; keeps ``x.dtype``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: GQA attention over a kvjax layer view, then SwiGLU.

    ``attention``: the attention implementations to try, in order (the cache config's
    :attr:`~kvjax.spec.CacheConfig.attention`; :func:`kvjax.attention.attend`).
    """

    config: ModelConfig
    attention: tuple[str, ...]
    fused: bool = False
    #: also return the chunk's queries (after the rotary embedding), for eviction
    return_queries: bool = False
    #: the mesh axis the layer's heads and MLP units are split over (inside
    #: ``shard_map``): the output and down projections' partial sums are added over it
    model_axis: str | None = None

    def _p(self, name: str) -> jax.Array:
        # zeros only matter for shape inference; loaders always supply the values
        return self.param(name, nn.initializers.zeros_init(),
                          layer_shapes(self.config, self.fused)[name])

    def _project(self, x: jax.Array, name: str, bias: str | None = None
                 ) -> tuple[jax.Array, ...]:
        """``x`` times the projections ``FUSED[name]``: one matmul with the joined matrix
        (its result split by columns) or one each."""
        if self.fused:
            y = x @ self._p(name)
            if bias is not None:
                y = y + self._p(bias)
            return tuple(jnp.split(y, fused_cuts(self.config, name), axis=-1))
        ys = tuple(x @ self._p(part) for part in FUSED[name])
        if bias is not None:
            ys = tuple(y + self._p(b) for y, b in zip(ys, FUSED[bias], strict=True))
        return ys

    def _reduce(self, partial: jax.Array) -> jax.Array:
        if self.model_axis is None:
            return partial
        return jax.lax.psum(partial, self.model_axis)

    @nn.compact
    def __call__(self, h: jax.Array, layer_kv, step: Step, cos: jax.Array, sin: jax.Array):
        """``h [B, T, H]`` -> ``(h, layer_kv)`` after appending this chunk's K/V (and the
        queries ``[B, T, N, D]`` third, with ``return_queries``)."""
        c = self.config
        b, t, _ = h.shape
        x = rms_norm(h, self._p("attn_norm"), c.rms_norm_eps)
        q, k, v = self._project(x, "w_qkv", "b_qkv" if c.attention_bias else None)
        q = q.reshape(b, t, c.num_heads, c.head_dim)
        k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
        v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, self._p("q_norm"), c.rms_norm_eps)
            k = rms_norm(k, self._p("k_norm"), c.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        layer_kv = append(layer_kv, k, v, step)
        o = attend(q, layer_kv, step, sliding_window=c.sliding_window, impl=self.attention)
        h = h + self._reduce(o.reshape(b, t, -1).astype(h.dtype) @ self._p("wo"))

        x = rms_norm(h, self._p("mlp_norm"), c.rms_norm_eps)
        gate, up = self._project(x, "w_gate_up")
        mlp = nn.silu(gate) * up
        h = h + self._reduce(mlp @ self._p("w_down"))
        return (h, layer_kv, q) if self.return_queries else (h, layer_kv)


@dataclasses.dataclass(frozen=True)
class Observer:
    """What a layer's chunk shows a caller of :func:`hidden_states`:
    ``update(state, layer, queries[B, T, N, D], view, step, inputs) -> state`` adds what
    it sees to ``state`` (``view``: the layer's cache after the chunk's append; queries
    after the rotary embedding; ``inputs``: arrays of the caller's it reads). On a mesh
    (:mod:`kvjax.sharding`) ``partition`` and ``inputs_partition`` are the
    :class:`~jax.sharding.PartitionSpec` of the state and the inputs: each device adds
    what its rows and heads see, summed over the axes the state's partition does not
    name. A plain ``update(state, layer, queries, view, step)`` also serves, off a mesh.
    """

    update: Callable[..., Any]
    partition: P = dataclasses.field(default_factory=P)
    inputs: Any = None
    inputs_partition: Any = dataclasses.field(default_factory=P)

    def __call__(self, state, layer, queries, view, step):
        return self.update(state, layer, queries, view, step, self.inputs)


def hidden_states(
    params: Params, config: ModelConfig, tokens: jax.Array, cache: KVCache,
    valid: jax.Array | None = None, observe: tuple[Observer, Any] | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, Any]:
    """Final-normed hidden states ``[B, T, H]`` of a chunk, and the cache holding it.

    ``observe``: ``(observer, state)``; every layer ``i`` updates ``state =
    observer(state, i, queries, view, step)`` and the last state is returned third:
    :func:`attention_observer` sums the attention each stored position receives (an
    eviction's scores), :func:`query_moment_observer` the queries' second moments.

    ``mesh`` (:func:`kvjax.sharding.make_mesh`): the layers run tensor-parallel inside
    ``shard_map``, rows over its ``data`` axis and heads (and MLP units) over ``model``,
    on params placed by :func:`shard_params` and a cache made by :func:`new_cache` with
    the same mesh; the hidden states come back split over rows.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    if cache.num_layers != config.num_layers:
        raise ValueError(f"cache has {cache.num_layers} layers, model {config.num_layers}")
    if mesh is None:
        return _hidden_states(params, config, tokens, cache, valid, observe)
    return _sharded_hidden_states(params, config, tokens, cache, valid, observe, mesh)


def _hidden_states(params, config, tokens, cache, valid, observe, model_axis=None):
    num_tokens = tokens.shape[1]
    step = make_step(cache, num_tokens, valid)
    cos, sin = rope_tables(config, cache.positions(step, num_tokens))
    h = jnp.take(params["embed"], tokens, axis=0)
    layer = DecoderLayer(config, attention=cache.config.attention, fused=is_fused(params),
                         return_queries=observe is not None, model_axis=model_axis)

    if observe is None:
        def body(h, layer_params, view):
            return layer.apply({"params": layer_params}, h, view, step, cos, sin)

        h, cache = _scan_layers(body, h, cache, params["layers"])
    else:
        observer = observe[0]

        def body(carry, layer_params, view):
            h, i, state = carry
            h, view, q = layer.apply({"params": layer_params}, h, view, step, cos, sin)
            return (h, i + 1, observer(state, i, q, view, step)), view

        (h, _, state), cache = _scan_layers(body, (h, jnp.int32(0), observe[1]), cache,
                                            params["layers"])
    cache = commit(cache, step)
    h = rms_norm(h, params["final_norm"], config.rms_norm_eps)
    return (h, cache) if observe is None else (h, cache, state)


def _sharded_hidden_states(params, config, tokens, cache, valid, observe, mesh):
    batch, num_tokens = tokens.shape
    check_mesh(config, mesh, rows=batch)
    if is_fused(params):
        raise ValueError("params with fused projections do not split over a mesh: place "
                         "them with shard_params")
    # the whole cache's step: the checks of concrete counts see every row
    make_step(cache, num_tokens, valid)
    if valid is None:
        valid = jnp.full((batch,), num_tokens, jnp.int32)
    split = axis_sizes(mesh)[MODEL]
    local = shard_config(config, split)
    # one device along the model axis: nothing to add up
    axis = MODEL if split > 1 else None
    # the head stays outside: its vocabulary split is XLA's (lm_logits)
    inner = {name: params[name] for name in ("embed", "layers", "final_norm")}
    in_specs = (param_specs(inner), P(DATA), cache_specs(cache), P(DATA))
    out_specs = (P(DATA), in_specs[2])
    if observe is None:
        def run(p, t, c, v):
            return _hidden_states(p, local, t, c, v, None, axis)

        return per_shard(run, mesh, in_specs, out_specs)(inner, tokens, cache, valid)

    observer, state = observe
    if not isinstance(observer, Observer):
        raise ValueError("an observer on a mesh is an Observer, which names its state's "
                         "partition")
    summed = tuple(axis for axis in (DATA, MODEL) if axis not in observer.partition)

    def observed(p, t, c, v, start, inputs):
        local_observer = dataclasses.replace(observer, inputs=inputs)
        h, c, seen = _hidden_states(p, local, t, c, v,
                                    (local_observer, jnp.zeros_like(start)), axis)
        return h, c, start + (jax.lax.psum(seen, summed) if summed else seen)

    return per_shard(
        observed, mesh, (*in_specs, observer.partition, observer.inputs_partition),
        (*out_specs, observer.partition),
    )(inner, tokens, cache, valid, state, observer.inputs)


def attention_observer(config: ModelConfig, weights: jax.Array) -> Observer:
    """An observer whose state ``mass[L, B, K, S]`` (``S`` the cache's ``max_len``)
    gains the attention each stored position receives from the chunk's queries,
    weighted per query by ``weights[B, T]`` (:func:`kvjax.eviction.attention_mass`);
    split over rows and kv heads on a mesh (``weights`` too)."""
    def observe(mass, i, q, view, step, weights):
        lengths = step.start + step.valid
        keys = dense(view.k, lengths, jnp.float32, restore_keys=True)
        seen = attention_mass(q, keys, step.positions(q.shape[1]), lengths, weights,
                              config.head_dim ** -0.5)
        return mass.at[i].add(seen)

    return Observer(observe, ROWS_HEADS, weights, P(DATA))


def query_moment_observer(config: ModelConfig) -> Observer:
    """An observer whose state ``float32[L, K, D, D]`` gains, per kv head, ``sum q q^T``
    over the chunk's real queries of every query head that shares it."""
    def observe(moment, i, q, view, step, _):
        batch, tokens = q.shape[:2]
        # the kv heads of the view: a device's own on a mesh
        heads = view.k.raw.shape[1]
        real = (jnp.arange(tokens)[None, :] < step.valid[:, None]).astype(jnp.float32)
        q = q.astype(jnp.float32).reshape(batch, tokens, heads, -1, config.head_dim)
        weighted = q * real[:, :, None, None, None]
        return moment.at[i].add(jnp.einsum("btkgd,btkge->kde", weighted, q,
                                           precision=jax.lax.Precision.HIGHEST))

    return Observer(observe, P(None, MODEL))


def lm_logits(params: Params, config: ModelConfig, h: jax.Array) -> jax.Array:
    """Float32 logits ``[..., V]`` of final-normed hidden states ``[..., H]``."""
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return (h @ head).astype(jnp.float32)


def forward(
    params: Params, config: ModelConfig, tokens: jax.Array, cache: KVCache,
    valid: jax.Array | None = None, mesh: Mesh | None = None,
) -> tuple[jax.Array, KVCache]:
    """Logits ``[B, T, V]`` (float32) of a chunk ``tokens [B, T]``, and the updated cache.

    Token ``t`` of row ``b`` sits at position ``cache.lengths[b] + t``. ``valid[B]`` (default
    ``T``) counts each row's real tokens; a right-padded tail is neither stored nor
    attended to, and its logits are meaningless. ``mesh``: tensor-parallel over it
    (:func:`hidden_states`). Jit with ``static_argnums=1`` and ``mesh`` static.
    """
    h, cache = hidden_states(params, config, tokens, cache, valid, mesh=mesh)
    return lm_logits(params, config, h), cache


#: :func:`forward` jitted with the weights as an argument (not a closure constant, which
#: XLA would fold into the program: about 8x slower to compile for a 135M model on CPU)
jit_forward = jax.jit(forward, static_argnums=1, static_argnames="mesh")


def new_cache(
    config: ModelConfig, cache_config: CacheConfig, *, batch: int, max_len: int,
    dtype: Any = jnp.bfloat16, key: jax.Array | None = None, calibration: Any = None,
    mesh: Mesh | None = None, num_pages: int | None = None,
) -> KVCache:
    """An empty kvjax cache shaped for this model (``calibration``: the key calibration
    of a spec with ``calib`` clauses, :func:`models.evaluate.calibrate_keys`; codecs that
    take fitted parameters read the checkpoint of the spec's ``fit=`` clause,
    :func:`kvjax.calibration.fitted_of`). ``mesh``: made split over it, rows over
    ``data`` and kv heads over ``model`` (:func:`kvjax.sharding.new_sharded_cache`),
    the same values as without. ``num_pages``: a paged spec's pool, its tables empty
    (:func:`kvjax.cache.init_cache`)."""
    make = _cache_maker(config, cache_config, batch=batch, max_len=max_len, dtype=dtype,
                        key=key, calibration=calibration, num_pages=num_pages)
    if mesh is None:
        return make()
    check_mesh(config, mesh, rows=batch)
    return new_sharded_cache(mesh, make)


def _cache_maker(config: ModelConfig, cache_config: CacheConfig, *, batch: int, max_len: int,
                 dtype: Any, key: jax.Array | None, calibration: Any,
                 num_pages: int | None) -> Callable[[], KVCache]:
    fitted = fitted_of(cache_config) if cache_config.fit else None

    def make() -> KVCache:
        return init_cache(
            jax.random.PRNGKey(0) if key is None else key, cache_config,
            num_layers=config.num_layers, batch=batch, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, max_len=max_len, dtype=dtype, calibration=calibration,
            fitted=fitted, num_pages=num_pages,
        )

    return make


def cache_shape(
    config: ModelConfig, cache_config: CacheConfig, *, batch: int, max_len: int,
    dtype: Any = jnp.bfloat16, key: jax.Array | None = None, calibration: Any = None,
    mesh: Mesh | None = None, num_pages: int | None = None,
) -> KVCache:
    """The cache :func:`new_cache` makes with the same arguments, as
    :class:`jax.ShapeDtypeStruct` leaves carrying the shardings its arrays will have
    (the default device's without ``mesh``): nothing is allocated. Programs compiled
    for it take the cache itself, and compiling them before the cache exists leaves
    XLA's compile-time scratch (autotuning buffers) the memory the cache will take."""
    make = _cache_maker(config, cache_config, batch=batch, max_len=max_len, dtype=dtype,
                        key=key, calibration=calibration, num_pages=num_pages)
    if mesh is not None:
        check_mesh(config, mesh, rows=batch)
        return sharded_cache_shape(mesh, make)
    here = jnp.zeros(()).sharding  # where an array made without a placement goes
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                          sharding=here),
                        jax.eval_shape(make))


def logits_no_cache(
    params: Params, config: ModelConfig, tokens: jax.Array,
    cache_config: CacheConfig | None = None,
) -> jax.Array:
    """Logits ``[B, T, V]`` of one forward over ``tokens`` on a fresh cache of ``T`` slots.

    The cache is the exact float32 one unless ``cache_config`` says otherwise.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    cache_config = cache_config or CacheConfig(k="f32", v="f32")
    cache = new_cache(config, cache_config, batch=tokens.shape[0], max_len=tokens.shape[1],
                      dtype=jnp.float32)
    # an explicit `valid` keeps the jit signature equal to padded-batch calls of forward
    valid = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    return jit_forward(params, config, tokens, cache, valid)[0]


def init_params(key: jax.Array, config: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """Random params in the shared layout: N(0, 1/fan_in) weights, ~1 norms, small biases."""
    # one compiled program instead of an eager dispatch (and compile) per leaf shape
    return _init_params_jit(key, config, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _init_params_jit(key: jax.Array, config: ModelConfig, dtype: Any) -> Params:
    is_shape = lambda s: isinstance(s, tuple)
    shapes = param_shapes(config)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    sizes = [math.prod(shape) for _, shape in with_paths]
    # one draw sliced into leaves: a random op per leaf shape compiles far slower on CPU
    draws = jax.random.normal(key, (sum(sizes),), jnp.float32)
    leaves, offset = [], 0
    for (path, shape), size in zip(with_paths, sizes, strict=True):
        name = jax.tree_util.keystr(path)
        z = draws[offset : offset + size].reshape(shape)
        offset += size
        if "norm" in name:
            # not exactly 1 so that a swapped or ignored norm weight shows in tests
            leaf = 1.0 + 0.1 * z
        elif name.endswith(("'bq']", "'bk']", "'bv']")):
            leaf = 0.1 * z
        else:
            leaf = z * shape[-2] ** -0.5
        leaves.append(leaf.astype(dtype))
    return jax.tree.unflatten(treedef, leaves)
