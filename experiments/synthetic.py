"""OCTOPUS-style synthetic probes (section 4.1) for a list of key codecs.

For each codec: key reconstruction and inner-product error on Gaussian keys
(:func:`kvjax.eval.synthetic.reconstruction`) and the synthetic needle
(:func:`kvjax.eval.synthetic.needle`). Prints a markdown table and writes every row
(per-seed values included), the settings and the provenance to ``OUT/synthetic.json``.

    python experiments/synthetic.py [--codec SPEC ...] [--seeds 64] [--needle-seeds 128]
        [--head-dim 128] [--seed 0] [--out results/synthetic]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from kvjax import compile_cache
from kvjax.eval.sweep import write_json
from kvjax.eval.synthetic import needle, reconstruction
from kvjax.probe import BASELINE_CODECS
from kvjax.spec import parse_codec


def run(specs, *, head_dim: int, seeds: int, needle_seeds: int, seed: int) -> list[dict]:
    """One row per codec: the reconstruction metrics, the needle's, and the wall time."""
    codecs = [parse_codec(spec) for spec in specs]  # bad specs fail before any work
    rows = []
    for codec in tqdm(codecs, desc="codecs", unit="codec"):
        start = time.perf_counter()
        rec = reconstruction(codec, head_dim=head_dim, seeds=seeds, seed=seed)
        hay = needle(codec, head_dim=head_dim, seeds=needle_seeds, seed=seed)
        rows.append({
            "codec": codec.spec,
            "reconstruction": rec,
            "needle": hay,
            "seconds": time.perf_counter() - start,
        })
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table: one line per codec, needle mass also as a ratio to exact keys."""
    lines = [
        "| codec | bits | cosine | mse | ip_abs_err | needle mass | median | mass / ref "
        "| top1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        rec, hay = row["reconstruction"], row["needle"]
        lines.append(
            f"| {row['codec']} | {rec['bits_per_element']:.3f} | {rec['cosine']:.5f} "
            f"| {rec['mse']:.3e} | {rec['ip_abs_err']:.4f} "
            f"| {hay['mass']:.4f} ± {hay['mass_std']:.4f} | {hay['mass_median']:.4f} "
            f"| {hay['ratio']:.4f} "
            f"| {hay['top1']:.3f} |"
        )
    if rows:
        hay = rows[0]["needle"]
        lines.append("")
        lines.append(
            f"reference (exact float32 keys): needle mass {hay['reference']:.4f} "
            f"± {hay['reference_std']:.4f} (median {hay['reference_median']:.4f}), "
            f"top1 {hay['reference_top1']:.3f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    """Parse flags, run every codec, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", action="append", metavar="SPEC",
                        help="key codec spec (repeat); default: the baseline list")
    parser.add_argument("--seeds", type=int, default=64, help="reconstruction seeds")
    parser.add_argument("--needle-seeds", type=int, default=128, help="needle seeds")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/synthetic", help="output directory")
    compile_cache.add_argument(parser)
    args = parser.parse_args(argv)
    compile_cache.from_args(args)

    start = time.perf_counter()
    rows = run(args.codec or BASELINE_CODECS, head_dim=args.head_dim, seeds=args.seeds,
               needle_seeds=args.needle_seeds, seed=args.seed)
    total = time.perf_counter() - start
    print(table(rows))
    print(f"\n{len(rows)} codecs in {total:.1f} s")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"seeds": args.seeds, "needle_seeds": args.needle_seeds,
                "head_dim": args.head_dim, "seed": args.seed, "seconds": total}
    write_json(out / "synthetic.json", {"settings": settings, "rows": rows})
    print(f"wrote {out / 'synthetic.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
