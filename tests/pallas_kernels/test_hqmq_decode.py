"""The fused HQMQ decode-attention kernel's entry against its pure-jnp reference (the
kernel suite, over streams the codec really stores), and the stream layout it reads.

Tolerance: the kernel rounds its operands (the query, codewords times radius codes, the
probabilities times the scales) to float16 and accumulates in float32: about 1e-3 of
the outputs, which are O(1) here; 3e-3 absolute, as for the other kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention.fused import hqmq_tables
from kvjax.codec import HqmqFormat
from kvjax.spec import parse_codec
from pallas_kernels.hqmq_decode import api, reference
from pallas_kernels.hqmq_decode.kernel import DIGITS, LOOKUPS
from pallas_kernels.partial import normalize
from tests.pallas_kernels.suite import KernelSuite, PagedSuite, Shape

MED = "hqmq:s96,r4,med3"
#: the paper's uncapped Med-C: a slot for every chunk (512 per block of 32 tokens at
#: D = 64)
MED_ALL = f"{MED},mp100"
#: the row's slots pooled, 10% of them (about the spikes' share): blocks with fewer
#: spikes leave slots to later ones, whose chunks then lie in earlier blocks' entries
MED_POOL = f"{MED},mp10,mpool"


@dataclasses.dataclass(frozen=True)
class Case(Shape):
    """One call of the entry: shapes, the codec and blocking."""

    lengths: tuple[int, ...]
    spec: str = "hqmq"
    layers: int | None = None  # streams stacked over this many layers; layer 1 is read
    block_s: int | None = 16
    splits: int | None = 2

    @property
    def id(self) -> str:
        return "-".join(filter(None, [
            f"{self.shape_id}-{self.spec.replace(':', '-').replace(',', '-')}",
            f"bs{self.block_s}", f"sp{self.splits}", "n" + ",".join(map(str, self.lengths)),
            f"L{self.layers}" * bool(self.layers)]))


#: the share of elements made spikes (x12) where a spec has Med-C outliers: more
#: chunks than the 3% of slots, so that full blocks and overflow are exercised
SPIKES = 0.04


# One compiled program per shape and spec: op by op, encoding costs more than the kernel.
@functools.partial(jax.jit, static_argnames=("spec", "batch", "heads", "group", "slots",
                                             "head_dim"))
def coded(spec, batch, heads, group, slots, head_dim, seed=0):
    """``(q, (k_stream, k_scale, k_outliers), (v_...), k_table, v_table)`` of Gaussian
    vectors (with spikes where the spec has outliers) encoded by the codec, one parameter
    draw per kv head and role; ``*_outliers`` the Med-C ``(flags, chunks[, start])`` or
    None."""
    codec = parse_codec(spec)
    [fmt] = [f for f in codec.kernel_formats() if isinstance(f, HqmqFormat)]
    keys = jax.random.split(jax.random.key(seed), 7)
    q = jax.random.normal(keys[0], (batch, heads, group, head_dim))
    out = [q]
    tables = []
    for i in range(2):
        params = jax.vmap(lambda k: codec.init(k, head_dim))(jax.random.split(keys[1 + i],
                                                                              heads))
        x = jax.random.normal(keys[3 + i], (batch, heads, slots, head_dim))
        if fmt.outliers is not None:
            x = x * jnp.where(jax.random.bernoulli(keys[5 + i], SPIKES, x.shape), 12.0, 1.0)
        codes = jax.vmap(codec.encode, in_axes=(0, 1), out_axes=1)(params, x)
        out.append((*fmt.arrays(codes), fmt.outlier_arrays(codes)))
        tables.append(hqmq_tables(fmt, params))
    return (*out, *tables)


CASES = (
    # D = 128 (32 chunks), GQA 4, ragged rows with an empty one, 3 splits
    Case(3, 2, 4, 70, 128, (70, 23, 0), splits=3),
    # GQA 1 and 7, lengths not multiples of the block
    Case(1, 1, 1, 37, 128, (37,)),
    Case(2, 1, 7, 41, 128, (41, 17)),
    # D = 64 (16 chunks: the narrowest matmul operands)
    Case(2, 2, 3, 33, 64, (33, 5)),
    # a stack of layers read in place at a traced index
    Case(2, 2, 4, 40, 64, (40, 9), layers=3),
    # the library's default blocking and splits (S not a multiple of its block)
    Case(2, 1, 4, 130, 64, (130, 1), block_s=None, splits=None),
    # head dims short of whole chunks (the codec pads the last one): 126 and, with
    # outliers, 61
    Case(2, 1, 4, 40, 126, (40, 13)),
    Case(1, 2, 4, 64, 61, (50,), spec=MED, block_s=None, splits=2),
    # uncapped Med-C: every spike stored, in as many slots as the block has chunks
    Case(2, 1, 2, 64, 64, (64, 40), spec=MED_ALL, block_s=None, splits=2),
    # Med-C outliers: D = 128 (31 slots of 32 blocks), a row ending inside a block
    Case(2, 2, 4, 96, 128, (96, 45), spec=MED, block_s=None, splits=2),
    # D = 64 (16 slots, two tokens' flags a word), stacked layers, one split
    Case(2, 1, 3, 64, 64, (64, 33), spec=MED, block_s=32, splits=1, layers=2),
    # pooled slots: D = 128 and, stacked, D = 64
    Case(2, 2, 4, 128, 128, (128, 70), spec=MED_POOL, block_s=None, splits=2),
    Case(2, 1, 3, 128, 64, (128, 40), spec=MED_POOL, block_s=32, splits=2, layers=2),
)


class TestHqmqDecode(PagedSuite, KernelSuite):
    entry = staticmethod(api.hqmq_decode)
    reference = staticmethod(reference.hqmq_decode)
    CASES = CASES
    PAGED_ARRAYS: ClassVar[dict[str, int]] = {
        name: 1 for name in ("k_stream", "k_scale", "v_stream", "v_scale")}
    UNSUPPORTED = (
        (Case(1, 1, 4, 20, 128, (20,), spec="hqmq:s24,r3"), "not whole bytes and nibbles"),
        (Case(1, 1, 4, 20, 80, (20,)), "head_dim 80"),
        (Case(1, 1, 4, 20, 48, (20,)), "head_dim 48"),
    )
    DROP = (Case(1, 1, 4, 48, 128, (48,)), [32])
    TOLERANCE: ClassVar[dict[str, float]] = {"out": 3e-3, "lse": 2e-3}
    IMPL = "hqmq_decode"
    NEEDLE_SPECS = ("hqmq window=16 sinks=4",
                    f"{MED} window=16 sinks=4 page=64")  # the second through pages

    def inputs(self, case: Case) -> dict:
        def one(seed=0):
            return coded(case.spec, case.batch, case.heads, case.group, case.slots,
                         case.head_dim, seed)

        q, k, v, k_table, v_table = one()
        layer = None
        if case.layers:
            # other layers hold other codes: reading the wrong one cannot pass
            stacks = [one(seed)[1:3] for seed in (1, 0, 2)[:case.layers]]
            k, v = (jax.tree.map(lambda *a: jnp.stack(a), *[s[r] for s in stacks])
                    for r in range(2))
            layer = jnp.int32(1)
        med = {}
        for role, (_, _, outliers) in (("k", k), ("v", v)):
            names = ("outlier_flags", "outliers", "outlier_start")
            med.update({f"{role}_{n}": a for n, a in zip(names, outliers or (), strict=False)})
        return {"q": q, "k_stream": k[0], "k_scale": k[1], "v_stream": v[0], "v_scale": v[1],
                "lengths": jnp.asarray(case.lengths, jnp.int32), "k_table": k_table,
                "v_table": v_table, "layer": layer, **med,
                "layout": parse_codec(case.spec).kernel_formats()[0].layout(case.head_dim),
                "sm_scale": case.head_dim**-0.5, "block_s": case.block_s,
                "splits": case.splits}

    def tolerance(self, case: Case) -> dict[str, float]:
        """Four times wider with spikes: float16 operands err relative to the values
        and logits, which the spikes make about ten times larger."""
        if "med" in case.spec:
            return {k: 4 * v for k, v in self.TOLERANCE.items()}
        return self.TOLERANCE

    def lengths(self, case: Case) -> list[int]:
        return list(case.lengths)

    def test_paged_pool_with_outliers_matches_the_contiguous_rows(self):
        """Med-C outliers in pages: their flags and chunks are per outlier block, whole
        blocks of a page."""
        case = Case(2, 2, 4, 96, 128, (96, 45), spec=MED, block_s=None, splits=2)
        block = parse_codec(MED).kernel_formats()[0].outliers.block
        assert self.PAGE_TOKENS % block == 0
        self.check_paged(case, {**self.PAGED_ARRAYS, **{
            f"{role}_{name}": block for role in "kv" for name in ("outlier_flags",
                                                                  "outliers")}})

    def test_pages_refuse_pooled_outliers_and_split_blocks(self):
        # one row: its arrays are a pool of its own pages
        kw = self.inputs(Case(1, 1, 4, 64, 64, (64,), spec=MED_POOL, block_s=32))
        with pytest.raises(NotImplementedError, match="pooled outliers"):
            api.hqmq_decode(**{**kw, "pages": jnp.asarray([[0, 1]]), "page_tokens": 32})
        kw = self.inputs(Case(1, 1, 4, 64, 64, (64,), spec=MED, block_s=32))
        with pytest.raises(NotImplementedError, match="no whole outlier blocks"):
            api.hqmq_decode(**{**kw, "pages": jnp.asarray([[0, 1, 2, 3]]),
                               "page_tokens": 16})

    def test_malformed_arrays_raise_value_errors(self):
        kw = self.inputs(Case(2, 1, 4, 20, 64, (20, 3)))
        for name, bad, match in (
                ("k_stream", kw["k_stream"][..., :-1], "k_stream must be"),
                ("v_scale", kw["v_scale"][:, :, :-1], "v_scale must have shape"),
                ("k_table", kw["k_table"][:, :3], "k_table must be"),
                ("v_table", kw["v_table"][..., :-1], "v_table holds"),
                ("q", kw["q"][0], "q must be")):
            with pytest.raises(ValueError, match=match):
                api.hqmq_decode(**{**kw, name: bad})
        with pytest.raises(ValueError, match="uint8"):
            api.hqmq_decode(**{**kw, "k_stream": kw["k_stream"].astype(jnp.int32),
                               "v_stream": kw["v_stream"].astype(jnp.int32)})


@pytest.mark.parametrize("spec,head_dim", [("hqmq", 128), ("hqmq", 64), ("hqmq:s96,r4", 48)])
def test_layout_reads_what_the_codec_decodes(spec, head_dim):
    """The stream read the layout's way (the reference's ``dequantize``) is the codec's
    own decode, exactly."""
    codec = parse_codec(spec)
    [fmt] = codec.kernel_formats()
    params = codec.init(jax.random.key(0), head_dim)
    x = jax.random.normal(jax.random.key(1), (3, 50, head_dim)) * 3.0
    codes = codec.encode(params, x)
    stream, scale = fmt.arrays(codes)
    layout = fmt.layout(head_dim)
    assert layout.size == stream.shape[-1]
    got = reference.dequantize(stream, scale, fmt.codewords(params).T, layout)
    np.testing.assert_array_equal(got, codec.decode(params, codes))


@pytest.mark.parametrize("spec,head_dim", [("hqmq:s24,r3", 128), ("hqmq:s192,r4", 128),
                                           ("hqmq:s96,r5", 128), ("hqmq:s48,r4", 64),
                                           ("hqmq", 256)])
def test_layout_is_none_where_the_fields_are_not_bytes(spec, head_dim):
    assert parse_codec(spec).kernel_layout(head_dim) is None


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_each_lookup_matches_the_reference(lookup):
    """Codewords formed either way (the secondary times the unit from its index, or the
    whole codeword gathered) give the reference's partial."""
    suite = TestHqmqDecode()
    kw = suite.inputs(CASES[0])
    want = normalize(*reference.hqmq_decode(**kw))
    got = normalize(*api.hqmq_decode(**kw, lookup=lookup))
    np.testing.assert_allclose(got, want, atol=TestHqmqDecode.TOLERANCE["out"])


