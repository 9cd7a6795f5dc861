"""Timing of jitted array functions for the benchmarks: compile apart, then the median
of repeated samples, each a loop whose input depends on the previous output."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def timed(fn: Callable[..., jax.Array], args: tuple, inner: int, repeats: int
          ) -> tuple[float, float]:
    """``(compile seconds, median seconds per call)`` of ``fn(x, *rest)``, whose output
    can be added to ``x`` (broadcast and cast to its type).

    A sample is one jitted call running ``fn`` ``inner`` times in a ``lax.fori_loop``
    whose ``x`` depends on the previous output (so XLA hoists nothing out of the loop),
    divided by ``inner``; the program is compiled (timed apart) and run once before the
    ``repeats`` samples."""
    if inner < 1 or repeats < 1:
        raise ValueError(f"inner and repeats must be >= 1, got {inner} and {repeats}")

    def loop(x, *rest):
        def body(_, x):
            return x + 1e-30 * fn(x, *rest).astype(x.dtype)
        return jax.lax.fori_loop(0, inner, body, x)

    t0 = time.perf_counter()
    compiled = jax.jit(loop).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        samples.append((time.perf_counter() - t) / inner)
    return compile_s, statistics.median(samples)
