"""The fused PolarQuant decode-attention kernel's entry against its pure-jnp reference
(the kernel suite), over arrays that PolarQuant and KIVI's value codec really store, and
the pieces of its layout.

Tolerance: the suite's over rotated keys (:mod:`tests.pallas_kernels.rotated`): the
kernel looks its cosines and sines up in float16 tables and multiplies them in float32
before it rounds the unit vectors to float16 operands. The errors measured over the
cases below, interpret mode, reach 6.4e-4 in the outputs and 5.3e-4 in the log-sum-exps
(6.7e-4 and 2.8e-4 with float32 tables: the tables' rounding doubles the second).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import PolarFormat
from kvjax.codecs.polarquant import PolarQuantCodec, angle_widths, column_layout
from pallas_kernels import units
from pallas_kernels.polar_decode import api, kernel, reference
from pallas_kernels.polar_decode.kernel import (
    Read,
    Trig,
    key_view,
    plan,
    query_columns,
    trig_tables,
    uniform_error,
    unit_vectors,
)
from tests.pallas_kernels.rotated import Case, RotatedSuite, encoded, formats
from tests.pallas_kernels.test_units import run

#: every case's vectors are cut from one encoding of this shape per spec and head dim
#: (rows, kv heads, query rows per kv head, slots): one compiled encoder per spec
CODED = (2, 2, 7, 130)

CASES = (
    # 3 bits at D = 128: columns of a 16-bit and an 8-bit unit, the top angles in the
    # bytes' spare slots; GQA 4, a ragged and an empty row, 3 splits
    Case(2, 2, 4, 37, 128, "polarquant:b3", (37, 0), splits=3),
    # 2 bits at D = 64: one byte per column; GQA 1
    Case(1, 2, 1, 33, 64, "polarquant:b2", (33,)),
    # 4 bits: one 32-bit unit per column; GQA 7, lengths on a block boundary, one split
    Case(2, 1, 7, 41, 128, "polarquant:b4", (32, 16), splits=1),
    # 1 bit: the deep angles store no bits (their one centroid)
    Case(1, 1, 4, 24, 128, "polarquant:b1", (24,)),
    # D = 64, 3 bits: the columns hold level 1 only, the 31 angles above in two words;
    # a stack of layers read in place at a traced index, an empty row, and the library's
    # default blocking and splits (S not a multiple of its 128-token block)
    Case(2, 1, 4, 130, 64, "polarquant:b3", (130, 0), layers=3, block_s=None, splits=None),
)


class TestPolarDecode(RotatedSuite):
    KEY_FORMAT = PolarFormat
    entry = staticmethod(api.polar_decode)
    reference = staticmethod(reference.polar_decode)
    CASES = CASES
    UNSUPPORTED = (
        (Case(1, 1, 4, 20, 128, "polarquant:b5", (20,)), "5-bit angles"),
        # below full depth the angles stay one dense stream (and fp16 radii)
        (Case(1, 1, 4, 20, 128, "polarquant:b3,l4", (20,)), "one dense stream"),
    )
    DROP = (Case(2, 2, 4, 37, 128, "polarquant:b3", (37, 37), splits=3), [21, 37])
    IMPL = "polar_decode"
    NEEDLE_SPECS = ("polarquant:b3 window=16 sinks=4", "polarquant:b3 window=16 page=64")

    def encoded(self, case: Case, seed: int = 0):
        """The case's corner of the :data:`CODED` encoding."""
        q, params, k_codes, v_codes = encoded(case.spec, *CODED, case.head_dim, seed)

        def cut(a):
            return a[:case.batch, :case.heads, :case.slots]

        return (q[:case.batch, :case.heads, :case.group],
                jax.tree.map(lambda a: a[:case.heads], params), jax.tree.map(cut, k_codes),
                jax.tree.map(cut, v_codes))

    def inputs(self, case: Case) -> dict:
        _, k_fmt, v_fmt = formats(case.spec, PolarFormat)
        if api.unsupported(case.head_dim, v_fmt.bits, v_fmt.group,
                           **k_fmt.options(case.head_dim)):
            # refused before any array is read: words of the shape are enough
            return {**api.random_inputs(
                jax.random.key(0), batch=case.batch, heads=case.heads, group=case.group,
                slots=case.slots, head_dim=case.head_dim, angle_bits=k_fmt.bits,
                value_bits=v_fmt.bits), **self.static(case)}
        return super().inputs(case)

    @pytest.mark.parametrize("head_dim", [128, 64])
    def test_reference_agrees_with_the_codecs(self, head_dim):
        """The reference's scores and values are the codecs' own: its partial equals the
        attention over ``scores`` (the decoded keys' dots) of the same arrays (both
        layouts: D = 128 holds the top angles in the columns' slots, D = 64 in words of
        their own)."""
        got, want = self.reference_and_codecs(
            Case(*CODED, head_dim, "polarquant:b3", (CODED[-1], 11)))
        np.testing.assert_allclose(got, want, atol=2e-4)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("bits", range(1, 8))
