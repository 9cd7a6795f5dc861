"""Arrays on disk with orbax-checkpoint, checked on the way back: compressed caches.

A checkpoint is a directory: ``arrays/`` (an orbax checkpoint of a flat dict of named
arrays) and ``kvjax.json``, written last, so a directory without it is an unfinished
save. The JSON holds :data:`FORMAT`, the ``kind`` of checkpoint, the kvjax version,
:func:`kvjax.eval.provenance.provenance` (git SHA, library versions, device, command),
the caller's metadata, and every array's shape, dtype and SHA-256. Reading back
(:func:`load_arrays`) refuses, with a :class:`CheckpointError` that says why, a
directory that is not a finished checkpoint, another format, kind or kvjax version,
metadata that differs from what the reader expects (another model, cache spec or shape),
and arrays that orbax cannot read (truncated files) or whose bytes differ from the
recorded digests (corruption). A checkpoint never restores silently wrong.

Compressed caches (:func:`save_cache`, :func:`load_cache`) store every array of the
:class:`kvjax.cache.KVCache` pytree (packed codes, codec parameters, raw tokens, lengths,
flags) and rebuild the pytree's static part from the recorded cache spec and shape.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.cache import KVCache, init_cache
from kvjax.centering import KeyCalibration
from kvjax.spec import parse_cache

#: the layout version of a checkpoint directory; another one is refused on reading
FORMAT = 1
#: the file that describes a checkpoint, written after its arrays
METADATA_FILE = "kvjax.json"
ARRAYS_DIR = "arrays"
#: :func:`save_cache`'s kind
CACHE_KIND = "kv-cache"


class CheckpointError(ValueError):
    """A checkpoint that is unfinished, corrupt, or not the one the reader expects."""


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _dtype_name(dtype: Any) -> str:
    return jnp.dtype(dtype).name


#: characters that orbax reads as a glob pattern in a checkpoint's path (and then misses
#: its own files)
_GLOB = set("[]*?")


def _checked_path(path: str | Path) -> Path:
    path = Path(path)
    if _GLOB & set(str(path.absolute())):
        raise ValueError(f"{path}: a checkpoint path must not contain any of "
                         f"{''.join(sorted(_GLOB))} (orbax reads them as a pattern)")
    return path


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory that holds a kvjax checkpoint and nothing else (a
    finished one, or the arrays an interrupted save left), or nothing at all: what
    :func:`save_arrays` may replace."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        return False
    names = {entry.name for entry in path.iterdir()}
    if not names <= {METADATA_FILE, ARRAYS_DIR}:
        return False
    if METADATA_FILE in names:
        try:
            record = json.loads((path / METADATA_FILE).read_text())
        except (OSError, ValueError):
            return False
        return isinstance(record, dict) and {"format", "kind", "arrays"} <= set(record)
    return True


def _writable_target(path: Path, overwrite: bool) -> None:
    """Refuse a path whose replacement would take what is not a checkpoint: the working
    directory or one above it, a file, a directory of other files."""
    text = str(path)
    if not text.strip():
        raise ValueError("a checkpoint path must not be empty")
    here = Path.cwd().resolve()
    target = path.resolve()
    if target == here or target in here.parents or target == Path.home().resolve():
        raise ValueError(f"{text!r} is the working directory, a directory above it or the "
                         "home directory: name a checkpoint directory of its own")
    if not path.exists() and not path.is_symlink():
        return
    if not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    if not is_checkpoint_dir(path):
        raise FileExistsError(f"{path} holds what is not a kvjax checkpoint: it is not "
                              "replaced (name another path, or remove it yourself)")


def save_arrays(path: str | Path, arrays: Mapping[str, Any], metadata: Mapping[str, Any],
                *, kind: str, overwrite: bool = False) -> int:
    """Write ``arrays`` (name -> array) and ``metadata`` (JSON values) as a checkpoint
    of ``kind`` in the directory ``path``; returns its bytes on disk.

    An existing ``path`` is refused unless ``overwrite``, and even then unless it is a
    kvjax checkpoint or an empty directory (:func:`is_checkpoint_dir`): nothing else is
    ever deleted. The empty path, the working directory, one above it and the home
    directory are refused. The checkpoint is written beside ``path`` first and renamed
    into place, so an interrupted save leaves what was there. Arrays of no elements are
    recorded by shape and dtype only (orbax stores none).
    """
    import orbax.checkpoint as ocp

    from kvjax.eval.provenance import provenance

    _writable_target(Path(path), overwrite)
    path = _checked_path(path)
    host = {name: np.asarray(jax.device_get(a)) for name, a in arrays.items()}
    described = {name: {"shape": list(a.shape), "dtype": _dtype_name(a.dtype),
                        "sha256": _digest(a)} for name, a in host.items()}
    stored = {name: a for name, a in host.items() if a.size}
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".saving",
                                    dir=path.parent))
    try:
        if stored:
            checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
            checkpointer.save((staging / ARRAYS_DIR).absolute(),
                              args=ocp.args.StandardSave(stored))
        record = {"format": FORMAT, "kind": kind, "kvjax": kvjax.__version__,
                  "provenance": provenance(), "metadata": dict(metadata),
                  "arrays": described}
        (staging / METADATA_FILE).write_text(json.dumps(record, indent=1, sort_keys=True)
                                             + "\n")
        _replace(path, staging)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return disk_bytes(path)


def _replace(path: Path, staging: Path) -> None:
    """Put the finished ``staging`` directory at ``path``, the checkpoint there (if any)
    moved aside first and removed only once the new one is in place."""
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".replaced",
                                    dir=path.parent))
        os.replace(path, old / path.name)
    try:
        os.replace(staging, path)
    except OSError:
        if old is not None:
            os.replace(old / path.name, path)
        raise
    finally:
        if old is not None and old.exists():
            shutil.rmtree(old)


def read_metadata(path: str | Path, *, kind: str) -> dict:
    """The ``kvjax.json`` record of the checkpoint at ``path`` (keys ``format``,
    ``kind``, ``kvjax``, ``provenance``, ``metadata``, ``arrays``), checked to be a
    finished checkpoint of ``kind`` in this format and kvjax version."""
    path = _checked_path(path)
    file = path / METADATA_FILE
    if not path.is_dir():
        raise CheckpointError(f"{path}: no checkpoint directory there")
    if not file.is_file():
        raise CheckpointError(f"{path}: not a finished kvjax checkpoint (no {METADATA_FILE}; "
                              "an interrupted save leaves none)")
    try:
        record = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: unreadable ({err})") from err
    if not isinstance(record, dict) or not {"format", "kind", "arrays"} <= set(record):
        raise CheckpointError(f"{file}: not a kvjax checkpoint description")
    if record["format"] != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {record['format']}, this kvjax "
                              f"reads format {FORMAT}")
    if record["kind"] != kind:
        raise CheckpointError(f"{path}: a '{record['kind']}' checkpoint, not a '{kind}' one")
    if record.get("kvjax") != kvjax.__version__:
        raise CheckpointError(f"{path}: written by kvjax {record.get('kvjax')}, this is "
                              f"kvjax {kvjax.__version__}; codes are only read by the "
                              "version that wrote them")
    _check_record(file, record)
    return record


def _check_record(file: Path, record: dict) -> None:
    """A :class:`CheckpointError` naming the first field of ``record`` that is not what
    :func:`save_arrays` writes (an edited or damaged description)."""
    def wrong(what: str) -> CheckpointError:
        return CheckpointError(f"{file}: {what}: the description was edited or damaged")

    if not isinstance(record.get("metadata"), dict):
        raise wrong("'metadata' is not a mapping")
    if not isinstance(record["arrays"], dict):
        raise wrong("'arrays' is not a mapping of names to descriptions")
    for name, d in record["arrays"].items():
        if not isinstance(d, dict) or set(d) != {"shape", "dtype", "sha256"}:
            raise wrong(f"array '{name}' is not described by shape, dtype and sha256")
        shape = d["shape"]
        if not isinstance(shape, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**40
                for n in shape):
            raise wrong(f"array '{name}' has the shape {shape!r}")
        try:
            if not isinstance(d["dtype"], str):
                raise TypeError
            jnp.dtype(d["dtype"])
        except (TypeError, ValueError):
            raise wrong(f"array '{name}' has the dtype {d['dtype']!r}") from None
        digest = d["sha256"]
        if not (isinstance(digest, str) and len(digest) == 64
                and all(c in "0123456789abcdef" for c in digest)):
            raise wrong(f"array '{name}' has no SHA-256 digest")


def check_expected(path: str | Path, metadata: Mapping[str, Any],
                   expect: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointError` naming every key of ``expect`` whose value differs
    from the checkpoint's ``metadata``."""
    wrong = [f"{key}: checkpoint has {metadata.get(key)!r}, expected {value!r}"
             for key, value in expect.items() if metadata.get(key) != value]
    if wrong:
        raise CheckpointError(f"{path}: not a checkpoint for this use ({'; '.join(wrong)})")


