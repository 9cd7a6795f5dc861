"""Where a model's weights leave the device's free memory: in use and the largest free
block after the stacked weights, after laying them out per layer on the device
(:func:`models.llama.decode_layout`) and after laying them out on the host
(:func:`models.llama.relayout`), and whether two arrays of ``--stack-gb`` (a cache's K
and V stacks) then fit.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python experiments/weights_layout_memory.py \\
        --shape llama-3-8b --stack-gb 24                                       # GPU
    python experiments/weights_layout_memory.py --shape smollm2-135m --layers 2   # CPU

Each layout runs in a process of its own (``--layout``), from fresh random weights: a
device's allocator keeps the history of what was placed before. On a device that keeps
no memory statistics (a CPU) the rows say so.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from kvjax import compile_cache
from kvjax.eval.memory import MODEL_SHAPES
from models.config import ModelConfig
from models.llama import decode_layout, init_params, relayout

LAYOUTS = {"stacked": lambda p: p, "device": decode_layout, "host": relayout}


def memory(device) -> str:
    stats = device.memory_stats()
    if not stats or "largest_free_block_bytes" not in stats:
        return "no memory statistics on this device"
    return (f"in use {stats['bytes_in_use'] / 2**30:.2f} GiB, largest free block "
            f"{stats['largest_free_block_bytes'] / 2**30:.2f} GiB of "
            f"{(stats['bytes_limit'] - stats['bytes_in_use']) / 2**30:.2f} GiB free")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(MODEL_SHAPES), default="llama-3-8b")
    p.add_argument("--layers", type=int, help="fewer transformer blocks than the shape's")
    p.add_argument("--layout", choices=list(LAYOUTS), default="host")
    p.add_argument("--stack-gb", type=float, default=0.0,
                   help="then allocate two arrays of this many GiB (0: none)")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    if args.stack_gb < 0 or (args.layers is not None and args.layers < 1):
        print("weights_layout_memory: error: --stack-gb >= 0, --layers >= 1",
              file=sys.stderr)
        return 2
    device = jax.devices()[0]
    config = ModelConfig.from_shape(MODEL_SHAPES[args.shape], max_len=4096,
                                    num_layers=args.layers)
    params = jax.block_until_ready(init_params(jax.random.key(0), config, jnp.bfloat16))
    print(f"stacked weights: {memory(device)}")
    if args.layout != "stacked":
        params = jax.block_until_ready(LAYOUTS[args.layout](params))
        print(f"laid out on the {args.layout}: {memory(device)}")
    if args.stack_gb:
        size = int(args.stack_gb * 2**30)
        stacks = [jnp.zeros((size,), jnp.uint8) for _ in range(2)]
        jax.block_until_ready(stacks)
        print(f"two {args.stack_gb:g} GiB stacks fit: {memory(device)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
