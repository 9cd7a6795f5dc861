"""End-to-end decode speed and capacity with a compressed cache, random weights.

    python experiments/bench_e2e.py                       # Llama-3-8B shapes, 32k prompt (GPU)
    python experiments/bench_e2e.py --shape smollm2-135m --layers 1 --context 256 --batch 2
                                                          # a CPU smoke run

For each cache spec and batch size: a random-weight model of the given shape
(:data:`kvjax.eval.memory.MODEL_SHAPES`, bf16 weights, positions sized to the run)
generates ``--new-tokens`` greedy tokens after a random prompt of ``--context``
tokens, prefilled ``--prefill-chunk`` tokens at a time (after a warm-up run of the same
compiled programs on a prompt of one chunk, which the compile time is taken from), its
weights in ``--weights`` layout: ``decode`` (:func:`models.llama.decode_layout`: layers
unrolled over per-layer buffers, projections joined), ``per-layer`` (the projections
apart) or ``stacked`` (scanned, which a GPU copies layer by layer every step); reported
are decode tokens/s
(all rows, compilation excluded), milliseconds per decode step, prefill seconds and the
cache's bytes. The models' attention is their cache config's, ``"auto"``: on a GPU the
decode steps of ``int:N`` and SAW caches run the fused INT kernel (``"int_decode"``),
those of TurboQuant, OCTOPUS and PolarQuant caches their kernels over rotated keys
(``"codebook_decode"``, ``"octopus_decode"``, ``"polar_decode"``), those of a ``bf16``
cache ``"dense_decode"`` (reading the layer in place), and prefill chunks run the flash
attention ``"chunk_flash"`` (see :func:`kvjax.attention.auto_names`).

Capacity: the largest batch whose cache of ``--context`` tokens (the bytes of the arrays
that :func:`kvjax.cache.init_cache` allocates: :func:`kvjax.eval.memory.cache_bytes`) fits
beside the weights in the device's memory (``bytes_limit`` of the GPU, or ``--device-gb``), less
``--reserve-gb`` for activations. ``--check-programs`` replaces the guessed reserve by
the temporaries XLA reports for the compiled prefill chunk and decode loop at that
batch (compiled from shapes, nothing allocated), and finds the largest batch for which
cache + temporaries fit; the table gives it as a share of the rows the cache's bytes
alone allow beside the weights (*of the bytes' rows*: what the temporaries cost in
rows). ``--at-capacity`` also runs each codec at its largest batch
(prefilled ``--capacity-chunk`` tokens at a time), which shows that it fits and what
the capacity buys in tokens/s; it wants JAX's default preallocating allocator
(``XLA_PYTHON_CLIENT_PREALLOCATE`` unset), whose limit the capacity is computed from.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import compile_cache
from kvjax.eval.memory import MODEL_SHAPES
from kvjax.eval.memory import row_bytes as memory_row_bytes
from kvjax.eval.provenance import provenance
from kvjax.eval.sweep import write_json
from kvjax.sharding import DATA, MeshError, make_mesh, parse_mesh
from kvjax.sharding import describe as describe_mesh
from kvjax.spec import CacheConfig, parse_cache
from models.config import ModelConfig
from models.generate import generate
from models.llama import decode_layout, init_params, relayout, shard_params, unstack_layers

#: ``--weights``: how the random stacked weights are laid out for the run
WEIGHT_LAYOUTS = {"decode": decode_layout, "per-layer": unstack_layers,
                  "stacked": lambda params: params}


def floor_tok_per_s(weights: int, cache: int, batch: int, peak_gbs: float) -> float:
    """Decode tokens/s if every step read the weights and the cache once at the peak
    bandwidth and did nothing else: the bound a decode step can approach."""
    return batch * peak_gbs * 1e9 / (weights + cache)


def short_sha(git: str | None) -> str:
    """A provenance's commit in a table cell: 12 digits, and whether the tree differed."""
    if not git:
        return "-"
    return git[:12] + ("+dirty" if git.endswith("+dirty") else "")


def weights_bytes(params) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))


def row_bytes(config: ModelConfig, cache_config: CacheConfig, context: int,
              mesh: str | None = None) -> tuple[int, int]:
    """(bytes of one row's cache of ``context`` tokens, bytes a cache holds whatever its
    batch), per device over a mesh of shape ``mesh`` (:func:`kvjax.eval.memory.row_bytes`)."""
    return memory_row_bytes(cache_config, context=context, num_layers=config.num_layers,
                            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                            mesh=mesh)


