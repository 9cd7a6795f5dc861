"""The fused OCTOPUS decode-attention kernel's entry against its pure-jnp reference (the
kernel suite), over arrays that OCTOPUS (MSE and QJL) and KIVI's value codec really
store, and the byte layout the kernel reads.

Tolerance: the kernel rounds its matmul operands (the rotated query, ``G q``, each
triplet's scaled ``x, y, z``, the dequantized values, the probabilities) to float16 and
accumulates in float32; outputs here are O(1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import GroupIntFormat, OctopusFormat
from kvjax.codecs.octopus import byte_layout
from kvjax.spec import parse_cache
from pallas_kernels.octopus_decode import api, reference
from pallas_kernels.octopus_decode.kernel import plan, query_columns
from tests.pallas_kernels.suite import KernelSuite, Shape


@dataclasses.dataclass(frozen=True)
class Case(Shape):
    """One call of the entry over a cache spec's codes."""

    spec: str
    lengths: tuple[int, ...]
    layers: int | None = None  # codes stacked over this many layers; layer 1 is read
    block_s: int | None = 16
    splits: int | None = 2

    @property
    def id(self) -> str:
        return "-".join(filter(None, [
            self.shape_id,
            self.spec.replace(":", "").replace(",", ""), f"bs{self.block_s}",
            f"sp{self.splits}", "n" + ",".join(map(str, self.lengths)),
            f"L{self.layers}" * bool(self.layers)]))


def formats(spec: str):
    config = parse_cache(spec)
    [k_fmt] = [f for f in config.k.kernel_formats() if isinstance(f, OctopusFormat)]
    [v_fmt] = [f for f in config.v.kernel_formats() if isinstance(f, GroupIntFormat)]
    return config, k_fmt, v_fmt


# One compiled program per shape and spec, as in the codebook kernel's tests.
@functools.partial(jax.jit, static_argnames=("batch", "heads", "group", "slots", "head_dim",
                                             "spec"))
def coded_case(batch, heads, group, slots, head_dim, spec, seed=0):
    """``(q, key arrays, value arrays, signs, sketch)`` of random vectors encoded by the
    spec's codecs, one parameter draw per kv head."""
    config, k_fmt, v_fmt = formats(spec)
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, heads, group, head_dim))
    k = jax.random.normal(keys[1], (batch, heads, slots, head_dim))
    v = jax.random.normal(keys[2], (batch, heads, slots, head_dim))
    params = jax.vmap(lambda key: config.k.init(key, head_dim))(
        jax.random.split(keys[3], heads))
    k_codes = jax.vmap(config.k.encode, in_axes=(0, 1), out_axes=1)(params, k)
    v_codes = config.v.encode(None, v)
    return (q, k_fmt.arrays(k_codes), v_fmt.arrays(v_codes), params["signs"],
            params.get("sketch"))


#: normalized outputs O(1); log-sum-exps of logits O(5)
ATOL, LSE_ATOL = 3e-3, 2e-3

CASES = (
    # octopus:b3 at D = 128: three 16-byte windows, four norm windows; GQA 4, an empty row
    Case(3, 2, 4, 45, 128, "octopus:b3", (45, 23, 0), splits=3),
    # GQA 1 and 7, lengths off the block; no and one-bit norm codes
    Case(1, 1, 1, 37, 128, "octopus:d4,n0", (37,)),
    Case(2, 1, 7, 41, 128, "octopus:d4,n1", (41, 17)),
    # D = 64: 8-byte windows (narrow, broadcast dots), a stack of layers read in place
    # at a traced index
    Case(2, 2, 3, 29, 64, "octopus:b3", (29, 5), layers=3, splits=1),
    # QJL: the estimator's term from G q and the sign bits
    Case(2, 1, 4, 35, 128, "octopus:b4,qjl", (35, 12)),
    # the library's default blocking and splits (S not a multiple of its 128-token block)
    Case(1, 1, 4, 130, 128, "octopus:b3", (130,), block_s=None, splits=None),
)


@functools.partial(jax.jit, static_argnames=("spec", "lengths"))
def codec_attention(q, k, v, params, spec, lengths):
    """The attention of ``q`` over the codecs' own scores (``scores``: QJL's estimator)
    and decoded values of ``k``, ``v`` (D = 128)."""
    config, _, _ = formats(spec)
    codes = jax.vmap(config.k.encode, in_axes=(0, 1), out_axes=1)(params, k)
    s = jax.vmap(config.k.scores, in_axes=(0, 1, 1), out_axes=1)(params, q, codes)
    values = config.v.decode(None, config.v.encode(None, v))
    valid = jnp.arange(k.shape[2])[None, :] < jnp.asarray(lengths)[:, None]
    s = jnp.where(valid[:, None, None, :], s * 128**-0.5, -jnp.inf)
    return jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(s, axis=-1), values)


