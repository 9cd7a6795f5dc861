"""One model's decode step with its layers scanned over stacked weights or unrolled over
per-layer buffers: time per step, compile time and the compiled program's op counts.

    python experiments/bench_decode_step.py                              # Llama-3-8B (GPU)
    python experiments/bench_decode_step.py --shape smollm2-135m --layers 2 \\
        --run bf16:1:64 --run int:4:2:128                                 # a CPU smoke run

A random-weight model of the shape (bf16 weights) runs ``--steps`` greedy decode steps
in one jitted ``fori_loop`` (the loop :mod:`models.generate` runs, without its
bookkeeping) over a cache that holds ``S`` tokens per row (zeros: the step's speed does
not depend on their values), for each ``--run SPEC:B:S``; tracing (``lower``) and XLA's
compile are timed apart, and ``--hlo DIR`` keeps each optimized program. Layouts (``--layout``,
repeatable): ``stacked`` (one ``lax.scan`` over the stacked weights, as loaded),
``per-layer`` (:func:`models.llama.unstack_layers`: the layers unrolled, each reading its
own buffers), ``sliced`` (unrolled, but each layer's weights sliced from the stack
inside the program) and ``fused`` (:func:`models.llama.decode_layout`: per-layer, with
the projections joined, two fewer matmuls per layer). The generated
tokens of every layout must agree; the op counts (fusions, custom calls, copies, dynamic
slices) of the optimized program show what each layout adds per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from kvjax import compile_cache
from kvjax.eval.memory import MODEL_SHAPES
from kvjax.spec import parse_cache
from models.config import ModelConfig
from models.llama import (
    decode_layout,
    hidden_states,
    init_params,
    layer_params,
    lm_logits,
    new_cache,
    unstack_layers,
)

LAYOUTS = ("stacked", "per-layer", "sliced", "fused")
OPS = ("fusion", "custom-call", "copy", "dynamic-slice", "dynamic-update-slice")


def decode_loop(config, layout: str, steps: int):
    """``(params, tokens [B], cache) -> (tokens, cache)`` after ``steps`` greedy steps."""
    def run(params, tokens, cache):
        if layout == "sliced":
            params = {**params, "layers": tuple(layer_params(params, i)
                                                for i in range(config.num_layers))}

        def body(_, state):
            tokens, cache = state
            h, cache = hidden_states(params, config, tokens[:, None], cache)
            logits = lm_logits(params, config, h[:, 0])
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

        return jax.lax.fori_loop(0, steps, body, (tokens, cache))

    return jax.jit(run, donate_argnums=2)


def op_counts(hlo: str) -> dict[str, int]:
    """Instructions of each kind in an optimized HLO module's text."""
    return {op: len(re.findall(rf"= [^=]*? {op}\(", hlo)) for op in OPS}


def filled_cache(config, spec: str, batch: int, context: int):
    """A cache of ``context`` tokens per row (zero codes), room for a few more."""
    cache = new_cache(config, parse_cache(spec), batch=batch, max_len=context + 64)
    return dataclasses.replace(cache, lengths=jnp.full_like(cache.lengths, context))


def bench(config, params_by_layout, spec: str, batch: int, context: int, steps: int,
          repeats: int, hlo_dir: Path | None = None) -> list[dict]:
    """One row per layout: ms per step, tracing and compile s, op counts, the tokens'
    agreement; the optimized HLO written to ``hlo_dir`` when given."""
    rows, first = [], None
    tokens = jnp.zeros((batch,), jnp.int32)
    for layout, params in params_by_layout.items():
        loop = decode_loop(config, layout, steps)
        start = time.perf_counter()
        # shapes only: a second cache of 32k-token rows would not fit beside the first
        lowered = loop.lower(params, tokens,
                             jax.eval_shape(lambda: filled_cache(config, spec, batch, context)))
        lower_s = time.perf_counter() - start
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start - lower_s
        hlo = compiled.as_text()
        if hlo_dir is not None:
            hlo_dir.mkdir(parents=True, exist_ok=True)
            name = re.sub(r"[^\w.-]+", "_", f"{spec}-B{batch}-S{context}-{layout}") + ".hlo"
            (hlo_dir / name).write_text(hlo)
        samples, cache = [], None
        for _ in range(repeats + 1):  # the first call warms up
            cache = None  # the last call's cache freed before the next one is made
            cache = filled_cache(config, spec, batch, context)
            start = time.perf_counter()
            out, cache = compiled(params, tokens, cache)
            jax.block_until_ready(out)
            samples.append(time.perf_counter() - start)
        del cache
        first = out if first is None else first
        rows.append({"cache": spec, "batch": batch, "context": context, "layout": layout,
                     "ms_per_step": 1e3 * min(samples[1:]) / steps, "lower_s": lower_s,
                     "compile_s": compile_s, "same_tokens": bool(jnp.all(out == first)),
                     **op_counts(hlo)})
    return rows


def main(argv=None) -> int:
    """Parse the runs, time every layout, print a markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(MODEL_SHAPES), default="llama-3-8b")
    p.add_argument("--layers", type=int, help="fewer blocks than the shape's")
    p.add_argument("--run", action="append", metavar="SPEC:B:S",
                   help="cache spec, batch, tokens in the cache (default: bf16:1:256, "
                   "int:4:8:32768)")
    p.add_argument("--layout", action="append", choices=LAYOUTS)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hlo", type=Path, metavar="DIR",
                   help="write each compiled program's optimized HLO here")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    try:
        runs = []
        for text in args.run or ["bf16:1:256", "int:4:8:32768"]:
            spec, batch, context = text.rsplit(":", 2)
            parse_cache(spec)
            runs.append((spec, int(batch), int(context)))
    except ValueError as err:
        print(f"bench_decode_step: bad --run: {err}", file=sys.stderr)
        return 2
    layouts = args.layout or list(LAYOUTS[:2])
    longest = max(context for _, _, context in runs)
    config = ModelConfig.from_shape(MODEL_SHAPES[args.shape], max_len=longest + 64,
                          num_layers=args.layers)
    stacked = init_params(jax.random.key(0), config, jnp.bfloat16)
    arrange = {"per-layer": unstack_layers, "fused": decode_layout}
    params = {layout: arrange.get(layout, lambda p: p)(stacked) for layout in layouts}
    rows = []
    for spec, batch, context in runs:
        rows += bench(config, params, spec, batch, context, args.steps, args.repeats,
                      args.hlo)
        print(rows[-1], file=sys.stderr, flush=True)
    print("| cache | B | S | layout | ms/step | trace s | compile s | same tokens | "
          + " | ".join(OPS) + " |")
    print("|---" * (8 + len(OPS)) + "|")
    for r in rows:
        print(f"| {r['cache']} | {r['batch']} | {r['context']} | {r['layout']} | "
              f"{r['ms_per_step']:.2f} | {r['lower_s']:.1f} | {r['compile_s']:.1f} | "
              f"{r['same_tokens']} | "
              + " | ".join(str(r[op]) for op in OPS) + " |")
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
