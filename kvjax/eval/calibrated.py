"""Calibrated against data-free codecs, measured on text the fits never saw.

A run fits codec parameters (:mod:`kvjax.calibration`) on one corpus and measures
perplexity and the next-token distribution against the bf16 cache (KL, top-1) on
another, for data-free codecs (``int:N``, ``saw:bN,kv``) and the fitted variants of the
SAW paper's ablations: k-means residual VQ with C centroids (``saw:bN,cC,kv``), the
query-aware basis (``saw:bN,hess,kv``) and both; HQMQ with a learned secondary
codebook against its Haar-random one; and per-layer bit allocations
(:mod:`kvjax.allocation`) chosen from sensitivities measured on the fit corpus, against
uniform widths of the same bits. :class:`CalibrationSettings` names one
direction (fit corpus -> evaluation corpus); :func:`default_configs` the grid;
:func:`write_reports` the table, CSV and plot over both directions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from kvjax.eval.sweep import run_label, write_table_reports
from kvjax.spec import parse_cache, parse_codec

#: the families whose codecs use no calibration data
DATA_FREE = ("int", "saw", "hqmq")
#: (fit corpus, evaluation corpus) pairs: each text evaluates the other's fits
DIRECTIONS = (("shakespeare", "austen"), ("austen", "shakespeare"))
BITS = (2, 3, 4)
CENTROIDS = (1, 16, 256)
#: the paper's largest codebook, fitted at one width only
LARGE = 2048
#: HQMQ points (``sS,rB``) compared with their learned codebooks
HQMQ = ("s24,r3", "s96,r4")
FIELDS = ("fit_corpus", "eval_corpus", "family", "config", "fitted", "bits_per_element",
          "ppl", "reference_ppl", "kl_mean", "kl_p99", "top1_agreement", "fit_seconds",
          "fit_bytes")


def family(config: str) -> str:
    """The curve a configuration belongs to: ``int``, ``saw`` (data-free), ``saw cC``,
    ``saw hess``, ``saw cC hess``, ``hqmq``, ``hqmq learn``, ``hqmq learn score``,
    ``allocated`` (per-layer
    rules) or ``bf16``."""
    if "layers[" in config:
        return "allocated"
    name, _, options = config.partition(":")
    if name == "hqmq":
        return " ".join(["hqmq", *(o for o in options.split(",") if o in ("learn", "score"))])
    if name != "saw":
        return name
    extra = [o for o in options.split(",") if o.startswith("c") or o == "hess"]
    return " ".join(["saw", *extra])


def width(config: str) -> int | None:
    """The nominal bit width of a configuration of the grid (``int:N``, ``saw:bN,...``),
    None for others (``bf16``)."""
    cache = parse_cache(config)
    codec = parse_codec(cache.k)
    if cache.layers or codec.name not in ("int", "saw"):
        return None
    return codec.bits


def default_configs(bits: Sequence[int] = BITS, centroids: Sequence[int] = CENTROIDS,
                    combined: int | None = 256, large: int | None = LARGE,
                    large_bits: int = 4, hqmq: Sequence[str] = HQMQ) -> list[str]:
    """The grid at every bit width: ``int:N``, data-free ``saw:bN,kv``, each centroid
    count, ``hess``, and (``combined``) centroids with ``hess``; ``large`` centroids only
    at ``large_bits`` (the paper's INT4: its fit costs ~8x C = 256's). K and V both go
    through the rotation (``kv``), as in the paper's k-means ablation. First, each HQMQ
    point of ``hqmq`` with its Haar-random and its learned secondary codebook, and the
    last one learned for the score error."""
    configs = [c for point in hqmq for c in (f"hqmq:{point}", f"hqmq:{point},learn")]
    configs += [f"hqmq:{point},learn,score" for point in hqmq[-1:]]
    for b in bits:
        counts = [*centroids, *([large] if large and b == large_bits else [])]
        configs += [f"int:{b}", f"saw:b{b},kv", *(f"saw:b{b},kv,c{c}" for c in counts),
                    f"saw:b{b},kv,hess"]
        if combined:
            configs.append(f"saw:b{b},kv,c{combined},hess")
    return configs


@dataclasses.dataclass(frozen=True)
class CalibrationSettings:
    """One direction of the comparison: fit on ``fit_windows`` windows of ``fit_len``
    tokens of ``fit_corpus``, evaluate on ``windows`` windows of ``window_len`` tokens of
    ``eval_corpus``; ``seed`` seeds the codecs and the fits."""

    model: str
    fit_corpus: str
    eval_corpus: str
    fit_windows: int = 8
    fit_len: int = 512
    windows: int = 4
    window_len: int = 256
    seed: int = 0

    def run_name(self) -> str:
        """A directory name that differs whenever a setting differs."""
        return run_label(self.model, self.fit_corpus, f"f{self.fit_windows}x{self.fit_len}",
                         "to", Path(self.eval_corpus).stem,
                         f"{self.windows}x{self.window_len}", f"seed{self.seed}")

    def title(self) -> str:
        return (f"{self.model}: fitted on {self.fit_windows}x{self.fit_len} tokens of "
                f"{self.fit_corpus}, evaluated on {self.windows}x{self.window_len} of "
                f"{self.eval_corpus}")


def summary_table(rows: Sequence[dict]) -> str:
    """A markdown table: per direction and bit width, every configuration, with the
    change of perplexity and KL against the data-free ``saw`` of that width."""
    head = ("| fit -> eval | config | fitted | bits/elem | ppl | vs saw | KL mean | "
            "KL p99 | top-1 |")
    lines = [head, "|" + "---|" * 9]
    free = {(r["fit_corpus"], width(r["config"])): r for r in rows if r["family"] == "saw"}

    def key(r):
        return (r["fit_corpus"], -(width(r["config"]) or round(r["bits_per_element"])),
                r["bits_per_element"], r["config"])

    for r in sorted(rows, key=key):
        base = free.get((r["fit_corpus"], width(r["config"])))
        delta = ("-" if base is None or r is base or r["family"] == "bf16"
                 else f"{r['ppl'] - base['ppl']:+.3f}")
        lines.append(
            f"| {r['fit_corpus']} -> {r['eval_corpus']} | `{r['config']}` | "
            f"{'yes' if r['fitted'] else 'no'} | {r['bits_per_element']:.3f} | "
            f"{r['ppl']:.3f} | {delta} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} | "
            f"{r['top1_agreement']:.3f} |")
    return "\n".join(lines)


def plot(rows: Sequence[dict], path, title: str) -> None:
    """KL mean (log) vs bits per element, a panel per direction, a curve per family
    (dashed: the data-free ones)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = list(dict.fromkeys((r["fit_corpus"], r["eval_corpus"]) for r in rows))
    families = list(dict.fromkeys(r["family"] for r in rows if r["family"] != "bf16"))
    fig, axes = plt.subplots(1, len(directions), figsize=(5.2 * len(directions) + 1.6, 4.0),
                             squeeze=False)
    for ax, (fit, evaluated) in zip(axes[0], directions, strict=True):
        for i, name in enumerate(families):
            pts = sorted((r["bits_per_element"], r["kl_mean"]) for r in rows
                         if r["family"] == name and r["fit_corpus"] == fit)
            if pts:
                dashed = "--" if name in DATA_FREE else "-"
                ax.plot(*zip(*pts, strict=True), dashed, marker="osD^v<>pPXh"[i % 11],
                        color=plt.cm.tab20(i % 20), label=name)
        ax.set_yscale("log")
        ax.set_xlabel("bits per stored element")
        ax.set_ylabel("KL(bf16 || cache), nats/token (lower is better)")
        ax.set_title(f"fitted on {fit}, evaluated on {evaluated}", fontsize=9)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(rows: Sequence[dict], out: Path, title: str) -> str:
    """``summary.md``, ``calibration.csv`` and ``calibration.png`` in ``out``; returns
    the table and the paths."""
    return write_table_reports(out, title, summary_table(rows), rows, FIELDS,
                               "calibration.csv", plot, "calibration.png")


__all__ = [
    "BITS",
    "CENTROIDS",
    "DATA_FREE",
    "DIRECTIONS",
    "FIELDS",
    "HQMQ",
    "LARGE",
    "CalibrationSettings",
    "default_configs",
    "family",
    "plot",
    "summary_table",
    "width",
    "write_reports",
]
