"""kvjax.eval.lattice_rates: the formulas and helpers of the rate measurements (the whole
protocol at tiny sizes: tests/experiments/test_hyperquant_tables.py)."""

import math

import numpy as np
import pytest

from kvjax.eval import lattice_rates as lr
from kvjax.primitives.lattices import lattice


def test_helpers():
    assert lr.entropy_bits(np.array([5, 5, 5, 5])) == pytest.approx(2.0)
    assert lr.entropy_bits(np.array([7, 0])) == 0.0
    assert lr.granular_gain_db(1 / 12) == 0.0
    assert [lr.pinned_bits(lattice(n)) for n in lr.LATTICE_ORDER] == [1.0, 0.25, 0.5, 0.0]
    assert lr.raw_classes(lattice("a2")) == (0, 1)
    assert lr.target_rates(15)[0] == 1.5 and lr.target_rates(15)[-1] == 5.0
    assert len(lr.target_rates(15)) == 15
    assert lr.rd_rate(10 * math.log10(4.0)) == pytest.approx(1.0)