def test_column_layout_stores_the_dense_streams_bits(head_dim, bits):
    """Where the column layout applies, every stored angle has its own bits inside the
    ``D B`` bits that the dense stream rounds up to, and the codec decodes the same
    vectors from it as from the dense stream."""
    offsets = column_layout(head_dim, bits)
    if head_dim == 128 and bits <= max(api.ANGLE_BITS):
        assert offsets is not None  # every width the kernel reads, at the common head dim
    if offsets is None:
        return
    widths = np.asarray(angle_widths(head_dim, bits))
    dense_bits = 8 * -(-int(widths.sum()) // 8)
    assert dense_bits == head_dim * bits
    taken = np.zeros(head_dim * bits, int)
    for o, w in zip(offsets, widths, strict=True):
        assert (o >= 0) == (w > 0)
        taken[o:o + w] += 1
    assert taken.max() <= 1 and taken.sum() == widths.sum()


def test_column_layout_decodes_like_the_dense_stream(monkeypatch):
    codec = PolarQuantCodec(bits=3)
    params = codec.init(jax.random.key(0), 64)
    x = jax.random.normal(jax.random.key(1), (5, 64))
    codes = jax.jit(codec.encode)(params, x)
    assert codes["angles"].dtype == jnp.uint32 and codes["angles"].shape == (5, 6)
    want = jax.jit(codec.decode)(params, codes)
    monkeypatch.setattr(PolarQuantCodec, "column_offsets", lambda self, head_dim: None)
    dense = jax.jit(codec.encode)(params, x)
    assert dense["angles"].dtype == jnp.uint8 and dense["angles"].nbytes == 5 * 24
    np.testing.assert_array_equal(jax.jit(codec.decode)(params, dense), want)


def test_the_kernel_plans_its_reads_from_the_offsets():
    # 3 bits at D = 128: levels 1..3 in the columns (a 16-bit and an 8-bit unit), the
    # top angles read four slots to a word column
    wide = plan(128, 3, column_layout(128, 3))
    assert wide.depth == 3 and wide.views == (8, 16, 32)
    assert len({(r.bits, r.unit) for level in wide.top for r in level}) == 4
    assert [len(level) for level in wide.top] == [8, 4, 2, 1]
    # at D = 64 level 1 alone fits whole units; the rest is read as word columns
    narrow = plan(64, 3, column_layout(64, 3))
    assert narrow.depth == 1 and narrow.views == (8, 32)
    # a layout whose level-1 codes are not in column units cannot be read
    dense = tuple(range(0, 63 * 3, 3))
    assert "16 units" in plan(64, 2, dense)
    assert np.array_equal(np.sort(query_columns(128)), np.arange(128))
    assert query_columns(128)[:3].tolist() == [0, 8, 16]


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_level_one_lookup_folds_only_what_it_must(bits):
    """Up to 8 level-1 centroids are read from tables of their own cosines and sines,
    any codebook; 16 or 32 are folded onto the half circle or the first quadrant, which
    assumes uniform centroids: checked against the real ones, a skewed codebook
    refused."""
    centroids = PolarQuantCodec(bits=bits).level_centroids(128)
    assert uniform_error(centroids[0]) < 1e-7  # float32 rounding
    skewed = (centroids[0][0] + 0.01, *centroids[0][1:])
    folded = len(centroids[0]) > 8
    assert Trig.of(1, centroids[0]).uniform == folded
    assert (uniform_error(skewed) > 1e-3) == folded
    options = {**PolarFormat.options(formats(f"polarquant:b{bits}", PolarFormat)[1], 128)}
    options["centroids"] = (skewed, *options["centroids"][1:])
    reason = api.unsupported(128, max(bits, 2), 32, **options)
    assert ("not uniform" in reason) if folded else reason is None
    # a deep level looks its cosines and sines up in tables of its own
    trig = Trig.of(2, centroids[1])
    assert not trig.uniform and len(trig.cos) == len(centroids[1])


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16, jnp.uint32])
def test_level_one_lookups_in_every_unit(bits, dtype):
    """The level-1 cosines and sines of every code, read at a bit inside the unit: the
    register lookups' float16 tables (bytes, 16-bit units) or float32 select chains
    (32-bit units; 16 centroids folded to the quadrant there) against the centroids'
    own."""
    centroids = PolarQuantCodec(bits=bits).level_centroids(128)[0]
    codes = jnp.arange(len(centroids), dtype=dtype)[:, None]
    read = Read(jnp.dtype(dtype).itemsize * 8, 0, 1, bits + 1)
    cos, sin = Trig.of(1, centroids)(codes << 1 | 1, read, asm=False)
    atol = 1e-7 if dtype == jnp.uint32 else 2.5e-4  # float16: half an ulp below 1
    np.testing.assert_allclose(np.asarray(cos)[:, 0], np.cos(centroids), atol=atol)
    np.testing.assert_allclose(np.asarray(sin)[:, 0], np.sin(centroids), atol=atol)


