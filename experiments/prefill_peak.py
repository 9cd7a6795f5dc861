"""What one prefill chunk really holds on the device beside the weights and the cache,
against what XLA's memory analysis of the compiled program says.

    python experiments/prefill_peak.py --cache bf16 --batch 4 --context 32768     # GPU
    python experiments/prefill_peak.py --shape smollm2-135m --layers 2 --batch 2 \\
        --context 512 --chunk 64                                             # CPU smoke

A random-weight model of ``--shape`` (decode layout, as ``bench_e2e.py`` runs it), a new
cache of ``--cache`` for ``--batch`` rows of ``--context`` tokens (plus 16), and one
prefill chunk of ``--chunk`` tokens through the model's compiled prefill
(:func:`models.generate.prefill_program`, compiled before the cache is allocated, as
:func:`models.generate.prefill` does), the cache donated. Printed: the weights' bytes and
the largest free block of device memory before and after compiling (a cache stack
needs one block of its size), what compiling held and whether it raised the peak, the
cache's bytes, the program's
arguments, outputs (and how many of them alias the donated inputs) and temporaries from
``compiled.memory_analysis()``, and on a device that keeps memory statistics the peak
bytes in use during the chunk less the weights and the cache: what the program needed
at run time. A run-time need far above the analysed temporaries (a whole stack of the
cache, say) is a copy the analysis does not count, and what makes the capacity that
``bench_e2e.py --check-programs`` computes fail. ``--hlo`` also lists the copies in the
compiled program whose shape holds the cache's token axis.
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import compile_cache
from kvjax.eval.memory import MODEL_SHAPES
from kvjax.spec import parse_cache
from models import generate as gen
from models.config import ModelConfig
from models.llama import cache_shape, init_params, new_cache, relayout


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def in_use(device) -> tuple[int, int, int] | None:
    """``(bytes in use, peak bytes in use, largest free block)`` of ``device``, or None
    where it keeps no statistics (a CPU)."""
    stats = device.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return (int(stats["bytes_in_use"]), int(stats["peak_bytes_in_use"]),
            int(stats.get("largest_free_block_bytes", 0)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(MODEL_SHAPES), default="llama-3-8b")
    p.add_argument("--layers", type=int, help="fewer transformer blocks than the shape's")
    p.add_argument("--cache", default="bf16", metavar="SPEC")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--hlo", action="store_true")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    try:
        cache_config = parse_cache(args.cache)
        if min(args.batch, args.context, args.chunk) < 1 or args.chunk > args.context:
            raise ValueError("--batch, --context and --chunk must be >= 1, the chunk at "
                             "most the context")
    except ValueError as err:
        print(f"prefill_peak: error: {err}", file=sys.stderr)
        return 2
    device = jax.devices()[0]
    max_len = args.context + 16
    config = ModelConfig.from_shape(MODEL_SHAPES[args.shape], max_len=max_len,
                                    num_layers=args.layers)
    params = relayout(init_params(jax.random.key(0), config, jnp.bfloat16))
    # compiled first, as models.generate does: autotuning's buffers before the cache's
    placed = in_use(device)
    shape = cache_shape(config, cache_config, batch=args.batch, max_len=max_len)
    compiled = gen.prefill_program(params, config, shape, chunk=args.chunk)
    compiling = in_use(device)
    cache = jax.block_until_ready(new_cache(config, cache_config, batch=args.batch,
                                            max_len=max_len))
    cache_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(cache))
    tokens = jnp.asarray(np.random.default_rng(0).integers(
        0, config.vocab_size, (args.batch, args.chunk)), jnp.int32)
    valid = jnp.full((args.batch,), args.chunk, jnp.int32)
    sizes = compiled.memory_analysis()
    print(f"cache {cache_config.spec}: {gib(cache_bytes)} for {args.batch} rows of "
          f"{max_len} tokens")
    print(f"analysis: arguments {gib(sizes.argument_size_in_bytes)}, outputs "
          f"{gib(sizes.output_size_in_bytes)} ({gib(sizes.alias_size_in_bytes)} in place), "
          f"temporaries {gib(sizes.temp_size_in_bytes)}")
    before = in_use(device)
    given = jax.tree_util.tree_flatten_with_path(cache)[0]
    _, cache = compiled(params, tokens, valid, cache)
    jax.block_until_ready(cache)
    after = in_use(device)
    # a donated argument the run could not take over is copied: list what it kept
    kept = [(jax.tree_util.keystr(path), leaf) for path, leaf in given
            if not leaf.is_deleted() and leaf.nbytes > 2**20]
    print(f"donated: {len(given) - len(kept)} of the cache's {len(given)} arrays taken "
          "over by the program" + "".join(f"; kept {name} {gib(leaf.nbytes)}"
                                          for name, leaf in kept))
    if before is None or after is None or compiling is None:
        print("run time: this device keeps no memory statistics")
    else:
        weights = placed[0]
        # the peak counts from the process's start (the weights' initialization too)
        grew = (f"raised the peak to {gib(compiling[1])}" if compiling[1] > placed[1]
                else f"left the peak at {gib(compiling[1])} (the weights' placement)")
        print(f"weights {gib(weights)}, largest free block {gib(placed[2])}; compiling "
              f"{grew}, held {gib(compiling[0] - weights)} beyond the weights afterwards, "
              f"largest free block {gib(compiling[2])}")
        held = before[0]  # the weights and the cache, allocated before the chunk
        # the device's peak counts from the process's start: a run that needed less
        # than the compilation leaves it where the compilation put it
        beyond = "at most " if after[1] == compiling[1] else ""
        print(f"run time: peak {gib(after[1])}, of which beyond the weights and the cache "
              f"{beyond}{gib(after[1] - held)} (analysed temporaries "
              f"{gib(sizes.temp_size_in_bytes)})")
    if args.hlo:
        slots = str(max_len)
        copies = [line.strip() for line in compiled.as_text().splitlines()
                  if re.search(r"= \S+ copy\(", line) and slots in line]
        print(f"copies holding the cache's {slots}-token axis: {len(copies)}")
        for line in copies[:20]:
            print("  " + line[:240])
    return 0


if __name__ == "__main__":
    sys.exit(main())
