"""The dense decode-attention kernel's entry against its pure-jnp reference (the kernel
suite), and through the attention adapter over bf16 caches.

Tolerance: the kernel rounds the query and the probabilities to the values' 16-bit
type (bfloat16: 8 significant bits, against float16's 11 for the other kernels) and
accumulates in float32: 8e-3 of the outputs, which are O(1) here.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import fused
from kvjax.spec import parse_codec
from pallas_kernels.dense_decode import api, reference
from tests.pallas_kernels.suite import KernelSuite, PagedSuite, Shape, layer_stacks


@dataclasses.dataclass(frozen=True)
class Case(Shape):
    """One call of the entry: shapes, the storage type, blocking, stacked layers."""

    lengths: tuple[int, ...]
    dtype: str = "bfloat16"
    layers: int | None = None  # values stacked over this many layers; layer 1 is read
    block_s: int | None = 32
    splits: int | None = 2

    @property
    def id(self) -> str:
        return "-".join(filter(None, [
            self.shape_id, self.dtype, f"bs{self.block_s}", f"sp{self.splits}",
            "n" + ",".join(map(str, self.lengths)), f"L{self.layers}" * bool(self.layers)]))


CASES = (
    # S not a multiple of the block, GQA 4, ragged rows and an empty one
    Case(3, 2, 4, 100, 128, (100, 33, 0), splits=3),
    # GQA 1 and 7, float16, the library's default blocking and splits
    Case(1, 1, 1, 40, 64, (40,), dtype="float16", block_s=None, splits=None),
    Case(2, 1, 7, 70, 128, (70, 9)),
    # a stack of layers read in place
    Case(2, 2, 4, 64, 64, (64, 40), layers=3, block_s=16),
)


def stored(case: Case, seed: int) -> tuple[jax.Array, jax.Array]:
    """Keys and values ``[B, K, S, D]`` in the case's storage type."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    shape = (case.batch, case.heads, case.slots, case.head_dim)
    return (jax.random.normal(k1, shape).astype(case.dtype),
            jax.random.normal(k2, shape).astype(case.dtype))


class TestDenseDecode(PagedSuite, KernelSuite):
    entry = staticmethod(api.dense_decode)
    reference = staticmethod(reference.dense_decode)
    CASES = CASES
    UNSUPPORTED = (
        (Case(1, 1, 4, 16, 128, (16,), dtype="float32"), "it reads bfloat16 or float16"),
        (Case(1, 1, 4, 16, 96, (16,)), "head_dim 96"),
    )
    DROP = (Case(1, 1, 4, 64, 128, (64,)), [48])
    TOLERANCE: ClassVar[dict[str, float]] = {"out": 8e-3, "lse": 8e-3}
    IMPL = "dense_decode"
    NEEDLE_SPECS = ("bf16", "bf16 window=16 sinks=4 page=64")  # the second through pages
    PAGED_ARRAYS: ClassVar[dict[str, int]] = {"keys": 1, "values": 1}

    def inputs(self, case: Case) -> dict:
        q = jax.random.normal(jax.random.key(9),
                              (case.batch, case.heads, case.group, case.head_dim))
        keys, values, layer = layer_stacks(stored, case)
        return {"q": q, "keys": keys, "values": values,
                "lengths": jnp.asarray(case.lengths, jnp.int32), "layer": layer,
                "sm_scale": case.head_dim**-0.5, "block_s": case.block_s,
                "splits": case.splits}

    def lengths(self, case: Case) -> list[int]:
        return list(case.lengths)

    def test_malformed_arrays_raise_value_errors(self):
        kw = self.inputs(CASES[0])
        for name, bad, match in (
                ("keys", kw["keys"][..., :-1], "keys must be"),
                ("values", kw["values"][:, :, :-1], "values must match keys"),
                ("values", kw["values"].astype(jnp.float16), "values must match keys"),
                ("lengths", kw["lengths"][:2], "lengths must be integers of shape"),
                ("q", kw["q"][0], "q must be")):
            with pytest.raises(ValueError, match=match):
                api.dense_decode(**{**kw, name: bad})


@pytest.mark.parametrize("k,v,reason", [
    ("bf16", "int:4", "V 'int:4' does not store its vectors as they are"),
    ("f32", "f32", "it reads bfloat16 or float16"),
])
def test_which_caches_it_reads(k, v, reason):
    assert reason in fused.dense_reads(parse_codec(k), parse_codec(v), 128,
                                       unsupported=api.unsupported)


def test_kernel_call_binds_a_bf16_cache():
    call = fused.kernel_call(parse_codec("bf16"), parse_codec("bf16"), batch=2, heads=2,
                             slots=48, head_dim=64, key=jax.random.key(0))
    assert call.name == "dense_decode"
    assert call.read_bytes == 2 * 2 * 2 * 48 * 64 * 2
    q = jax.random.normal(jax.random.key(1), (2, 2, 4, 64))
    o, _, l = call(q)
    ref = reference.dense_decode(q, **call.arrays, **call.static)
    np.testing.assert_allclose(o / l[..., None], ref[0] / ref[2][..., None], atol=8e-3)
