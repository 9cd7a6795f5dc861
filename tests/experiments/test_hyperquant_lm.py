"""experiments/hyperquant_lm.py with a fake model evaluation: the configurations and cache
settings of each part, the tables and files, and resuming from stored results."""

import json

from experiments import hyperquant_lm as hl
from kvjax.eval.provenance import KEY
from tests.experiments.test_octopus_lm import FakeEvaluate


def test_parts_windows_and_files(tmp_path, capsys):
    fake = FakeEvaluate()
    docs = tmp_path / "docs"
    argv = ["--out", str(tmp_path / "out"), "--docs", str(docs), "--no-progress"]
    assert hl.main(argv, evaluate=fake) == 0
    configs = {c for c, _ in fake.seen}
    assert set(hl.rate_configs()) | set(hl.bias_configs()) | set(hl.CONTEXT) <= configs
    assert "hyperquant:e8,1.7bps" in configs and "hyperquant:e8,2bps,haar,dither" in configs
    # symmetric K = V, no raw layers, both residual windows
    e8 = [cc for c, cc in fake.seen if c == "hyperquant:e8,3bps"]
    assert {cc.residual_window for cc in e8} == {0, 32}
    assert all(cc.k == cc.v and cc.layers == () for cc in e8)
    summary = json.loads((docs / "lm.json").read_text())
    assert set(summary["parts"]) == {"window0", "window32"} and KEY in summary
    assert {r["cache_spec"] for r in summary["parts"]["window32"]
            if r["config"] == "int:4"} == {"int:4 window=32"}
    assert {r["config"] for r in summary["seeds"]["rows"]} == set(hl.seed_configs())
    text = (docs / "lm_tables.md").read_text()
    for heading in ("## Residual window 0", "## Rotation and dither at 2 bps",
                    "## With and without the residual window", "## Seeds"):
        assert heading in text
    for name in ("lm_w0.csv", "lm_w32.csv", "lm_pareto_w0.png", "lm_pareto_w32_zoom.png"):
        assert (docs / name).stat().st_size > 100
    again = FakeEvaluate()
    assert hl.main(argv, evaluate=again) == 0
    assert again.seen == []
    assert "written:" in capsys.readouterr().out


def test_cache_options_keep_first_and_last_k_raw(tmp_path):
    fake = FakeEvaluate()
    assert hl.main(["--out", str(tmp_path), "--docs", str(tmp_path / "d"), "--no-progress",
                    "--part", "bias", "--residual", "32",
                    "--cache-options", "layers[0,-1]:k=bf16"], evaluate=fake) == 0
    assert {tuple(r.spec for r in cc.layers) for _, cc in fake.seen} == {("layers[0,-1]:k=bf16",)}
    assert {c for c, _ in fake.seen} == {"bf16", *hl.bias_configs()}
