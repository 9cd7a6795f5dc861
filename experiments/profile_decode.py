"""Calls of the INT-N decode kernel at a chosen shape, for a profiler to attach to.

    ncu --clock-control none -k regex:int_decode python experiments/profile_decode.py

Runs the kernel's entry (:func:`pallas_kernels.int_decode.api.int_decode`, what the
models' attention calls) a few times on random packed codes (the speed depends only on
the bytes) so a profiler such as Nsight Compute sees a warm, compiled kernel.
"""

from __future__ import annotations

import argparse
import sys

import jax

from kvjax.eval.memory import model_shape
from pallas_kernels.flash import NUM_WARPS, default_blocking, default_splits
from pallas_kernels.int_decode.api import int_decode, random_inputs
from pallas_kernels.int_decode.kernel import Research


def main(argv=None) -> int:
    """Parse the shape and blocking, run the kernel ``--calls`` times."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3-8b",
                   help="a model of kvjax.eval.memory.model_shape")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--slots", type=int, default=32768)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--layout", default="halves", help="benchmark-only: halves or bytes")
    p.add_argument("--block-s", type=int)
    p.add_argument("--num-warps", type=int, default=NUM_WARPS)
    p.add_argument("--num-stages", type=int)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)
    try:
        shape = model_shape(args.shape)
        research = Research(layout=args.layout)
    except ValueError as err:
        print(f"profile_decode: {err}", file=sys.stderr)
        return 2
    heads, head_dim = shape.num_kv_heads, shape.head_dim
    block_s, stages = default_blocking(args.block_s, args.num_stages)
    splits = default_splits(args.batch, heads, args.slots, block_s, args.num_warps)
    arrays = random_inputs(jax.random.key(0), batch=args.batch, heads=heads,
                           group=shape.num_heads // heads, slots=args.slots,
                           head_dim=head_dim, bits=args.bits)
    for _ in range(args.calls):
        jax.block_until_ready(int_decode(
            **arrays, bits=args.bits, sm_scale=head_dim**-0.5, block_s=block_s,
            splits=splits, num_warps=args.num_warps, num_stages=stages, research=research))
    print(f"ran {args.calls} calls: B={args.batch} S={args.slots} block {block_s} "
          f"stages {stages} splits {splits} layout {args.layout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
