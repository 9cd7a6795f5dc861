"""The params layouts of :mod:`models.llama`: stacked over layers or one dict per layer,
the projections separate or fused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.llama import (
    check_params,
    fuse_projections,
    init_params,
    is_fused,
    layer_params,
    logits_no_cache,
    stack_layers,
    unstack_layers,
)

CONFIG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                     max_position_embeddings=32)


@pytest.fixture(scope="module")
def params():
    return init_params(jax.random.key(0), CONFIG)


def test_per_layer_params_round_trip_and_check(params):
    per_layer = unstack_layers(params)
    assert isinstance(per_layer["layers"], tuple) and len(per_layer["layers"]) == 3
    assert unstack_layers(per_layer) is per_layer
    check_params(per_layer, CONFIG)
    for i in range(3):
        for name, leaf in layer_params(params, i).items():
            np.testing.assert_array_equal(per_layer["layers"][i][name], leaf)
            np.testing.assert_array_equal(layer_params(per_layer, i)[name], leaf)
    restacked = stack_layers(per_layer)
    for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    numpy_stack = stack_layers(jax.tree.map(np.asarray, per_layer))
    assert isinstance(numpy_stack["layers"]["wq"], np.ndarray)


def test_check_params_names_per_layer_problems(params):
    layers = unstack_layers(params)["layers"]
    with pytest.raises(ValueError, match="2 per-layer dicts, expected 3"):
        check_params({**params, "layers": layers[:2]}, CONFIG)
    broken = dict(layers[1])
    broken["wq"] = broken["wq"][:, :4]
    with pytest.raises(ValueError, match=r"layers\.1\.wq has shape \(32, 4\)"):
        check_params({**params, "layers": (layers[0], broken, layers[2])}, CONFIG)
    with pytest.raises(ValueError, match=r"missing layers\.2\.wo"):
        check_params({**params, "layers": (layers[0], layers[1],
                                           {k: v for k, v in layers[2].items() if k != "wo"})},
                     CONFIG)


def test_per_layer_forward_equals_stacked(params):
    tokens = np.arange(12).reshape(2, 6) % CONFIG.vocab_size
    np.testing.assert_allclose(logits_no_cache(unstack_layers(params), CONFIG, tokens),
                               logits_no_cache(params, CONFIG, tokens), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_give_the_same_logits(bias):
    config = dataclasses.replace(CONFIG, attention_bias=bias, qk_norm=bias)
    stacked = init_params(jax.random.key(1), config)
    if bias:  # init_params leaves biases at zero: make them count
        stacked["layers"] = {**stacked["layers"], **{
            name: jax.random.normal(jax.random.key(i), stacked["layers"][name].shape)
            for i, name in enumerate(("bq", "bk", "bv"))}}
    tokens = np.arange(12).reshape(2, 6) % config.vocab_size
    want = logits_no_cache(stacked, config, tokens)
    for params in (stacked, unstack_layers(stacked)):
        fused = fuse_projections(params)
        assert is_fused(fused) and not is_fused(params)
        assert fuse_projections(fused) is fused
        check_params(fused, config)
        layer = layer_params(fused, 1)
        assert "wq" not in layer and "w_gate" not in layer and ("b_qkv" in layer) == bias
        np.testing.assert_array_equal(layer["w_qkv"][:, :32], layer_params(params, 1)["wq"])
        # one wider matmul may sum in another order: float32 rounding apart, equal
        np.testing.assert_allclose(logits_no_cache(fused, config, tokens), want, rtol=1e-5,
                                   atol=1e-5)


def test_check_params_names_fused_problems(params):
    fused = unstack_layers(fuse_projections(params))
    broken = dict(fused["layers"][0])
    broken["w_gate_up"] = broken["w_gate_up"][:, :64]
    with pytest.raises(ValueError, match=r"layers\.0\.w_gate_up has shape \(32, 64\)"):
        check_params({**fused, "layers": (broken, *fused["layers"][1:])}, CONFIG)
    with pytest.raises(ValueError, match=r"unexpected layers\.wq"):
        stacked = fuse_projections(params)
        check_params({**stacked, "layers": {**stacked["layers"],
                                            "wq": params["layers"]["wq"]}}, CONFIG)


def test_relayout_on_the_host_gives_the_layout_and_frees_the_device_copies(monkeypatch):
    from models import llama as ll

    config = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         max_position_embeddings=32)
    params = ll.init_params(jax.random.PRNGKey(0), config, jnp.bfloat16)
    want = jax.tree.map(np.asarray, ll.decode_layout(params))
    # on the CPU the layout is made in place; a GPU's path, taken here on the CPU
    assert ll._one_gpu(jax.tree.leaves(params)) is None
    device = jax.devices()[0]
    monkeypatch.setattr(ll, "_one_gpu", lambda arrays: device)
    got = ll.relayout(params)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(params))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.devices() == {device}
        np.testing.assert_array_equal(np.asarray(a), b)
