"""experiments/outliers.py: the synthetic parts for two codecs, the model part with a fake
evaluation (seeded codecs per seed, the others once, every transform at seed 0)."""

import json

from experiments import outliers
from kvjax.eval.provenance import KEY
from tests.kvjax.eval.test_sweep import FakeEvaluate


def test_testbed_swing_and_model_parts(tmp_path, capsys):
    fakes = []

    def build(settings):
        fakes.append(FakeEvaluate())
        return fakes[-1]

    docs = tmp_path / "docs"
    code = outliers.main(["--part", "testbed", "--part", "swing", "--part", "model",
                          "--codec", "int:4", "--codec", "turboquant:b4",
                          "--seeds", "0", "1", "--testbed-tokens", "64",
                          "--out", str(tmp_path / "out"), "--docs", str(docs),
                          "--no-progress"], build=build)
    assert code == 0
    calls = [c for fake in fakes for c in fake.calls]
    # seeded: per seed without and with centering; the rest once
    assert calls.count("turboquant:b4 center=first") == 2
    assert calls.count("int:4 center=first") == 1
    assert calls.count("turboquant:b4 center=calib") == 1
    summary = json.loads((docs / "outliers.json").read_text())
    assert len(summary["model"]["ppl"]["turboquant:b4"]) == 2
    assert len(summary["model"]["ppl"]["int:4"]) == 1
    assert set(summary["swing"]) == {"turboquant:b4", "turboquant:b4 center=first"}
    testbed = summary["testbed"]["rows"]
    assert len(testbed["turboquant:b4"]) == 2 and len(testbed["int:4"]) == 1
    assert testbed["int:4 center=first"][0]["output_rel_error"] < \
        testbed["int:4"][0]["output_rel_error"]
    assert KEY in summary
    for name in ("pareto_before.png", "pareto_after.png", "outliers_tables.md"):
        assert (docs / name).stat().st_size > 0
    out = capsys.readouterr().out
    assert "| `turboquant:b4` |" in out and "center=first smooth=first" in out
