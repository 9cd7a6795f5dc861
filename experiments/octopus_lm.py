"""The OCTOPUS paper's language-model protocol on one model and corpus: the five
rotation-preconditioned K codecs at b in {2, 3, 4}, sharing the V codec, the residual
window and the raw boundary blocks.

    python experiments/octopus_lm.py --docs docs/octopus          # all parts
    python experiments/octopus_lm.py --part protocol --windows 4   # a quick look

Recipe (the paper's Sec. 4.2): residual window of 32 raw tokens (``--cache-options``,
default ``window=32``), V by group-wise INT with groups of 32 (``kivi:B,g32,token``, each
codec's ``value_codec``), K of the first and last transformer block kept bf16
("boundary-1", ``layers[0,-1]:k=bf16``), everything counted in the measured bits.
Perplexity over 8 windows of 512 tokens (the paper: 8 chunks of 512).

Parts (``--part``, repeatable; default all):

* ``protocol``: ``turboquant:bB``, ``turboquant:bB,qjl``, ``polarquant:bB``, ``octopus:bB``,
  ``octopus:bB,qjl`` for B in {2, 3, 4}, plus references: ``kivi:2,g32``, ``kivi:4,g32``,
  ``int:4``, Han et al.'s own PolarQuant setting ``polarquant:b3,l4`` and OCTOPUS with the
  uniform split ``octopus:dB,nB``.
* ``seeds``: the three MSE codecs at every B with two more seeds of the codecs' random
  parameters (rotation signs), for mean and spread.
* ``unprotected``: the B = 2 codecs and the B = 4 MSE codecs without boundary-1.

Every perplexity goes through :func:`kvjax.eval.sweep.run_sweep` (resumable JSON per
configuration under ``--out``: a second run only aggregates); the table, CSV, JSON and
Pareto plot go to ``--docs``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvjax import compile_cache
from kvjax.eval import sweep as sw
from models.evaluate import sweep_evaluator

BITS = (2, 3, 4)
FAMILIES = ("turboquant:b{}", "turboquant:b{},qjl", "polarquant:b{}", "octopus:b{}",
            "octopus:b{},qjl")
MSE_FAMILIES = ("turboquant:b{}", "polarquant:b{}", "octopus:b{}")
REFERENCES = ("kivi:2,g32", "kivi:4,g32", "int:4", "polarquant:b3,l4", "octopus:d2,n2",
              "octopus:d3,n3")
EXTRA_SEEDS = (1, 2)
#: the paper's boundary-1: K of the first and last block in bf16
BOUNDARY = "layers[0,-1]:k=bf16"
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


def main(argv: Sequence[str] | None = None, evaluate=None) -> int:
    """Run the chosen parts; print and write every table. ``evaluate`` replaces the model
    (tests)."""
    p = sw.protocol_parser(__doc__.split("\n\n")[0], PARTS, "octopus_lm",
                           window_len=512, summary="lm.json",
                           published="docs/octopus", cache_options="window=32")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    parts = args.part or list(PARTS)
    models: dict = {}

    def settings(seed=0, boundary=True):
        return sw.Settings(model=args.model, corpus=args.corpus, windows=args.windows,
                           window_len=args.window_len, seed=seed,
                           cache_options=f"{args.cache_options} {BOUNDARY if boundary else ''}")

    def run(configs, seed=0, boundary=True):
        fn = evaluate or sw.lazy_evaluator(settings(seed, boundary), models, sweep_evaluator)
        rows, _ = sw.run_sweep(configs, settings(seed, boundary), args.out, fn,
                               progress=not args.no_progress)
        return sw.with_deltas(rows)

    try:
        protected = settings()
    except ValueError as err:
        p.error(str(err))
    args.docs.mkdir(parents=True, exist_ok=True)
    title = protected.title()
    summary = {"model": args.model, "corpus": args.corpus, "windows": args.windows,
               "window_len": args.window_len, "cache_options": protected.cache_options}
    sections = []
    keep = ("config", "family", "cache_spec", "k_codec", "v_codec", "bits_per_element",
            "k_bits_per_element", "v_bits_per_element", "ppl", "delta_pct")
    protocol = None
    if "protocol" in parts:
        protocol = run(protocol_configs())
        table = sw.markdown_table(protocol)
        lines = orderings(protocol)
        sw.write_csv(protocol, args.docs / "lm.csv")
        sw.plot_pareto_views(protocol, args.docs / "lm_pareto.png", title)
        summary["protocol"] = [{k: r[k] for k in keep} for r in protocol]
        sections.append("## Protocol (seed 0)\n\n" + table
                        + "\n\nOrder by perplexity at each nominal b:\n\n" + "\n".join(lines))
    if "seeds" in parts:
        per_seed = {0: protocol or run(seed_configs())}
        for seed in EXTRA_SEEDS:
            per_seed[seed] = run(seed_configs(), seed)
        rows = sw.seed_rows(per_seed)
        table = sw.seed_table(rows, sorted(per_seed))
        ranked = orderings([{**r, "ppl": r["mean"]} for r in rows])
        summary["seeds"] = rows
        sections.append("## Seeds of the rotation (MSE codecs)\n\n" + table
                        + "\n\nOrder by mean perplexity:\n\n" + "\n".join(ranked))
    if "unprotected" in parts:
        rows = run(unprotected_configs(), boundary=False)
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
