"""experiments/hyperquant_tables.py at tiny sizes: the files it writes, every lattice in
every part with finite numbers, Monte-Carlo G near the exact values, and the cost of not
stripping in the order of the bits membership pins."""

import json
import math

import pytest

from experiments import hyperquant_tables as hqt
from kvjax.eval import lattice_rates as lr
from kvjax.eval.provenance import KEY
from kvjax.primitives.lattices import lattice

LATTICES = {"z", "a2", "d4", "e8"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs")
    # every target compiles its own encode: two targets per lattice, one dithered e8
    code = hqt.main(["--samples", "20000", "--head-dims", "64", "--vectors", "512",
                     "--targets", "2", "--dither-targets", "3", "--sweep-vectors", "512",
                     "--docs", str(docs), "--no-progress"])
    assert code == 0
    return docs, json.loads((docs / "tables.json").read_text())


def _finite(value) -> bool:
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def test_files_and_structure(run):
    docs, summary = run
    for name in ("tables.md", "tables.json", "rates.png"):
        assert (docs / name).stat().st_size > 0
    for part in ("second_moments", "operating_point"):
        assert {r["lattice"] for r in summary[part]["rows"]} == LATTICES
    assert {r["lattice"] for r in summary["sweep"]["summary"]} == LATTICES
    assert [r["target"] for r in summary["sweep"]["rows"] if r["lattice"] == "z"] == [1.5, 5.0]
    assert [r["lattice"] for r in summary["sweep"]["rows"] if r["dither"]] == ["e8"]
    assert summary["settings"]["seed"] == 1 and summary["settings"]["head_dims"] == [64]
    assert _finite(summary)
    assert summary[KEY]["versions"]["jax"] and summary[KEY]["device"]["count"] >= 1
    md = (docs / "tables.md").read_text()
    assert md == hqt.markdown(summary)
    assert "## 4. Realized vs target rate" in md and "| e8 | 64 |" in md and "| 3.74 |" in md


def test_second_moments_near_exact(run):
    for r in run[1]["second_moments"]["rows"]:
        assert r["estimate"] == pytest.approx(lattice(r["lattice"]).second_moment, rel=0.03)
        assert r["paper"] == pytest.approx(r["exact"], abs=6e-5)


def test_operating_point_numbers(run):
    rows = {r["lattice"]: r for r in run[1]["operating_point"]["rows"]}
    for name, r in rows.items():
        assert r["ideal"] == pytest.approx(
            lr.rd_rate(21.0) + 0.5 * math.log2(2 * math.pi * math.e
                                                * lattice(name).second_moment))
        # the rate sits above the scalar entropy, which sits near the lattice ideal
        assert r["scalar_entropy"] < r["rice_direct"] < r["ideal"] + 0.2
        assert abs(r["entropy_minus_ideal"]) < 0.05
        assert abs(r["rice_direct"] - r["rice_calibration"]) < 0.02
        assert abs(r["snr_measured_db"] - 21.0) < 0.1
    # stripping removes what membership pins: e8 > a2 > d4 > z = 0
    cost = {n: r["strip_cost"] for n, r in rows.items()}
    assert cost["e8"] > cost["a2"] > cost["d4"] > 0.1
    assert cost["z"] == pytest.approx(0.0, abs=1e-9)
    for r in rows.values():
        assert r["strip_cost"] == pytest.approx(r["pinned_bits"], abs=0.02)
    # one Rice parameter for a2's unequal coordinates costs more than one per class
    assert rows["a2"]["strip_cost_one_parameter"] > rows["a2"]["strip_cost"] + 0.03