def load_arrays(path: str | Path, *, kind: str, expect: Mapping[str, Any] | None = None,
                record: dict | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays, record)`` of the checkpoint at ``path``: every array, read back and
    checked against its recorded shape, dtype and SHA-256, and the :func:`read_metadata`
    record, whose ``metadata`` must agree with ``expect`` where ``expect`` names a key.
    ``record``: the :func:`read_metadata` record a caller has already read."""
    import orbax.checkpoint as ocp

    record = read_metadata(path, kind=kind) if record is None else record
    check_expected(path, record["metadata"], expect or {})
    described = record["arrays"]
    template = {name: jax.ShapeDtypeStruct(tuple(d["shape"]), jnp.dtype(d["dtype"]))
                for name, d in described.items() if int(np.prod(d["shape"]))}
    restored = {}
    if template:
        checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        try:
            with _stderr_hushed_on_failure():
                restored = checkpointer.restore((Path(path) / ARRAYS_DIR).absolute(),
                                                args=ocp.args.StandardRestore(template))
        except Exception as err:  # orbax and tensorstore raise many types for a bad file
            why = " ".join(str(err).split())[:300]
            raise CheckpointError(f"{path}: the arrays cannot be read, the checkpoint is "
                                  f"truncated or corrupt ({type(err).__name__}: "
                                  f"{why})") from err
        finally:
            checkpointer.close()
    arrays = {}
    for name, d in described.items():
        shape, dtype = tuple(d["shape"]), jnp.dtype(d["dtype"])
        array = np.asarray(restored[name]) if name in restored else np.zeros(shape, dtype)
        if array.shape != shape or array.dtype != dtype or _digest(array) != d["sha256"]:
            raise CheckpointError(f"{path}: array '{name}' differs from the one saved "
                                  "(its SHA-256 does not match): the checkpoint is corrupt")
        arrays[name] = array
    return arrays, record


#: seconds a failed read waits, its output hushed, for tensorstore's reads in flight
FAILED_READ_SETTLE_S = 0.5


@contextlib.contextmanager
def _stderr_hushed_on_failure():
    """Runs the block with stderr (the file descriptor and ``sys.stderr``) kept aside: on
    success what was written there is passed on; on failure it is dropped, after
    :data:`FAILED_READ_SETTLE_S` seconds in which tensorstore's reads still in flight end.
    Those reads' callbacks find orbax's event loop closed and print tracebacks from
    their threads ("Event loop is closed"), after and around the one line the failure
    becomes."""
    sys.stderr.flush()
    saved_fd, saved = os.dup(2), sys.stderr
    with tempfile.TemporaryFile(mode="w+b") as kept:
        os.dup2(kept.fileno(), 2)
        sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(2), "wb"), write_through=True)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            time.sleep(FAILED_READ_SETTLE_S)
            raise
        finally:
            sys.stderr.close()
            sys.stderr = saved
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            if not failed:
                kept.seek(0)
                text = kept.read().decode(errors="replace")
                if text:
                    saved.write(text)


def disk_bytes(path: str | Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# -- compressed caches -----------------------------------------------------------------


def cache_layout(cache: KVCache) -> dict[str, Any]:
    """What rebuilds ``cache``'s pytree structure: the canonical cache spec, layers,
    rows, kv heads, head dim, capacity and the dtype of raw tokens."""
    raw = cache.segments[0].k.raw
    return {"spec": cache.config.spec, "num_layers": cache.num_layers,
            "batch": cache.batch, "num_kv_heads": int(raw.shape[2]),
            "head_dim": int(raw.shape[-1]), "max_len": cache.max_len,
            "dtype": _dtype_name(raw.dtype)}


class _ShapesOnly:
    """Stands in for fitted codec parameters where only a cache's shapes matter (the
    stored cache holds its parameters)."""

    @staticmethod
    def layer_params(role, layer, codec, num_kv_heads, head_dim):
        del role, layer
        keys = jax.random.split(jax.random.PRNGKey(0), num_kv_heads)
        return jax.vmap(lambda k: codec.init(k, head_dim))(keys)


def _cache_structure(layout: Mapping[str, Any]) -> KVCache:
    """An abstract cache (leaves are ``ShapeDtypeStruct``) of ``layout``."""
    config = parse_cache(layout["spec"])
    shape = (layout["num_layers"], layout["num_kv_heads"], layout["head_dim"])
    # the values of a calibration do not shape the cache; zeros stand in for them
    calibration = (KeyCalibration(center=np.zeros(shape), rms=np.zeros(shape), tokens=0)
                   if config.calibrated else None)
    return jax.eval_shape(lambda: init_cache(
        jax.random.PRNGKey(0), config, num_layers=layout["num_layers"],
        batch=layout["batch"], num_kv_heads=layout["num_kv_heads"],
        head_dim=layout["head_dim"], max_len=layout["max_len"],
        dtype=jnp.dtype(layout["dtype"]), calibration=calibration,
        fitted=_ShapesOnly() if config.needs_fit else None))


def cache_arrays(cache: KVCache) -> dict[str, jax.Array]:
    """Every array of ``cache`` by its pytree path (``segments[0].k.codes['q']``)."""
    leaves = jax.tree_util.tree_flatten_with_path(cache)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def save_cache(path: str | Path, cache: KVCache, *, metadata: Mapping[str, Any] | None = None,
               extra: Mapping[str, Any] | None = None, overwrite: bool = False) -> int:
    """Write ``cache`` (every packed array as stored, nothing decoded) to the directory
    ``path``; returns its bytes on disk. ``metadata``: JSON values that a reader can
    require (:func:`load_cache`'s ``expect``), e.g. the model the cache belongs to;
    ``extra``: more named arrays kept with it (``extra/NAME``)."""
    arrays = {f"cache{name}": a for name, a in cache_arrays(cache).items()}
    arrays.update({f"extra/{name}": a for name, a in (extra or {}).items()})
    meta = {**(metadata or {}), "cache": cache_layout(cache)}
    return save_arrays(path, arrays, meta, kind=CACHE_KIND, overwrite=overwrite)


def load_cache(path: str | Path, *, expect: Mapping[str, Any] | None = None
               ) -> tuple[KVCache, dict[str, jax.Array], dict]:
    """``(cache, extra, metadata)`` from a directory :func:`save_cache` wrote: the cache
    exactly as saved, the extra arrays, and the caller's metadata (with ``cache``, the
    layout). ``expect``: metadata values the checkpoint must have (a
    :class:`CheckpointError` otherwise, as for any unfinished or corrupt checkpoint)."""
    record = read_metadata(path, kind=CACHE_KIND)
    metadata = record["metadata"]
    check_expected(path, metadata, expect or {})
    try:
        structure = _cache_structure(metadata["cache"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: the cache layout {metadata.get('cache')!r} does not "
                              f"build a cache ({err})") from err
    # the recorded arrays are checked against the layout before any is read, so a
    # mismatch is named rather than reported as an unreadable file
    names = {f"cache{name}": leaf for name, leaf in cache_arrays(structure).items()}
    described = {name: d for name, d in record["arrays"].items() if name.startswith("cache")}
    if set(described) != set(names):
        raise CheckpointError(f"{path}: the stored arrays are not those of a "
                              f"'{metadata['cache']['spec']}' cache of this kvjax "
                              f"(missing {sorted(set(names) - set(described))[:3]}, unknown "
                              f"{sorted(set(described) - set(names))[:3]})")
    for name, leaf in names.items():
        shape, dtype = tuple(described[name]["shape"]), jnp.dtype(described[name]["dtype"])
        if (shape, dtype) != (leaf.shape, leaf.dtype):
            raise CheckpointError(f"{path}: array '{name}' is {dtype}{list(shape)}, the "
                                  f"layout needs {leaf.dtype}{list(leaf.shape)}")
    arrays, _ = load_arrays(path, kind=CACHE_KIND, record=record)
    treedef = jax.tree.structure(structure)
    cache = jax.tree.unflatten(treedef, [jnp.asarray(arrays[name]) for name in names])
    extra = {name[len("extra/"):]: jnp.asarray(a) for name, a in arrays.items()
             if name.startswith("extra/")}
    return cache, extra, metadata


__all__ = ["ARRAYS_DIR", "CACHE_KIND", "FORMAT", "METADATA_FILE", "CheckpointError",
           "cache_arrays", "cache_layout", "check_expected", "disk_bytes", "load_arrays",
           "load_cache", "read_metadata", "save_arrays", "save_cache"]
