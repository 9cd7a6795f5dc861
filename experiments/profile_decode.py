"""One call of the INT-N decode kernel at a chosen shape, for a profiler to attach to.

    ncu --clock-control none -k regex:int_decode python experiments/profile_decode.py

Runs the kernel a few times on random packed codes (the speed depends only on the bytes)
so a profiler such as Nsight Compute sees a warm, compiled kernel.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from experiments.bench_decode import SHAPES, random_codes
from pallas_kernels.int_decode.api import NUM_WARPS, default_blocking, default_splits
from pallas_kernels.int_decode.kernel import codes_partial, operand_width, pad_query_rows


def main(argv=None) -> int:
    """Parse the shape and blocking, run the kernel ``--calls`` times."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--slots", type=int, default=32768)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--layout", default="halves")
    p.add_argument("--block-s", type=int)
    p.add_argument("--num-warps", type=int, default=NUM_WARPS)
    p.add_argument("--num-stages", type=int)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)
    num_heads, heads, head_dim = SHAPES[args.shape]
    block_s, stages = default_blocking(args.block_s, args.num_stages)
    splits = default_splits(args.batch, heads, args.slots, block_s, args.num_warps)
    k = random_codes(jax.random.key(1), args.batch, heads, args.slots, head_dim, args.bits)
    v = random_codes(jax.random.key(2), args.batch, heads, args.slots, head_dim, args.bits)
    q = jax.random.normal(jax.random.key(0), (args.batch, heads, num_heads // heads, head_dim))
    q = pad_query_rows(q, operand_width(head_dim, args.bits, args.layout))
    n = jnp.full((args.batch,), args.slots, jnp.int32)
    for _ in range(args.calls):
        jax.block_until_ready(codes_partial(
            q, *k, *v, n, bits=args.bits, sm_scale=head_dim**-0.5, block_s=block_s,
            splits=splits, num_warps=args.num_warps, num_stages=stages, layout=args.layout))
    print(f"ran {args.calls} calls: B={args.batch} S={args.slots} block {block_s} "
          f"stages {stages} splits {splits} layout {args.layout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