@pytest.mark.parametrize("head_dim,bits", [(64, 2), (64, 3), (64, 4), (128, 1), (128, 2),
                                           (128, 3), (128, 4), (256, 2), (256, 3)])
def test_unit_vectors_through_the_ptx(monkeypatch, head_dim, bits):
    """The compiled kernel's lookups (inline PTX, run by the units' emulator) rebuild the
    same unit vectors as interpret mode's jnp forms, bit for bit, over random words: the
    offsets, tables and signs the key reader hands the PTX are those it means."""
    plan_ = plan(head_dim, bits, column_layout(head_dim, bits))
    trig = trig_tables(PolarQuantCodec(bits=bits).level_centroids(head_dim))
    words = np.random.default_rng(bits).integers(
        0, 1 << 32, (8, head_dim * bits // 32), dtype=np.uint32)
    refs = {b: np.asarray(key_view(jnp.asarray(words), b)) for b in plan_.views}

    def load(ref, ds):
        return jnp.asarray(ref[:, ds.start:ds.start + ds.size])

    want = unit_vectors(plan_, trig, load, refs, asm=False)

    def emulated(ptx, args):
        return jnp.asarray(run(ptx, [np.asarray(a) for a in args]))

    monkeypatch.setattr(units, "run_ptx", emulated)
    monkeypatch.setattr(kernel, "run_ptx", emulated)
    got = unit_vectors(plan_, trig, load, refs, asm=True)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_malformed_arrays_raise():
    _, k_fmt, _ = formats("polarquant:b3", PolarFormat)
    options = k_fmt.options(128)
    kw = api.random_inputs(jax.random.key(0), batch=1, heads=1, group=2, slots=8,
                           head_dim=128, angle_bits=3, value_bits=3)
    static = {**options, "value_bits": 3, "value_group": 32, "sm_scale": 0.1}
    with pytest.raises(ValueError, match="k_norm must have shape"):
        api.polar_decode(**{**kw, "k_norm": kw["k_norm"][..., :4]}, **static)
    with pytest.raises(ValueError, match="k_codes must be uint32"):
        api.polar_decode(**{**kw, "k_codes": kw["k_codes"].astype(jnp.uint8)}, **static)
    with pytest.raises(ValueError, match="127 angle offsets"):
        api.polar_decode(**kw, **{**static, "offsets": options["offsets"][:-1]})
    with pytest.raises(ValueError, match="level 2 has 4 centroids"):
        api.polar_decode(**kw, **{**static, "centroids": (options["centroids"][0], (0.5,),
                                                           *options["centroids"][2:])})
    with pytest.raises(NotImplementedError, match="no QJL"):
        api.polar_decode(**{**kw, "k_qjl": kw["k_codes"]}, **static)