def capacity(config: ModelConfig, cache_config: CacheConfig, context: int, free: float,
             mesh: str | None = None) -> int:
    """The largest batch whose caches of ``context`` tokens fit in ``free`` bytes (of
    each device, over a mesh of shape ``mesh``: a multiple of its data axis)."""
    per_row, fixed = row_bytes(config, cache_config, context, mesh)
    return parse_mesh(mesh)[DATA] * max(0, int((free - fixed) // per_row))


def of_bytes(rows: int | None, bytes_rows: int | None) -> str:
    """A table cell: the rows that fit with the programs' temporaries as a share of the
    rows the cache's bytes alone allow (``-`` where either is unknown)."""
    if rows is None or not bytes_rows:
        return "-"
    return f"{rows / bytes_rows:.2f}"


def device_bytes(tree, device) -> int:
    """Bytes of ``tree``'s arrays that ``device`` holds."""
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
               for shard in leaf.addressable_shards if shard.device == device)


def program_temps(params, config: ModelConfig, cache_config: CacheConfig, *, batch: int,
                  context: int, chunk: int, new_tokens: int) -> tuple[int, int]:
    """XLA's temporary bytes of the compiled prefill chunk and decode loop at ``batch``
    rows (compiled from shapes alone, nothing allocated), the working memory that must
    fit beside the weights and the cache. They are the programs a run at that batch
    then executes (:func:`models.generate.prefill_program` keeps them)."""
    from models import generate as gen
    from models.llama import cache_shape

    cache = cache_shape(config, cache_config, batch=batch, max_len=context + new_tokens)
    prefill = gen.prefill_program(params, config, cache, chunk=min(chunk, context))
    logits, cache = prefill.out_info[:2]
    decode = gen.decode_program(params, config, logits, cache, max_new_tokens=new_tokens,
                                greedy=True, num_eos=0)
    return (prefill.memory_analysis().temp_size_in_bytes,
            decode.memory_analysis().temp_size_in_bytes)


def capacity_with_programs(params, config, cache_config, *, context, chunk, new_tokens,
                           free_total: float) -> tuple[int, int, int]:
    """The largest batch whose cache and the larger of its compiled programs' temporaries
    fit in ``free_total`` bytes (device memory less the weights). Starts from the
    cache-only capacity, scales the batch down by the temporaries measured there (they
    grow about linearly with the rows), and compiles again until a batch fits.
    Returns ``(batch, prefill temp bytes, decode temp bytes)`` at that batch."""
    per_row, fixed = row_bytes(config, cache_config, context + new_tokens)
    batch = max(0, int((free_total - fixed) // per_row))
    while batch > 0:
        temps = program_temps(params, config, cache_config, batch=batch, context=context,
                              chunk=chunk, new_tokens=new_tokens)
        need = max(temps)
        if fixed + batch * per_row + need <= free_total:
            return batch, *temps
        # the temporaries grow about linearly with the rows: charge each row its share
        batch = min(batch - 1, max(0, int((free_total - fixed) // (per_row + need / batch))))
    return 0, 0, 0


def capacity_summary(rows: list[dict]) -> list[str]:
    """One line per cache run at its own largest batch: its decode throughput against
    bf16's at bf16's largest batch (the comparison a compressed cache is for)."""
    at_capacity = [r for r in rows if r.get("at_capacity")]
    bf16 = next((r for r in at_capacity if r["codec"] == "bf16"), None)
    lines = []
    for r in at_capacity:
        rows_vs = "" if bf16 is None else f", {r['batch'] / bf16['batch']:.2f}x bf16's rows"
        speed_vs = ("" if bf16 is None else
                    f", {r['decode_tok_per_s'] / bf16['decode_tok_per_s']:.2f}x bf16's "
                    f"tok/s at its {bf16['batch']} rows")
        lines.append(f"at capacity: {r['codec']}: {r['batch']} rows x {r['context']} tokens"
                     f"{rows_vs}, {r['decode_tok_per_s']:.1f} tok/s{speed_vs}")
    return lines


def main(argv=None) -> int:
    """Run every (codec, batch) and print a markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(MODEL_SHAPES), default="llama-3-8b")
    p.add_argument("--cache", "--codec", dest="cache", action="append", metavar="SPEC",
                   help="cache spec, repeatable (default: bf16, int:4, saw)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--point", action="append", metavar="B:S",
                   help="rows and prompt tokens of a run, instead of --batch at --context "
                        "(repeat for a grid: one table over batches and contexts)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--window", type=int, default=None,
                   help="raw residual window of every spec that sets none (default 0)")
    p.add_argument("--device-gb", type=float, default=None,
                   help="device memory when the backend does not report it")
    p.add_argument("--reserve-gb", type=float, default=8.0)
    p.add_argument("--layers", type=int, help="fewer transformer blocks than the shape's, "
                   "for a quick look (decode time scales with the layer count)")
    p.add_argument("--at-capacity", action="store_true",
                   help="also run each codec at its largest batch")
    p.add_argument("--capacity-only", action="store_true",
                   help="with --at-capacity: run only each codec's largest batch (its "
                   "programs are the ones compiled for the check, so none compiles "
                   "again)")
    p.add_argument("--capacity-chunk", type=int, default=256,
                   help="prefill chunk of the runs at capacity and of --check-programs")
    p.add_argument("--check-programs", action="store_true",
                   help="also find the largest batch whose cache fits together with the "
                   "compiled prefill's and decode's temporaries (compiles, allocates "
                   "nothing); --at-capacity then runs that batch")
    p.add_argument("--peak-gbs", type=float, default=4240.0,
                   help="memory bandwidth of the floor, GB/s (H200: 4240)")
    p.add_argument("--weights", choices=list(WEIGHT_LAYOUTS), default="decode",
                   help="the weights' layout (default: models.llama.decode_layout)")
    p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="run over D x M devices: rows over data, heads tensor-parallel "
                        "over model (fused projections split back); capacity and floor "
                        "per device")
    p.add_argument("--json", type=Path)
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    window = {} if args.window is None else {"residual_window": args.window}
    try:
        points = [tuple(int(x) for x in text.split(":")) for text in args.point or ()]
        if any(len(point) != 2 for point in points):
            raise ValueError(f"--point takes B:S, got {args.point}")
        points = points or [(batch, args.context) for batch in args.batch]
        cache_configs = {spec: parse_cache(spec, **window)
                         for spec in args.cache or ["bf16", "int:4", "saw"]}
        mesh = None if args.mesh is None else make_mesh(args.mesh)
        if mesh is not None and args.check_programs:
            raise MeshError("--check-programs compiles one device's programs: not with "
                            "--mesh")
    except ValueError as err:
        print(f"bench_e2e: error: {err}", file=sys.stderr)
        return 2
    if args.capacity_only and not args.at_capacity:
        print("bench_e2e: error: --capacity-only goes with --at-capacity", file=sys.stderr)
        return 2
    contexts = sorted({context for _, context in points})
    if args.at_capacity and len(contexts) > 1:
        print("bench_e2e: error: --at-capacity runs one context", file=sys.stderr)
        return 2
    config = ModelConfig.from_shape(MODEL_SHAPES[args.shape],
                                    max_len=contexts[-1] + args.new_tokens,
                                    num_layers=args.layers)
    if args.at_capacity and os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false":
        # the growing allocator fails single allocations of tens of GiB (a layer stack of
        # a full cache) long before the memory is used up
        print("bench_e2e: XLA_PYTHON_CLIENT_PREALLOCATE=false: a cache near the memory "
              "limit may fail to allocate; unset it for --at-capacity", file=sys.stderr)
    params = init_params(jax.random.key(0), config, jnp.bfloat16)
    # laid out on the host: on the device the freed stacked copy splits the free memory
    params = relayout(params, WEIGHT_LAYOUTS[args.weights])
    weights = args.weights
    first = jax.devices()[0]
    mesh_shape = None if mesh is None else describe_mesh(mesh)
    if mesh is not None:
        try:
            params = shard_params(params, config, mesh)
        except MeshError as err:
            print(f"bench_e2e: error: {err}", file=sys.stderr)
            return 2
        first = mesh.devices.flat[0]
    # what one device holds and reads every step: all of it, or its share over a mesh
    held = weights_bytes(params) if mesh is None else device_bytes(params, first)
    source = provenance()
    stats = first.memory_stats() or {}
    limit = stats.get("bytes_limit") or (args.device_gb or 0) * 1e9
    free_total = limit - held
    if stats.get("largest_free_block_bytes"):
        # the cache's stacks go in one after another: a split free memory holds less
        free_total = min(free_total, int(stats["largest_free_block_bytes"]))
    free = free_total - args.reserve_gb * 1e9
    rows, checked = [], {}
    rng = np.random.default_rng(0)
    for spec, cache_config in cache_configs.items():
        max_batch = {context: capacity(config, cache_config, context, free, mesh_shape)
                     if free > 0 else None for context in contexts}
        if args.check_programs and free_total > 0:
            checked[spec] = capacity_with_programs(
                params, config, cache_config, context=contexts[-1],
                chunk=args.capacity_chunk, new_tokens=args.new_tokens,
                free_total=free_total)
            print(f"{spec}: {checked[spec][0]} rows fit with the compiled programs' "
                  f"temporaries (prefill {checked[spec][1] / 2**30:.2f} GiB, decode "
                  f"{checked[spec][2] / 2**30:.2f} GiB)", file=sys.stderr, flush=True)
        runs = ([] if args.capacity_only else
                [(batch, context, args.prefill_chunk, False) for batch, context in points])
        at_capacity = checked[spec][0] if spec in checked else max_batch[contexts[-1]]
        if args.at_capacity and at_capacity:
            runs.append((at_capacity, contexts[-1], args.capacity_chunk, True))
        for batch, context, chunk, capacity_run in runs:
            run = functools.partial(generate, params, config, cache_config=cache_config,
                                    max_new_tokens=args.new_tokens, eos_token_ids=(),
                                    max_len=context + args.new_tokens, prefill_chunk=chunk,
                                    mesh=mesh)
            # the same programs run once on a prompt of one chunk first: compiled there,
            # and the first run's one-time costs (module loads, buffers) not timed
            # (only its compile times are kept: its cache would not fit beside the next one)
            warm = run(rng.integers(0, config.vocab_size, (batch, min(chunk, context))).tolist())
            compile_s = {"compile_s": warm.compile_s,
                         "prefill_compile_s": warm.prefill_compile_s,
                         "decode_compile_s": warm.decode_compile_s}
            del warm
            prompts = rng.integers(0, config.vocab_size, (batch, context)).tolist()
            result = run(prompts)
            rows.append({
                "codec": spec, "cache": cache_config.spec, "batch": batch,
                "context": context, "at_capacity": capacity_run, "weights": weights,
                "decode_tok_per_s": result.decode_tok_per_s,
                "floor_tok_per_s": floor_tok_per_s(
                    held, result.cache_bytes if mesh is None
                    else device_bytes(result.cache, first), batch, args.peak_gbs),
                "mesh": "-" if mesh is None else describe_mesh(mesh),
                "step_ms": 1e3 * result.decode_s / args.new_tokens,
                "prefill_s": result.prefill_s,
                **compile_s, "cache_bytes": result.cache_bytes,
                "max_batch": max_batch[context],
                "max_batch_checked": checked[spec][0] if spec in checked else None,
                # the rows the cache's bytes alone allow beside the weights (no reserve)
                "max_batch_bytes": (capacity(config, cache_config, context, free_total,
                                             mesh_shape) if free_total > 0 else None),
                "prefill_temp_bytes": checked[spec][1] if spec in checked else None,
                "decode_temp_bytes": checked[spec][2] if spec in checked else None,
                "git": source["git"], "code": source["code"],
                "device": source["device"]["device_kind"],
            })
            print(rows[-1], file=sys.stderr, flush=True)
            del result  # its cache would sit beside the next run's
    base = {(r["batch"], r["context"]): r["decode_tok_per_s"] for r in rows
            if r["codec"] == "bf16"}
    print("| codec | batch | context | decode tok/s | ms/step | of floor | vs bf16 | "
          "prefill s | compile s (prefill + decode) | cache GiB | max batch at the context | "
          "checked with programs | of the bytes' rows | weights | mesh | git (code digest) | "
          "device |")
    print("|---" * 17 + "|")
    for r in rows:
        key = (r["batch"], r["context"])
        ratio = r["decode_tok_per_s"] / base[key] if key in base else float("nan")
        print(f"| {r['codec']} | {r['batch']} | {r['context']} | {r['decode_tok_per_s']:.1f} | "
              f"{r['step_ms']:.2f} | {r['decode_tok_per_s'] / r['floor_tok_per_s']:.2f} | "
              f"{ratio:.2f}x | {r['prefill_s']:.1f} | {r['prefill_compile_s']:.1f} + "
              f"{r['decode_compile_s']:.1f} | "
              f"{r['cache_bytes'] / 2**30:.2f} | "
              f"{r['max_batch'] if r['max_batch'] is not None else '-'} | "
              f"{r['max_batch_checked'] if r['max_batch_checked'] is not None else '-'} | "
              f"{of_bytes(r['max_batch_checked'], r['max_batch_bytes'])} | "
              f"{r['weights']} | {r['mesh']} | {short_sha(r['git'])} ({r['code'][:8]}) | "
              f"{r['device']} |")
    for line in capacity_summary(rows):
        print(line)
    if args.json:
        write_json(args.json, {"rows": rows}, source=source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
