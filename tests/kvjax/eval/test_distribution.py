"""Tests of kvjax.eval.distribution and of the distribution metrics that perplexity
computes against a reference cache."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.eval import perplexity
from kvjax.eval.distribution import position_edges, summarize, token_divergence
from kvjax.spec import CacheConfig, parse_cache
from tests.kvjax.eval.test_ppl import F32, direct_nll, model_fns, params, wins  # noqa: F401


def test_token_divergence_by_hand():
    ref = jnp.log(jnp.asarray([[[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]]))
    got = jnp.log(jnp.asarray([[[0.25, 0.5, 0.25], [0.1, 0.2, 0.7]]]))
    kl, agree = token_divergence(ref, got + 3.0)  # a shift of the logits changes nothing
    want = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    np.testing.assert_allclose(np.asarray(kl), [[want, 0.0]], atol=1e-6)
    assert np.asarray(agree).tolist() == [[False, True]]
    # KL is not symmetric in general; here both ways are equal by symmetry of the swap
    back, _ = token_divergence(got, ref)
    np.testing.assert_allclose(np.asarray(back)[0, 0], want, atol=1e-6)


def test_token_divergence_is_nonnegative_on_random_logits():
    a, b = jax.random.normal(jax.random.key(0), (2, 3, 5, 50)) * 4
    kl, _ = token_divergence(a, b)
    assert float(kl.min()) >= 0 and float(kl.max()) > 0.1
    same, agree = token_divergence(a, a)
    assert float(jnp.max(same)) < 1e-5 and bool(agree.all())


@pytest.mark.parametrize("length,edges", [
    (256, (0, 32, 64, 128, 256)), (8, (0, 1, 2, 4, 8)), (3, (0, 1, 3)), (1, (0, 1)),
])
def test_position_edges(length, edges):
    assert position_edges(length) == edges


def test_position_edges_rejects_empty():
    with pytest.raises(ValueError, match="positive"):
        position_edges(0)


def test_summarize_means_tails_and_buckets():
    kl = np.array([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 99.0],
                   [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 99.0]], np.float32)
    agree = np.array([[1, 1, 0, 0, 1, 1, 1, 0], [1] * 8], bool)
    scored = np.broadcast_to(np.arange(8) < 7, kl.shape)  # the last position is unscored
    m = summarize(kl, agree, scored)
    assert m.tokens == 14
    assert m.kl_mean == pytest.approx((21 + 7) / 14)
    assert m.kl_p99 == pytest.approx(np.percentile(kl[:, :7], 99))
    assert m.top1_agreement == pytest.approx(12 / 14)
    assert [(b.start, b.end, b.tokens) for b in m.by_position] == [
        (0, 1, 2), (1, 2, 2), (2, 4, 4), (4, 8, 6)]
    last = m.by_position[-1]
    assert last.kl_mean == pytest.approx((4 + 5 + 6 + 3) / 6)  # the 99s are not scored
    assert last.top1_agreement == pytest.approx(1.0)
    assert m.by_position[2].top1_agreement == pytest.approx(0.5)


def test_summarize_rejects_bad_input():
    with pytest.raises(ValueError, match="one shape"):
        summarize(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="no token"):
        summarize(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 3)))


def test_perplexity_against_a_reference_cache(params, wins):  # noqa: F811
    """The reference runs beside the cache: its perplexity is the reference's own, a
    cache equal to it has zero KL and full agreement, and a coarse cache has KL that the
    finer one beats."""
    forward, f32 = model_fns(params, F32)
    plain = perplexity(forward, f32, wins)
    assert plain.kl_mean is None and plain.reference_ppl is None and not plain.kl_by_position

    same = perplexity(forward, f32, wins, reference=f32)
    assert same.reference_ppl == pytest.approx(math.exp(direct_nll(params, wins)), rel=1e-5)
    assert same.kl_mean < 1e-6 and same.top1_agreement == 1.0

    results = {}
    for spec in ("int:2", "int:8"):
        _, coded = model_fns(params, parse_cache(spec))
        results[spec] = perplexity(forward, coded, wins, chunk=5, reference=f32)
    coarse, fine = results["int:2"], results["int:8"]
    assert coarse.reference_ppl == pytest.approx(same.reference_ppl, rel=1e-5)
    assert 0 < fine.kl_mean < coarse.kl_mean and fine.kl_p99 < coarse.kl_p99
    assert fine.top1_agreement >= coarse.top1_agreement
    assert coarse.kl_p99 >= coarse.kl_mean
    assert sum(b.tokens for b in coarse.kl_by_position) == coarse.tokens
    assert coarse.kl_by_position[0].start == 0


def test_reference_config_keeps_window_and_sinks():
    config = parse_cache("k=int:4 v=int:2 window=8 sinks=2 center=first")
    assert config.reference() == CacheConfig(k="bf16", residual_window=8, sink_tokens=2)
    assert config.reference().reference() == config.reference()
