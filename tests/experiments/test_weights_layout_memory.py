"""experiments/weights_layout_memory.py and experiments/key_deviations.py: smoke runs."""

from experiments import key_deviations, weights_layout_memory


def test_every_layout_runs_and_says_what_the_device_reports(capsys):
    for layout in weights_layout_memory.LAYOUTS:
        assert weights_layout_memory.main(["--shape", "smollm2-135m", "--layers", "1",
                                           "--layout", layout, "--stack-gb", "0.001"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("stacked weights: ")
    assert any(line.startswith("laid out on the host: ") for line in out)
    assert out[-1].startswith("two 0.001 GiB stacks fit: ")
    assert weights_layout_memory.main(["--stack-gb", "-1"]) == 2


def test_the_embedded_models_keys_stay_inside_the_limit(capsys):
    assert key_deviations.main(["--windows", "1", "--chunks", "16", "64"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 3  # the header and two chunk lengths
    for row in rows[1:]:
        largest = float(row.split("|")[2])
        assert 0 < largest < 64
    assert key_deviations.main(["--chunks", "1"]) == 2
