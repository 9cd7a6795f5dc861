"""HyperQuant on spiky blocks at low rates: relative error, fallback share and encode time.

    python experiments/hyperquant_spiky.py
    PYTHONPATH=/path/to/another/tree python experiments/hyperquant_spiky.py   # compare

A block whose Rice code does not fit its budget falls back (:mod:`kvjax.codecs.hyperquant`).
Spiky tokens are the hard case: a single large coordinate becomes, rotated, a flat vector
that a coarse lattice rounds to zero. For 64 tokens of D = 64 of each kind (seeded), the
table gives the relative squared error of the round trip, the share of blocks that fell
back and of tokens that decode to exactly zero, and the median time of one jitted encode
of the Gaussian batch (the hot path of a decode step encodes one block per head).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import compile_cache
from kvjax.spec import parse_codec

SPECS = ("hyperquant:d4,2bps", "hyperquant:e8,1.5bps", "hyperquant:z,1.5bps",
         "hyperquant:a2,1.5bps", "hyperquant:e8,3bps")
TOKENS, HEAD_DIM = 64, 64


def batches(seed: int = 0) -> dict[str, np.ndarray]:
    """``[TOKENS, HEAD_DIM]`` float32 tokens of each kind."""
    rng = np.random.default_rng(seed)
    out = {}
    onehot = np.zeros((TOKENS, HEAD_DIM), np.float32)
    onehot[np.arange(TOKENS), rng.integers(0, HEAD_DIM, TOKENS)] = 1.0
    out["one-hot"] = onehot
    spike = 0.01 * rng.standard_normal((TOKENS, HEAD_DIM))
    spike[np.arange(TOKENS), rng.integers(0, HEAD_DIM, TOKENS)] += 10.0
    out["spike + noise"] = spike.astype(np.float32)
    for factor in (20, 50):
        channel = rng.standard_normal((TOKENS, HEAD_DIM))
        channel[:, 3] *= factor
        out[f"channel {factor}x"] = channel.astype(np.float32)
    out["gaussian"] = rng.standard_normal((TOKENS, HEAD_DIM)).astype(np.float32)
    return out


def encode_ms(codec, params, x, repeats: int = 30) -> float:
    encode = jax.jit(codec.encode)
    jax.block_until_ready(encode(params, x))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(encode(params, x))
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", action="append", help=f"codec spec, repeatable (default: {SPECS})")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    data = batches()
    kinds = list(data)
    print("| spec | " + " | ".join(kinds) + " | encode ms |")
    print("|---" * (len(kinds) + 2) + "|")
    for spec in args.spec or SPECS:
        codec = parse_codec(spec)
        params = codec.init(jax.random.key(0), HEAD_DIM)
        cells = []
        for kind in kinds:
            x = jnp.asarray(data[kind])
            codes = codec.encode(params, x)
            x_hat = np.asarray(codec.decode(params, codes))
            rel = float(np.sum((x_hat - data[kind]) ** 2) / np.sum(data[kind] ** 2))
            fell = float(np.mean(np.asarray(codec.fallback_levels(codes)) > 0))
            zero = float(np.mean(~np.any(x_hat != 0, axis=-1)))
            cells.append(f"{rel:.4f} ({fell:.0%} fb, {zero:.0%} zero)")
        ms = encode_ms(codec, params, jnp.asarray(data["gaussian"]))
        print(f"| `{spec}` | " + " | ".join(cells) + f" | {ms:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
