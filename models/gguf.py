"""Load a llama-like model from a GGUF file (llama.cpp's format) into kvjax's params layout.

``gguf.GGUFReader`` memory-maps the file and gives each tensor's raw bytes; the block
dequantization of the types we accept is written here in vectorized numpy (so the
supported set and its exact semantics are ours to test). The result is the same
``(config, params, tokenizer)`` triple that the HF loader returns, with Q and K rows put
back in the transformers order.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeScaling
from models.llama import check_params

# GGUF architectures we accept, mapped to a ``ModelConfig.family``. llama.cpp writes Mistral
# models as "llama"; "mistral" is accepted for writers that use it and read the same way.
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}

# llama.cpp's converter interleaves the two rotary halves of each Q/K head (its RoPE kernel
# rotates adjacent pairs); it does so for llama-style models only, the Qwen converters keep
# the HF order.
_PERMUTED_QK = frozenset({"llama", "mistral"})

# GGML type ids (``gguf.GGMLQuantizationType``) handled below, with bytes per block and
# elements per block.
_F32, _F16, _Q4_1, _Q8_0, _BF16 = 0, 1, 3, 8, 30
_BLOCKS = {_Q4_1: (20, 32), _Q8_0: (34, 32)}
_TYPE_NAMES = {_F32: "F32", _F16: "F16", _Q4_1: "Q4_1", _Q8_0: "Q8_0", _BF16: "BF16"}

# Per-layer GGUF tensor names -> our ``params["layers"]`` keys.
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
# Linear weights: GGUF keeps the torch ``[out, in]`` row layout; kvjax multiplies ``x @ W``.
_TRANSPOSED = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"})
# Tensors that carry no weights of ours; ``rope_freqs`` is read into the config instead.
_IGNORED = frozenset({"rope_freqs.weight"})
# ``{arch}.context_length`` when a file does not give it
_DEFAULT_CONTEXT = 4096


# --------------------------------------------------------------------------- dequantization


def _dequant_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_1 blocks -> float32: per 32 values an fp16 scale ``d``, fp16 min ``m``, 16 bytes.

    Byte ``j`` holds value ``j`` in its low nibble and value ``j + 16`` in its high nibble
    (llama.cpp's ``block_q4_1`` layout); each value is ``d * q + m``.
    """
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return d * q + m


def _dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 blocks -> float32: per 32 values an fp16 scale ``d`` and 32 int8, value ``d * q``."""
    blocks = raw.reshape(-1, 34)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return d * q


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (as bytes or uint16) -> float32: they are its top 16 bits."""
    bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


def dequantize(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw GGUF tensor data -> float32 array of numpy ``shape`` (GGUF dims reversed).

    ``raw`` is what ``GGUFReader`` exposes as ``tensor.data`` (a typed view for float
    types, the bytes for block-quantized ones). Types other than F32, F16, BF16, Q4_1 and
    Q8_0 raise ``ValueError``.
    """
    type_id = int(type_id)
    if type_id == _F32:
        out = np.asarray(raw).view(np.float32)
    elif type_id == _F16:
        out = np.asarray(raw).view(np.float16).astype(np.float32)
    elif type_id == _BF16:
        out = _bf16_to_f32(np.asarray(raw))
    elif type_id in _BLOCKS:
        _, block_len = _BLOCKS[type_id]
        if shape[-1] % block_len:
            raise ValueError(
                f"rows of {shape[-1]} values do not split into blocks of {block_len}"
            )
        raw = np.ascontiguousarray(raw).view(np.uint8)
        out = (_dequant_q4_1 if type_id == _Q4_1 else _dequant_q8_0)(raw)
    else:
        raise ValueError(
            f"unsupported quant type {_type_name(type_id)}; supported: "
            f"{', '.join(_TYPE_NAMES.values())}"
        )
    return out.reshape(shape)


def _type_name(type_id: int) -> str:
    """Readable name of a GGML type id, falling back to the number."""
    try:
        import gguf

        return gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        return str(type_id)


# --------------------------------------------------------------------------- header / config


def _field(reader, key: str, default: Any = None) -> Any:
    """Value of header field ``key`` (scalar, string or list), or ``default`` if absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _f32_value(value) -> float:
    """A float32 header value as the shortest decimal that rounds to it (1e-5, not 9.99e-6)."""
    return float(str(np.float32(value)))


def _architecture(reader) -> str:
    """The ``general.architecture`` string, validated against what we can load."""
    return _supported_architecture(_field(reader, "general.architecture"))


def _supported_architecture(arch: str | None) -> str:
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture '{arch}'; supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int,
                         reader, arch: str) -> RopeScaling:
    """Recover Llama-3.1 RoPE scaling from llama.cpp's ``rope_freqs`` tensor.

    The converter stores only the per-frequency divisors, not the parameters that made
    them. We take the factor as the largest divisor and the low/high frequency factors
    every Llama-3.x release uses (1 and 4), rebuild the divisors, and accept them only when
    they reproduce the tensor, so a different scheme fails loudly instead of loading wrong.
    """
    factor = float(factors.max())
    low, high = 1.0, 4.0
    orig = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 8192))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < orig / high, 1.0,
        np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)),
    )
    if not np.allclose(expected, factors, rtol=1e-4):
        raise ValueError(
            "unsupported rope scaling: rope_freqs.weight is not Llama-3 scaling with "
            "low/high frequency factors 1/4"
        )
    return RopeScaling(factor=factor, low_freq_factor=low, high_freq_factor=high,
                       original_max_position_embeddings=orig)