class TestOctopusDecode(KernelSuite):
    entry = staticmethod(api.octopus_decode)
    reference = staticmethod(reference.octopus_decode)
    CASES = CASES
    UNSUPPORTED = (
        (Case(1, 1, 4, 20, 128, "octopus:b2", (20,)), "one dense stream"),
        (Case(1, 1, 4, 20, 128, "octopus:d4,n8", (20,)), "256 norm levels"),
    )
    DROP = (Case(1, 1, 4, 48, 128, "octopus:b3", (48,)), [32])
    TOLERANCE: ClassVar[dict[str, float]] = {"out": ATOL, "lse": LSE_ATOL}
    IMPL = "octopus_decode"
    # the QJL arrays reach the entry through the adapter code the codebook kernel's
    # needle covers
    NEEDLE_SPECS = ("octopus:b3 window=16 sinks=4",)

    def inputs(self, case: Case) -> dict:
        _, k_fmt, v_fmt = formats(case.spec)
        shape = (case.batch, case.heads, case.group, case.slots, case.head_dim, case.spec)
        q, k_arrays, v_arrays, signs, sketch = coded_case(*shape)
        layer = None
        if case.layers:
            # other layers hold other codes: reading the wrong one cannot pass
            stacks = [coded_case(*shape, seed=seed) for seed in (1, 0, 2)[:case.layers]]
            k_arrays = [jnp.stack([s[1][i] for s in stacks]) for i in range(len(k_arrays))]
            v_arrays = [jnp.stack([s[2][i] for s in stacks]) for i in range(3)]
            layer = jnp.int32(1)
        k_codes, k_norm, *qjl = k_arrays
        return {"q": q, "k_codes": k_codes, "k_norm": k_norm,
                **dict(zip(("v_codes", "v_scale", "v_zero"), v_arrays, strict=True)),
                "lengths": jnp.asarray(case.lengths, jnp.int32), "layer": layer,
                "k_signs": signs, "k_qjl": qjl[0] if qjl else None,
                "k_residual_norm": qjl[1] if qjl else None, "qjl_sketch": sketch,
                **k_fmt.options(case.head_dim),
                "value_bits": v_fmt.bits, "value_group": v_fmt.group,
                "sm_scale": case.head_dim**-0.5, "block_s": case.block_s,
                "splits": case.splits}

    def lengths(self, case: Case) -> list[int]:
        return list(case.lengths)

    def test_reference_agrees_with_the_codecs(self):
        """The reference's scores and values are the codecs' own: its partial equals the
        attention over the codec's ``scores`` (the decoded keys' dots plus QJL's term;
        the byte layout of ``octopus:b3``'s split) of the same arrays."""
        spec = "octopus:b4,qjl"
        case = Case(2, 2, 4, 30, 128, spec, (30, 11))
        o, _, l = reference.octopus_decode(**self.inputs(case))
        q, *_ = coded_case(2, 2, 4, 30, 128, case.spec)
        keys = jax.random.split(jax.random.key(0), 4)
        k = jax.random.normal(keys[1], (2, 2, 30, 128))
        v = jax.random.normal(keys[2], (2, 2, 30, 128))
        config, _, _ = formats(spec)
        params = jax.vmap(lambda key: config.k.init(key, 128))(jax.random.split(keys[3], 2))
        # float32 products on a GPU too (its default rounds matmul operands)
        with jax.default_matmul_precision("highest"):
            want = codec_attention(q, k, v, params, spec, case.lengths)
        np.testing.assert_allclose(np.asarray(o) / np.asarray(l)[..., None], want, atol=2e-4)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256, 512])
@pytest.mark.parametrize("norm_bits", [0, 1, 2, 4, 8])
def test_byte_layout_places_every_code_where_its_windows_read_it(head_dim, norm_bits):
    """Every byte holds one direction or norm codes (no bit is lost: the dense stream's
    byte count), every window lies in the token's bytes, and each norm code is in its
    triplet's column of the norm window :func:`plan` loads for it."""
    triplets = -(-head_dim // 3)
    layout = byte_layout(triplets, norm_bits)
    assert layout.size == -(-triplets * (8 + norm_bits) // 8)
    norm_bytes = {b for b, _ in layout.norm}
    assert sorted([*layout.direction, *norm_bytes]) == list(range(layout.size))
    assert len(set(layout.norm)) == len(layout.norm)
    steps = plan(layout)
    assert len(steps.windows) == len(layout.windows)
    for (start, column, first, count), window in zip(layout.windows, steps.windows,
                                                     strict=True):
        assert 0 <= start <= layout.size - layout.width and window.start == start
        for j in range(count):
            assert layout.direction[first + j] == start + column + j
            if norm_bits:
                c = column + j
                [(load, slot)] = [(s, k) for lo, hi, s, k in window.runs if lo <= c <= hi]
                assert 0 <= load <= layout.size - layout.width
                assert layout.norm[first + j] == (load + c, slot)
    if head_dim >= 128:
        assert layout.width == 16  # whole matrix-instruction tiles


def test_query_columns_zero_what_holds_no_dim():
    layout = byte_layout(43, 2)
    cols = query_columns(layout, 128).reshape(len(layout.windows), 3, layout.width)
    # window 2 holds triplets 32..42 in its columns 5..15; dim 128 (the pad) is zero
    np.testing.assert_array_equal(cols[2, 0], [128] * 5 + list(range(96, 128, 3)))
    assert cols[2, 2, -1] == 128 and cols[2, 1, -1] == 127
    assert sorted(set(cols.ravel().tolist())) == list(range(129))


def test_malformed_arrays_raise():
    case = Case(1, 1, 2, 8, 128, "octopus:b4,qjl", (8,))
    kw = TestOctopusDecode().inputs(case)
    with pytest.raises(ValueError, match="come together"):
        api.octopus_decode(**{**kw, "qjl_sketch": None})
    with pytest.raises(ValueError, match="k_norm must have shape"):
        api.octopus_decode(**{**kw, "k_norm": kw["k_norm"][..., :4]})
    with pytest.raises(ValueError, match="8 magnitudes"):
        api.octopus_decode(**{**kw, "magnitudes": kw["magnitudes"][:4]})
    with pytest.raises(ValueError, match="uint8 bytes"):
        api.octopus_decode(**{**kw, "k_codes": kw["k_codes"].astype(jnp.int32)})
    with pytest.raises(ValueError, match="norm levels do not match"):
        api.octopus_decode(**{**kw, "norms": kw["norms"][:2]})
