"""experiments/bench_compile.py: its arguments and a smoke run on a tiny model."""

import json

from experiments import bench_compile
from kvjax.eval.memory import MODEL_SHAPES
from tests.experiments.test_bench_e2e import TINY


def test_smoke_run_prints_the_table(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(MODEL_SHAPES, "tiny", TINY)
    args = ["--shape", "tiny", "--cache", "int:4", "--layers", "1", "--batch", "1",
            "--context", "32", "--chunk", "16", "--new-tokens", "2",
            "--json", str(tmp_path / "rows.json")]
    assert bench_compile.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    # the suite runs with the compilation cache off: every program compiled
    assert out[0] == "compilation cache: off"
    assert out[1] == "| cache | layers | lower s | prefill compile s | decode compile s |"
    assert out[3].startswith("| int:4 | 1 | ")
    row = json.loads((tmp_path / "rows.json").read_text())["rows"][0]
    assert all(row[k] > 0 for k in ("lower_s", "prefill_compile_s", "decode_compile_s"))


def test_bad_arguments_are_one_line():
    assert bench_compile.main(["--cache", "int:99"]) == 2
    assert bench_compile.main(["--layers", "0"]) == 2
