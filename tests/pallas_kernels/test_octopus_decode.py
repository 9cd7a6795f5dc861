"""The fused OCTOPUS decode-attention kernel's entry against its pure-jnp reference (the
kernel suite), over arrays that OCTOPUS (MSE and QJL) and KIVI's value codec really
store, and the byte layout the kernel reads.

Tolerance: the suite's over rotated keys (:mod:`tests.pallas_kernels.rotated`); the
unit vectors rounded to float16 are each triplet's scaled ``x, y, z``, lifted from
magnitudes and scaled by norm levels that the register lookups hold in float16 too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import OctopusFormat
from kvjax.codecs import octopus
from kvjax.codecs.octopus import byte_layout
from kvjax.primitives.octahedral import octahedral_decode
from pallas_kernels import units
from pallas_kernels.octopus_decode import api, reference
from pallas_kernels.octopus_decode.kernel import (
    Window,
    directions,
    norm_levels,
    plan,
    query_columns,
)
from tests.pallas_kernels.rotated import Case, RotatedSuite
from tests.pallas_kernels.test_units import run as emulate

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
    # 4-bit norm codes: 16 levels, two register lookups and a select
    Case(1, 1, 4, 33, 128, "octopus:d4,n4", (33,)),
    # the library's default blocking and splits (S not a multiple of its 128-token block)
    Case(1, 1, 4, 130, 128, "octopus:b3", (130,), block_s=None, splits=None),
)


class TestOctopusDecode(RotatedSuite):
    KEY_FORMAT = OctopusFormat
    entry = staticmethod(api.octopus_decode)
    reference = staticmethod(reference.octopus_decode)
    CASES = CASES
    UNSUPPORTED = (
        (Case(1, 1, 4, 20, 128, "octopus:b2", (20,)), "one dense stream"),
        (Case(1, 1, 4, 20, 128, "octopus:d4,n8", (20,)), "256 norm levels"),
    )
    DROP = (Case(1, 1, 4, 48, 128, "octopus:b3", (48,)), [32])
    IMPL = "octopus_decode"
    # the QJL arrays reach the entry through the adapter code the codebook kernel's
    # needle covers
    NEEDLE_SPECS = ("octopus:b3 window=16 sinks=4", "octopus:b3 window=16 page=64")

    def test_reference_agrees_with_the_codecs(self):
        """The reference's scores and values are the codecs' own: its partial equals the
        attention over the codec's ``scores`` (the decoded keys' dots plus QJL's term;
        the byte layout of ``octopus:b3``'s split) of the same arrays."""
        got, want = self.reference_and_codecs(Case(2, 2, 4, 30, 128, "octopus:b4,qjl", (30, 11)))
        np.testing.assert_allclose(got, want, atol=2e-4)


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


@pytest.fixture(params=[False, True], ids=["jnp", "ptx"])
def asm(request, monkeypatch):
    """Both forms of the key reader's lookups: the jnp form interpret mode runs, and the
    compiled kernel's inline PTX run on the host by the units' emulator."""
    if request.param:
        monkeypatch.setattr(units, "run_ptx", lambda ptx, args: jnp.asarray(
            emulate(ptx, [np.asarray(a) for a in args])))
    return request.param


def test_directions_lift_every_byte(asm):
    """All 256 direction bytes: the select-free fold equals the codec's octahedral decode
    of the float16-rounded magnitudes, and the rounding moves a unit direction's
    coordinates by less than a float16 step at 1 (the matmul operands' own rounding)."""
    magnitudes = octopus.direction_magnitudes(4)
    byte = np.arange(256, dtype=np.uint8).reshape(16, 16)
    got = np.stack([np.asarray(v) for v in directions(jnp.asarray(byte), magnitudes, asm)],
                   axis=-1)
    got = got / np.linalg.norm(got, axis=-1, keepdims=True)

    def decode(table):
        table = np.asarray(table, np.float32)

        def coordinate(code):
            return np.where(code & 8, -table[code & 7], table[code & 7])

        return np.asarray(octahedral_decode(jnp.asarray(coordinate(byte & 15)),
                                            jnp.asarray(coordinate(byte >> 4))))

    rounded = np.asarray(magnitudes, np.float16).astype(np.float32)
    np.testing.assert_allclose(got, decode(rounded), atol=1e-6)
    np.testing.assert_allclose(got, decode(magnitudes), atol=2.0**-10)


def _check_norm_levels(windows, norm_bits, asm, width=16):
    norms = octopus.norm_levels(128, norm_bits)
    rng = np.random.default_rng(norm_bits)
    starts = sorted({start for w in windows for _, _, start, _ in w.runs})
    tiles = {start: rng.integers(0, 256, (8, width), dtype=np.uint8) for start in starts}
    column = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
    rounded = np.asarray(norms, np.float16).astype(np.float32)
    for window in windows:
        got = np.asarray(norm_levels(window, {s: jnp.asarray(t) for s, t in tiles.items()},
                                     norms, column, asm))
        for lo, hi, start, slot in window.runs:
            code = (tiles[start][:, lo:hi + 1] >> norm_bits * slot) & ((1 << norm_bits) - 1)
            np.testing.assert_array_equal(got[:, lo:hi + 1], rounded[code])


@pytest.mark.parametrize("norm_bits", [1, 2, 4])
def test_norm_levels_read_every_run(asm, norm_bits):
    """Every triplet column of every direction window reads its own norm code's level
    (float16-rounded) from the merged runs, at whatever slots they hold the codes."""
    steps = plan(byte_layout(43, norm_bits))
    _check_norm_levels(steps.windows, norm_bits, asm, steps.width)


@pytest.mark.parametrize("norm_bits", [2, 4])
def test_norm_levels_shift_runs_either_way(asm, norm_bits):
    """Runs below the window's common slot are shifted up to it (no layout of the codec
    needs that today), runs above it down."""
    window = Window(0, ((0, 5, 0, 0), (6, 10, 0, 1), (11, 15, 16, 1)))
    _check_norm_levels([window], norm_bits, asm)
    _check_norm_levels([Window(0, ((0, 7, 0, 1), (8, 15, 16, 0)))], norm_bits, asm)
