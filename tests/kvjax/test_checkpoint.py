"""Checkpoints on disk: compressed caches round-trip bit for bit; bad ones are refused."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import cache as kc
from kvjax import checkpoint as ck
from kvjax.centering import KeyCalibration
from kvjax.spec import parse_cache

SPECS = [
    "int:4",
    "kivi:2,g32 window=8 sinks=2",
    "hqmq:s96,r4,med3",
    "k=int:4 v=bf16 layers[1]:kv=int:2 center=first",
    "int:4 center=calib smooth=calib",
    "int:4 evict=streaming:16",
]
LAYERS, BATCH, HEADS, DIM, MAX_LEN, TOKENS = 2, 2, 2, 32, 48, 40


def _calibration(seed=0):
    rng = np.random.default_rng(seed)
    shape = (LAYERS, HEADS, DIM)
    return KeyCalibration(center=rng.standard_normal(shape),
                          rms=np.abs(rng.standard_normal(shape)) + 0.1, tokens=64)


def _filled(spec, valid=(TOKENS, 23)):
    """A cache of ``spec`` after one chunk of random K/V (rows of ``valid`` tokens)."""
    config = parse_cache(spec)
    cache = kc.init_cache(jax.random.key(7), config, num_layers=LAYERS, batch=BATCH,
                          num_kv_heads=HEADS, head_dim=DIM, max_len=MAX_LEN,
                          calibration=_calibration() if config.calibrated else None)
    rng = np.random.default_rng(1)
    shape = (BATCH, TOKENS, HEADS, DIM)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    step = kc.make_step(cache, TOKENS, jnp.asarray(valid, jnp.int32))
    for i in range(LAYERS):
        cache = cache.with_layer(i, kc.append(cache.layer(i), k, v, step))
    return kc.commit(cache, step)


def _assert_same_cache(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved ``int:4`` cache: ``(path, cache)``."""
    path = tmp_path_factory.mktemp("ck") / "int4"
    cache = _filled("int:4")
    ck.save_cache(path, cache, metadata={"model": "m1"}, extra={"note": jnp.arange(3)})
    return path, cache


@pytest.mark.parametrize("spec", SPECS)
def test_a_cache_comes_back_bit_for_bit_and_decodes_the_same(tmp_path, spec):
    cache = _filled(spec)
    written = ck.save_cache(tmp_path / "c", cache, metadata={"model": "m"})
    back, extra, metadata = ck.load_cache(tmp_path / "c", expect={"model": "m"})
    _assert_same_cache(cache, back)
    assert back.config == cache.config and extra == {}
    assert metadata["cache"] == ck.cache_layout(cache)
    assert written == ck.disk_bytes(tmp_path / "c") > 0
    for i in range(LAYERS):
        for role in ("k", "v"):
            before = kc.dense(getattr(cache.layer(i), role), cache.lengths)
            after = kc.dense(getattr(back.layer(i), role), back.lengths)
            np.testing.assert_array_equal(np.asarray(before), np.asarray(after))


def test_extra_arrays_and_the_record(saved):
    path, cache = saved
    _, extra, metadata = ck.load_cache(path)
    np.testing.assert_array_equal(extra["note"], [0, 1, 2])
    assert metadata == {"model": "m1", "cache": ck.cache_layout(cache)}
    record = json.loads((path / ck.METADATA_FILE).read_text())
    assert record["format"] == ck.FORMAT and record["kvjax"] == kvjax.__version__
    assert {"git", "code", "versions"} <= set(record["provenance"])
    assert record["metadata"]["model"] == "m1"
    names = ck.cache_arrays(cache)
    assert {f"cache{n}" for n in names} | {"extra/note"} == set(record["arrays"])


def test_arrays_without_elements_are_recorded_not_stored(tmp_path):
    arrays = {"empty": np.zeros((0, 3), np.float32), "full": np.ones((2,), np.int8)}
    ck.save_arrays(tmp_path / "a", arrays, {}, kind="test")
    back, _ = ck.load_arrays(tmp_path / "a", kind="test")
    assert back["empty"].shape == (0, 3) and back["empty"].dtype == np.float32
    np.testing.assert_array_equal(back["full"], [1, 1])


def test_an_existing_directory_is_kept_unless_overwritten(tmp_path, saved):
    _, cache = saved
    (tmp_path / "c").mkdir()
    with pytest.raises(FileExistsError, match="overwrite"):
        ck.save_cache(tmp_path / "c", cache)
    ck.save_cache(tmp_path / "c", cache, overwrite=True)
    ck.load_cache(tmp_path / "c")


def test_only_a_checkpoint_or_an_empty_directory_is_ever_replaced(tmp_path, saved):
    _, cache = saved
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    (tmp_path / "notes.txt").write_text("keep me")
    for target in (mine, tmp_path / "notes.txt"):
        with pytest.raises(FileExistsError, match="not a kvjax checkpoint: it is not "
                                                   "replaced"):
            ck.save_cache(target, cache, overwrite=True)
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    # a checkpoint is replaced by the new one, and nothing is left beside it
    ck.save_cache(tmp_path / "c", cache, metadata={"model": "a"})
    ck.save_cache(tmp_path / "c", cache, metadata={"model": "b"}, overwrite=True)
    assert ck.read_metadata(tmp_path / "c", kind=ck.CACHE_KIND)["metadata"]["model"] == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "mine", "notes.txt"]


@pytest.mark.parametrize("where", ["", "  ", ".", "..", "HOME"])
def test_the_working_and_home_directories_are_refused(tmp_path, saved, monkeypatch, where):
    _, cache = saved
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    (work / "data.csv").write_text("1,2")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"must not be empty|working directory"):
        ck.save_cache(str(tmp_path / "a") if where == "HOME" else where, cache,
                      overwrite=True)
    assert (work / "data.csv").read_text() == "1,2"


