"""Calibrated codecs against data-free ones at equal stored bits, on text the fits never
saw (:mod:`kvjax.eval.calibrated`): SAW's k-means residual VQ (C centroids), its
query-aware basis and both, fitted on one corpus and evaluated on the other, both ways;
and per-layer bit allocations (:mod:`kvjax.allocation`) from each layer's sensitivity
measured on the fit corpus, against uniform widths at the same bits.

    python experiments/calibration.py
    python experiments/calibration.py --bits 2 4 --centroids 16 256 --out results/calib

Each direction's points go to ``OUT/RUN/configs/`` (one JSON each, read back by a second
run with equal settings; ``--force`` redoes them) and its fitted parameters to
``OUT/RUN/fits/``, the measured sensitivities to ``OUT/RUN/sensitivity-*/``; then
``OUT/summary.md``, ``OUT/calibration.csv`` and ``OUT/calibration.png``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvjax import compile_cache
from kvjax.eval import calibrated
from kvjax.eval.retrieval import run_suite
from kvjax.spec import parse_cache


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", metavar="NAME_OR_PATH")
    p.add_argument("--corpora", nargs=2, default=list(calibrated.DIRECTIONS[0]),
                   metavar=("A", "B"), help="fit on A evaluate on B, and the reverse")
    p.add_argument("--bits", type=int, nargs="+", default=list(calibrated.BITS))
    p.add_argument("--centroids", type=int, nargs="+", default=list(calibrated.CENTROIDS))
    p.add_argument("--large", type=int, default=calibrated.LARGE,
                   help="centroids fitted at 4 bits only (0: none)")
    p.add_argument("--hqmq", nargs="*", default=list(calibrated.HQMQ), metavar="sS,rB",
                   help="HQMQ points run with the Haar-random and the learned codebook")
    p.add_argument("--fit-windows", type=int, default=8, help="calibration windows")
    p.add_argument("--fit-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--windows", type=int, default=4, help="evaluation windows")
    p.add_argument("--window-len", type=int, default=256, help="tokens per evaluation window")
    p.add_argument("--budgets", type=float, nargs="*", default=[3.5, 4.5],
                   help="bits per element of per-layer allocations (none: skip them)")
    p.add_argument("--candidates", nargs="+", default=["int:2", "int:4", "int:8"],
                   help="the codecs an allocation chooses from per (layer, K|V)")
    p.add_argument("--sensitivity-windows", type=int, default=2,
                   help="windows of the fit corpus (of --window-len) that measure each "
                        "layer's sensitivity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results") / "calibration")
    p.add_argument("--force", action="store_true", help="redo finished points")
    p.add_argument("--no-progress", action="store_true")
    compile_cache.add_argument(p)
    return p


def main(argv: Sequence[str] | None = None, build=None) -> int:
    """Run both directions and print the table. ``build(settings, fits_dir, progress) ->
    measure`` replaces the model (tests); by default it loads when first needed."""
    args = build_parser().parse_args(argv)
    compile_cache.from_args(args)
    try:
        configs = calibrated.default_configs(args.bits, args.centroids, large=args.large,
                                             hqmq=args.hqmq)
        for config in configs:
            parse_cache(config)
        if min(args.fit_windows, args.fit_len, args.windows, args.window_len) < 1:
            raise ValueError("--fit-windows, --fit-len, --windows and --window-len must be "
                             "positive")
    except ValueError as err:  # CacheSpecError is a ValueError
        print(f"calibration: {err}", file=sys.stderr)
        return 2
    progress = not args.no_progress
    a, b = args.corpora
    rows = []
    for fit_corpus, eval_corpus in ((a, b), (b, a)):
        settings = calibrated.CalibrationSettings(
            model=args.model, fit_corpus=fit_corpus, eval_corpus=eval_corpus,
            fit_windows=args.fit_windows, fit_len=args.fit_len, windows=args.windows,
            window_len=args.window_len, seed=args.seed)
        run_dir = args.out / settings.run_name()
        tasks = _lazy(build or _model_tasks, settings, run_dir / "fits", progress)
        allocated = _allocations(args, run_dir, tasks, fit_corpus)
        found, _ = run_suite([*configs, *allocated], settings, args.out,
                             _measure_of(tasks), force=args.force, progress=progress)
        rows += found
    title = (f"{args.model}: fitted on {args.fit_windows}x{args.fit_len} tokens of one "
             f"corpus, evaluated on {args.windows}x{args.window_len} of the other")
    print(calibrated.write_reports(rows, args.out, title))
    return 0


def _lazy(build, settings, fits_dir, progress):
    """``tasks() -> (measure, sensitivity)``, built on the first call (finished points
    and stored sensitivities cost no model load)."""
    built = []

    def tasks():
        if not built:
            built.append(build(settings, fits_dir, progress))
        return built[0]

    return tasks


def _measure_of(tasks):
    return lambda name, cache_config: tasks()[0](name, cache_config)


def _allocations(args, run_dir: Path, tasks, fit_corpus: str) -> list[str]:
    """The cache specs of the per-layer allocations at ``--budgets``, from the
    sensitivities stored in ``run_dir`` or measured (and stored) now."""
    if not args.budgets:
        return []
    from kvjax.allocation import Sensitivity, allocate
    from kvjax.eval.sweep import config_slug

    name = config_slug(" ".join([*args.candidates, f"w{args.sensitivity_windows}"]))
    path = run_dir / f"sensitivity-{name}"
    if (path / "kvjax.json").exists() and not args.force:
        sensitivity = Sensitivity.load(path)
    else:
        sensitivity = tasks()[1](args.candidates, args.sensitivity_windows)
        sensitivity.save(path, metadata={"model": args.model, "corpus": fit_corpus,
                                         "windows": args.sensitivity_windows,
                                         "window_len": args.window_len}, overwrite=True)
    return [allocate(sensitivity, budget).spec for budget in args.budgets]


def _model_tasks(settings: calibrated.CalibrationSettings, fits_dir: Path, progress: bool):
    """Load the model once; return ``(measure, sensitivity(candidates, windows))``."""
    from kvjax.eval.corpus import load_corpus, tokenize_prefix, windows
    from models.evaluate import calibrated_measure, layer_sensitivity, load_model_and_windows

    loaded = load_model_and_windows(settings.model, settings.eval_corpus, settings.windows,
                                    settings.window_len)
    config, params, tokenizer = loaded[:3]

    def sensitivity(candidates, count):
        ids = tokenize_prefix(tokenizer, load_corpus(settings.fit_corpus),
                              count * settings.window_len)
        return layer_sensitivity(params, config, windows(ids, count, settings.window_len),
                                 candidates, seed=settings.seed, progress=progress)

    return calibrated_measure(settings, fits_dir, progress=progress, loaded=loaded), sensitivity


if __name__ == "__main__":
    sys.exit(main())
