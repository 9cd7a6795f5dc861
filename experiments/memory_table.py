"""KV-cache memory per cache spec at real models' shapes, from the cache's own arrays.

For each model shape (:data:`kvjax.eval.memory.MODEL_SHAPES`) and cache spec, prints a
markdown table: stored bits per element, cache bytes per token (all layers and kv heads,
K and V), the cache's size at each context (GiB = 2**30 bytes, batch 1, every array that
:func:`kvjax.cache.init_cache` allocates), the compression against a bf16 cache with the
same window and sinks at the largest context, and the largest batch-1 context whose
cache fits on one accelerator (default an H200, 141 GB = 141e9 bytes) beside the
model's bf16 weights.

    python experiments/memory_table.py [--cache SPEC ...] [--model NAME ...]
        [--contexts 32768 131072] [--window W] [--device-gb 141] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvjax.eval.memory import (
    MODEL_SHAPES,
    bytes_per_token,
    cache_bytes,
    max_context,
    model_shape,
)
from kvjax.probe import BASELINE_CODECS
from kvjax.spec import CacheConfig, parse_cache

GIB = 2**30
DEFAULT_CONTEXTS = (32768, 131072)
#: HBM of one H200, in GB (1e9 bytes) as NVIDIA states it
DEFAULT_DEVICE_GB = 141.0


def context_label(context: int) -> str:
    """``32768 -> '32k'``; contexts that are not whole multiples of 1024 stay as written."""
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", "--codec", dest="cache", action="append", metavar="SPEC",
                        help="cache spec, repeatable (default: the probe's codec list)")
    parser.add_argument("--model", action="append", metavar="NAME",
                        help=f"model shape, repeatable; known: {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS),
                        metavar="N", help="context lengths in tokens (default 32768 131072)")
    parser.add_argument("--window", type=int, default=None, metavar="W",
                        help="residual window of raw bf16 tokens of every spec that "
                        "sets none (default 0)")
    parser.add_argument("--device-gb", type=float, default=DEFAULT_DEVICE_GB,
                        help="accelerator memory in GB = 1e9 bytes (default 141, an H200)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return parser.parse_args(argv)


def cache_configs(specs: Sequence[str], window: int | None) -> list[CacheConfig]:
    """The cache of each spec; ``window`` is the residual window of those that set none."""
    defaults = {} if window is None else {"residual_window": window}
    return [parse_cache(spec, **defaults) for spec in specs]


def measure(specs, configs, names, contexts, device_gb) -> list[dict]:
    """One row per (model, cache): its bytes per token, sizes and the fitting context."""
    if not contexts or any(c < 1 for c in contexts):
        raise ValueError(f"contexts must be positive token counts, got {contexts}")
    from tqdm.auto import tqdm

    shapes = [model_shape(n) for n in names]
    rows = []
    bar = tqdm(total=len(shapes) * len(configs), desc="memory table", unit="cache",
               disable=None)  # on a terminal only
    for shape in shapes:
        dims = dict(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                    head_dim=shape.head_dim)
        budget = device_gb * 1e9 - shape.weight_bytes_bf16
        for spec, config in zip(specs, configs, strict=True):
            reference = CacheConfig(k="bf16", residual_window=config.residual_window,
                                    sink_tokens=config.sink_tokens)
            ref = cache_bytes(reference, context=max(contexts), **dims)
            per_token = bytes_per_token(config, **dims)
            sizes = {c: cache_bytes(config, context=c, **dims) for c in contexts}
            fit = max_context(config, budget_bytes=budget, **dims) if budget > 0 else None
            rows.append({
                "model": shape.name, **dims, "codec": spec, "cache": config.spec,
                "k_codec": config.k.spec, "v_codec": config.v.spec,
                "residual_window": config.residual_window, "sinks": config.sink_tokens,
                "batch": 1,
                "bits_per_element": per_token["bits_per_element"],
                "bytes_per_token": per_token["bytes"],
                "cache_bytes": {str(c): b for c, b in sizes.items()},
                "ratio_vs_bf16": ref / sizes[max(contexts)],
                "device_gb": device_gb, "weight_bytes_bf16": shape.weight_bytes_bf16,
                "max_context_beside_weights": fit,
            })
            bar.update()
    bar.close()
    return rows


def markdown(rows: list[dict], contexts: Sequence[int], device_gb: float) -> str:
    """The rows as a markdown table."""
    largest = context_label(max(contexts))
    header = ["model", "codec", "bits/elem", "bytes/token",
              *(f"GiB @ {context_label(c)}" for c in contexts), f"vs bf16 @ {largest}",
              f"max context in {device_gb:g} GB beside bf16 weights"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        fit = r["max_context_beside_weights"]
        cells = [r["model"], r["codec"], f"{r['bits_per_element']:.4g}",
                 f"{r['bytes_per_token']:,.6g}",
                 *(f"{r['cache_bytes'][str(c)] / GIB:.3f}" for c in contexts),
                 f"{r['ratio_vs_bf16']:.2f}x",
                 "weights do not fit" if fit is None else f"{fit:,}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table (and write ``--json``); 0 on success, 2 on bad input."""
    args = parse_args(argv)
    specs = args.cache or list(BASELINE_CODECS)
    names = args.model or list(MODEL_SHAPES)
    try:
        configs = cache_configs(specs, args.window)
        rows = measure(specs, configs, names, args.contexts, args.device_gb)
    except ValueError as err:
        print(f"memory_table: error: {err}", file=sys.stderr)
        return 2
    window = f", residual window {args.window} bf16 tokens" if args.window else ""
    print(f"KV cache, batch 1{window}; GiB = 2**30 bytes, GB = 1e9 bytes\n")
    print(markdown(rows, args.contexts, args.device_gb))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
