"""Element operations per cached token and kv head of each fused decode kernel, counted
from its traced program (:func:`kvjax.eval.kernel_ops.kernel_ops`; no GPU needed):

    python experiments/kernel_ops.py                       # the paper codecs, D = 128
    python experiments/kernel_ops.py --codec octopus:b3 --top 12 --json ops.json

One row per cache spec: the kernel that reads it, its block, the operations by kind
and their total (without ``layout``), the tensor-core multiply-adds, and with ``--top``
the costliest arithmetic primitives. A lever that removes work shows here before a GPU
times it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvjax.eval.kernel_ops import KINDS, kernel_ops
from kvjax.eval.sweep import write_json

CODECS = ("bf16", "int:4", "hyperquant:e8,4bps,int8", "turboquant:b4", "turboquant:b3",
          "turboquant:b4,qjl", "polarquant:b3", "octopus:b3", "hqmq:s96,r4",
          "hqmq:s96,r4,med3")


def table(rows: list[dict]) -> str:
    """A markdown table of :func:`main`'s rows."""
    lines = ["| cache | kernel | block | " + " | ".join(KINDS) + " | total | vs int:4 | mma |",
             "|---" * (len(KINDS) + 6) + "|"]
    base = next((r["total"] for r in rows if r["cache"] == "int:4"), None)
    for r in rows:
        ratio = f"{r['total'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['cache']} | {r['kernel']} | {r['block_s']} | "
                     + " | ".join(f"{r['ops'][k]:.0f}" for k in KINDS)
                     + f" | {r['total']:.0f} | {ratio} | {r['mma']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", action="append", metavar="SPEC",
                   help=f"cache specs (default: {', '.join(CODECS)})")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4, help="query heads per kv head")
    p.add_argument("--block-s", type=int, default=None, help="default: each kernel's own")
    p.add_argument("--top", type=int, default=0,
                   help="also list each kernel's N costliest arithmetic primitives")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    options = {} if args.block_s is None else {"block_s": args.block_s}
    rows = []
    for spec in args.codec or CODECS:
        try:
            ops = kernel_ops(spec, head_dim=args.head_dim, group=args.group, **options)
        except ValueError as err:  # CodecError is one; no kernel reads the spec
            print(f"kernel_ops: {spec}: {str(err).splitlines()[0]}", file=sys.stderr)
            return 2
        rows.append({"cache": spec, "kernel": ops.kernel, "block_s": ops.block_s,
                     "ops": ops.ops, "total": ops.total, "mma": ops.mma,
                     "by_primitive": ops.by_primitive, "head_dim": args.head_dim,
                     "group": args.group})
    print(table(rows))
    for r in rows if args.top else ():
        top = list(r["by_primitive"].items())[:args.top]
        print(f"{r['cache']}: " + ", ".join(f"{name} {n:.0f}" for name, n in top))
    if args.json:
        write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
