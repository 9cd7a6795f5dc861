"""What a model and its compressed cache cost each GPU when split over 1 to 8 of them:
bytes per device, rows that fit, and the decode step's memory-bound floor, per codec.

    python experiments/sharding_model.py                 # writes docs/sharding/model.*

Everything comes from shapes, nothing is allocated: the weights' bytes per device from
``jax.eval_shape`` of the random-weight model placed by
:func:`models.llama.param_specs` (query, kv and MLP columns split over the ``model``
axis, the output and down projections' rows, the head over the vocabulary; embedding
and norms whole on every device), the cache's from ``jax.eval_shape`` of
:func:`kvjax.cache.init_cache` placed by :func:`kvjax.sharding.cache_specs`
(:func:`kvjax.eval.memory.row_bytes`). Each configuration is tensor-parallel over all
its GPUs (``model=G``); a head count the GPUs do not divide is left out.

Per configuration: the rows of ``--context`` tokens that fit beside the weights in
``--device-gib`` less ``--reserve-gib`` per device; the floor of a decode step at a
batch: every device reads its weights and its rows' cache once at ``--peak-gbs``, and
the two all-reduces per layer move ``B x hidden`` bf16 values through a ring at
``--link-gbs`` per direction (``2 (G - 1) / G`` of the bytes each). The per-collective
latency is not in the floor: each step runs ``2 L`` of them, listed beside it.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from kvjax.eval.memory import MODEL_SHAPES, row_bytes
from kvjax.sharding import tree_bytes_per_device
from kvjax.spec import parse_cache
from models.config import ModelConfig
from models.llama import init_params, param_specs

CODECS = ("bf16", "fp8", "int:8", "int:4", "kivi:2,g32", "saw", "turboquant:b3",
          "polarquant:b3", "octopus:b3", "hqmq", "hyperquant:e8,3bps")
#: (model shape, context) pairs of the table
RUNS = (("llama-3-8b", 32768), ("llama-3-70b", 131072))
GPUS = (1, 2, 4, 8)
GIB = 2**30


def weight_bytes_per_device(config: ModelConfig, gpus: int) -> int:
    """Bytes of the bf16 weights each of ``gpus`` tensor-parallel devices holds."""
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), config, jnp.bfloat16))
    return tree_bytes_per_device(f"model={gpus}", shapes, param_specs(shapes, gpus))


def floor_step_s(*, weights: int, per_row: int, fixed: int, batch: int, hidden: int,
                 layers: int, gpus: int, peak_gbs: float, link_gbs: float) -> float:
    """Seconds of a decode step that reads every device's weights and cache once and
    all-reduces its layers' outputs through a ring, and does nothing else."""
    memory = (weights + fixed + batch * per_row) / (peak_gbs * 1e9)
    reduced = 2 * layers * batch * hidden * 2  # bf16 values, two sums per layer
    ring = 0.0 if gpus == 1 else 2 * (gpus - 1) / gpus * reduced / (link_gbs * 1e9)
    return memory + ring


