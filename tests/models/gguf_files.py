"""Small GGUF files for the loader and CLI tests, written two ways.

- :func:`tiny_model`: a 1-layer llama-like model through gguf-py's ``GGUFWriter`` (the
  reference writer), optionally with a byte-level BPE tokenizer and a chat template, so
  every command of the CLI runs it in seconds.
- :func:`gguf_bytes`: a minimal writer of the container format itself, in which every
  count, length, type and offset can be set to a wrong value (files that gguf-py would
  refuse to write), with the byte offsets where its sections begin.
"""

from __future__ import annotations

import struct

import numpy as np

# GGUF value types and GGML tensor types used here (gguf.GGUFValueType / GGMLQuantizationType)
UINT32, FLOAT32, STRING, ARRAY = 4, 6, 8, 9
F32, F16 = 0, 1

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (its ``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_model(path, arch="llama", *, weight_type="F32", extra=None, rope_freqs=None,
               keys=None, tokenizer=False, merges=("Ġ t",), context=256, scale=1.0):
    """A 1-layer llama-like GGUF: hidden 64, 2 heads, 1 kv head, D 32, MLP 96.

    Without ``tokenizer`` the vocabulary is 32 (``vocab_size`` in the header); with it,
    a byte-level BPE vocabulary (3 special tokens, the 256 bytes and "Ġt"), ``merges``
    and a chat template, which transformers builds a tokenizer from. ``extra`` maps more
    tensor names to ``(array, raw_dtype or None)``; ``keys`` maps more header keys
    (without the architecture prefix) to uint32 values; ``scale`` multiplies every weight.
    """
    import gguf

    qt = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (keys or {}).items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_uint32(f"{arch}.embedding_length", 64)
    w.add_uint32(f"{arch}.feed_forward_length", 96)
    w.add_uint32(f"{arch}.attention.head_count", 2)
    w.add_uint32(f"{arch}.attention.head_count_kv", 1)
    w.add_uint32(f"{arch}.context_length", context)
    w.add_float32(f"{arch}.rope.freq_base", 500000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if tokenizer:
        tokens = [*SPECIAL_TOKENS, *_byte_level_alphabet(), "Ġt"]
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - 3))
        w.add_token_merges(list(merges))
        w.add_bos_token_id(0)
        w.add_eos_token_id(2)
        w.add_chat_template(CHAT_TEMPLATE)
        vocab = len(tokens)
    else:
        w.add_uint32(f"{arch}.vocab_size", 32)
        vocab = 32
    rng = np.random.default_rng(0)

    def add(name, shape, qtype="F32"):
        x = (scale * rng.standard_normal(shape)).astype(np.float32)
        if qtype == "F32":
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qt[qtype]), raw_dtype=qt[qtype])

    add("token_embd.weight", (vocab, 64))
    add("output_norm.weight", (64,))
    add("output.weight", (vocab, 64), weight_type)
    for n, shape in {"attn_norm": (64,), "ffn_norm": (64,), "attn_q": (64, 64),
                     "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
                     "ffn_gate": (96, 64), "ffn_up": (96, 64), "ffn_down": (64, 96)}.items():
        add(f"blk.0.{n}.weight", shape, weight_type if len(shape) == 2 else "F32")
    for name, raw in (extra or {}).items():
        w.add_tensor(name, raw[0], raw_dtype=raw[1])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


#: numpy shapes of the tensors of :func:`tiny_model` without a tokenizer
TINY_SHAPES = {
    "token_embd.weight": (32, 64), "output_norm.weight": (64,), "output.weight": (32, 64),
    "blk.0.attn_norm.weight": (64,), "blk.0.ffn_norm.weight": (64,),
    "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (32, 64),
    "blk.0.attn_v.weight": (32, 64), "blk.0.attn_output.weight": (64, 64),
    "blk.0.ffn_gate.weight": (96, 64), "blk.0.ffn_up.weight": (96, 64),
    "blk.0.ffn_down.weight": (64, 96),
}


def tiny_fields(**values):
    """The header fields of :func:`tiny_model` (no tokenizer) for :func:`gguf_bytes`;
    ``values`` replaces the value of a ``llama.*`` key (``block_count=...``) with a uint32,
    or with ``(value type, value)``, or drops it when ``None``."""
    fields = {"general.architecture": (STRING, "llama")}
    for key, value in dict(block_count=1, embedding_length=64, feed_forward_length=96,
                           context_length=256, vocab_size=32, **{
                               "attention.head_count": 2,
                               "attention.head_count_kv": 1}).items():
        fields[f"llama.{key}"] = (UINT32, value)
    for key, value in values.items():
        key = "llama." + key.replace("__", ".")
        if value is None:
            fields.pop(key, None)
        else:
            fields[key] = value if isinstance(value, tuple) else (UINT32, value)
    return [(key, kind, value) for key, (kind, value) in fields.items()]


def tiny_tensors():
    """The tensors of :func:`tiny_model` (no tokenizer, F32, seeded) for :func:`gguf_bytes`."""
    rng = np.random.default_rng(0)
    return [(name, shape[::-1], F32, rng.standard_normal(shape).astype(np.float32).tobytes())
            for name, shape in TINY_SHAPES.items()]


def _string(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def _value(kind: int, value) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        item, items = value
        return struct.pack("<IQ", item, len(items)) + b"".join(_value(item, v) for v in items)
    return struct.pack("<" + {UINT32: "I", FLOAT32: "f"}[kind], value)


def gguf_bytes(fields, tensors, *, version=3, alignment=32, kv_count=None, tensor_count=None,
               magic=b"GGUF"):
    """``(file bytes, marks)`` of a GGUF (little-endian) written field by field.

    ``fields``: ``(key, value type, value)``; a string value is ``str``, an array
    ``(item type, items)``, a type this writer does not know is written as a uint32.
    ``tensors``: ``(name, dims, ggml type, data bytes)`` with an optional fifth item, a
    data offset for the info to claim (the data is then not written; by default each
    tensor's data follows the last, aligned). ``kv_count``/``tensor_count`` override the
    counts. ``marks`` maps ``"fields"``, ``"tensor_infos"``, ``"data"`` and ``"end"`` to
    where they begin.
    """
    out = bytearray(magic + struct.pack("<IQQ", version,
                                        len(tensors) if tensor_count is None else tensor_count,
                                        len(fields) if kv_count is None else kv_count))
    marks = {"fields": len(out)}
    for key, kind, value in fields:
        out += _string(key) + struct.pack("<I", kind)
        out += _value(kind, value) if kind in (UINT32, FLOAT32, STRING, ARRAY) else (
            struct.pack("<I", value))
    marks["tensor_infos"] = len(out)
    placed, next_offset = [], 0
    for name, dims, ggml_type, data, *claimed in tensors:
        offset = claimed[0] if claimed else next_offset
        if not claimed:
            placed.append(data + bytes(-len(data) % alignment))
            next_offset += len(placed[-1])
        out += _string(name) + struct.pack("<I", len(dims))
        out += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ggml_type, offset)
    out += bytes(-len(out) % alignment)
    marks["data"] = len(out)
    out += b"".join(placed)
    marks["end"] = len(out)
    return bytes(out), marks
