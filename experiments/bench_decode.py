"""Decode-attention latency: the fused INT-N kernel vs cuDNN / XLA bf16 and
dequantize-then-attend, in one run, with the same query and cache length for all.

    python experiments/bench_decode.py                 # the full table (GPU)
    python experiments/bench_decode.py --quick         # two shapes, fewer repeats

Each path attends one query token per row (N query heads, K kv heads, head dim D) to
all S cached tokens: ``cudnn`` / ``xla`` are ``jax.nn.dot_product_attention`` over a
bf16 cache; ``dequant`` unpacks the int4 codes to bf16 and then runs cuDNN (what a
codec without a fused kernel pays); ``fused`` and ``saw`` run the Pallas kernel over the
packed codes (``saw``: the query rotated and column-permuted by one XLA product first)
and merge its splits, with the library's default blocking
(:func:`~pallas_kernels.int_decode.api.default_blocking`); ``saw-in-kernel`` rotates the
query inside every program instead.

Timing: every path is compiled and run once before timing (compile time reported
apart); a timed sample is one jitted call that runs the path ``--inner`` times in a
``lax.fori_loop`` whose query depends on the previous output (so nothing is hoisted),
divided by ``--inner``; the table shows the median of ``--repeats`` samples. ``GB/s`` is
the bytes the path must read (cache + query) over its time; ``floor`` is those bytes at
``--peak-gbs``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codecs import SawCodec
from kvjax.codecs.intn import dequantize
from kvjax.primitives.packing import unpack_bits
from pallas_kernels.int_decode.api import NUM_WARPS, default_blocking, default_splits
from pallas_kernels.int_decode.kernel import codes_partial, operand_width, pad_query_rows
from pallas_kernels.int_decode.reference import merge_partials, normalize

SHAPES = {
    # name: (query heads N, kv heads K, head dim D)
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
}
FULL_GRID = [(1, 4096), (8, 4096), (32, 4096), (1, 32768), (8, 32768), (32, 32768),
             (1, 131072)]
QUICK_GRID = [(32, 32768), (1, 131072)]


def random_codes(key, batch, heads, slots, head_dim, bits):
    """Uniformly random packed words and fp16 scales/zeros: the kernel's speed does not
    depend on the values, only on the bytes."""
    words = head_dim * bits // 32
    k1, k2, k3 = jax.random.split(key, 3)
    codes = jax.random.bits(k1, (batch, heads, slots, words), jnp.uint32)
    scale = (jax.random.uniform(k2, (batch, heads, slots)) * 0.1).astype(jnp.float16)
    zero = (jax.random.normal(k3, (batch, heads, slots)) * 0.1).astype(jnp.float16)
    return codes, scale, zero


def nbytes(*arrays) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays)


def timed(fn, args, inner, repeats):
    """(compile seconds, median seconds per call) of ``fn(q, *rest) -> out like q``."""

    def loop(q, *rest):
        def body(_, q):
            return q + 1e-30 * fn(q, *rest).astype(q.dtype)
        return jax.lax.fori_loop(0, inner, body, q)

    t0 = time.perf_counter()
    compiled = jax.jit(loop).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        samples.append((time.perf_counter() - t) / inner)
    return compile_s, statistics.median(samples)


def unpack_int4_bf16(codes, scale, zero, head_dim):
    """Dequantize planar int4 words to bf16 ``[B, S, K, D]`` (the layout cuDNN takes)."""
    x = dequantize(unpack_bits(codes, 4, head_dim), scale[..., None], zero[..., None])
    return jnp.swapaxes(x.astype(jnp.bfloat16), 1, 2)


def bench_shape(name, batch, slots, inner, repeats, block_s, num_warps, num_stages, peak,
                variants=()):
    num_heads, heads, head_dim = SHAPES[name]
    group = num_heads // heads
    key = jax.random.key(0)
    kq, kk, kv, kr = jax.random.split(key, 4)
    q = jax.random.normal(kq, (batch, num_heads, head_dim), jnp.float32)
    block_s, num_stages = default_blocking(block_s, num_stages)
    splits = default_splits(batch, heads, slots, block_s, num_warps)
    results = {}

    # bf16 baselines: cache [B, S, K, D]
    k16 = jax.random.normal(kk, (batch, slots, heads, head_dim), jnp.bfloat16)
    v16 = jax.random.normal(kv, (batch, slots, heads, head_dim), jnp.bfloat16)
    bf16_bytes = nbytes(k16, v16)
    for impl in ("cudnn", "xla"):
        def attn(q, k, v, impl=impl):
            out = jax.nn.dot_product_attention(q[:, None].astype(jnp.bfloat16), k, v,
                                               implementation=impl)
            return out[:, 0]
        try:
            results[impl] = (*timed(attn, (q, k16, v16), inner, repeats), bf16_bytes)
        except Exception as err:  # report, keep benchmarking the other paths
            results[impl] = (float("nan"), float("nan"), bf16_bytes)
            print(f"  {impl} failed: {str(err).splitlines()[0][:120]}", file=sys.stderr)
    del k16, v16

    k_arrays = random_codes(kk, batch, heads, slots, head_dim, 4)
    v_arrays = random_codes(kv, batch, heads, slots, head_dim, 4)
    code_bytes = nbytes(*k_arrays, *v_arrays)
    n_comp = jnp.full((batch,), slots, jnp.int32)

    def dequant(q, kc, ks, kz, vc, vs, vz):
        k = unpack_int4_bf16(kc, ks, kz, head_dim)
        v = unpack_int4_bf16(vc, vs, vz, head_dim)
        out = jax.nn.dot_product_attention(q[:, None].astype(jnp.bfloat16), k, v,
                                           implementation="cudnn")
        return out[:, 0]

    results["dequant"] = (*timed(dequant, (q, *k_arrays, *v_arrays), inner, repeats),
                          code_bytes)

    saw = SawCodec(block=min(128, head_dim), signs=True)
    rotation = jnp.broadcast_to(
        saw.rotate(saw.init(kr, head_dim), jnp.eye(head_dim)).T, (heads, head_dim, head_dim))

    def fused(q, kc, ks, kz, vc, vs, vz, n, rot=None, layout="halves", block_s=block_s,
              num_warps=num_warps, num_stages=num_stages, splits=None, asm=True,
              rotate_in_kernel=False):
        qg = pad_query_rows(q.reshape(batch, heads, group, head_dim),
                            operand_width(head_dim, 4, layout))
        n_splits = splits or default_splits(batch, heads, slots, block_s, num_warps)
        o, m, l = codes_partial(qg, kc, ks, kz, vc, vs, vz, n, rot, bits=4,
                                sm_scale=head_dim**-0.5, block_s=block_s, splits=n_splits,
                                num_warps=num_warps, num_stages=num_stages, layout=layout,
                                asm=asm, rotate_in_kernel=rotate_in_kernel)
        out = normalize(*merge_partials((o[..., :group, :], m[..., :group], l[..., :group]),
                                        axis=2))
        return out.reshape(batch, num_heads, head_dim)

    results["fused"] = (*timed(fused, (q, *k_arrays, *v_arrays, n_comp), inner, repeats),
                        code_bytes)
    results["saw"] = (*timed(lambda q, *a: fused(q, *a, rot=rotation),
                             (q, *k_arrays, *v_arrays, n_comp), inner, repeats), code_bytes)
    results["saw-in-kernel"] = (
        *timed(lambda q, *a: fused(q, *a, rot=rotation, rotate_in_kernel=True),
               (q, *k_arrays, *v_arrays, n_comp), inner, repeats), code_bytes)
    for variant in variants:
        layout, bs, warps, stages, *n_splits = variant.split(":")
        kw = {"layout": layout.removesuffix("-jnp"), "asm": not layout.endswith("-jnp"),
              "block_s": int(bs), "num_warps": int(warps), "num_stages": int(stages),
              "splits": int(n_splits[0]) if n_splits else None}
        try:
            results[f"fused[{variant}]"] = (
                *timed(lambda q, *a, kw=kw: fused(q, *a, **kw),
                       (q, *k_arrays, *v_arrays, n_comp), inner, repeats), code_bytes)
        except Exception as err:  # report, keep benchmarking the other variants
            print(f"  {variant} failed: {str(err).splitlines()[0][:160]}", file=sys.stderr)
    return {"shape": name, "batch": batch, "slots": slots, "splits": splits,
            "block_s": block_s, "floor_ms": 1e3 * code_bytes / (peak * 1e9),
            "paths": {k: {"compile_s": c, "ms": 1e3 * t, "bytes": b,
                          "gbs": b / t / 1e9 if t == t else float("nan")}
                      for k, (c, t, b) in results.items()}}


def table(rows):
    head = ("| shape | B | S | splits | path | ms | GB/s | vs cuDNN bf16 | floor ms |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        base = r["paths"]["cudnn"]["ms"]
        for path, p in r["paths"].items():
            lines.append(f"| {r['shape']} | {r['batch']} | {r['slots']} | {r['splits']} | "
                         f"{path} | {p['ms']:.3f} | {p['gbs']:.0f} | {base / p['ms']:.2f}x | "
                         f"{r['floor_ms']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the grid and print the table (and a JSON file with ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shape", choices=sorted(SHAPES), action="append")
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--block-s", type=int, help="default: the library's choice")
    p.add_argument("--num-warps", type=int, default=NUM_WARPS)
    p.add_argument("--num-stages", type=int, help="default: the library's choice")
    p.add_argument("--json", type=Path)
    p.add_argument("--peak-gbs", type=float, default=4240.0,
                   help="device-to-device copy bandwidth measured on the H200")
    p.add_argument("--variant", action="append", default=[],
                   metavar="LAYOUT:BLOCK_S:WARPS:STAGES[:SPLITS]",
                   help="extra kernel configurations to time, e.g. bytes:128:8:3 or "
                        "halves-jnp:64:4:2:66 (-jnp: unpack without inline PTX)")
    args = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_decode: needs a GPU (cuDNN and the compiled kernel)", file=sys.stderr)
        return 2
    grid = QUICK_GRID if args.quick else FULL_GRID
    rows = []
    for shape in args.shape or ["llama3-8b", "smollm2-135m"]:
        for batch, slots in grid:
            rows.append(bench_shape(shape, batch, slots, args.inner, args.repeats,
                                    args.block_s, args.num_warps, args.num_stages,
                                    args.peak_gbs, args.variant))
            print(table(rows[-1:]).splitlines()[-5:], file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
