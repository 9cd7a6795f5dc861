"""The fused Rice decode-attention kernel's entry against its pure-jnp reference (the
kernel suite, over blocks the HyperQuant codec really stores), in the codec's rotated
frame, and through the attention adapter (rotation in and out).

Tolerance: the kernel rounds the query and the probabilities times the token factors
to float16 (the lattice codes are exact integers) and accumulates in float32: 3e-3 of
the outputs, which are O(1) here, as for the other kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.spec import parse_codec
from pallas_kernels.rice_decode import api, reference
from tests.pallas_kernels.suite import KernelSuite, PagedSuite, Shape

RICE = "hyperquant:e8,3bps"


@dataclasses.dataclass(frozen=True)
class Case(Shape):
    """One call of the entry: shapes, the codec, the data and blocking."""

    lengths: tuple[int, ...]
    spec: str = RICE
    #: "gauss", or "spiky": one coordinate x40 in every third token, so that blocks
    #: fall back to coarser scales and to signs
    data: str = "gauss"
    layers: int | None = None  # blocks stacked over this many layers; layer 1 is read
    block_s: int | None = 16
    splits: int | None = 2

    @property
    def id(self) -> str:
        return "-".join(filter(None, [
            f"{self.shape_id}-{self.spec.replace(':', '-').replace(',', '-')}", self.data,
            f"bs{self.block_s}", f"sp{self.splits}", "n" + ",".join(map(str, self.lengths)),
            f"L{self.layers}" * bool(self.layers)]))


def vectors(data: str, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Test vectors ``[..., S, D]`` of one kind (:class:`Case`)."""
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, shape)
    if data == "gauss":
        return x
    slots, head_dim = shape[-2:]
    spike = jnp.arange(slots)[:, None] % 3 == 0
    column = jax.random.randint(k2, (*shape[:-1], 1), 0, head_dim)
    return jnp.where(spike & (jnp.arange(head_dim) == column), 40.0 * x, x)


@functools.partial(jax.jit, static_argnames=("spec", "data", "batch", "heads", "group",
                                             "slots", "head_dim"))
def coded(spec, data, batch, heads, group, slots, head_dim, seed=0):
    """``(q, (k_stream, k_index, k_norm), (v_...))`` of vectors encoded by the codec,
    one parameter draw per kv head and role; ``q`` in the rotated frame (any vector
    is one)."""
    codec = parse_codec(spec)
    keys = jax.random.split(jax.random.key(seed), 5)
    out = [jax.random.normal(keys[0], (batch, heads, group, head_dim))]
    for i in range(2):
        params = jax.vmap(lambda k: codec.init(k, head_dim))(jax.random.split(keys[1 + i],
                                                                              heads))
        x = vectors(data, keys[3 + i], (batch, heads, slots, head_dim))
        codes = jax.vmap(codec.encode, in_axes=(0, 1), out_axes=1)(params, x)
        out.append((codes["stream"], codes["index"], codes["norm"]))
    return tuple(out)


CASES = (
    # D = 128: two sub-streams of 512 per block of 8, GQA 4, ragged rows, an empty one
    Case(3, 2, 4, 64, 128, (64, 21, 0), splits=3),
    # every fallback level (coarser scales, signs with their token scales)
    Case(2, 2, 4, 96, 128, (96, 50), data="spiky"),
    # GQA 1 and 7, 4 bps, the library's default blocking and splits
    Case(1, 1, 1, 40, 128, (40,), spec="hyperquant:e8,4bps", block_s=None, splits=None),
    Case(2, 1, 7, 48, 128, (48, 17), spec="hyperquant:e8,4bps"),
    # D = 64: one sub-stream per block
    Case(2, 2, 3, 32, 64, (32, 5), spec="hyperquant:e8,3.5bps"),
    # stacked layers read in place, four Rice blocks per step of the kernel
    Case(2, 2, 4, 64, 128, (64, 40), layers=3, block_s=32),
)


