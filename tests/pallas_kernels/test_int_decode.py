"""The fused INT-N decode-attention kernel's entry against its pure-jnp reference (the
kernel suite), and the pieces of its layout and blocking.

Tolerance: the kernel rounds its matmul operands (the query, and the probabilities times
the value scales) to float16 and accumulates in float32, so it differs from the exact
reference by about 1e-3 of the output's magnitude; outputs here are O(1), and the
tolerance below is 3e-3 absolute. A kernel that drops or repeats a block of tokens, or
mixes up two query heads, misses by far more (tested).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codecs import IntCodec, SawCodec
from kvjax.codecs.hyperquant import INT8_BIAS
from kvjax.primitives.packing import unpack_codes
from kvjax.spec import parse_codec
from pallas_kernels.int_decode import api, reference
from pallas_kernels.int_decode.kernel import Research
from pallas_kernels.units import unit_permutation, unit_view
from tests.pallas_kernels.suite import KernelSuite, PagedSuite, Shape


@dataclasses.dataclass(frozen=True)
class Case(Shape):
    """One call of the entry: shapes, codes and blocking."""

    bits: int
    lengths: tuple[int, ...]
    saw: int | None = None     # SAW rotation block of the keys (None: int:N keys)
    saw_values: bool = False   # values rotated too (SAW "kv")
    hyperquant: str | None = None  # keys and values of this int8 HyperQuant spec
    layers: int | None = None  # codes stacked over this many layers; layer 1 is read
    block_s: int | None = 16
    splits: int | None = 2
    research: Research | None = None

    @property
    def id(self) -> str:
        extra = [f"saw{self.saw}" * bool(self.saw), "kv" * self.saw_values,
                 (self.hyperquant or "").replace(":", "-").replace(",", "-"),
                 f"L{self.layers}" * bool(self.layers),
                 f"{self.research}" * bool(self.research)]
        return "-".join([f"{self.shape_id}b{self.bits}", f"bs{self.block_s}",
                         f"sp{self.splits}", "n" + ",".join(map(str, self.lengths)),
                         *filter(None, extra)])


def coded(codec, params, x):
    codes = codec.encode(params, x)
    return codes["codes"], codes["scale"][..., 0], codes["zero"][..., 0]


def int_format_case(spec, key, k, v, heads, head_dim):
    """Keys and values of a codec with an offset IntFormat (HyperQuant int8): the arrays
    it gives the kernel, and its matrices ``R`` per head."""
    codec = parse_codec(spec)
    fmt = codec.kernel_formats()[0]
    out = []
    for i, x in enumerate((k, v)):
        params = codec.init(jax.random.fold_in(key, i), head_dim)
        r = fmt.rotation(params, head_dim)
        out += [fmt.arrays(codec.encode(params, x)), jnp.broadcast_to(r, (heads, *r.shape))]
    return out


# One compiled program per shape: op-by-op dispatch would compile dozens of small
# programs for every new shape, which costs more than the kernel itself.
@functools.partial(jax.jit, static_argnames=("batch", "heads", "group", "slots", "head_dim",
                                             "bits", "saw_block", "saw_values", "hyperquant",
                                             "seed"))
def random_case(batch, heads, group, slots, head_dim, bits, saw_block=None, saw_values=False,
                hyperquant=None, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, heads, group, head_dim))
    k = jax.random.normal(keys[1], (batch, heads, slots, head_dim))
    v = jax.random.normal(keys[2], (batch, heads, slots, head_dim))
    if hyperquant:
        k_arrays, q_rotation, v_arrays, v_rotation = int_format_case(
            hyperquant, keys[3], k, v, heads, head_dim)
        return q, k_arrays, v_arrays, q_rotation, v_rotation
    q_rotation = v_rotation = None
    if saw_block:
        saw = SawCodec(block=saw_block, bits=bits, signs=True)
        params = saw.init(keys[3], head_dim)
        k_arrays = coded(saw, params, k)
        r = saw.rotate(params, jnp.eye(head_dim)).T
        q_rotation = jnp.broadcast_to(r, (heads, head_dim, head_dim))
    else:
        k_arrays = coded(IntCodec(bits=bits), None, k)
    if saw_values:
        saw = SawCodec(block=saw_block, bits=bits, signs=True, rotate_values=True)
        params = saw.init(jax.random.fold_in(keys[3], 1), head_dim)
        v_arrays = coded(saw, params, v)
        r = saw.rotate(params, jnp.eye(head_dim)).T
        v_rotation = jnp.broadcast_to(r, (heads, head_dim, head_dim))
    else:
        v_arrays = coded(IntCodec(bits=bits), None, v)
    return q, k_arrays, v_arrays, q_rotation, v_rotation


#: normalized outputs O(1); log-sum-exps of logits O(5) (measured: at most 9.4e-4 and
#: 5.4e-4 over the cases below, interpret mode)
ATOL, LSE_ATOL = 3e-3, 2e-3

CASES = (
    # int4 at D=128 (32 columns per plane: matrix path), GQA 4, ragged rows, 3 splits
    Case(3, 2, 4, 70, 128, 4, (70, 23, 0), splits=3),
    # GQA 1 and 7, lengths not multiples of the block
    Case(1, 1, 1, 37, 128, 4, (37,)),
    Case(2, 1, 7, 41, 128, 8, (41, 17)),
    # the narrowest matrix operands (16 columns: int4 at D=64, int2 at D=128)
    Case(2, 2, 3, 33, 64, 4, (33, 5)),
    Case(1, 1, 4, 29, 128, 2, (29,), splits=1),
    # 8 columns (int2 at D=64): the broadcast path
    Case(2, 1, 3, 21, 64, 2, (21, 9)),
    # SAW: the query rotated (with its columns permuted) before the kernel
    Case(2, 2, 4, 50, 128, 4, (50, 31), saw=32),
    Case(1, 1, 4, 24, 64, 8, (24,), saw=64, splits=1),
    # SAW "kv": values stored rotated, the output rotated back
    Case(2, 1, 4, 45, 64, 4, (45, 13), saw=32, saw_values=True, splits=3),
    # a stack of layers read in place at a traced index, an empty row
    Case(2, 2, 4, 40, 64, 4, (40, 0), layers=3),
    # HyperQuant int8: biased signed codes without zeros, a linear map that is not a
    # rotation (lattice point scale, 1 / (alpha sqrt D)) on the query and the output
    Case(2, 2, 4, 50, 128, 8, (50, 19), hyperquant="hyperquant:e8,4bps,int8", splits=3),
    Case(1, 1, 7, 33, 64, 8, (33,), hyperquant="hyperquant:a2,3bps,haar,int8", layers=2),
    # the library's default blocking and splits (S not a multiple of its 128-token block)
    Case(2, 1, 4, 130, 64, 4, (130, 1), block_s=None, splits=None),
)


class TestIntDecode(PagedSuite, KernelSuite):
    entry = staticmethod(api.int_decode)
    reference = staticmethod(reference.int_decode)
    CASES = CASES
    UNSUPPORTED = (
        (Case(1, 1, 4, 20, 128, 3, (20,)), "3-bit codes are not planar-packed"),
        (Case(1, 1, 4, 20, 80, 4, (20,)), "head_dim 80 is not a power of two"),
    )
    DROP = (Case(1, 1, 4, 48, 128, 4, (48,)), [32])
    TOLERANCE: ClassVar[dict[str, float]] = {"out": ATOL, "lse": LSE_ATOL}
    IMPL = "int_decode"
    PAGED_ARRAYS: ClassVar[dict[str, int]] = {name: 1 for name in (
        "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")}
    NEEDLE_SPECS = ("int:4 window=16 sinks=4", "k=saw:h32,signs v=int:4 window=16 sinks=4",
                    "int:4 window=16 sinks=4 page=64",  # the whole cache through pages
                    "hyperquant:e8,4bps,int8 window=16 sinks=4")

    def inputs(self, case: Case) -> dict:
        def one(seed=0):
            return random_case(case.batch, case.heads, case.group, case.slots,
                               case.head_dim, case.bits, case.saw, case.saw_values,
                               case.hyperquant, seed=seed)

        q, k_arrays, v_arrays, q_rotation, v_rotation = one()
        layer = None
        if case.layers:
            # other layers hold other codes: reading the wrong one cannot pass
            stacks = [one(seed) for seed in (1, 0, 2)[:case.layers]]
            k_arrays, v_arrays = (
                [None if s0[i] is None else jnp.stack([s[role][i] for s in stacks])
                 for i, s0 in ((i, stacks[0][role]) for i in range(3))]
                for role in (1, 2))
            layer = jnp.int32(1)
        names = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
        offset = INT8_BIAS if case.hyperquant else None
        return {"q": q, **dict(zip(names, (*k_arrays, *v_arrays), strict=True)),
                "lengths": jnp.asarray(case.lengths, jnp.int32), "layer": layer,
                "q_rotation": q_rotation, "v_rotation": v_rotation, "bits": case.bits,
                "offset": offset, "sm_scale": case.head_dim**-0.5, "block_s": case.block_s,
                "splits": case.splits, "research": case.research}

    def lengths(self, case: Case) -> list[int]:
        return list(case.lengths)

    def test_rotation_inside_the_kernel(self):
        """The SAW query rotated by every program instead of before the kernel."""
        self.test_entry_matches_reference(
            Case(2, 2, 4, 50, 128, 4, (50, 31), saw=32,
                 research=Research(rotate_in_kernel=True)))

    def test_unbiased_planes_match_reference(self):
        """Codes turned into float16 with one subtraction per pair (no bias to take out)."""
        self.test_entry_matches_reference(
            Case(2, 2, 4, 70, 128, 4, (70, 9), research=Research(biased=False)))

    @pytest.mark.parametrize("several", [
        Case(2, 4, 4, 70, 128, 4, (70, 23), research=Research(heads=4)),
        Case(2, 4, 3, 45, 64, 2, (45, 9), research=Research(heads=2)),
        Case(1, 4, 7, 40, 64, 8, (33,), research=Research(heads=4)),
        Case(2, 2, 4, 50, 128, 4, (50, 31), saw=32, saw_values=True,
             research=Research(heads=2)),
        Case(2, 4, 4, 50, 128, 8, (50, 19), hyperquant="hyperquant:e8,4bps,int8", layers=2,
             research=Research(heads=2)),
        Case(2, 2, 4, 40, 128, 4, (40, 7), research=Research(heads=2, biased=False)),
    ], ids=str)
    def test_programs_of_several_heads_match_reference(self, several):
        """Programs that serve several kv heads, their rows sharing the matmul tiles."""
        self.test_entry_matches_reference(several)

    def test_heads_per_program_must_divide_the_heads(self):
        kw = self.inputs(Case(1, 3, 4, 20, 64, 4, (20,)))
        with pytest.raises(ValueError, match="do not split"):
            api.int_decode(**{**kw, "research": Research(heads=2)})
        with pytest.raises(ValueError, match="positive"):
            Research(heads=0)
        with pytest.raises(ValueError, match="one kv head"):
            Research(heads=2, rotate_in_kernel=True)

    def test_bytes_layout_matches_reference(self):
        """The 8-bit-unit layout with int-to-float conversions."""
        self.test_entry_matches_reference(
            Case(2, 2, 4, 70, 128, 4, (70, 0), research=Research(layout="bytes")))

    def test_malformed_arrays_raise_value_errors(self):
        kw = self.inputs(Case(2, 1, 4, 20, 64, 4, (20, 3)))
        for name, bad, match in (
                ("k_codes", kw["k_codes"][..., :-1], "k_codes must be"),
                ("v_scale", kw["v_scale"][:, :, :-1], "v_scale must have shape"),
                ("lengths", kw["lengths"][:1], "lengths must be integers of shape"),
                ("q", kw["q"][0], "q must be"),
                ("q_rotation", jnp.eye(64), "q_rotation must be")):
            with pytest.raises(ValueError, match=match):
                api.int_decode(**{**kw, name: bad})
        with pytest.raises(ValueError, match="uint32"):
            api.int_decode(**{**kw, "k_codes": kw["k_codes"].astype(jnp.int32),
                              "v_codes": kw["v_codes"].astype(jnp.int32)})
        with pytest.raises(ValueError, match="pass no zeros"):
            api.int_decode(**{**kw, "offset": 8})
        with pytest.raises(ValueError, match="needed unless offset"):
            api.int_decode(**{**kw, "k_zero": None})
        with pytest.raises(ValueError, match="is not a 4-bit code"):
            api.int_decode(**{**kw, "k_zero": None, "v_zero": None, "offset": 16})

    def test_no_code_slot_is_an_empty_partial(self):
        kw = self.inputs(Case(2, 1, 4, 20, 64, 4, (0, 0)))
        kw.update({name: kw[name][:, :, :0] for name in
                   ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")})
        for fn in (api.int_decode, reference.int_decode):
            o, m, l = fn(**kw)
            assert o.shape == kw["q"].shape and not np.any(np.asarray(o))
            assert not np.any(np.asarray(l)) and np.all(np.asarray(m) < -1e38)


@pytest.mark.parametrize("layout", ["halves", "bytes"])
@pytest.mark.parametrize("head_dim,bits", [(128, 4), (64, 4), (128, 2), (64, 8), (256, 2)])
def test_unit_permutation_matches_unpacking(head_dim, bits, layout):
    codes = jax.random.bits(jax.random.key(3), (5, head_dim * bits // 32), jnp.uint32)
    dims = np.asarray(unpack_codes(codes, bits, head_dim))
    units = np.asarray(unit_view(codes, layout)).astype(np.uint32)
    perm = unit_permutation(head_dim, bits, layout)
    per_unit = (16 if layout == "halves" else 8) // bits
    planes = np.concatenate([(units >> (bits * j)) & ((1 << bits) - 1)
                             for j in range(per_unit)], axis=-1)
    np.testing.assert_array_equal(planes, dims[:, perm])
    assert sorted(perm) == list(range(head_dim))


def test_research_variant_is_checked():
    with pytest.raises(ValueError, match="layout must be one of"):
        Research(layout="words")


def test_random_inputs_fit_the_entry():
    arrays = api.random_inputs(jax.random.key(0), batch=2, heads=1, group=3, slots=20,
                               head_dim=64, bits=4, rotated=True)
    api.check_arrays(**{k: arrays.get(k) for k in (
        "q", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "lengths",
        "layer", "q_rotation", "v_rotation")}, bits=4)
    r = np.asarray(arrays["q_rotation"][0])
    np.testing.assert_allclose(r @ r.T, np.eye(64), atol=1e-5)   # orthogonal
    assert arrays["lengths"].tolist() == [20, 20]
