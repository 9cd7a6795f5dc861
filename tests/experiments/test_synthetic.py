"""experiments/synthetic.py at tiny sizes: the table and the JSON with its provenance."""

import json

from experiments import synthetic
from kvjax.eval.provenance import KEY


def test_table_and_json(tmp_path, capsys):
    args = ["--codec", "int:4", "--seeds", "1", "--needle-seeds", "1", "--head-dim", "32",
            "--out", str(tmp_path)]
    assert synthetic.main(args) == 0
    out = capsys.readouterr().out
    assert "| int:4 | 5.000 |" in out   # 4 + 32/32 bits at D = 32
    stored = json.loads((tmp_path / "synthetic.json").read_text())
    assert [r["codec"] for r in stored["rows"]] == ["int:4"]
    assert stored["settings"] == {"seeds": 1, "needle_seeds": 1, "head_dim": 32, "seed": 0,
                                  "seconds": stored["settings"]["seconds"]}
    assert set(stored[KEY]) == {"git", "code", "versions", "device", "command", "time"}
