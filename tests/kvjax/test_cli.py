"""``python -m kvjax``: the probe command, the one cache option and its error handling."""

import json
import subprocess
import sys

import numpy as np
import pytest

from kvjax.cli import main, needle_caches
from kvjax.spec import parse_cache


def _loads(text: str):
    """Strict JSON: NaN and Infinity, which Python's json reads, fail the test."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))


SMALL = ["--head-dim", "32", "--tokens", "64", "--heads", "2", "--queries", "4"]


def _probe_json(capsys, *args):
    assert main(["probe", *args, *SMALL, "--json"]) == 0
    return _loads(capsys.readouterr().out)


def test_probe_json_fields_and_bits(capsys):
    out = _probe_json(capsys, "--codec", "int:4")
    for field in ("cache", "head_dim", "bits_per_element_formula", "bits_per_element_measured",
                  "rel_mse", "cosine", "ip_abs_err", "attn_rel_err"):
        assert field in out
    assert out["cache"] == "int:4" and out["head_dim"] == 32
    assert out["bits_per_element_measured"] == out["bits_per_element_formula"] == 5.0
    assert 0 < out["rel_mse"] < 0.03 and 0.98 < out["cosine"] < 1
    assert 0 < out["attn_rel_err"] < 0.2


def test_probe_errors_shrink_with_bits(capsys):
    rows = _probe_json(capsys, "--codec", "int:2", "--codec", "int:4", "--codec", "int:8")
    mse = [r["rel_mse"] for r in rows]
    ip = [r["ip_abs_err"] for r in rows]
    assert mse[0] > mse[1] > mse[2] > 0 and ip[0] > ip[1] > ip[2] > 0
    lossless = _probe_json(capsys, "--codec", "bf16")
    assert lossless["rel_mse"] < 1e-4 and lossless["bits_per_element_measured"] == 16


def test_probe_separate_k_and_v(capsys):
    out = _probe_json(capsys, "--cache", "k=kivi:2,g32 v=int:8")
    assert out["k_codec"] == "kivi:2,g32" and out["v_codec"] == "int:8"
    assert out["v_rel_mse"] < out["rel_mse"]
    assert out["cache"] == "k=kivi:2,g32 v=int:8"


def test_probe_cache_spec_reaches_the_cache(capsys):
    """Window, sinks and layer rules of the spec shape the probe's one-layer cache."""
    plain = _probe_json(capsys, "--cache", "int:2")
    # the canonical spec is recorded, whatever the order of the clauses
    windowed = _probe_json(capsys, "--cache", "int:2 sinks=4 window=16")
    assert windowed["cache"] == "int:2 window=16 sinks=4"
    # 20 of the 64 tokens stay raw (float32): less error, more bits, same codes
    assert windowed["rel_mse"] < plain["rel_mse"]
    assert windowed["cache_bits_per_element"] > plain["cache_bits_per_element"]
    assert windowed["bits_per_element_measured"] == plain["bits_per_element_measured"]
    raw_k = _probe_json(capsys, "--cache", "int:2 layers[0]:k=bf16")
    assert raw_k["k_codec"] == "bf16" and raw_k["v_codec"] == "int:2"
    assert raw_k["rel_mse"] < 1e-4 and raw_k["v_rel_mse"] == plain["v_rel_mse"]


def test_codec_is_a_second_name_of_the_cache_option(capsys):
    rows = _probe_json(capsys, "--codec", "fp8", "--cache", "int:4", "--codec", "int:8")
    assert [r["cache"] for r in rows] == ["fp8", "int:4", "int:8"]


def test_probe_table_lists_every_codec(capsys):
    assert main(["probe", *SMALL, "--codec", "fp8", "--codec", "kivi:2,g16"]) == 0
    table = capsys.readouterr().out
    assert "| fp8 |" in table and "| kivi:2,g16 |" in table


