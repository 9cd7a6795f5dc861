"""How far a model's own keys stray from their channel's median in a prompt's first chunk,
in the robust deviations that ``center=first`` / ``smooth=first`` leave values out by
(:data:`kvjax.centering.ROBUST_LIMIT`): the margin clean keys keep below the limit.

    python experiments/key_deviations.py                          # the embedded SmolLM2
    python experiments/key_deviations.py --model qwen2.5-0.5b --chunks 32 128 512

The model's keys over ``--windows`` windows of the corpus, after the rotary embedding
(a float32 cache), each first chunk of ``--chunks`` tokens taken as a prompt's first
append is (its first token left out, as the statistics leave it):
:func:`kvjax.centering.robust_deviations` per (row, kv head); printed, per chunk
length, the largest deviation of any value and the median over layers of each layer's
largest.
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import numpy as np

import models
from kvjax import centering, compile_cache
from kvjax.cache import dense
from kvjax.spec import CacheConfig
from models import llama
from models.evaluate import load_model_and_windows


def deviations(model: str, corpus: str, windows: int, chunks: list[int]) -> list[dict]:
    """One row per chunk length: the largest robust deviation and the layers' median."""
    config, params, _, _, wins = load_model_and_windows(model, corpus, windows, max(chunks))
    wins = jnp.asarray(wins)
    cache = llama.new_cache(config, CacheConfig(k="f32", v="f32"), batch=wins.shape[0],
                            max_len=wins.shape[1], dtype=jnp.float32)
    _, cache = llama.jit_forward(params, config, wins, cache, None)
    rows = []
    for chunk in chunks:
        per_layer = []
        for i in range(cache.num_layers):
            keys = dense(cache.layer(i).k, cache.lengths)[:, :, :chunk]  # [B, K, T, D]
            weight = centering.first_chunk_weights(
                jnp.full((keys.shape[0],), chunk, jnp.int32), chunk)[:, None, :]
            dev, counted = centering.robust_deviations(keys, weight)
            per_layer.append(float(jnp.max(jnp.where(counted, dev, 0.0))))
        rows.append({"chunk": chunk, "max": max(per_layer),
                     "median_of_layer_max": float(np.median(per_layer)),
                     "limit": centering.ROBUST_LIMIT})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--corpus", default="shakespeare")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 128, 512])
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    if args.windows < 1 or min(args.chunks) < 2:
        print("key_deviations: error: --windows >= 1 and --chunks >= 2 tokens",
              file=sys.stderr)
        return 2
    print(f"{args.model} on {args.corpus}, {args.windows} windows; limit "
          f"{centering.ROBUST_LIMIT:g} robust deviations")
    print("| first chunk | largest deviation | median of the layers' largest |")
    print("|---|---|---|")
    for row in deviations(args.model, args.corpus, args.windows, args.chunks):
        print(f"| {row['chunk']} | {row['max']:.1f} | {row['median_of_layer_max']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
