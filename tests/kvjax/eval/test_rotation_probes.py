"""kvjax.eval.rotation_probes: ratios and interpolation at equal bits, the codec families,
the split configurations and the local 3x3 rounding against the full grid (the whole
protocol at tiny sizes: tests/experiments/test_octopus_synthetic.py)."""

import jax.numpy as jnp
import pytest

from kvjax.eval import rotation_probes as rp

D = 32


def test_ratios_and_equal_bits():
    rows = [
        {"codec": c, "family": rp.family(c), "b": rp.nominal(c), "bits": bits, "mse": mse,
         "ip_abs_err": ip, "per_seed": {"mse": [mse, mse], "ip_abs_err": [ip, ip]}}
        for c, bits, mse, ip in (("turboquant:b2", 2.125, 0.12, 3.0),
                                 ("turboquant:b3", 3.125, 0.03, 1.5),
                                 ("octopus:b2", 2.5, 0.06, 2.0),
                                 ("polarquant:b2", 2.125, 0.12, 3.0))]
    ratio = rp.metric_ratio(rows, "turboquant:b2", "octopus:b2", "mse")
    assert ratio["ratio"] == pytest.approx(2.0) and ratio["seed_min"] == ratio["seed_max"]
    assert rp.metric_ratio(rows, "turboquant:b9", "octopus:b2", "mse") is None
    (eq,) = [r for r in rp.equal_bits(rows) if r["codec"] == "octopus:b2"
             and r["metric"] == "mse"]
    # 0.12 -> 0.03 over one bit: 0.12 * 4 ** -0.375 at 2.5 bits, or 0.12 - 0.09 * 0.375
    assert eq["reference_value"] == pytest.approx(0.12 * 4 ** -0.375)
    assert eq["reference_linear"] == pytest.approx(0.12 - 0.09 * 0.375)
    assert eq["ratio"] == pytest.approx(0.06 / eq["reference_value"])
    assert rp.loglinear([(1, 1.0), (2, 4.0)], 3) is None
    assert rp.family("octopus:d3,n3") == "octopus-split"
    assert rp.family("octopus:d3,n1") == "octopus"
    assert rp.family("turboquant:b2,qjl") == "turboquant-qjl"


def test_split_configurations():
    configs = rp.split_configs()
    assert len(configs) == 15 and (2, -2, 0, 4) in configs and (4, 2, 6, 2) in configs
    assert rp.split_spec(4, 2) == "octopus:d4,n2"
    assert rp.equal_rate_splits(3) == [(3, 3), (4, 1)]


def test_grid_local_rounding_matches_the_full_grid():
    (row,) = rp.grid_part([3], head_dim=D, triplets=300, timing=False, norm_bits=[1])
    assert (row["direction_bits"], row["norm_bits"], row["triplets"]) == (3, 1, 300)
    assert row["identical"] == 1.0 and row["ratio"] == 1.0 and row["candidates_full"] == 64
    assert rp.grid_norm_bits(2) == [0, 2] and rp.grid_norm_bits(5) == [2, 3]
    t = rp.rotated_triplets(300, D, 0)
    assert t.shape == (300, 3) and float(jnp.max(jnp.abs(t))) < 1
