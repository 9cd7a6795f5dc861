"""Eviction x quantization at equal cache size (:mod:`kvjax.eval.tradeoff`): quantization
alone, eviction alone (StreamingLLM, H2O, SnapKV) and both, on one model, measured by the
continuation after a prefilled prompt (perplexity, KL, top-1 agreement against bf16) and
by the retrieval suite, against the cache's bits per sequence element.

    python experiments/eviction.py
    python experiments/eviction.py --budgets 50% 25% --codecs int:8 kivi:4,g32 \\
        --retrieval-lengths 2048 4096 --out results/eviction

Every point prefills its prompt exactly, then keeps and encodes (:mod:`kvjax.eviction`).
Results go to ``OUT/continuation/RUN/`` and ``OUT/retrieval/RUN/`` (one JSON per point,
read back by a second run with the same settings; ``--force`` redoes them), then
``OUT/summary.md``, ``OUT/grid.csv`` and ``OUT/tradeoff.png``. ``--retrieval-lengths``
with no value skips the retrieval suite.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvjax import compile_cache
from kvjax.eval import retrieval as rt
from kvjax.eval import tradeoff


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", metavar="NAME_OR_PATH")
    p.add_argument("--corpus", default="shakespeare", metavar="NAME|PATH")
    p.add_argument("--budgets", nargs="+", default=list(tradeoff.BUDGETS),
                   help="eviction budgets (shares like 25%% or token counts)")
    p.add_argument("--codecs", nargs="+", default=list(tradeoff.CODECS),
                   help="the codecs of quantization alone")
    p.add_argument("--policies", nargs="+", default=["streaming", "h2o", "snapkv"],
                   choices=["streaming", "h2o", "snapkv"])
    p.add_argument("--combined", nargs="*", default=[f"{a}+{b}" for a, b in tradeoff.COMBINED],
                   metavar="POLICY+CODEC", help="eviction and codec pairs")
    p.add_argument("--combined-budgets", nargs="+", default=list(tradeoff.COMBINED_BUDGETS))
    p.add_argument("--windows", type=int, default=4, help="continuation windows")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of a window")
    p.add_argument("--follow", type=int, default=128, help="scored tokens after it")
    p.add_argument("--retrieval-lengths", type=int, nargs="*", default=[2048])
    p.add_argument("--tasks", nargs="+", default=list(rt.TASKS), choices=rt.TASKS)
    p.add_argument("--depths", type=float, nargs="+", default=[0.5])
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results") / "eviction")
    p.add_argument("--force", action="store_true", help="redo finished points")
    p.add_argument("--no-progress", action="store_true")
    compile_cache.add_argument(p)
    return p


def main(argv: Sequence[str] | None = None, build=None) -> int:
    """Run the grid and print its table. ``build(continuation, retrieval) -> (measure,
    answer)`` replaces the model (tests); by default it loads once, when first needed."""
    args = build_parser().parse_args(argv)
    compile_cache.from_args(args)
    try:
        pairs = [tuple(c.split("+", 1)) for c in args.combined]
        if any(len(p) != 2 for p in pairs):
            raise ValueError("--combined takes POLICY+CODEC pairs, e.g. snapkv+kivi:4,g32")
        points = tradeoff.default_points(args.budgets, args.codecs, args.policies, pairs,
                                         args.combined_budgets)
        if args.windows < 1 or not 1 <= args.context or args.follow < 1:
            raise ValueError("--windows, --context and --follow must be positive")
        retrieval = None
        if args.retrieval_lengths:
            from kvjax.eval.needle import check_grid

            check_grid(args.retrieval_lengths, args.depths, args.trials)
            retrieval = rt.SuiteSettings(model=args.model, corpus=args.corpus,
                                         tasks=args.tasks, lengths=args.retrieval_lengths,
                                         depths=args.depths, trials=args.trials,
                                         seed=args.seed)
    except ValueError as err:  # CacheSpecError is a ValueError
        print(f"eviction: {err}", file=sys.stderr)
        return 2
    continuation = tradeoff.ContinuationSettings(
        model=args.model, corpus=args.corpus, windows=args.windows, context=args.context,
        follow=args.follow, seed=args.seed)
    progress = not args.no_progress
    loaded: dict = {}

    def bound(which):
        def call(config, cache_config):
            if not loaded:
                measure, answer = (build or _model_tasks)(continuation, retrieval, progress)
                loaded.update(measure=measure, answer=answer)
            return loaded[which](config, cache_config)

        return call

    rows = tradeoff.run_points(points, continuation, args.out, bound("measure"),
                               retrieval=retrieval, answer=bound("answer"), force=args.force,
                               progress=progress)
    title = continuation.title() + (
        "" if retrieval is None else
        f"; retrieval at {', '.join(map(str, retrieval.lengths))} tokens")
    print(tradeoff.write_reports(rows, args.out, title))
    return 0


def _model_tasks(continuation: tradeoff.ContinuationSettings,
                 retrieval: rt.SuiteSettings | None, progress: bool):
    """Load the model and corpus once; return ``(measure, answer)``."""
    import dataclasses

    from kvjax.spec import CacheConfig
    from models.evaluate import cache_continuation, load_model_and_windows, suite_answer

    window_len = continuation.context + continuation.follow
    config, params, tokenizer, _, windows = load_model_and_windows(
        continuation.model, continuation.corpus, continuation.windows, window_len)

    def measure(name, cache_config):
        result = cache_continuation(params, config, cache_config, windows,
                                    context=continuation.context, seed=continuation.seed,
                                    chunk=1024, reference=CacheConfig(k="bf16"),
                                    progress=progress)
        row = dataclasses.asdict(result)
        row.pop("kl_by_position")
        return [row]

    answer = None if retrieval is None else suite_answer(
        params, config, tokenizer, retrieval, progress=progress)
    return measure, answer


if __name__ == "__main__":
    sys.exit(main())