def test_probe_reads_kv_from_npy(tmp_path, capsys):
    kv = np.random.default_rng(0).standard_normal((2, 40, 1, 16)).astype(np.float32)
    path = tmp_path / "kv.npy"
    np.save(path, kv)
    out = _probe_json(capsys, "--codec", "int:8", "--npy", str(path))
    assert out["tokens"] == 40 and out["head_dim"] == 16
    kv[0, 3, 0, 1] = np.nan
    np.save(path, kv)
    assert main(["probe", "--codec", "int:8", "--npy", str(path)]) == 2
    assert "NaN or Inf" in capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    (["--codec", "int:9"], "2..8"),
    (["--codec", "zip:4"], "valid codecs"),
    (["--codec", "kivi:2,q3"], "unknown option"),
    (["--cache", "v=int:4"], "names no K codec"),
    (["--k", "int:4", "--v", "int:4"], "unrecognized arguments: --k"),
    (["--codec", "int:4", "--window", "8"], "unrecognized arguments: --window"),
    (["--codec", "int:4", "--head-dim", "0"], "positive integer"),
    (["--codec", "int:4", "--tokens", "x"], "positive integer"),
])
def test_bad_input_exits_2_with_one_line(capsys, args, needle):
    assert main(["probe", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


COMMANDS = [["probe"], ["generate", "--prompt", "hi"], ["ppl"], ["needle"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("spec,needle", [
    ("zip:4", "valid codecs"),
    ("int:4 window=-3", "non-negative integer"),
    ("int:4 colour=red", "unknown clause 'colour=red'; clauses: CODEC k=CODEC"),
    ("k=int:4 k=int:2", "given twice"),
    ("int:4 layers[0,x]:k=bf16", "bad layer selection"),
    ("", "empty cache spec"),
])
def test_every_command_rejects_a_bad_spec_in_one_line(capsys, command, spec, needle):
    """A usage error before any model or data is loaded: exit 2, one line, no traceback."""
    assert main([*command, "--cache", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvjax: error: argument --cache/--codec: ")
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["probe", "--npy", "/no/such.npy"],
                                     ["generate", "--prompt", "hi", "--model", "no-such"],
                                     ["ppl", "--model", "no-such"],
                                     ["needle", "--model", "no-such"]],
                         ids=lambda c: c[0])
def test_every_command_rejects_an_unknown_attention_name(capsys, command):
    assert main([*command, "--cache", "int:4 attn=no_such_impl"]) == 2
    err = capsys.readouterr().err
    assert "no_such_impl" in err and len(err.strip().splitlines()) == 1


def test_codecs_command_lists_registered(capsys):
    assert main(["codecs"]) == 0
    out = capsys.readouterr().out
    for name in ("bf16", "fp8", "int", "kivi", "hqmq", "saw", "medC"):
        assert name in out
    # a layout with no fast read says so under its codec, naming a fast sibling that
    # the kernel registry does read
    from kvjax.attention.fused import find_kernel
    from kvjax.spec import parse_codec

    hyperquant = out[out.index("\nhyperquant:"):out.index("\nint:")]
    note = hyperquant.split("decode speed: ")[1]
    assert "0.022x" in note and "hyperquant:e8,4bps,int8" in note
    assert out.count("decode speed: ") == 1
    sibling = parse_codec("hyperquant:e8,4bps,int8")
    assert find_kernel(sibling, sibling, 128)[0].name == "int_decode"


def test_module_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "kvjax", "probe", "--codec", "fp8", *SMALL, "--json"],
        capture_output=True, text=True, check=False, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = _loads(proc.stdout)
    assert parse_cache(out["cache"]) == parse_cache("fp8")
    bad = subprocess.run([sys.executable, "-m", "kvjax", "probe", "--codec", "int:1"],
                         capture_output=True, text=True, check=False, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("kvjax: error:")


def test_generate_with_the_embedded_model(capsys):
    args = ["generate", "--prompt", "The capital of France is", "--max-new-tokens", "4"]
    assert main([*args, "--json"]) == 0
    out = _loads(capsys.readouterr().out)
    assert "Paris" in out["text"] and len(out["tokens"]) == 4
    assert len(out["log_probs"]) == 4 and all(x <= 0 for x in out["log_probs"])
    assert out["cache_bytes"] > 0 and out["decode_tok_per_s"] > 0 and out["prefill_s"] > 0
    assert out["cache"] == "bf16" and out["mesh"] == "data=1,model=1"
    # SmolLM2's 3 kv heads (and 9 query heads) on 3 devices: the same tokens
    assert main([*args, "--json", "--mesh", "model=3"]) == 0
    sharded = _loads(capsys.readouterr().out)
    assert sharded["tokens"] == out["tokens"] and sharded["mesh"] == "data=1,model=3"
    assert main([*args, "--cache", "k=int:4 v=int:8 window=2", "--json"]) == 0
    captured = capsys.readouterr()
    out = _loads(captured.out)
    assert out["text"].strip() and out["cache"] == "k=int:4 v=int:8 window=2"
    assert captured.err == ""  # stderr is no terminal here: no status lines unless asked
    assert main([*args, "--progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "kvjax: loading smollm2-135m" and err[1].startswith(
        "kvjax: compiling and running the prefill (") and "'bf16'" in err[1]


def test_a_prompt_stored_by_one_process_continues_in_another(tmp_path, capsys):
    """The saving call decodes as usual; a second process reads the stored cache and
    emits the same greedy tokens without the prompt."""
    stored = tmp_path / "prompt"
    args = ["--max-new-tokens", "6", "--json"]
    assert main(["generate", "--prompt", "The capital of France is", "--cache",
                 "kivi:2,g32 window=4", "--save-prompt", str(stored), *args]) == 0
    first = _loads(capsys.readouterr().out)
    proc = subprocess.run([sys.executable, "-m", "kvjax", "generate", "--resume", str(stored),
                           *args], capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr
    resumed = _loads(proc.stdout)
    assert resumed["tokens"] == first["tokens"] and len(first["tokens"]) == 6
    assert resumed["cache"] == first["cache"] == "kivi:2,g32 window=4"
    assert resumed["disk_bytes"] == first["disk_bytes"] > 0
    assert main(["generate", "--resume", str(stored), "--max-new-tokens", "8"]) == 2
    assert "room for 7 new tokens" in capsys.readouterr().err
    # without --max-new-tokens a resumed prompt fills the room its cache keeps
    assert main(["generate", "--resume", str(stored), "--json"]) == 0
    filled = _loads(capsys.readouterr().out)["tokens"]
    assert filled[:6] == first["tokens"] and len(filled) == 7


def test_a_generate_that_does_not_fit_is_one_line(capsys, monkeypatch):
    """XLA out of device memory: the program, its sizes and what to try on one line, exit
    status 1, no traceback."""
    import jax

    from models import generate as gen

    def exhausted(name, *args):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 34735783936 bytes.")

    monkeypatch.setattr(gen, "_compiled", exhausted)
    assert main(["generate", "--prompt", "The capital of France is", "--max-new-tokens",
                 "4", "--prefill-chunk", "4"]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("kvjax: error: prefill does not fit in device memory at batch 1, ")
    assert "34735783936 bytes" in err and "a smaller prefill chunk" in err


@pytest.mark.parametrize("args,needle", [
    (["--resume", "/no/such/dir", "--prompt", "hi"], "--prompt does not apply"),
    (["--resume", "/no/such/dir", "--cache", "int:4"], "--cache does not apply"),
    ([], "give --prompt TEXT, or --resume DIR"),
    (["--prompt", "  "], "empty"),
    (["--prompt", "hi", "--model", "no-such-model"], "no-such-model"),
    (["--prompt", "hi", "--codec", "int:1"], "2..8"),
    (["--prompt", "hi", "--cache", "v=int:4"], "names no K codec"),
    (["--prompt", "hi", "--mesh", "data=2"], "1 row does not split over data=2"),
])
def test_generate_bad_input_exits_2(capsys, args, needle):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_needle_baselines_share_the_window_and_sinks():
    tested = [parse_cache(s) for s in ("int:4", "int:2 window=8", "bf16 window=8",
                                       "kivi:2,g32 sinks=4 layers[0]:k=bf16 attn=reference")]
    assert [c.spec for c in needle_caches(tested)] == [
        "bf16", "bf16 window=8", "bf16 sinks=4", "int:4", "int:2 window=8",
        "kivi:2,g32 sinks=4 layers[0]:k=bf16 attn=reference"]
    assert [c.spec for c in needle_caches([])] == ["bf16"]
