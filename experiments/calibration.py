"""Calibrated codecs against data-free ones at equal stored bits, on text the fits never
saw (:mod:`kvjax.eval.calibrated`): SAW's k-means residual VQ (C centroids), its
query-aware basis and both, fitted on one corpus and evaluated on the other, both ways.

    python experiments/calibration.py
    python experiments/calibration.py --bits 2 4 --centroids 16 256 --out results/calib

Each direction's points go to ``OUT/RUN/configs/`` (one JSON each, read back by a second
run with equal settings; ``--force`` redoes them) and its fitted parameters to
``OUT/RUN/fits/``; then ``OUT/summary.md``, ``OUT/calibration.csv`` and
``OUT/calibration.png``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

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
    p.add_argument("--fit-windows", type=int, default=8, help="calibration windows")
    p.add_argument("--fit-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--windows", type=int, default=4, help="evaluation windows")
    p.add_argument("--window-len", type=int, default=256, help="tokens per evaluation window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results") / "calibration")
    p.add_argument("--force", action="store_true", help="redo finished points")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None, build=None) -> int:
    """Run both directions and print the table. ``build(settings, fits_dir, progress) ->
    measure`` replaces the model (tests); by default it loads when first needed."""
    args = build_parser().parse_args(argv)
    try:
        configs = calibrated.default_configs(args.bits, args.centroids)
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
        fits_dir = args.out / settings.run_name() / "fits"
        measure = _lazy(build or _model_measure, settings, fits_dir, progress)
        found, _ = run_suite(configs, settings, args.out, measure, force=args.force,
                             progress=progress)
        rows += found
    title = (f"{args.model}: fitted on {args.fit_windows}x{args.fit_len} tokens of one "
             f"corpus, evaluated on {args.windows}x{args.window_len} of the other")
    print(calibrated.write_reports(rows, args.out, title))
    return 0


def _lazy(build, settings, fits_dir, progress):
    """``measure`` that builds the real one on its first call (finished points cost no
    model load)."""
    built = []

    def measure(name, cache_config):
        if not built:
            built.append(build(settings, fits_dir, progress))
        return built[0](name, cache_config)

    return measure


def _model_measure(settings: calibrated.CalibrationSettings, fits_dir: Path, progress: bool):
    from models.evaluate import calibrated_measure

    return calibrated_measure(settings, fits_dir, progress=progress)


if __name__ == "__main__":
    sys.exit(main())
