"""The conformance suite: every registered codec, and the outlier wrapper, on the examples
it declares (:attr:`kvjax.codec.Codec.examples`).

Per example: the round trip within the error the example states, the bits formula equal
to the bits of the stored arrays, vmap over heads (each with its own parameters, as the
cache calls a codec) equal to one call per head, determinism under a seed, non-finite
input (an error eagerly, finite codes under jit), all-zero and constant rows, bad head
dims, an empty token axis, and the spec round trip. Per codec: the codes under jit equal
to eager ones, examples that exist and use every declared option, and one-line errors
with the usage for bad option values.

A codec registered without examples fails here. Each example compiles two programs (the
vmapped round trip and the one-head round trip) that every check reads; eager dispatch,
which compiles op by op, runs once per codec.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import Codec, CodecError, Example, measured_bits_per_element
from kvjax.codecs.outliers import MedOutlierCodec
from kvjax.spec import parse_codec, registered
from tests.kvjax.codecs.compiled import FAST_COMPILE, encode_decode

#: every codec class: the registered ones and the outlier wrapper
CLASSES = [*(cls for _, cls in sorted(registered().items())), MedOutlierCodec]
CASES = [pytest.param(cls, example, id=example.spec)
         for cls in CLASSES for example in cls.examples]
FIRST = [pytest.param(cls, cls.examples[0], id=cls.name)
         for cls in CLASSES if cls.examples]

HEADS = 2
#: the slices of every input batch ``x[HEADS, len(SLICES), T, D]``
SLICES = ("shared", "gauss", "zero", "const", "negconst", "nonfinite")
CONSTANTS = {"const": 0.37, "negconst": -3.3}
ZERO_ROWS = (1, 6)  # rows of the "gauss" slice set to zero
BAD_AT = {np.nan: (0, 3), np.inf: (2, 5), -np.inf: (5, 0)}  # (token, channel)


def at(name: str) -> int:
    return SLICES.index(name)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def roundtrip_heads(codec, params, x):
    """:func:`encode_decode` vmapped over a leading head axis of ``params`` and ``x``."""

    def one(p, v):
        codes = codec.encode(p, v)
        return codes, codec.decode(p, codes)

    return jax.vmap(one)(params, x)


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def empty_round_trip(codec, params, x, q):
    """Codes, reconstruction and scores of ``q`` against ``x``, in one program."""
    codes = codec.encode(params, x)
    return codes, codec.decode(params, codes), codec.scores(params, q, codes)


def tokens(codec: Codec) -> int:
    """The fewest whole blocks of the codec holding 12 tokens."""
    return codec.block_tokens * math.ceil(12 / codec.block_tokens)


def make_batch(codec: Codec, d: int) -> np.ndarray:
    """``x[HEADS, len(SLICES), T, D]``: the "shared" slice is the same for every head."""
    t = tokens(codec)
    rng = np.random.default_rng(d)
    x = np.zeros((HEADS, len(SLICES), t, d), np.float32)
    x[:, at("shared")] = rng.standard_normal((t, d))
    x[:, at("gauss")] = rng.standard_normal((HEADS, t, d))
    x[:, at("gauss"), list(ZERO_ROWS)] = 0.0
    for name, value in CONSTANTS.items():
        x[:, at(name)] = value
    x[:, at("nonfinite")] = rng.standard_normal((HEADS, t, d))
    for bad, (token, channel) in BAD_AT.items():
        x[:, at("nonfinite"), token, channel] = bad
    return x


def init_heads(codec: Codec, d: int, seed: int = 0):
    """Parameters of each head from its own key, vmapped as the cache draws them."""
    keys = jax.random.split(jax.random.key(seed), HEADS)
    return jax.vmap(lambda key: codec.init(key, d))(keys)


def head(tree, h: int):
    return jax.tree.map(lambda a: a[h], tree)


def leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
        for x, y in zip(map(np.asarray, la), map(np.asarray, lb), strict=True))


def leaves_close(a, b) -> bool:
    return all(np.allclose(np.asarray(x, np.float64), np.asarray(y, np.float64))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def rel_mse(x, x_hat) -> float:
    x, x_hat = np.asarray(x, np.float64), np.asarray(x_hat, np.float64)
    return float(np.sum((x - x_hat) ** 2) / np.sum(x**2))


@functools.cache
def run(spec: str, d: int) -> dict:
    """Everything the checks of one example read, from the two compiled programs."""
    codec = parse_codec(spec)
    x = make_batch(codec, d)
    params = init_heads(codec, d)
    codes, x_hat = roundtrip_heads(codec, params, jnp.asarray(x))
    # one head at a time: the same program for every head
    one = [encode_decode(codec, head(params, h), jnp.asarray(x[h])) for h in range(HEADS)]
    again = init_heads(codec, d)
    again_codes, _ = roundtrip_heads(codec, again, jnp.asarray(x))
    return {
        "codec": codec, "x": x, "params": params, "codes": codes, "x_hat": np.asarray(x_hat),
        "one_codes": [c for c, _ in one], "one_hat": [np.asarray(v) for _, v in one],
        "again": again, "again_codes": again_codes,
    }


# -- what every codec declares -----------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.name)
def test_every_codec_declares_examples_that_use_every_option(cls):
    assert cls.examples, f"codec '{cls.name}' declares no examples: add some to {cls.__name__}"
    used = set()
    for example in cls.examples:
        assert isinstance(example, Example) and example.rel_mse >= 0
        codec = parse_codec(example.spec)
        assert type(codec) is cls
        rest = example.spec.partition(":")[2]
        tokens_ = rest.split(",") if rest else []
        for opt in cls.options:
            if any(opt.match(t) is not None or (opt.form == "value" and t.isdigit())
                   for t in tokens_):
                used.add(opt.field)
    unused = [opt.syntax for opt in cls.options if opt.field not in used]
    assert not unused, f"no example of '{cls.name}' uses {unused}"


@pytest.mark.parametrize("cls", [c for c in CLASSES if c.options], ids=lambda cls: cls.name)
def test_bad_option_values_give_one_line_with_the_usage(cls):
    spec = cls.examples[0].spec
    name, _, rest = spec.partition(":")
    tokens_ = rest.split(",") if rest else []
    usage = f"; usage: {cls.usage()}"

    def index(opt):
        for i, t in enumerate(tokens_):
            if opt.match(t) is not None or (opt.form == "value" and t.isdigit()):
                return i
        return None

    def expect(bad_tokens, needle):
        bad = f"{name}:{','.join(bad_tokens)}"
        with pytest.raises(CodecError) as err:
            parse_codec(bad)
        message = str(err.value)
        assert needle in message and message.endswith(usage), (bad, message)
        assert "\n" not in message

    for opt in cls.options:
        if opt.choices and opt.type is int:
            value = max(opt.choices) + 1
        elif opt.hi is not None:
            value = opt.hi + 1 if opt.type is int else opt.hi * 2
        else:
            continue
        i = index(opt)
        bad_tokens = [*tokens_, opt.render(value)] if i is None else \
            [*tokens_[:i], opt.render(value), *tokens_[i + 1:]]
        expect(bad_tokens, f"{opt.label} must be {opt.requirement()}")
    for opt in cls.options:
        i = index(opt)
        if i is not None and opt.form != "value":
            expect([*tokens_, tokens_[i]], "given twice")
    # a codec whose one option is a bare value reads every option as that value; the
    # wrapper hands options it does not know to the base codec
    only_value = [opt.form for opt in cls.options] == ["value"]
    if cls is not MedOutlierCodec:
        expect([*tokens_, "zz9"], "expected exactly one" if only_value else
               "unknown option 'zz9'")


# -- per example -------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "example"), CASES)
def test_round_trip_within_the_stated_error(cls, example):
    r = run(example.spec, example.head_dim)
    x, x_hat = r["x"], r["x_hat"]
    assert x_hat.shape == x.shape and x_hat.dtype == np.float32
    gauss = [at("shared"), at("gauss")]
    assert rel_mse(x[:, gauss], x_hat[:, gauss]) <= example.rel_mse
    if not r["codec"].lossy:
        assert np.all(np.abs(x_hat[:, gauss] - x[:, gauss]) <= 2.0**-8 * np.abs(x[:, gauss]))


@pytest.mark.parametrize(("cls", "example"), CASES)
def test_bits_formula_equals_the_stored_bits(cls, example):
    r = run(example.spec, example.head_dim)
    measured = measured_bits_per_element(r["codes"], r["x"].size)
    assert r["codec"].bits_per_element(example.head_dim) == measured
    assert measured_bits_per_element(r["one_codes"][0], r["x"][0].size) == measured


@pytest.mark.parametrize(("cls", "example"), CASES)
def test_vmap_over_heads_equals_one_call_per_head(cls, example):
    r = run(example.spec, example.head_dim)
    for h in range(HEADS):
        assert leaves_equal(head(r["codes"], h), r["one_codes"][h])
        np.testing.assert_array_equal(r["x_hat"][h], r["one_hat"][h])


@pytest.mark.parametrize(("cls", "example"), CASES)
def test_seeds_decide_the_parameters(cls, example):
    r = run(example.spec, example.head_dim)
    # the same key twice: the same parameters and codes
    assert leaves_equal(r["params"], r["again"])
    assert leaves_equal(r["codes"], r["again_codes"])
    # two heads' keys, one input: other parameters and codes exactly when seeded
    shared = jax.tree.map(lambda a: np.asarray(a)[:, at("shared")], r["codes"])
    heads = head(r["params"], 0), head(r["params"], 1)
    if example.seeded:
        assert not leaves_close(*heads)
        assert not leaves_equal(head(shared, 0), head(shared, 1))
    else:
        assert leaves_equal(*heads) and leaves_equal(head(shared, 0), head(shared, 1))


@pytest.mark.parametrize(("cls", "example"), CASES)
def test_non_finite_input(cls, example):
    r = run(example.spec, example.head_dim)
    codec, x = r["codec"], r["x"]
    # under jit NaN/Inf are stored as finite numbers; outside jit they are an error
    assert np.all(np.isfinite(r["x_hat"][:, at("nonfinite")]))
    for bad, (token, channel) in BAD_AT.items():
        clean = x[0, at("gauss")].copy()
        clean[token, channel] = bad
        with pytest.raises(CodecError, match="NaN or Inf"):
            codec.encode(head(r["params"], 0), jnp.asarray(clean))


@pytest.mark.parametrize(("cls", "example"), CASES)
def test_zero_and_constant_rows(cls, example):
    r = run(example.spec, example.head_dim)
    codec, x, x_hat = r["codec"], r["x"], r["x_hat"]
    assert np.all(x_hat[:, at("zero")] == 0)
    rows = x_hat[:, at("gauss"), list(ZERO_ROWS)]
    assert np.all(np.isfinite(rows))
    if codec.block_tokens == 1:  # vectors are independent: zero rows among data stay 0
        assert np.all(rows == 0)
    for name in CONSTANTS:
        got = x_hat[:, at(name)]
        assert np.all(np.isfinite(got))
        # a constant row is one vector like any other: at most twice the Gaussian bound
        assert rel_mse(x[:, at(name)], got) <= 2 * example.rel_mse, name


@pytest.mark.parametrize(("cls", "example"), CASES)
def test_bad_head_dims_and_shapes(cls, example):
    codec = parse_codec(example.spec)
    for bad in (0, -4, 2.5, "64", *example.bad_head_dims):
        with pytest.raises(CodecError, match="head_dim"):
            codec.check_head_dim(bad)
        with pytest.raises(CodecError, match="head_dim"):
            codec.bits_per_element(bad)
        with pytest.raises(CodecError, match="head_dim"):
            codec.init(jax.random.key(0), bad)
    params = head(run(example.spec, example.head_dim)["params"], 0)
    with pytest.raises(CodecError, match="expected x"):
        codec.encode(params, jnp.zeros((example.head_dim,)))
    with pytest.raises(CodecError, match="floating"):
        codec.encode(params, jnp.zeros((tokens(codec), example.head_dim), jnp.int32))


@pytest.mark.parametrize(("cls", "example"), CASES)
def test_empty_token_axis(cls, example):
    """No tokens (T = 0), with and without leading axes: empty codes that decode to no
    vectors and score to no columns (traced as under jit: the shapes are what matter)."""
    codec, d = parse_codec(example.spec), example.head_dim
    params = codec.init(jax.random.key(0), d)
    for shape in ((0, d), (HEADS, 0, d)):
        q = jnp.ones((*shape[:-2], 3, d), jnp.float32)
        codes, x_hat, scores = empty_round_trip(codec, params, jnp.zeros(shape), q)
        assert x_hat.shape == shape and x_hat.dtype == jnp.float32
        assert all(0 in leaf.shape for leaf in jax.tree.leaves(codes))
        assert scores.shape == (*shape[:-2], 3, 0)


@pytest.mark.parametrize(("cls", "example"), CASES)
def test_spec_round_trip(cls, example):
    codec = parse_codec(example.spec)
    again = parse_codec(codec.spec)
    assert again == codec and hash(again) == hash(codec)
    assert again.spec == codec.spec
    value = codec.value_codec()
    assert parse_codec(value.spec) == value and parse_codec(value.spec).spec == value.spec


# -- per codec -----------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "example"), FIRST)
def test_jit_matches_eager(cls, example):
    r = run(example.spec, example.head_dim)
    codec, params = r["codec"], head(r["params"], 0)
    x = jnp.asarray(r["x"][0, at("gauss")])
    assert leaves_equal(codec.encode(params, x), head(r["one_codes"][0], at("gauss")))
