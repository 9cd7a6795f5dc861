"""Prefill-attention throughput: the chunk-attention kernel at its default blocking and
at ``--variant`` blockings, against cuDNN's flash attention where it can do the same work,
in one run.

    python experiments/bench_prefill.py                        # Llama-3-8B shape (GPU)
    python experiments/bench_prefill.py --point 8:1024:31744 --variant 128:64:8:3
    python experiments/bench_prefill.py --point 8:1024:31744 --cache int:4 --cache bf16
    python experiments/bench_prefill.py --shape smollm2-135m --point 1:32:32 \\
        --inner 1 --repeats 1                                  # a CPU smoke run

A point ``B:T:S`` is a prefill chunk of ``T`` tokens per row (``N`` query heads grouped
over ``K`` kv heads, head dim ``D``: the attention shape of
:func:`kvjax.eval.memory.model_shape`) at positions ``S .. S + T - 1``, attending
causally to the ``S`` tokens before it and to itself: what every chunk of a chunked
prefill does, ``S`` growing chunk by chunk. ``chunk_flash`` is
:func:`pallas_kernels.chunk_attention.api.chunk_attention` (what the ``"chunk_flash"``
attention calls) over bfloat16 keys and values ``[B, K, S + T, D]``; a ``--variant
BLOCK_Q:BLOCK_K:WARPS:STAGES[:ORDER]`` runs it with that blocking (and grid order:
``queries`` starts the query blocks of one row and kv head together), and its output is
compared
with the default's (``max diff``, which must stay at bfloat16 rounding). ``cudnn`` is
``jax.nn.dot_product_attention`` with ``is_causal`` over the chunk alone, so it runs
only where ``S = 0`` (its causal mask is aligned at the first query; a chunk after a
history needs it aligned at the last).

``--cache SPEC`` (repeatable) also times the chunk over one layer of that cache holding
the ``S`` tokens before it (random keys and values, encoded as a prefill stores them),
through the cache's attention list as a model's layer calls it (``"auto"``: on a GPU the
fused kernel over its codes, which reads the history in place; the row names the
implementation that served): what a compressed prefill pays per layer and chunk, beside
``chunk_flash`` over bfloat16.

Timing as in ``bench_decode.py`` (:func:`kvjax.eval.timing.timed`): compile apart, the
median of ``--repeats`` samples of ``--inner`` dependent calls. ``TFLOP/s`` counts the
two matmuls over the keys each query row sees (``4 D`` flops per visible key), so
masked-out work a kernel does anyway is not counted; ``of peak`` is that rate over
``--peak-tflops`` (the H200's dense bfloat16 rate by default).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kc
from kvjax import compile_cache
from kvjax.attention import REGISTRY, Call, attend, resolve
from kvjax.eval.memory import MODEL_SHAPES, model_shape
from kvjax.eval.sweep import write_json
from kvjax.eval.timing import timed
from kvjax.spec import parse_cache
from pallas_kernels.chunk_attention.api import chunk_attention
from pallas_kernels.chunk_attention.kernel import ORDERS

DEFAULT_POINTS = ((8, 1024, 0), (8, 1024, 15360), (8, 1024, 31744), (1, 4096, 126976))


def parse_point(text: str) -> tuple[int, int, int]:
    """``B:T:S`` -> ``(B, T, S)``, each an integer, ``B, T >= 1``, ``S >= 0``."""
    parts = text.split(":")
    try:
        batch, tokens, history = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"a point is B:T:S (three integers), got '{text}'") from None
    if batch < 1 or tokens < 1 or history < 0:
        raise ValueError(f"a point needs B, T >= 1 and S >= 0, got '{text}'")
    return batch, tokens, history


def parse_variant(text: str) -> dict:
    """``BLOCK_Q:BLOCK_K:WARPS:STAGES[:ORDER]`` -> the kernel entry's keywords (``ORDER``
    one of :data:`pallas_kernels.chunk_attention.kernel.ORDERS`, default ``rows``)."""
    names = ("block_q", "block_k", "num_warps", "num_stages")
    parts = text.split(":")
    order = parts.pop() if len(parts) == len(names) + 1 else "rows"
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != len(names) or min(values) < 1 or order not in ORDERS:
        raise ValueError(f"a variant is BLOCK_Q:BLOCK_K:WARPS:STAGES (positive integers), "
                         f"then optionally :ORDER, one of {ORDERS}; got '{text}'")
    return {**dict(zip(names, values, strict=True)), "order": order}


def visible_keys(tokens: int, history: int) -> int:
    """Keys the chunk's ``tokens`` query tokens see in total, causally after ``history``
    stored tokens: token ``t`` sees ``history + t + 1``."""
    return tokens * history + tokens * (tokens + 1) // 2


def bench_point(shape, batch, tokens, history, variants, inner, repeats, peak_tflops,
                interpret=None):
    """The rows of one point: every path's compile and run time and throughput
    (``shape`` a :class:`~kvjax.eval.memory.ModelShape`)."""
    heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    group = heads // kv_heads
    slots = history + tokens
    kq, kk, kv = jax.random.split(jax.random.key(batch * 7919 + tokens + history), 3)
    # query rows grouped per kv head, row r = g * T + t (chunk_attention's order)
    q = jax.random.normal(kq, (batch, kv_heads, group * tokens, head_dim), jnp.bfloat16)
    keys = jax.random.normal(kk, (batch, kv_heads, slots, head_dim), jnp.bfloat16)
    values = jax.random.normal(kv, (batch, kv_heads, slots, head_dim), jnp.bfloat16)
    positions = jnp.tile(history + jnp.arange(tokens, dtype=jnp.int32), (batch, group))
    lengths = jnp.full((batch,), slots, jnp.int32)
    scale = head_dim ** -0.5
    flops = 4 * head_dim * heads * batch * visible_keys(tokens, history)

    def flash(options):
        def run(q, k, v, pos, n):
            return chunk_attention(q, k, v, pos, n, sm_scale=scale, interpret=interpret,
                                   **options)
        return run

    args = (q, keys, values, positions, lengths)
    rows = []

    def row(path, compile_s, seconds, diff=None):
        rows.append({"batch": batch, "tokens": tokens, "history": history, "path": path,
                     "compile_s": compile_s, "ms": 1e3 * seconds,
                     "tflops": flops / seconds / 1e12,
                     "of_peak": flops / seconds / 1e12 / peak_tflops, "max_diff": diff})

    default = jax.jit(flash({}))(*args)
    row("chunk_flash", *timed(flash({}), args, inner, repeats))
    for text, options in variants.items():
        try:
            out = jax.jit(flash(options))(*args)
            diff = float(jnp.max(jnp.abs(out - default)))
            row(f"chunk_flash[{text}]", *timed(flash(options), args, inner, repeats), diff)
        except Exception as err:  # report, keep benchmarking the other variants
            print(f"  variant {text} failed: {str(err).splitlines()[0][:160]}",
                  file=sys.stderr)
    if history == 0 and jax.default_backend() == "gpu":
        # [B, T, N, D], query head n = k * G + g as in the grouped rows above
        q_bt = jnp.swapaxes(q.reshape(batch, heads, tokens, head_dim), 1, 2)
        k_bt, v_bt = (jnp.swapaxes(a, 1, 2) for a in (keys, values))

        def cudnn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                implementation="cudnn")
        ref = jnp.swapaxes(cudnn(q_bt, k_bt, v_bt), 1, 2).reshape(default.shape)
        row("cudnn", *timed(cudnn, (q_bt, k_bt, v_bt), inner, repeats),
            float(jnp.max(jnp.abs(ref.astype(jnp.float32) - default))))
    return rows


def chunk_view(cache_config, shape, batch, tokens, history, seed=0):
    """``(view, step, q [B, T, N, D])``: a one-layer cache of ``cache_config`` holding
    ``history`` random tokens per row (encoded as a prefill stores them), the chunk of
    ``tokens`` appended after them, and the chunk's queries (bfloat16)."""
    heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)

    @jax.jit
    def build():
        cache = kc.init_cache(kp, cache_config, num_layers=1, batch=batch,
                              num_kv_heads=kv_heads, head_dim=head_dim,
                              max_len=history + tokens, dtype=jnp.bfloat16)
        dims = (batch, history + tokens, kv_heads, head_dim)
        keys = jax.random.normal(kk, dims, jnp.bfloat16)
        values = jax.random.normal(kv, dims, jnp.bfloat16)
        if history:
            step = kc.make_step(cache, history)
            view = kc.append(cache.layer(0), keys[:, :history], values[:, :history], step)
            cache = kc.commit(cache.with_layer(0, view), step)
        step = kc.make_step(cache, tokens)
        view = kc.append(cache.layer(0), keys[:, history:], values[:, history:], step)
        q = jax.random.normal(kq, (batch, tokens, heads, head_dim), jnp.bfloat16)
        return view, step, q

    return build()


