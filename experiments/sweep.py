"""Sweep cache configurations on one model and corpus: perplexity (and optionally needle
retrieval) per configuration, one JSON per configuration, then a CSV, a markdown table
and Pareto plots (:mod:`kvjax.eval.sweep`).

    python experiments/sweep.py --preset demo
    python experiments/sweep.py --codec int:4 --codec kivi:2,g32 --codec "k=int:4 v=int:2" \\
        --windows 8 --window-len 512 --cache-options "window=32 layers[0,-1]:k=bf16" --needle
    python experiments/sweep.py --preset rotation --seeds 0 1 2 3 4

A configuration is a cache spec (``int:4``; KIVI's spec gives V its per-token variant;
``k=SPEC v=SPEC`` sets them apart); ``--cache-options`` are cache-spec clauses added to
every configuration. Results go to ``OUT/RUN/configs/*.json`` where ``RUN`` names the
model, corpus, windows and cache options, so a second run with the same settings skips
every configuration already done (resumable; ``--force`` redoes them). ``bf16`` always
runs: it is the baseline of every delta. Every other configuration also runs the bf16
cache beside it for the next-token KL divergence and top-1 agreement
(:mod:`kvjax.eval.distribution`: table columns, ``pareto_kl.png``,
``kl_by_position.png``); ``--no-distribution`` skips that (half the work).

``--seed S`` draws the codecs' parameters (sign flips, rotations, projections, HQMQ's
quaternions, dither keys) from ``S`` and names the run. ``--seeds S [S ...]`` runs the
configurations once per seed, each seed its own resumable run folder ``OUT/RUN`` as
``--seed`` would write it, the model loaded once: a configuration whose parameters depend
on the seed is measured for every seed, one whose parameters do not (``int``, ``kivi``,
``bf16``...) once (with ``--needle``, whose prompts the seed draws, every configuration
runs for every seed). The report over the seeds goes to ``OUT/RUN-seedsLABEL`` (``RUN``
without its seed; ``seeds0-4`` for ``--seeds 0 1 2 3 4``): ``summary.csv`` and
``summary.md`` (bits, ppl per seed, mean, sd, min, max and the delta of the mean to bf16;
a configuration measured once is marked and has sd 0) and ``pareto.png``/
``pareto_zoom.png`` (the means, with min..max error bars). One seed given to ``--seeds``
is the same as ``--seed``.

``--devices N`` measures N configurations at once, each on its own device (a thread per
device, each with a copy of the model): on a machine with N GPUs, N times the
configurations per hour, with the results and the resumable folders of a serial run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvjax import compile_cache
from kvjax.eval import sweep as sw

#: named lists of configurations; ``demo`` is what ``make demo`` runs
PRESETS: dict[str, tuple[str, ...]] = {
    "demo": (
        "bf16", "fp8", "int:8", "int:6", "int:5", "int:4", "int:3", "int:2",
        "kivi:8,g32", "kivi:4,g32", "kivi:3,g32", "kivi:2,g32",
        "saw:h64", "saw:h64,b3", "saw:h64,b2",
        # each paper codec at two or three of its own operating points (the papers'
        # protocol scripts sweep them in full)
        "hqmq:s96,r4", "hqmq:s24,r3",
        "turboquant:b3", "turboquant:b2", "polarquant:b3", "polarquant:b2",
        "octopus:b3", "octopus:b2",
        "hyperquant:e8,4bps", "hyperquant:e8,3bps", "hyperquant:e8,2bps",
    ),
    "int": ("bf16", "int:8", "int:7", "int:6", "int:5", "int:4", "int:3", "int:2"),
    "kivi": ("bf16", "kivi:8,g32", "kivi:4,g32", "kivi:3,g32", "kivi:2,g32",
             "kivi:4,g64", "kivi:2,g64", "kivi:2,g128"),
    # the rotation-preconditioned family at nominal 2 / 3 / 4 bits (experiments/octopus_lm.py
    # runs it with the OCTOPUS paper's window and boundary layers)
    "rotation": ("bf16", *(f"{c}:b{b}" for b in (2, 3, 4)
                           for c in ("turboquant", "polarquant", "octopus"))),
    # HyperQuant's E8 over the rate range and the other lattices at 3 bps
    # (experiments/hyperquant_lm.py runs the paper's whole KV protocol)
    "hyperquant": ("bf16", *(f"hyperquant:e8,{r}bps" for r in (1.7, 2, 2.5, 3, 4)),
                   "hyperquant:d4,3bps", "hyperquant:a2,3bps", "hyperquant:z,3bps"),
    # SAW rotation blocks, sign flips and rotated V at 4 bits, vs plain int:4 (D = 64)
    "saw": ("bf16", "int:4", "saw:h16", "saw:h32", "saw:h64", "saw:h64,signs",
            "saw:h64,kv", "saw:h64,b8", "saw:h64,b3", "saw:h64,b2", "int:3", "int:2"),
}


def build_parser() -> argparse.ArgumentParser:
    """The arguments of the sweep script."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codec", "--cache", action="append", dest="configs", metavar="CONFIG",
                   help="a configuration, a cache spec such as int:4 or 'k=int:4 v=int:2' "
                        "(repeat); added to the preset's if both are given")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named list of configurations (default: demo, without --codec)")
    p.add_argument("--model", default="smollm2-135m", metavar="NAME_OR_PATH")
    p.add_argument("--corpus", default="shakespeare", metavar="NAME|PATH")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=256)
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: window)")
    p.add_argument("--cache-options", default="", metavar="CLAUSES",
                   help="cache-spec clauses added to every configuration: a raw residual "
                        "window, raw sink tokens, per-layer rules, attention, e.g. "
                        "'window=32 sinks=4 layers[0,-1]:k=bf16' (the bits of raw layers "
                        "are counted)")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=0, metavar="S",
                       help="the seed of the codec parameters (default 0)")
    seeds.add_argument("--seeds", type=int, nargs="+", default=None, metavar="S",
                       help="run every seed given, each its own run (a configuration "
                            "whose parameters do not depend on the seed once), and report "
                            "mean and spread over them in OUT/RUN-seedsLABEL")
    p.add_argument("--needle", action="store_true", help="also run needle retrieval")
    p.add_argument("--no-distribution", action="store_true",
                   help="skip the KL / top-1 comparison with the bf16 cache (half the work)")
    p.add_argument("--needle-lengths", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--needle-depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--needle-trials", type=int, default=2)
    p.add_argument("--needle-batch", type=int, default=None,
                   help="needle prompts per generate call (default: all of one length); "
                        "the reference attention holds [batch, heads, length, length] scores")
    p.add_argument("--devices", type=int, default=1, metavar="N",
                   help="measure N configurations at once, one per device (each device "
                        "holds a copy of the model); the results of a serial run")
    p.add_argument("--out", type=Path, default=Path("results") / "sweep")
    p.add_argument("--force", action="store_true", help="redo finished configurations")
    p.add_argument("--no-progress", action="store_true")
    compile_cache.add_argument(p)
    return p


def main(argv: Sequence[str] | None = None, evaluate: sw.Evaluate | None = None,
         build: Callable[[sw.Settings], sw.Evaluate] | None = None) -> int:
    """Run the sweep; prints the table and the paths of the CSV, table and plots.

    ``evaluate`` (every seed's evaluator) or ``build`` (``build(settings)``, the evaluator
    of a seed's settings) replaces the model evaluation (tests use them); by default the
    model and corpus of the arguments are loaded once, when a configuration needs
    measuring. Returns 2 with a one-line reason on bad input.
    """
    args = build_parser().parse_args(argv)
    compile_cache.from_args(args)
    try:
        for name in ("windows", "window_len"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if args.needle and min(args.needle_trials, *args.needle_lengths,
                               args.needle_batch or 1) < 1:
            raise ValueError("--needle-trials, --needle-lengths and --needle-batch must be "
                             ">= 1")
        if args.seeds is not None and min(args.seeds) < 0:
            raise ValueError("--seeds must be >= 0")
        seeds = sorted(set(args.seeds)) if args.seeds else [args.seed]
        devices = sw.sweep_devices(args.devices)
        configs = list(PRESETS[args.preset]) if args.preset else []
        configs += args.configs or []
        if not configs:
            configs = list(PRESETS["demo"])
        settings = sw.Settings(
            model=args.model, corpus=str(args.corpus), windows=args.windows,
            window_len=args.window_len, chunk=args.chunk, cache_options=args.cache_options,
            seed=seeds[0],
            needle_lengths=tuple(args.needle_lengths) if args.needle else (),
            needle_depths=tuple(args.needle_depths) if args.needle else (),
            needle_trials=args.needle_trials if args.needle else 0,
            distribution=not args.no_distribution,
        )
        for config in configs:
            sw.cache_config(config, settings)   # bad specs fail before the model loads
        if build is None and evaluate is not None:
            build = lambda _: evaluate
        if build is None:
            from models.evaluate import sweep_builder

            build = sweep_builder(needle_batch=args.needle_batch)
        if len(seeds) == 1:
            rows, run_dir = sw.run_sweep(configs, settings, args.out,
                                         sw.lazy_evaluator(settings, {}, build),
                                         force=args.force, progress=not args.no_progress,
                                         devices=devices)
        else:
            per_seed, seeds_dir = sw.run_seeds(configs, settings, seeds, args.out, build,
                                               force=args.force,
                                               progress=not args.no_progress,
                                               devices=devices)
    except (ValueError, OSError) as err:
        print(f"sweep: error: {err}", file=sys.stderr)
        return 2
    if len(seeds) == 1:
        print(sw.write_reports(rows, settings, run_dir))
    else:
        print(sw.write_seed_reports(per_seed, settings, seeds_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
