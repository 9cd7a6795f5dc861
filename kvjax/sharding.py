"""A compressed cache over several devices, with JAX's own meshes and ``shard_map``.

A mesh has two named axes: ``data`` splits the rows (sequences) and ``model`` the kv
heads (and, in a model, the query heads and the MLP's hidden units: tensor parallelism).
Every array of a :class:`~kvjax.cache.KVCache` has its rows and kv heads on fixed axes
(codes, raw window, sinks and key-transform vectors ``[L, B, K, ...]``, codec parameters
``[L, K, ...]``, flags ``[L, B]``, lengths ``[B]``), so :func:`cache_specs` names a
partition for each, and a device holds its own rows' codes of its own heads only.

Attention, appends and evictions are independent per (row, kv head): :func:`per_shard`
runs a function of whole caches on each device's block of them inside
:func:`jax.shard_map`, where every existing implementation (the reference, XLA's and the
fused Pallas kernels) sees an ordinary, smaller cache and no device reads another's
codes. One device, or no mesh, is the plain path: nothing here is used.

    mesh = make_mesh("data=2,model=4")
    cache = new_sharded_cache(mesh, lambda: init_cache(key, config, ...))
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.cache import KVCache, Store, evict_into

#: the mesh axis over rows (sequences)
DATA = "data"
#: the mesh axis over heads (tensor parallelism)
MODEL = "model"
AXES = (DATA, MODEL)


class MeshError(ValueError):
    """A mesh that cannot be built, or that cannot split the rows or heads given."""


def parse_mesh(text: str | Mapping[str, int] | None) -> dict[str, int]:
    """``"data=2,model=4"`` (either axis may be left out: size 1; ``""`` or None: one
    device) as ``{"data": 2, "model": 4}``; a mapping is checked the same way."""
    if text is None:
        return {DATA: 1, MODEL: 1}
    if isinstance(text, Mapping):
        items = [(str(k), v) for k, v in text.items()]
    else:
        items = []
        for part in (p.strip() for p in str(text).split(",")):
            if not part:
                continue
            name, sep, size = part.partition("=")
            if not sep:
                raise MeshError(f"mesh '{text}': '{part}' is not AXIS=SIZE "
                                f"(axes: {', '.join(AXES)})")
            try:
                if not re.fullmatch(r"\s*[+-]?\d+\s*", size, re.ASCII):
                    raise ValueError(size)  # int() also reads '1_0' and other scripts' digits
                items.append((name.strip(), int(size)))
            except ValueError:
                raise MeshError(f"mesh '{text}': size '{size.strip()}' of {name.strip()} "
                                "is not an integer") from None
    shape = {DATA: 1, MODEL: 1}
    seen = set()
    for name, size in items:
        if name not in AXES:
            raise MeshError(f"mesh axis '{name}' unknown; axes: {', '.join(AXES)}")
        if name in seen:
            raise MeshError(f"mesh axis '{name}' given twice")
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise MeshError(f"mesh axis {name} must have a positive size, got {size!r}")
        seen.add(name)
        shape[name] = int(size)
    return shape


def make_mesh(shape: str | Mapping[str, int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, model)`` mesh of the first ``data * model`` of ``devices`` (default:
    ``jax.devices()``); :func:`parse_mesh` reads ``shape``. Devices of one host and
    one kind are expected; neighbours in the device list share a ``model`` group, the
    axis that communicates at every layer."""
    sizes = parse_mesh(shape)
    devices = list(jax.devices() if devices is None else devices)
    need = sizes[DATA] * sizes[MODEL]
    if need > len(devices):
        raise MeshError(f"mesh data={sizes[DATA]},model={sizes[MODEL]} needs {need} "
                        f"devices, {len(devices)} available")
    grid = np.array(devices[:need], dtype=object).reshape(sizes[DATA], sizes[MODEL])
    return Mesh(grid, AXES)


def describe(mesh: Mesh | None) -> str:
    """``data=D,model=M`` (``data=1,model=1`` for None): what :func:`parse_mesh` reads."""
    sizes = axis_sizes(mesh)
    return f"{DATA}={sizes[DATA]},{MODEL}={sizes[MODEL]}"


def axis_sizes(mesh: Mesh | None) -> dict[str, int]:
    """``{"data": D, "model": M}`` of a mesh (ones for None)."""
    if mesh is None:
        return {DATA: 1, MODEL: 1}
    if tuple(mesh.axis_names) != AXES:
        raise MeshError(f"a kvjax mesh has the axes {AXES}, got {tuple(mesh.axis_names)}")
    return {name: int(mesh.shape[name]) for name in AXES}


