"""Command line: ``python -m kvjax <command>``.

Commands:
    codecs   list the registered codecs and their spec grammar
    probe    measure codecs on seeded Gaussian (or saved) K/V; a table, or JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvjax.codec import CodecError, parse_kv, registered

DEFAULT_PROBE_CODECS = (
    "bf16", "fp8", "int:8", "int:6", "int:4", "int:3", "int:2",
    "kivi:4,g32", "kivi:2,g32",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"kvjax: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m kvjax``."""
    parser = _Parser(prog="kvjax", description="KV-cache compression for LLMs in JAX")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    sub.add_parser("codecs", help="list registered codecs and their spec grammar")

    p = sub.add_parser("probe", help="codec error, bits and attention error on synthetic K/V")
    p.add_argument("--codec", action="append", metavar="SPEC",
                   help="codec spec for K and V (repeat for a table); default: all baselines")
    p.add_argument("--k", metavar="SPEC", help="K codec spec (with --v)")
    p.add_argument("--v", metavar="SPEC", help="V codec spec (with --k)")
    p.add_argument("--head-dim", type=_positive, default=128)
    p.add_argument("--tokens", type=_positive, default=1024)
    p.add_argument("--heads", type=_positive, default=2, help="kv heads")
    p.add_argument("--queries", type=_positive, default=16, help="probe queries per kv head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--npy", metavar="FILE", help="K/V from a .npy [2, T, K, D] or [T, K, D]")
    p.add_argument("--json", action="store_true", help="one JSON object (a list for several)")
    return parser


def _cmd_codecs() -> int:
    for name, cls in sorted(registered().items()):
        doc = (cls.from_options.__doc__ or cls.__doc__ or "").strip().splitlines()
        print(f"{name:12s} {doc[0] if doc else ''}")
    return 0


def _cmd_probe(args) -> int:
    from kvjax.probe import gaussian_kv, load_kv, probe

    if (args.k is None) != (args.v is None):
        raise CodecError("--k and --v go together")
    if args.k is not None and args.codec:
        raise CodecError("give either --codec or --k/--v, not both")
    pairs = []
    if args.k is not None:
        k_codec, v_codec = parse_kv(k=args.k, v=args.v)
        pairs.append((f"{k_codec.spec} / {v_codec.spec}", k_codec, v_codec))
    else:
        for spec in args.codec or DEFAULT_PROBE_CODECS:
            k_codec, v_codec = parse_kv(spec)
            pairs.append((spec, k_codec, v_codec))
    if args.npy:
        k, v = load_kv(args.npy)
    else:
        k, v = gaussian_kv(args.seed, args.tokens, args.heads, args.head_dim)
    rows = []
    for spec, k_codec, v_codec in pairs:
        row = {"codec": spec, "k_codec": k_codec.spec, "v_codec": v_codec.spec}
        row.update(probe(k_codec, v_codec, k=k, v=v, queries=args.queries, seed=args.seed))
        rows.append(row)
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else rows, indent=None))
    else:
        print(format_probe_table(rows))
    return 0


def format_probe_table(rows: list[dict]) -> str:
    """A markdown table of probe results."""
    cols = [("codec", "codec", "{}"), ("bits", "bits_per_element_measured", "{:.3f}"),
            ("rel_mse", "rel_mse", "{:.2e}"), ("cosine", "cosine", "{:.5f}"),
            ("ip_abs_err", "ip_abs_err", "{:.4f}"), ("v_rel_mse", "v_rel_mse", "{:.2e}"),
            ("attn_rel_err", "attn_rel_err", "{:.2e}")]
    head = "| " + " | ".join(c[0] for c in cols) + " |"
    rule = "|" + "|".join("---" for _ in cols) + "|"
    body = ["| " + " | ".join(fmt.format(r[key]) for _, key, fmt in cols) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 with a one-line reason on bad input)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse: --help, or a usage error already printed
        return int(exit_.code or 0)
    try:
        if args.command == "codecs":
            return _cmd_codecs()
        if args.command == "probe":
            return _cmd_probe(args)
    except (ValueError, OSError) as err:  # CodecError is a ValueError
        print(f"kvjax: error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
