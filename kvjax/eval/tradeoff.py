"""Eviction x quantization at equal cache size: which wins at a byte budget, and does
combining them beat both?

A *strategy* is a family of cache specs that trades quality for bytes one way:
quantization alone (``CODEC evict=all``), eviction alone (``bf16 evict=POLICY:B``) and
both (``CODEC evict=POLICY:B``). Every point runs under one protocol (:mod:`kvjax.eviction`):
the prompt is prefilled exactly, then stored (selected and/or encoded), and what follows
attends to it. Each point is measured by

- the continuation metrics (:func:`kvjax.eval.ppl.continuation_perplexity`): the tokens
  after a prefilled context of each window, perplexity and KL / top-1 agreement against
  the uncompressed cache, and ``sequence_bits_per_element``, the cache's bits over every
  token of the windows (evicted ones stored as nothing): the x axis;
- optionally the retrieval suite (:mod:`kvjax.eval.retrieval`), mean exact-match accuracy.

:func:`run_points` is resumable like the retrieval suite (one JSON per point);
:func:`write_reports` writes ``summary.md``, ``grid.csv`` and ``tradeoff.png`` (a panel per
metric, one curve per strategy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvjax.eval.retrieval import SuiteSettings, accuracy, run_suite
from kvjax.eval.sweep import run_label, write_table_reports
from kvjax.eviction import POLICIES
from kvjax.spec import parse_cache

#: the default strategies' settings: budgets as shares of the prompt, the codecs of
#: quantization alone, and the (policy, codec) pairs of the combinations
BUDGETS = ("50%", "25%", "12.5%")
CODECS = ("int:8", "kivi:4,g32", "kivi:2,g32")
COMBINED = (("snapkv", "kivi:4,g32"), ("h2o", "kivi:4,g32"), ("snapkv", "int:8"),
            ("h2o", "int:8"))
COMBINED_BUDGETS = ("50%", "25%")
#: what a point reports, for the table, the CSV and the panels: (field, label, better)
METRICS = (("ppl", "perplexity", "lower"), ("kl_mean", "mean KL (nats)", "lower"),
           ("top1_agreement", "top-1 agreement", "higher"),
           ("retrieval", "retrieval accuracy", "higher"))
FIELDS = ("strategy", "config", "sequence_bits_per_element", "bits_per_element", "ppl",
          "reference_ppl", "kl_mean", "kl_p99", "top1_agreement", "retrieval", "seconds")


@dataclasses.dataclass(frozen=True)
class Point:
    """One cache spec of a strategy."""

    strategy: str
    config: str


def default_points(budgets: Sequence[str] = BUDGETS, codecs: Sequence[str] = CODECS,
                   policies: Sequence[str] = ("streaming", "h2o", "snapkv"),
                   combined: Sequence[tuple[str, str]] = COMBINED,
                   combined_budgets: Sequence[str] = COMBINED_BUDGETS) -> list[Point]:
    """The grid: the uncompressed reference, quantization alone per codec, eviction
    alone per policy and budget, and each (policy, codec) pair per combined budget."""
    for policy in (*policies, *(p for p, _ in combined)):
        if policy not in POLICIES or policy == "all":
            raise ValueError(f"unknown eviction policy '{policy}'")
    points = [Point("reference", "bf16")]
    points += [Point("quantize", f"{codec} evict=all") for codec in codecs]
    for policy in policies:
        points += [Point(policy, f"bf16 evict={policy}:{b}") for b in budgets]
    for policy, codec in combined:
        points += [Point(f"{policy} + {codec}", f"{codec} evict={policy}:{b}")
                   for b in combined_budgets]
    for p in points:
        parse_cache(p.config)  # a bad spec fails before any run
    return points


@dataclasses.dataclass(frozen=True)
class ContinuationSettings:
    """What a point's continuation metrics depend on besides its cache."""

    model: str
    corpus: str
    windows: int
    context: int
    follow: int
    seed: int = 0

    def run_name(self) -> str:
        """A directory name that differs whenever a setting differs."""
        return run_label(self.model, self.corpus, f"n{self.windows}", f"c{self.context}",
                         f"f{self.follow}", f"seed{self.seed}")

    def title(self) -> str:
        return (f"{self.model} on {self.corpus}: {self.windows} windows, "
                f"{self.context}-token prompt + {self.follow} scored tokens")