def check_split(mesh: Mesh | None, *, rows: int | None = None,
                kv_heads: int | None = None, **others: int) -> None:
    """Raise :class:`MeshError` unless ``rows`` divide over the data axis and
    ``kv_heads`` (and every other named count, e.g. ``query_heads=``) over the model
    axis: one line naming each count that does not."""
    sizes = axis_sizes(mesh)
    problems = []
    if rows is not None and rows % sizes[DATA]:
        problems.append(f"{rows} {'row does' if rows == 1 else 'rows do'} not split over "
                        f"{DATA}={sizes[DATA]} (give a multiple of {sizes[DATA]} rows)")
    for name, count in (("kv_heads", kv_heads), *others.items()):
        if count is not None and count % sizes[MODEL]:
            problems.append(f"{count} {name.replace('_', ' ')} do not split over "
                            f"{MODEL}={sizes[MODEL]}")
    if problems:
        raise MeshError("; ".join(problems))


# -- where each array of a cache goes -----------------------------------------------------

#: rows and kv heads on the two axes after the layer axis (codes, raw tokens, and any
#: per-(layer, row, kv head) array such as eviction's attention scores)
ROWS_HEADS = P(None, DATA, MODEL)


def _store_specs(store: Store) -> Store:
    def spread(tree, spec):
        return jax.tree.map(lambda _: spec, tree)

    return dataclasses.replace(
        store,
        codes=spread(store.codes, ROWS_HEADS),
        params=spread(store.params, P(None, MODEL)),
        raw=ROWS_HEADS, sink=ROWS_HEADS,
        nonfinite=P(None, DATA), saturated=P(None, DATA),
        shift=spread(store.shift, ROWS_HEADS), scale=spread(store.scale, ROWS_HEADS),
        layer=None,
    )


def cache_specs(cache: KVCache) -> KVCache:
    """``cache`` with a :class:`~jax.sharding.PartitionSpec` in place of every array
    (the same pytree structure): rows over ``data``, kv heads over ``model``. Works on a
    cache of :class:`jax.ShapeDtypeStruct` leaves too (``jax.eval_shape``)."""
    if any(seg.k.layer is not None for seg in cache.segments):
        raise ValueError("cache_specs takes a whole cache, not a layer view")
    segments = tuple(dataclasses.replace(seg, k=_store_specs(seg.k), v=_store_specs(seg.v))
                     for seg in cache.segments)
    rows = P(DATA)
    return dataclasses.replace(
        cache, segments=segments, lengths=rows, overflowed=rows, bad_valid=rows,
        evicted=None if cache.evicted is None else rows)


def check_cache(mesh: Mesh | None, cache: KVCache) -> None:
    """:func:`check_split` of a cache's rows and kv heads; a paged cache (one pool every
    row reads) is not split over a mesh."""
    if mesh is not None and cache.pages is not None:
        raise MeshError(f"cache spec '{cache.config.spec}' is paged: a paged cache runs on "
                        "one device (drop page= or the mesh)")
    raw = cache.segments[0].k.raw
    check_split(mesh, rows=int(raw.shape[1]), kv_heads=int(raw.shape[2]))


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _empty(leaf) -> bool:
    return math.prod(leaf.shape) == 0


def leaf_specs(specs: Any, tree: Any) -> list[P]:
    """``specs`` (a PartitionSpec per leaf or per subtree: a prefix of ``tree``, as
    ``shard_map`` takes them) as one spec per leaf of ``tree``, in leaf order."""
    per_leaf = jax.tree.map(lambda spec, sub: [spec] * len(jax.tree.leaves(sub)), specs,
                            tree, is_leaf=lambda x: _is_spec(x) or x is None)
    return [spec for group in jax.tree.leaves(per_leaf, is_leaf=lambda x: isinstance(x, list))
            for spec in group]


def shardings(mesh: Mesh, specs: Any, tree: Any) -> Any:
    """A :class:`~jax.sharding.NamedSharding` on ``mesh`` per leaf of ``tree``, from its
    spec; a zero-size leaf (an empty code leaf, a raw window of no tokens) is whole on
    every device, as JAX returns such arrays from any jitted function, so a cache placed
    here and one a jitted step returns are laid out alike."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [
        NamedSharding(mesh, P() if _empty(leaf) else spec)
        for leaf, spec in zip(leaves, leaf_specs(specs, tree), strict=True)])


def place_cache(mesh: Mesh, cache: KVCache) -> KVCache:
    """``cache`` moved onto ``mesh``, each device given its rows' codes of its heads."""
    check_cache(mesh, cache)
    return jax.device_put(cache, shardings(mesh, cache_specs(cache), cache))


def sharded_cache_shape(mesh: Mesh, make: Callable[[], KVCache]) -> KVCache:
    """The cache ``make()`` would build, as :class:`jax.ShapeDtypeStruct` leaves that
    carry its sharded layout on ``mesh`` (:func:`new_sharded_cache`'s): nothing is
    allocated, so a program can be compiled for the cache before it exists."""
    shape = jax.eval_shape(make)
    check_cache(mesh, shape)
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, sharding=sharding), shape,
        shardings(mesh, cache_specs(shape), shape))


