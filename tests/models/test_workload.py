"""Synthetic serving workloads, the driver on a simulated clock, the figures of a run,
and ``python -m kvjax serve-bench``."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cli import main
from kvjax.spec import parse_cache
from models import workload as wl
from models.config import ModelConfig
from models.llama import init_params
from models.serve import Completion, Engine, Request

CONFIG = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=128)


def _workload(**kw):
    kw = {"requests": 6, "rate": 2.0, "prompt_len": (10, 30), "output_len": (2, 6), **kw}
    return wl.Workload(**kw)


def test_requests_follow_the_workload_and_the_seed():
    workload = _workload(shared_fraction=1.0, shared_tokens=8)
    timed = wl.requests(workload, 128, seed=3)
    assert timed == wl.requests(workload, 128, seed=3) != wl.requests(workload, 128, seed=4)
    arrivals = [at for at, _ in timed]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    for _, request in timed:
        assert 10 <= len(request.prompt) <= 30 and 2 <= request.max_new_tokens <= 6
        assert request.prompt[:8] == timed[0][1].prompt[:8] and request.stop == ()
    at_once = wl.requests(_workload(rate=math.inf), 128)
    assert {at for at, _ in at_once} == {0.0}
    none_shared = wl.requests(_workload(shared_fraction=0.0, shared_tokens=8), 128, seed=3)
    assert len({tuple(r.prompt[:8]) for _, r in none_shared}) == len(none_shared)


@pytest.mark.parametrize("kw,match", [
    ({"requests": 0}, "requests"), ({"rate": 0.0}, "rate"), ({"rate": math.nan}, "rate"),
    ({"prompt_len": (5, 3)}, "prompt_len"), ({"output_len": (0, 3)}, "output_len"),
    ({"shared_fraction": 1.5}, "shared_fraction"),
    ({"shared_fraction": 0.5, "shared_tokens": 10}, "shorter than the shortest prompt"),
])
def test_bad_workloads_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        _workload(**kw)


class _Clock:
    """Simulated time: every reading costs ``tick`` seconds, sleeping moves it on."""

    def __init__(self, tick=0.01):
        self.now, self.tick, self.slept = 0.0, tick, []

    def __call__(self):
        self.now += self.tick
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def test_drive_submits_at_arrival_and_measures_every_request():
    params = init_params(jax.random.PRNGKey(0), CONFIG)
    clock = _Clock()
    engine = Engine(params, CONFIG, parse_cache("int:4 page=16"), rows=2, max_len=40,
                    chunk=16, cache_dtype=jnp.float32, clock=clock)
    workload = _workload(rate=0.5)  # gaps of seconds: the engine idles between some
    timed = wl.requests(workload, CONFIG.vocab_size, seed=1)
    finished = []
    trace = wl.drive(engine, timed, sleep=clock.sleep, progress=finished.append)
    assert sum(finished) == len(timed) and clock.slept
    assert [c.request for c in trace.completions] == [r for _, r in timed]
    for (at, request), done in zip(timed, trace.completions, strict=True):
        assert done.submitted == pytest.approx(trace.start + at)
        assert done.admitted >= done.submitted and done.token_times[0] > done.admitted
        assert len(done.tokens) == request.max_new_tokens and done.reason == "length"
    figures = wl.summary(trace)
    assert figures["requests"] == 6
    assert figures["tokens"] == sum(r.max_new_tokens for _, r in timed)
    assert figures["tok_per_s"] == pytest.approx(figures["tokens"] / (trace.end - trace.start))
    assert 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"]
    assert 0 < figures["peak_pages"] <= engine.pool.num_pages
    assert figures["peak_running"] <= 2 and engine.pages_used == engine.cached_pages


def test_summary_reads_the_timelines():
    def done(submitted, times):
        return Completion(id=0, request=Request([1], len(times)), tokens=[7] * len(times),
                          reason="length", submitted=submitted, token_times=list(times))

    trace = wl.Trace([done(0.0, [1.0, 1.5, 2.5]), done(1.0, [4.0, 4.5])], start=0.0,
                     end=5.0, pages=[1, 3, 2], running=[1, 2], queued=[1, 0])
    figures = wl.summary(trace)
    assert figures["tokens"] == 5 and figures["tok_per_s"] == 1.0
    assert figures["req_per_s"] == 0.4
    assert figures["ttft_p50_s"] == 2.0  # the median of 1 s and 3 s
    np.testing.assert_allclose(figures["itl_p50_s"], 0.5)  # of 0.5, 1.0, 0.5
    assert (figures["peak_pages"], figures["peak_running"], figures["peak_queued"]) == (3, 2, 1)


SMALL = ["--shape", "smollm2-135m", "--layers", "1", "--requests", "3", "--prompt-len",
         "8:20", "--output-len", "2:4", "--rows", "2", "--chunk", "8"]


def test_serve_bench_cli_rows_table_and_plot(capsys, tmp_path):
    plot = tmp_path / "rate.png"
    assert main(["serve-bench", *SMALL, "--cache", "bf16", "--cache", "int:4 page=16",
                 "--rate", "50", "inf", "--json", "--plot", str(plot)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["cache"], r["rate"]) for r in rows] == [
        ("bf16", 50.0), ("bf16", None), ("int:4 page=16", 50.0), ("int:4 page=16", None)]
    assert all(r["requests"] == 3 and r["tokens"] >= 6 and r["tok_per_s"] > 0 for r in rows)
    assert rows[0]["pool_pages"] == 0 and rows[2]["pool_pages"] == 2 * 2
    assert plot.stat().st_size > 0
    assert main(["serve-bench", *SMALL, "--cache", "int:4 page=16"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| cache | rate/s |") and "| int:4 page=16 | inf | 3 |" in table
    # every request starts with one 16-token page: with rows to spare all come at once,
    # so one row at a time lets the later ones read the first's page
    shared = [*SMALL, "--cache", "int:4 page=16", "--prompt-len", "20:24", "--shared",
              "1:16", "--rows", "1", "--json"]
    assert main(["serve-bench", *shared]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert main(["serve-bench", *shared, "--no-share"]) == 0
    (whole,) = json.loads(capsys.readouterr().out)
    assert row["shared_tokens"] == 2 * 16 and whole["shared_tokens"] == 0
    assert row["prefilled_tokens"] == whole["prefilled_tokens"] - 32


def test_serve_bench_puts_every_cache_in_the_same_memory(capsys):
    """--cache-gb: bf16 rows and int:4 pages from one budget, and the caches the
    engines made stay within it."""
    budget = 0.002  # GB: a few rows of the one-layer shape at 23 tokens
    assert main(["serve-bench", *SMALL, "--cache", "bf16", "--cache", "int:4 page=16",
                 "--cache-gb", str(budget), "--json"]) == 0
    bf16, int4 = json.loads(capsys.readouterr().out)
    assert bf16["pool_pages"] == 0 and bf16["rows"] >= 1
    assert int4["rows"] == 2 and int4["pool_pages"] > 0
    for row in (bf16, int4):
        assert row["cache_bytes"] <= budget * 1e9 and row["requests"] == 3
    # a row's worth of bytes more would not have fit
    assert bf16["cache_bytes"] * (bf16["rows"] + 1) / bf16["rows"] > budget * 1e9


@pytest.mark.parametrize("args,match", [
    (["--rate", "0"], "requests per second > 0"),
    (["--prompt-len", "9:3"], "LO <= HI"),
    (["--shared", "2:4"], "FRACTION:TOKENS"),
    (["--shared", "0.5:8"], "shorter than the shortest prompt"),
    (["--model", "x"], "--model or --shape"),
    (["--cache", "bf16 evict=h2o:16"], "evict"),
    (["--cache-gb", "1e-9"], "holds no row"),
    (["--cache", "int:4 page=16", "--cache-gb", "1e-9"], "leave no room for a page"),
    (["--cache", "int:4", "--num-pages", "4"], "is not paged"),
    (["--cache", "int:4 page=16", "--num-pages", "4", "--cache-gb", "1"], "not both"),
])
def test_serve_bench_bad_input_is_one_line(capsys, args, match):
    assert main(["serve-bench", *SMALL, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1 and err.startswith("kvjax: error:")
