"""kvjax.eval.timing: compile apart, then per-call seconds of a dependent loop."""

import jax.numpy as jnp
import pytest

from kvjax.eval.timing import timed


def test_timed_runs_the_loop_and_reports_positive_times():
    calls = []

    def fn(x, w):
        calls.append(1)  # traced once per compile, not per call
        return x @ w

    compile_s, seconds = timed(fn, (jnp.ones((4, 4)), jnp.eye(4)), inner=3, repeats=2)
    assert compile_s > 0 and seconds > 0
    assert len(calls) == 1


def test_timed_rejects_empty_loops():
    with pytest.raises(ValueError, match="inner and repeats"):
        timed(lambda x: x, (jnp.ones(2),), inner=0, repeats=1)
