"""Per-layer bit allocation: the exact knapsack, its spec, and bad input."""

import itertools

import numpy as np
import pytest

from kvjax.allocation import Sensitivity, allocate, allocation_spec
from kvjax.spec import parse_cache

BITS = {"k": (2.5, 4.5, 8.5), "v": (2.5, 4.5, 8.5)}


def _sensitivity(layers=3, seed=0):
    rng = np.random.default_rng(seed)
    loss = np.zeros((layers, 2, 3))
    loss[:, :, 0] = rng.random((layers, 2)) * 2
    loss[:, :, 1] = loss[:, :, 0] * rng.random((layers, 2)) * 0.5
    return Sensitivity(candidates=("int:2", "int:4", "int:8"), bits=BITS, loss=loss)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget", [2.5, 3.0, 3.5, 4.5, 6.0, 8.5])
def test_the_allocation_is_the_best_choice_within_the_budget(seed, budget):
    s = _sensitivity(seed=seed)
    found = allocate(s, budget)
    assert found.bits <= budget + 1e-12
    best = min(
        sum(s.loss[u // 2, u % 2, c] for u, c in enumerate(choice))
        for choice in itertools.product(range(3), repeat=6)
        if np.mean([BITS["k"][c] for c in choice]) <= budget + 1e-12)
    assert found.predicted == pytest.approx(best, abs=1e-12)
    config = parse_cache(found.spec)
    picked = [(k.spec, v.spec) for k, v in config.layer_codecs(3)]
    assert picked == [(f"int:{(2, 4, 8)[a]}", f"int:{(2, 4, 8)[b]}") for a, b in found.choice]


def test_the_spec_takes_the_most_common_codec_as_default():
    s = _sensitivity(layers=4)
    spec = allocation_spec(s, [(1, 0), (1, 0), (2, 0), (0, 2)])
    assert spec == "k=int:4 v=int:2 layers[3]:k=int:2 layers[2]:k=int:8 layers[3]:v=int:8"
    kivi = Sensitivity(candidates=("kivi:2,g32", "kivi:4,g32"),
                       bits={"k": (3.0, 5.0), "v": (3.0, 5.0)}, loss=np.zeros((3, 2, 2)))
    assert allocation_spec(kivi, [(0, 1), (0, 0), (0, 0)]) == (
        "k=kivi:2,g32 v=kivi:2,g32,token layers[0]:v=kivi:4,g32,token")


def test_sensitivities_round_trip_and_bad_input_is_refused(tmp_path):
    s = _sensitivity()
    assert s.save(tmp_path / "s", metadata={"model": "m"}) > 0
    back = Sensitivity.load(tmp_path / "s")
    assert back.candidates == s.candidates and back.bits == s.bits
    np.testing.assert_array_equal(back.loss, s.loss)
    with pytest.raises(ValueError, match="below the cheapest"):
        allocate(s, 2.0)
    with pytest.raises(ValueError, match=r"loss must be \[layers, 2, 3\]"):
        Sensitivity(candidates=("int:2", "int:4", "int:8"), bits=BITS, loss=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="finite"):
        Sensitivity(candidates=("int:2", "int:4", "int:8"), bits=BITS,
                    loss=np.full((1, 2, 3), np.nan))


def test_budgets_are_checked_and_a_huge_one_buys_every_dearest_choice():
    s = _sensitivity()
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        with pytest.raises(ValueError, match="finite number of bits"):
            allocate(s, bad)
    # no table of 1e12 bits: the dearest choice of every unit is the most it can spend
    found = allocate(s, 1e12)
    assert found.choice == ((2, 2),) * 3 and found.bits == 8.5
