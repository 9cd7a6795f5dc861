"""Cache memory from the cache's own shapes (kvjax.eval.memory, experiments/memory_table.py)."""

import json
from fractions import Fraction

import jax
import pytest

from experiments import memory_table
from kvjax.cache import init_cache, memory_bytes
from kvjax.codec import CodecError
from kvjax.codecs import IntCodec
from kvjax.eval.memory import (
    MODEL_SHAPES,
    bytes_per_token,
    cache_bytes,
    max_context,
    model_shape,
    pool_pages,
    row_bytes,
)
from kvjax.probe import BASELINE_CODECS
from kvjax.spec import CacheConfig, parse_cache


def _dims(name):
    s = model_shape(name)
    return dict(num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim)


def test_model_shapes_match_the_hf_configs():
    expect = {"smollm2-135m": (30, 9, 3, 64), "llama-3-8b": (32, 32, 8, 128),
              "mistral-7b": (32, 32, 8, 128), "qwen2.5-7b": (28, 28, 4, 128),
              "llama-3-70b": (80, 64, 8, 128)}
    got = {n: (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim)
           for n, s in MODEL_SHAPES.items()}
    assert got == expect
    assert round(MODEL_SHAPES["llama-3-8b"].weight_bytes_bf16 / 1e9, 1) == 16.1


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3-8b", "llama-3-70b"])
def test_bf16_is_two_bytes_per_element(name):
    d = _dims(name)
    out = bytes_per_token("bf16", **d)
    expect = 2 * d["num_layers"] * d["num_kv_heads"] * d["head_dim"] * 2
    assert out["bytes"] == expect and out["k_bytes"] == out["v_bytes"] == expect / 2
    assert out["bits_per_element"] == 16 and out["block_tokens"] == 1


def test_int4_at_head_dim_128_is_four_and_a_quarter_bits():
    d = _dims("llama-3-8b")
    out = bytes_per_token("int:4", **d)
    assert out["bits_per_element"] == 4 + 32 / 128 == IntCodec(bits=4).bits_per_element(128)
    # 16 packed uint32 words and an fp16 scale and zero: 68 bytes per vector
    per_role = d["num_layers"] * d["num_kv_heads"] * 68
    assert out["k_bytes"] == out["v_bytes"] == per_role and out["bytes"] == 2 * per_role


def test_kivi_keys_cost_a_fraction_of_a_block_per_token():
    config = parse_cache("kivi:2,g96")
    k, v = config.k, config.v
    out = bytes_per_token(config, num_layers=1, num_kv_heads=1, head_dim=64)
    assert out["block_tokens"] == 96
    # 96 tokens of 64 2-bit codes (4 words each) and one fp16 scale/zero per channel
    k_expect = Fraction(96 * 4 * 4 + 2 * 64 * 2, 96)
    assert k_expect.denominator != 1
    assert out["k_bytes"] == pytest.approx(float(k_expect), rel=1e-15)
    assert out["k_bytes"] == pytest.approx(k.bits_per_element(64) * 64 / 8, rel=1e-15)
    # values per token: 4 words and one (scale, zero) for the single 64-channel group
    assert out["v_bytes"] == 4 * 4 + 2 * 2 == v.bits_per_element(64) * 64 / 8
    scaled = bytes_per_token(config, num_layers=3, num_kv_heads=5, head_dim=64)
    assert scaled["bytes"] == pytest.approx(15 * out["bytes"], rel=1e-15)


@pytest.mark.parametrize("spec", BASELINE_CODECS)
def test_measured_bits_agree_with_each_codecs_formula(spec):
    config = parse_cache(spec)
    k, v = config.k, config.v
    out = bytes_per_token(config, **_dims("smollm2-135m"))
    assert out["k_bits_per_element"] == pytest.approx(k.bits_per_element(64), rel=1e-12)
    assert out["v_bits_per_element"] == pytest.approx(v.bits_per_element(64), rel=1e-12)


