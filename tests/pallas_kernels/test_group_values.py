"""The shared value side of the kernels over group-wise INT values: which channel
groups a plane holds, what it refuses, and that its reference dequantizes as the value
codec decodes (the kernels' own suites check the in-kernel form against it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.codec import GroupIntFormat
from kvjax.primitives.packing import pack_codes
from kvjax.spec import parse_codec
from pallas_kernels import group_values
from pallas_kernels.units import unit_view


def test_plane_groups():
    # 16-bit units of 4-bit codes: even columns one group, odd columns another
    assert group_values.plane_groups(128, 4, 32) == (
        ((0, 0, 32, None), (2, 0, 32, 1)), ((0, 0, 32, None), (2, 0, 32, 1)),
        ((1, 0, 32, None), (3, 0, 32, 1)), ((1, 0, 32, None), (3, 0, 32, 1)))
    # byte planes: plane j is the quarter j of the dims
    for bits in (2, 3):
        assert group_values.plane_groups(128, bits, 32) == tuple(
            ((j, 0, 32, None),) for j in range(4))
        assert group_values.plane_groups(64, bits, 32) == tuple(
            ((j // 2, 0, 16, None),) for j in range(4))
        assert group_values.plane_groups(256, bits, 32) == tuple(
            ((2 * j, 0, 64, None), (2 * j + 1, 32, 64, None)) for j in range(4))
    assert group_values.plane_groups(128, 4, 8) is None
    assert "mix too finely" in group_values.unsupported(4, 8, 128)
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


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_planes_read_the_codes(bits):
    """Column ``c`` of plane ``j`` read the value side's way (16-bit units, bytes, or
    bytes beside the low or high nibble of unit ``c // 2``'s top byte) is the code of dim
    ``perm[j * width + c]``."""
    head_dim = 128
    codes = np.random.default_rng(1).integers(0, 1 << bits, (5, head_dim))
    words = pack_codes(jnp.asarray(codes), bits)
    view, planes, perm = group_values.value_layout(head_dim, bits)
    width = head_dim // planes
    halves = np.asarray(unit_view(words, "halves")).astype(np.int64)
    bytes_ = np.asarray(unit_view(words, "bytes")).astype(np.int64)
    column = np.arange(width)
    for j in range(planes):
        if view == "halves":
            got = (halves >> (bits * j)) & ((1 << bits) - 1)
        elif view == "bytes":
            got = (bytes_ >> (2 * j)) & 3
        else:
            top = bytes_[:, width + column // 2] >> (4 * (column % 2))
            got = ((bytes_[:, :width] >> (2 * j)) & 3) | ((top >> j) & 1) << 2
        np.testing.assert_array_equal(got, codes[:, perm[j * width:(j + 1) * width]])


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