def test_unknown_lookup_raises():
    kw = TestHqmqDecode().inputs(CASES[1])
    with pytest.raises(ValueError, match="lookup must be one of"):
        api.hqmq_decode(**kw, lookup="matmul")
    with pytest.raises(ValueError, match="digits must be one of"):
        api.hqmq_decode(**kw, digits="table")


# D = 128 (32 chunks: 6 groups of two bytes, a last one of one) and D = 64 with Med-C
# outliers in the same pass
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[9]], ids=lambda c: c.id)
@pytest.mark.parametrize("digits", DIGITS)
def test_each_digit_read_matches_the_reference(digits, case):
    """The digit groups gathered by column, or loaded whole and spread by a matmul,
    give the reference's partial."""
    suite = TestHqmqDecode()
    kw = suite.inputs(case)
    want = normalize(*reference.hqmq_decode(**kw))
    got = normalize(*api.hqmq_decode(**kw, digits=digits))
    np.testing.assert_allclose(got, want, atol=suite.tolerance(case)["out"])


def test_outlier_cases_hold_outliers_that_matter():
    """The Med-C cases store outliers in both roles (some blocks full), and leaving them
    out changes the output far beyond the tolerance: the suite's comparison sees them."""
    kw = TestHqmqDecode().inputs(next(c for c in CASES if c.spec == MED and c.head_dim == 128))
    for role in ("k", "v"):
        per_block = jnp.sum(jax.lax.population_count(kw[f"{role}_outlier_flags"]), axis=-1)
        slots = kw[f"{role}_outliers"].shape[-1] // 4
        assert int(per_block.min()) > 0 and int(per_block.max()) == slots
    without = {k: v for k, v in kw.items() if "outlier" not in k}
    full = normalize(*reference.hqmq_decode(**kw))
    base = normalize(*reference.hqmq_decode(**without))
    assert float(jnp.max(jnp.abs(full - base))) > 30 * TestHqmqDecode.TOLERANCE["out"]