class TestRiceDecode(PagedSuite, KernelSuite):
    entry = staticmethod(api.rice_decode)
    reference = staticmethod(reference.rice_decode)
    CASES = CASES
    #: one entry per Rice block of 8 tokens
    PAGED_ARRAYS: ClassVar[dict[str, int]] = {
        f"{role}_{name}": api.RICE_BLOCK for role in "kv" for name in ("stream", "index",
                                                                       "norm")}
    UNSUPPORTED = (
        (Case(1, 1, 4, 16, 128, (16,), spec="hyperquant:d4,3bps"), "reads E8 streams"),
    )
    DROP = (Case(1, 1, 4, 48, 128, (48,)), [40])
    TOLERANCE: ClassVar[dict[str, float]] = {"out": 3e-3, "lse": 2e-3}
    IMPL = "rice_decode"
    NEEDLE_SPECS = (f"{RICE} window=16 sinks=4",)

    def inputs(self, case: Case) -> dict:
        def one(seed=0):
            return coded(case.spec, case.data, case.batch, case.heads, case.group,
                         case.slots, case.head_dim, seed)

        q, k, v = one()
        layer = None
        if case.layers:
            # other layers hold other codes: reading the wrong one cannot pass
            stacks = [one(seed)[1:] for seed in (1, 0, 2)[:case.layers]]
            k, v = (jax.tree.map(lambda *a: jnp.stack(a), *[s[r] for s in stacks])
                    for r in range(2))
            layer = jnp.int32(1)
        return {"q": q, "k_stream": k[0], "k_index": k[1], "k_norm": k[2],
                "v_stream": v[0], "v_index": v[1], "v_norm": v[2],
                "lengths": jnp.asarray(case.lengths, jnp.int32), "layer": layer,
                "layout": parse_codec(case.spec).rice_layout(case.head_dim),
                "sm_scale": case.head_dim**-0.5, "block_s": case.block_s,
                "splits": case.splits}

    def tolerance(self, case: Case) -> dict[str, float]:
        """Twice as wide with spikes: their outputs are a few times larger, and float16
        operands err relative to them."""
        if case.data == "spiky":
            return {k: 2 * v for k, v in self.TOLERANCE.items()}
        return self.TOLERANCE

    def lengths(self, case: Case) -> list[int]:
        return list(case.lengths)

    def test_malformed_arrays_raise_value_errors(self):
        kw = self.inputs(CASES[0])
        for name, bad, match in (
                ("k_stream", kw["k_stream"][..., :-1], "k_stream must be"),
                ("v_index", kw["v_index"][..., :1], "v_index must have shape"),
                ("k_norm", kw["k_norm"][:, :, :-1], "k_norm must have shape"),
                ("q", kw["q"][0], "q must be")):
            with pytest.raises(ValueError, match=match):
                api.rice_decode(**{**kw, name: bad})
        with pytest.raises(ValueError, match="uint32"):
            api.rice_decode(**{**kw, "k_index": kw["k_index"].astype(jnp.int32)})
        with pytest.raises(ValueError, match="block_s 8"):
            api.rice_decode(**{**kw, "block_s": 8})


def test_the_spiky_case_reaches_every_fallback_level():
    """The fallback case holds blocks at the calibrated scale, at coarser ones and in
    the sign fallback (keys and values read them the same way), and the sign fallback
    in both roles: the suite's comparison covers each."""
    kw = TestRiceDecode().inputs(CASES[1])
    seen = set()
    for role in ("k", "v"):
        levels = set(np.unique(np.asarray(kw[f"{role}_index"][..., 0] & 0xFFFFFF)).tolist())
        assert {0, 4} <= levels, levels
        seen |= levels
    assert seen & {1, 2, 3}, seen


@pytest.mark.parametrize("change,reason", [
    ({"block": 16}, "blocks of 16 tokens"),
    ({"lattice": "a2"}, "reads E8 streams"),
    ({"head_dim": 96}, "head_dim 96"),
])
def test_unsupported_layouts(change, reason):
    layout = dataclasses.replace(parse_codec(RICE).rice_layout(128), **change)
    assert reason in api.unsupported(layout, layout.head_dim)
