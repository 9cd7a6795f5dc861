"""Hugging Face checkpoints (safetensors directories) -> the shared params layout.

HF ``nn.Linear`` weights are ``[out, in]``; the layout wants ``[in, out]`` so they are
transposed once here, and the per-layer tensors are stacked over ``L``.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from models.config import ModelConfig
from models.llama import Params, check_params, layer_shapes

# layout name -> (HF name inside "model.layers.{i}.", is a Linear weight to transpose)
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}

# tensors that HF checkpoints may carry but the model does not use
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _to_numpy(x: Any) -> np.ndarray:
    """A numpy array of a numpy/torch/jax tensor; bf16 stays bf16 (ml_dtypes)."""
    if hasattr(x, "detach"):  # torch: numpy() refuses bfloat16, so go through float32
        import torch

        if x.dtype == torch.bfloat16:
            return x.detach().float().cpu().numpy().astype(ml_dtypes.bfloat16)
        return x.detach().cpu().numpy()
    return np.asarray(x)


def params_from_hf(
    state_dict: Mapping[str, Any], config: ModelConfig, dtype: Any = None
) -> Params:
    """Convert an HF llama-like ``state_dict`` to the shared params layout.

    Accepts numpy, torch or jax tensors; ``dtype`` (default: keep each tensor's) is the
    dtype of the returned jax arrays. Raises ``ValueError`` listing missing tensors,
    unexpected ones and wrong shapes.
    """
    names = dict(state_dict)
    used: set[str] = set()

    def take(name: str) -> np.ndarray:
        if name not in names:
            raise ValueError(f"checkpoint is missing tensor '{name}'")
        used.add(name)
        return _to_numpy(names[name])

    shapes = layer_shapes(config)
    layers = {}
    for key in (k for k in _LAYER_NAMES if k in shapes):
        hf_name, transpose = _LAYER_NAMES[key]
        per_layer = []
        for i in range(config.num_layers):
            name = f"model.layers.{i}.{hf_name}"
            w = take(name)
            w = w.T if transpose else w
            if w.shape != shapes[key]:
                got = w.T.shape if transpose else w.shape
                want = shapes[key][::-1] if transpose else shapes[key]
                raise ValueError(f"tensor '{name}' has shape {tuple(got)}, expected {want}")
            per_layer.append(w)
        layers[key] = np.stack(per_layer)
    params: Params = {
        "embed": take("model.embed_tokens.weight"),
        "layers": layers,
        "final_norm": take("model.norm.weight"),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = take("lm_head.weight").T
    elif "lm_head.weight" in names:
        # tied checkpoints may still store the head; it must equal the embedding
        used.add("lm_head.weight")

    extra = sorted(n for n in names if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        shown = ", ".join(extra[:8]) + (" ..." if len(extra) > 8 else "")
        raise ValueError(f"checkpoint has {len(extra)} tensors the config does not use: {shown}")
    out = {
        k: ({kk: _as_jax(vv, dtype) for kk, vv in v.items()} if isinstance(v, dict)
            else _as_jax(v, dtype))
        for k, v in params.items()
    }
    check_params(out, config)
    return out


def _as_jax(x: np.ndarray, dtype: Any):
    return jnp.asarray(x, dtype=dtype) if dtype is not None else jnp.asarray(x)


_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(file: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file as a read-only memory-mapped numpy array.

    The format is an 8-byte little-endian header size, a JSON header, then raw bytes;
    reading it directly keeps bf16 (which ``safetensors.numpy`` rejects) as
    ``ml_dtypes.bfloat16`` and puts nothing on an accelerator.
    """
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor '{name}' has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        out[name] = data[begin:end].view(dtype).reshape(info["shape"])
    return out


def read_safetensors_dir(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a (possibly sharded) safetensors checkpoint directory.

    Shards come from ``model.safetensors.index.json`` when present, else ``*.safetensors``.
    """
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, name) for name in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(read_safetensors(file))
    return tensors


def load_hf_dir(path: str | os.PathLike, dtype: Any = jnp.bfloat16):
    """Load an HF model directory: ``(ModelConfig, params in dtype, tokenizer or None)``.

    The tokenizer comes from ``transformers.AutoTokenizer`` when the directory holds
    tokenizer files; nothing is downloaded.
    """
    path = os.fspath(path)
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise ValueError(f"{path} has no config.json")
    config = ModelConfig.from_hf_file(config_file)
    params = params_from_hf(read_safetensors_dir(path), config, dtype=dtype)
    tokenizer = None
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if any(os.path.exists(os.path.join(path, n)) for n in tokenizer_files):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return config, params, tokenizer
