"""experiments/sharding_model.py: bytes per GPU from the shapes, rows that fit, floors."""

import csv

import pytest

from experiments import sharding_model

GIB = 2**30


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    assert sharding_model.main(["--codec", "bf16", "--codec", "int:4", "--out",
                                str(out)]) == 0
    for name in ("model.md", "model.csv", "model.png"):
        assert (out / name).stat().st_size > 0
    with open(out / "model.csv") as f:
        return [{k: (v if k in ("model", "codec") else float(v)) for k, v in r.items()}
                for r in csv.DictReader(f)]


def test_bytes_per_gpu_follow_the_heads_split(rows):
    eight_b = {(r["codec"], r["gpus"]): r for r in rows if r["model"] == "llama-3-8b"}
    # a bf16 row of 32k tokens: 32 layers x 8 kv heads x 128 dims x K and V x 2 bytes
    for gpus in (1, 2, 4, 8):
        assert eight_b["bf16", gpus]["row_gib_per_gpu"] == pytest.approx(
            32 * 8 * 128 * 2 * 2 * 32768 / GIB / gpus)
    # the split weights halve, the embedding stays whole on every GPU
    whole = eight_b["bf16", 1]["weights_gib_per_gpu"]
    assert whole == pytest.approx(8_030_261_248 * 2 / GIB)
    embedding = 128256 * 4096 * 2 / GIB
    assert eight_b["bf16", 2]["weights_gib_per_gpu"] == pytest.approx(
        (whole - embedding) / 2 + embedding, rel=1e-3)


def test_more_gpus_hold_more_rows_and_never_scale_past_one(rows):
    for model in ("llama-3-8b", "llama-3-70b"):
        for codec in ("bf16", "int:4"):
            line = sorted((r for r in rows if r["model"] == model and r["codec"] == codec),
                          key=lambda r: r["gpus"])
            fits = [r["rows_fit"] for r in line]
            assert fits == sorted(fits) and fits[-1] > 2 * fits[1]
            assert all(r["scaling_efficiency"] <= 1 + 1e-9 for r in line
                       if r["scaling_efficiency"] == r["scaling_efficiency"])
    seventy = {(r["codec"], r["gpus"]): r for r in rows if r["model"] == "llama-3-70b"}
    assert seventy["bf16", 1]["rows_fit"] == 0    # 131 GiB of weights alone
    assert seventy["int:4", 8]["rows_fit"] > 3.5 * seventy["bf16", 8]["rows_fit"]


def test_bad_codec_exits_2(capsys):
    assert sharding_model.main(["--codec", "int:1"]) == 2
    assert "2..8" in capsys.readouterr().err
