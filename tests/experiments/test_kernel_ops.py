"""experiments/kernel_ops.py: the table, the top primitives and the JSON rows."""

import json

from experiments import kernel_ops


def test_table_top_and_json(capsys, tmp_path):
    out = tmp_path / "ops.json"
    assert kernel_ops.main(["--codec", "int:4", "--codec", "bf16", "--top", "2",
                            "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| cache | kernel | block | arith | lookup")
    assert lines[2].startswith("| int:4 | int_decode | 128 |") and "| 1.00x |" in lines[2]
    assert lines[3].startswith("| bf16 | dense_decode |") and lines[4].startswith("int:4: ")
    rows = json.loads(out.read_text())["rows"]
    assert [r["cache"] for r in rows] == ["int:4", "bf16"] and rows[1]["ops"]["load"] == 256


def test_a_spec_without_a_kernel_is_one_line(capsys):
    assert kernel_ops.main(["--codec", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kernel_ops: fp8: no fused kernel reads")
