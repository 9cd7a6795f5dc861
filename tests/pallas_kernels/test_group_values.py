"""The shared value side of the kernels over group-wise INT values: which channel
groups a plane holds, what it refuses, and that its reference dequantizes as the value
codec decodes (the kernels' own suites check the in-kernel form against it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import GroupIntFormat
from kvjax.spec import parse_codec
from pallas_kernels import group_values


def test_value_planes_hold_one_group_per_half():
    assert group_values.parity_groups(128, 4, 32) == ((0, 2), (0, 2), (1, 3), (1, 3))
    assert group_values.parity_groups(128, 4, 8) is None
    assert "mix within a half" in group_values.unsupported(4, 8, 128)
    assert "neither planar nor split" in group_values.unsupported(5, 32, 128)
    assert "not a power of two" in group_values.unsupported(4, 24, 128)
    assert group_values.unsupported(3, 32, 128) is None


@pytest.mark.parametrize("spec", ["kivi:3,g32,token", "kivi:4,g32,token", "kivi:2,g64,token"])
def test_reference_dequantizes_like_the_codec(spec):
    codec = parse_codec(spec)
    [fmt] = [f for f in codec.kernel_formats() if isinstance(f, GroupIntFormat)]
    x = jax.random.normal(jax.random.key(0), (2, 7, 128))
    codes = codec.encode(None, x)
    got = group_values.dequantize(*fmt.arrays(codes), fmt.bits, fmt.group, 128)
    np.testing.assert_allclose(got, codec.decode(None, codes), rtol=1e-3, atol=1e-3)


def test_malformed_value_arrays_raise():
    tokens = (1, 2, 5)
    codes = jnp.zeros((*tokens, 16), jnp.uint32)
    scale = jnp.zeros((*tokens, 4), jnp.float16)
    group_values.check_arrays(codes, scale, scale, tokens, 128, 4, 32)
    with pytest.raises(ValueError, match="v_codes must have shape"):
        group_values.check_arrays(codes[..., :8], scale, scale, tokens, 128, 4, 32)
    with pytest.raises(ValueError, match="v_zero must have shape"):
        group_values.check_arrays(codes, scale, scale[..., :2], tokens, 128, 4, 32)
    with pytest.raises(ValueError, match="uint32"):
        group_values.check_arrays(codes.astype(jnp.int32), scale, scale, tokens, 128, 4, 32)
