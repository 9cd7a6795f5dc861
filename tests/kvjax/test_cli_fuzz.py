"""``python -m kvjax`` under misuse: every subcommand, bad specs and numbers, bad files.

Each case runs the CLI in-process (``main(argv)``; a subprocess would start JAX for
seconds each time) and holds it to its contract: bad input is one line on stderr that
starts ``kvjax: error:``, exit status 2, nothing on stdout and never a traceback; a run
that succeeds with ``--json`` prints strict JSON (no ``NaN`` or ``Infinity``: numbers
that are not finite are ``null``). Random cases are drawn with :mod:`tests.fuzz`
(``KVJAX_FUZZ_EXAMPLES`` runs more). Model files are a tiny GGUF written here (a 1-layer
model with a byte-level tokenizer: every command runs it in seconds) and the first bytes
of the embedded model's GGUF, cut inside each of its sections.
"""

import json
import struct

import numpy as np
import pytest

import models
from kvjax.cli import main
from kvjax.cli import strict_json as strict_json_text
from kvjax.spec import registered
from models.gguf import read_layout
from tests.fuzz import example_count, rng
from tests.models.gguf_files import tiny_model

gguf = pytest.importorskip("gguf")

PROBE = ["probe", "--tokens", "16", "--head-dim", "16", "--heads", "1", "--queries", "2"]
COMMANDS = {
    "probe": PROBE,
    "generate": ["generate", "--prompt", "hi", "--max-new-tokens", "2"],
    "ppl": ["ppl", "--windows", "1", "--window-len", "32"],
    "needle": ["needle", "--lengths", "200", "--depths", "0.5", "--trials", "1"],
}
MODEL_COMMANDS = ("generate", "ppl", "needle")


def run(capsys, argv):
    """``(status, stdout, stderr)`` of ``main(argv)``; any exception fails the test."""
    try:
        status = main(argv)
    except BaseException as exc:  # what escapes main is a traceback
        pytest.fail(f"{argv} raised {type(exc).__name__}: {exc}")
    out, err = capsys.readouterr()
    return status, out, err


def usage_error(capsys, argv, needle=""):
    """Run ``argv``; assert the one-line error contract; return the message."""
    status, out, err = run(capsys, argv)
    lines = err.strip().splitlines()
    assert status == 2 and out == "", (argv, status, out, err)
    assert len(lines) == 1 and lines[0].startswith("kvjax: error: "), (argv, err)
    assert needle in lines[0], (argv, needle, lines[0])
    return lines[0]


