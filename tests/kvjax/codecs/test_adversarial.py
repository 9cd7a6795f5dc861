"""Adversarial inputs for every codec: the range and precision rule (README.md, "Range and
precision") on seeded extreme and degenerate vectors.

Every codec class, on each example it declares (the conformance suite's cases), gets
``example_count`` seeded batches (:mod:`tests.fuzz`; ``KVJAX_FUZZ_EXAMPLES`` runs more).
A batch holds :data:`ROWS` rows of whole codec blocks, each row one kind of vector
(:data:`KINDS`: Gaussian, Gaussian with an offset, outlier channels, tokens of ragged
scales, a spike over a faint background, one-hot, random signs, constant, all zero,
NaN/Inf among Gaussians), drawn at unit scale and multiplied by a power of two:
log-uniform from 1e-8 to 1e30 (float16 inputs: from 1e-3 to its largest value), or just
inside or just outside the codec's limits. The first batch also pins two vectors that
once went wrong (:data:`PINNED`). Inputs come in the case's dtype (float32,
bfloat16 or float16, by turns). What each row must give:

* outside ``jit``, ``encode`` raises a one-line :class:`CodecError` that starts with the
  spec for rows that are not finite or exceed :attr:`Codec.limits`;
* under ``jit``: a finite decode; ``in_range`` False exactly for those rows, which decode
  as their ``saturate``-d copy does (in range: the documented alteration), while in-range
  rows pass ``saturate`` unchanged (nothing is clipped silently);
* in range, the stated error: scaled by a power of two, a row decodes as that power times
  the decode of the row at unit scale, exactly, whenever the stored fp16 numbers scale
  with it (the error is relative: it does not depend on the magnitude); where they do
  not (metadata below fp16's smallest normal, fp8's floored scale, a dither drawn from
  the stored norms), the error is at most the codec's bound for the row's kind, relative,
  plus :data:`FLOOR_STEPS` times ``FP16_STEP`` per element, absolute.

The codec's bound for a kind, as relative squared error (:func:`bound`, also checked at
unit scale): an example states a bound for Gaussian vectors, and Gaussian rows are held
to twice it; constant rows to four times it (a constant lands anywhere on the grid once
the magnitude moves). The other kinds' error depends on each codec's design (two
outliers stretch a low-bit per-token grid so that the rest decodes coarsely; tokens of
ragged scales do the same to a per-channel grid), so they, and constant rows for codecs
that store a block coarser when it does not fit its budget (HyperQuant's Rice stream),
are held to no worse than decoding zero. Each case compiles one program (the batches
differ in values, not shapes), and NaN never comes out of finite input.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import FP16_STEP, Codec, CodecError, sanitize
from kvjax.spec import parse_codec
from tests.fuzz import example_count, rng
from tests.kvjax.codecs.compiled import FAST_COMPILE
from tests.kvjax.codecs.test_conformance import CASES, tokens

ROWS = 8
KINDS = ("gauss", "offset", "channels", "ragged", "spike", "onehot", "signs", "const", "zero",
         "nonfinite")
#: input dtypes, by turns over the cases
DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
#: the absolute error allowed per element where fp16 metadata is subnormal
FLOOR_STEPS = 2
EXAMPLES = example_count(3)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def round_trip(codec: Codec, params, ref: jax.Array, x: jax.Array):
    """One encode of ``[ref; x; saturate(x)]`` (rows of whole blocks are independent) and
    its decode, with ``in_range(x)`` and ``saturate(x)``."""
    sat = codec.saturate(sanitize(x))
    codes = codec.encode(params, jnp.concatenate([ref, x.astype(jnp.float32), sat]))
    return codes, codec.decode(params, codes), codec.in_range(x), sat


def fallback_capable(codec: Codec) -> bool:
    """Codecs that store a block coarser when it does not fit its budget."""
    base = getattr(codec, "base", codec)
    return base.name == "hyperquant" and not base.int8


def bound(codec: Codec, example, kind: str) -> float:
    """The relative squared error allowed for a row of ``kind`` (see the module doc)."""
    if kind == "gauss":
        return 2.0 * example.rel_mse
    if kind == "const" and not fallback_capable(codec):
        # a constant lands anywhere on the codec's grid once the magnitude moves: fp8's
        # floored scale no longer maps it onto 448, and e4m3 rounds it within 2^-4
        return 4.0 * example.rel_mse
    return 1.0


def unit_row(g: np.random.Generator, kind: str, t: int, d: int,
             background: float | None = None) -> np.ndarray:
    """A row ``[t, d]`` (float64) of ``kind``, scaled so its largest element is in [1, 2)
    (``background``: a spike's background as a power of two, else drawn)."""
    if kind == "zero":
        return np.zeros((t, d))
    if kind == "signs":
        v = g.choice([-1.0, 1.0], (t, d))
    elif kind == "onehot":
        v = np.zeros((t, d))
        v[np.arange(t), g.integers(0, d, t)] = g.choice([-1.0, 1.0], t)
    elif kind == "const":
        v = np.full((t, d), g.choice([-1.0, 1.0]))
    elif kind == "spike":
        faint = 2.0**background if background is not None else 10.0 ** g.uniform(-20, -1)
        v = g.standard_normal((t, d)) * faint
        v[np.arange(t), g.integers(0, d, t)] = g.choice([-1.0, 1.0], t)
    else:
        v = g.standard_normal((t, d))
        if kind == "offset":
            v += g.standard_normal()
        elif kind == "channels":
            v[:, g.choice(d, min(d, g.integers(1, 5)), replace=False)] *= g.uniform(10, 100)
        elif kind == "ragged":
            v *= 2.0 ** g.integers(-12, 13, (t, 1))
    v *= g.uniform(1, 2) / np.max(np.abs(v))
    if kind == "nonfinite":
        for _ in range(g.integers(1, 4)):
            v[g.integers(0, t), g.integers(0, d)] = g.choice([np.nan, np.inf, -np.inf])
    return v


def excess(codec: Codec, x: np.ndarray) -> np.ndarray:
    """Per token of finite ``x[..., T, D]``: how far beyond the codec's limits it is, as the
    larger of max|x_i| / element limit and |x| / norm limit (<= 1: in range)."""
    x = x.astype(np.float64)
    limits = codec.limits
    ratio = np.max(np.abs(x), axis=-1) / limits.element
    return np.maximum(ratio, np.linalg.norm(x, axis=-1) / limits.norm)


#: the first batch of every case starts with two vectors that once went wrong: one
#: coordinate near 1e30 over a unit background (PolarQuant below full depth decoded it
#: to NaN), and a vector of elements near 30000, within fp16, whose norm is not (norm
#: codecs shrank it silently)
PINNED = ((("spike", -100), 100), (("signs", 0), 14))


def draw(codec: Codec, g: np.random.Generator, t: int, d: int, dtype: np.dtype, index: int):
    """``(kinds, powers, ref, x)``: the rows' kinds, their power-of-two exponents, the
    rows at unit scale (float32) and scaled (``dtype``). A row that the dtype rounded
    away from its kind (float16's subnormals) is of kind ``"rounded"``, held to no bound
    of a kind at unit scale."""
    kinds = list(g.choice(KINDS, ROWS))
    # float16 holds 1e-3 .. 6e4 with its relative precision (smaller values are the cast's
    # business, not the codec's: float32 and bfloat16 inputs go down to 1e-8)
    low, top = (-3.0, 4.8) if dtype == np.float16 else (-8.0, 30.0)
    powers, ref, x = [], [], []
    for j, kind in enumerate(kinds):
        v = unit_row(g, kind, t, d)
        finite = np.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
        reach = float(np.max(excess(codec, finite)))
        if index == 0 and j < len(PINNED):
            (kind, background), k = PINNED[j]
            kinds[j] = kind
            v = unit_row(g, kind, t, d, background)
            if kind == "signs":
                v *= 1.5 / np.max(np.abs(v))
        elif g.random() < 0.3 and 0 < reach < math.inf and kind != "zero":
            # just inside or just outside the limits
            k = math.floor(-math.log2(reach)) + int(g.integers(-1, 2))
        else:
            k = round(math.log2(10.0 ** g.uniform(low, top)))
        with np.errstate(over="ignore"):
            scaled = np.ldexp(v, k).astype(dtype)
        powers.append(k)
        # the unit-scale row is the scaled one divided back (exact: a power of two), so the
        # two are proportional whatever the dtype rounded
        back = np.ldexp(scaled.astype(np.float64), -k)
        ref.append(np.nan_to_num(back, nan=0.0, posinf=0.0, neginf=0.0))
        if np.all(np.isfinite(back)) and rel_err(back, v) > 1e-4:
            kinds[j] = "rounded"
        x.append(scaled)
    return kinds, powers, np.stack(ref).astype(np.float32), np.stack(x)


def fp16_leaves(codes, row: int) -> list[np.ndarray]:
    """The stored fp16 arrays of one row of a codes pytree, as float64."""
    return [np.asarray(leaf[row], np.float64) for leaf in jax.tree.leaves(codes)
            if leaf.dtype == jnp.float16]


def rel_err(x_hat: np.ndarray, x: np.ndarray) -> float:
    x, x_hat = x.astype(np.float64), x_hat.astype(np.float64)
    total = np.sum(x * x)
    return float(np.sum((x - x_hat) ** 2) / total) if total > 0 else float(np.any(x_hat))


def check_eager(codec: Codec, params, g: np.random.Generator, row: np.ndarray,
                finite: bool, where: str) -> None:
    """Outside jit, a row that is not finite or out of range is a one-line error that
    starts with the spec (in a random leading shape)."""
    lead = [(), (2,), (1, 2)][g.integers(0, 3)]
    x = jnp.asarray(np.broadcast_to(row, (*lead, *row.shape)))
    with pytest.raises(CodecError) as err:
        codec.encode(params, x)
    message = str(err.value)
    assert message.startswith(f"{codec.spec}: ") and "\n" not in message, (where, message)
    assert ("NaN or Inf" if not finite else "exceeds") in message, (where, message)


@pytest.mark.parametrize(("cls", "example"), CASES)
def test_adversarial_inputs(cls, example):
    codec = parse_codec(example.spec)
    d, t = example.head_dim, tokens(codec)
    dtype = DTYPES[[c.id for c in CASES].index(example.spec) % len(DTYPES)]
    params = codec.init(jax.random.key(0), d)
    dithered = getattr(getattr(codec, "base", codec), "dither", False)
    floor = FLOOR_STEPS * FP16_STEP * math.sqrt(t * d)
    eager_done = 0
    for index in range(EXAMPLES):
        g = rng(f"adversarial {example.spec}", index)
        kinds, powers, ref, x = draw(codec, g, t, d, dtype, index)
        codes, x_hat, ok, sat = jax.tree.map(np.asarray, round_trip(codec, params, ref, x))
        hat_ref, hat_x, hat_sat = np.split(x_hat, 3)
        x32 = x.astype(np.float32)
        assert np.all(np.isfinite(x_hat)), (example.spec, index)
        for j, (kind, k) in enumerate(zip(kinds, powers, strict=True)):
            where = f"{example.spec} example {index} row {j}: {kind} x 2^{k} ({dtype})"
            finite = np.all(np.isfinite(x32[j]), axis=-1)
            reach = excess(codec, np.nan_to_num(x32[j], posinf=0.0, neginf=0.0))
            clear = np.abs(reach - 1) > 1e-5  # not within rounding of a limit
            assert np.array_equal(ok[j][clear], (finite & (reach <= 1))[clear]), where
            # the saturated copy is in range, decodes as the row does, and equals the row
            # wherever it was in range
            assert np.all(excess(codec, sat[j]) <= 1 + 1e-6), where
            np.testing.assert_array_equal(hat_x[j], hat_sat[j], err_msg=where)
            inside = ok[j]
            np.testing.assert_array_equal(sat[j][inside], x32[j][inside], err_msg=where)
            if kind == "zero":
                assert np.all(hat_ref[j] == 0) and np.all(hat_x[j] == 0), where
                continue
            limit = bound(codec, example, kind)
            if kind not in ("nonfinite", "rounded"):
                assert rel_err(hat_ref[j], ref[j]) <= limit, (where, "unit scale")
            if not np.all(inside):
                if eager_done < 2 * EXAMPLES:
                    eager_done += 1
                    check_eager(codec, params, g, x[j], bool(np.all(finite)), where)
                # saturating the norm keeps each vector's direction; clipping elements
                # (or an Inf among them) may leave any shape
                shaped = math.isinf(codec.limits.element) and np.all(finite)
                worst = limit if shaped else 1.0
                assert rel_err(hat_sat[j], sat[j]) <= worst, (where, "saturated")
                continue
            # every fp16 array either scales with the row (norms, scales, zero points) or
            # is scale-free (PolarQuant's radii of the unit vector)
            scale = 2.0**k
            exact = not dithered and all(
                np.array_equal(a, scale * b) or np.array_equal(a, b)
                for a, b in zip(fp16_leaves(codes, ROWS + j), fp16_leaves(codes, j),
                                strict=True))
            if exact:
                np.testing.assert_allclose(hat_x[j], scale * hat_ref[j].astype(np.float64),
                                           rtol=1e-6, atol=1e-30, err_msg=where)
            else:
                error = np.linalg.norm(hat_x[j].astype(np.float64) - x32[j])
                allowed = math.sqrt(limit) * np.linalg.norm(x32[j].astype(np.float64)) + floor
                assert error <= allowed, (where, error, allowed)


@pytest.mark.parametrize(("cls", "example"), CASES)
def test_head_dims_and_token_axes_give_clear_errors(cls, example):
    codec = parse_codec(example.spec)
    params = codec.init(jax.random.key(0), example.head_dim)
    t = tokens(codec)
    for index in range(EXAMPLES):
        g = rng(f"head dims {example.spec}", index)
        for d in g.integers(1, 300, 3):
            d = int(d)
            try:
                codec.check_head_dim(d)
            except CodecError as err:
                message = str(err)
                assert message.startswith(f"{codec.spec}: ") and "\n" not in message, message
                for call in (lambda d=d: codec.init(jax.random.key(0), d),
                             lambda d=d: codec.bits_per_element(d),
                             lambda d=d: codec.encode(params, jnp.zeros((t, d)))):
                    with pytest.raises(CodecError, match="head_dim"):
                        call()
    if codec.block_tokens > 1:
        with pytest.raises(CodecError, match=f"block of {codec.block_tokens} tokens"):
            codec.encode(params, jnp.zeros((t + 1, example.head_dim)))


def test_polarquant_below_full_depth_keeps_one_huge_coordinate_finite():
    # PolarQuant at l4 decoded a vector holding one coordinate near 1e30 to NaN (Inf under
    # jit): its radii overflowed fp16. Now such a vector is out of range: an error outside
    # jit, and under jit it is stored as its saturated copy, finite
    codec = parse_codec("polarquant:b3,l4")
    params = codec.init(jax.random.key(0), 64)
    x = np.random.default_rng(0).standard_normal((2, 4, 64)).astype(np.float32)
    x[1, :, 5] = [1e30, -1e30, 3e38, 1e20]
    _, x_hat, ok, sat = jax.tree.map(np.asarray, round_trip(codec, params, x[:1], x))
    assert np.all(np.isfinite(x_hat))
    assert ok[0].all() and not ok[1].any()
    _, hat_x, hat_sat = np.split(x_hat, [1, 3])
    np.testing.assert_array_equal(hat_x, hat_sat)
    # the saturated vectors point along the huge coordinate, at the largest fp16 norm
    np.testing.assert_allclose(np.linalg.norm(sat[1], axis=-1), 65504, rtol=1e-5)
    assert rel_err(hat_x[1], sat[1]) <= 2 * codec.examples[0].rel_mse
    with pytest.raises(CodecError, match=r"^polarquant:b3,l4: a vector norm of .* exceeds"):
        codec.encode(params, jnp.asarray(x[1]))
