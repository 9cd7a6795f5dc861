"""experiments/bench_decode.py and profile_decode.py: arguments, the table, and the
profiler's calls of the kernel entry (interpret mode on a CPU)."""

import pytest

from experiments import bench_decode, profile_decode
from pallas_kernels.int_decode.kernel import Research


def test_bad_arguments_exit_with_status_2(capsys):
    assert bench_decode.main(["--shape", "llama3-8b"]) == 2
    assert "known models: " in capsys.readouterr().err
    assert bench_decode.main(["--variant", "words:64:4:2"]) == 2
    assert "layout must be one of" in capsys.readouterr().err
    assert bench_decode.main(["--codec", "fp8"]) == 2
    assert "no fused kernel reads K 'fp8'" in capsys.readouterr().err
    assert bench_decode.main(["--codec", "turboquant:b9"]) == 2
    assert bench_decode.main(["--codec-variant", "32:3:2"]) == 2
    assert "warps a power of two" in capsys.readouterr().err
    assert bench_decode.main(["--codec-variant", "32:4"]) == 2
    assert "takes BLOCK_S:WARPS:STAGES[:SPLITS]" in capsys.readouterr().err
    assert bench_decode.main(["--codec-variant", "32:4:2:0"]) == 2
    assert bench_decode.parse_codec_variant("64:2:2:16")["splits"] == 16
    assert bench_decode.parse_codec_variant("lookup=table,block_s=32") == {
        "lookup": "table", "block_s": 32}
    assert bench_decode.main(["--codec-variant", "lookup="]) == 2
    assert bench_decode.parse_codec_variant("16:4:1") == {"block_s": 16, "num_warps": 4,
                                                          "num_stages": 1}
    assert profile_decode.main(["--shape", "nope"]) == 2
    assert profile_decode.main(["--layout", "words"]) == 2


def test_variants_and_the_table():
    assert bench_decode.parse_variant("halves-jnp:64:4:2:66") == {
        "research": Research(layout="halves", asm=False), "block_s": 64, "num_warps": 4,
        "num_stages": 2, "splits": 66}
    assert bench_decode.parse_variant("bytes:128:8:3")["splits"] is None
    assert bench_decode.parse_variant("halves-sub-h4:128:2:3")["research"] == Research(
        biased=False, heads=4)
    with pytest.raises(ValueError, match="unknown layout suffixes"):
        bench_decode.parse_variant("halves-x:128:2:3")
    row = {"shape": "llama-3-8b", "batch": 32, "slots": 32768, "splits": 4, "block_s": 128,
           "paths": {"cudnn": {"ms": 1.048, "gbs": 4100.0, "floor_ms": 1.013},
                     "fused": {"ms": 0.5, "gbs": 2280.0, "floor_ms": 0.269}}}
    lines = bench_decode.table([row]).splitlines()
    assert lines[0].startswith("| shape | B | S | splits | path | ms | GB/s | vs cuDNN bf16")
    assert lines[3] == ("| llama-3-8b | 32 | 32768 | 4 | fused | 0.500 | 2280 | 2.10x | 0.269 "
                        "| 1.86x |")


def test_profile_runs_the_entry(capsys):
    args = ["--shape", "smollm2-135m", "--batch", "1", "--slots", "40", "--calls", "1",
            "--block-s", "16"]
    assert profile_decode.main(args) == 0
    assert "ran 1 calls: B=1 S=40 block_s 16 num_warps 2" in capsys.readouterr().out
    assert profile_decode.main([*args, "--codec", "turboquant:b3,qjl"]) == 0
    out = capsys.readouterr().out
    assert "block_s 16 turboquant:b3,qjl" in out  # only what the command line set
    assert profile_decode.main([*args, "--codec", "hyperquant:e8,4bps,int8"]) == 0
    assert "[int_decode]" in capsys.readouterr().out
    assert profile_decode.main([*args, "--codec", "fp8"]) == 2
