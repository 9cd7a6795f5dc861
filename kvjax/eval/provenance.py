"""Where a result came from: the code, the library versions, the device and the command.

Every results file that a script writes carries :func:`provenance` under the key
:data:`KEY`, so a number can be traced back to the commit and machine that produced it.
A checkout whose commit is not the code it runs (a copy of a working tree with commits
its ``.git`` does not hold reports its last commit ``+dirty``) is still identified by
:func:`code_digest`, which any commit's tree reproduces:
``python -m kvjax.eval.provenance COMMIT`` prints it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import platform
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

#: the key under which results files store :func:`provenance`
KEY = "provenance"

#: the distributions whose versions are recorded
PACKAGES = ("jax", "jaxlib", "flax", "numpy", "kvjax")
#: the code that produces results: every ``.py`` under these folders, and the pins
CODE = ("kvjax", "models", "pallas_kernels", "experiments", "pyproject.toml")
#: the repository root (the folder holding the ``kvjax`` package)
ROOT = Path(__file__).resolve().parents[2]


def code_digest(root: str | Path | None = None) -> str:
    """16 hex digits of SHA-256 over the path and bytes of every file of :data:`CODE`
    under ``root`` (default: this checkout), in path order: the same for any two trees
    whose result-producing code is the same, whatever their git state."""
    root = Path(root) if root is not None else ROOT
    files = []
    for name in CODE:
        path = root / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [f for f in path.rglob("*.py") if "__pycache__" not in f.parts]
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.relative_to(root).as_posix()):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0")
        digest.update(f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def commit_code_digest(commit: str, repo: str | Path | None = None) -> str:
    """:func:`code_digest` of ``commit``'s tree (``git archive``; raises
    ``subprocess.CalledProcessError`` for an unknown commit)."""
    repo = Path(repo) if repo is not None else ROOT
    # the whole tree: a path of CODE that the commit lacks would fail a pathspec
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=repo,
                             capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        return code_digest(tmp)


def git_sha(path: str | Path | None = None) -> str | None:
    """The commit of the checkout holding ``path`` (default: kvjax's own source), with
    ``+dirty`` when tracked files differ from it; None outside a git checkout."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=where, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty.strip() else "")


def versions() -> dict[str, str | None]:
    """Python's version and those of :data:`PACKAGES` (None where not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def device() -> dict:
    """JAX's default backend, the kind of its first device and the device count."""
    import jax

    devices = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind,
            "count": len(devices), "machine": platform.platform()}


def timestamp() -> str:
    """The local time, ISO 8601 with the UTC offset."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def provenance(argv: Sequence[str] | None = None) -> dict:
    """``{"git", "code", "versions", "device", "command", "time"}`` of this process.

    ``git`` is :func:`git_sha` of kvjax's checkout, ``code`` its :func:`code_digest`,
    ``command`` the command line (``argv``, default ``sys.argv``, shell-quoted).
    """
    argv = sys.argv if argv is None else argv
    return {"git": git_sha(), "code": code_digest(), "versions": versions(),
            "device": device(), "command": shlex.join(["python", *argv]),
            "time": timestamp()}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvjax.eval.provenance [COMMIT ...]``: the code digest of this checkout,
    or of each commit."""
    commits = list(sys.argv[1:] if argv is None else argv)
    if not commits:
        print(code_digest())
        return 0
    for commit in commits:
        try:
            print(f"{commit} {commit_code_digest(commit)}")
        except subprocess.CalledProcessError as err:
            print(f"provenance: {commit}: {err.stderr.decode().strip()}", file=sys.stderr)
            return 2
    return 0


__all__ = ["KEY", "code_digest", "commit_code_digest", "device", "git_sha", "provenance",
           "timestamp", "versions"]


if __name__ == "__main__":
    sys.exit(main())
