"""experiments/bench_e2e.py: capacity arithmetic from the cache's bytes, and a smoke run."""

import json
import math

import jax
import numpy as np
import pytest

from experiments import bench_e2e
from kvjax.eval.memory import MODEL_SHAPES, ModelShape, model_shape
from kvjax.spec import parse_cache
from models.config import ModelConfig

#: a shape small enough for CPU runs of the whole pipeline
TINY = ModelShape(name="tiny", num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
                  num_params=2_229_504, family="llama", vocab_size=256, hidden_size=256,
                  intermediate_size=512, rope_theta=10000.0)


def _one_layer_tiny(max_len=4096):
    return ModelConfig.from_shape(TINY, max_len=max_len, num_layers=1)


@pytest.mark.parametrize("shape", [*MODEL_SHAPES.values(), TINY], ids=lambda s: s.name)
def test_model_configs_have_the_shapes_parameter_counts(shape):
    """The table's architecture fields give its published parameter count exactly."""
    from models.llama import param_shapes

    config = ModelConfig.from_shape(shape, max_len=1024)
    leaves = jax.tree.leaves(param_shapes(config), is_leaf=lambda s: isinstance(s, tuple))
    assert sum(math.prod(s) for s in leaves) == shape.num_params
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim)


def test_capacity_from_measured_bytes():
    config = ModelConfig.from_shape(model_shape("llama-3-8b"), max_len=1000)
    context = 1000
    bf16_row = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2 * context
    # the fixed part of a bf16 cache is a few flags and counters, far below one row
    free = 10 * bf16_row + bf16_row // 2
    assert bench_e2e.capacity(config, parse_cache("bf16"), context, free) == 10
    int4 = bench_e2e.capacity(config, parse_cache("int:4"), context, free)
    saw = bench_e2e.capacity(config, parse_cache("saw"), context, free)
    # int:4 at D = 128 stores 4.25 bits per element instead of 16
    assert int4 == saw and 38 <= int4 <= 39
    # over 2 rows of devices, 4 heads each: 10 rows per device's quarter of a row each
    assert bench_e2e.capacity(config, parse_cache("bf16"), context, free / 4,
                              "data=2,model=4") == 20


def test_smoke_run_over_a_mesh(capsys, monkeypatch):
    """TINY's 2 kv heads over 2 devices, 2 rows over 2: the weights and the cache each
    device reads set the floor."""
    monkeypatch.setitem(MODEL_SHAPES, "tiny", TINY)
    args = ["--shape", "tiny", "--context", "40", "--batch", "2", "--new-tokens", "2",
            "--prefill-chunk", "16", "--codec", "int:4", "--device-gb", "1", "--layers",
            "1", "--mesh", "data=2,model=2"]
    assert bench_e2e.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("| int:4 | 2 | 40 |") and " | data=2,model=2 | " in out[2]
    assert bench_e2e.main([*args[:-1], "model=4"]) == 2
    assert "2 kv heads do not split over model=4" in capsys.readouterr().err