def serving(names, view, step, q) -> str:
    """The implementation of ``names`` that serves the chunk (the first whose
    ``supports`` passes, as :func:`kvjax.attention.attend` picks)."""
    call = Call(q=q, layer=view, step=step, lengths=step.start + step.valid,
                scale=q.shape[-1] ** -0.5, sliding_window=None)
    return next(name for name in resolve(names) if REGISTRY[name].supports(call) is None)


def cache_rows(shape, batch, tokens, history, specs, inner, repeats, peak_tflops):
    """One row per cache spec: the chunk's attention over a layer of that cache holding
    ``history`` tokens, through its attention list (``"auto"``: the fused kernel over
    its codes on a GPU), timed as the kernel rows are."""
    flops = 4 * shape.head_dim * shape.num_heads * batch * visible_keys(tokens, history)
    rows = []
    for spec in specs:
        cache_config = parse_cache(spec)
        view, step, q = chunk_view(cache_config, shape, batch, tokens, history)
        names = cache_config.attention

        def run(q, view, step, names=names):
            return attend(q, view, step, impl=names)

        compile_s, seconds = timed(run, (q, view, step), inner, repeats)
        rows.append({"batch": batch, "tokens": tokens, "history": history,
                     "path": f"{spec} ({serving(names, view, step, q)})",
                     "compile_s": compile_s, "ms": 1e3 * seconds,
                     "tflops": flops / seconds / 1e12,
                     "of_peak": flops / seconds / 1e12 / peak_tflops, "max_diff": None})
        del view, step, q
    return rows


