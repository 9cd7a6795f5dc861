"""experiments/calibration.py: both directions with a fake model, resumable, bad input."""

from experiments import calibration


def fake_build(calls):
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

        return measure

    return build


def test_runs_both_directions_resumes_and_reports(tmp_path, capsys):
    calls = []
    args = ["--bits", "2", "--centroids", "16", "--out", str(tmp_path), "--no-progress"]
    assert calibration.main(args, build=fake_build(calls)) == 0
    out = capsys.readouterr().out
    configs = ["bf16", "int:2", "saw:b2,kv", "saw:b2,kv,c16", "saw:b2,kv,hess",
               "saw:b2,kv,c256,hess"]
    assert calls == [("shakespeare", c) for c in configs] + [("austen", c) for c in configs]
    assert ("| shakespeare -> austen | `saw:b2,kv,c16` | yes | 2.625 | 25.000 | -5.000 |"
            in out)
    assert (tmp_path / "calibration.png").stat().st_size > 10_000
    assert (tmp_path / "calibration.csv").read_text().count("\n") == 13
    assert calibration.main(args, build=fake_build(calls)) == 0
    assert len(calls) == 12  # nothing redone


def test_bad_input_exits_2(tmp_path, capsys):
    for args in (["--bits", "9"], ["--centroids", "3"], ["--windows", "0"]):
        assert calibration.main([*args, "--out", str(tmp_path)], build=fake_build([])) == 2
        assert capsys.readouterr().err.startswith("calibration: ")
