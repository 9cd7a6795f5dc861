"""Caches over meshes of the suite's virtual CPU devices: the mesh grammar, where each
array goes, attention and eviction per device equal to one device's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kvjax import cache as kc
from kvjax import sharding as sh
from kvjax.attention import attend
from kvjax.cache import memory_bytes
from kvjax.spec import parse_cache

LENGTHS = (37, 20, 5, 44)
HEADS, GROUP, HEAD_DIM = 4, 2, 64


@pytest.mark.parametrize("text,want", [
    ("data=2,model=4", {"data": 2, "model": 4}),
    (" model = 2 ", {"data": 1, "model": 2}),
    ("", {"data": 1, "model": 1}),
    (None, {"data": 1, "model": 1}),
    ({"data": 8}, {"data": 8, "model": 1}),
])
def test_mesh_grammar(text, want):
    assert sh.parse_mesh(text) == want


@pytest.mark.parametrize("text,message", [
    ("rows=2", "mesh axis 'rows' unknown; axes: data, model"),
    ("data=2,data=2", "given twice"),
    ("model=0", "positive size"),
    ("model=two", "is not an integer"),
    ("model", "is not AXIS=SIZE"),
])
def test_bad_meshes_say_why(text, message):
    with pytest.raises(sh.MeshError, match=message):
        sh.parse_mesh(text)


def test_a_mesh_takes_the_first_devices_and_no_more_than_there_are():
    mesh = sh.make_mesh("data=2,model=3")
    assert dict(mesh.shape) == {"data": 2, "model": 3}
    assert list(mesh.devices.flat) == jax.devices()[:6]
    assert sh.describe(mesh) == "data=2,model=3" and sh.describe(None) == "data=1,model=1"
    with pytest.raises(sh.MeshError, match="needs 16 devices, 8 available"):
        sh.make_mesh("data=4,model=4")
    with pytest.raises(sh.MeshError, match=r"3 rows do not split over data=2 \(give a "
                                           r"multiple of 2 rows\); 6 query heads do not "
                                           "split over model=4"):
        sh.check_split(sh.make_mesh("data=2,model=4"), rows=3, kv_heads=4, query_heads=6)


def _cache(spec: str, *, sinks: int = 0):
    """A one-layer cache after a ragged prefill of :data:`LENGTHS` tokens (and the step of
    one more token per row appended after it), rows and heads that split by 2 and 4."""
    config = parse_cache(f"{spec} window=4 sinks={sinks}")
    batch = len(LENGTHS)
    cache = kc.init_cache(jax.random.key(0), config, num_layers=2, batch=batch,
                          num_kv_heads=HEADS, head_dim=HEAD_DIM, max_len=48)
    keys = jax.random.split(jax.random.key(1), 2)
    total = max(LENGTHS)
    k = jax.random.normal(keys[0], (batch, total + 1, HEADS, HEAD_DIM))
    v = jax.random.normal(keys[1], (batch, total + 1, HEADS, HEAD_DIM))
    for tokens, valid in ((slice(0, total), jnp.array(LENGTHS)), (slice(total, None), None)):
        step = kc.make_step(cache, k[:, tokens].shape[1], valid)
        for layer in range(2):
            view = kc.append(cache.layer(layer), k[:, tokens], v[:, tokens], step)
            cache = cache.with_layer(layer, view)
        cache = kc.commit(cache, step)
    return cache, step


def test_every_array_of_a_cache_has_its_place():
    cache, _ = _cache("hqmq:s24,r3 center=first smooth=first layers[0]:k=bf16", sinks=2)
    assert len(cache.segments) == 2
    specs = sh.cache_specs(cache)
    leaves = jax.tree.leaves(cache)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(spec_leaves)
    for leaf, spec in zip(leaves, spec_leaves, strict=True):
        assert len(spec) <= leaf.ndim
    seg = specs.segments[1]
    assert seg.k.raw == P(None, "data", "model") and seg.k.shift == P(None, "data", "model")
    assert seg.k.nonfinite == P(None, "data") and specs.lengths == P("data")
    assert set(jax.tree.leaves(seg.k.params, is_leaf=lambda x: isinstance(x, P))) == {
        P(None, "model")}

    mesh = sh.make_mesh("data=2,model=4")
    placed = sh.place_cache(mesh, cache)
    _equal(placed, cache)
    codes = next(leaf for leaf in jax.tree.leaves(placed.segments[1].k.codes) if leaf.size)
    # each of the 8 devices holds 2 rows of 1 kv head
    assert {s.data.shape[1:3] for s in codes.addressable_shards} == {(2, 1)}
    # the bytes a device holds, as the shapes alone predict them
    for device in mesh.devices.flat:
        held = sum(s.data.nbytes for leaf in jax.tree.leaves(placed)
                   for s in leaf.addressable_shards if s.device == device)
        assert held == sh.bytes_per_device("data=2,model=4", jax.eval_shape(lambda: cache))
    with pytest.raises(sh.MeshError, match="4 kv heads do not split over model=3"):
        sh.place_cache(sh.make_mesh("model=3"), cache)


def test_a_sharded_cache_is_made_in_place_with_the_same_values():
    config = parse_cache("turboquant:b3 window=4 sinks=2")
    kw = {"num_layers": 2, "batch": 4, "num_kv_heads": HEADS, "head_dim": HEAD_DIM,
          "max_len": 48}
    want = kc.init_cache(jax.random.key(5), config, **kw)
    mesh = sh.make_mesh("data=2,model=2")
    got = sh.new_sharded_cache(mesh, lambda: kc.init_cache(jax.random.key(5), config, **kw))
    _equal(got, want)
    assert got.segments[0].k.raw.sharding.spec == P(None, "data", "model")
    assert memory_bytes(got) == memory_bytes(want)


def _equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 a, b)


@pytest.mark.parametrize("spec,impl", [
    ("int:4", "reference"),
    ("bf16", "xla"),
    ("k=saw:h32 v=int:4", "int_decode"),
    ("k=turboquant:b3,qjl v=kivi:3,g32,token", "codebook_decode"),
])
def test_attention_per_device_equals_one_device(spec, impl):
    """A decode step's attention, each device over its rows and heads (fused kernels in
    interpret mode), equals attention over the whole cache."""
    cache, step = _cache(spec)
    q = jax.random.normal(jax.random.key(2), (len(LENGTHS), 1, HEADS * GROUP, HEAD_DIM))

    def run(q, cache, step):
        return attend(q, cache.layer(1), step, impl=impl)

    want = run(q, cache, step)
    mesh = sh.make_mesh("data=2,model=2")
    rows_heads = P("data", None, "model")
    got = sh.per_shard(run, mesh, (rows_heads, sh.cache_specs(cache),
                                   jax.tree.map(lambda _: P("data"), step)),
                       rows_heads)(q, sh.place_cache(mesh, cache), step)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    if impl != "reference":  # really the implementation named
        reference = attend(q, cache.layer(1), step, impl="reference")
        assert not np.array_equal(np.asarray(want), np.asarray(reference))


@pytest.mark.parametrize("policy", ["h2o:24", "streaming:20"])
def test_eviction_per_device_equals_one_device(policy):
    prompts, _ = _cache("bf16")
    target = kc.init_cache(jax.random.key(0), parse_cache(f"int:4 evict={policy}"),
                           num_layers=2, batch=4, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                           max_len=32)
    mass = (jax.random.uniform(jax.random.key(3), (2, 4, HEADS, prompts.max_len))
            if policy.startswith("h2o") else None)
    want = kc.evict_into(prompts, mass, target)
    mesh = sh.make_mesh("data=2,model=4")
    got = sh.sharded_evict_into(mesh, sh.place_cache(mesh, prompts), mass,
                                sh.place_cache(mesh, target))
    _equal(got, want)
    assert int(jnp.sum(got.evicted)) > 0


def test_a_paged_cache_is_not_split_over_a_mesh():
    config = parse_cache("int:4 page=16")
    make = functools.partial(kc.init_cache, jax.random.key(0), config, num_layers=1,
                             batch=4, num_kv_heads=HEADS, head_dim=HEAD_DIM, max_len=48)
    with pytest.raises(sh.MeshError, match="'int:4 page=16' is paged: a paged cache runs "
                                           "on one device"):
        sh.new_sharded_cache(sh.make_mesh("data=2"), make)
