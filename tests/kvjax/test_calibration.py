"""Fitted codec parameters: fits per (layer, K|V), checkpoints, and caches that use them."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax import calibration as cal
from kvjax.checkpoint import METADATA_FILE, CheckpointError
from kvjax.spec import parse_cache, parse_codec

LAYERS, HEADS, TOKENS, DIM = 3, 2, 96, 32
SPEC = "k=saw:h32,c16,hess v=saw:h32,kv,c1 layers[1]:kv=int:4"


@pytest.fixture(scope="module")
def activations():
    rng = np.random.default_rng(0)
    shape = (LAYERS, HEADS, TOKENS, DIM)
    keys = rng.standard_normal(shape).astype(np.float32) + np.linspace(-3, 3, DIM)
    values = rng.standard_normal(shape).astype(np.float32)
    queries = rng.standard_normal((LAYERS, HEADS, 50, DIM)).astype(np.float32)
    queries *= np.linspace(3, 0.1, DIM)
    moment = np.einsum("lkmd,lkme->lkde", queries, queries)
    return cal.Activations(keys=keys, values=values, query_moment=moment)


@pytest.fixture(scope="module")
def fitted(activations):
    return cal.fit_cache(parse_cache(SPEC), activations, key=jax.random.PRNGKey(0),
                         metadata={"corpus": "test"})


def test_activations_check_their_shapes():
    with pytest.raises(ValueError, match="one shape"):
        cal.Activations(keys=np.zeros((1, 2, 3, 4)), values=np.zeros((1, 2, 3, 5)),
                        query_moment=np.zeros((1, 2, 4, 4)))
    with pytest.raises(ValueError, match="query_moment must be"):
        cal.Activations(keys=np.zeros((1, 2, 3, 4)), values=np.zeros((1, 2, 3, 4)),
                        query_moment=np.zeros((1, 2, 3, 3)))


def test_only_codecs_that_need_it_are_fitted_each_head_on_its_own_data(fitted, activations):
    assert fitted.codecs == {"k": ("saw:h32,b4,c16,hess", None, "saw:h32,b4,c16,hess"),
                             "v": ("saw:h32,b4,kv,c1", None, "saw:h32,b4,kv,c1")}
    assert fitted.params["k"][1] is None and fitted.metadata == {"corpus": "test",
                                                                 "tokens": TOKENS}
    k_codec, v_codec = parse_codec("saw:h32,c16,hess"), parse_codec("saw:h32,kv,c1")
    for layer in (0, 2):
        for head in range(HEADS):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
                jax.random.PRNGKey(0), layer), 0), head)
            alone = k_codec.fit(key, activations.keys[layer, head],
                                activations.query_moment[layer, head])
            for name, array in alone.items():
                np.testing.assert_allclose(fitted.params["k"][layer][name][head], array,
                                           rtol=1e-5, atol=1e-5)
            # c1 of V is the mean of the rotated values, with no query moment
            v = fitted.params["v"][layer]
            rotated = v_codec.rotate(jax.tree.map(lambda a: a[head], v),  # noqa: B023
                                     activations.values[layer, head])
            np.testing.assert_allclose(v["centroids"][head, 0], rotated.mean(0), atol=1e-5)


def test_a_fit_is_determined_by_its_key(fitted, activations):
    again = cal.fit_cache(parse_cache(SPEC), activations, key=jax.random.PRNGKey(0),
                          metadata={"corpus": "test"})
    assert cal.fitted_arrays_equal(again, fitted)
    other = cal.fit_cache(parse_cache(SPEC), activations, key=jax.random.PRNGKey(1))
    assert not cal.fitted_arrays_equal(other, fitted)


def test_nothing_to_fit_is_an_error(activations):
    with pytest.raises(ValueError, match="no codec of cache 'int:4'"):
        cal.fit_cache(parse_cache("int:4"), activations, key=jax.random.PRNGKey(0))


def test_a_fit_saves_and_loads_bit_for_bit(tmp_path, fitted):
    written = cal.save_fitted(tmp_path / "f", fitted)
    assert written > 0
    back = cal.load_fitted(tmp_path / "f")
    assert cal.fitted_arrays_equal(back, fitted)
    assert back.shape == (LAYERS, HEADS, DIM) and back.metadata["corpus"] == "test"
    other = dataclasses.replace(fitted, params={**fitted.params, "v": (
        jax.tree.map(lambda a: a + 1, fitted.params["v"][0]), *fitted.params["v"][1:])})
    assert not cal.fitted_arrays_equal(other, fitted)


@pytest.mark.parametrize("change, message", [
    (lambda m: m["codecs"]["k"].__setitem__(0, "saw:h32,b4,c256,hess"), "should be"),
    (lambda m: m["codecs"]["v"].pop(), "one entry per layer"),
    (lambda m: m["codecs"]["k"].__setitem__(0, None), "no codec takes"),
])
def test_a_fit_whose_record_does_not_match_its_arrays_is_refused(tmp_path, fitted, change,
                                                                  message):
    cal.save_fitted(tmp_path / "f", fitted)
    file = tmp_path / "f" / METADATA_FILE
    record = json.loads(file.read_text())
    change(record["metadata"])
    file.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=message):
        cal.load_fitted(tmp_path / "f")


def _cache(spec, **kw):
    config = parse_cache(spec)
    if config.fit and "fitted" not in kw:
        kw["fitted"] = cal.fitted_of(config)
    return kc.init_cache(jax.random.PRNGKey(5), config, num_layers=LAYERS,
                         batch=1, num_kv_heads=HEADS, head_dim=DIM, max_len=16,
                         dtype=jnp.float32, **kw)


def test_a_cache_reads_the_fit_its_spec_names(tmp_path, fitted, activations):
    cal.save_fitted(tmp_path / "f", fitted)
    cache = _cache(f"{SPEC} fit={tmp_path / 'f'}")
    direct = _cache(SPEC, fitted=fitted)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(direct), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(cache.layer(2).k.params["centroids"],
                                  fitted.params["k"][2]["centroids"])
    # the cache stores with the fitted centroids: its tokens decode as the codec does
    x = jnp.asarray(activations.keys[:, :, :16].transpose(0, 2, 1, 3)[None, 0])  # [1,16,K,D]
    step = kc.make_step(cache, 16)
    layer = kc.append(cache.layer(0), x, x, step)
    stored = kc.dense(layer.k, step.start + step.valid)[0, 0]
    codec = parse_codec("saw:h32,c16,hess")
    params = jax.tree.map(lambda a: a[0], fitted.params["k"][0])
    expected = codec.decode(params, codec.encode(params, x[0, :, 0]))
    np.testing.assert_allclose(stored, expected, rtol=1e-5, atol=1e-5)


def test_a_cache_refuses_a_missing_or_mismatched_fit(tmp_path, fitted):
    with pytest.raises(ValueError, match="add fit=DIR"):
        _cache(SPEC)
    with pytest.raises(ValueError, match="pass fitted="):
        _cache(f"{SPEC} fit={tmp_path / 'f'}", fitted=None)
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        _cache(f"{SPEC} fit={tmp_path / 'nowhere'}")
    with pytest.raises(ValueError, match="fitted for saw:h32,b4,c16,hess, the cache stores "
                                         "it as saw:h32,b4,c256,hess"):
        _cache("k=saw:h32,c256,hess v=saw:h32,kv,c1 layers[1]:kv=int:4", fitted=fitted)
    with pytest.raises(ValueError, match="fitted for no codec"):
        _cache("k=saw:h32,c16,hess v=saw:h32,kv,c1", fitted=fitted)
    with pytest.raises(ValueError, match=r"for \[layers, kv heads, head dim\]"):
        kc.init_cache(jax.random.PRNGKey(5), parse_cache(SPEC), num_layers=LAYERS, batch=1,
                      num_kv_heads=1, head_dim=DIM, max_len=16, fitted=fitted)


def test_a_rewritten_fit_is_read_again(tmp_path, fitted, activations):
    path = tmp_path / "f"
    cal.save_fitted(path, fitted)
    config = parse_cache(f"{SPEC} fit={path}")
    assert cal.fitted_arrays_equal(cal.fitted_of(config), fitted)
    refit = cal.fit_cache(parse_cache(SPEC), activations, key=jax.random.PRNGKey(1))
    cal.save_fitted(path, refit, overwrite=True)
    assert cal.fitted_arrays_equal(cal.fitted_of(config), refit)


def test_a_fitted_rotation_reaches_the_fused_kernel(tmp_path):
    """A decode step of a tiny llama whose K and V are stored with fitted query-aware
    bases: the int kernel (interpret mode) rotates the query by the fitted basis and
    agrees with the reference attention."""
    from models import llama
    from models.config import ModelConfig
    from models.evaluate import collect_activations

    config = ModelConfig(family="llama", vocab_size=64, hidden_size=128,
                         intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=64, max_position_embeddings=64)
    params = llama.init_params(jax.random.key(0), config)
    text = jax.random.randint(jax.random.key(5), (2, 32), 0, config.vocab_size)
    spec = "saw:h64,kv,hess window=4"
    fit = cal.fit_cache(parse_cache(spec), collect_activations(params, config, text),
                        key=jax.random.PRNGKey(0))
    basis = np.asarray(fit.params["k"][0]["basis"][0])
    assert not np.allclose(basis, np.eye(64), atol=1e-2)  # the fit moved it
    cal.save_fitted(tmp_path / "fit", fit)
    prompt = jax.random.randint(jax.random.key(1), (2, 21), 0, config.vocab_size)
    logits = {}
    for impl in ("reference", "int_decode,reference"):
        cache_config = parse_cache(f"{spec} attn={impl} fit={tmp_path / 'fit'}")
        cache = llama.new_cache(config, cache_config, batch=2, max_len=32, dtype=jnp.float32)
        _, cache = llama.jit_forward(params, config, prompt, cache, jnp.array([21, 13]))
        step_logits, _ = llama.jit_forward(params, config, prompt[:, :1], cache, None)
        logits[impl] = np.asarray(step_logits)
    scale = np.max(np.abs(logits["reference"]))
    np.testing.assert_allclose(logits["int_decode,reference"], logits["reference"],
                               atol=1e-2 * scale)
    assert not np.array_equal(logits["int_decode,reference"], logits["reference"])
