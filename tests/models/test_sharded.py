"""The model tensor-parallel over meshes of the suite's virtual CPU devices: prefill,
decode, generation and perplexity equal one device's; what cannot split is refused."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import memory_bytes
from kvjax.sharding import MeshError, make_mesh
from kvjax.spec import parse_cache
from models import llama
from models.config import ModelConfig
from models.evaluate import cache_perplexity
from models.generate import decode, generate, load_prompt_cache, prefill, save_prompt_cache
from tests.models.test_generate import programs_at_allocation

#: 8 query heads over 4 kv heads (GQA 2), MLP units and vocabulary that split by 2, 4, 8
CONFIG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8,
                     max_position_embeddings=128)
#: ragged prompts, one longer than the window and block of the codecs below
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(1, 30)), [5] * 12]
NEW = 10


@pytest.fixture(scope="module")
def params():
    return llama.init_params(jax.random.PRNGKey(0), CONFIG)


def _equal_caches(a, b):
    """The same cache up to the order the tensor-parallel sums add in: float leaves
    within float32 rounding, codes equal but for the rare value that rounding moves
    across a quantization boundary (none in the first layer, which no sum precedes)."""
    def same(x, y):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
        else:
            assert np.mean(x != y) <= 0.01 if x.size else True
            if x.ndim >= 2:
                np.testing.assert_array_equal(x[0], y[0])

    jax.tree.map(same, a, b)


@pytest.mark.parametrize("mesh_shape", ["data=4", "data=2,model=4"])
def test_sharded_prefill_equals_one_device(params, mesh_shape):
    cc = parse_cache("int:4 window=4 sinks=2")
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 20), 0, CONFIG.vocab_size)
    valid = jnp.array([20, 13, 7, 20])
    cache = llama.new_cache(CONFIG, cc, batch=4, max_len=32, dtype=jnp.float32)
    want, want_cache = llama.jit_forward(params, CONFIG, tokens, cache, valid)

    mesh = make_mesh(mesh_shape)
    cache = llama.new_cache(CONFIG, cc, batch=4, max_len=32, dtype=jnp.float32, mesh=mesh)
    got, got_cache = llama.jit_forward(llama.shard_params(params, CONFIG, mesh), CONFIG,
                                       tokens, cache, valid, mesh=mesh)
    real = np.arange(20)[None, :] < np.asarray(valid)[:, None]
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)
    # the same codes, windows and flags, every device holding its rows and heads only
    _equal_caches(got_cache, want_cache)
    raw = got_cache.segments[0].k.raw
    sizes = dict(mesh.shape)
    assert {s.data.shape for s in raw.addressable_shards} == {
        (2, 4 // sizes["data"], 4 // sizes["model"], *raw.shape[3:])}


@pytest.mark.parametrize("spec,mesh_shape", [
    ("hqmq:s24,r3 window=4 sinks=2", "data=4,model=2"),      # outliers in a pool per row
    ("turboquant:b3 center=first layers[0]:k=bf16", "data=2,model=4"),
    ("bf16 evict=h2o:16", "data=2,model=2"),   # observed prefill, eviction per device
    ("int:4 attn=int_decode,reference", "data=2,model=2"),  # the fused kernel per device
    ("int:4 evict=snapkv:8,w4", "data=4"),  # a quantized evicting cache, rows split
])
def test_sharded_generation_gives_the_same_tokens(params, spec, mesh_shape, monkeypatch):
    got = []
    cc = parse_cache(spec)
    kw = {"cache_config": cc, "max_new_tokens": NEW, "cache_dtype": jnp.float32,
          "eos_token_ids": ()}
    want = generate(params, CONFIG, PROMPTS, **kw)
    seen, compiled = programs_at_allocation(
        monkeypatch, lambda: got.append(generate(params, CONFIG, PROMPTS,
                                                 mesh=make_mesh(mesh_shape), **kw)))
    got = got[0]
    # the programs compiled for the sharded cache's shape are the ones that ran
    assert all(set(names) >= {"decode"} for names in seen) and compiled.count("decode") == 1
    assert got.tokens == want.tokens
    assert memory_bytes(got.cache) == memory_bytes(want.cache)
    np.testing.assert_array_equal(got.cache.lengths, want.cache.lengths)


@pytest.mark.parametrize("num_kv_heads,mesh_shape", [(2, "model=2"), (8, "data=2,model=4")])
def test_gqa_ratios_that_split(num_kv_heads, mesh_shape):
    config = ModelConfig(**{**CONFIG.__dict__, "num_kv_heads": num_kv_heads})
    p = llama.init_params(jax.random.PRNGKey(2), config)
    # sampled: the draws do not depend on how the logits are split over the vocabulary
    kw = {"cache_config": parse_cache("kivi:2,g8"), "max_new_tokens": 6,
          "cache_dtype": jnp.float32, "eos_token_ids": (), "temperature": 0.8, "seed": 3}
    want = generate(p, config, PROMPTS, **kw)
    assert generate(p, config, PROMPTS, mesh=make_mesh(mesh_shape), **kw).tokens == want.tokens


def test_what_cannot_split_is_refused_naming_the_counts(params):
    config = ModelConfig(**{**CONFIG.__dict__, "num_kv_heads": 2})
    p = llama.init_params(jax.random.PRNGKey(2), config)
    kw = {"cache_config": parse_cache("int:4"), "max_new_tokens": 2}
    with pytest.raises(MeshError, match="2 kv heads do not split over model=4"):
        generate(p, config, PROMPTS, mesh=make_mesh("model=4"), **kw)
    with pytest.raises(MeshError, match="3 rows do not split over data=2"):
        generate(params, CONFIG, PROMPTS[:3], mesh=make_mesh("data=2"), **kw)
    odd = ModelConfig(**{**CONFIG.__dict__, "intermediate_size": 50})
    with pytest.raises(MeshError, match="50 mlp units do not split over model=4"):
        llama.shard_params(llama.init_params(jax.random.PRNGKey(2), odd), odd,
                           make_mesh("model=4"))


def test_fused_and_per_layer_params_split_like_stacked_ones(params):
    mesh = make_mesh("data=2,model=2")
    kw = {"cache_config": parse_cache("int:4 window=4"), "max_new_tokens": 6,
          "cache_dtype": jnp.float32, "eos_token_ids": ()}
    want = generate(params, CONFIG, PROMPTS, **kw)
    fast = llama.decode_layout(params)
    placed = llama.shard_params(fast, CONFIG, mesh)
    assert not llama.is_fused(placed) and isinstance(placed["layers"], tuple)
    assert placed["layers"][0]["wq"].sharding.spec == jax.sharding.PartitionSpec(None,
                                                                                 "model")
    assert generate(fast, CONFIG, PROMPTS, mesh=mesh, **kw).tokens == want.tokens
    with pytest.raises(ValueError, match="fused projections"):
        llama.hidden_states(fast, CONFIG, jnp.zeros((4, 1), jnp.int32),
                            llama.new_cache(CONFIG, kw["cache_config"], batch=4, max_len=8,
                                            mesh=mesh), mesh=mesh)


def test_a_decode_step_gathers_no_cache(params):
    """The compiled step over the mesh communicates only the layers' two sums: no
    all-gather (of a cache or of anything else), no all-to-all."""
    mesh = make_mesh("data=2,model=4")
    cache = llama.new_cache(CONFIG, parse_cache("int:4 window=4"), batch=4, max_len=32,
                            mesh=mesh)
    tokens = jnp.zeros((4, 1), jnp.int32)
    text = llama.jit_forward.lower(llama.shard_params(params, CONFIG, mesh), CONFIG, tokens,
                                   cache, None, mesh=mesh).compile().as_text()
    found = collections.Counter(re.findall(
        r"\b(all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)", text))
    assert set(found) == {"all-reduce"}, found


def test_sharded_perplexity_equals_one_device(params):
    windows = jax.random.randint(jax.random.PRNGKey(3), (4, 24), 0, CONFIG.vocab_size)
    cc = parse_cache("turboquant:b3 window=4")
    mesh = make_mesh("data=2,model=2")
    kw = {"chunk": 8, "cache_dtype": jnp.float32}
    want = cache_perplexity(params, CONFIG, cc, windows, **kw)
    got = cache_perplexity(params, CONFIG, cc, windows, mesh=mesh, **kw)
    np.testing.assert_allclose(got.ppl, want.ppl, rtol=1e-6)
    assert got.bits_per_element == want.bits_per_element


def test_observers_sum_over_the_axes_their_state_is_not_split_along(params):
    tokens = jax.random.randint(jax.random.PRNGKey(4), (4, 12), 0, CONFIG.vocab_size)
    cc = parse_cache("f32")
    moment = jnp.zeros((2, 4, 8, 8), jnp.float32)
    observer = llama.query_moment_observer(CONFIG)
    cache = llama.new_cache(CONFIG, cc, batch=4, max_len=12, dtype=jnp.float32)
    want = llama.hidden_states(params, CONFIG, tokens, cache, observe=(observer, moment))[2]
    mesh = make_mesh("data=2,model=2")
    cache = llama.new_cache(CONFIG, cc, batch=4, max_len=12, dtype=jnp.float32, mesh=mesh)
    got = llama.hidden_states(llama.shard_params(params, CONFIG, mesh), CONFIG, tokens,
                              cache, observe=(observer, moment + 1.0), mesh=mesh)[2]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want) + 1.0, rtol=1e-5, atol=1e-5)


def test_a_prompt_cache_from_disk_decodes_over_a_mesh(params, tmp_path):
    cc = parse_cache("int:4 window=4")
    kw = {"max_new_tokens": NEW, "eos_token_ids": ()}
    want = generate(params, CONFIG, PROMPTS, cache_config=cc, cache_dtype=jnp.float32, **kw)
    pre = prefill(params, CONFIG, PROMPTS, cache_config=cc, max_len=29 + NEW, room=NEW,
                  cache_dtype=jnp.float32, key=jax.random.fold_in(jax.random.PRNGKey(0), 0))
    save_prompt_cache(tmp_path / "p", pre, params=params, config=CONFIG, prompts=PROMPTS)
    stored = load_prompt_cache(tmp_path / "p", params=params, config=CONFIG)
    got = decode(params, CONFIG, stored.prefill, mesh=make_mesh("data=2,model=2"), **kw)
    assert got.tokens == want.tokens
    assert got.cache.segments[0].k.raw.sharding.spec == jax.sharding.PartitionSpec(
        None, "data", "model")
