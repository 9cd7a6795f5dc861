"""Load a llama-like model from a GGUF file (llama.cpp's format) into kvjax's params layout.

:func:`read_layout` first checks the file's whole structure against its size (a file
that is cut short or corrupt is a :class:`models.files.ModelFileError` naming what is
wrong, never a numpy error from deep inside a reader); then ``gguf.GGUFReader``
memory-maps the file and gives each tensor's raw bytes. The block dequantization of the
types we accept is written here in vectorized numpy (so the supported set and its exact
semantics are ours to test). The result is the same ``(config, params, tokenizer)``
triple that the HF loader returns, with Q and K rows put back in the transformers order.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from typing import Any

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeScaling
from models.files import ModelFileError
from models.llama import check_params, param_shapes

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


def _header_int(value: Any, key: str, minimum: int = 0) -> int:
    """A header value that must be an integer of at least ``minimum``; clear errors."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"header field '{key}' must be an integer, got {_shown(value)}")
    if value < minimum:
        raise ValueError(f"header field '{key}' must be at least {minimum}, got {value}")
    return int(value)


def _header_float(value: Any, key: str) -> float:
    """A header value that must be a finite positive number; clear errors."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ValueError(f"header field '{key}' must be a number, got {_shown(value)}")
    if not 0 < value < math.inf:
        raise ValueError(f"header field '{key}' must be a finite positive number, got {value}")
    return _f32_value(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int_value(fields: dict[str, Any], key: str, default: int) -> int:
    """A positive integer field of a :func:`read_header` dict, or ``default``."""
    return _header_int(fields.get(key, default), key, minimum=1)


def _architecture(reader) -> str:
    """The ``general.architecture`` string, validated against what we can load."""
    return _supported_architecture(_field(reader, "general.architecture"))


def _supported_architecture(arch: Any) -> str:
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        shown = f"'{arch}'" if isinstance(arch, str) or arch is None else _shown(arch)
        raise ValueError(
            f"unsupported GGUF architecture {shown}; supported: {', '.join(ARCHITECTURES)}"
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
    orig_key = f"{arch}.rope.scaling.original_context_length"
    orig = _header_int(_field(reader, orig_key, 8192), orig_key, minimum=1)
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

    def value(name, default):
        found = _field(reader, f"{arch}.{name}", default)
        if found is None:
            raise ValueError(f"GGUF header lacks '{arch}.{name}'")
        return found

    def integer(name, default=None):
        return _header_int(value(name, default), f"{arch}.{name}", minimum=1)

    def number(name, default=None):
        return _header_float(value(name, default), f"{arch}.{name}")

    hidden = integer("embedding_length")
    heads = integer("attention.head_count")
    kv_heads = integer("attention.head_count_kv", heads)
    # key_length is written when head_dim differs from hidden/heads (Qwen3, some Mistrals).
    head_dim = integer("attention.key_length", max(hidden // heads, 1))
    theta = number("rope.freq_base", 10000.0)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is not None and not isinstance(tokens, list):
        raise ValueError("header field 'tokenizer.ggml.tokens' must be an array")
    vocab = len(tokens) if tokens is not None else integer("vocab_size")
    names = {t.name for t in reader.tensors}

    scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type not in (None, "none", "llama3"):
        raise ValueError(f"unsupported rope scaling type {_shown(scaling_type)}")
    if "rope_freqs.weight" in names:
        tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        if int(tensor.n_elements) != head_dim // 2:
            raise ValueError(f"tensor 'rope_freqs.weight' has {tensor.n_elements} values, "
                             f"expected head_dim / 2 = {head_dim // 2}")
        factors = dequantize(tensor.data, tensor.tensor_type, (tensor.n_elements,))
        scaling = _llama3_rope_scaling(factors.astype(np.float64), theta, head_dim, reader,
                                       arch)

    # Stop tokens: eos, plus end-of-turn / end-of-message where the file names them
    # (Llama-3 instruct files), in that order and without repeats.
    stop_keys = [f"tokenizer.ggml.{k}_token_id" for k in ("eos", "eot", "eom")]
    stops = [_header_int(_field(reader, k), k) for k in stop_keys
             if _field(reader, k) is not None]
    eos_ids = tuple(dict.fromkeys(stops))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    window_key = f"{arch}.attention.sliding_window"
    window = _field(reader, window_key) if arch == "mistral" else None
    window = None if window is None else _header_int(window, window_key)
    return ModelConfig(
        family=ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=integer("feed_forward_length"),
        num_layers=integer("block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=number("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=integer("context_length", _DEFAULT_CONTEXT),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=window or None,
        bos_token_id=None if bos is None else _header_int(bos, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
    )


# GGUF header value types (``gguf.GGUFValueType``): struct formats of the fixed-size ones
_VALUE_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                  10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_UINT32 = 4
# GGUF versions with 64-bit counts and lengths, the ones gguf-py and llama.cpp read
_VERSIONS = (2, 3)
# llama.cpp's GGML_MAX_DIMS
_MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file as its header describes it, checked against the file.

    ``dims`` are in GGUF order (fastest-varying first; numpy's shape is the reverse),
    ``start``/``stop`` the absolute byte range of its data.
    """

    name: str
    dims: tuple[int, ...]
    type_id: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class GGUFLayout:
    """The structure of a GGUF file: version, scalar and string header fields (arrays
    left out), tensors, where the tensor data begins, and the file's size in bytes."""

    version: int
    fields: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    data_start: int
    size: int


