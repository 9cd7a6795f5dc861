"""Prefill and decode speed of kvjax generation vs HF transformers (PyTorch), same weights.

Loads a model once (default: the embedded SmolLM2-135M-Instruct), builds an HF
``LlamaForCausalLM`` holding exactly the same weights, and for each KV codec generates
``--new-tokens`` greedy tokens from the same prompt with both, timing prefill and decode
separately (kvjax: compilation excluded and reported on its own; HF: eager PyTorch with
its default dynamic cache, after one warm-up). Prints a markdown table with the
decode-speed ratio and checks that both produced the same tokens.

    python experiments/bench_generate.py [--model NAME] [--codecs bf16 int:4]
        [--prompt-tokens 128] [--new-tokens 64] [--dtype float32] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

import models
from kvjax import compile_cache
from kvjax.eval.sweep import write_json
from kvjax.spec import parse_cache
from models.generate import generate
from models.llama import layer_params

PROMPT_TEXT = (
    "The history of astronomy is the story of people looking up at the night sky and "
    "trying to understand what they saw. Early observers tracked the motions of the Sun, "
    "the Moon and the planets, and built calendars on their cycles. "
)


def hf_model(config, params) -> torch.nn.Module:
    """An HF ``LlamaForCausalLM`` in float32 with the weights of ``params``."""
    if config.family != "llama" or config.rope_scaling is not None:
        raise ValueError("this benchmark builds plain HF Llama models only")
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(hf_config).eval()

    def t(x):
        return torch.from_numpy(np.asarray(x, np.float32).copy())

    state = {"model.embed_tokens.weight": t(params["embed"]),
             "model.norm.weight": t(params["final_norm"])}
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        layer = layer_params(params, i)
        for ours, theirs in names.items():
            state[prefix + theirs + ".weight"] = t(layer[ours]).T.contiguous()
        state[prefix + "input_layernorm.weight"] = t(layer["attn_norm"])
        state[prefix + "post_attention_layernorm.weight"] = t(layer["mlp_norm"])
    if "lm_head" in params:
        state["lm_head.weight"] = t(params["lm_head"]).T.contiguous()
    else:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


def time_hf(model, prompt, new_tokens, repeats):
    """Median prefill seconds, median decode seconds and the greedy tokens."""
    ids = torch.tensor([prompt])
    prefill, total, tokens = [], [], None
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first run warms up
            start = time.perf_counter()
            model(ids, use_cache=True)
            prefill.append(time.perf_counter() - start)
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            total.append(time.perf_counter() - start)
            tokens = out[0, len(prompt):].tolist()
    p, g = float(np.median(prefill[1:])), float(np.median(total[1:]))
    return p, max(g - p, 1e-9), tokens


def time_kvjax(params, config, prompt, codec, new_tokens, repeats):
    """Median prefill and decode seconds, compile seconds, cache bytes and the tokens."""
    cache_config = parse_cache(codec)
    runs = [generate(params, config, [prompt], cache_config=cache_config,
                     max_new_tokens=new_tokens, eos_token_ids=(), cache_dtype=jnp.float32)
            for _ in range(repeats + 1)]
    timed = runs[1:]
    return (float(np.median([r.prefill_s for r in timed])),
            float(np.median([r.decode_s for r in timed])),
            runs[0].compile_s, runs[-1].cache_bytes, runs[-1].tokens[0])


def main(argv=None) -> int:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--codecs", nargs="+", default=["bf16", "int:4"])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", help="also write the rows to this JSON file")
    compile_cache.add_argument(ap)
    args = ap.parse_args(argv)
    compile_cache.from_args(args)

    config, params, tokenizer = models.load(args.model, dtype=jnp.dtype(args.dtype))
    ids = tokenizer.encode(PROMPT_TEXT * 20)[: args.prompt_tokens]
    if len(ids) < args.prompt_tokens:
        raise SystemExit(f"prompt text gives only {len(ids)} tokens")
    torch.set_num_threads(os.cpu_count() or 1)
    hf = hf_model(config, jax.tree.map(np.asarray, params))
    hf_prefill, hf_decode, hf_tokens = time_hf(hf, ids, args.new_tokens, args.repeats)

    rows = []
    for codec in args.codecs:
        prefill, decode, compile_s, cache_bytes, tokens = time_kvjax(
            params, config, ids, codec, args.new_tokens, args.repeats)
        decode_steps = args.new_tokens - 1  # the first new token comes from the prefill
        rows.append({
            "codec": codec, "prefill_tok_s": len(ids) / prefill,
            "decode_tok_s": decode_steps / decode, "compile_s": compile_s,
            "cache_bytes": cache_bytes,
            "hf_prefill_tok_s": len(ids) / hf_prefill,
            "hf_decode_tok_s": decode_steps / hf_decode,
            "decode_ratio": (decode_steps / decode) / (decode_steps / hf_decode),
            "same_tokens_as_hf": tokens == hf_tokens,
            "matching_prefix": next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens,
                                     strict=False)) if a != b), len(tokens)),
        })
    settings = {"model": args.model, "dtype": args.dtype, "prompt_tokens": len(ids),
                "new_tokens": args.new_tokens, "torch": torch.__version__,
                "cpu": platform.processor() or platform.machine(), "threads": os.cpu_count()}
    print(f"model {args.model} ({args.dtype}), prompt {len(ids)} tokens, "
          f"{args.new_tokens} new tokens, jax {jax.__version__} on {jax.devices()[0].platform}")
    print("| KV codec | kvjax prefill tok/s | kvjax decode tok/s | HF prefill tok/s | "
          "HF decode tok/s | decode ratio | compile s | cache bytes | tokens = HF |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['codec']} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | "
              f"{r['hf_prefill_tok_s']:.0f} | {r['hf_decode_tok_s']:.1f} | "
              f"{r['decode_ratio']:.2f}x | {r['compile_s']:.1f} | {r['cache_bytes']} | "
              f"{'yes' if r['same_tokens_as_hf'] else 'first ' + str(r['matching_prefix'])} |")
    if args.json:
        write_json(Path(args.json), {"settings": settings, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
