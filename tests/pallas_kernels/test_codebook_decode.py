"""The fused codebook decode-attention kernel's entry against its pure-jnp reference
(the kernel suite), over arrays that TurboQuant (MSE and QJL) and KIVI's value codec
really store, and the pieces of its layout.

Tolerance: the suite's over rotated keys (:mod:`tests.pallas_kernels.rotated`); the
errors measured over the cases below, interpret mode, reach 1.3e-3 in the outputs and
4e-4 in the log-sum-exps.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kvjax.codec import CodebookFormat
from pallas_kernels.codebook_decode import api, reference
from tests.pallas_kernels.rotated import Case, RotatedSuite

CASES = (
    # 4-bit keys and values (32 columns per plane), GQA 4, ragged rows, 3 splits
    Case(3, 2, 4, 70, 128, "turboquant:b4", (70, 23, 0), splits=3),
    # split 3-bit keys and values, GQA 1 and 7, lengths off the block
    Case(1, 2, 1, 37, 128, "turboquant:b3", (37,)),
    Case(2, 1, 7, 41, 128, "turboquant:b3", (41, 17)),
    # 2-bit (16 columns) and 1-bit keys (bytes), narrow broadcast planes at D = 64, 32
    Case(2, 1, 4, 33, 128, "turboquant:b2", (33, 16), splits=1),
    Case(2, 2, 3, 29, 64, "turboquant:b2", (29, 5)),
    Case(2, 1, 4, 24, 32, "turboquant:b1", (24, 9)),
    # QJL: the estimator's term from G q and the sign bits (3- and 2-bit MSE stages)
    Case(2, 2, 4, 50, 128, "turboquant:b4,qjl", (50, 31)),
    Case(1, 1, 4, 45, 128, "turboquant:b3,qjl", (45,), splits=3),
    # a stack of layers read in place at a traced index, an empty row
    Case(2, 2, 4, 40, 64, "turboquant:b4", (40, 0), layers=3),
    # the library's default blocking and splits (S not a multiple of its 128-token block)
    Case(2, 1, 4, 130, 128, "turboquant:b3,qjl", (130, 1), block_s=None, splits=None),
)


class TestCodebookDecode(RotatedSuite):
    KEY_FORMAT = CodebookFormat
    entry = staticmethod(api.codebook_decode)
    reference = staticmethod(reference.codebook_decode)
    CASES = CASES
    UNSUPPORTED = (
        (Case(1, 1, 4, 20, 128, "turboquant:b5", (20,)), "5-bit key codes"),
        (Case(1, 1, 4, 20, 16, "turboquant:b4", (20,)), "head_dim 16 is not a power of two"),
    )
    DROP = (Case(1, 1, 4, 48, 128, "turboquant:b4", (48,)), [32])
    IMPL = "codebook_decode"
    NEEDLE_SPECS = ("turboquant:b4 window=16 sinks=4",
                    "turboquant:b3,qjl window=16 page=64")  # the second through pages

    def test_reference_agrees_with_the_codecs(self):
        """The reference's scores and values are the codecs' own: its partial equals the
        attention over ``decode`` (and QJL's ``scores``) of the same arrays."""
        got, want = self.reference_and_codecs(
            Case(2, 2, 4, 30, 128, "turboquant:b3,qjl", (30, 11)))
        np.testing.assert_allclose(got, want, atol=2e-4)


def test_unsupported_codes():
    assert "5-bit key codes" in api.unsupported(128, 4, 32, key_bits=5)
    assert "power of two" in api.unsupported(96, 4, 32, key_bits=4)
    assert "mix too finely" in api.unsupported(128, 4, 8, key_bits=4)
    assert api.unsupported(128, 3, 32, key_bits=3, magnitudes=(0.1,) * 4) is None


def test_malformed_arrays_raise():
    kw = api.random_inputs(jax.random.key(0), batch=1, heads=1, group=2, slots=8,
                           head_dim=128, key_bits=4, value_bits=4, qjl=True)
    static = {"key_bits": 4, "magnitudes": (0.1,) * 8, "value_bits": 4, "value_group": 32,
              "sm_scale": 0.1}
    with pytest.raises(ValueError, match="come together"):
        api.codebook_decode(**{**kw, "qjl_sketch": None}, **static)
    with pytest.raises(ValueError, match="k_norm must have shape"):
        api.codebook_decode(**{**kw, "k_norm": kw["k_norm"][..., :4]}, **static)
    with pytest.raises(ValueError, match="8 magnitudes"):
        api.codebook_decode(**kw, **{**static, "magnitudes": (0.1,) * 4})