CACHE_CASES = [
    "int:4",
    "fp8 sinks=2",
    "kivi:4,g4 window=3",
    "kivi:2,g8 window=5 sinks=3 layers[0,-1]:k=bf16 layers[1]:v=bf16",
    "k=int:4 v=kivi:2,g8,token layers[1:]:k=kivi:2,g4",
]


@pytest.mark.parametrize("spec", CACHE_CASES)
@pytest.mark.parametrize("context", [9, 40, 45])
def test_cache_bytes_equals_a_real_caches_memory(spec, context):
    shape = dict(num_layers=3, num_kv_heads=2, head_dim=16)
    config = parse_cache(spec)
    cache = init_cache(jax.random.key(0), config, batch=2, max_len=context, **shape)
    got = cache_bytes(config, context=context, batch=2, **shape)
    assert got == memory_bytes(cache)


def test_cache_bytes_is_tokens_times_bytes_per_token_plus_bookkeeping():
    shape = dict(num_layers=4, num_kv_heads=2, head_dim=32)
    # nonfinite and saturated flags per (role, layer, row); per row: length, overflow and
    # bad-valid flags, evicted count
    bookkeeping = 2 * 2 * 4 * 3 + 3 * 10
    per_token = bytes_per_token("int:4", **shape)["bytes"]
    total = cache_bytes("int:4", context=100, batch=3, **shape)
    assert total == 3 * 100 * per_token + bookkeeping
    # KIVI keys: an unfinished group waits raw, so the raw region has G - 1 spare slots
    per_token = bytes_per_token("kivi:2,g32", **shape)["bytes"]
    spare = 4 * 2 * 31 * 32 * 2  # layers * heads * (G - 1) bf16 tokens of 32 elements
    assert cache_bytes("kivi:2,g32", context=128, **shape) == 128 * per_token + spare + 16 + 10


def test_a_row_over_a_mesh_costs_each_device_its_heads_share():
    shape = dict(num_layers=4, num_kv_heads=8, head_dim=32)
    per_row, fixed = row_bytes("turboquant:b3", context=100, **shape)
    assert per_row == cache_bytes("turboquant:b3", context=100, batch=2, **shape) - \
        cache_bytes("turboquant:b3", context=100, **shape)
    # codes split over 4 devices' heads, the rotations too; a row's flags (nonfinite and
    # saturated per role and layer) and counters (length, two flags, evicted) are whole
    # on each device of its data index
    bookkeeping = 2 * 2 * 4 + 10
    split, split_fixed = row_bytes("turboquant:b3", context=100, mesh="data=2,model=4",
                                   **shape)
    assert split == (per_row - bookkeeping) // 4 + bookkeeping and 0 < split_fixed < fixed
    assert cache_bytes("turboquant:b3", context=100, batch=2, mesh="data=2,model=4",
                       **shape) == split + split_fixed


def test_max_context_is_the_largest_that_fits():
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=32)
    config = "k=kivi:2,g32 v=kivi:2,g32,token window=7"
    budget = 50_000
    n = max_context(config, budget_bytes=budget, **shape)
    assert cache_bytes(config, context=n, **shape) <= budget
    assert cache_bytes(config, context=n + 1, **shape) > budget
    assert max_context("bf16 window=7", budget_bytes=10, **shape) == 0


def test_bad_input_is_a_clear_value_error():
    d = _dims("smollm2-135m")
    with pytest.raises(ValueError, match="unknown model 'llama-4'; known models: smollm2"):
        model_shape("llama-4")
    for context in (0, -5):
        with pytest.raises(ValueError, match="context must be a positive int"):
            cache_bytes("int:4", context=context, **d)
    with pytest.raises(ValueError, match="residual_window must be a non-negative int"):
        cache_bytes(CacheConfig(k="int:4", residual_window=-1), context=8, **d)
    with pytest.raises(ValueError, match="sink_tokens=9 exceeds the context of 8"):
        cache_bytes("int:4 sinks=9", context=8, **d)
    with pytest.raises(ValueError, match=r"layers\[30\] names layer 30"):
        cache_bytes("int:4 layers[30]:k=bf16", context=8, **d)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        bytes_per_token("int:4", num_layers=1, num_kv_heads=1, head_dim=0)
    with pytest.raises(ValueError, match="unknown codec 'int5'"):
        bytes_per_token("k=int5 v=int:4", **d)

    class EvenHeadDim(IntCodec):
        def check_head_dim(self, head_dim):
            super().check_head_dim(head_dim)
            if head_dim % 2:
                raise CodecError(f"{self.spec}: head_dim must be even, got {head_dim}")

    odd = CacheConfig(k=EvenHeadDim(bits=4), v=EvenHeadDim(bits=4))
    with pytest.raises(ValueError, match="head_dim must be even, got 63"):
        bytes_per_token(odd, num_layers=1, num_kv_heads=1, head_dim=63)
    with pytest.raises(ValueError, match="head_dim must be even, got 63"):
        cache_bytes(odd, context=8, num_layers=1, num_kv_heads=1, head_dim=63)


