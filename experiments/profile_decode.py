"""Calls of a decode kernel at a chosen shape, for a profiler to attach to.

    ncu --clock-control none -k regex:int_decode python experiments/profile_decode.py
    ncu --clock-control none -k regex:codebook python experiments/profile_decode.py \
        --codec turboquant:b3

Runs the kernel's entry a few times so a profiler such as Nsight Compute sees a warm,
compiled kernel: the INT kernel's (:func:`pallas_kernels.int_decode.api.int_decode`) on
random packed codes (its speed depends only on the bytes), or with ``--codec`` the
registered fused kernel that reads that cache spec
(:func:`kvjax.attention.fused.kernel_call`: codebook, polar, octopus, HQMQ, Rice, or the
INT kernel over HyperQuant's int8 codes) over a cache of its codes.
"""

from __future__ import annotations

import argparse
import sys

import jax

from kvjax import compile_cache
from kvjax.attention import fused
from kvjax.eval.memory import model_shape
from kvjax.spec import parse_cache
from pallas_kernels.flash import NUM_WARPS, default_blocking, default_splits
from pallas_kernels.int_decode.api import int_decode, random_inputs
from pallas_kernels.int_decode.kernel import Research


def codec_call(spec: str, batch: int, heads: int, group: int, slots: int, head_dim: int):
    """``(kernel name, options -> partial)``: the registered fused kernel that reads
    ``spec`` (:func:`kvjax.attention.fused.kernel_call`), over a cache of that spec's
    codes; a ValueError when none reads it."""
    config = parse_cache(spec)
    call = fused.kernel_call(config.k, config.v, batch=batch, heads=heads, slots=slots,
                             head_dim=head_dim, key=jax.random.key(0), distinct=1024)
    q = jax.random.normal(jax.random.key(1), (batch, heads, group, head_dim))
    return call.name, lambda **options: call(q, **options)


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
    p.add_argument("--num-warps", type=int,
                   help=f"default: {NUM_WARPS} for the INT kernel, the codec kernel's own")
    p.add_argument("--num-stages", type=int)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--codec", metavar="SPEC",
                   help="a cache spec read by a fused kernel (e.g. turboquant:b3)")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    try:
        shape = model_shape(args.shape)
        research = Research(layout=args.layout)
        heads, head_dim = shape.num_kv_heads, shape.head_dim
        group = shape.num_heads // heads
        if args.codec:
            name, call = codec_call(args.codec, args.batch, heads, group, args.slots,
                                      head_dim)
    except ValueError as err:  # CodecError is a ValueError
        print(f"profile_decode: {err}", file=sys.stderr)
        return 2
    if args.codec:  # the kernel's own choices where the command line sets none
        options = {name: value for name, value in (
            ("block_s", args.block_s), ("num_warps", args.num_warps),
            ("num_stages", args.num_stages)) if value is not None}
    else:
        block_s, stages = default_blocking(args.block_s, args.num_stages)
        warps = args.num_warps or NUM_WARPS
        options = {"block_s": block_s, "num_warps": warps, "num_stages": stages,
                   "splits": default_splits(args.batch, heads, args.slots, block_s, warps)}
    if not args.codec:
        arrays = random_inputs(jax.random.key(0), batch=args.batch, heads=heads,
                               group=group, slots=args.slots, head_dim=head_dim,
                               bits=args.bits)

        def call(**options):
            return int_decode(**arrays, bits=args.bits, sm_scale=head_dim**-0.5,
                              research=research, **options)

    for _ in range(args.calls):
        jax.block_until_ready(call(**options))
    kernel = f"{args.codec} [{name}]" if args.codec else f"int{args.bits} layout {args.layout}"
    chosen = " ".join(f"{name} {value}" for name, value in options.items())
    print(f"ran {args.calls} calls: B={args.batch} S={args.slots} {chosen or 'defaults'} "
          f"{kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
