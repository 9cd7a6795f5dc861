"""Tests of kvjax.eval.perplexity on a tiny random llama (CPU, float32)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.eval import perplexity
from kvjax.eval.ppl import continuation_perplexity
from kvjax.spec import CacheConfig, parse_cache, parse_codec
from models import llama
from models.config import ModelConfig

CONFIG = ModelConfig(family="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=64)
NUM_WINDOWS, WINDOW_LEN = 3, 23
JIT_FORWARD = llama.jit_forward


@pytest.fixture(scope="module")
def params():
    return llama.init_params(jax.random.PRNGKey(0), CONFIG, jnp.float32)


@pytest.fixture(scope="module")
def wins():
    rng = np.random.default_rng(0)
    return rng.integers(0, CONFIG.vocab_size, (NUM_WINDOWS, WINDOW_LEN), dtype=np.int32)


def model_fns(params, cache_config, dtype=jnp.float32):
    """The (forward, new_cache) pair that perplexity takes, for the tiny model."""
    def forward(tokens, cache, valid):
        return JIT_FORWARD(params, CONFIG, tokens, cache, valid)

    def new_cache(batch, max_len):
        return llama.new_cache(CONFIG, cache_config, batch=batch, max_len=max_len, dtype=dtype)

    return forward, new_cache


F32 = CacheConfig(k="f32", v="f32")


def test_exact_cache_matches_direct_nll(params, wins):
    expected_nll = direct_nll(params, wins)
    got = perplexity(*model_fns(params, F32), wins)
    assert got.tokens == NUM_WINDOWS * (WINDOW_LEN - 1)
    assert got.nll == pytest.approx(expected_nll, rel=1e-5)
    assert got.ppl == pytest.approx(math.exp(expected_nll), rel=1e-5)
    assert got.bits_per_element == pytest.approx(32.0)
    assert got.seconds > 0


def direct_nll(params, wins):
    """Mean next-token NLL of one plain float32 forward over each whole window."""
    logits = np.asarray(llama.logits_no_cache(params, CONFIG, wins), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp[:, :-1], wins[:, 1:, None].astype(np.int64), -1)
    return -picked.mean()


def test_bf16_cache_matches_plain_forward_to_bf16_rounding(params, wins):
    expected = direct_nll(params, wins)
    got = perplexity(*model_fns(params, CacheConfig(k="bf16", v="bf16"), jnp.bfloat16), wins)
    assert got.bits_per_element == 16.0
    # K/V rounded to bf16 (8 mantissa bits) move the NLL by ~2e-4 relative here; int:2
    # moves it by 3e-2
    assert got.nll == pytest.approx(expected, rel=1e-3)
    assert got.nll != expected


def test_chunked_equals_whole_window_for_exact_cache(params, wins):
    fns = model_fns(params, F32)
    whole = perplexity(*fns, wins)
    chunked = perplexity(*fns, wins, chunk=5)
    assert chunked.tokens == whole.tokens
    assert chunked.nll == pytest.approx(whole.nll, rel=1e-5)


def test_tokenwise_lossy_codec_bits_and_chunking(params, wins):
    codec = parse_codec("int:4")
    fns = model_fns(params, CacheConfig(k="int:4", v="int:4"))
    got = perplexity(*fns, wins, chunk=5)
    assert math.isfinite(got.ppl) and got.ppl > 1
    # a token-wise codec with no window encodes every token the moment it arrives, so
    # every query reads the same decoded keys whether the window came in chunks or not
    whole = perplexity(*fns, wins)
    assert got.nll == pytest.approx(whole.nll, rel=1e-6)
    # no residual window or sinks: every token is compressed, so bits equal the formula
    expected = codec.bits_per_element(CONFIG.head_dim)
    assert got.bits_per_element == pytest.approx(expected)
    assert got.k_bits_per_element == pytest.approx(expected)
    assert got.v_bits_per_element == pytest.approx(expected)


def test_window_and_raw_layer_are_counted(params, wins):
    config = parse_cache("int:4 window=4 layers[0]:k=bf16")
    # two batches (2 + 1 windows): the bits of both final caches are pooled
    got = perplexity(*model_fns(params, config, jnp.bfloat16), wins, batch_size=2)
    # window tokens (bf16) and the raw K layer cost more than the int:4 formula
    assert got.k_bits_per_element > got.v_bits_per_element > 6.0
    assert got.bits_per_element == pytest.approx(
        (got.k_bits_per_element + got.v_bits_per_element) / 2)


@pytest.mark.parametrize("bad, kw", [
    (np.zeros((0, 8), np.int32), {}),
    (np.zeros((2, 1), np.int32), {}),
    (np.zeros((8,), np.int32), {}),
    (np.zeros((2, 8), np.float32), {}),
    (np.zeros((2, 8), np.int32), {"chunk": 0}),
    (np.zeros((2, 8), np.int32), {"batch_size": 0}),
])
def test_bad_input_raises(bad, kw):
    def never(*_):
        raise AssertionError("must fail before running the model")

    with pytest.raises(ValueError):
        perplexity(never, never, bad, **kw)


def test_med_c_outlier_counts_are_reported(params, wins):
    plain = perplexity(*model_fns(params, CacheConfig(k="int:4", v="int:4")), wins)
    assert (plain.outlier_chunks, plain.outlier_overflow, plain.medc_chunks) == (0, 0, 0)
    assert plain.outlier_overflow_share is None
    # blocks of 4 tokens: 20 of each window's 23 compressed; K and V of 2 layers, 2 kv
    # heads, 4 chunks of 4 dims; one slot per block (3% of 16 chunks) at med1.5
    capped = perplexity(*model_fns(params, parse_cache("int:4,med1.5,mb4")), wins,
                        batch_size=2)
    assert capped.medc_chunks == NUM_WINDOWS * 20 * 2 * 2 * 2 * 4
    assert capped.outlier_chunks <= capped.medc_chunks // 16
    assert capped.outlier_overflow > 0 and capped.outlier_chunks > 0
    assert capped.outlier_overflow_share == pytest.approx(
        capped.outlier_overflow / (capped.outlier_chunks + capped.outlier_overflow))
    uncapped = perplexity(*model_fns(params, parse_cache("int:4,med1.5,mb4,mp100")), wins)
    assert uncapped.outlier_overflow == 0 and uncapped.outlier_overflow_share == 0.0
    assert uncapped.outlier_chunks > capped.outlier_chunks
    # 15 more fp16 chunk slots per block of 4 tokens x 16 dims, on 20 of 23 tokens
    assert uncapped.bits_per_element - capped.bits_per_element == pytest.approx(
        15 * 64 / (4 * 16) * 20 / 23)


# -- the continuation after a prefilled prompt ----------------------------------------


def continuation_fns(params, cache_config, context, window_len):
    from models.generate import prefill

    def fill(prompts):
        pre = prefill(params, CONFIG, prompts.tolist(), cache_config=cache_config,
                      max_len=window_len, room=window_len - context,
                      cache_dtype=jnp.float32)
        return pre.logits, pre.cache

    return fill, model_fns(params, cache_config)[0]


def test_continuation_scores_the_tokens_after_the_prompt_exactly(params, wins):
    context = 15
    fill, forward = continuation_fns(params, F32, context, WINDOW_LEN)
    got = continuation_perplexity(fill, forward, wins, context=context, batch_size=2,
                                  reference=fill)
    logits = np.asarray(llama.logits_no_cache(params, CONFIG, wins), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp[:, context - 1:-1],
                                wins[:, context:, None].astype(np.int64), -1)
    assert got.tokens == NUM_WINDOWS * (WINDOW_LEN - context)
    assert got.nll == pytest.approx(-picked.mean(), rel=1e-5)
    assert got.kl_mean == pytest.approx(0.0, abs=1e-6) and got.top1_agreement == 1.0
    assert got.sequence_bits_per_element == got.bits_per_element == 32.0


def test_continuation_after_an_eviction_counts_the_sequence_bits(params, wins):
    context = 16
    evict = parse_cache("f32 evict=streaming:4,s1")
    fill, forward = continuation_fns(params, evict, context, WINDOW_LEN)
    reference = continuation_fns(params, F32, context, WINDOW_LEN)[0]
    got = continuation_perplexity(fill, forward, wins, context=context,
                                  reference=reference)
    assert got.kl_mean > 1e-4 and got.reference_ppl != got.ppl
    # stored: 4 kept prompt tokens and the 6 fed after them (the last token is only a
    # target), over a sequence of 16 + 6
    assert got.bits_per_element == 32.0
    assert got.sequence_bits_per_element == pytest.approx(32.0 * 10 / 22)


@pytest.mark.parametrize(("context", "message"), [(0, "context must be"),
                                                  (WINDOW_LEN, "context must be")])
def test_continuation_rejects_a_context_that_leaves_nothing(params, wins, context, message):
    fill, forward = continuation_fns(params, F32, 5, WINDOW_LEN)
    with pytest.raises(ValueError, match=message):
        continuation_perplexity(fill, forward, wins, context=context)
