"""experiments/prefill_peak.py: its arguments and a smoke run on a tiny model."""

import re

from experiments import prefill_peak
from kvjax.eval.memory import MODEL_SHAPES
from tests.experiments.test_bench_e2e import TINY


def test_smoke_run_prints_the_analysis(capsys, monkeypatch):
    monkeypatch.setitem(MODEL_SHAPES, "tiny", TINY)
    args = ["--shape", "tiny", "--cache", "int:4", "--layers", "1", "--batch", "2",
            "--context", "48", "--chunk", "16", "--hlo"]
    assert prefill_peak.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("cache int:4: ") and out[0].endswith("for 2 rows of 64 tokens")
    assert re.fullmatch(r"analysis: arguments [\d.]+ GiB, outputs [\d.]+ GiB \([\d.]+ GiB in "
                        r"place\), temporaries [\d.]+ GiB", out[1])
    # every cache array taken over: a donation refused would be a copy of it
    assert re.fullmatch(r"donated: (\d+) of the cache's \1 arrays taken over by the "
                        r"program", out[2])
    assert out[3] == "run time: this device keeps no memory statistics"  # a CPU
    assert out[4].startswith("copies holding the cache's 64-token axis: ")


def test_bad_arguments_are_one_line(capsys):
    assert prefill_peak.main(["--cache", "int:99"]) == 2
    assert prefill_peak.main(["--chunk", "64", "--context", "32"]) == 2
    assert capsys.readouterr().err.count("prefill_peak: error:") == 2