def strict_json(text: str):
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity``."""

    def refuse(constant):
        raise AssertionError(f"not JSON: {constant} in {text[:200]}")

    return json.loads(text, parse_constant=refuse)


def succeeds_with_json(capsys, argv):
    status, out, err = run(capsys, argv)
    assert status == 0, (argv, err)
    return strict_json(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GGUF model with a tokenizer and a chat template (context 256)."""
    return str(tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", tokenizer=True))


def _with(command: str, *args: str) -> list[str]:
    argv = [*COMMANDS[command], *args]
    if command == "ppl" and "--cache" not in args:
        argv += ["--cache", "int:4"]
    return argv


# --------------------------------------------------------------------------- cache specs

# clauses the grammar must reject wherever they stand in a spec
BAD_CLAUSES = (
    "nosuch:4", "int:4,zz", "int:99", "int:", "int:4,,", ":", "medC", "kivi:2,g0",
    "kivi:2,g-1", "k=nosuch:2", "v=int:1", "k=", "K=int:4", "window=-1", "window=x",
    "window=1e3", "window=", "window=1.5", "sinks=-2", "sinks=", "sinks=0x4",
    "layers[]:k=bf16", "layers[x]:k=bf16", "layers[0:x]:k=bf16", "layers[0]:q=bf16",
    "layers[0]k=bf16", "layers[0]:k=", "layers[0]:k=nosuch", "layers[0]:k=int:1", "attn=",
    "attn=nosuch", "attn=reference,,xla", "colour=red", "=",
)
GOOD_EXTRAS = ("window=4", "sinks=2", "layers[0]:k=bf16", "attn=reference", "v=int:8")


def test_malformed_specs_on_every_command(capsys):
    """A registered codec's example spec with valid clauses and one bad clause, in a
    random order, given to a random command: a usage error before anything loads."""
    examples = [e.spec for cls in registered().values() for e in cls.examples]
    for index in range(example_count(60)):
        r = rng("cli-bad-spec", index)
        clauses = [str(r.choice(examples)),
                   *r.choice(GOOD_EXTRAS, size=r.integers(0, 3), replace=False)]
        clauses.insert(r.integers(0, len(clauses) + 1), str(r.choice(BAD_CLAUSES)))
        command = str(r.choice(list(COMMANDS)))
        usage_error(capsys, _with(command, "--cache", " ".join(clauses)),
                    "argument --cache/--codec: ")


def test_every_bad_clause_alone(capsys):
    for clause in BAD_CLAUSES:
        usage_error(capsys, [*PROBE, "--cache", f"int:4 {clause}"], "argument --cache/--codec")


# --------------------------------------------------------------------------- numbers

INVALID = {
    "count": ("0", "-1", "x", "1e3", "", "3.5", str(2**31), str(2**64)),
    "seed": ("-1", "x", "1e3", "3.5", str(2**63), str(-(2**63))),
    "temperature": ("-1", "nan", "inf", "-inf", "x"),
    "top-p": ("0", "1.5", "nan", "-0.1", "inf"),
    "depth": ("-0.1", "1.5", "nan", "inf", "x"),
}
OPTIONS = {
    "probe": {"--head-dim": "count", "--tokens": "count", "--heads": "count",
              "--queries": "count", "--seed": "seed"},
    "generate": {"--max-new-tokens": "count", "--prefill-chunk": "count", "--seed": "seed",
                 "--temperature": "temperature", "--top-p": "top-p"},
    "ppl": {"--windows": "count", "--window-len": "count", "--chunk": "count",
            "--seed": "seed"},
    "needle": {"--lengths": "count", "--trials": "count", "--batch-size": "count",
               "--seed": "seed", "--depths": "depth"},
}


def test_bad_numbers_on_every_command(capsys):
    """Every numeric option with values out of its range: rejected while parsing."""
    for index in range(example_count(60)):
        r = rng("cli-bad-number", index)
        command = str(r.choice(list(OPTIONS)))
        option = str(r.choice(list(OPTIONS[command])))
        value = str(r.choice(INVALID[OPTIONS[command][option]]))
        usage_error(capsys, _with(command, f"{option}={value}"), f"argument {option}: ")


def test_bad_command_lines(capsys):
    usage_error(capsys, [], "required: command")
    usage_error(capsys, ["nosuch"], "invalid choice: 'nosuch'")
    usage_error(capsys, ["codecs", "--json"], "unrecognized arguments: --json")
    usage_error(capsys, ["generate"], "give --prompt TEXT, or --resume DIR")
    usage_error(capsys, ["generate", "--prompt", " "], "the prompt is empty")
    usage_error(capsys, ["ppl"], "required: --cache")
    usage_error(capsys, [*PROBE, "--cache"], "expected one argument")


def test_sizes_too_large_for_one_array(capsys):
    big = str(2**31 - 1)
    usage_error(capsys, ["probe", "--tokens", big, "--heads", "2"], "more than 2147483647")
    usage_error(capsys, [*PROBE, "--queries", big, "--heads", "2"], "queries x heads")


# --------------------------------------------------------------------------- contexts


def test_windows_longer_than_the_context(capsys, tiny):
    """A cache window or sinks past the context: an error before any model loads (the
    default model's context comes from its header: 8192)."""
    for clause in ("window=17", "sinks=17"):
        usage_error(capsys, [*PROBE, "--cache", f"int:4 {clause}"],
                    "exceeds the probe's input of 16 tokens")
    # a count no cache could hold is refused by the spec itself, before it overflows
    usage_error(capsys, [*PROBE, "--cache", f"int:4 window={10**30}"],
                "is past the most tokens a cache spec names")
    for command in MODEL_COMMANDS:
        usage_error(capsys, _with(command, "--cache", "kivi:2,g32 window=9000"),
                    "cache window=9000 exceeds the model's context of 8192 tokens")
        usage_error(capsys, _with(command, "--cache", "int:4 sinks=300", "--model", tiny),
                    "cache sinks=300 exceeds the model's context of 256 tokens")
    usage_error(capsys, _with("ppl", "--window-len", "9000"), "exceed the model's context")
    usage_error(capsys, _with("needle", "--lengths", "9000"), "exceed the model's context")
    usage_error(capsys, _with("generate", "--max-new-tokens", "300", "--model", tiny),
                "exceeds max_position_embeddings=256")


# --------------------------------------------------------------------------- files


def _first_bytes(path: str, count: int, out) -> str:
    with open(path, "rb") as f:
        head = f.read(count)
    out.write_bytes(head)
    return str(out)


def test_missing_and_corrupt_model_files(capsys, tmp_path, tiny):
    """Every command that loads a model, given missing, foreign and cut files: the
    error names the file and what is wrong, before the weights are read."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "text.gguf").write_text("hello\n")
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "config.json").write_text("{")
    cases = [
        (str(tmp_path / "missing.gguf"), "missing.gguf: no such GGUF file"),
        (str(tmp_path / "dir"), "dir: a directory without config.json"),
        (str(tmp_path / "text.gguf"), "not a GGUF file: it starts with b'hell'"),
        (str(tmp_path / "empty.gguf"), "empty file, not a GGUF model"),
        (str(tmp_path / "notjson"), "config.json: not a JSON file"),
        ("no-such-model", "unknown model 'no-such-model'"),
    ]
    for index in range(example_count(3)):
        noise = tmp_path / f"noise{index}.gguf"
        noise.write_bytes(b"\0" + rng("cli-noise-gguf", index).bytes(4096))
        cases.append((str(noise), "not a GGUF file"))

    # the tiny model cut inside each section (offsets from gguf-py's reader)
    reader = gguf.GGUFReader(tiny)
    data_start = reader.data_offset
    for count in (2, 12, reader.fields["general.architecture"].offset + 10,
                  reader.fields["tokenizer.ggml.tokens"].offset + 100,
                  reader.tensors[0].field.offset + 5, data_start - 1, data_start + 100,
                  reader.tensors[-1].data_offset + reader.tensors[-1].n_bytes - 1):
        cut = _first_bytes(tiny, count, tmp_path / f"tiny{count}.gguf")
        cases.append((cut, "truncated file: "))

    # the embedded model cut inside its magic, header, metadata, tensor infos and data
    real = models.registered_path("smollm2-135m")
    real_start = read_layout(real).data_start
    for count, what in ((3, "the GGUF magic"), (20, "the header field count"),
                        (5000, "header field"), (real_start - 50, "of tensor"),
                        (real_start + 4096, "tensor 'token_embd.weight' needs bytes")):
        cut = _first_bytes(real, count, tmp_path / f"real{count}.gguf")
        cases.append((cut, f"{cut}: truncated file: "))
        cases.append((cut, what))

    for model, needle in cases:
        for command in MODEL_COMMANDS:
            usage_error(capsys, _with(command, "--model", model), needle)


def test_bad_data_files(capsys, tmp_path):
    """``probe --npy`` and ``--corpus`` with files that are missing, foreign or cut."""
    kv = np.ones((2, 16, 1, 16), np.float32)
    np.save(tmp_path / "kv.npy", kv)
    whole = (tmp_path / "kv.npy").read_bytes()
    files = {
        "cut.npy": (whole[:len(whole) - 100], "a malformed .npy file"),
        "header.npy": (whole[:20], "a malformed .npy file"),
        "empty.npy": (b"", "not a .npy file"),
        "text.npy": (b"1 2 3\n", "not a .npy file"),
        "noise.npy": (rng("cli-noise-npy", 0).bytes(500), "not a .npy file"),
    }
    for name, (content, needle) in files.items():
        (tmp_path / name).write_bytes(content)
        usage_error(capsys, [*PROBE, "--npy", str(tmp_path / name)], needle)
    np.savez(tmp_path / "kv.npz", kv=kv)
    np.save(tmp_path / "objects.npy", np.array([None, 1]), allow_pickle=True)
    np.save(tmp_path / "complex.npy", kv.astype(np.complex64))
    np.save(tmp_path / "flat.npy", kv.ravel())
    np.save(tmp_path / "none.npy", kv[:, :0])
    for name, needle in (("kv.npz", "an .npz archive"), ("objects.npy", "Object arrays"),
                         ("complex.npy", "expected real numbers, got dtype complex64"),
                         ("flat.npy", "expected an array [2, T, K, D] or [T, K, D]"),
                         ("none.npy", "need at least one token"),
                         ("missing.npy", "No such file"), (".", "Is a directory")):
        usage_error(capsys, [*PROBE, "--npy", str(tmp_path / name)], needle)

    (tmp_path / "latin1.txt").write_bytes("caf\xe9 " .encode("latin-1") * 50)
    for command in ("ppl", "needle"):
        usage_error(capsys, _with(command, "--corpus", str(tmp_path / "latin1.txt")),
                    "is not UTF-8 text")
        usage_error(capsys, _with(command, "--corpus", str(tmp_path / "none.txt")),
                    "unknown corpus")


# --------------------------------------------------------------------------- JSON


def test_probe_json_is_strict(capsys, tmp_path):
    """Nothing to measure (the window holds every token) is null; values far beyond
    float16, which bf16 stores, measure finite errors (or, for a codec that cannot store
    them, exit 2 with one line)."""
    rows = succeeds_with_json(capsys, [*PROBE, "--cache", "int:4 window=16", "--cache",
                                       "kivi:2,g16", "--json"])
    assert [r["cache"] for r in rows] == ["int:4 window=16", "kivi:2,g16"]
    assert rows[0]["bits_per_element_measured"] is None and rows[0]["rel_mse"] == 0
    assert rows[1]["bits_per_element_measured"] > 2 and rows[1]["rel_mse"] > 0

    kv = rng("cli-huge-kv", 0).standard_normal((2, 16, 1, 16)).astype(np.float32) * 1e30
    np.save(tmp_path / "huge.npy", kv)
    for spec in ("bf16", "int:4"):
        argv = [*PROBE, "--npy", str(tmp_path / "huge.npy"), "--cache", spec, "--json"]
        status, out, _ = run(capsys, argv)
        if status == 0:
            row = strict_json(out)
            if spec == "bf16":
                assert row["rel_mse"] < 1e-4 and row["attn_rel_err"] < 1e-2, row
        else:
            usage_error(capsys, argv)  # (re-run: the first run's stderr is consumed)


def test_model_commands_print_strict_json(capsys, tiny, tmp_path):
    """generate, ppl and needle on the tiny model print strict JSON; on a model file whose
    weights are not finite they print strict JSON or fail in one line."""
    out = succeeds_with_json(capsys, _with("generate", "--model", tiny, "--json", "--cache",
                                           "int:4 window=2"))
    assert len(out["tokens"]) == 2 and out["cache"] == "int:4 window=2"
    out = succeeds_with_json(capsys, _with("ppl", "--model", tiny, "--json"))
    assert out["ppl"] > 1 and out["window_len"] == 32
    rows = succeeds_with_json(capsys, _with("needle", "--model", tiny, "--json", "--cache",
                                            "int:4"))
    assert {r["cache"] for r in rows} == {"bf16", "int:4"} and len(rows) == 2

    broken = str(tiny_model(tmp_path / "inf.gguf", tokenizer=True, scale=np.inf))
    for command in ("generate", "ppl"):
        argv = _with(command, "--model", broken, "--json", "--cache", "bf16")
        status, text, _ = run(capsys, argv)
        if status == 0:
            strict_json(text)
        else:
            usage_error(capsys, argv)  # (re-run: the first run's stderr is consumed)


def test_strict_json_writes_null_for_what_is_not_finite():
    row = {"a": float("nan"), "b": [np.float32("inf"), np.int64(3), -np.inf],
           "c": np.array([1.5, np.nan]), "d": (np.bool_(True), None, "x")}
    assert strict_json_text(row) == (
        '{"a": null, "b": [null, 3, null], "c": [1.5, null], "d": [true, null, "x"]}')


def test_help_documents_the_json_rule(capsys):
    for command in COMMANDS:
        status, out, _ = run(capsys, [command, "--help"])
        assert status == 0 and "not finite are null" in " ".join(out.split())


def test_npy_with_a_header_longer_than_the_file(capsys, tmp_path):
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 16, 1, 16), }"
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    path = tmp_path / "short.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + b"\0" * 8)
    usage_error(capsys, [*PROBE, "--npy", str(path)], "a malformed .npy file")
