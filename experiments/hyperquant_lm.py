"""The HyperQuant paper's KV-only language-model protocol on one model and corpus: E8
across the rate range, the four lattices at 3 and 4 bps, the rotation x dither menu at
2 bps, each with and without a 32-token residual window, next to the other codecs.

    python experiments/hyperquant_lm.py --docs docs/hyperquant          # all parts
    python experiments/hyperquant_lm.py --part rates --windows 2         # a quick look

K and V both use the codec (the paper's symmetric K = V); no layer is kept raw unless
``--cache-options`` says so (``layers[0,-1]:k=bf16``: K of the first and last block in
bf16, the OCTOPUS recipe). Perplexity over 8 windows of 512 tokens, every bit measured
from the cache arrays: the fp16 norms, each block's fixed Rice budget and sub-stream
index words, the raw window.

Parts (``--part``, repeatable; default all), each at every ``--residual`` (default 0 and 32):

* ``rates``: ``hyperquant:e8,Rbps`` for R in 1.7..4; ``d4``, ``a2``, ``z`` at 3 and 4 bps.
* ``bias``: E8 at 2 bps with rotation ``none`` / ``signs`` / ``haar``, with and without
  dither (the paper's Table 6).
* ``context``: the other codecs at comparable bits: ``int:4``, ``kivi:2,g32``,
  ``kivi:4,g32``, ``turboquant:b2..4``, ``octopus:b2``, ``octopus:b3``.
* ``seeds``: E8 at 2, 3 and 4 bps with two more seeds of the codec parameters (rotation
  signs; the calibration is data-free and fixed).

Every perplexity goes through :func:`kvjax.eval.sweep.run_sweep` (resumable JSON per
configuration under ``--out``: a second run only aggregates); tables, CSV, JSON and
Pareto plots go to ``--docs``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvjax import compile_cache
from kvjax.eval import sweep as sw
from models.evaluate import sweep_evaluator

E8_RATES = (1.7, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0)
OTHER_LATTICES = ("d4", "a2", "z")
ROTATIONS = ("none", "signs", "haar")
CONTEXT = ("int:4", "kivi:2,g32", "kivi:4,g32", "turboquant:b2", "turboquant:b3",
           "turboquant:b4", "octopus:b2", "octopus:b3")
SEED_RATES = (2.0, 3.0, 4.0)
EXTRA_SEEDS = (1, 2)
PARTS = ("rates", "bias", "context", "seeds")


def spec(lattice: str, rate: float, rotation: str = "none", dither: bool = False) -> str:
    """The canonical spec string of a HyperQuant configuration."""
    parts = [lattice, f"{rate:g}bps"]
    if rotation != "none":
        parts.append(rotation)
    if dither:
        parts.append("dither")
    return "hyperquant:" + ",".join(parts)


def rate_configs() -> list[str]:
    """E8 over the range, then the other lattices at 3 and 4 bps."""
    return ([spec("e8", r) for r in E8_RATES]
            + [spec(lat, r) for lat in OTHER_LATTICES for r in (3.0, 4.0)])


def bias_configs() -> list[str]:
    """E8 at 2 bps: three rotations x dither off/on."""
    return [spec("e8", 2.0, rot, d) for rot in ROTATIONS for d in (False, True)]


def seed_configs() -> list[str]:
    """E8 at 2, 3, 4 bps."""
    return [spec("e8", r) for r in SEED_RATES]


def label(row: dict) -> str:
    """A table label: the configuration, or ``hyperquant:...`` shortened."""
    return row["config"].replace("hyperquant:", "hq:")


def lm_table(rows: Sequence[dict]) -> str:
    """Markdown: configuration, measured bits, KV compression, ppl, delta, fallbacks."""
    lines = ["| codec | bits / element (K, V) | KVx | ppl | vs bf16 | fallback blocks |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["bits_per_element"], r["config"])):
        lines.append(
            f"| `{r['config']}` | {r['bits_per_element']:.3f} ({r['k_bits_per_element']:.2f}, "
            f"{r['v_bits_per_element']:.2f}) | {16 / r['bits_per_element']:.2f} | "
            f"{r['ppl']:.3f} | {r['delta_pct']:+.2f}% | {r.get('fallback_blocks', 0)} |")
    return "\n".join(lines)


def bias_table(by_window: dict[int, list[dict]]) -> str:
    """Markdown: rotation x dither at 2 bps, one ppl column per residual window."""
    windows = sorted(by_window)
    lookup = {w: {r["config"]: r for r in rows} for w, rows in by_window.items()}
    head = "| rotation | dither | " + " | ".join(f"ppl (window {w})" for w in windows) + " |"
    lines = [head, "|---|---|" + "---|" * len(windows)]
    for rot in ROTATIONS:
        for d in (False, True):
            cells = []
            for w in windows:
                r = lookup[w].get(spec("e8", 2.0, rot, d))
                cells.append(f"{r['ppl']:.3f} ({r['delta_pct']:+.1f}%)" if r else "-")
            lines.append(f"| {rot} | {'yes' if d else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def window_table(by_window: dict[int, list[dict]]) -> str:
    """Markdown: each configuration's bits and ppl at every residual window."""
    windows = sorted(by_window)
    lookup = {w: {r["config"]: r for r in rows} for w, rows in by_window.items()}
    configs = list(dict.fromkeys(r["config"] for w in windows for r in by_window[w]))
    head = "| codec | " + " | ".join(f"bits, ppl (window {w})" for w in windows) + " |"
    lines = [head, "|---|" + "---|" * len(windows)]
    for c in configs:
        cells = []
        for w in windows:
            r = lookup[w].get(c)
            cells.append(f"{r['bits_per_element']:.3f}, {r['ppl']:.3f} "
                         f"({r['delta_pct']:+.1f}%)" if r else "-")
        lines.append(f"| `{c}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, evaluate=None) -> int:
    """Run the chosen parts at every residual window; print and write every table.
    ``evaluate`` replaces the model (tests)."""
    p = sw.protocol_parser(__doc__.split("\n\n")[0], PARTS, "hyperquant_lm",
                           window_len=512, summary="lm.json",
                           published="docs/hyperquant")
    p.add_argument("--residual", type=int, nargs="+", default=[0, 32],
                   help="raw residual windows (tokens) to run every part at")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    parts = args.part or list(PARTS)
    models: dict = {}

    def settings(window, seed=0):
        return sw.Settings(model=args.model, corpus=args.corpus, windows=args.windows,
                           window_len=args.window_len, seed=seed,
                           cache_options=f"window={window} {args.cache_options}")

    def run(configs, window, seed=0):
        fn = evaluate or sw.lazy_evaluator(settings(window, seed), models, sweep_evaluator)
        rows, _ = sw.run_sweep(configs, settings(window, seed), args.out, fn,
                               progress=not args.no_progress)
        return sw.with_deltas(rows)

    try:
        options = sw.Settings(model=args.model, corpus=args.corpus, windows=args.windows,
                              window_len=args.window_len, cache_options=args.cache_options)
        for window in args.residual:
            settings(window)
    except ValueError as err:
        p.error(str(err))
    args.docs.mkdir(parents=True, exist_ok=True)
    title = options.title()
    keep = ("config", "family", "cache_spec", "k_codec", "v_codec", "bits_per_element",
            "k_bits_per_element", "v_bits_per_element", "ppl", "delta_pct",
            "fallback_blocks")
    summary: dict = {"model": args.model, "corpus": args.corpus, "windows": args.windows,
                     "window_len": args.window_len, "cache_options": options.cache_options,
                     "residual_windows": args.residual, "parts": {}}
    sections = []
    main_parts = [pt for pt in ("rates", "bias", "context") if pt in parts]
    configs_of = {"rates": rate_configs, "bias": bias_configs, "context": lambda: list(CONTEXT)}
    by_window: dict[int, list[dict]] = {}
    for window in args.residual:
        configs = [c for pt in main_parts for c in configs_of[pt]()]
        if not configs:
            break
        rows = run(configs, window)
        by_window[window] = rows
        summary["parts"][f"window{window}"] = [{k: r.get(k) for k in keep} for r in rows]
        sw.write_csv(rows, args.docs / f"lm_w{window}.csv")
        suffix = f", residual window {window}" if window else ", no residual window"
        sw.plot_pareto_views(rows, args.docs / f"lm_pareto_w{window}.png", title + suffix,
                             max_bits=6.0)
        sections.append(f"## Residual window {window}\n\n" + lm_table(rows))
    if by_window:
        if "bias" in main_parts:
            sections.append("## Rotation and dither at 2 bps (E8)\n\n" + bias_table(by_window))
        if len(by_window) > 1:
            sections.append("## With and without the residual window\n\n"
                            + window_table(by_window))
    if "seeds" in parts:
        window = args.residual[0]
        per_seed = {0: by_window.get(window) or run(seed_configs(), window)}
        for seed in EXTRA_SEEDS:
            per_seed[seed] = run(seed_configs(), window, seed)
        rows = [r for r in sw.seed_rows(per_seed) if r["config"] in seed_configs()]
        summary["seeds"] = {"residual_window": window, "rows": rows}
        sections.append(f"## Seeds of the codec parameters (window {window})\n\n"
                        + sw.seed_table(rows, sorted(per_seed)))
    text = f"# HyperQuant, KV-only: {title}\n\n" + "\n\n".join(sections)
    sw.publish_tables(args.docs, text, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
