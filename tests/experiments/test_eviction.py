"""experiments/eviction.py: the grid with a fake model, resumable, and bad input."""

from experiments import eviction


def fake_build(calls):
    def build(continuation, retrieval, progress):
        def measure(config, cache_config):
            calls.append(("measure", config))
            share = 1.0 if cache_config.evict is None else cache_config.evict.share
            return [{"ppl": 20.0, "reference_ppl": 20.0, "kl_mean": 0.0, "kl_p99": 0.0,
                     "top1_agreement": 1.0, "bits_per_element": 16.0, "seconds": 0.0,
                     "sequence_bits_per_element": 16.0 * share}]

        def answer(config, cache_config):
            calls.append(("answer", config))
            return [{"task": t, "length": n, "depth": d, "trial": 0, "correct": True,
                     "recall": 1.0, "answer": "1", "expected": ["1"]}
                    for t in retrieval.tasks for n in retrieval.lengths
                    for d in retrieval.depths]

        return measure, answer

    return build


def test_runs_resumes_and_reports(tmp_path, capsys):
    calls = []
    args = ["--budgets", "25%", "--codecs", "int:4", "--policies", "snapkv",
            "--combined", "snapkv+int:8", "--combined-budgets", "50%", "--tasks", "passkey",
            "--retrieval-lengths", "1024", "--out", str(tmp_path), "--no-progress"]
    assert eviction.main(args, build=fake_build(calls)) == 0
    out = capsys.readouterr().out
    configs = ["bf16", "int:4 evict=all", "bf16 evict=snapkv:25%", "int:8 evict=snapkv:50%"]
    assert calls == [("measure", c) for c in configs] + [("answer", c) for c in configs]
    assert "| snapkv | `bf16 evict=snapkv:25%` | 4.00 | 20.000 |" in out
    assert (tmp_path / "tradeoff.png").stat().st_size > 10_000
    assert eviction.main(args, build=fake_build(calls)) == 0
    assert len(calls) == 8  # nothing redone


def test_no_retrieval_lengths_skip_the_suite(tmp_path, capsys):
    calls = []
    args = ["--budgets", "50%", "--codecs", "int:4", "--policies", "h2o", "--combined",
            "--retrieval-lengths", "--out", str(tmp_path), "--no-progress"]
    assert eviction.main(args, build=fake_build(calls)) == 0
    assert {kind for kind, _ in calls} == {"measure"}
    assert "retrieval" in capsys.readouterr().out  # the column, empty


def test_bad_input_exits_2(tmp_path, capsys):
    for args in (["--codecs", "int:99"], ["--combined", "snapkv"],
                 ["--combined", "lru+int:4"], ["--budgets", "0"],
                 ["--retrieval-lengths", "100", "--depths", "2"]):
        assert eviction.main([*args, "--out", str(tmp_path)], build=fake_build([])) == 2
        assert capsys.readouterr().err.startswith("eviction: ")
