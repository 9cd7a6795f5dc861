"""kvjax.eval.tradeoff: the eviction x quantization grid, resumable, and its reports."""

from __future__ import annotations

import csv

import pytest

from kvjax.eval import tradeoff
from kvjax.eval.retrieval import SuiteSettings


def test_default_points_cover_every_strategy():
    points = tradeoff.default_points(budgets=("50%",), codecs=("int:4",),
                                     policies=("snapkv",), combined=(("h2o", "int:8"),),
                                     combined_budgets=("25%",))
    assert [(p.strategy, p.config) for p in points] == [
        ("reference", "bf16"), ("quantize", "int:4 evict=all"),
        ("snapkv", "bf16 evict=snapkv:50%"), ("h2o + int:8", "int:8 evict=h2o:25%")]
    with pytest.raises(ValueError, match="unknown eviction policy 'lru'"):
        tradeoff.default_points(policies=("lru",))
    with pytest.raises(ValueError, match="bit width"):
        tradeoff.default_points(codecs=("int:99",))


def _fake_measure(calls):
    def measure(config, cache_config):
        calls.append(config)
        policy = cache_config.evict
        share = 1.0 if policy is None else policy.share
        bits = 16.0 if cache_config.k.spec == "bf16" else 4.0
        return [{"ppl": 10 + len(config) / 10, "kl_mean": 0.01, "kl_p99": 0.1,
                 "top1_agreement": 0.9, "reference_ppl": 10.0, "seconds": 0.0,
                 "bits_per_element": bits, "sequence_bits_per_element": bits * share}]

    return measure


def _fake_answer(config, cache_config):
    return [{"task": "passkey", "length": 64, "depth": 0.5, "trial": 0,
             "correct": cache_config.evict is None, "score": 1.0, "answer": "",
             "expected": ["1"]}]


def test_points_run_once_and_report(tmp_path):
    points = tradeoff.default_points(budgets=("25%",), codecs=("int:4",),
                                     policies=("streaming",), combined=(),
                                     combined_budgets=())
    settings = tradeoff.ContinuationSettings(model="m", corpus="c", windows=2, context=8,
                                             follow=4)
    suite = SuiteSettings(model="m", corpus="c", tasks=("passkey",), lengths=(64,),
                          depths=(0.5,))
    calls: list[str] = []
    rows = tradeoff.run_points(points, settings, tmp_path, _fake_measure(calls),
                               retrieval=suite, answer=_fake_answer)
    assert calls == ["bf16", "int:4 evict=all", "bf16 evict=streaming:25%"]
    by = {r["config"]: r for r in rows}
    assert by["bf16 evict=streaming:25%"]["sequence_bits_per_element"] == 4.0
    assert by["bf16"]["retrieval"] == 1.0 and by["int:4 evict=all"]["retrieval"] == 0.0
    again = tradeoff.run_points(points, settings, tmp_path, _fake_measure(calls),
                                retrieval=suite, answer=_fake_answer)
    assert calls == ["bf16", "int:4 evict=all", "bf16 evict=streaming:25%"]  # read back
    assert again == rows

    text = tradeoff.write_reports(rows, tmp_path / "report", "a title")
    assert "| quantize | `int:4 evict=all` | 4.00 |" in text
    with (tmp_path / "report" / "grid.csv").open() as f:
        assert [r["strategy"] for r in csv.DictReader(f)] == ["reference", "quantize",
                                                               "streaming"]
    assert (tmp_path / "report" / "tradeoff.png").stat().st_size > 10_000
