"""Tests of experiments/sweep.py: resumption, outputs and bad input, with a fake model
evaluation (the real model runs in ``make demo``, in test_real_model_sweep_smoke and in
test_cli_ppl/test_needle)."""

import csv
import json

import pytest

from experiments import sweep
from kvjax.eval.provenance import KEY
from kvjax.eval.sweep import config_slug
from tests.kvjax.eval.test_sweep import FakeEvaluate, SeedFake


def run(tmp_path, *args, evaluate=None):
    evaluate = evaluate or FakeEvaluate()
    code = sweep.main([*args, "--out", str(tmp_path), "--no-progress"], evaluate=evaluate)
    return code, evaluate


def test_sweep_writes_results_and_resumes(tmp_path, capsys):
    code, first = run(tmp_path, "--codec", "int:4", "--cache", "k=int:2 v=int:8")
    assert code == 0
    assert first.calls == ["bf16", "int:4", "k=int:2 v=int:8"]   # bf16 always, first
    out = capsys.readouterr().out
    run_dir = tmp_path / "smollm2_135m-shakespeare-8x256-seed0"
    assert str(run_dir / "pareto.png") in out
    files = sorted(p.name for p in (run_dir / "configs").iterdir())
    assert len(files) == 3 and all(f.endswith(".json") for f in files)
    stored = json.loads((run_dir / "configs" / f"{config_slug('int:4')}.json").read_text())
    for key in ("config", "family", "model", "corpus", "windows", "window_len", "seed",
                "cache_spec", "ppl", "bits_per_element", "seconds", "wall_seconds"):
        assert key in stored, key
    assert "git" in stored[KEY]
    assert stored["family"] == "int" and stored["k_codec"] == stored["v_codec"] == "int:4"
    assert (run_dir / "pareto.png").stat().st_size > 10_000
    assert str(run_dir / "pareto_zoom.png") in out
    assert (run_dir / "pareto_zoom.png").stat().st_size > 10_000
    with open(run_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["config"] for r in rows] == ["bf16", "int:4", "k=int:2 v=int:8"]
    assert float(rows[0]["delta_pct"]) == 0.0
    table = (run_dir / "summary.md").read_text()
    assert table.splitlines()[2].startswith("| `bf16` | 16.000")

    # a second run measures only the new configuration
    code, second = run(tmp_path, "--codec", "int:4", "--codec", "int:3")
    assert code == 0 and second.calls == ["int:3"]
    # other settings are another run; --force redoes everything
    _, third = run(tmp_path, "--codec", "int:4", "--cache-options", "window=16")
    assert third.calls == ["bf16", "int:4"]
    _, forced = run(tmp_path, "--codec", "int:4", "--force")
    assert forced.calls == ["bf16", "int:4"]


def test_cache_options_reach_the_cache_config_and_name_the_run(tmp_path):
    seen = {}

    def evaluate(config, cache_config, with_needle):
        seen[config] = cache_config
        return FakeEvaluate()(config, cache_config, with_needle)

    code, _ = run(tmp_path, "--codec", "int:4", "--cache-options", "layers[0,-1]:k=bf16",
                  evaluate=evaluate)
    assert code == 0
    assert seen["int:4"].spec == "int:4 layers[0,-1]:k=bf16"
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.startswith("smollm2_135m-shakespeare-8x256-layers_0_1_k_bf16-")
    stored = json.loads((run_dir / "configs" / f"{config_slug('int:4')}.json").read_text())
    assert stored["cache_options"] == "layers[0,-1]:k=bf16"
    assert stored["cache_spec"] == "int:4 layers[0,-1]:k=bf16"
    # the stored options count as the same setting: a second run skips both configurations
    _, again = run(tmp_path, "--codec", "int:4", "--cache-options", "layers[0,-1]:k=bf16")
    assert again.calls == []


def test_needle_results_join_the_sweep(tmp_path, capsys):
    run(tmp_path, "--codec", "int:2")
    # results without needle answers are redone when the needle is asked for
    _, second = run(tmp_path, "--codec", "int:2", "--needle")
    assert second.calls == ["bf16", "int:2"]
    out = capsys.readouterr().out
    assert "| `int:2` | 2.500 (2.50, 2.50) |" in out and "needle retrieval" in out
    run_dir = tmp_path / "smollm2_135m-shakespeare-8x256-seed0"
    assert "| bf16 | 64 | 1.00 | 1.00 | 1.00 |" in (run_dir / "needle.md").read_text()
    _, third = run(tmp_path, "--codec", "int:2", "--needle")
    assert third.calls == []


