"""The Flax core against HF transformers (PyTorch, float32, eager) on tiny random models.

HF's default init (std 0.02) makes logits nearly constant, which would let a wrong RoPE
or a dropped norm pass; the weights are therefore re-drawn with unit-scale spreads.
Compile time dominates these tests, so shapes are shared between tests where possible.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from kvjax.spec import CacheConfig
from models import context_length
from models.config import ModelConfig
from models.hf import load_hf_dir, params_from_hf
from models.llama import init_params, jit_forward, logits_no_cache, new_cache

VOCAB, SEQ, BATCH = 128, 20, 2
TOL = 1e-4

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               max_position_embeddings=256, rms_norm_eps=1e-5)

FAMILIES = {
    # head_dim 24 != 64 / 4: the explicit head_dim path
    "llama": lambda: transformers.LlamaConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=24),
    # long wavelengths (> 16) stretched, 4..16 blended: every branch of the llama3 rule
    "llama3_scaling": lambda: transformers.LlamaConfig(
        **_COMMON, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                         "rope_theta": 500000.0}),
    "qwen2": lambda: transformers.Qwen2Config(
        **_COMMON, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(
        **_COMMON, num_attention_heads=6, num_key_value_heads=2, head_dim=16),
    "mistral": lambda: transformers.MistralConfig(
        **_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        sliding_window=7),
}

_MODEL_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
}


def _hf_model(name: str, seed: int = 0):
    hf_config = FAMILIES[name]()
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = _MODEL_CLASSES[hf_config.model_type](hf_config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return model, ModelConfig.from_hf(hf_config.to_dict())


@pytest.fixture(scope="module")
def models():
    """Per family: (HF model, our config, our params)."""
    out = {}
    for name in FAMILIES:
        model, config = _hf_model(name)
        out[name] = (model, config, params_from_hf(model.state_dict(), config))
    return out


def _tokens(batch=BATCH, seq=SEQ, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, seq)).astype(np.int32)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(models, name):
    model, config, params = models[name]
    tokens = _tokens()
    ref = _hf_logits(model, tokens)
    ours = np.asarray(logits_no_cache(params, config, tokens))
    assert ours.shape == (BATCH, SEQ, VOCAB) and ours.dtype == np.float32
    assert np.abs(ours - ref).max() <= TOL
    # the comparison has teeth: logits spread far more than the tolerance
    assert ref.std() > 0.3


def test_features_reach_the_config(models):
    assert models["llama3_scaling"][1].rope_scaling is not None
    assert models["qwen2"][1].attention_bias and models["qwen2"][1].tie_word_embeddings
    assert "lm_head" not in models["qwen2"][2]
    assert models["qwen3"][1].qk_norm and "q_norm" in models["qwen3"][2]["layers"]
    assert models["mistral"][1].sliding_window == 7 < SEQ


def test_sliding_window_matters(models):
    """Without the window our mistral logits must differ from HF's (the test can fail)."""
    model, config, params = models["mistral"]
    tokens = _tokens()
    import dataclasses

    unwindowed = dataclasses.replace(config, sliding_window=None)
    ours = np.asarray(logits_no_cache(params, unwindowed, tokens))
    assert np.abs(ours - _hf_logits(model, tokens)).max() > 1e-2


def test_chunked_prefill_equals_one_shot(models):
    _, config, params = models["llama"]
    tokens = _tokens()
    one_shot = np.asarray(logits_no_cache(params, config, tokens))
    step = jit_forward
    cache = new_cache(config, CacheConfig(k="f32", v="f32"), batch=BATCH, max_len=SEQ,
                      dtype=jnp.float32)
    # chunks of 7, 6, 1, 1, 5 tokens; width-7 chunks with fewer valid tokens are padded
    pieces, pos = [], 0
    for width, n in ((7, 7), (7, 6), (1, 1), (1, 1), (7, 5)):
        chunk = np.zeros((BATCH, width), np.int32)
        chunk[:, :n] = tokens[:, pos : pos + n]
        logits, cache = step(params, config, jnp.asarray(chunk), cache,
                             jnp.full((BATCH,), n, jnp.int32))
        pieces.append(np.asarray(logits)[:, :n])
        pos += n
    assert pos == SEQ
    np.testing.assert_array_equal(np.asarray(cache.lengths), [SEQ, SEQ])
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), one_shot, atol=1e-5, rtol=0)


