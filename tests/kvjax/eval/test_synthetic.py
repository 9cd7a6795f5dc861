"""Synthetic probes (kvjax.eval.synthetic): exact codecs are exact, error falls with bits,
bits are measured, the needle's mass matches a hand computation, runs are seeded, the
codec's own score path is what gets measured, block codecs get padded, bad input fails.

Every call compiles one program per (codec, sizes), so the tests use small sizes and
share results through a cache.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codecs import F32Codec, KiviCodec
from kvjax.eval import synthetic
from kvjax.eval.synthetic import needle, needle_mass, needle_problem, reconstruction
from kvjax.spec import parse_codec, registered

SMALL = {"head_dim": 64, "keys": 64, "queries": 4, "seeds": 2}
SMALL_NEEDLE = {"head_dim": 16, "distractors": 63, "seeds": 4}


@functools.cache
def rec(spec, **sizes):
    return reconstruction(spec, **{**SMALL, **sizes})


@functools.cache
def hay(spec, **sizes):
    return needle(spec, **{**SMALL_NEEDLE, **sizes})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroScoresF32(F32Codec):
    """Exact storage whose score path answers 0 for every key."""

    def scores(self, params, q, codes):
        return jnp.zeros((*q.shape[:-1], codes["x"].shape[-2]), jnp.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroScoresKivi(KiviCodec):
    """KIVI keys (blocks of ``group`` tokens) whose score path answers 0 for every key."""

    def scores(self, params, q, codes):
        tokens = codes["codes"].shape[-3] * codes["codes"].shape[-2]
        return jnp.zeros((*q.shape[:-1], tokens), jnp.float32)


def test_exact_codecs_reconstruct():
    f32, bf16 = rec("f32"), rec("bf16")
    assert f32["cosine"] == 1.0 and f32["mse"] == 0.0 and f32["ip_abs_err"] < 1e-5
    assert bf16["cosine"] > 0.99999 and bf16["mse"] < 1e-5
    # bf16 keeps 8 bits of mantissa: relative error ~2**-9 of |q.k| ~ sqrt(D)
    assert 0 < bf16["ip_abs_err"] < 0.05
    assert f32["bits_per_element"] == 32.0 and bf16["bits_per_element"] == 16.0


def test_error_falls_with_bits():
    results = [rec(f"int:{bits}") for bits in (2, 4, 8)]
    for metric in ("mse", "ip_abs_err"):
        values = [r[metric] for r in results]
        assert values[0] > values[1] > values[2] > 0, (metric, values)
    cosines = [r["cosine"] for r in results]
    assert cosines[0] < cosines[1] < cosines[2] < 1


def test_measured_bits_equal_formula_int4():
    r = reconstruction("int:4", head_dim=128, keys=32, queries=1, seeds=1)
    assert r["bits_per_element"] == r["bits_per_element_formula"] == 4.25


def test_summary_shapes_and_std():
    r = rec("int:4")
    assert len(r["per_seed"]["mse"]) == SMALL["seeds"]
    assert r["mse"] == pytest.approx(np.mean(r["per_seed"]["mse"]))
    assert r["mse_std"] == pytest.approx(np.std(r["per_seed"]["mse"]))
    assert r["mse_median"] == pytest.approx(np.median(r["per_seed"]["mse"]))
    assert r["codec"] == "int:4" and r["keys"] == 64


def test_needle_exact_keys_match_reference():
    r = hay("f32")
    assert r["mass"] == pytest.approx(r["reference"], rel=1e-6)
    assert r["ratio"] == pytest.approx(1.0, rel=1e-6)
    assert all(0 < m <= 1 for m in r["per_seed"]["mass"])
    assert r["keys"] == SMALL_NEEDLE["distractors"] + 1


def test_needle_mass_by_hand():
    # two keys e1, e2 in D=2, query 2 e1: logits 2/sqrt(2) and 0
    mass, top1 = needle_mass(jnp.array([2.0, 0.0]) / math.sqrt(2), 0)
    assert float(mass) == pytest.approx(1 / (1 + math.exp(-math.sqrt(2))), rel=1e-6)
    assert bool(top1)
    mass, top1 = needle_mass(jnp.array([0.0, 0.0, 0.0]), 1)
    assert float(mass) == pytest.approx(1 / 3) and not bool(top1)


def test_needle_matches_a_hand_computation():
    # one distractor, D=4: redo every trial in numpy from the documented draws
    seed, seeds, noise, d = 7, 3, 0.5, 4
    r = needle("f32", head_dim=d, distractors=1, noise=noise, seeds=seeds, seed=seed)
    for s in range(seeds):
        data, _, _ = synthetic._trial_keys(seed, s)
        keys, q, pos = map(np.asarray, needle_problem(data, 1, d, noise))
        e = q - keys[pos]
        assert np.linalg.norm(e) == pytest.approx(noise * np.linalg.norm(keys[pos]), rel=1e-5)
        logits = keys.astype(np.float64) @ q / math.sqrt(d)
        expected = math.exp(logits[pos]) / np.exp(logits).sum()
        assert r["per_seed"]["mass"][s] == pytest.approx(expected, rel=1e-5)
        assert r["per_seed"]["top1"][s] == bool(logits[pos] >= logits[1 - pos])


def test_runs_are_seeded():
    a, b = rec("int:4"), reconstruction("int:4", **SMALL)
    assert a == b
    c = reconstruction("int:4", **SMALL, seed=1)
    assert c["mse"] != a["mse"] and c["ip_abs_err"] != a["ip_abs_err"]
    n1, n2 = hay("int:4"), needle("int:4", **SMALL_NEEDLE)
    assert n1 == n2
    assert needle("int:4", **SMALL_NEEDLE, seed=1)["per_seed"]["mass"] != n1["per_seed"]["mass"]


def test_score_path_is_measured():
    # exact codes, zero scores: decode-then-dot would report no error and the reference mass
    r = reconstruction(ZeroScoresF32(), **SMALL)
    assert r["cosine"] == 1.0 and r["mse"] == 0.0
    # |q.k| of Gaussian q, k has mean sqrt(2 D / pi)
    assert r["ip_abs_err"] == pytest.approx(math.sqrt(2 * SMALL["head_dim"] / math.pi), rel=0.1)
    n = needle(ZeroScoresF32(), **SMALL_NEEDLE)
    assert n["mass"] == pytest.approx(1 / (SMALL_NEEDLE["distractors"] + 1), rel=1e-6)
    assert n["reference"] == hay("f32")["reference"]


def test_kivi_reconstruction_pads_blocks():
    r = rec("kivi:2,g32", keys=40)  # 40 keys: the last block of 32 is padded
    assert r["bits_per_element"] == r["bits_per_element_formula"] == 3.0
    assert 0.85 < r["cosine"] < 0.99
    full = rec("kivi:2,g32")
    assert 0.85 < full["cosine"] < 0.99


def test_kivi_needle_pads_outside_the_softmax():
    n = hay("kivi:2,g32", distractors=40)  # 41 keys in 2 blocks of 32
    assert 0 < n["mass"] <= 1 and n["keys"] == 41
    assert 0 < n["ratio"] < 1.05
    # padding rows stay out of the softmax: 41 equal scores, not 64
    zero = needle(ZeroScoresKivi(bits=2, group=32), **{**SMALL_NEEDLE, "distractors": 40})
    assert zero["mass"] == pytest.approx(1 / 41, rel=1e-6)


@pytest.mark.parametrize("name", sorted(registered()))
def test_every_registered_codec_runs(name):
    # the first of the examples the codec declares (the conformance suite requires some)
    codec = parse_codec(registered()[name].examples[0].spec)
    r = reconstruction(codec, head_dim=32, keys=64, queries=2, seeds=1)
    assert 0 < r["cosine"] <= 1 + 1e-6 and np.isfinite(r["ip_abs_err"])
    assert r["bits_per_element"] == pytest.approx(r["bits_per_element_formula"])


@pytest.mark.parametrize(
    ("fn", "kwargs"),
    [
        (reconstruction, {"keys": 0}),
        (reconstruction, {"queries": 0}),
        (reconstruction, {"seeds": 0}),
        (reconstruction, {"keys": 2.5}),
        (reconstruction, {"head_dim": 0}),
        (reconstruction, {"seed": -1}),
        (needle, {"seeds": 0}),
        (needle, {"noise": -0.1}),
        (needle, {"noise": float("nan")}),
        (needle, {"noise": "0.1"}),
        (needle, {"distractors": -1}),
        (needle, {"head_dim": 0}),
    ],
)
def test_bad_inputs_raise(fn, kwargs):
    with pytest.raises(ValueError):
        fn("int:4", **kwargs)


def test_bad_spec_raises():
    with pytest.raises(ValueError, match="unknown codec"):
        reconstruction("nope:3")


def test_traced_trial_keys_match_eager():
    # the scan derives keys from traced indices; the hand computation above from ints
    data = jax.jit(lambda s: jax.random.key_data(synthetic._trial_keys(7, s)[0]))(jnp.uint32(2))
    np.testing.assert_array_equal(data, jax.random.key_data(synthetic._trial_keys(7, 2)[0]))