def model_rows(args) -> list[dict]:
    """One row per (model, GPUs, codec)."""
    rows = []
    for shape_name, context in RUNS:
        shape = MODEL_SHAPES[shape_name]
        config = ModelConfig.from_shape(shape, max_len=context)
        for gpus in GPUS:
            if config.num_kv_heads % gpus or config.intermediate_size % gpus:
                continue
            weights = weight_bytes_per_device(config, gpus)
            free = (args.device_gib - args.reserve_gib) * GIB - weights
            for spec in args.codec or CODECS:
                per_row, fixed = row_bytes(parse_cache(spec), context=context,
                                           num_layers=config.num_layers,
                                           num_kv_heads=config.num_kv_heads,
                                           head_dim=config.head_dim, mesh=f"model={gpus}")
                fit = max(0, int((free - fixed) // per_row)) if free > 0 else 0
                step = {batch: floor_step_s(
                    weights=weights, per_row=per_row, fixed=fixed, batch=batch,
                    hidden=config.hidden_size, layers=config.num_layers, gpus=gpus,
                    peak_gbs=args.peak_gbs, link_gbs=args.link_gbs) if batch else math.nan
                    for batch in (args.batch, fit)}
                rows.append({
                    "model": shape_name, "context": context, "gpus": gpus, "codec": spec,
                    "weights_gib_per_gpu": weights / GIB,
                    "row_gib_per_gpu": per_row / GIB, "rows_fit": fit,
                    "batch": args.batch, "floor_ms": 1e3 * step[args.batch],
                    "floor_tok_per_s": args.batch / step[args.batch],
                    "floor_ms_at_fit": 1e3 * step[fit],
                    "floor_tok_per_s_at_fit": fit / step[fit] if fit else 0.0,
                    "all_reduces_per_step": 2 * config.num_layers,
                })
    for r in rows:  # against one GPU (or the fewest that hold the model) at the batch
        first = min((o for o in rows if o["model"] == r["model"] and o["codec"] == r["codec"]
                     and o["rows_fit"] >= args.batch), key=lambda o: o["gpus"], default=None)
        r["scaling_efficiency"] = (math.nan if first is None or r["rows_fit"] < args.batch
                                   else r["floor_tok_per_s"] / first["floor_tok_per_s"]
                                   * first["gpus"] / r["gpus"])
    return rows


def markdown(rows: list[dict], batch: int) -> str:
    """One table per model."""
    out = []
    for shape_name, context in RUNS:
        part = [r for r in rows if r["model"] == shape_name]
        out += [f"\n**{shape_name}, {context // 1024}k tokens per row**\n",
                "| codec | GPUs | weights GiB/GPU | cache GiB/GPU per row | rows that fit | "
                f"floor ms/step at B={batch} | tok/s at B={batch} | scaling efficiency | "
                "tok/s at the rows that fit |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(part, key=lambda r: (CODECS.index(r["codec"])
                                            if r["codec"] in CODECS else 99, r["gpus"])):
            small = r["rows_fit"] >= batch
            out.append(
                f"| {r['codec']} | {r['gpus']} | {r['weights_gib_per_gpu']:.1f} | "
                f"{r['row_gib_per_gpu']:.3f} | {r['rows_fit']} | "
                + (f"{r['floor_ms']:.2f} | {r['floor_tok_per_s']:.0f} | "
                   f"{r['scaling_efficiency']:.2f} |" if small else "- | - | - |")
                + (f" {r['floor_tok_per_s_at_fit']:.0f} |" if r["rows_fit"] else " - |"))
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """Rows that fit and floor tokens/s at them, against GPUs, one line per codec."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(RUNS), figsize=(12, 8))
    for col, (shape_name, context) in enumerate(RUNS):
        for i, codec in enumerate(dict.fromkeys(r["codec"] for r in rows)):
            # a model that does not fit has no point on a log scale
            pts = [r for r in rows if r["model"] == shape_name and r["codec"] == codec
                   and r["rows_fit"]]
            style = {"marker": "osD^v<>pPX*h"[i % 12], "color": f"C{i % 10}", "label": codec}
            axes[0, col].plot([r["gpus"] for r in pts], [r["rows_fit"] for r in pts], **style)
            axes[1, col].plot([r["gpus"] for r in pts],
                              [r["floor_tok_per_s_at_fit"] for r in pts], **style)
        axes[0, col].set_title(f"{shape_name}, {context // 1024}k tokens per row",
                               fontsize=10)
        axes[0, col].set_ylabel("rows that fit")
        axes[1, col].set_ylabel("floor tokens/s at those rows")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(GPUS, [str(g) for g in GPUS])
            ax.set_xlabel("GPUs (tensor-parallel)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    """Write the table, CSV and plot; print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", action="append", metavar="SPEC",
                   help="cache spec, repeatable (default: every family)")
    p.add_argument("--batch", type=int, default=8, help="rows of the fixed-batch floor")
    p.add_argument("--device-gib", type=float, default=139.0,
                   help="memory per GPU (H200: the 139 GiB JAX can use)")
    p.add_argument("--reserve-gib", type=float, default=8.0,
                   help="kept per GPU for activations and the programs' temporaries")
    p.add_argument("--peak-gbs", type=float, default=4240.0,
                   help="memory bandwidth per GPU, GB/s (H200, measured copy: 4240)")
    p.add_argument("--link-gbs", type=float, default=450.0,
                   help="NVLink bandwidth per GPU and direction, GB/s (H100/H200 SXM: 450)")
    p.add_argument("--out", type=Path, default=Path("docs") / "sharding")
    args = p.parse_args(argv)
    try:
        for spec in args.codec or ():
            parse_cache(spec)
        if args.batch < 1:
            raise ValueError("--batch must be >= 1")
    except ValueError as err:
        print(f"sharding_model: error: {err}", file=sys.stderr)
        return 2
    rows = model_rows(args)
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, args.batch)
    (args.out / "model.md").write_text(table.lstrip() + "\n")
    with open(args.out / "model.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out / "model.png")
    print(table)
    print(f"\n{args.out / 'model.md'}, {args.out / 'model.csv'}, {args.out / 'model.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
