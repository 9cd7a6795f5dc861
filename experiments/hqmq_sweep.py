"""HQMQ on one model and corpus: the paper's sweep against naive int, the seed variance of
the secondary codebooks, the outlier multiplier C, and a per-layer chunk-norm diagnostic.

    python experiments/hqmq_sweep.py                         # all parts, default model
    python experiments/hqmq_sweep.py --part sweep --windows 4 --docs docs/hqmq

Parts (``--part``, repeatable; default all):

* ``bits``: the paper's fractional bits next to the stored ones, at D = 64 and 128.
* ``sweep``: HQMQ at S in {24, 48, 96, 192} x B in {3, 4, 6}, without and with Med3
  outliers, against ``int:2..8`` and ``int:2..8`` + Med3: perplexity vs measured bits,
  table, Pareto plot, and which configurations each family's points are dominated by.
* ``seeds``: ``hqmq:s96,r4`` and ``hqmq:s24,r3`` with 5 seeds of the secondary codebooks
  (mean, standard deviation and coefficient of variation of the perplexity).
* ``multiplier``: ``hqmq:s96,r6`` with ``medC`` for C in {2, 3, 4, 5} and without, and
  at C = 3 with 8% outlier slots instead of 3%.
* ``diagnostic``: the model's keys and values (float32 cache of the windows): per layer
  the largest chunk norm over the median chunk norm (the paper's Figure 7), and the
  fraction of chunks above 3x the median of their block of 32 tokens.

Every perplexity goes through :func:`kvjax.eval.sweep.run_sweep` (resumable JSON per
configuration under ``--out``); tables, plots and ``hqmq.json`` go to ``--docs``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kvjax import compile_cache
from kvjax.cache import dense
from kvjax.eval import sweep as sw
from kvjax.spec import CacheConfig, parse_codec
from models import llama
from models.evaluate import load_model_and_windows, sweep_evaluator

SECONDARY = (24, 48, 96, 192)
RADIUS_BITS = (3, 4, 6)
INT_BITS = tuple(range(2, 9))
SEED_CONFIGS = ("hqmq:s96,r4", "hqmq:s24,r3")
SEEDS = (0, 1, 2, 3, 4)
MULTIPLIERS = (2, 3, 4, 5)
PARTS = ("bits", "sweep", "seeds", "multiplier", "diagnostic")


def sweep_configs() -> list[str]:
    """The paper's grid and its baselines (bf16 is added by the sweep)."""
    hqmq = [f"hqmq:s{s},r{r}" for s in SECONDARY for r in RADIUS_BITS]
    ints = [f"int:{n}" for n in INT_BITS]
    return [*hqmq, *(c + ",med3" for c in hqmq), *ints, *(c + ",med3" for c in ints)]


def dominated_by(rows: Sequence[dict], family: str, rivals: str) -> dict[str, list[str]]:
    """For each row of ``family``: the rows of ``rivals`` with no more bits and a lower
    perplexity (an empty list: nothing of ``rivals`` dominates it)."""
    out = {}
    for r in rows:
        if r["family"] != family:
            continue
        out[r["config"]] = [o["config"] for o in rows if o["family"] == rivals
                            and o["bits_per_element"] <= r["bits_per_element"] + 1e-9
                            and o["ppl"] < r["ppl"]]
    return out


#: (family, rival) pairs of the dominance table
DOMINANCE = (("int", "hqmq"), ("hqmq", "int"), ("int+med", "hqmq+med"),
             ("hqmq+med", "int+med"), ("int", "hqmq+med"))


def dominance_table(rows: Sequence[dict]) -> str:
    """Markdown: for each :data:`DOMINANCE` pair present, how many of the family's points a
    rival point dominates (no more bits, lower ppl), and which."""
    lines = ["| family | rival | dominated | of | dominated points (a rival point has no more "
             "bits and a lower ppl) |", "|---|---|---|---|---|"]
    for fam, rival in DOMINANCE:
        beaten = dominated_by(rows, fam, rival)
        if not beaten:
            continue
        hit = [c for c, by in beaten.items() if by]
        lines.append(f"| `{fam}` | `{rival}` | {len(hit)} | {len(beaten)} | "
                     + (", ".join(f"`{c}`" for c in hit) or "-") + " |")
    return "\n".join(lines)


