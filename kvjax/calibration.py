"""Calibrated codec parameters: fit them on a model's activations, keep them on disk.

Codecs whose :attr:`~kvjax.codec.Codec.needs_fit` is true (``saw:c256``, ``saw:hess``)
take parameters fitted on calibration text instead of seeded ones. The pipeline:

1. :class:`Activations`: per layer and kv head, the keys and values that a model stored
   for calibration text (through the same cache path as inference, a float32 cache) and
   the second moment ``sum q q^T`` of the queries that attend to them
   (:func:`models.evaluate.collect_activations` gathers them).
2. :func:`fit_cache`: every (layer, K|V) whose codec needs fitting is fitted, all kv
   heads at once (``jax.vmap`` of :meth:`~kvjax.codec.Codec.fit`), seeded per (layer,
   head, K|V) from one key, with a progress bar.
3. :func:`save_fitted` / :func:`load_fitted`: a :mod:`kvjax.checkpoint` of kind
   ``codec-params`` holding each fitted array, the codec spec each (layer, K|V) was fitted
   for, the shape ``(layers, kv heads, head dim)`` and the caller's metadata (model,
   corpus, tokens, seed). A cache spec names it with ``fit=DIR``;
   :func:`fitted_of` reads it (:func:`models.llama.new_cache` does) and
   :func:`kvjax.cache.init_cache` refuses parameters fitted for another codec or shape.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.checkpoint import CheckpointError, load_arrays, save_arrays
from kvjax.codec import Codec
from kvjax.spec import CacheConfig, parse_codec

#: :func:`save_fitted`'s checkpoint kind
KIND = "codec-params"
ROLES = ("k", "v")


@dataclasses.dataclass(frozen=True)
class Activations:
    """What a model stores and asks of its cache on calibration text.

    ``keys``, ``values``: ``float32[L, K, N, D]``, the ``N`` calibration tokens of every
    (layer, kv head), rows pooled (keys as the cache receives them, after the rotary
    embedding); ``query_moment``: ``float32[L, K, D, D]``, ``sum q q^T`` over those tokens'
    queries of every query head that shares the kv head.
    """

    keys: Any
    values: Any
    query_moment: Any

    def __post_init__(self):
        keys, values = (jnp.asarray(a, jnp.float32) for a in (self.keys, self.values))
        moment = jnp.asarray(self.query_moment, jnp.float32)
        if keys.ndim != 4 or keys.shape != values.shape:
            raise ValueError(f"keys and values must be [layers, kv heads, tokens, head dim] "
                             f"of one shape, got {keys.shape} and {values.shape}")
        layers, heads, _, dim = keys.shape
        if moment.shape != (layers, heads, dim, dim):
            raise ValueError(f"query_moment must be {[layers, heads, dim, dim]}, got "
                             f"{list(moment.shape)}")
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "query_moment", moment)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(layers, kv heads, head dim)``."""
        layers, heads, _, dim = self.keys.shape
        return layers, heads, dim

    @property
    def tokens(self) -> int:
        return int(self.keys.shape[2])


@dataclasses.dataclass(frozen=True)
class Fitted:
    """Fitted codec parameters of a whole cache.

    ``codecs[role][layer]``: the spec of the codec that (layer, K|V) was fitted for, None
    where nothing was fitted; ``params[role][layer]``: its parameters, leaves ``[K, ...]``
    (every kv head), or None; ``shape``: ``(layers, kv heads, head dim)``; ``metadata``:
    JSON values saved with them (model, corpus, tokens, seed).
    """

    codecs: Mapping[str, tuple[str | None, ...]]
    params: Mapping[str, tuple[Any, ...]]
    shape: tuple[int, int, int]
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def layer_params(self, role: str, layer: int, codec: Codec, num_kv_heads: int,
                     head_dim: int) -> Any:
        """The parameters of ``layer``'s ``role`` for a cache that stores it with
        ``codec``; a ``ValueError`` when they were fitted for another codec or shape."""
        layers, heads, dim = self.shape
        if (heads, dim) != (num_kv_heads, head_dim) or not 0 <= layer < layers:
            raise ValueError(f"the fitted parameters are for [layers, kv heads, head dim] = "
                             f"{list(self.shape)}; the cache asks for layer {layer} of "
                             f"{num_kv_heads} kv heads of dim {head_dim}")
        fitted_for = self.codecs[role][layer]
        if fitted_for != codec.spec:
            raise ValueError(f"layer {layer}'s {role.upper()} was fitted for "
                             f"{fitted_for or 'no codec'}, the cache stores it as "
                             f"{codec.spec}")
        return self.params[role][layer]


def _head_keys(key: jax.Array, layer: int, role: str, heads: int) -> jax.Array:
    base = jax.random.fold_in(jax.random.fold_in(key, layer), ROLES.index(role))
    return jax.vmap(lambda h: jax.random.fold_in(base, h))(jnp.arange(heads))