def test_ragged_batch_rows_equal_single_rows(models):
    model, config, params = models["llama"]
    tokens = _tokens(seed=1)
    short = 13
    padded = tokens.copy()
    padded[1, short:] = 0
    cache = new_cache(config, CacheConfig(k="f32", v="f32"), batch=BATCH, max_len=SEQ,
                      dtype=jnp.float32)
    logits, cache = jit_forward(
        params, config, jnp.asarray(padded), cache, jnp.asarray([SEQ, short], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [SEQ, short])
    logits = np.asarray(logits)
    alone = np.asarray(logits_no_cache(params, config, tokens[1:, :short]))
    np.testing.assert_allclose(logits[1, :short], alone[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[0], _hf_logits(model, tokens[:1])[0], atol=TOL, rtol=0)


def test_save_pretrained_round_trip(tmp_path, models):
    model, config, _ = models["qwen3"]
    model = model.to(torch.bfloat16)
    # a small shard size forces the sharded (index.json) path
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    model.float()
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded_config, params, tokenizer = load_hf_dir(tmp_path, dtype=jnp.float32)
    assert loaded_config == config
    assert tokenizer is None
    expected = params_from_hf(
        {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, config,
        dtype=jnp.float32)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, expected)
    bf16 = load_hf_dir(tmp_path)[1]
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(bf16))


def test_load_single_file_checkpoint(tmp_path, models):
    model, config, params = models["llama"]
    model.save_pretrained(tmp_path)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    loaded_config, loaded, _ = load_hf_dir(tmp_path, dtype=jnp.float32)
    assert loaded_config == config
    assert context_length(tmp_path) == config.max_position_embeddings == 256
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded, params)


def test_params_from_hf_errors(models):
    model, config, _ = models["llama"]
    sd = dict(model.state_dict())
    missing = dict(sd)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        params_from_hf(missing, config)
    extra = dict(sd, **{"model.layers.0.self_attn.q_proj.bias": torch.zeros(96)})
    with pytest.raises(ValueError, match="does not use"):
        params_from_hf(extra, config)
    bad_layer = dict(sd, **{"model.layers.1.self_attn.k_proj.weight": torch.zeros(24, 64)})
    with pytest.raises(ValueError, match=r"k_proj.weight' has shape \(24, 64\), expected \(48,"):
        params_from_hf(bad_layer, config)
    wrong = dict(sd, **{"model.norm.weight": torch.ones(65)})
    with pytest.raises(ValueError, match=r"final_norm has shape \(65,\)"):
        params_from_hf(wrong, config)


def test_init_params_layout(models):
    for _, config, params in models.values():
        ours = jax.eval_shape(lambda k, c=config: init_params(k, c), jax.random.PRNGKey(0))
        assert jax.tree.structure(ours) == jax.tree.structure(params)
        assert jax.tree.map(jnp.shape, ours) == jax.tree.map(jnp.shape, params)


def _hf_dict(**overrides):
    base = FAMILIES["llama"]().to_dict()
    base.update(overrides)
    return json.loads(json.dumps(base))


def test_config_errors():
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_hf(_hf_dict(model_type="gpt2"))
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_hf(_hf_dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                      "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        ModelConfig.from_hf(_hf_dict(num_attention_heads=6, num_key_value_heads=4))
    with pytest.raises(ValueError, match="sliding window"):
        ModelConfig.from_hf(dict(FAMILIES["qwen2"]().to_dict(), use_sliding_window=True,
                                 sliding_window=8))