def config_from_gguf(reader) -> ModelConfig:
    """Build the ``ModelConfig`` from a ``gguf.GGUFReader``'s header (and tensor list).

    Raises ``ValueError`` naming the architecture when it is not one of ``ARCHITECTURES``.
    """
    arch = _architecture(reader)

    def key(name, default=None):
        value = _field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF header lacks '{arch}.{name}'")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    # key_length is written when head_dim differs from hidden/heads (Qwen3, some Mistrals).
    head_dim = int(key("attention.key_length", hidden // heads))
    theta = _f32_value(key("rope.freq_base", 10000.0))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(key("vocab_size"))
    names = {t.name for t in reader.tensors}

    scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type not in (None, "none", "llama3"):
        raise ValueError(f"unsupported rope scaling type '{scaling_type}'")
    if "rope_freqs.weight" in names:
        tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = dequantize(tensor.data, tensor.tensor_type, (tensor.n_elements,))
        scaling = _llama3_rope_scaling(factors.astype(np.float64), theta, head_dim, reader,
                                       arch)

    # Stop tokens: eos, plus end-of-turn / end-of-message where the file names them
    # (Llama-3 instruct files), in that order and without repeats.
    stops = (_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
    eos_ids = tuple(dict.fromkeys(int(i) for i in stops if i is not None))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    window = _field(reader, f"{arch}.attention.sliding_window") if arch == "mistral" else None
    return ModelConfig(
        family=ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32_value(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", _DEFAULT_CONTEXT)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=int(window) if window else None,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


# GGUF header value types (``gguf.GGUFValueType``): struct formats of the fixed-size ones
_VALUE_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                  10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The scalar and string fields of a GGUF header; arrays and tensors are skipped.

    ``gguf.GGUFReader`` builds numpy views for every element of every header array (a
    49k-token vocabulary and its merges: seconds); this walks the key/value pairs with
    ``struct`` and steps over arrays, so reading a model's shape takes milliseconds.
    Raises ``ValueError`` for a file that is not GGUF (version 2 or later) or is cut short.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"'{path}' is not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _header_fields(buf)
            except (struct.error, UnicodeDecodeError) as err:
                raise ValueError(f"'{path}' has a malformed GGUF header ({err})") from None


def _header_fields(buf) -> dict[str, Any]:
    # the version is a small number: read in the wrong byte order its low half is zero
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
    version, _, kv_count = struct.unpack_from(order + "IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    pos = 24

    def take(fmt):
        nonlocal pos
        values = struct.unpack_from(order + fmt, buf, pos)
        pos += struct.calcsize(order + fmt)
        return values[0] if len(values) == 1 else values

    def string():
        nonlocal pos
        n = take("Q")
        if pos + n > len(buf):
            raise struct.error("string past the end of the file")
        pos += n
        return bytes(buf[pos - n:pos]).decode("utf-8")

    fields = {}
    for _ in range(kv_count):
        key, kind = string(), take("I")
        if kind == _STRING:
            fields[key] = string()
        elif kind in _VALUE_FORMATS:
            fields[key] = take(_VALUE_FORMATS[kind])
        elif kind == _ARRAY:
            item, count = take("IQ")
            if item == _STRING:
                for _ in range(count):
                    n = take("Q")   # (not `pos += take(...)`: take moves pos itself)
                    pos += n
            elif item in _VALUE_FORMATS:
                pos += count * struct.calcsize(order + _VALUE_FORMATS[item])
            else:
                raise ValueError(f"header array '{key}' holds values of type {item}")
        else:
            raise ValueError(f"header field '{key}' has unknown type {kind}")
    if pos > len(buf):
        raise struct.error("header past the end of the file")
    return fields


def context_length(path: str | os.PathLike) -> int:
    """``max_position_embeddings`` of a GGUF model, from its header alone (milliseconds;
    :func:`load_gguf` takes seconds). Unsupported architectures raise as in loading."""
    header = read_header(path)
    arch = _supported_architecture(header.get("general.architecture"))
    return int(header.get(f"{arch}.context_length", _DEFAULT_CONTEXT))


# --------------------------------------------------------------------------- weights


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation along axis 0 (weights ``[out, in]`` or biases).

    The converter maps each head's rows ``(2, D/2)`` (HF: first half, second half) to
    ``(D/2, 2)`` (adjacent pairs); swapping the two axes back restores the HF order.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_f32(tensor) -> np.ndarray:
    """Dequantize one ``ReaderTensor`` to float32 in numpy order (GGUF dims reversed)."""
    shape = tuple(int(s) for s in reversed(tensor.shape))
    return dequantize(tensor.data, tensor.tensor_type, shape)


def params_from_gguf(reader, config: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """All weights of ``reader`` in kvjax's params layout, cast to ``dtype``.

    Unknown tensor names raise ``ValueError`` rather than being silently dropped (they
    would mean an architecture variant this loader does not implement).
    """
    arch = _architecture(reader)
    by_name = {t.name: t for t in reader.tensors}
    # Check every type before decoding anything: fail in a moment, naming the tensor.
    for t in reader.tensors:
        if int(t.tensor_type) not in _TYPE_NAMES:
            raise ValueError(
                f"unsupported quant type {_type_name(int(t.tensor_type))} in tensor "
                f"'{t.name}'; supported: {', '.join(_TYPE_NAMES.values())}"
            )

    def take(name):
        tensor = by_name.pop(name, None)
        if tensor is None:
            raise ValueError(f"GGUF lacks tensor '{name}'")
        return _tensor_f32(tensor)

    def cast(x):
        return jnp.asarray(x, dtype=dtype)

    layers: dict[str, list[np.ndarray]] = {}
    for i in range(config.num_layers):
        for suffix, ours in _LAYER_TENSORS.items():
            name = f"blk.{i}.{suffix}"
            if name not in by_name:
                continue
            x = take(name)
            if arch in _PERMUTED_QK and ours in ("wq", "bq"):
                x = unpermute_qk(x, config.num_heads)
            elif arch in _PERMUTED_QK and ours in ("wk", "bk"):
                x = unpermute_qk(x, config.num_kv_heads)
            layers.setdefault(ours, []).append(x.T if ours in _TRANSPOSED else x)

    params = {
        "embed": cast(take("token_embd.weight")),
        "layers": {k: cast(np.stack(v)) for k, v in layers.items()},
        "final_norm": cast(take("output_norm.weight")),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = cast(take("output.weight").T)
    if leftover := sorted(set(by_name) - _IGNORED):
        raise ValueError(f"unexpected GGUF tensors (unsupported variant?): {leftover[:8]}")
    check_params(params, config)  # missing layer tensors or layers show up here
    return params


# --------------------------------------------------------------------------- entry point


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer embedded in a GGUF, built by transformers (``gguf_file=``).

    The returned ``PreTrainedTokenizerFast`` has ``encode``/``decode`` and, when the GGUF
    carries ``tokenizer.chat_template``, ``apply_chat_template``. It is built with
    ``PreTrainedTokenizerFast`` rather than ``AutoTokenizer``: both build the same backend
    from the GGUF's vocabulary and merges, but ``AutoTokenizer`` first parses the whole
    header again through transformers' legacy GGUF path just to pick a tokenizer class
    (about 10x slower: 13 s against 1.4 s for SmolLM2); the two give identical encodings,
    special tokens and chat template.
    """
    from transformers import PreTrainedTokenizerFast

    path = os.path.abspath(os.fspath(path))
    return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path),
                                                   gguf_file=os.path.basename(path))


def load_gguf(path: str | os.PathLike, dtype=jnp.bfloat16, *, tokenizer: bool = True):
    """Load ``(config, params, tokenizer)`` from a GGUF file.

    ``dtype`` is the dtype of every returned array. With ``tokenizer=False`` the third
    element is ``None`` (building it re-reads the vocabulary, a few seconds).
    """
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"no GGUF file at '{path}'")
    reader = gguf.GGUFReader(path)
    config = config_from_gguf(reader)
    params = params_from_gguf(reader, config, dtype)
    return config, params, (load_tokenizer(path) if tokenizer else None)
