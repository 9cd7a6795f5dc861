"""HyperQuant's Rice blocks as arrays: the sign fallback's packing round trip, the level
scales, and the rotated-frame decode against the codec's own."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.primitives.rice_blocks import (
    LADDER,
    rotated_tokens,
    sign_scale_codes,
    sign_scales,
    sign_words,
    unpack_signs,
)
from kvjax.spec import parse_codec


@pytest.mark.parametrize("tokens,head_dim,bits", [(8, 128, 8), (8, 64, 3), (4, 48, 0)])
def test_sign_fallback_round_trip(tokens, head_dim, bits):
    y = jax.random.normal(jax.random.key(0), (2, tokens * head_dim))
    codes = sign_scale_codes(y.reshape(2, tokens, head_dim), bits)
    words = sign_words(y, codes, bits, num_words=-(-tokens * head_dim // 32) + 3)
    signs, got = unpack_signs(words, tokens, head_dim, bits)
    np.testing.assert_array_equal(signs, np.where(np.asarray(y) >= 0, 1.0, -1.0))
    np.testing.assert_array_equal(got, codes)
    scales = sign_scales(codes, bits)
    if bits:
        np.testing.assert_allclose(scales, (np.asarray(codes) + 1.0) / (1 << bits))
    else:
        np.testing.assert_allclose(scales, math.sqrt(2 / math.pi))


def test_level_scales_halve_the_step_per_level():
    layout = parse_codec("hyperquant:e8,3bps").rice_layout(128)
    scales = np.asarray(layout.level_scale(jnp.arange(LADDER + 1)))
    np.testing.assert_allclose(scales[0], 1 / (layout.alpha * math.sqrt(128)), rtol=1e-6)
    np.testing.assert_allclose(scales[1:LADDER] / scales[:LADDER - 1], math.sqrt(2), rtol=1e-6)
    assert scales[LADDER] == scales[LADDER - 1]  # the sign level reads its own scales


@pytest.mark.parametrize("spec", ["hyperquant:e8,3bps", "hyperquant:d4,4bps,haar"])
def test_rotated_tokens_are_the_decode_before_the_inverse_rotation(spec):
    codec = parse_codec(spec)
    params = codec.init(jax.random.key(1), 64)
    x = jax.random.normal(jax.random.key(2), (24, 64))
    codes = codec.encode(params, x)
    y = rotated_tokens(codec.rice_layout(64), codes["stream"], codes["index"], codes["norm"])
    got = codec.unrotate_vectors(params, y.reshape(-1, 64))
    np.testing.assert_allclose(got, codec.decode(params, codes), atol=1e-5)
