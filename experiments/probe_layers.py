"""The cache's share of a decode step: append one token and attend, over every layer.

    python experiments/probe_layers.py                     # GPU: bf16 / int:4, B=8, S=32k

No weights: each layer appends a random K/V token and attends with a random query, the
way a model's decode step does (with the cache config's attention: ``"auto"`` unless the
spec says ``attn=``), so the time is the cache's alone.
``scan`` runs the layers the way the models do (:func:`kvjax.cache.scan_layers`: the
stacked codes ride in the scan's carry, each layer reads them at its index); ``unrolled``
runs a Python loop over separate per-layer caches (each layer's codes its own buffer).
Their difference is what indexing a stacked cache costs a path. ``GB/s`` is the cache's
bytes over the step time; XLA's temporary bytes are from the compiled step.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from kvjax import cache as kc
from kvjax import compile_cache
from kvjax.attention import attend
from kvjax.spec import parse_cache


def filled_cache(spec, *, layers, batch, heads, head_dim, context):
    """A cache of ``context`` tokens per row (zeros: speed does not depend on values)."""
    config = parse_cache(spec)
    cache = kc.init_cache(jax.random.key(0), config, num_layers=layers, batch=batch,
                          num_kv_heads=heads, head_dim=head_dim, max_len=context + 64,
                          dtype=jnp.bfloat16)
    return dataclasses.replace(cache, lengths=jnp.full((batch,), context, jnp.int32))


def step_fn(mode, num_heads):
    def attend_layer(view, step, key, attention):
        kq, kk = jax.random.split(key)
        batch, heads, _, head_dim = view.k.raw.shape
        kv = jax.random.normal(kk, (batch, 1, heads, head_dim), jnp.bfloat16)
        view = kc.append(view, kv, kv, step)
        q = jax.random.normal(kq, (batch, 1, num_heads, head_dim), jnp.bfloat16)
        return attend(q, view, step, impl=attention), view

    def scanned(cache, key):
        step = kc.make_step(cache, 1)

        def body(acc, i, view):
            o, view = attend_layer(view, step, jax.random.fold_in(key, i),
                                   cache.config.attention)
            return acc + o.astype(jnp.float32).sum(), view

        acc, cache = kc.scan_layers(body, jnp.float32(0), cache,
                                    jnp.arange(cache.num_layers))
        return acc, kc.commit(cache, step)

    def unrolled(caches, key):
        step = kc.make_step(caches[0], 1)
        acc, out = jnp.float32(0), []
        for i, c in enumerate(caches):
            o, view = attend_layer(c.layer(0), step, jax.random.fold_in(key, i),
                                   c.config.attention)
            acc = acc + o.astype(jnp.float32).sum()
            out.append(kc.commit(c.with_layer(0, view), step))
        return acc, tuple(out)

    return scanned if mode == "scan" else unrolled


def measure(spec, mode, args):
    def make(layers):
        return filled_cache(spec, layers=layers, batch=args.batch, heads=args.kv_heads,
                            head_dim=args.head_dim, context=args.context)

    state = make(args.layers) if mode == "scan" else tuple(make(1) for _ in range(args.layers))
    nbytes = sum(kc.memory_bytes(c) for c in (state if mode == "unrolled" else (state,)))
    fn = jax.jit(step_fn(mode, args.heads), donate_argnums=0)
    key = jax.random.key(1)
    compiled = fn.lower(state, key).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    if args.hlo:
        print_big_values(compiled.as_text(), args.hlo * 2**20)
    acc, state = compiled(state, key)
    samples = []
    for r in range(args.repeats):
        jax.block_until_ready(state)
        t = time.perf_counter()
        acc, state = compiled(state, jax.random.fold_in(key, r))
        jax.block_until_ready((acc, state))
        samples.append(time.perf_counter() - t)
    ms = 1e3 * statistics.median(samples)
    return ms, nbytes / ms / 1e6, temp


SIZES = {"bf16": 2, "f16": 2, "f32": 4, "u32": 4, "s32": 4, "u8": 1, "pred": 1}


def print_big_values(hlo: str, threshold: float) -> None:
    """The instructions of the optimized HLO whose result is at least ``threshold`` bytes
    (parameters excluded): where a path copies or converts a large part of the cache."""
    pattern = re.compile(r"^\s*(?:ROOT )?(\S+) = (\w+)\[([\d,]*)\]\S* (\S+)\(")
    for line in hlo.splitlines():
        m = pattern.match(line)
        if not m or m.group(4) == "parameter" or m.group(2) not in SIZES:
            continue
        dims = [int(d) for d in m.group(3).split(",") if d]
        nbytes = SIZES[m.group(2)] * math.prod(dims)
        if nbytes >= threshold:
            print(f"  {nbytes / 2**20:8.0f} MiB  {line.strip()[:220]}", file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", action="append", default=None)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--hlo", type=float, default=0,
                   help="print optimized-HLO values of at least this many MiB")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    print("| codec | layers | mode | ms/step | GB/s of cache | XLA temp MiB |")
    print("|---|---|---|---|---|---|")
    for spec in args.codec or ["bf16", "int:4"]:
        for mode in ("scan", "unrolled"):
            ms, gbs, temp = measure(spec, mode, args)
            print(f"| {spec} | {args.layers} | {mode} | {ms:.3f} | {gbs:.0f} | "
                  f"{temp / 2**20:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
