"""The long-context retrieval suite (:mod:`kvjax.eval.retrieval`: passkey, single,
multi-key and multi-value needles, variable tracking, common words) on one model, per
cache configuration: exact-match accuracy per task and length, a table and a plot.

    python experiments/retrieval.py --codec int:4 --codec kivi:2,g32
    python experiments/retrieval.py --codec hqmq:s96,r4 --lengths 2048 4096 8192 \\
        --depths 0.1 0.5 0.9 --trials 2 --json results/retrieval.json

A configuration is a cache spec; ``bf16`` always runs first, the baseline. A length is
the context a case fills (prompt and answer; the embedded model's context is 8192).
Results go to ``OUT/RUN/configs/*.json`` (``RUN`` names the model, corpus, lengths,
depths, trials, tasks and seed) as each configuration finishes, so a second run with the
same settings skips what is done (``--force`` redoes it); then ``summary.md`` and
``accuracy.png`` (accuracy vs length, a panel per task and one for their mean).
``--json PATH`` also writes every answer, one object per case.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvjax import compile_cache
from kvjax.eval import retrieval as rt

DEFAULT_LENGTHS = (2048, 4096, 8192)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", "--cache", action="append", dest="configs", default=[],
                   metavar="SPEC", help="a cache spec; repeat for several")
    p.add_argument("--model", default="smollm2-135m", metavar="NAME_OR_PATH")
    p.add_argument("--corpus", default="shakespeare", metavar="NAME|PATH")
    p.add_argument("--tasks", nargs="+", default=list(rt.TASKS), choices=rt.TASKS)
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    p.add_argument("--depths", type=float, nargs="+", default=list(DEFAULT_DEPTHS))
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="draws the values and codec keys")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="prompts per generate call (default: all of one length)")
    p.add_argument("--out", type=Path, default=Path("results") / "retrieval")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write every answer here")
    p.add_argument("--force", action="store_true", help="redo finished configurations")
    p.add_argument("--no-progress", action="store_true")
    compile_cache.add_argument(p)
    return p


def main(argv: Sequence[str] | None = None, build=None) -> int:
    """Run the suite and print the table. ``build(settings) -> answer(config,
    cache_config)`` replaces the model (tests); by default the model and corpus load
    once, on the first configuration that needs answering."""
    args = build_parser().parse_args(argv)
    compile_cache.from_args(args)
    settings = rt.SuiteSettings(model=args.model, corpus=args.corpus, tasks=args.tasks,
                                lengths=args.lengths, depths=args.depths,
                                trials=args.trials, seed=args.seed)
    try:
        from kvjax.eval.needle import check_grid
        from kvjax.spec import parse_cache

        check_grid(args.lengths, args.depths, args.trials)
        for config in args.configs:
            parse_cache(config)
        if build is None:
            import models

            context = models.context_length(args.model)
            too_long = [n for n in args.lengths if n > context]
            if too_long:
                raise ValueError(f"lengths {too_long} exceed the model's context "
                                 f"({context} tokens)")
    except ValueError as err:  # CodecError and CacheSpecError are ValueErrors
        print(f"retrieval: {err}", file=sys.stderr)
        return 2
    progress = not args.no_progress
    loaded: dict = {}

    def answer(config, cache_config):
        if "answer" not in loaded:
            loaded["answer"] = (build or _model_answers)(settings, args.batch, progress)
        return loaded["answer"](config, cache_config)

    rows, run_dir = rt.run_suite(args.configs, settings, args.out, answer, force=args.force,
                                 progress=progress)
    print(rt.write_suite_reports(rows, settings, run_dir))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def _model_answers(settings: rt.SuiteSettings, batch: int | None, progress: bool):
    """Load the model and build the cases once; return ``answer``."""
    import jax.numpy as jnp

    import models
    from models.evaluate import suite_answer

    config, params, tokenizer = models.load(settings.model, jnp.float32)
    return suite_answer(params, config, tokenizer, settings, batch_size=batch,
                        progress=progress)


if __name__ == "__main__":
    sys.exit(main())
