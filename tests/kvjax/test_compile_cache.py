"""kvjax.compile_cache: JAX's persistent compilation cache, its switches, and the CLI flag.

Every test that turns the cache on restores JAX's settings afterwards (the ``restored``
fixture): the rest of the suite runs without a persistent cache (tests/conftest.py).
"""

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from kvjax import compile_cache
from kvjax.cli import main
from kvjax.compile_cache import (
    DEFAULT_DIRECTORY,
    ENV,
    THRESHOLDS,
    cache_directory,
    enable_compile_cache,
    from_args,
)

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = ("jax_compilation_cache_dir", *THRESHOLDS)


@pytest.fixture
def restored():
    """JAX's cache settings as they were, and JAX's handle on the directory dropped."""
    before = {name: getattr(jax.config, name) for name in OPTIONS}
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    compile_cache._reset()


def test_enable_sets_the_config_and_creates_the_directory(tmp_path, monkeypatch, restored):
    where = tmp_path / "a" / "b"
    assert enable_compile_cache(where) == where.resolve()
    assert where.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(where.resolve())
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    # an explicit directory wins over the switch
    monkeypatch.setenv(ENV, "off")
    assert enable_compile_cache(where) == where.resolve()


def test_the_directory_comes_from_the_environment(tmp_path, monkeypatch, restored):
    monkeypatch.setenv(ENV, str(tmp_path / "mine"))
    assert cache_directory() == tmp_path / "mine"
    for off in ("off", "OFF", " none "):
        monkeypatch.setenv(ENV, off)
        assert cache_directory() is None
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    jax.config.update("jax_compilation_cache_dir", None)
    assert cache_directory() == tmp_path / ".cache" / "kvjax" / "jax-compile"
    assert cache_directory() == DEFAULT_DIRECTORY.expanduser()
    # JAX's own setting (JAX_COMPILATION_CACHE_DIR) comes before the default
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    assert cache_directory() == tmp_path / "jax"


def test_off_leaves_jax_as_it_was(tmp_path, monkeypatch, restored):
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv(ENV, "off")
    assert enable_compile_cache() is None
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    assert from_args(argparse.Namespace(no_compile_cache=True)) is None
    assert jax.config.jax_compilation_cache_dir is None
    assert not (tmp_path / "cache").exists()
    assert from_args(argparse.Namespace()) == (tmp_path / "cache").resolve()
    assert jax.config.jax_compilation_cache_dir == str((tmp_path / "cache").resolve())


def test_a_directory_that_cannot_be_made_is_a_warning(tmp_path, monkeypatch, restored):
    jax.config.update("jax_compilation_cache_dir", None)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(ENV, str(tmp_path / "file" / "cache"))
    with pytest.warns(RuntimeWarning, match="compilation cache off"):
        assert from_args(argparse.Namespace(no_compile_cache=False)) is None
    assert jax.config.jax_compilation_cache_dir is None


@pytest.mark.parametrize("flag", [[], ["--no-compile-cache"], ["codecs", "--no-compile-cache"]],
                         ids=["default", "before", "after"])
def test_the_cli_turns_it_on_unless_told_not_to(tmp_path, monkeypatch, restored, capsys, flag):
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv(ENV, str(tmp_path / "cli"))
    argv = flag if flag[:1] == ["codecs"] else [*flag, "codecs"]
    assert main(argv) == 0
    assert "int" in capsys.readouterr().out
    expected = None if "--no-compile-cache" in flag else str((tmp_path / "cli").resolve())
    assert jax.config.jax_compilation_cache_dir == expected


SCRIPT = textwrap.dedent("""
    import sys

    import jax
    import jax.numpy as jnp
    from jax import monitoring

    from kvjax.compile_cache import enable_compile_cache

    events = []
    monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
    enable_compile_cache(sys.argv[1])
    jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0)(jnp.ones(8)).block_until_ready()
    print(sum(e.endswith("/cache_hits") for e in events),
          sum(e.endswith("/cache_misses") for e in events))
""")


def test_a_fresh_process_loads_what_the_first_compiled(tmp_path):
    where = tmp_path / "programs"

    def run():
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(where)], cwd=ROOT,
                              capture_output=True, text=True, check=False, timeout=300)
        assert proc.returncode == 0, proc.stderr
        hits, misses = map(int, proc.stdout.split())
        return hits, misses, sorted(p.name for p in where.iterdir())

    hits, misses, stored = run()
    assert hits == 0 and misses > 0
    assert any("lambda" in name for name in stored)
    hits, misses, again = run()
    assert hits > 0 and misses == 0
    assert again == stored
