"""The OCTOPUS paper's language-model protocol on one model and corpus: the five
rotation-preconditioned K codecs at b in {2, 3, 4}, sharing the V codec, the residual
window and the raw boundary blocks.

    python experiments/octopus_lm.py --docs docs/octopus          # all parts
    python experiments/octopus_lm.py --part protocol --windows 4   # a quick look

Recipe (the paper's Sec. 4.2): residual window of 32 raw tokens, V by group-wise INT with
groups of 32 (``kivi:B,g32,token``, each codec's ``value_codec``), K of the first and last
transformer block kept bf16 ("boundary-1"), everything counted in the measured bits.
Perplexity over 8 windows of 512 tokens (the paper: 8 chunks of 512).

Parts (``--part``, repeatable; default all):

* ``protocol``: ``turboquant:bB``, ``turboquant:bB,qjl``, ``polarquant:bB``, ``octopus:bB``,
  ``octopus:bB,qjl`` for B in {2, 3, 4}, plus references: ``kivi:2,g32``, ``kivi:4,g32``,
  ``int:4``, Han et al.'s own PolarQuant setting ``polarquant:b3,l4`` and OCTOPUS with the
  uniform split ``octopus:dB,nB``.
* ``seeds``: the three MSE codecs at every B with two more seeds of the codecs' random
  parameters (rotation signs), for mean and spread.
* ``unprotected``: the B = 2 codecs and the B = 4 MSE codecs without boundary-1.

Every perplexity goes through :mod:`experiments.sweep` (resumable JSON per configuration
under ``--out``: a second run only aggregates); the table, CSV, JSON and Pareto plot go
to ``--docs``.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if not __package__:  # run as a script: the repository root holds the experiments package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from experiments import sweep as sw

BITS = (2, 3, 4)
FAMILIES = ("turboquant:b{}", "turboquant:b{},qjl", "polarquant:b{}", "octopus:b{}",
            "octopus:b{},qjl")
MSE_FAMILIES = ("turboquant:b{}", "polarquant:b{}", "octopus:b{}")
REFERENCES = ("kivi:2,g32", "kivi:4,g32", "int:4", "polarquant:b3,l4", "octopus:d2,n2",
              "octopus:d3,n3")
EXTRA_SEEDS = (1, 2)
BOUNDARY = (0, -1)
PARTS = ("protocol", "seeds", "unprotected")


def protocol_configs() -> list[str]:
    """The five codecs at every B, then the references."""
    return [f.format(b) for b in BITS for f in FAMILIES] + list(REFERENCES)


def seed_configs() -> list[str]:
    """The MSE codecs at every B."""
    return [f.format(b) for b in BITS for f in MSE_FAMILIES]


def unprotected_configs() -> list[str]:
    """The B = 2 codecs and the B = 4 MSE codecs."""
    return [f.format(2) for f in FAMILIES] + [f.format(4) for f in MSE_FAMILIES]


def seed_rows(per_seed: dict[int, list[dict]]) -> list[dict]:
    """Per configuration present in every seed: bits, per-seed ppl, mean, sd, delta of
    the mean to bf16's (which is the same for every seed: it has no random parameters)."""
    seeds = sorted(per_seed)
    by_seed = {s: {r["config"]: r for r in rows} for s, rows in per_seed.items()}
    base = by_seed[seeds[0]]["bf16"]["ppl"]
    out = []
    for config in by_seed[seeds[0]]:
        if config == "bf16" or not all(config in by_seed[s] for s in seeds):
            continue
        ppl = [by_seed[s][config]["ppl"] for s in seeds]
        mean = statistics.fmean(ppl)
        out.append({"config": config, "bits_per_element":
                    by_seed[seeds[0]][config]["bits_per_element"], "ppl": ppl, "mean": mean,
                    "sd": statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
                    "delta_pct": 100 * (mean / base - 1)})
    return out


def seed_table(rows: Sequence[dict], seeds: Sequence[int]) -> str:
    """Markdown: configuration, bits, ppl per seed, mean +- sd, delta of the mean."""
    head = ("| codec | bits / element | " + " | ".join(f"seed {s}" for s in seeds)
            + " | mean +- sd | vs bf16 |")
    lines = [head, "|---|---|" + "---|" * len(seeds) + "---|---|"]
    for r in sorted(rows, key=lambda r: (r["bits_per_element"], r["config"])):
        lines.append(f"| `{r['config']}` | {r['bits_per_element']:.3f} | "
                     + " | ".join(f"{p:.2f}" for p in r["ppl"])
                     + f" | {r['mean']:.2f} +- {r['sd']:.2f} | {r['delta_pct']:+.1f}% |")
    return "\n".join(lines)