class _Cursor:
    """Reads the header of a GGUF file in order; every read is checked against its size."""

    def __init__(self, path: str, buf):
        self.path, self.buf, self.size = path, buf, len(buf)
        self.pos, self.order = 0, "<"

    def need(self, n: int, what: str) -> int:
        """Step over ``n`` bytes that ``what`` takes; returns where they start."""
        start = self.pos
        if start + n > self.size:
            raise ModelFileError.truncated(self.path, what, start, start + n, self.size)
        self.pos += n
        return start

    def take(self, fmt: str, what: str):
        start = self.need(struct.calcsize(self.order + fmt), what)
        values = struct.unpack_from(self.order + fmt, self.buf, start)
        return values[0] if len(values) == 1 else values

    def string(self, what: str) -> str:
        n = self.take("Q", f"the length of {what}")
        start = self.need(n, what)
        try:
            return bytes(self.buf[start:self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(self.path, f"{what} (bytes {start}..{self.pos}) is not "
                                 "UTF-8 text") from None

    def value(self, kind: int, what: str, key: str) -> Any:
        """One header value of type ``kind``; arrays are checked and stepped over (None)."""
        if kind == _STRING:
            return self.string(what)
        if kind in _VALUE_FORMATS:
            return self.take(_VALUE_FORMATS[kind], what)
        if kind != _ARRAY:
            raise ModelFileError(self.path, f"header field '{key}' has unknown value type "
                                 f"{kind}")
        item = self.take("I", f"the item type of {what}")
        count = self.take("Q", f"the length of {what}")
        if item in _VALUE_FORMATS:
            self.need(count * struct.calcsize(self.order + _VALUE_FORMATS[item]), what)
        elif item in (_STRING, _ARRAY):
            # every item takes bytes, so a count too large for the file ends at its end
            for i in range(count):
                self.value(item, f"item {i} of {what}", key)
        else:
            raise ModelFileError(self.path, f"header array '{key}' holds values of unknown "
                                 f"type {item}")
        return None


def _check_magic(path: str, head: bytes, size: int) -> None:
    if size == 0:
        raise ModelFileError(path, "empty file, not a GGUF model")
    if head != b"GGUF":
        if len(head) < 4 and b"GGUF".startswith(head):
            raise ModelFileError.truncated(path, "the GGUF magic", 0, 4, size)
        raise ModelFileError(path, f"not a GGUF file: it starts with {head!r}, a GGUF "
                             "file with b'GGUF'")


def read_layout(path: str | os.PathLike) -> GGUFLayout:
    """Walk a GGUF file's header and check it against the file before anything reads it.

    Checks the magic, the version (2 or 3), the counts, every string's length and
    encoding, every value type, the alignment, and each tensor's dimensions, type, data
    offset and size: all of a tensor's bytes must lie in the file. Anything wrong raises
    :class:`ModelFileError` naming the path and the problem (``"truncated file: tensor
    'x' needs bytes A..B, file has N"``). Arrays (the vocabulary) are checked and stepped
    over, not built: under a tenth of a second for SmolLM2's 49k tokens and merges.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            _check_magic(path, f.read(4), size)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                cur = _Cursor(path, buf)
                cur.pos = 4
                version, tensor_count, fields, types = _read_fields(cur)
                infos = _read_tensor_infos(cur, tensor_count)
    except OSError as err:
        raise ModelFileError(path, err.strerror or str(err)) from None

    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if "general.alignment" in fields and types["general.alignment"] != _UINT32:
        raise ModelFileError(path, "header field 'general.alignment' must be a uint32")
    if alignment < 1 or alignment & (alignment - 1):
        raise ModelFileError(path, f"alignment {alignment} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in infos:
        what = f"tensor '{name}'"
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise ModelFileError(path, f"{what} has unknown GGML type {type_id}") from None
        if dims and dims[0] % block:
            raise ModelFileError(path, f"{what} has rows of {dims[0]} values, which do not "
                                 f"split into blocks of {block} ({_type_name(type_id)})")
        if offset % alignment:
            raise ModelFileError(path, f"{what} starts at data offset {offset}, not a "
                                 f"multiple of the alignment {alignment}")
        start = data_start + offset
        stop = start + math.prod(dims) // block * type_size
        if stop > size:
            raise ModelFileError.truncated(path, what, start, stop, size)
        tensors.append(TensorInfo(name, dims, type_id, start, stop))
    return GGUFLayout(version, fields, tuple(tensors), data_start, size)


def _read_fields(cur: _Cursor) -> tuple[int, int, dict[str, Any], dict[str, int]]:
    """The version, the tensor count, the scalar and string fields and every field's
    type."""
    version = cur.take("I", "the GGUF version")
    # the version is a small number: read in the wrong byte order its low half is zero
    if not version & 0xFFFF:
        cur.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in _VERSIONS:
        raise ModelFileError(cur.path, f"GGUF version {version} is not supported "
                             f"(versions {', '.join(map(str, _VERSIONS))} are)")
    tensor_count = cur.take("Q", "the tensor count")
    kv_count = cur.take("Q", "the header field count")
    fields, types = {}, {}
    for i in range(kv_count):
        key = cur.string(f"the key of header field {i}")
        if key in types:
            raise ModelFileError(cur.path, f"header field '{key}' is given twice")
        kind = cur.take("I", f"the type of header field '{key}'")
        value = cur.value(kind, f"the value of header field '{key}'", key)
        types[key] = kind
        if kind != _ARRAY:
            fields[key] = value
    return version, tensor_count, fields, types


def _read_tensor_infos(cur: _Cursor, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """``(name, dims, type id, data offset)`` of every tensor, in file order."""
    infos, names = [], set()
    for i in range(count):
        name = cur.string(f"the name of tensor {i}")
        if name in names:
            raise ModelFileError(cur.path, f"tensor '{name}' is given twice")
        names.add(name)
        what = f"the info of tensor '{name}'"
        n_dims = cur.take("I", what)
        if n_dims > _MAX_DIMS:
            raise ModelFileError(cur.path, f"tensor '{name}' has {n_dims} dimensions; "
                                 f"GGUF allows at most {_MAX_DIMS}")
        dims = tuple(cur.take("Q", what) for _ in range(n_dims))
        type_id, offset = cur.take("I", what), cur.take("Q", what)
        infos.append((name, dims, type_id, offset))
    return infos


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The scalar and string fields of a GGUF header; arrays and tensors are skipped.

    ``gguf.GGUFReader`` builds numpy views for every element of every header array (a
    49k-token vocabulary and its merges: seconds); :func:`read_layout` walks the file with
    ``struct`` and steps over arrays, so reading a model's shape takes a fraction of a
    second. Every structural problem of the file raises :class:`ModelFileError`.
    """
    return read_layout(path).fields


def context_length(path: str | os.PathLike) -> int:
    """``max_position_embeddings`` of a GGUF model, from its header alone (a fraction of
    a second; :func:`load_gguf` takes seconds), after :func:`read_layout` has checked the
    whole file. Unsupported architectures raise as in loading, as :class:`ModelFileError`.
    """
    header = read_header(path)
    try:
        arch = _supported_architecture(header.get("general.architecture"))
        return _int_value(header, f"{arch}.context_length", _DEFAULT_CONTEXT)
    except ValueError as err:
        raise ModelFileError(path, str(err)) from None


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
    would mean an architecture variant this loader does not implement), and so do layer
    tensors beyond ``config.num_layers`` and every tensor whose shape is not the one the
    config gives it (checked before it is decoded).
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
    blocks = {name.split(".")[1] for name in by_name if name.startswith("blk.")}
    # (the count first: a corrupt block_count can be billions)
    if len(blocks) != config.num_layers or blocks != {str(i) for i in range(len(blocks))}:
        raise ValueError(f"block_count is {config.num_layers} but the tensors name blocks "
                         f"{sorted(blocks, key=lambda b: (len(b), b))[:8]}")
    shapes = param_shapes(config)

    def take(name, shape):
        """The tensor ``name`` in numpy order, which must have ``shape`` there."""
        tensor = by_name.pop(name, None)
        if tensor is None:
            raise ValueError(f"GGUF lacks tensor '{name}'")
        got = tuple(int(s) for s in reversed(tensor.shape))
        if got != tuple(shape):
            raise ValueError(f"tensor '{name}' has shape {got}, expected {tuple(shape)}")
        return _tensor_f32(tensor)

    def cast(x):
        return jnp.asarray(x, dtype=dtype)

    layers: dict[str, list[np.ndarray]] = {}
    for i in range(config.num_layers):
        for suffix, ours in _LAYER_TENSORS.items():
            name = f"blk.{i}.{suffix}"
            if name not in by_name:
                continue
            if ours not in shapes["layers"]:
                raise ValueError(f"tensor '{name}' does not belong to this architecture "
                                 "(per-layer tensors follow those of block 0)")
            shape = shapes["layers"][ours][1:]
            x = take(name, shape[::-1] if ours in _TRANSPOSED else shape)
            if arch in _PERMUTED_QK and ours in ("wq", "bq"):
                x = unpermute_qk(x, config.num_heads)
            elif arch in _PERMUTED_QK and ours in ("wk", "bk"):
                x = unpermute_qk(x, config.num_kv_heads)
            layers.setdefault(ours, []).append(x.T if ours in _TRANSPOSED else x)

    params = {
        "embed": cast(take("token_embd.weight", shapes["embed"])),
        "layers": {k: cast(np.stack(v)) for k, v in layers.items()},
        "final_norm": cast(take("output_norm.weight", shapes["final_norm"])),
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = cast(take("output.weight", shapes["lm_head"][::-1]).T)
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
    special tokens and chat template. A vocabulary that does not make a tokenizer raises
    :class:`ModelFileError`.
    """
    from transformers import PreTrainedTokenizerFast

    path = os.path.abspath(os.fspath(path))
    try:
        return PreTrainedTokenizerFast.from_pretrained(os.path.dirname(path),
                                                       gguf_file=os.path.basename(path))
    except Exception as err:  # the tokenizers backend raises plain Exception
        raise ModelFileError(path, f"its tokenizer cannot be built: {err}") from None


def load_gguf(path: str | os.PathLike, dtype=jnp.bfloat16, *, tokenizer: bool = True):
    """Load ``(config, params, tokenizer)`` from a GGUF file.

    ``dtype`` is the dtype of every returned array. The file's structure is checked by
    :func:`read_layout` first; that and every other problem with its contents (an
    unsupported architecture or quant type, missing, extra or misshapen tensors) raise
    :class:`ModelFileError` naming the path. The tokenizer is ``None`` with
    ``tokenizer=False`` (building it re-reads the vocabulary, a few seconds) and when the
    file has none (no ``tokenizer.ggml.model``).
    """
    import gguf

    path = os.fspath(path)
    layout = read_layout(path)
    try:
        reader = gguf.GGUFReader(path)
        config = config_from_gguf(reader)
        params = params_from_gguf(reader, config, dtype)
    except ModelFileError:
        raise
    except ValueError as err:
        raise ModelFileError(path, str(err)) from None
    has_tokenizer = tokenizer and "tokenizer.ggml.model" in layout.fields
    return config, params, (load_tokenizer(path) if has_tokenizer else None)