@pytest.mark.parametrize("args,message", [
    (["--codec", "int:1"], "2..8"),
    (["--codec", "nope:3"], "nope"),
    (["--codec", "int:4/int:2"], "2..8"),
    (["--codec", "k=int:4 v=nope:2"], "nope"),
    (["--codec", "int:4 window=8", "--cache-options", "window=32"], "given twice"),
    (["--cache-options", "int:4"], "cache options"),
    (["--windows", "0"], "--windows"),
    (["--devices", "99"], "a sweep over 99 devices needs 1..8"),
])
def test_bad_input_exits_2_before_any_evaluation(tmp_path, capsys, args, message):
    code, evaluate = run(tmp_path, *args)
    assert code == 2 and evaluate.calls == []
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_real_model_sweep_smoke(tmp_path, capsys):
    """The default evaluator: the embedded model on Shakespeare, tiny windows, the two
    configurations measured at once on two of the suite's virtual devices (each with its
    copy of the model)."""
    args = ["--codec", "int:4", "--windows", "1", "--window-len", "32",
            "--out", str(tmp_path), "--no-progress", "--devices", "2"]
    assert sweep.main(args) == 0
    run_dir = tmp_path / "smollm2_135m-shakespeare-1x32-seed0"
    rows = {json.loads(p.read_text())["config"]: json.loads(p.read_text())
            for p in (run_dir / "configs").iterdir()}
    assert set(rows) == {"bf16", "int:4"}
    assert rows["bf16"]["bits_per_element"] == 16.0
    assert rows["int:4"]["bits_per_element"] == 4.5     # head dim 64: 4 + 32/64
    assert 1 < rows["bf16"]["ppl"] < rows["int:4"]["ppl"] * 1.5
    assert rows["int:4"]["tokens"] == 31


def test_seeds_parse_and_exclude_seed(capsys):
    parser = sweep.build_parser()
    assert parser.parse_args(["--seeds", "0", "1", "2"]).seeds == [0, 1, 2]
    assert parser.parse_args(["--seed", "3"]).seeds is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--seed", "1", "--seeds", "0", "1"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_seeds_run_each_seed_and_report_over_them(tmp_path, capsys):
    fake = SeedFake()
    code = sweep.main(["--codec", "int:4", "--codec", "turboquant:b3", "--seeds", "2", "0",
                       "1", "--out", str(tmp_path), "--no-progress"], build=fake)
    assert code == 0
    assert fake.calls == [(0, "bf16"), (0, "int:4"), (0, "turboquant:b3"),
                          (1, "turboquant:b3"), (2, "turboquant:b3")]
    out = capsys.readouterr().out
    seeds_dir = tmp_path / "smollm2_135m-shakespeare-8x256-seeds0-2"
    for name in ("summary.csv", "summary.md", "pareto.png", "pareto_zoom.png"):
        assert str(seeds_dir / name) in out and (seeds_dir / name).is_file()
    assert "| `int:4` † | 4.500 |" in out and "min .. max" in out
    for seed in (0, 1, 2):
        assert (tmp_path / f"smollm2_135m-shakespeare-8x256-seed{seed}" / "configs").is_dir()
    # resumable: a second run measures nothing
    again = SeedFake()
    assert sweep.main(["--codec", "int:4", "--codec", "turboquant:b3", "--seeds", "0", "1",
                       "2", "--out", str(tmp_path), "--no-progress"], build=again) == 0
    assert again.calls == [] and again.built == []


def test_one_seed_in_seeds_is_seed(tmp_path):
    code, fake = run(tmp_path, "--codec", "int:4", "--seeds", "3")
    assert code == 0 and fake.calls == ["bf16", "int:4"]
    run_dir = tmp_path / "smollm2_135m-shakespeare-8x256-seed3"
    assert (run_dir / "summary.csv").is_file() and (run_dir / "pareto.png").is_file()
    _, again = run(tmp_path, "--codec", "int:4", "--seed", "3")
    assert again.calls == []


def test_negative_seeds_exit_2(tmp_path, capsys):
    code, fake = run(tmp_path, "--seeds", "-1", "0")
    assert code == 2 and fake.calls == []
    assert "--seeds must be >= 0" in capsys.readouterr().err


def test_the_default_evaluator_loads_the_model_once_for_every_seed(tmp_path, monkeypatch):
    """models.evaluate.sweep_builder shares one loaded model between the seeds' evaluators
    (the loading and the perplexity are faked: the seeds' codec keys still differ)."""
    from kvjax.eval.ppl import PerplexityResult
    from models import evaluate

    loads, keys, references = [], [], []

    def load(model, corpus, num_windows, window_len):
        loads.append((model, corpus, num_windows, window_len))
        return None, None, None, "", None

    def perplexity(params, config, cache_config, windows, *, chunk, seed, progress,
                   calibration=None, reference=None):
        keys.append((seed, cache_config.spec))
        references.append(None if reference is None else reference.spec)
        return PerplexityResult(ppl=20.0 + seed, nll=3.0, tokens=10, bits_per_element=4.5,
                                k_bits_per_element=4.5, v_bits_per_element=4.5,
                                seconds=0.0, fallback_blocks=0)

    monkeypatch.setattr(evaluate, "load_model_and_windows", load)
    monkeypatch.setattr(evaluate, "cache_perplexity", perplexity)
    assert sweep.main(["--codec", "turboquant:b3", "--seeds", "0", "1", "2", "--out",
                       str(tmp_path), "--no-progress"]) == 0
    assert loads == [("smollm2-135m", "shakespeare", 8, 256)]
    assert keys == [(0, "bf16"), (0, "turboquant:b3"), (1, "turboquant:b3"),
                    (2, "turboquant:b3")]
    # every configuration but the bf16 cache is compared with it
    assert references == [None, "bf16", "bf16", "bf16"]
    # without the comparison: another setting, so measured again, and alone
    assert sweep.main(["--codec", "turboquant:b3", "--out", str(tmp_path), "--no-progress",
                       "--no-distribution"]) == 0
    assert keys[4:] == [(0, "bf16"), (0, "turboquant:b3")] and references[4:] == [None, None]
