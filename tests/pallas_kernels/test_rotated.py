"""The pipeline every kernel over rotated keys shares (:mod:`pallas_kernels.rotated`):
the blocking a call gets where it sets none. (Each kernel's numbers are tested by its
own suite, :mod:`tests.pallas_kernels.rotated`.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kvjax.attention import fused
from kvjax.eval.kernel_ops import _first, kernel_ops
from kvjax.spec import parse_cache
from pallas_kernels import codebook_decode, octopus_decode, polar_decode
from pallas_kernels.flash import BLOCKING as LIBRARY

BLOCKINGS = [
    ("turboquant:b3", codebook_decode.kernel.SPLIT_BLOCKING),
    ("turboquant:b4", LIBRARY),
    ("polarquant:b3", polar_decode.kernel.BLOCKING),
    ("octopus:b3", octopus_decode.kernel.BLOCKING),
]


def _blocking(spec: str, group: int, **options) -> tuple[int, int, int]:
    """``(block_s, num_warps, num_stages)`` of the compiled path's ``pallas_call`` for
    ``group`` query rows per kv head, traced (nothing compiles)."""
    config = parse_cache(spec)
    call = fused.kernel_call(config.k, config.v, batch=1, heads=1, slots=1024,
                             head_dim=128, key=jax.random.key(0))
    q = jax.ShapeDtypeStruct((1, 1, group, 128), jnp.float32)
    traced = jax.make_jaxpr(lambda q: call(q, interpret=False, **options))(q)
    params = _first(traced.jaxpr, "pallas_call").params["compiler_params"]
    block_s = kernel_ops(spec, group=group, **options).block_s
    return block_s, params.num_warps, params.num_stages


@pytest.mark.parametrize("spec, blocking", BLOCKINGS, ids=[s for s, _ in BLOCKINGS])
def test_a_decode_takes_its_kernels_blocking_and_a_chunk_the_librarys(spec, blocking):
    assert _blocking(spec, group=4) == blocking
    # a chunk's programs hold more rows than a decode step's: not what was measured
    assert _blocking(spec, group=64) == LIBRARY


def test_what_a_call_sets_overrides_the_kernels_blocking():
    block_s, warps, stages = polar_decode.kernel.BLOCKING
    assert _blocking("polarquant:b3", group=4, block_s=64) == (64, warps, stages)
    assert _blocking("polarquant:b3", group=4, num_warps=4, num_stages=1) == (block_s, 4, 1)
