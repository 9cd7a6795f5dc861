"""Synthetic serving workloads for :class:`models.serve.Engine`, and what a run of one
measures.

A :class:`Workload` states ``requests`` requests arriving as a Poisson process of
``rate`` requests per second (``inf``: all at once), prompt and output lengths drawn
uniformly from closed ranges, and a shared system prompt of ``shared_tokens`` tokens
that a ``shared_fraction`` of the requests start with. :func:`requests` draws it from a
seed (token ids uniform over the vocabulary, no stop tokens, so every request runs to its
output length). :func:`drive` feeds the requests to an engine at their arrival times on
the engine's clock and steps it until all are done; :func:`summary` reads the
completions: output tokens per second over the run, time to first token (arrival to
first token) and inter-token latency (between a request's consecutive tokens as they
reached the caller), p50 and p99, and the peak pages, running rows and queue.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from models.serve import Completion, Engine, Request


@dataclasses.dataclass(frozen=True)
class Workload:
    """A synthetic request stream (module docstring). Lengths are ``(low, high)``
    token counts, both included."""

    requests: int
    rate: float
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    shared_fraction: float = 0.0
    shared_tokens: int = 0
    temperature: float = 0.0

    def __post_init__(self):
        if not isinstance(self.requests, int) or self.requests < 1:
            raise ValueError(f"requests must be a positive int, got {self.requests!r}")
        if not (self.rate > 0):  # also refuses NaN
            raise ValueError(f"rate must be > 0 requests per second (inf: all at once), "
                             f"got {self.rate!r}")
        for name, (low, high) in (("prompt_len", self.prompt_len),
                                  ("output_len", self.output_len)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be 1 <= low <= high, got {low}:{high}")
        if not 0 <= self.shared_fraction <= 1:
            raise ValueError(f"shared_fraction must be in [0, 1], got {self.shared_fraction}")
        if self.shared_fraction and not 1 <= self.shared_tokens < self.prompt_len[0]:
            raise ValueError(f"a shared prompt of {self.shared_tokens} tokens must be shorter "
                             f"than the shortest prompt ({self.prompt_len[0]} tokens)")

    @property
    def longest(self) -> int:
        """Cache slots the longest request can need."""
        return self.prompt_len[1] + self.output_len[1] - 1


def requests(workload: Workload, vocab_size: int, seed: int = 0
             ) -> list[tuple[float, Request]]:
    """``(arrival seconds, request)`` of every request of ``workload``, in arrival order
    (the same for the same seed)."""
    rng = np.random.default_rng(seed)
    gaps = (np.zeros(workload.requests) if math.isinf(workload.rate)
            else rng.exponential(1 / workload.rate, workload.requests))
    arrivals = np.cumsum(gaps) - gaps[0]
    shared = rng.integers(0, vocab_size, workload.shared_tokens).tolist()
    out = []
    for i, at in enumerate(arrivals):
        length = int(rng.integers(workload.prompt_len[0], workload.prompt_len[1] + 1))
        new = int(rng.integers(workload.output_len[0], workload.output_len[1] + 1))
        prompt = rng.integers(0, vocab_size, length).tolist()
        if rng.random() < workload.shared_fraction:
            prompt[:len(shared)] = shared
        out.append((float(at), Request(prompt, new, temperature=workload.temperature,
                                       stop=(), seed=i)))
    return out


@dataclasses.dataclass
class Trace:
    """What :func:`drive` saw: the completions in arrival order, the run's start and
    end (engine clock), and per engine step the pages held, rows running and requests
    queued."""

    completions: list[Completion]
    start: float
    end: float
    pages: list[int]
    running: list[int]
    queued: list[int]


def drive(engine: Engine, timed: Sequence[tuple[float, Request]], *,
          sleep: Callable[[float], None] = time.sleep,
          progress: Callable[[int], None] | None = None) -> Trace:
    """Submit each request at its arrival time (seconds after the start, on the
    engine's clock; its completion's ``submitted`` is that time) and step the engine
    until every request is done; waits with ``sleep`` while nothing runs. ``progress``
    is told how many requests finished after each step."""
    clock = engine.clock
    start = clock()
    pending = list(timed)
    ids, pages, running, queued = [], [], [], []
    while pending or not engine.idle:
        now = clock() - start
        while pending and pending[0][0] <= now:
            at, request = pending.pop(0)
            ids.append(engine.submit(request, at=start + at))
        if engine.idle:
            sleep(max(0.0, pending[0][0] - (clock() - start)))
            continue
        events = engine.step()
        pages.append(engine.pages_used)
        running.append(engine.running)
        queued.append(engine.waiting)
        done = sum(event.done for event in events)
        if done and progress is not None:
            progress(done)
    return Trace([engine.completions[i] for i in ids], start, clock(), pages, running, queued)


def _percentiles(values: Sequence[float]) -> tuple[float, float]:
    if not len(values):
        return math.nan, math.nan
    p50, p99 = np.percentile(np.asarray(values, float), [50, 99])
    return float(p50), float(p99)


def summary(trace: Trace) -> dict:
    """The run's figures (module docstring): ``tokens``, ``seconds``, ``tok_per_s``,
    ``req_per_s``, ``ttft_p50_s`` / ``ttft_p99_s``, ``itl_p50_s`` / ``itl_p99_s``,
    ``peak_pages``, ``peak_running``, ``peak_queued``."""
    done = trace.completions
    tokens = sum(len(c.tokens) for c in done)
    seconds = max(trace.end - trace.start, 1e-9)
    ttft = [c.token_times[0] - c.submitted for c in done if c.token_times]
    itl = [b - a for c in done for a, b in zip(c.token_times, c.token_times[1:], strict=False)]
    ttft_p50, ttft_p99 = _percentiles(ttft)
    itl_p50, itl_p99 = _percentiles(itl)
    return {
        "requests": len(done), "tokens": tokens, "seconds": seconds,
        "tok_per_s": tokens / seconds, "req_per_s": len(done) / seconds,
        "ttft_p50_s": ttft_p50, "ttft_p99_s": ttft_p99,
        "itl_p50_s": itl_p50, "itl_p99_s": itl_p99,
        "peak_pages": max(trace.pages, default=0),
        "peak_running": max(trace.running, default=0),
        "peak_queued": max(trace.queued, default=0),
    }


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{1e3 * seconds:.1f}"


def _rate(rate: float | None) -> float:
    return math.inf if rate is None else rate  # strict JSON writes inf as null


def markdown_table(rows: Sequence[dict]) -> str:
    """The rows of a serving benchmark (:func:`summary`'s figures with ``cache``,
    ``rate``, ``pool_pages``, and the engine's ``prefilled_tokens`` and
    ``shared_tokens``) as a markdown table."""
    lines = ["| cache | rate/s | requests | tok/s | TTFT p50/p99 ms | ITL p50/p99 ms "
             "| peak pages | peak running | prompt tokens fed (shared) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pages = f"{r['peak_pages']}/{r['pool_pages']}" if r["pool_pages"] else "-"
        lines.append(
            f"| {r['cache']} | {_rate(r['rate']):g} | {r['requests']} | {r['tok_per_s']:.1f} "
            f"| {_ms(r['ttft_p50_s'])}/{_ms(r['ttft_p99_s'])} "
            f"| {_ms(r['itl_p50_s'])}/{_ms(r['itl_p99_s'])} | {pages} "
            f"| {r['peak_running']} | {r.get('prefilled_tokens', '-')} "
            f"({r.get('shared_tokens', 0)}) |")
    return "\n".join(lines)


def plot_throughput(rows: Sequence[dict], path, title: str) -> None:
    """Output tokens per second against the request rate, a line per cache (an
    all-at-once rate drawn at the right edge, marked ``inf``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{**r, "rate": _rate(r["rate"])} for r in rows]
    finite = [r["rate"] for r in rows if math.isfinite(r["rate"])]
    edge = 2 * max(finite) if finite else 1.0
    fig, ax = plt.subplots(figsize=(6, 4))
    for cache in dict.fromkeys(r["cache"] for r in rows):
        mine = sorted((r["rate"] if math.isfinite(r["rate"]) else edge, r["tok_per_s"])
                      for r in rows if r["cache"] == cache)
        ax.plot(*zip(*mine, strict=True), marker="o", label=cache)
    if len(finite) < len(rows):
        ax.axvline(edge, color="grey", lw=0.5)
        ax.annotate("inf", (edge, 0), xycoords=("data", "axes fraction"), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
