"""The optimized decode loop against the reference loop on a real model: the same tokens?

    python experiments/loop_tokens.py                     # the embedded SmolLM2, on a GPU
    python experiments/loop_tokens.py --cache int:4 --attention int_decode,reference \\
        --new-tokens 8                                    # the kernel in interpret mode (CPU)

For each cache spec, greedy generation from the same prompts twice: the reference loop
(weights stacked and scanned, every attention call the float32 reference) and the
optimized one (:func:`models.llama.decode_layout`: weights per layer, unrolled, the
projections joined; the cache config's attention ``--attention``,
by default ``"auto"``: on a GPU the fused kernels). Prints per spec how many rows agree
and where the first disagreeing row parts; exits 1 when any row differs. The fused
kernels' matmul operands are 16-bit (the reference's float32), so a near-tie between
two tokens can part the rows legitimately; the table says at which step. With bfloat16
weights (``--dtype``) even the same attention parts the two layouts now and then: XLA
may keep a fused chain of bfloat16 operations in float32 (its excess precision), and a
scan over layers and unrolled layers fuse differently; with float32 weights the layouts
agree token for token (the embedded SmolLM2 on a CPU, 3 prompts x 8 tokens, int:4 and
bf16 caches), and what parts the rows is the kernels' rounding alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import models
from kvjax import compile_cache
from kvjax.eval.sweep import write_json
from kvjax.spec import parse_cache
from models.generate import generate
from models.llama import decode_layout

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
)


def read_prompt_ids(path: Path) -> list[list[int]]:
    """The prompts' token ids from ``path``: a JSON list of non-empty lists of ints, or
    an object holding one under ``"prompts"`` (what ``--json`` writes)."""
    data = json.loads(Path(path).read_text())
    prompts = data.get("prompts") if isinstance(data, dict) else data
    if not (isinstance(prompts, list) and prompts and all(
            isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)
            for ids in prompts)):
        raise ValueError(f"{path}: expected a non-empty list of non-empty lists of token "
                         "ids (or an object with one under 'prompts')")
    return prompts


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first step at which two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(params, per_layer, config, prompts, spec: str, attention: str,
            new_tokens: int) -> dict:
    """One spec's row: tokens of the reference loop (``params`` stacked) and of the
    optimized loop (``per_layer``, the same weights in the decode layout)."""
    reference = parse_cache(f"{spec} attn=reference")
    optimized = parse_cache(f"{spec} attn={attention}")
    kw = {"max_new_tokens": new_tokens, "eos_token_ids": ()}
    want = generate(params, config, prompts, cache_config=reference, **kw).tokens
    got = generate(per_layer, config, prompts, cache_config=optimized,
                   **kw).tokens
    parts = [first_difference(w, g) for w, g in zip(want, got, strict=True)]
    return {"cache": spec, "attention": attention, "rows": len(prompts),
            "equal_rows": sum(p is None for p in parts),
            "first_difference": min((p for p in parts if p is not None), default=None),
            "reference": want, "optimized": got}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--cache", action="append", metavar="SPEC",
                   help="cache specs (default: bf16, int:4)")
    p.add_argument("--attention", default="auto",
                   help="the optimized loop's attention list, as in attn= of a cache spec")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the weights' type")
    p.add_argument("--json", type=Path,
                   help="the rows and the prompts' token ids (which --prompt-ids reads)")
    p.add_argument("--prompt-ids", type=Path, metavar="JSON",
                   help="token ids of the prompts (a list of lists, or a --json file) in "
                   "place of tokenizing PROMPTS: the model loads without its tokenizer, "
                   "so neither transformers nor tokenizers need be installed")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    specs = args.cache or ["bf16", "int:4"]
    try:
        for spec in specs:
            parse_cache(f"{spec} attn={args.attention}")
        given = read_prompt_ids(args.prompt_ids) if args.prompt_ids else None
    except (ValueError, OSError) as err:
        print(f"loop_tokens: {err}", file=sys.stderr)
        return 2
    config, params, tokenizer = models.load(args.model, dtype=jnp.dtype(args.dtype),
                                            tokenizer=given is None)
    prompts = given or [tokenizer.encode(text) for text in PROMPTS]
    per_layer = decode_layout(params)
    rows = []
    for spec in specs:
        rows.append(compare(params, per_layer, config, prompts, spec, args.attention,
                            args.new_tokens))
        print({k: v for k, v in rows[-1].items() if k not in ("reference", "optimized")},
              file=sys.stderr, flush=True)
    print("| cache | weights | optimized attention | rows equal | first differing step | "
          "device |")
    print("|---|---|---|---|---|---|")
    device = jax.devices()[0].device_kind
    for r in rows:
        step = "-" if r["first_difference"] is None else r["first_difference"]
        print(f"| {r['cache']} | {args.dtype} | {r['attention']} | {r['equal_rows']} / "
              f"{r['rows']} | {step} | {device} |")
    if args.json:
        write_json(args.json, {"rows": rows, "prompts": prompts})
    return 0 if all(r["equal_rows"] == r["rows"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
