"""experiments/calibration.py: both directions with a fake model, resumable, bad input."""

import numpy as np

from experiments import calibration
from kvjax.allocation import Sensitivity


def fake_build(calls):
    def sensitivity(candidates, windows):
        calls.append(("sensitivity", windows))
        loss = np.zeros((3, 2, len(candidates)))
        loss[:, 0, 0] = [1.0, 0.1, 0.2]  # keys of layer 0 are the sensitive ones
        loss[:, 1, 0] = 0.05
        return Sensitivity(candidates=tuple(candidates),
                           bits={"k": (2.5, 4.5, 8.5), "v": (2.5, 4.5, 8.5)}, loss=loss)

    def build(settings, fits_dir, progress):
        def measure(name, cache_config):
            calls.append((settings.fit_corpus, name))
            fitted = cache_config.needs_fit
            return [{"fit_corpus": settings.fit_corpus, "eval_corpus": settings.eval_corpus,
                     "family": calibration.calibrated.family(name), "config": name,
                     "fitted": fitted, "bits_per_element": 2.5 + 0.125 * fitted,
                     "ppl": 30.0 - 5 * fitted, "reference_ppl": 20.0, "kl_mean": 0.5,
                     "kl_p99": 2.0, "top1_agreement": 0.5, "fit_seconds": 1.0 * fitted,
                     "fit_bytes": 100 * fitted}]

        return measure, sensitivity

    return build


def test_runs_both_directions_resumes_and_reports(tmp_path, capsys):
    calls = []
    args = ["--bits", "2", "--centroids", "16", "--budgets", "2.834", "--hqmq",
            "--out", str(tmp_path), "--no-progress"]
    assert calibration.main(args, build=fake_build(calls)) == 0
    out = capsys.readouterr().out
    configs = ["bf16", "int:2", "saw:b2,kv", "saw:b2,kv,c16", "saw:b2,kv,hess",
               "saw:b2,kv,c256,hess", "k=int:2 v=int:2 layers[0]:k=int:4"]
    assert calls == [("sensitivity", 2), *(("shakespeare", c) for c in configs),
                     ("sensitivity", 2), *(("austen", c) for c in configs)]
    assert ("| shakespeare -> austen | `saw:b2,kv,c16` | yes | 2.625 | 25.000 | -5.000 |"
            in out)
    assert (tmp_path / "calibration.png").stat().st_size > 10_000
    assert (tmp_path / "calibration.csv").read_text().count("\n") == 15
    assert calibration.main(args, build=fake_build(calls)) == 0
    assert len(calls) == 16  # nothing redone, not even the sensitivities


def test_bad_input_exits_2(tmp_path, capsys):
    for args in (["--bits", "9"], ["--centroids", "3"], ["--windows", "0"]):
        assert calibration.main([*args, "--out", str(tmp_path)], build=fake_build([])) == 2
        assert capsys.readouterr().err.startswith("calibration: ")