def orderings(rows: Sequence[dict], key: str = "ppl") -> list[str]:
    """Per B: the five codecs from best to worst by ``key``, with their bits."""
    by_config = {r["config"]: r for r in rows}
    lines = []
    for b in BITS:
        present = [f.format(b) for f in FAMILIES if f.format(b) in by_config]
        ranked = sorted(present, key=lambda c: by_config[c][key])
        lines.append(f"- b = {b}: " + " < ".join(
            f"`{c}` ({by_config[c][key]:.2f} at {by_config[c]['bits_per_element']:.3f} b)"
            for c in ranked))
    return lines


def lazy_evaluator(settings: sw.Settings, cache: dict) -> Callable:
    """:func:`experiments.sweep.model_evaluator`, loaded only when a configuration
    actually needs measuring (an aggregation of finished results loads nothing)."""
    def evaluate(name, cache_config, with_needle):
        # the seed draws the codecs' parameters inside the evaluator: part of the key
        key = (settings.model, settings.corpus, settings.windows, settings.window_len,
               settings.seed)
        if key not in cache:
            cache[key] = sw.model_evaluator(settings)
        return cache[key](name, cache_config, with_needle)

    return evaluate


def main(argv: Sequence[str] | None = None, evaluate=None) -> int:
    """Run the chosen parts; print and write every table. ``evaluate`` replaces the model
    (tests)."""
    p = sw.protocol_parser(__doc__.split("\n\n")[0], PARTS, "octopus_lm",
                           window_len=512, summary="lm.json",
                           published="docs/octopus")
    p.add_argument("--window", type=int, default=32, help="raw residual window (tokens)")
    args = p.parse_args(argv)
    parts = args.part or list(PARTS)
    args.docs.mkdir(parents=True, exist_ok=True)
    models: dict = {}

    def run(configs, seed=0, raw_k_layers=BOUNDARY):
        settings = sw.Settings(model=args.model, corpus=args.corpus, windows=args.windows,
                               window_len=args.window_len, chunk=None,
                               residual_window=args.window, sinks=0, seed=seed,
                               raw_k_layers=raw_k_layers)
        fn = evaluate or lazy_evaluator(settings, models)
        rows, _ = sw.run_sweep(configs, settings, args.out, fn, progress=not args.no_progress)
        return sw.with_deltas(rows)

    title = (f"{args.model} on {args.corpus}: {args.windows} x {args.window_len} tokens, "
             f"window {args.window}")
    summary = {"model": args.model, "corpus": args.corpus, "windows": args.windows,
               "window_len": args.window_len, "residual_window": args.window,
               "raw_k_layers": list(BOUNDARY)}
    sections = []
    keep = ("config", "family", "k_codec", "v_codec", "bits_per_element",
            "k_bits_per_element", "v_bits_per_element", "ppl", "delta_pct")
    protocol = None
    if "protocol" in parts:
        protocol = run(protocol_configs())
        table = sw.markdown_table(protocol)
        lines = orderings(protocol)
        sw.write_csv(protocol, args.docs / "lm.csv")
        sw.plot_pareto_views(protocol, args.docs / "lm_pareto.png", "boundary-1, " + title)
        summary["protocol"] = [{k: r[k] for k in keep} for r in protocol]
        sections.append("## Protocol (seed 0)\n\n" + table
                        + "\n\nOrder by perplexity at each nominal b:\n\n" + "\n".join(lines))
    if "seeds" in parts:
        per_seed = {0: protocol or run(seed_configs())}
        for seed in EXTRA_SEEDS:
            per_seed[seed] = run(seed_configs(), seed)
        rows = seed_rows(per_seed)
        table = seed_table(rows, sorted(per_seed))
        ranked = orderings([{**r, "ppl": r["mean"]} for r in rows])
        summary["seeds"] = rows
        sections.append("## Seeds of the rotation (MSE codecs)\n\n" + table
                        + "\n\nOrder by mean perplexity:\n\n" + "\n".join(ranked))
    if "unprotected" in parts:
        rows = run(unprotected_configs(), raw_k_layers=())
        by_config = {r["config"]: r for r in protocol or run(unprotected_configs())}
        lines = ["| codec | bits (no boundary) | ppl (no boundary) | ppl (boundary-1) |",
                 "|---|---|---|---|"]
        for r in rows:
            if r["config"] == "bf16":
                continue
            protected = by_config.get(r["config"], {}).get("ppl")
            lines.append(f"| `{r['config']}` | {r['bits_per_element']:.3f} | {r['ppl']:.2f} | "
                         + (f"{protected:.2f} |" if protected else "- |"))
        summary["unprotected"] = [{k: r[k] for k in keep} for r in rows]
        sections.append("## Without boundary-1\n\n" + "\n".join(lines))
    text = "\n\n".join(sections)
    sw.publish_tables(args.docs, text, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
