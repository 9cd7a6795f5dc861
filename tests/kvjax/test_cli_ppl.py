"""Tests of ``python -m kvjax ppl``: one real run with the embedded model, and bad input."""

import json
import math

import pytest

from kvjax.cli import main
from kvjax.spec import parse_codec


def _loads(text: str):
    """Strict JSON: NaN and Infinity, which Python's json reads, fail the test."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))


SMOLLM2_HEAD_DIM = 64  # SmolLM2-135M: 576 hidden / 9 heads


def test_ppl_real_model_on_shakespeare(capsys):
    args = ["ppl", "--codec", "int:4", "--windows", "2", "--window-len", "64", "--json"]
    assert main(args) == 0
    out = _loads(capsys.readouterr().out)
    assert out["cache"] == "int:4" and out["k_codec"] == out["v_codec"] == "int:4"
    assert out["bf16_cache"] == "bf16"
    assert out["corpus"] == "shakespeare" and out["windows"] == 2 and out["window_len"] == 64
    assert math.isfinite(out["ppl"]) and out["ppl"] > 1
    assert math.isfinite(out["bf16_ppl"]) and 1 < out["bf16_ppl"] <= out["ppl"] * 1.5
    # no residual window or sinks: every stored token is int:4 codes
    expected = parse_codec("int:4").bits_per_element(SMOLLM2_HEAD_DIM)
    assert out["bits_per_element"] == pytest.approx(expected)
    assert out["seconds"] > 0
    # the next-token distribution against the bf16 cache, overall and by position
    assert 0 < out["kl_mean"] <= out["kl_p99"] and 0 < out["top1_agreement"] <= 1
    buckets = out["kl_by_position"]
    assert [(b["start"], b["end"]) for b in buckets] == [(0, 8), (8, 16), (16, 32), (32, 64)]
    assert sum(b["tokens"] for b in buckets) == out["tokens"] == 2 * 63
    assert out["mesh"] == "data=1,model=1"



def test_ppl_after_an_evicted_prompt_counts_the_sequence_bits(capsys):
    args = ["ppl", "--cache", "int:8 evict=snapkv:50%,w8", "--windows", "1",
            "--window-len", "64", "--context", "48", "--json"]
    assert main(args) == 0
    out = _loads(capsys.readouterr().out)
    assert out["cache"] == "int:8 evict=snapkv:50%,w8" and out["bf16_cache"] == "bf16"
    assert out["context"] == 48 and out["tokens"] == 16
    # 24 of the 48 prompt tokens and the 15 fed after them are stored, of 63
    assert out["sequence_bits_per_element"] == pytest.approx(
        out["bits_per_element"] * 39 / 63)
    assert out["kl_mean"] > 0 and 0 < out["top1_agreement"] <= 1


@pytest.mark.parametrize("args,needle", [
    (["--codec", "int:4", "--corpus", "no-such-corpus"], "no-such-corpus"),
    ([], "--codec"),
    (["--cache", "v=int:4"], "names no K codec"),
    (["--codec", "int:1"], "2..8"),
    (["--codec", "int:4", "--window-len", "9000"], "context"),
    (["--codec", "int:4", "--model", "no-such-model"], "no-such-model"),
    (["--cache", "int:4 evict=snapkv:25%"], "give --context N"),
    (["--codec", "int:4", "--window-len", "64", "--context", "64"], "leaves no token"),
    (["--codec", "int:4", "--mesh", "rows=2"], "mesh axis 'rows' unknown"),
    (["--codec", "int:4", "--mesh", "model=16"], "needs 16 devices"),
    (["--codec", "int:4", "--window-len", "64", "--mesh", "model=2"],
     "3 kv heads do not split over model=2"),
])
def test_ppl_bad_input_exits_2(capsys, args, needle):
    assert main(["ppl", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
