"""experiments/hqmq_sweep.py with a fake model evaluation: the configurations it runs,
its tables, dominance table and seed statistics."""

import json

from experiments import hqmq_sweep
from kvjax.eval.provenance import KEY
from tests.kvjax.eval.test_sweep import FakeEvaluate


def test_sweep_seeds_and_multiplier_parts(tmp_path, capsys):
    fake = FakeEvaluate()
    docs = tmp_path / "docs"
    code = hqmq_sweep.main(["--part", "sweep", "--part", "seeds", "--part", "multiplier",
                            "--out", str(tmp_path / "out"), "--docs", str(docs),
                            "--no-progress"], evaluate=fake)
    assert code == 0
    grid = hqmq_sweep.sweep_configs()
    assert len(grid) == 4 * 3 * 2 + 7 * 2 and "hqmq:s192,r6,med3" in grid
    assert "int:2,med3" in grid and set(grid) <= set(fake.calls)
    # each seed is its own run; the multiplier part reuses nothing but bf16's settings
    assert fake.calls.count("hqmq:s96,r4") == len(hqmq_sweep.SEEDS)
    assert "hqmq:s96,r6,med5" in fake.calls
    for name in ("sweep.md", "sweep.csv", "pareto.png", "pareto_zoom.png", "seeds.md",
                 "multiplier.md", "hqmq.json"):
        assert (docs / name).stat().st_size > 0
    summary = json.loads((docs / "hqmq.json").read_text())
    assert len(summary["seeds"]["hqmq:s24,r3"]) == 5 and KEY in summary
    out = capsys.readouterr().out
    # the fake's ppl falls with bits, so nothing with fewer bits beats anything
    assert "| `int` | `hqmq` | 0 | 7 | - |" in out
    assert "| `hqmq:s96,r4` | 5 |" in out and "0.00% |" in out


def test_dominance():
    rows = [
        {"config": "int:4", "family": "int", "bits_per_element": 4.25, "ppl": 12.0},
        {"config": "int:3", "family": "int", "bits_per_element": 3.25, "ppl": 20.0},
        {"config": "hqmq:s96,r4", "family": "hqmq", "bits_per_element": 4.0, "ppl": 11.0},
    ]
    assert hqmq_sweep.dominated_by(rows, "int", "hqmq") == {"int:4": ["hqmq:s96,r4"],
                                                             "int:3": []}
    assert hqmq_sweep.dominated_by(rows, "hqmq", "int") == {"hqmq:s96,r4": []}


def test_dominance_table():
    rows = [
        {"config": "int:4", "family": "int", "bits_per_element": 4.25, "ppl": 12.0},
        {"config": "int:3", "family": "int", "bits_per_element": 3.25, "ppl": 20.0},
        {"config": "hqmq:s96,r4", "family": "hqmq", "bits_per_element": 4.0, "ppl": 11.0},
    ]
    assert hqmq_sweep.dominance_table(rows).splitlines()[2:] == [
        "| `int` | `hqmq` | 1 | 2 | `int:4` |", "| `hqmq` | `int` | 0 | 1 | - |",
        "| `int` | `hqmq+med` | 0 | 2 | - |"]   # pairs without points of the family are left out