#: ``measure(config, cache_config) -> [row]``: one row of continuation metrics
Measure = Callable[[str, object], list[dict]]


def run_points(points: Sequence[Point], settings: ContinuationSettings, out: Path,
               measure: Measure, *, retrieval: SuiteSettings | None = None,
               answer=None, force: bool = False, progress: bool = False) -> list[dict]:
    """Measure every point (continuation metrics; with ``retrieval`` and ``answer``, as
    in :func:`kvjax.eval.retrieval.run_suite`, the suite's mean accuracy too), each
    stored as it finishes under ``out`` and read back on a second run with equal
    settings. Returns one row per point (:data:`FIELDS`)."""
    configs = [p.config for p in points]
    measured, _ = run_suite(configs, settings, Path(out) / "continuation", measure,
                            force=force, progress=progress)
    by_config = {r["codec"]: r for r in measured}
    scores: dict[str, float] = {}
    if retrieval is not None:
        rows, _ = run_suite(configs, retrieval, Path(out) / "retrieval", answer,
                            force=force, progress=progress)
        acc = accuracy(rows)
        lengths = sorted({k[2] for k in acc})
        for config in configs:
            values = [acc[(config, "mean", n)] for n in lengths if (config, "mean", n) in acc]
            scores[config] = float(np.mean(values)) if values else float("nan")
    out_rows = []
    for p in points:
        row = by_config[p.config]
        out_rows.append({"strategy": p.strategy, "config": p.config,
                         **{f: row.get(f) for f in FIELDS[2:] if f != "retrieval"},
                         "retrieval": scores.get(p.config)})
    return out_rows


def summary_table(rows: Sequence[dict]) -> str:
    """A markdown table of the points, by strategy then size."""
    head = ("| strategy | config | bits/elem (sequence) | ppl | KL mean | KL p99 | top-1 | "
            "retrieval |")
    lines = [head, "|" + "---|" * 8]
    shown = (("sequence_bits_per_element", ".2f"), ("ppl", ".3f"), ("kl_mean", ".4f"),
             ("kl_p99", ".3f"), ("top1_agreement", ".3f"), ("retrieval", ".2f"))
    for r in sorted(rows, key=lambda r: (r["strategy"] != "reference", r["strategy"],
                                         -r["sequence_bits_per_element"])):
        cells = ["-" if r.get(name) is None or r[name] != r[name] else format(r[name], fmt)
                 for name, fmt in shown]
        lines.append(f"| {r['strategy']} | `{r['config']}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_tradeoff(rows: Sequence[dict], path, title: str) -> None:
    """Quality vs bits per sequence element, a panel per metric of :data:`METRICS` that
    the rows hold, one curve per strategy (the reference a star)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in METRICS if any(r.get(m[0]) is not None for r in rows)]
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6),
                             squeeze=False)
    for ax, (field, label, better) in zip(axes[0], metrics, strict=True):
        for i, strategy in enumerate(strategies):
            pts = sorted((r["sequence_bits_per_element"], r[field]) for r in rows
                         if r["strategy"] == strategy and r.get(field) is not None)
            if not pts:
                continue
            style = {"marker": "*", "markersize": 12, "linestyle": "none"} if (
                strategy == "reference") else {"marker": "osD^v<>pPXh"[i % 11]}
            ax.plot(*zip(*pts, strict=True), color=f"C{i % 10}", label=strategy, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache bits per sequence element")
        ax.set_ylabel(f"{label} ({better} is better)")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(rows: Sequence[dict], out: Path, title: str) -> str:
    """``summary.md``, ``grid.csv`` and ``tradeoff.png`` in ``out``; returns the table
    and the paths."""
    return write_table_reports(out, title, summary_table(rows), rows, FIELDS, "grid.csv",
                               plot_tradeoff, "tradeoff.png")


__all__ = ["BUDGETS", "CODECS", "COMBINED", "COMBINED_BUDGETS", "FIELDS", "METRICS",
           "ContinuationSettings", "Point", "default_points", "plot_tradeoff", "run_points",
           "summary_table", "write_reports"]
