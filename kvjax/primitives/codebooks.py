"""Data-free codebooks built once and kept on disk.

Lloyd-Max codebooks depend only on a density and a bit width, never on data, but
designing one takes up to a second; :func:`lloyd_codebook` designs it once per machine
and keeps it as an ``.npz`` file in :func:`codebook_dir` (``$KVJAX_CODEBOOKS``, else
``~/.cache/kvjax/codebooks``). Files are written to a temporary name and renamed, so
concurrent processes never read half a file; a corrupt or foreign file is designed again.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import numpy as np

from kvjax.primitives.lloyd import Density, LloydMaxQuantizer, lloyd_max


def codebook_dir() -> Path:
    """Where codebooks live: ``$KVJAX_CODEBOOKS``, else ``~/.cache/kvjax/codebooks``."""
    env = os.environ.get("KVJAX_CODEBOOKS")
    return Path(env) if env else Path.home() / ".cache" / "kvjax" / "codebooks"


def _file_name(density: Density, bits: int) -> str:
    params = "-".join(repr(p) for p in density.params)
    text = f"lloyd-{density.name}-{params}-{density.lo!r}-{density.hi!r}-b{bits}"
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text) + ".npz"


@functools.cache
def lloyd_codebook(density: Density, bits: int) -> LloydMaxQuantizer:
    """:func:`kvjax.primitives.lloyd.lloyd_max` of ``(density, bits)`` at its default accuracy,
    read from the disk cache when designed before (and memoized in the process)."""
    if density.name == "custom":  # a custom pdf is known by name only: never cache it
        return lloyd_max(density, bits)
    path = codebook_dir() / _file_name(density, bits)
    try:
        with np.load(path) as f:
            q = LloydMaxQuantizer(f["centroids"], f["thresholds"], float(f["mse"]),
                                  int(f["iterations"]), bool(f["converged"]))
        if q.centroids.shape == (2**bits,) and q.thresholds.shape == (2**bits - 1,):
            q.centroids.setflags(write=False)
            q.thresholds.setflags(write=False)
            return q
    except (OSError, KeyError, ValueError):
        pass
    q = lloyd_max(density, bits)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, centroids=q.centroids, thresholds=q.thresholds, mse=q.mse,
                     iterations=q.iterations, converged=q.converged)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home still gets the codebook, designed each run
    return q


def clear_memo() -> None:
    """Forget the in-process copies (the files stay)."""
    lloyd_codebook.cache_clear()
