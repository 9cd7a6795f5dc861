"""Hugging Face checkpoints (safetensors directories) -> the shared params layout.

HF ``nn.Linear`` weights are ``[out, in]``; the layout wants ``[in, out]`` so they are
transposed once here, and the per-layer tensors are stacked over ``L``.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from models.config import ModelConfig
from models.files import ModelFileError
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
    ``ml_dtypes.bfloat16`` and puts nothing on an accelerator. The header is checked
    against the file before any tensor is mapped: a short file, a header that is not a
    JSON object of tensor entries, an unsupported dtype, or data offsets that disagree
    with a tensor's shape or lie past the end raise :class:`ModelFileError`.
    """
    file = os.fspath(file)
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFileError.truncated(file, "the header length", 0, 8, size)
            header_len = int.from_bytes(head, "little")
            if 8 + header_len > size:
                raise ModelFileError.truncated(file, "the JSON header", 8, 8 + header_len, size)
            raw = f.read(header_len)
    except OSError as err:
        raise ModelFileError(file, err.strerror or str(err)) from None
    try:
        header = json.loads(raw)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise ModelFileError(file, f"the header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise ModelFileError(file, "the header is not a JSON object")
    start = 8 + header_len
    entries = {name: _tensor_entry(file, name, info, start, size)
               for name, info in header.items() if name != "__metadata__"}
    # an empty data section cannot be memory-mapped; its tensors are all empty
    data = (np.memmap(file, dtype=np.uint8, mode="r", offset=start) if size > start
            else np.zeros(0, np.uint8))
    return {name: data[begin:end].view(dtype).reshape(shape)
            for name, (dtype, shape, begin, end) in entries.items()}


def _tensor_entry(file: str, name: str, info: Any, start: int, size: int):
    """``(dtype, shape, begin, end)`` of one header entry, checked against the file."""
    what = f"tensor '{name}'"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise ModelFileError(file, f"{what}: a header entry needs dtype, shape and "
                             "data_offsets")
    dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in _SAFETENSORS_DTYPES:
        raise ModelFileError(file, f"{what} has unsupported dtype {dtype_name}")

    def naturals(value, count=None):
        return (isinstance(value, list) and (count is None or len(value) == count)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                        for v in value))

    if not naturals(shape):
        raise ModelFileError(file, f"{what} has a bad shape {shape!r:.40}")
    if not naturals(offsets, 2) or offsets[0] > offsets[1]:
        raise ModelFileError(file, f"{what} has bad data_offsets {offsets!r:.40}")
    dtype = np.dtype(_SAFETENSORS_DTYPES[dtype_name])
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise ModelFileError(file, f"{what} of shape {tuple(shape)} and dtype {dtype_name} "
                             f"takes {nbytes} bytes, its data_offsets {begin}..{end} span "
                             f"{end - begin}")
    if start + end > size:
        raise ModelFileError.truncated(file, what, start + begin, start + end, size)
    return dtype, tuple(shape), begin, end


def read_safetensors_dir(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a (possibly sharded) safetensors checkpoint directory.

    Shards come from ``model.safetensors.index.json`` when present, else ``*.safetensors``.
    A bad index, a shard it names that is missing, no shards at all, a tensor in two
    shards, or a bad shard raise :class:`ModelFileError`.
    """
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = [os.path.join(path, name) for name in _index_shards(index)]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelFileError(path, "no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        if not os.path.isfile(file):
            raise ModelFileError(file, "no such file (a shard model.safetensors.index.json "
                                 "names)")
        shard = read_safetensors(file)
        if twice := sorted(set(shard) & set(tensors)):
            raise ModelFileError(file, f"tensor '{twice[0]}' is also in another shard")
        tensors.update(shard)
    return tensors


def _index_shards(index: str) -> list[str]:
    """The shard file names of a ``model.safetensors.index.json``, sorted, once each."""
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except OSError as err:
        raise ModelFileError(index, err.strerror or str(err)) from None
    except (ValueError, AttributeError) as err:  # not JSON, or not an object
        raise ModelFileError(index, f"not a JSON object ({err})") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and v and os.path.basename(v) == v
            for v in weight_map.values()):
        raise ModelFileError(index, "'weight_map' must map tensor names to shard file "
                             "names in the same directory")
    return sorted(set(weight_map.values()))


def load_hf_dir(path: str | os.PathLike, dtype: Any = jnp.bfloat16, *,
                tokenizer: bool = True):
    """Load an HF model directory: ``(ModelConfig, params in dtype, tokenizer or None)``.

    The tokenizer comes from ``transformers.AutoTokenizer`` when the directory holds
    tokenizer files (and ``tokenizer`` is true); nothing is downloaded. Every problem
    with the directory's files (config, shards, tensors that do not fit the config, a
    tokenizer that cannot be built) raises :class:`ModelFileError`.
    """
    path = os.fspath(path)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ModelFileError(path, "no config.json")
    config = ModelConfig.from_hf_file(config_file)
    try:
        params = params_from_hf(read_safetensors_dir(path), config, dtype=dtype)
    except ModelFileError:
        raise
    except ValueError as err:  # tensors that do not fit the config
        raise ModelFileError(path, str(err)) from None
    built = None
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if tokenizer and any(os.path.exists(os.path.join(path, n)) for n in tokenizer_files):
        from transformers import AutoTokenizer

        try:
            built = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as err:  # the tokenizers backend raises plain Exception
            raise ModelFileError(path, f"its tokenizer cannot be built: {err}") from None
    return config, params, built
