"""experiments/octopus_lm.py with a fake model evaluation: the protocol's cache settings,
seed aggregation, the unprotected comparison and the written files."""

import json

import pytest

from experiments import octopus_lm
from kvjax.eval.provenance import KEY


class FakeEvaluate:
    """ppl falls with K bits and grows with the seed; records every cache config."""

    def __init__(self):
        self.seen = []

    def __call__(self, config, cache_config, with_needle):
        self.seen.append((config, cache_config))
        bits = cache_config.k.bits_per_element(64)
        ppl = 40.0 + 200.0 / bits**2 + (5.0 if "qjl" in config else 0.0)
        return {"ppl": ppl, "nll": 1.0, "tokens": 10, "bits_per_element": bits,
                "k_bits_per_element": bits, "v_bits_per_element": bits, "seconds": 0.0}


def test_protocol_seeds_and_unprotected(tmp_path, capsys):
    fake = FakeEvaluate()
    docs = tmp_path / "docs"
    code = octopus_lm.main(["--out", str(tmp_path / "out"), "--docs", str(docs),
                            "--no-progress"], evaluate=fake)
    assert code == 0
    configs = {c for c, _ in fake.seen}
    assert set(octopus_lm.protocol_configs()) <= configs
    protocol = [cc for c, cc in fake.seen if c == "octopus:b2"]
    # boundary-1 and the window in the protocol, neither boundary in the unprotected run
    assert {tuple(r.spec for r in cc.layers) for cc in protocol} == {("layers[0,-1]:k=bf16",), ()}
    assert all(cc.residual_window == 32 for _, cc in fake.seen)
    summary = json.loads((docs / "lm.json").read_text())
    assert summary["cache_options"] == "window=32 layers[0,-1]:k=bf16" and KEY in summary
    assert len(summary["protocol"]) == len(octopus_lm.protocol_configs()) + 1  # + bf16
    seeds = {r["config"]: r for r in summary["seeds"]}
    assert set(seeds) == set(octopus_lm.seed_configs())
    assert all(len(r["ppl"]) == 1 + len(octopus_lm.EXTRA_SEEDS) for r in seeds.values())
    text = (docs / "lm_tables.md").read_text()
    assert "## Without boundary-1" in text and "Order by perplexity" in text
    # the fake's ppl falls with bits, so OCTOPUS (more K bits) ranks first at every b
    for line in octopus_lm.orderings(summary["protocol"]):
        assert line.split(": ", 1)[1].startswith("`octopus:b")
    for name in ("lm.csv", "lm_pareto.png", "lm_pareto_zoom.png"):
        assert (docs / name).stat().st_size > 100
    # a second run measures nothing: every result is on disk
    again = FakeEvaluate()
    assert octopus_lm.main(["--out", str(tmp_path / "out"), "--docs", str(docs),
                            "--no-progress"], evaluate=again) == 0
    assert again.seen == []
    assert "written:" in capsys.readouterr().out


def test_cache_options_replace_the_window(tmp_path, capsys):
    fake = FakeEvaluate()
    assert octopus_lm.main(["--part", "unprotected", "--cache-options", "window=8 sinks=4",
                            "--out", str(tmp_path), "--docs", str(tmp_path / "d"),
                            "--no-progress"], evaluate=fake) == 0
    assert {(cc.residual_window, cc.sink_tokens) for _, cc in fake.seen} == {(8, 4)}
    with pytest.raises(SystemExit) as exit_:
        octopus_lm.main(["--cache-options", "window=x", "--out", str(tmp_path)],
                        evaluate=fake)
    assert exit_.value.code == 2 and "window=x" in capsys.readouterr().err