def bits_table(head_dims: Sequence[int] = (64, 128)) -> str:
    """HQMQ's fractional bits (the paper's count) and the bits stored, per head dim."""
    head = "| codec |" + "".join(f" paper D={d} | stored D={d} |" for d in head_dims)
    lines = [head, "|---|" + "---|---|" * len(head_dims)]
    for s in SECONDARY:
        for r in RADIUS_BITS:
            codec = parse_codec(f"hqmq:s{s},r{r}")
            cells = "".join(f" {codec.fractional_bits_per_element(d):.3f} | "
                            f"{codec.bits_per_element(d):.3f} |" for d in head_dims)
            lines.append(f"| `{codec.spec}` |{cells}")
    return "\n".join(lines)


def seed_table(results: dict[str, list[float]]) -> str:
    """Mean, standard deviation and CV of the perplexity per configuration."""
    lines = ["| codec | seeds | ppl per seed | mean | std | CV |", "|---|---|---|---|---|---|"]
    for config, ppls in results.items():
        mean = statistics.fmean(ppls)
        std = statistics.stdev(ppls) if len(ppls) > 1 else 0.0
        lines.append(f"| `{config}` | {len(ppls)} | {', '.join(f'{p:.3f}' for p in ppls)} | "
                     f"{mean:.3f} | {std:.3f} | {100 * std / mean:.2f}% |")
    return "\n".join(lines)