def fit_cache(config: CacheConfig, activations: Activations, *, key: jax.Array,
              progress: bool = False, metadata: Mapping[str, Any] | None = None) -> Fitted:
    """Fit every (layer, K|V) of ``config`` whose codec needs fitting on
    ``activations``: keys with the query moment, values alone. ``key`` seeds each
    (layer, kv head, K|V) apart; ``progress`` shows a bar over the fits. Raises
    ``ValueError`` when no codec of ``config`` needs fitting."""
    layers, heads, _ = activations.shape
    per_layer = config.layer_codecs(layers)
    work = [(layer, role, codec) for layer, pair in enumerate(per_layer)
            for role, codec in zip(ROLES, pair, strict=True) if codec.needs_fit]
    if not work:
        raise ValueError(f"no codec of cache '{config.spec}' takes fitted parameters")
    codecs = {role: [None] * layers for role in ROLES}
    params = {role: [None] * layers for role in ROLES}
    if progress:
        from tqdm.auto import tqdm

        work = tqdm(work, desc="fitting", unit="fit")
    for layer, role, codec in work:
        data = activations.keys[layer] if role == "k" else activations.values[layer]
        keys = _head_keys(key, layer, role, heads)
        if role == "k":
            fitted = _fit_heads(codec, keys, data, activations.query_moment[layer])
        else:
            fitted = _fit_heads(codec, keys, data, None)
        codecs[role][layer] = codec.spec
        params[role][layer] = jax.block_until_ready(fitted)
    return Fitted(codecs={r: tuple(c) for r, c in codecs.items()},
                  params={r: tuple(p) for r, p in params.items()},
                  shape=activations.shape,
                  metadata={**(metadata or {}), "tokens": activations.tokens})


@functools.partial(jax.jit, static_argnums=0)
def _fit_heads(codec: Codec, keys, data, moment):
    if moment is None:
        return jax.vmap(lambda k, x: codec.fit(k, x))(keys, data)
    return jax.vmap(codec.fit)(keys, data, moment)


def _names(role: str, layer: int, tree: Any) -> dict[str, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {f"{role}/{layer}{jax.tree_util.keystr(path)}": leaf for path, leaf in leaves}


def _template(codec: Codec, heads: int, head_dim: int) -> Any:
    """The abstract parameters of every kv head: :meth:`Codec.init`'s, stacked."""
    return jax.eval_shape(jax.vmap(lambda k: codec.init(k, head_dim)),
                          jax.random.split(jax.random.PRNGKey(0), heads))


def save_fitted(path: str | Path, fitted: Fitted, *, overwrite: bool = False) -> int:
    """Write ``fitted`` to the directory ``path`` (:mod:`kvjax.checkpoint`, kind
    :data:`KIND`); returns its bytes on disk."""
    arrays = {}
    for role in ROLES:
        for layer, tree in enumerate(fitted.params[role]):
            if tree is not None:
                arrays.update(_names(role, layer, tree))
    metadata = {**fitted.metadata, "shape": list(fitted.shape),
                "codecs": {r: list(c) for r, c in fitted.codecs.items()}}
    return save_arrays(path, arrays, metadata, kind=KIND, overwrite=overwrite)


def load_fitted(path: str | Path) -> Fitted:
    """The :class:`Fitted` that :func:`save_fitted` wrote at ``path``; a
    :class:`~kvjax.checkpoint.CheckpointError` for anything else, an unfinished or a
    corrupt checkpoint, or arrays that are not the recorded codecs' parameters."""
    arrays, record = load_arrays(path, kind=KIND)
    metadata = dict(record["metadata"])
    try:
        layers, heads, dim = (int(n) for n in metadata.pop("shape"))
        codecs = {r: tuple(metadata["codecs"][r]) for r in ROLES}
        metadata.pop("codecs")
        if any(len(c) != layers for c in codecs.values()):
            raise ValueError("a codec list per role of one entry per layer")
        params: dict[str, list[Any]] = {r: [] for r in ROLES}
        expected: set[str] = set()
        for role in ROLES:
            for layer, spec in enumerate(codecs[role]):
                if spec is None:
                    params[role].append(None)
                    continue
                template = _template(parse_codec(spec), heads, dim)
                names = _names(role, layer, template)
                expected |= set(names)
                for name, leaf in names.items():
                    got = arrays.get(name)
                    if got is None or got.shape != leaf.shape or got.dtype != leaf.dtype:
                        raise ValueError(f"'{name}' should be {leaf.dtype}{list(leaf.shape)}")
                params[role].append(jax.tree.unflatten(
                    jax.tree.structure(template), [jnp.asarray(arrays[n]) for n in names]))
        if set(arrays) != expected:
            raise ValueError(f"arrays no codec takes: {sorted(set(arrays) - expected)[:3]}")
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: not fitted codec parameters of this kvjax "
                              f"({err})") from err
    return Fitted(codecs=codecs, params={r: tuple(p) for r, p in params.items()},
                  shape=(layers, heads, dim), metadata=metadata)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, stamp: tuple[int, int]) -> Fitted:
    del stamp  # in the key only: a rewritten checkpoint is read again
    return load_fitted(path)


def fitted_of(config: CacheConfig) -> Fitted:
    """The fitted parameters that ``config``'s ``fit=`` clause names (read once per
    checkpoint and kept while it is unchanged on disk); ``ValueError`` without one."""
    if not config.fit:
        raise ValueError(f"cache spec '{config.spec}' has a codec that takes fitted "
                         "parameters: add fit=DIR (python -m kvjax calibrate --fit SPEC "
                         "--out DIR writes them)")
    path = Path(config.fit)
    record = path / "kvjax.json"
    stamp = (record.stat().st_mtime_ns, record.stat().st_size) if record.exists() else (0, 0)
    return _load_cached(str(path.absolute()), stamp)


def fitted_arrays_equal(a: Fitted, b: Fitted) -> bool:
    """Whether two fits hold the same codecs and bit-identical parameters."""
    if a.codecs != b.codecs or a.shape != b.shape:
        return False
    for role in ROLES:
        for x, y in zip(a.params[role], b.params[role], strict=True):
            if (x is None) != (y is None):
                return False
            if x is not None and not all(
                    np.array_equal(np.asarray(p), np.asarray(q))
                    for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True)):
                return False
    return True


__all__ = ["KIND", "ROLES", "Activations", "Fitted", "fit_cache", "fitted_arrays_equal",
           "fitted_of", "load_fitted", "save_fitted"]
