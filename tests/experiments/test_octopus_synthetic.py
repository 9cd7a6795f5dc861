"""experiments/octopus_synthetic.py at tiny sizes: the files it writes, the structure of its
results, the fp32 needle baseline against a numpy softmax, error falling with bits, stored
bits equal to the bytes of the codes, the split diagonal and the paper's ratios (the
probes themselves: tests/kvjax/eval/test_rotation_probes.py).

Every codec costs a compilation per part, so the run is shared and the codec list short.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import octopus_synthetic as osyn
from kvjax.eval import rotation_probes as rp
from kvjax.eval.provenance import KEY
from kvjax.eval.synthetic import _trial_keys, needle_problem
from kvjax.spec import parse_codec

D, KEYS, DISTRACTORS, NEEDLE_SEEDS = 32, 64, 127, 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs")
    # every codec costs a compilation per part: one codec, whose keys run the split's
    # delta = +1 row reuses (the same codec, sizes and seeds), and one more split
    code = osyn.main(["--parts", "keys,needle,split", "--codec", "octopus:b3",
                      "--no-rate-refs", "--head-dim", str(D), "--keys", str(KEYS),
                      "--queries", "4", "--seeds", "2", "--gain-seeds", "1",
                      "--needle-seeds", str(NEEDLE_SEEDS),
                      "--distractors", str(DISTRACTORS), "--split-bits", "3",
                      "--split-deltas", "0,1", "--split-seeds", "2", "--no-equal-rate",
                      "--docs", str(docs), "--no-progress"])
    assert code == 0
    return docs, json.loads((docs / "synthetic.json").read_text())


def test_main_writes_markdown_json_and_figure(run):
    docs, summary = run
    for name in ("synthetic.md", "synthetic.json", "synthetic.png"):
        assert (docs / name).stat().st_size > 0
    md = (docs / "synthetic.md").read_text()
    assert md.splitlines()[3].startswith("python experiments/octopus_synthetic.py --parts")
    assert "| `octopus:b3` | 4.0000 |" in md and "| 3 | +1 | (4, 2) | 10 | 4.0000 |" in md
    assert {"keys", "needle", "split", KEY} <= set(summary) and "grid" not in summary
    assert summary[KEY]["command"].startswith("python ")
    assert summary["keys"]["settings"] == {"head_dim": D, "seed": 0, "keys": KEYS,
                                           "queries": 4, "seeds": 2, "gain_seeds": 1}
    # the file is the tables and their settings; the discussion lives in docs/octopus.md
    assert md == osyn.markdown(summary) and "Discussion" not in md


def test_keys_rows_bits_and_error_falling_with_bits(run):
    (row,) = run[1]["keys"]["rows"]
    assert row["codec"] == "octopus:b3" and row["family"] == "octopus" and row["b"] == 3
    assert len(row["per_seed"]["mse"]) == 2 and 0.95 < row["cosine"] < 1
    # Lloyd-Max levels shrink: a key's score with itself falls short of |k|^2
    assert 0.9 < row["self_score_gain"] < 0.995
    # "bits" is measured from the codes' bytes (the script raises if the formula differs):
    # 11 triplets of 4 + 4 + 2 bits in 14 bytes, plus the fp16 norm
    assert row["bits"] == row["bits_formula"] == 4.0
    assert parse_codec("octopus:b3").bits_per_element(D) == 4.0
    uniform, plus1 = run[1]["split"]["rows"]
    # the split's (4, 2) row is the same codec on the same trials
    assert plus1["mse_per_seed"] == row["per_seed"]["mse"]
    # one more bit per triplet, on the direction: a third less error, in every trial
    assert np.all(np.asarray(plus1["mse_per_seed"]) < 0.75 * np.asarray(uniform["mse_per_seed"]))


def test_needle_baseline_is_the_numpy_softmax(run):
    result = run[1]["needle"]
    ref = result["reference"]

    @jax.jit
    def problems(trials):
        def one(trial):
            return needle_problem(_trial_keys(0, trial)[0], DISTRACTORS, D, 0.1)

        return jax.vmap(one)(trials)

    masses = []
    for keys, query, position in zip(*problems(jnp.arange(NEEDLE_SEEDS, dtype=jnp.uint32)),
                                     strict=True):
        logits = np.asarray(keys, np.float64) @ np.asarray(query, np.float64) / math.sqrt(D)
        p = np.exp(logits - logits.max())
        masses.append(p[int(position)] / p.sum())
    np.testing.assert_allclose(ref["per_seed"], masses, rtol=1e-4)
    assert ref["mass"] == pytest.approx(np.mean(masses), rel=1e-4)
    (row,) = result["rows"]
    assert row["codec"] == "octopus:b3" and 0 < row["mass"] <= 1
    assert row["ratio"] == pytest.approx(row["mass"] / ref["mass"])


def test_paper_ratios_and_codec_specs():
    rows = [
        {"codec": c, "family": rp.family(c), "b": rp.nominal(c), "bits": bits, "mse": mse,
         "ip_abs_err": ip, "per_seed": {"mse": [mse, mse], "ip_abs_err": [ip, ip]}}
        for c, bits, mse, ip in (("turboquant:b2", 2.125, 0.12, 3.0),
                                 ("turboquant:b3", 3.125, 0.03, 1.5),
                                 ("octopus:b2", 2.5, 0.06, 2.0),
                                 ("polarquant:b2", 2.125, 0.12, 3.0))]
    ratios = {(r["num"], r["den"]): r for r in osyn.paper_ratios(rows)}
    assert ratios["turboquant:b2", "octopus:b2"]["ratio"] == pytest.approx(2.0)
    assert ratios["polarquant:b2", "octopus:b2"]["paper"] == 2.4
    assert len(osyn.codec_specs()) == 15


def test_split_configs_and_diagonal(run):
    configs = rp.split_configs()
    assert len(configs) == 15 and (2, -2, 0, 4) in configs and (4, 2, 6, 2) in configs
    assert all(0 <= d <= 8 and 0 <= n <= 8 for _, _, d, n in configs)
    assert rp.equal_rate_splits(2) == [(2, 2), (3, 0)]
    uniform, plus1 = run[1]["split"]["rows"]
    assert (uniform["bits_per_triplet"], plus1["bits_per_triplet"]) == (9, 10)
    assert uniform["vs_uniform"] == 0 and plus1["codec"] == "octopus:b3"
    # the paper's split: one more bit per triplet, a third less error
    assert plus1["vs_uniform"] < -0.25 and run[1]["split"]["rate"] == []