def test_smoke_run_prints_the_table(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(MODEL_SHAPES, "tiny", TINY)
    args = ["--shape", "tiny", "--context", "40", "--batch", "1", "--new-tokens", "2",
            "--prefill-chunk", "16", "--codec", "int:4", "--codec", "bf16",
            "--device-gb", "1", "--layers", "1", "--json", str(tmp_path / "rows.json")]
    assert bench_e2e.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| codec | batch | context | decode tok/s | ms/step | of floor")
    assert out[2].startswith("| int:4 | 1 | 40 |") and out[3].startswith("| bf16 | 1 | 40 |")
    assert " | decode | " in out[2]
    record = json.loads((tmp_path / "rows.json").read_text())
    rows = record["rows"]
    assert [r["codec"] for r in rows] == ["int:4", "bf16"]
    assert record["provenance"]["device"]["device_kind"] == rows[0]["device"]
    # each row names the code it ran, which any commit's tree can be checked against
    assert rows[0]["code"] == record["provenance"]["code"]
    assert f"({rows[0]['code'][:8]}) |" in out[2]
    assert all(0 < r["decode_tok_per_s"] < r["floor_tok_per_s"] for r in rows)
    assert all(r["weights"] == "decode" for r in rows)
    # without --check-programs no share of the bytes' rows is known
    # (the default reserve leaves no room on a 1 GB device; the bytes alone do)
    assert all(r["max_batch"] is None and r["max_batch_bytes"] > 0 for r in rows)
    assert out[0].count("of the bytes' rows") == 1 and " | - | - | decode | " in out[2]


def test_share_of_the_rows_the_bytes_allow():
    assert bench_e2e.of_bytes(35, 38) == "0.92"
    assert bench_e2e.of_bytes(None, 38) == "-" and bench_e2e.of_bytes(3, 0) == "-"


def test_points_make_one_table_over_batches_and_contexts(capsys, monkeypatch):
    monkeypatch.setitem(MODEL_SHAPES, "tiny", TINY)
    args = ["--shape", "tiny", "--point", "2:24", "--point", "1:40", "--new-tokens", "2",
            "--prefill-chunk", "16", "--codec", "bf16", "--codec", "int:4",
            "--device-gb", "1", "--layers", "1"]
    assert bench_e2e.main(args) == 0
    rows = [line.split(" | ")[:3] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [["| bf16", "2", "24"], ["| bf16", "1", "40"], ["| int:4", "2", "24"],
                    ["| int:4", "1", "40"]]
    assert bench_e2e.main(["--point", "8"]) == 2
    assert bench_e2e.main(["--point", "1:8", "--point", "1:16", "--at-capacity"]) == 2


def test_the_table_says_when_the_tree_differed_from_its_commit():
    sha = "a76f4b35ee9dd69c67908c19a8d04e5def4dd0ff"
    assert bench_e2e.short_sha(sha + "+dirty") == "a76f4b35ee9d+dirty"
    assert bench_e2e.short_sha(sha) == "a76f4b35ee9d" and bench_e2e.short_sha(None) == "-"


def test_floor_reads_weights_and_cache_once_per_step():
    # the floors of Llama-3-8B at B = 8, S = 32k on the H200: 1350 (int:4) and 673 (bf16)
    weights = 16_060_522_496
    assert bench_e2e.floor_tok_per_s(weights, 9_139_000_000, 8, 4240.0) == pytest.approx(
        1346, rel=1e-3)
    assert bench_e2e.floor_tok_per_s(weights, 34_360_000_000, 8, 4240.0) == pytest.approx(
        672.7, rel=1e-3)


def test_probe_layers_smoke(capsys):
    from experiments import probe_layers

    args = ["--codec", "int:4", "--layers", "1", "--batch", "1", "--context", "32",
            "--heads", "2", "--kv-heads", "1", "--head-dim", "32", "--repeats", "1",
            "--hlo", "0.0001"]
    assert probe_layers.main(args) == 0
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("| int:4")]
    assert [r.split("|")[3].strip() for r in rows] == ["scan", "unrolled"]
    assert "MiB" in captured.err   # the large values of the optimized HLO


def test_capacity_with_programs_charges_the_temporaries(monkeypatch):
    """The batch search: cache + the larger compiled program's temporaries must fit."""
    config = _one_layer_tiny()
    cache_config = parse_cache("int:4")
    per_row, fixed = bench_e2e.row_bytes(config, cache_config, 42)
    calls = []

    def fake_temps(params, config, cache_config, *, batch, **kw):
        calls.append(batch)
        return 3 * per_row * batch + 1000, per_row * batch   # prefill's are the larger

    monkeypatch.setattr(bench_e2e, "program_temps", fake_temps)
    free = fixed + 100 * per_row + 10
    batch, prefill, decode = bench_e2e.capacity_with_programs(
        None, config, cache_config, context=40, chunk=16, new_tokens=2, free_total=free)
    # each row costs its cache and 3 rows' worth of temporaries: 24 fit, 25 do not
    assert calls[0] == 100 and batch == calls[-1] == 24
    assert fixed + batch * per_row + prefill <= free < fixed + 25 * 4 * per_row + 1000
    assert decode == per_row * batch


def test_program_temps_compile_from_shapes():
    import jax.numpy as jnp

    from models.llama import init_params

    config = _one_layer_tiny()
    params = init_params(jax.random.key(0), config, jnp.bfloat16)
    prefill, decode = bench_e2e.program_temps(params, config, parse_cache("int:4"),
                                              batch=2, context=40, chunk=16, new_tokens=2)
    assert prefill > 0 and decode > 0


def test_the_checked_programs_are_the_ones_that_run(monkeypatch):
    """A run at the checked batch compiles nothing more: the temporaries measured are
    those of the programs it executes, compiled before its cache existed."""
    import jax.numpy as jnp

    from models import generate as gen
    from models.llama import init_params

    monkeypatch.setattr(gen, "_COMPILED", {})
    config, cache_config = _one_layer_tiny(), parse_cache("int:4")
    params = init_params(jax.random.key(0), config, jnp.bfloat16)
    bench_e2e.program_temps(params, config, cache_config, batch=2, context=40, chunk=16,
                            new_tokens=2)
    checked = dict(gen._COMPILED)
    assert sorted(key[0] for key in checked) == ["decode", "prefill"]
    rng = np.random.default_rng(0)
    gen.generate(params, config, rng.integers(0, config.vocab_size, (2, 40)).tolist(),
                 cache_config=cache_config, max_new_tokens=2, eos_token_ids=(), max_len=42,
                 prefill_chunk=16)
    assert gen._COMPILED == checked


def test_capacity_only_runs_each_cache_at_its_checked_batch(capsys, monkeypatch):
    """--capacity-only skips the points: one run per cache, at the batch the programs'
    check found, and a line comparing it with bf16's at bf16's own largest batch. (The
    temporaries are stubbed to none: their search is tested above; here the cache's bytes
    alone set the rows.)"""
    monkeypatch.setitem(MODEL_SHAPES, "tiny", TINY)
    monkeypatch.setattr(bench_e2e, "program_temps", lambda *a, **kw: (0, 0))
    args = ["--shape", "tiny", "--context", "40", "--new-tokens", "2", "--codec", "bf16",
            "--codec", "int:4", "--device-gb", "0.003", "--reserve-gb", "0", "--layers",
            "1", "--at-capacity", "--check-programs", "--capacity-chunk", "16"]
    assert bench_e2e.main([*args, "--capacity-only"]) == 0
    out = capsys.readouterr().out.splitlines()
    table = [line for line in out if line.startswith(("| bf16", "| int:4"))]
    batches = [int(line.split(" | ")[1]) for line in table]
    checked = [int(line.split(" | ")[11]) for line in table]
    assert len(table) == 2 and batches == checked and batches[1] > 3 * batches[0] > 0
    summary = [line for line in out if line.startswith("at capacity: ")]
    assert summary[0].startswith(f"at capacity: bf16: {batches[0]} rows x 40 tokens, 1.00x")
    assert f"{batches[1] / batches[0]:.2f}x bf16's rows" in summary[1]
    assert bench_e2e.main([*args[:-4], "--capacity-only"]) == 2
    assert "--capacity-only goes with --at-capacity" in capsys.readouterr().err