def test_the_uncapped_case_holds_more_outliers_than_capped_slots():
    """Blocks of the uncapped case store more chunks than the default 3% has slots for,
    so the kernel reads slots past that count; there is a slot for every chunk."""
    case = next(c for c in CASES if c.spec == MED_ALL)
    kw = TestHqmqDecode().inputs(case)
    capped = parse_codec(MED).capacity(case.head_dim)
    for role in ("k", "v"):
        per_block = jnp.sum(jax.lax.population_count(kw[f"{role}_outlier_flags"]), axis=-1)
        assert int(per_block.max()) > capped
        assert kw[f"{role}_outliers"].shape[-1] == 4 * 32 * case.head_dim // 4


def test_pooled_cases_read_outliers_from_other_blocks_entries():
    """In the pooled cases some block stores more chunks than a block's share and some
    block's chunks start before its own entry of the pool, so the kernel reads across
    entries; the stored counts continue exactly from block to block."""
    for case in (c for c in CASES if c.spec == MED_POOL):
        kw = TestHqmqDecode().inputs(case)
        share = parse_codec(MED_POOL).capacity(case.head_dim)
        for role in ("k", "v"):
            per_block = jnp.sum(jax.lax.population_count(kw[f"{role}_outlier_flags"]),
                                axis=-1)
            start = kw[f"{role}_outlier_start"][..., 0].astype(jnp.int32)
            own = jnp.arange(start.shape[-1]) * share
            assert int(per_block.max()) > share
            assert bool(jnp.any(start < own))
            np.testing.assert_array_equal(start[..., 1:], (start + per_block)[..., :-1])


def test_malformed_outlier_arrays_raise():
    kw = TestHqmqDecode().inputs(next(c for c in CASES if c.spec == MED and c.head_dim == 128))
    flags, chunks = kw["k_outlier_flags"], kw["k_outliers"]
    for change, error, match in (
            ({"k_outliers": None}, ValueError, "go together"),
            ({"k_outlier_flags": flags.astype(jnp.int32)}, ValueError, "must be uint32"),
            ({"k_outlier_flags": flags[..., :-1]}, ValueError, "words per block"),
            ({"k_outliers": chunks[..., :-1]}, ValueError, "4 P"),
            ({"k_outlier_flags": flags[:, :, :1], "k_outliers": chunks[:, :, :1]},
             NotImplementedError, "outlier blocks of 96 tokens"),
            ({"block_s": 16}, ValueError, "one outlier block of 32 tokens"),
            ({"k_outlier_start": flags[..., :2]}, ValueError, "k_outlier_start must be"),
            ({"k_outlier_flags": None, "k_outliers": None,
              "k_outlier_start": flags[..., :1]}, ValueError, "needs k_outlier_flags")):
        with pytest.raises(error, match=match):
            api.hqmq_decode(**{**kw, **change})