def new_sharded_cache(mesh: Mesh, make: Callable[[], KVCache]) -> KVCache:
    """The cache ``make()`` builds (e.g. a closure over :func:`kvjax.cache.init_cache`),
    created directly in its sharded layout: no device ever holds the whole cache, so a
    cache larger than one device's memory can be made."""
    shape = sharded_cache_shape(mesh, make)
    return jax.jit(make, out_shardings=jax.tree.map(lambda leaf: leaf.sharding, shape))()


def sharded_zeros(mesh: Mesh, shape: tuple[int, ...], dtype: Any, spec: P) -> jax.Array:
    """Zeros of ``shape`` created split over ``mesh`` by ``spec``, each device making its
    block only."""
    return jax.jit(lambda: jnp.zeros(shape, dtype),
                   out_shardings=NamedSharding(mesh, spec))()


def _local_shape(shape: tuple[int, ...], spec: P, sizes: dict[str, int]) -> tuple[int, ...]:
    axes = (*spec, *[None] * (len(shape) - len(spec)))
    return tuple(n if axis is None else n // sizes[axis]
                 for n, axis in zip(shape, axes, strict=True))


def per_shard(fn: Callable, mesh: Mesh, in_specs: tuple, out_specs: Any) -> Callable:
    """``fn`` run on each device's block of its arguments (:func:`jax.shard_map`,
    jitted): inside it a cache is an ordinary one of the device's rows and heads.
    ``in_specs``: one spec (or spec prefix) per argument, as :func:`cache_specs` gives
    them; values the blocks must agree on are the caller's to reduce
    (``jax.lax.psum`` over :data:`MODEL`)."""
    sizes = axis_sizes(mesh)

    @jax.jit
    def call(*args):
        leaves, treedef = jax.tree.flatten(args)
        specs = leaf_specs(tuple(in_specs), args)
        # a zero-size leaf comes whole on every device (shardings): each device gets an
        # empty array of its block's shape instead, which holds the same nothing
        blocks = [jnp.zeros(_local_shape(leaf.shape, spec, sizes), leaf.dtype)
                  if _empty(leaf) else leaf for leaf, spec in zip(leaves, specs, strict=True)]
        specs = [P() if _empty(leaf) else spec for leaf, spec in zip(leaves, specs, strict=True)]

        def local(*block):
            return fn(*jax.tree.unflatten(treedef, block))

        # Pallas kernels carry no varying-axis types, so the check is off; the specs
        # place every array, and the callers reduce what is split explicitly
        return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs,
                             check_vma=False)(*blocks)

    return call


def sharded_evict_into(mesh: Mesh, prompts: KVCache, mass: jax.Array | None,
                       target: KVCache) -> KVCache:
    """:func:`kvjax.cache.evict_into` of caches split over ``mesh``, on each device's
    rows and heads: a policy picks tokens per (row, kv head), so no device reads
    another's. ``mass`` ``[L, B, K, S]`` is split as the caches are."""
    return _sharded_evict_into(mesh, prompts, mass, target)


@functools.partial(jax.jit, static_argnums=0)
def _sharded_evict_into(mesh, prompts, mass, target):
    # jitted here, so one compiled program serves every prefill of the same shapes
    specs = cache_specs(target)
    if mass is None:
        return per_shard(lambda p, t: evict_into(p, None, t), mesh,
                         (cache_specs(prompts), specs), specs)(prompts, target)
    return per_shard(evict_into, mesh, (cache_specs(prompts), ROWS_HEADS, specs),
                     specs)(prompts, mass, target)


def tree_bytes_per_device(mesh_shape: str | Mapping[str, int] | None, tree: Any,
                          specs: Any) -> int:
    """Bytes each device holds of ``tree`` (arrays or ``jax.eval_shape`` structs) placed
    by ``specs`` (a PartitionSpec per leaf) on a mesh of ``mesh_shape``: every leaf's
    bytes over the sizes of the axes it is split along, rounded up per axis (a
    replicated leaf counts whole)."""
    sizes = parse_mesh(mesh_shape)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    total = 0
    for leaf, spec in zip(jax.tree.leaves(tree), spec_leaves, strict=True):
        axes = (*spec, *[None] * (len(leaf.shape) - len(spec)))
        shape = [-(-n // sizes[axis]) if axis is not None else n
                 for n, axis in zip(leaf.shape, axes, strict=True)]
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def bytes_per_device(mesh_shape: str | Mapping[str, int] | None, cache: KVCache) -> int:
    """Bytes each device holds of ``cache`` (arrays or ``jax.eval_shape`` structs) split
    over a mesh of ``mesh_shape`` (:func:`tree_bytes_per_device`, :func:`cache_specs`)."""
    return tree_bytes_per_device(mesh_shape, cache, cache_specs(cache))
