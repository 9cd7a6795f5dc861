"""experiments/retrieval.py: the suite over cache configurations, resumable, with a fake
model, bad input, and one short real run with the embedded model."""

import json

from experiments import retrieval


def fake_build(calls):
    def build(settings, batch, progress):
        def answer(config, cache_config):
            calls.append(config)
            return [{"task": task, "length": n, "prompt_tokens": n - 12, "depth": d,
                     "trial": 0, "expected": ["1"], "answer": " 1",
                     "recall": 1.0, "correct": config == "bf16" or n < 4096}
                    for task in settings.tasks for n in settings.lengths
                    for d in settings.depths]
        return answer
    return build


def test_runs_resumes_and_reports(tmp_path, capsys):
    calls = []
    args = ["--codec", "int:4", "--tasks", "passkey", "single", "--out", str(tmp_path),
            "--json", str(tmp_path / "rows.json"), "--no-progress"]
    assert retrieval.main(args, build=fake_build(calls)) == 0
    out = capsys.readouterr().out
    assert calls == ["bf16", "int:4"]
    assert "| int:4 | passkey | 1.00 | 0.00 | 0.00 |" in out
    assert "| int:4 | **mean** | 1.00 | 0.00 | 0.00 |" in out
    assert "| bf16 | **mean** | 1.00 | 1.00 | 1.00 |" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert len(rows) == 2 * 2 * 3 * 3 and {r["codec"] for r in rows} == {"bf16", "int:4"}
    [run_dir] = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (run_dir / "accuracy.png").stat().st_size > 10_000
    assert retrieval.main(args, build=fake_build(calls)) == 0
    assert calls == ["bf16", "int:4"]  # nothing redone


def test_bad_input_exits_2(tmp_path, capsys):
    for args, needle in ((["--codec", "int:1"], "2..8"), (["--depths", "1.5"], "depth"),
                         (["--lengths", "9000"], "context"), (["--trials", "0"], "trials")):
        assert retrieval.main([*args, "--out", str(tmp_path)]) == 2
        assert needle in capsys.readouterr().err


def test_a_short_real_run(tmp_path, capsys):
    """The embedded model at 384 tokens with the bf16 cache alone (the codecs' path is
    the generate loop every cache test runs): the pipeline from cases to scores works,
    and it reads the pass key back."""
    args = ["--tasks", "passkey", "--lengths", "384",
            "--depths", "0.5", "--out", str(tmp_path), "--json", str(tmp_path / "r.json"),
            "--no-progress"]
    assert retrieval.main(args) == 0
    rows = json.loads((tmp_path / "r.json").read_text())
    assert len(rows) == 1
    assert all(300 < r["prompt_tokens"] <= 384 - 48 for r in rows)
    bf16 = {r["task"]: r for r in rows if r["codec"] == "bf16"}
    assert bf16["passkey"]["correct"], bf16["passkey"]["answer"]
