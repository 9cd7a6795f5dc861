"""Where a result came from: the code, the library versions, the device and the command.

Every results file that a script writes carries :func:`provenance` under the key
:data:`KEY`, so a number can be traced back to the commit and machine that produced it.
"""

from __future__ import annotations

import importlib.metadata
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

#: the key under which results files store :func:`provenance`
KEY = "provenance"

#: the distributions whose versions are recorded
PACKAGES = ("jax", "jaxlib", "flax", "numpy", "kvjax")


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
    """``{"git", "versions", "device", "command", "time"}`` of this process.

    ``git`` is :func:`git_sha` of kvjax's checkout, ``command`` the command line
    (``argv``, default ``sys.argv``, shell-quoted).
    """
    argv = sys.argv if argv is None else argv
    return {"git": git_sha(), "versions": versions(), "device": device(),
            "command": shlex.join(["python", *argv]), "time": timestamp()}


__all__ = ["KEY", "device", "git_sha", "provenance", "timestamp", "versions"]