def test_table_script_prints_the_table(capsys, tmp_path):
    table = memory_table
    out_json = tmp_path / "rows.json"
    argv = ["--codec", "int:4", "--model", "smollm2-135m", "--json", str(out_json)]
    assert table.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = ("| model | codec | bits/elem | bytes/token | GiB @ 32k | GiB @ 128k "
              "| vs bf16 @ 128k | max context in 141 GB beside bf16 weights |")
    assert header in lines
    row = lines[lines.index(header) + 2]
    # 30 layers * 3 heads * 2 roles * (8 words + 2 fp16) bytes
    assert row.startswith("| smollm2-135m | int:4 | 4.5 | 6,480 | 0.198 | 0.791 | 3.56x |")
    rows = json.loads(out_json.read_text())
    assert len(rows) == 1 and rows[0]["bytes_per_token"] == 6480
    assert rows[0]["cache_bytes"]["32768"] == 32768 * 6480 + 2 * 2 * 30 + 10


def test_table_script_rejects_bad_input(capsys):
    table = memory_table
    assert table.main(["--codec", "int:4", "--model", "gpt-5"]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err
    assert table.main(["--codec", "int:4", "--model", "smollm2-135m", "--contexts", "0"]) == 2
    assert "contexts must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["int:4 window=6 sinks=5", "kivi:2,g8 window=3 sinks=2",
                                  "k=kivi:2,g8 v=kivi:4,g4,token layers[0]:k=bf16"])
def test_max_context_is_exact_at_every_budget(spec):
    """Budgets that land in the sinks, in the window and among whole blocks."""
    shape = dict(num_layers=2, num_kv_heads=1, head_dim=16, batch=2)
    sizes = [cache_bytes(spec, context=c, **shape) for c in range(5, 60)]
    for budget in [*sorted(set(sizes))[::3], sizes[-1] - 1]:
        n = max_context(spec, budget_bytes=budget, **shape)
        assert cache_bytes(spec, context=n, **shape) <= budget
        assert cache_bytes(spec, context=n + 1, **shape) > budget
    smallest = cache_bytes(spec, context=max(1, parse_cache(spec).sink_tokens), **shape)
    assert max_context(spec, budget_bytes=smallest, **shape) >= 1
    assert max_context(spec, budget_bytes=smallest - 1, **shape) == 0


@pytest.mark.parametrize("spec", ["int:4 page=16", "kivi:2,g32 window=8 sinks=4 page=32"])
def test_pool_pages_is_the_most_that_fits(spec):
    dims = dict(num_layers=2, num_kv_heads=2, head_dim=64)

    def made(pages):
        return memory_bytes(init_cache(jax.random.key(0), parse_cache(spec), batch=3,
                                       max_len=100, num_pages=pages, **dims))

    budget = made(7) + made(8) >> 1  # between 7 and 8 pages
    assert pool_pages(spec, budget=budget, rows=3, context=100, **dims) == 7
    assert pool_pages(spec, budget=made(7), rows=3, context=100, **dims) == 7
    assert pool_pages(spec, budget=made(1) - 1, rows=3, context=100, **dims) == 0
    with pytest.raises(ValueError, match="not paged"):
        pool_pages("int:4", budget=1e9, rows=3, context=100, **dims)
