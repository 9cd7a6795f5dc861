"""experiments/bench_prefill.py: the work it counts, its arguments, and a smoke run."""

import json

import pytest

from experiments import bench_prefill


def test_visible_keys_count_the_causal_triangle_after_the_history():
    # token t of a chunk after S stored tokens sees S + t + 1 keys
    assert bench_prefill.visible_keys(3, 0) == 1 + 2 + 3
    assert bench_prefill.visible_keys(3, 10) == 11 + 12 + 13
    assert bench_prefill.visible_keys(1, 5) == 6


def test_points_and_variants_parse_or_fail_clearly():
    assert bench_prefill.parse_point("8:1024:31744") == (8, 1024, 31744)
    assert bench_prefill.parse_variant("128:64:8:3") == {
        "block_q": 128, "block_k": 64, "num_warps": 8, "num_stages": 3, "order": "rows"}
    assert bench_prefill.parse_variant("64:64:4:2:queries")["order"] == "queries"
    for bad in ("8:1024", "0:16:0", "1:16:-1", "a:b:c"):
        with pytest.raises(ValueError, match=r"B:T:S|B, T >= 1"):
            bench_prefill.parse_point(bad)
    for bad in ("128:64:8", "64:64:4:2:heads", "64:64:4:2:rows:1"):
        with pytest.raises(ValueError, match="BLOCK_Q:BLOCK_K:WARPS:STAGES"):
            bench_prefill.parse_variant(bad)
    assert bench_prefill.main(["--point", "8:16"]) == 2
    assert bench_prefill.main(["--variant", "64:64:4"]) == 2
    assert bench_prefill.main(["--cache", "int:99"]) == 2


def test_smoke_run_prints_the_table(capsys, tmp_path):
    args = ["--shape", "smollm2-135m", "--point", "1:16:16", "--variant", "16:16:4:1:queries",
            "--cache", "int:4 window=4 attn=int_decode", "--inner", "1", "--repeats", "1",
            "--json", str(tmp_path / "rows.json")]
    assert bench_prefill.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| B | T | S | path | ms | TFLOP/s")
    assert out[2].startswith("| 1 | 16 | 16 | chunk_flash | ")
    assert out[3].startswith("| 1 | 16 | 16 | chunk_flash[16:16:4:1:queries] | ")
    # the chunk over a layer of int:4 codes, read in place by the INT kernel
    assert out[4].startswith("| 1 | 16 | 16 | int:4 window=4 attn=int_decode (int_decode) | ")
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    flops = 4 * 64 * 9 * bench_prefill.visible_keys(16, 16)
    assert rows[0]["tflops"] == pytest.approx(flops / (rows[0]["ms"] / 1e3) / 1e12)
    # the variant computes the same attention up to the order of its bfloat16 sums
    assert 0 <= rows[1]["max_diff"] < 0.05