def test_a_failed_save_leaves_the_old_checkpoint(tmp_path, saved, monkeypatch):
    _, cache = saved
    ck.save_cache(tmp_path / "c", cache, metadata={"model": "old"})

    def broken(*args, **kwargs):
        raise OSError("disk full")

    import kvjax.eval.provenance as prov

    monkeypatch.setattr(prov, "provenance", broken)  # fails after the arrays are written
    with pytest.raises(OSError, match="disk full"):
        ck.save_cache(tmp_path / "c", cache, metadata={"model": "new"}, overwrite=True)
    assert ck.read_metadata(tmp_path / "c", kind=ck.CACHE_KIND)["metadata"]["model"] == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_key_calibration_file_is_written_as_named_and_never_empty(tmp_path):
    calib = KeyCalibration(center=np.zeros((1, 2, 4), np.float32),
                           rms=np.ones((1, 2, 4), np.float32), tokens=3)
    calib.save(tmp_path / "k")  # no suffix added
    assert KeyCalibration.load(tmp_path / "k").tokens == 3
    for bad, match in (("", "must not be empty"), (tmp_path, "is a directory")):
        with pytest.raises(ValueError, match=match):
            calib.save(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]


def test_a_path_orbax_would_read_as_a_pattern_is_refused(tmp_path, saved):
    with pytest.raises(ValueError, match="must not contain"):
        ck.save_cache(tmp_path / "layers[0]", saved[1])


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(format=ck.FORMAT + 1), "format"),
    (lambda r: r.update(kind="codec-params"), "not a 'kv-cache'"),
    (lambda r: r.update(kvjax="0.0.1"), "kvjax 0.0.1"),
    (lambda r: r["metadata"]["cache"].update(spec="int:2"), "does not build|needs"),
    (lambda r: r["metadata"]["cache"].update(head_dim=DIM * 2), "needs"),
    (lambda r: r["arrays"].pop("cache.lengths"), "missing"),
])
def test_a_record_that_does_not_fit_is_refused(tmp_path, saved, change, message):
    path = tmp_path / "c"
    ck.save_cache(path, saved[1])
    record = json.loads((path / ck.METADATA_FILE).read_text())
    change(record)
    (path / ck.METADATA_FILE).write_text(json.dumps(record))
    with pytest.raises(ck.CheckpointError, match=message):
        ck.load_cache(path)


def test_another_model_is_refused(saved):
    with pytest.raises(ck.CheckpointError, match="model: checkpoint has 'm1', expected 'm2'"):
        ck.load_cache(saved[0], expect={"model": "m2"})


def test_an_unfinished_save_is_refused(tmp_path, saved):
    path = tmp_path / "c"
    ck.save_cache(path, saved[1])
    (path / ck.METADATA_FILE).unlink()
    with pytest.raises(ck.CheckpointError, match="not a finished"):
        ck.load_cache(path)
    with pytest.raises(ck.CheckpointError, match="no checkpoint directory"):
        ck.load_cache(tmp_path / "nowhere")
    (path / ck.METADATA_FILE).write_text("{not json")
    with pytest.raises(ck.CheckpointError, match="unreadable"):
        ck.load_cache(path)


def _data_files(path):
    files = [f for f in (path / ck.ARRAYS_DIR).rglob("*") if f.is_file() and "/d/" in str(f)]
    assert files
    return sorted(files, key=lambda f: -f.stat().st_size)


# orbax's reader threads report the damaged file a second time, as unraisable exceptions
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_truncated_checkpoint_is_refused(tmp_path, saved):
    path = tmp_path / "c"
    ck.save_cache(path, saved[1])
    for f in _data_files(path):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ck.CheckpointError, match="corrupt"):
        ck.load_cache(path)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_changed_byte_never_restores_a_different_cache(tmp_path, saved):
    """A flipped byte is refused, or it lies where nothing read depends on it (orbax's
    files hold more than the arrays): the restored cache is then the saved one."""
    path = tmp_path / "c"
    ck.save_cache(path, saved[1])
    largest = _data_files(path)[0]
    data = largest.read_bytes()
    refused = 0
    for at in np.linspace(0, len(data) - 1, 12).astype(int):
        bad = bytearray(data)
        bad[at] ^= 0x5A
        largest.write_bytes(bytes(bad))
        try:
            back, _, _ = ck.load_cache(path)
        except ck.CheckpointError as err:
            assert "corrupt" in str(err)
            refused += 1
        else:
            _assert_same_cache(saved[1], back)
    assert refused >= 6
    largest.write_bytes(data)
    _assert_same_cache(saved[1], ck.load_cache(path)[0])


def test_a_corrupt_data_file_is_one_line_and_nothing_else_on_stderr(tmp_path, saved):
    import subprocess
    import sys

    path, _ = saved
    copy = tmp_path / "c"
    shutil.copytree(path, copy)
    data = max(_data_files(copy), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3: len(raw) // 3 + 16] = bytes(b ^ 0xFF for b in raw[len(raw) // 3:
                                                                         len(raw) // 3 + 16])
    data.write_bytes(bytes(raw))
    # a process of its own: tensorstore's late tracebacks come from its threads
    code = ("from kvjax.checkpoint import load_cache\n"
            f"try:\n    load_cache({str(copy)!r})\n"
            "except ValueError as err:\n    print(type(err).__name__)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.stdout.strip() == "CheckpointError", (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr and "Event loop" not in run.stderr, run.stderr