def table(rows) -> str:
    """The markdown table of the rows, each path against the default kernel's time."""
    lines = ["| B | T | S | path | ms | TFLOP/s | of peak | vs chunk_flash | max diff | "
             "compile s |", "|---" * 10 + "|"]
    base = {(r["batch"], r["tokens"], r["history"]): r["ms"] for r in rows
            if r["path"] == "chunk_flash"}
    for r in rows:
        diff = "-" if r["max_diff"] is None else f"{r['max_diff']:.1e}"
        ratio = base[(r["batch"], r["tokens"], r["history"])] / r["ms"]
        lines.append(f"| {r['batch']} | {r['tokens']} | {r['history']} | {r['path']} | "
                     f"{r['ms']:.3f} | {r['tflops']:.1f} | {r['of_peak']:.2f} | "
                     f"{ratio:.2f}x | {diff} | {r['compile_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Time every point and variant; print a markdown table (and ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(MODEL_SHAPES), default="llama-3-8b")
    p.add_argument("--point", action="append", metavar="B:T:S",
                   help="rows, chunk tokens, stored tokens before the chunk (default: "
                   + ", ".join(":".join(map(str, pt)) for pt in DEFAULT_POINTS) + ")")
    p.add_argument("--variant", action="append", default=[],
                   metavar="BLOCK_Q:BLOCK_K:WARPS:STAGES[:ORDER]")
    p.add_argument("--cache", action="append", default=[], metavar="SPEC",
                   help="also time the chunk over a layer of this cache holding the "
                   "history, through its attention list (repeatable; e.g. int:4)")
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bfloat16 matmul peak, TFLOP/s (H200: 989)")
    p.add_argument("--json", type=Path)
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    try:
        points = [parse_point(t) for t in args.point] if args.point else DEFAULT_POINTS
        variants = {text: parse_variant(text) for text in args.variant}
        for spec in args.cache:
            parse_cache(spec)
        if args.inner < 1 or args.repeats < 1:
            raise ValueError("--inner and --repeats must be >= 1")
    except ValueError as err:
        print(f"bench_prefill: error: {err}", file=sys.stderr)
        return 2
    shape = model_shape(args.shape)
    rows = []
    for batch, tokens, history in points:
        rows += bench_point(shape, batch, tokens, history, variants, args.inner,
                            args.repeats, args.peak_tflops)
        rows += cache_rows(shape, batch, tokens, history, args.cache, args.inner,
                           args.repeats, args.peak_tflops)
        print(rows[-1], file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        write_json(args.json, {"shape": args.shape, "rows": rows})
    # a variant whose output parts from the default beyond bfloat16 rounding is a bug
    return 0 if all(r["max_diff"] is None or (np.isfinite(r["max_diff"])
                    and r["max_diff"] < 0.05) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
