"""JAX's persistent compilation cache, on by default for the CLI and the experiments.

XLA compiles every jitted program anew in each process: the CLI's prefill and decode
loop, a sweep's model per cache layout. JAX can keep the compiled programs on disk and
load them in later processes instead (its persistent compilation cache); this module
turns that on for ``python -m kvjax`` and the scripts in ``experiments/``.

Where the programs go (:func:`cache_directory`): ``$KVJAX_COMPILE_CACHE`` when set, else
JAX's own ``jax_compilation_cache_dir`` (``$JAX_COMPILATION_CACHE_DIR``) when set, else
:data:`DEFAULT_DIRECTORY` (``~/.cache/kvjax/jax-compile``). ``KVJAX_COMPILE_CACHE=off``
(or ``none``) and the ``--no-compile-cache`` flag leave JAX's settings as they are (by
default: no persistent cache). Every program is stored, however quickly it compiled and
however small. The directory only grows: delete it to reclaim the space (JAX recompiles
what is missing). JAX treats the directory as trusted code: keep it private.

``enable_compile_cache`` is a library call; :func:`add_argument` and :func:`from_args`
give a command line its ``--no-compile-cache`` flag and the call.
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path
from typing import Any

#: the environment variable that names the directory, or turns the cache off
ENV = "KVJAX_COMPILE_CACHE"
#: values of :data:`ENV` that turn the cache off (any case)
OFF = ("off", "none")
#: where the programs go when neither :data:`ENV` nor JAX's own setting names a directory
DEFAULT_DIRECTORY = Path("~") / ".cache" / "kvjax" / "jax-compile"
#: the flag of :func:`add_argument`
FLAG = "--no-compile-cache"

#: JAX options set with the directory: store every program, whatever it took to compile
#: (JAX's default floor is 1 s) and whatever its size (-1: no floor, and none that JAX
#: would choose for the file system); an option this JAX lacks is skipped
THRESHOLDS = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


def cache_directory() -> Path | None:
    """The directory :func:`enable_compile_cache` uses when given none, or None when
    :data:`ENV` turns the cache off."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in OFF:
        return None
    if value:
        return Path(value).expanduser()
    import jax

    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return Path(configured).expanduser()
    return DEFAULT_DIRECTORY.expanduser()


def enable_compile_cache(directory: str | os.PathLike | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at ``directory`` (created if missing;
    default: :func:`cache_directory`) and store every program there; returns the
    directory, or None when ``directory`` is None and :data:`ENV` turns the cache off
    (then nothing changes). Raises ``OSError`` when the directory cannot be created.
    Programs compiled before the call are not stored."""
    path = cache_directory() if directory is None else Path(directory).expanduser()
    if path is None:
        return None
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)

    import jax

    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(path))
    for name, value in THRESHOLDS.items():
        try:
            jax.config.update(name, value)
        except AttributeError:  # an option this JAX does not have
            pass
    if previous != str(path):
        _reset()
    return path


def _reset() -> None:
    """Drop JAX's handle on the cache, so the next compilation opens the new directory
    (JAX opens it once per process)."""
    try:
        from jax.experimental.compilation_cache import compilation_cache
    except ImportError:  # pragma: no cover - every supported JAX has it
        return
    reset = getattr(compilation_cache, "reset_cache", None)
    if reset is not None:
        reset()


def add_argument(parser: argparse.ArgumentParser, *, default: Any = False) -> None:
    """Add ``--no-compile-cache`` to ``parser`` (``args.no_compile_cache``).
    ``default=argparse.SUPPRESS`` on a subcommand's parser lets the flag also follow the
    subcommand without hiding the main parser's value when it is not given there."""
    parser.add_argument(
        FLAG, dest="no_compile_cache", action="store_true", default=default,
        help=f"compile every JAX program anew instead of reusing those stored on disk "
             f"(default: stored in ${ENV}, else ~/.cache/kvjax/jax-compile; "
             f"{ENV}=off turns it off too)")


def from_args(args: argparse.Namespace) -> Path | None:
    """:func:`enable_compile_cache` unless ``args`` has ``--no-compile-cache`` (see
    :func:`add_argument`); the directory, or None when off. A directory that cannot be
    created is a warning, and the run goes on without the cache."""
    if getattr(args, "no_compile_cache", False):
        return None
    try:
        return enable_compile_cache()
    except OSError as err:
        warnings.warn(f"compilation cache off: {err}", RuntimeWarning, stacklevel=2)
        return None


__all__ = [
    "DEFAULT_DIRECTORY",
    "ENV",
    "FLAG",
    "OFF",
    "THRESHOLDS",
    "add_argument",
    "cache_directory",
    "enable_compile_cache",
    "from_args",
]