def chunk_norm_diagnostic(model: str, corpus: str, windows: int, window_len: int,
                          block: int = 32, multiplier: float = 3.0) -> list[dict]:
    """Per layer and K|V: the largest chunk norm over the median chunk norm, and the
    fraction of chunks above ``multiplier`` x the median of their block of ``block``
    tokens (as ``medC`` judges them), from a float32 cache of the windows."""
    config, params, _, _, wins = load_model_and_windows(model, corpus, windows, window_len)
    tokens = jnp.asarray(wins, jnp.int32)
    cache = llama.new_cache(config, CacheConfig(k="f32", v="f32"), batch=tokens.shape[0],
                            max_len=tokens.shape[1], dtype=jnp.float32)
    _, cache = llama.jit_forward(params, config, tokens, cache,
                                 jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32))
    rows = []
    for layer in range(config.num_layers):
        view = cache.layer(layer)
        for role in ("k", "v"):
            x = np.asarray(dense(getattr(view, role), cache.lengths))  # [B, K, S, D]
            pad = -x.shape[-1] % 4
            x = np.pad(x, [(0, 0)] * 3 + [(0, pad)])
            norms = np.linalg.norm(x.reshape(*x.shape[:-1], -1, 4), axis=-1)  # [B,K,S,C]
            s = norms.shape[2] // block * block
            blocks = norms[:, :, :s].reshape(*norms.shape[:2], s // block, -1)
            med = np.median(blocks, axis=-1, keepdims=True)
            rows.append({
                "layer": layer, "role": role,
                "max_over_median": float(norms.max() / np.median(norms)),
                "outlier_fraction": float(np.mean(blocks > multiplier * med)),
            })
    return rows


def plot_diagnostic(rows: Sequence[dict], path: Path, title: str, multiplier: float) -> None:
    """Per-layer max/median chunk-norm ratio (log) and outlier fraction, K and V."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for role, marker in (("k", "o"), ("v", "s")):
        pts = [r for r in rows if r["role"] == role]
        layers = [r["layer"] for r in pts]
        top.plot(layers, [r["max_over_median"] for r in pts], marker=marker,
                 label=role.upper())
        bottom.plot(layers, [100 * r["outlier_fraction"] for r in pts], marker=marker,
                    label=role.upper())
    top.axhline(multiplier, color="k", linestyle="--", linewidth=0.8,
                label=f"C = {multiplier:g}")
    top.set_yscale("log")
    top.set_ylabel("max / median chunk norm")
    bottom.set_ylabel(f"% chunks > {multiplier:g} x block median")
    bottom.set_xlabel("layer")
    top.set_title(title, fontsize=10)
    for ax in (top, bottom):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: Sequence[str] | None = None, evaluate=None) -> int:
    """Run the chosen parts; print every table. ``evaluate`` replaces the model (tests)."""
    p = sw.protocol_parser(__doc__.split("\n\n")[0], PARTS, "hqmq",
                           window_len=256, summary="hqmq.json",
                           published="docs/hqmq")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    parts = args.part or list(PARTS)
    try:
        options = sw.canonical_options(args.cache_options)
    except ValueError as err:
        p.error(str(err))
    args.docs.mkdir(parents=True, exist_ok=True)
    # parts run separately add to one summary (kept only for the same model, corpus and
    # cache options)
    settings = {"model": args.model, "corpus": args.corpus, "windows": args.windows,
                "window_len": args.window_len, "cache_options": options}
    previous = args.docs / "hqmq.json"
    summary: dict = json.loads(previous.read_text()) if previous.exists() else {}
    if {k: summary.get(k) for k in settings} != settings:
        summary = {}
    summary.update(settings)
    evaluators: dict = {}

    def run(configs, seed=0):
        settings = sw.Settings(model=args.model, corpus=args.corpus, windows=args.windows,
                               window_len=args.window_len, cache_options=options, seed=seed)
        fn = evaluate or sw.lazy_evaluator(settings, evaluators, sweep_evaluator)
        rows, _ = sw.run_sweep(configs, settings, args.out, fn,
                               progress=not args.no_progress)
        return sw.with_deltas(rows)

    title = f"{args.model} on {args.corpus}: {args.windows} x {args.window_len} tokens"
    if "bits" in parts:
        table = bits_table()
        (args.docs / "bits.md").write_text(table + "\n")
        print(table)
    if "sweep" in parts:
        rows = run(sweep_configs())
        table = sw.markdown_table(rows)
        dominance = dominance_table(rows)
        (args.docs / "sweep.md").write_text(table + "\n\n" + dominance + "\n")
        sw.write_csv(rows, args.docs / "sweep.csv")
        sw.plot_pareto_views(rows, args.docs / "pareto.png", "HQMQ vs naive int, " + title,
                             max_bits=7.0)
        summary["sweep"] = [{k: r[k] for k in ("config", "family", "bits_per_element", "ppl",
                                               "delta_pct")} for r in rows]
        print(table, "", dominance, sep="\n")
    if "seeds" in parts:
        per_seed: dict[str, list[float]] = {c: [] for c in SEED_CONFIGS}
        for seed in SEEDS:
            for r in run(SEED_CONFIGS, seed):
                if r["config"] in per_seed:
                    per_seed[r["config"]].append(r["ppl"])
        table = seed_table(per_seed)
        (args.docs / "seeds.md").write_text(table + "\n")
        summary["seeds"] = per_seed
        print("\n" + table)
    if "multiplier" in parts:
        # and the slot capacity: 3% (default) vs 8% of a block's chunks at C = 3
        configs = ["hqmq:s96,r6", *(f"hqmq:s96,r6,med{c}" for c in MULTIPLIERS),
                   "hqmq:s96,r6,med3,mp8"]
        rows = [r for r in run(configs) if r["config"] in configs or r["config"] == "bf16"]
        table = sw.markdown_table(rows)
        (args.docs / "multiplier.md").write_text(table + "\n")
        summary["multiplier"] = [{k: r[k] for k in ("config", "bits_per_element", "ppl")}
                                 for r in rows]
        print("\n" + table)
    if "diagnostic" in parts and evaluate is None:
        rows = chunk_norm_diagnostic(args.model, args.corpus, args.windows, args.window_len)
        plot_diagnostic(rows, args.docs / "chunk_norms.png",
                        "chunk norms per layer, " + title, 3.0)
        summary["diagnostic"] = rows
        k = [r for r in rows if r["role"] == "k"]
        worst = max(k, key=lambda r: r["max_over_median"])
        share = 100 * statistics.fmean(r["outlier_fraction"] for r in k)
        print(f"\nK max/median chunk norm: median over layers "
              f"{statistics.median(r['max_over_median'] for r in k):.1f}, largest "
              f"{worst['max_over_median']:.1f} (layer {worst['layer']}); K chunks above 3x "
              f"their block's median: {share:.2f}%")
    sw.write_json(args.docs / "hqmq.json", summary)
    print(f"\nwritten: {args.docs}")
    return 0 if all(math.isfinite(r.get("ppl", 0)) for r in summary.get("sweep", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
