"""Decode-attention latency: the fused kernels vs cuDNN / XLA bf16 and
dequantize-then-attend, in one run, with the same query and cache length for all.

    python experiments/bench_decode.py                 # the full table (GPU)
    python experiments/bench_decode.py --quick         # two shapes, fewer repeats
    python experiments/bench_decode.py --codec turboquant:b3 --codec turboquant:b4,qjl

Each path attends one query token per row (N query heads, K kv heads, head dim D: the
attention shape of a model of :func:`kvjax.eval.memory.model_shape`) to all S cached
tokens: ``cudnn`` / ``xla`` are ``jax.nn.dot_product_attention`` over a bf16 cache;
``dequant`` unpacks the int4 codes to bf16 and then runs cuDNN (what a codec without a
fused kernel pays); ``fused`` and ``saw`` call the kernel's entry,
:func:`pallas_kernels.int_decode.api.int_decode` (the one the models' attention calls),
over the packed codes with the library's default blocking and split count (``saw``:
with SAW's query rotation, which the entry applies with the column permutation in one
XLA product) and normalize its partial; ``saw-in-kernel`` and ``--variant`` are
benchmark-only kernel variants (:class:`~pallas_kernels.int_decode.kernel.Research`).
Each ``--codec`` (a cache spec read by a registered fused kernel: TurboQuant MSE or
QJL, PolarQuant, OCTOPUS, HyperQuant int8 or Rice, HQMQ with or without Med-C; default
:data:`CODECS`) adds its fused path,
``<spec> [<kernel>]``, the kernel's entry over that cache's arrays
(:func:`kvjax.attention.fused.kernel_call`: Gaussian vectors encoded by its codecs), and
``<spec> dequant``, the same codes decoded by the codecs to bf16 and attended by cuDNN.

Timing: every path is compiled and run once before timing (compile time reported
apart); a timed sample is one jitted call that runs the path ``--inner`` times in a
``lax.fori_loop`` whose query depends on the previous output (so nothing is hoisted),
divided by ``--inner``; the table shows the median of ``--repeats`` samples. ``GB/s`` is
the bytes the path must read (the cache) over its time; ``floor ms`` is those bytes at
``--peak-gbs`` and ``vs floor`` the path's time over it.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import compile_cache
from kvjax.attention import fused
from kvjax.eval.memory import model_shape
from kvjax.eval.timing import timed
from kvjax.spec import parse_cache
from pallas_kernels.flash import NUM_WARPS, default_blocking, default_splits
from pallas_kernels.int_decode.api import int_decode, random_inputs
from pallas_kernels.int_decode.kernel import Research
from pallas_kernels.int_decode.reference import dequantize
from pallas_kernels.partial import normalize

SHAPES = ("llama-3-8b", "smollm2-135m")
FULL_GRID = [(1, 4096), (8, 4096), (32, 4096), (1, 32768), (8, 32768), (32, 32768),
             (1, 131072)]
QUICK_GRID = [(32, 32768), (1, 131072)]
BITS = 4
#: the cache specs timed through their fused kernel by default
CODECS = ("turboquant:b4", "turboquant:b3", "turboquant:b4,qjl", "turboquant:b3,qjl",
          "polarquant:b3", "octopus:b3", "octopus:b4,qjl", "hyperquant:e8,4bps,int8", "hqmq",
          "hqmq:s96,r4,med3", "hyperquant:e8,3bps")
#: tokens encoded per (row, kv head) for a codec's cache, repeated to its length
DISTINCT_TOKENS = 1024


def nbytes(*arrays) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays)


def parse_variant(text: str) -> dict:
    """``LAYOUT:BLOCK_S:WARPS:STAGES[:SPLITS]`` (LAYOUT ``halves`` or ``bytes``, with any
    of the suffixes ``-jnp``: unpacked without inline PTX, ``-sub``: unbiased planes, one
    subtraction per pair of codes, ``-hN``: programs of N kv heads) as
    :func:`int_decode` options."""
    layout, block_s, warps, stages, *splits = text.split(":")
    name, *flags = layout.split("-")
    heads = [int(f[1:]) for f in flags if re.fullmatch(r"h\d+", f)]
    unknown = {f for f in flags if not re.fullmatch(r"h\d+", f)} - {"jnp", "sub"}
    if unknown or len(heads) > 1:
        raise ValueError(f"unknown layout suffixes in {text!r}")
    return {"research": Research(layout=name, asm="jnp" not in flags,
                                 biased="sub" not in flags, heads=heads[0] if heads else 1),
            "block_s": int(block_s), "num_warps": int(warps), "num_stages": int(stages),
            "splits": int(splits[0]) if splits else None}


def codec_kernel(spec: str, head_dim: int):
    """``(config, kernel)`` of the registered fused kernel that reads a cache spec at
    ``head_dim`` (:func:`kvjax.attention.fused.find_kernel`), or a ValueError."""
    config = parse_cache(spec)
    return config, fused.find_kernel(config.k, config.v, head_dim)[0]


def parse_codec_variant(text: str) -> dict:
    """``BLOCK_S:WARPS:STAGES[:SPLITS]``, or ``KEY=VALUE[,KEY=VALUE...]`` (any option
    of the kernel's entry, e.g. ``lookup=table``; whole numbers as ints), as the
    kernel options it sets."""
    if "=" in text:
        options = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            if not key.isidentifier() or not value:
                raise ValueError(f"--codec-variant {text!r}: KEY=VALUE pairs, got {item!r}")
            options[key] = int(value) if value.isdigit() else value
        return options
    try:
        block_s, warps, stages, *splits = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--codec-variant takes BLOCK_S:WARPS:STAGES[:SPLITS], got "
                         f"{text!r}") from None
    if (len(splits) > 1 or min(block_s, warps, stages, *splits) < 1
            or warps & (warps - 1)):
        raise ValueError(f"--codec-variant {text!r}: positive sizes, warps a power of two")
    return {"block_s": block_s, "num_warps": warps, "num_stages": stages,
            **({"splits": splits[0]} if splits else {})}


def bench_codec(spec, q, batch, heads, group, slots, head_dim, inner, repeats, options,
                variants=()):
    """``{path: (compile s, s per call, bytes)}`` of the fused kernel that reads a cache
    spec (:func:`kvjax.attention.fused.kernel_call`), of the same kernel under each of
    ``variants`` (``{label: kernel options}``; one that fails to compile is reported and
    skipped) and of its dequantize-then-cuDNN path."""
    config = parse_cache(spec)
    call = fused.kernel_call(config.k, config.v, batch=batch, heads=heads, slots=slots,
                             head_dim=head_dim, key=jax.random.key(1),
                             distinct=DISTINCT_TOKENS)
    num_heads = heads * group

    def kernel(q, arrays, options=options):
        qg = q.reshape(batch, heads, group, head_dim)
        return normalize(*call(qg, arrays, **options)).reshape(batch, num_heads, head_dim)

    def dequant(q, codecs):
        # what a cache without a fused kernel pays: the codecs' own decode (QJL's
        # reconstruction included), then cuDNN over [B, S, K, D] bf16
        k_params, k_codes, v_params, v_codes = codecs
        keys, values = (jax.vmap(codec.decode, in_axes=(0, 1), out_axes=1)(params, codes)
                        for codec, params, codes in ((config.k, k_params, k_codes),
                                                     (config.v, v_params, v_codes)))
        k, v = (jnp.swapaxes(a.astype(jnp.bfloat16), 1, 2) for a in (keys, values))
        out = jax.nn.dot_product_attention(
            q.reshape(batch, 1, num_heads, head_dim).astype(jnp.bfloat16), k, v,
            implementation="cudnn")
        return out[:, 0]

    read = call.read_bytes
    results = {f"{spec} [{call.name}]": (*timed(kernel, (q, call.arrays), inner, repeats),
                                         read)}
    for label, variant in dict(variants).items():
        try:
            results[f"{spec} [{call.name} {label}]"] = (
                *timed(functools.partial(kernel, options={**options, **variant}),
                       (q, call.arrays), inner, repeats), read)
        except Exception as err:  # report, keep timing the other variants
            print(f"  {spec} {label} failed: {str(err).splitlines()[0][:160]}",
                  file=sys.stderr)
    results[f"{spec} dequant"] = (*timed(dequant, (q, call.codecs), inner, repeats), read)
    return results


def bench_shape(name, batch, slots, inner, repeats, block_s, num_warps, num_stages, peak,
                variants=(), codecs=CODECS, codec_variants=None):
    shape = model_shape(name)
    num_heads, heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    group = num_heads // heads
    kk, kv, kc = jax.random.split(jax.random.key(0), 3)
    arrays = random_inputs(kc, batch=batch, heads=heads, group=group, slots=slots,
                           head_dim=head_dim, bits=BITS, rotated=True)
    q = arrays.pop("q").reshape(batch, num_heads, head_dim)
    rotation = arrays.pop("q_rotation")
    codes = (arrays["k_codes"], arrays["k_scale"], arrays["k_zero"], arrays["v_codes"],
             arrays["v_scale"], arrays["v_zero"])
    lengths = arrays["lengths"]
    block_arg, stages_arg, warps_arg = block_s, num_stages, num_warps
    block_s, num_stages = default_blocking(block_s, num_stages)
    num_warps = num_warps or NUM_WARPS
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
    code_bytes = nbytes(*codes)

    def dequant(q, kc, ks, kz, vc, vs, vz):
        # [B, K, S, D] -> [B, S, K, D] bf16, the layout cuDNN takes
        k = jnp.swapaxes(dequantize(kc, ks, kz, BITS, head_dim).astype(jnp.bfloat16), 1, 2)
        v = jnp.swapaxes(dequantize(vc, vs, vz, BITS, head_dim).astype(jnp.bfloat16), 1, 2)
        out = jax.nn.dot_product_attention(q[:, None].astype(jnp.bfloat16), k, v,
                                           implementation="cudnn")
        return out[:, 0]

    results["dequant"] = (*timed(dequant, (q, *codes), inner, repeats), code_bytes)

    def fused(q, kc, ks, kz, vc, vs, vz, n, rot=None, **options):
        options = {"block_s": block_s, "num_warps": num_warps, "num_stages": num_stages,
                   **options}
        qg = q.reshape(batch, heads, group, head_dim)
        out = normalize(*int_decode(qg, kc, ks, kz, vc, vs, vz, n, q_rotation=rot,
                                    bits=BITS, sm_scale=head_dim**-0.5, **options))
        return out.reshape(batch, num_heads, head_dim)

    paths = {
        "fused": {},
        "saw": {"rot": rotation},
        "saw-in-kernel": {"rot": rotation, "research": Research(rotate_in_kernel=True)},
    }
    paths.update({f"fused[{v}]": parse_variant(v) for v in variants})
    for path, kw in paths.items():
        try:
            results[path] = (*timed(lambda q, *a, kw=kw: fused(q, *a, **kw),
                                    (q, *codes, lengths), inner, repeats), code_bytes)
        except Exception as err:  # report, keep benchmarking the other variants
            print(f"  {path} failed: {str(err).splitlines()[0][:160]}", file=sys.stderr)
    # each codec's kernel takes its own default blocking unless the command line sets one
    options = {name: value for name, value in (("block_s", block_arg),
               ("num_warps", warps_arg), ("num_stages", stages_arg)) if value is not None}
    for spec in codecs:
        try:
            results.update(bench_codec(spec, q, batch, heads, group, slots, head_dim,
                                        inner, repeats, options, codec_variants or {}))
        except Exception as err:  # report, keep benchmarking the other codecs
            print(f"  {spec} failed: {str(err).splitlines()[0][:160]}", file=sys.stderr)
    return {"shape": name, "batch": batch, "slots": slots, "splits": splits,
            "block_s": block_s,
            "paths": {k: {"compile_s": c, "ms": 1e3 * t, "bytes": b,
                          "gbs": b / t / 1e9 if t == t else float("nan"),
                          "floor_ms": 1e3 * b / (peak * 1e9)}
                      for k, (c, t, b) in results.items()}}


def table(rows):
    """A markdown table, one line per (shape, B, S, path)."""
    head = ("| shape | B | S | splits | path | ms | GB/s | vs cuDNN bf16 | floor ms "
            "| vs floor |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        base = r["paths"]["cudnn"]["ms"]
        for path, p in r["paths"].items():
            lines.append(f"| {r['shape']} | {r['batch']} | {r['slots']} | {r['splits']} | "
                         f"{path} | {p['ms']:.3f} | {p['gbs']:.0f} | {base / p['ms']:.2f}x | "
                         f"{p['floor_ms']:.3f} | {p['ms'] / p['floor_ms']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the grid and print the table (and a JSON file with ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--point", action="append", metavar="B:S",
                   help="rows and cached tokens to time instead of the grid")
    p.add_argument("--shape", action="append",
                   help=f"a model of kvjax.eval.memory.model_shape (default: {SHAPES})")
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--block-s", type=int, help="default: the library's choice")
    p.add_argument("--num-warps", type=int,
                   help=f"default: {NUM_WARPS} for the INT kernel, each codec's own choice")
    p.add_argument("--num-stages", type=int, help="default: the library's choice")
    p.add_argument("--json", type=Path)
    p.add_argument("--peak-gbs", type=float, default=4240.0,
                   help="device-to-device copy bandwidth measured on the H200")
    p.add_argument("--variant", action="append", default=[],
                   metavar="LAYOUT:BLOCK_S:WARPS:STAGES[:SPLITS]",
                   help="extra kernel configurations to time, e.g. bytes:128:8:3, "
                        "halves-h2:128:2:3 (programs of 2 kv heads), halves-sub:128:2:3 "
                        "(unbiased planes) or halves-jnp:64:4:2:66 (-jnp: unpack without "
                        "inline PTX)")
    p.add_argument("--codec-variant", action="append", default=[],
                   metavar="B:W:S[:SPLITS]|KEY=VALUE",
                   help="also time every --codec's kernel with these options, e.g. 32:4:2, "
                        "64:2:2:16 or lookup=table (repeatable; the default "
                        "configuration is always timed)")
    p.add_argument("--codec", action="append", metavar="SPEC",
                   help="cache specs read by a fused kernel "
                        f"(default: {', '.join(CODECS)})")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    shapes = args.shape or list(SHAPES)
    try:
        for name in shapes:
            model_shape(name)
        for variant in args.variant:
            parse_variant(variant)
        # each as the command line wrote it: the label of its rows
        codec_variants = {text: parse_codec_variant(text) for text in args.codec_variant}
        points = [tuple(int(x) for x in text.split(":")) for text in args.point or ()]
        if any(len(point) != 2 for point in points):
            raise ValueError(f"--point takes B:S, got {args.point}")
        codecs = tuple(args.codec or CODECS)
        for spec in codecs:
            for name in shapes:
                codec_kernel(spec, model_shape(name).head_dim)
    except (ValueError, TypeError) as err:  # CodecError is a ValueError
        print(f"bench_decode: {err}", file=sys.stderr)
        return 2
    if jax.default_backend() != "gpu":
        print("bench_decode: needs a GPU (cuDNN and the compiled kernel)", file=sys.stderr)
        return 2
    grid = points or (QUICK_GRID if args.quick else FULL_GRID)
    rows = []
    for shape in shapes:
        for batch, slots in grid:
            rows.append(bench_shape(shape, batch, slots, args.inner, args.repeats,
                                    args.block_s, args.num_warps, args.num_stages,
                                    args.peak_gbs, args.variant, codecs,
                                    codec_variants))
            print(table(rows[-1:]), file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
