"""HF checkpoint directories on disk: config.json and safetensors, checked before reading.

The files are written by ``safetensors.numpy.save_file`` (the reference writer) for a
1-layer llama-like config, then cut, corrupted or left out: every problem is one
:class:`models.files.ModelFileError` naming the file, never a numpy or JSON error from
inside the reader. The loader's numerics are tested against transformers in
``test_parity.py``.
"""

import json
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import models
from models.files import ModelFileError
from models.hf import load_hf_dir, read_safetensors, read_safetensors_dir
from tests.fuzz import example_count, rng

CONFIG = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 2,
          "num_key_value_heads": 1, "max_position_embeddings": 256,
          "tie_word_embeddings": True}
SHAPES = {
    "model.embed_tokens.weight": (32, 64), "model.norm.weight": (64,),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.layers.0.post_attention_layernorm.weight": (64,),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.layers.0.self_attn.k_proj.weight": (32, 64),
    "model.layers.0.self_attn.v_proj.weight": (32, 64),
    "model.layers.0.self_attn.o_proj.weight": (64, 64),
    "model.layers.0.mlp.gate_proj.weight": (96, 64),
    "model.layers.0.mlp.up_proj.weight": (96, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 96),
}


def _tensors():
    r = np.random.default_rng(0)
    return {name: r.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def _checkpoint(folder, config=CONFIG, shards=1):
    """A checkpoint directory; with ``shards > 1`` an index names the shard files."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = _tensors()
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def _safetensors(tmp_path):
    """``(path, bytes, data start)`` of one safetensors file of the checkpoint's tensors."""
    path = tmp_path / "t.safetensors"
    save_file(_tensors(), str(path))
    data = path.read_bytes()
    return path, data, 8 + struct.unpack("<Q", data[:8])[0]


def test_checkpoints_load(tmp_path):
    """The reference files load, one file or sharded, with every tensor as written."""
    for name, shards in (("one", 1), ("sharded", 3)):
        folder = _checkpoint(tmp_path / name, shards=shards)
        config, params, tokenizer = models.load(str(folder), jnp.float32)
        assert config.num_layers == 1 and config.head_dim == 32 and tokenizer is None
        np.testing.assert_array_equal(np.asarray(params["layers"]["wk"][0]),
                                      _tensors()["model.layers.0.self_attn.k_proj.weight"].T)
        assert models.context_length(str(folder)) == 256


def test_truncated_safetensors_names_the_missing_part(tmp_path):
    _, data, start = _safetensors(tmp_path)
    first = min(json.loads(data[8:start]).items(),
                key=lambda item: item[1]["data_offsets"][0] if "dtype" in item[1] else 1e18)
    name, (begin, end) = first[0], first[1]["data_offsets"]
    cut = tmp_path / "cut.safetensors"
    for count, message in {
        0: "the header length needs bytes 0..8, file has 0",
        5: "the header length needs bytes 0..8, file has 5",
        20: f"the JSON header needs bytes 8..{start}, file has 20",
        start + 10: f"tensor '{name}' needs bytes {start + begin}..{start + end}, file has "
                    f"{start + 10}",
        len(data) - 1: "needs bytes",
    }.items():
        cut.write_bytes(data[:count])
        with pytest.raises(ModelFileError) as err:
            read_safetensors(cut)
        assert str(err.value).startswith(f"{cut}: truncated file: ") and message in str(
            err.value), (count, str(err.value))


def _with_header(data: bytes, start: int, header) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data[start:]


@pytest.mark.parametrize("change,message", [
    (lambda h: b"{not json", "the header is not JSON"),
    (lambda h: b"\xff\xfe", "the header is not JSON"),
    (lambda h: [1, 2], "the header is not a JSON object"),
    (lambda h: {**h, "x": 7}, "tensor 'x': a header entry needs dtype, shape and data_offsets"),
    (lambda h: {**h, "x": {"dtype": "F32", "shape": [1]}}, "needs dtype, shape and data_off"),
    (lambda h: {**h, "x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}},
     "tensor 'x' has unsupported dtype C64"),
    (lambda h: {**h, "x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
     "tensor 'x' has a bad shape"),
    (lambda h: {**h, "x": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}},
     "tensor 'x' has a bad shape"),
    (lambda h: {**h, "x": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}},
     "tensor 'x' has bad data_offsets"),
    (lambda h: {**h, "x": {"dtype": "F32", "shape": [1], "data_offsets": [0]}},
     "tensor 'x' has bad data_offsets"),
    (lambda h: {**h, "x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
     r"tensor 'x' of shape \(3,\) and dtype F32 takes 12 bytes, its data_offsets 0..8 span 8"),
    (lambda h: {**h, "x": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}},
     "truncated file: tensor 'x' needs bytes"),
])
def test_corrupt_safetensors_header(tmp_path, change, message):
    path, data, start = _safetensors(tmp_path)
    path.write_bytes(_with_header(data, start, change(json.loads(data[8:start]))))
    with pytest.raises(ModelFileError, match=message):
        read_safetensors(path)


def test_mutated_safetensors_load_or_fail_clearly(tmp_path):
    """Seeded corruptions of the header bytes (JSON text, lengths, offsets): each file
    reads, or raises ModelFileError; nothing else."""
    path, good, start = _safetensors(tmp_path)
    for index in range(example_count(200)):
        r = rng("safetensors-mutation", index)
        data = bytearray(good)
        for _ in range(r.integers(1, 4)):
            # mostly digits and JSON punctuation: they make plausible wrong numbers
            data[r.integers(0, start)] = r.choice([*b'0123456789[]{},":-. ', 255])
        path.write_bytes(bytes(data))
        try:
            tensors = read_safetensors(path)
        except ModelFileError as err:
            assert str(err).startswith(f"{path}: ") and "\n" not in str(err), index
        else:
            assert all(isinstance(t, np.ndarray) for t in tensors.values())


def test_checkpoint_directory_problems(tmp_path):
    """Missing and corrupt files of a checkpoint directory: errors that name the file."""
    folder = _checkpoint(tmp_path / "ckpt", shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFileError, match=r"model-00002-of-00002\.safetensors: no such file"):
        models.load(str(folder))

    index = folder / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "../elsewhere.safetensors"}}')
    with pytest.raises(ModelFileError, match="shard file names in the same directory"):
        read_safetensors_dir(folder)
    index.write_text("[]")
    with pytest.raises(ModelFileError, match=r"index\.json: not a JSON object"):
        read_safetensors_dir(folder)
    index.write_text("{")
    with pytest.raises(ModelFileError, match=r"index\.json: not a JSON object"):
        read_safetensors_dir(folder)

    twice = _checkpoint(tmp_path / "twice")
    save_file({"model.norm.weight": np.ones(64, np.float32)}, str(twice / "more.safetensors"))
    with pytest.raises(ModelFileError, match=r"tensor 'model\.norm\.weight' is also in another"):
        read_safetensors_dir(twice)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ModelFileError, match=r"empty: no \*\.safetensors files"):
        models.load(str(empty))
    with pytest.raises(ModelFileError, match=r"no config\.json"):
        load_hf_dir(tmp_path / "nothing")

    wrong = _checkpoint(tmp_path / "wrong", config={**CONFIG, "intermediate_size": 97})
    with pytest.raises(ModelFileError, match=r"wrong: tensor 'model\.layers\.0\.mlp\.gate_proj"
                                             r"\.weight' has shape \(96, 64\)"):
        models.load(str(wrong))


