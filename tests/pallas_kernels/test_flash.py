"""The blocking every decode kernel shares (:mod:`pallas_kernels.flash`); the loop itself
is tested through each kernel's entry against its reference."""

from __future__ import annotations

from pallas_kernels import flash


def test_default_blocking():
    assert flash.default_blocking(None, None) == (128, 3)
    assert flash.default_blocking(32, 4) == (32, 4)


def test_default_splits():
    # waves of 1056 programs of 2 warps
    assert flash.default_splits(1, 8, 1 << 17, 128) == 119     # 952 programs: 0.90 of a wave
    assert flash.default_splits(32, 8, 1 << 15, 128) == 4      # 1024
    assert flash.default_splits(32, 8, 1 << 15, 128, num_warps=4) == 2    # 512 of 528
    assert flash.default_splits(200, 8, 1 << 15, 128) == 1
    assert flash.default_splits(1, 8, 100, 64) == 2            # no more splits than blocks
    for warps in (2, 4):
        wave = flash.SMS * flash.WARPS_PER_SM // warps
        for batch in range(1, 80):
            for heads in (3, 8):
                programs = batch * heads * flash.default_splits(batch, heads, 1 << 20, 64, warps)
                waves = -(-programs // wave)
                assert programs / (waves * wave) >= 0.75, (batch, heads)
