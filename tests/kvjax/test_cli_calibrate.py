"""``python -m kvjax calibrate`` and the ``--calibration`` option of the model commands."""

import json

import numpy as np
import pytest

from kvjax.centering import KeyCalibration
from kvjax.cli import main


def test_calibrate_writes_what_ppl_reads(tmp_path, capsys):
    out = tmp_path / "keys.npz"
    assert main(["calibrate", "--out", str(out), "--windows", "1", "--window-len", "64",
                 "--offset", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    calib = KeyCalibration.load(out)
    assert calib.tokens == row["tokens"] == 64 and calib.shape == (30, 3, 64)
    assert row["center_over_spread_max"] > 1  # SmolLM2's keys do sit off zero
    assert np.all(calib.scale(centered=True) > 0)

    args = ["ppl", "--cache", "int:4 center=calib smooth=calib", "--windows", "1",
            "--window-len", "64", "--json"]
    assert main([*args, "--calibration", str(out)]) == 0
    with_file = json.loads(capsys.readouterr().out)
    assert with_file["cache"] == "int:4 center=calib smooth=calib"
    assert with_file["bf16_cache"] == "bf16"  # the baseline drops the transform
    # without a file, ppl calibrates on the windows after the evaluated one
    assert main(args) == 0
    held_out = json.loads(capsys.readouterr().out)
    assert held_out["ppl"] != with_file["ppl"]
    assert held_out["bf16_ppl"] == with_file["bf16_ppl"]


def test_generate_needs_a_calibration_file_for_calib_clauses(capsys):
    assert main(["generate", "--prompt", "Hi", "--cache", "int:4 smooth=calib"]) == 2
    err = capsys.readouterr().err
    assert "--calibration" in err and err.count("\n") == 1
    assert main(["calibrate", "--out", "/nonexistent/dir/x.npz", "--windows", "1",
                 "--window-len", "16"]) == 2
    assert main(["calibrate", "--out", "x.npz", "--offset", "-1"]) == 2


def test_calibrate_fits_what_a_fit_clause_reads(tmp_path, capsys):
    out = tmp_path / "fit"
    assert main(["calibrate", "--fit", "saw:b2,kv,c16", "--out", str(out), "--windows", "1",
                 "--window-len", "64", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["fits"] == 60 and row["tokens"] == 64 and row["disk_bytes"] > 0
    assert row["use"] == f"saw:b2,kv,c16 fit={out}"
    args = ["ppl", "--windows", "1", "--window-len", "32", "--corpus", "austen", "--json"]
    assert main([*args, "--cache", row["use"]]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert main([*args, "--cache", "saw:b2,kv"]) == 0
    free = json.loads(capsys.readouterr().out)
    assert fitted["bf16_ppl"] == free["bf16_ppl"] and fitted["ppl"] != free["ppl"]
    assert fitted["bits_per_element"] == free["bits_per_element"] + 8 / 64
    assert main([*args, "--cache", "saw:b2,kv,c16"]) == 2
    assert "add fit=DIR" in capsys.readouterr().err
    assert main(["calibrate", "--fit", "int:4", "--out", str(out)]) == 2
    assert "no codec of it takes fitted parameters" in capsys.readouterr().err


def test_allocate_refuses_bad_input_before_loading(capsys, tmp_path):
    out = str(tmp_path / "s.json")
    for args, message in ((["--allocate", "3", "--candidates", "int:1"], "2..8"),
                          (["--allocate", "3", "--fit", "saw:c16"], "separate runs"),
                          (["--allocate", "0"], "> 0")):
        assert main(["calibrate", "--out", out, *args]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("out", ["", "   "])
def test_an_empty_out_is_refused_before_anything_runs(capsys, out):
    assert main(["calibrate", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "--out must name a file" in err and err.count("\n") == 1


def test_a_budget_no_candidate_fits_is_refused_before_measuring(capsys, tmp_path,
                                                                monkeypatch):
    import models.evaluate

    ran = []
    monkeypatch.setattr(models.evaluate, "cache_perplexity",
                        lambda *a, **k: ran.append(1))
    out = str(tmp_path / "s")
    assert main(["calibrate", "--out", out, "--allocate", "4", "1e-9", "--windows", "1",
                 "--window-len", "32"]) == 2
    err = capsys.readouterr().err
    assert "budget of 1e-09 bits per element is below the cheapest choice (2.500)" in err
    assert not ran and err.count("\n") == 1