@pytest.mark.parametrize("text,message", [
    ("{", "not a JSON file"),
    ("\xff", "not a JSON file"),
    ("[1]", "config must be a JSON object"),
    (json.dumps({**CONFIG, "model_type": None}), "unsupported model_type None"),
    (json.dumps({k: v for k, v in CONFIG.items() if k != "hidden_size"}),
     "config lacks 'hidden_size'"),
    (json.dumps({**CONFIG, "num_attention_heads": "2"}),
     "config 'num_attention_heads' must be an integer, got '2'"),
    (json.dumps({**CONFIG, "num_attention_heads": 0}), "num_attention_heads must be a positive"),
    (json.dumps({**CONFIG, "rms_norm_eps": [1]}), "'rms_norm_eps' must be a finite number"),
    (json.dumps({**CONFIG, "rope_scaling": 3}), "rope_scaling must be an object"),
    (json.dumps({**CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
     "llama3 rope scaling lacks 'low_freq_factor'"),
    (json.dumps({**CONFIG, "eos_token_id": ["x"]}), "eos_token_id must be integers"),
])
def test_bad_config_json(tmp_path, text, message):
    """From the header alone (``context_length``) and from loading alike."""
    folder = _checkpoint(tmp_path / "ckpt")
    (folder / "config.json").write_bytes(text.encode("latin-1"))
    for read in (models.context_length, models.load):
        with pytest.raises(ModelFileError, match=message) as err:
            read(str(folder))
        assert err.value.path == str(folder / "config.json")


def test_tokenizer_that_cannot_be_built(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt")
    (folder / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelFileError, match="ckpt: its tokenizer cannot be built"):
        models.load(str(folder))
