"""How long a model's prefill and decode programs take to trace, lower and compile, per
cache spec and layer count, from shapes alone (nothing allocated).

    python experiments/bench_compile.py --cache int:4 --cache turboquant:b4 --layers 2 8 32
    python experiments/bench_compile.py --shape smollm2-135m --layers 2 --batch 1 \\
        --chunk 32 --context 256                         # a CPU smoke run

For each (cache spec, layer count): a random-weight model of ``--shape`` in the decode
layout (:func:`models.llama.decode_layout`: layers unrolled over per-layer buffers, as
``bench_e2e.py`` runs it), the jitted prefill of one ``--chunk`` of ``--batch`` rows
into a cache of ``--context`` tokens and the jitted decode loop of ``--new-tokens``
(:mod:`models.generate`), each traced and lowered (``lower s``, both together) and
compiled (``compile s``). JAX's persistent compilation cache is on as in every script
(:mod:`kvjax.compile_cache`): the first run on a machine compiles every program (cold),
a second run of the same command loads them (warm: what a later process pays beyond
tracing and lowering); ``--no-compile-cache`` always compiles. The cache's own attention
list decides the implementations (``"auto"``: the fused kernels on a GPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from kvjax import compile_cache
from kvjax.eval.memory import MODEL_SHAPES
from kvjax.eval.sweep import write_json
from kvjax.spec import parse_cache
from models import generate as gen
from models.config import ModelConfig
from models.llama import cache_shape, decode_layout, init_params


def lowered_programs(config: ModelConfig, cache_config, *, batch: int, context: int,
                     chunk: int, new_tokens: int) -> dict:
    """``{"prefill": Lowered, "decode": Lowered}`` of the model's programs, from shapes."""
    params = jax.eval_shape(lambda: decode_layout(init_params(jax.random.key(0), config,
                                                              jnp.bfloat16)))
    cache = cache_shape(config, cache_config, batch=batch, max_len=context + new_tokens)
    prefill = gen._prefill_jit.lower(*gen.prefill_arguments(params, config, cache, chunk=chunk))
    logits = jax.ShapeDtypeStruct((batch, config.vocab_size), jnp.float32)
    return {
        "prefill": prefill,
        "decode": gen._decode_jit.lower(*gen.decode_arguments(
            params, config, logits, cache, max_new_tokens=new_tokens, greedy=True)),
    }


def measure(config, cache_config, **shapes) -> dict:
    """Seconds to trace and lower both programs, and to compile each."""
    t0 = time.perf_counter()
    programs = lowered_programs(config, cache_config, **shapes)
    out = {"lower_s": time.perf_counter() - t0}
    for name, lowered in programs.items():
        t0 = time.perf_counter()
        lowered.compile()
        out[f"{name}_compile_s"] = time.perf_counter() - t0
    return out


def main(argv=None) -> int:
    """Measure every (cache spec, layer count); print a markdown table (and ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(MODEL_SHAPES), default="llama-3-8b")
    p.add_argument("--cache", action="append", metavar="SPEC",
                   help="cache spec, repeatable (default: bf16, int:4, turboquant:b4)")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--json", type=Path)
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    cache_dir = compile_cache.from_args(args)
    try:
        specs = {spec: parse_cache(spec) for spec in args.cache or
                 ["bf16", "int:4", "turboquant:b4"]}
        if min(args.layers) < 1 or min(args.batch, args.context, args.chunk,
                                       args.new_tokens) < 1:
            raise ValueError("--layers, --batch, --context, --chunk and --new-tokens must "
                             "be >= 1")
    except ValueError as err:
        print(f"bench_compile: error: {err}", file=sys.stderr)
        return 2
    shape = MODEL_SHAPES[args.shape]
    rows = []
    for spec, cache_config in specs.items():
        for layers in args.layers:
            config = ModelConfig.from_shape(shape, max_len=args.context + args.new_tokens,
                                            num_layers=layers)
            times = measure(config, cache_config, batch=args.batch, context=args.context,
                            chunk=min(args.chunk, args.context), new_tokens=args.new_tokens)
            rows.append({"cache": spec, "layers": layers, **times})
            print(rows[-1], file=sys.stderr, flush=True)
    print(f"compilation cache: {cache_dir or 'off'}")
    print("| cache | layers | lower s | prefill compile s | decode compile s |")
    print("|---" * 5 + "|")
    for r in rows:
        print(f"| {r['cache']} | {r['layers']} | {r['lower_s']:.1f} | "
              f"{r['prefill_compile_s']:.2f} | {r['decode_compile_s']:.2f} |")
    if args.json:
        write_json(args.json, {"shape": args.shape, "compile_cache": str(cache_dir),
                               "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
