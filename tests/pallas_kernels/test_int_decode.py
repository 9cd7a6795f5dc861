"""The fused INT-N decode-attention kernel (Pallas, interpret mode on CPU) against its
pure-jnp reference, and its layer-level entry point against kvjax's reference attention.

Tolerance: the kernel rounds its matmul operands (the query, and the probabilities times
the value scales) to float16 and accumulates in float32, so it differs from the exact
reference by about 1e-3 of the output's magnitude; outputs here are O(1), and the
tolerance below is 3e-3 absolute. A kernel that drops or repeats a block of tokens, or
mixes up two query heads, misses by far more (tested).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax.attention import attend
from kvjax.codecs import IntCodec, SawCodec
from kvjax.primitives.packing import unpack_bits
from pallas_kernels.int_decode import api
from pallas_kernels.int_decode.kernel import (
    codes_partial,
    operand_width,
    pad_query_rows,
    unit_permutation,
    unit_view,
)
from pallas_kernels.int_decode.reference import (
    codes_partial_reference,
    merge_partials,
    normalize,
)

ATOL = 3e-3
#: compiled on a GPU, Pallas interpret mode elsewhere
INTERPRET = jax.default_backend() != "gpu"


def coded(codec, params, x):
    codes = codec.encode(params, x)
    return codes["codes"], codes["scale"][..., 0], codes["zero"][..., 0]


# The helpers below run as one compiled program each: op-by-op dispatch would compile
# dozens of small programs for every new shape, which costs more than the kernel itself.


@functools.partial(jax.jit, static_argnames=("batch", "heads", "group", "slots", "head_dim",
                                             "bits", "saw_block", "seed"))
def random_case(batch, heads, group, slots, head_dim, bits, saw_block=None, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, heads, group, head_dim))
    k = jax.random.normal(keys[1], (batch, heads, slots, head_dim))
    v = jax.random.normal(keys[2], (batch, heads, slots, head_dim))
    rotation = None
    if saw_block:
        saw = SawCodec(block=saw_block, bits=bits, signs=True)
        params = saw.init(keys[3], head_dim)
        k_arrays = coded(saw, params, k)
        r = saw.rotate(params, jnp.eye(head_dim)).T
        rotation = jnp.broadcast_to(r, (heads, head_dim, head_dim))
    else:
        k_arrays = coded(IntCodec(bits=bits), None, k)
    return q, k_arrays, coded(IntCodec(bits=bits), None, v), rotation


@functools.partial(jax.jit, static_argnames=("bits", "block_s", "splits", "layout",
                                             "rotate_in_kernel"))
def run_kernel(q, k_arrays, v_arrays, n_comp, rotation, *, bits, block_s, splits,
               layout="halves", rotate_in_kernel=False):
    group = q.shape[2]
    q_rows = pad_query_rows(q, operand_width(q.shape[-1], bits, layout))
    o, m, l = codes_partial(q_rows, *k_arrays, *v_arrays, n_comp, rotation, bits=bits,
                            layout=layout,
                            sm_scale=q.shape[-1] ** -0.5, block_s=block_s, splits=splits,
                            interpret=INTERPRET, rotate_in_kernel=rotate_in_kernel)
    return normalize(*merge_partials((o[..., :group, :], m[..., :group], l[..., :group]),
                                     axis=2))


@functools.partial(jax.jit, static_argnames="bits")
def run_reference(q, k_arrays, v_arrays, n_comp, rotation, *, bits):
    return normalize(*codes_partial_reference(q, *k_arrays, *v_arrays, n_comp, bits=bits,
                                              sm_scale=q.shape[-1] ** -0.5,
                                              rotation=rotation))


@pytest.mark.parametrize(
    "batch,heads,group,slots,head_dim,bits,saw,block_s,splits,lengths",
    [
        # int4 at D=128 (32 columns per plane: matrix path), GQA 4, ragged rows, 3 splits
        (3, 2, 4, 70, 128, 4, None, 16, 3, [70, 23, 0]),
        # GQA 1 and 7, lengths not multiples of the block
        (1, 1, 1, 37, 128, 4, None, 16, 2, [37]),
        (2, 1, 7, 41, 128, 8, None, 16, 2, [41, 17]),
        # the narrowest matrix operands (16 columns: int4 at D=64, int2 at D=128)
        (2, 2, 3, 33, 64, 4, None, 16, 2, [33, 5]),
        (1, 1, 4, 29, 128, 2, None, 16, 1, [29]),
        # 8 columns (int2 at D=64): the broadcast path
        (2, 1, 3, 21, 64, 2, None, 16, 2, [21, 9]),
        # SAW: the query rotated (with its columns permuted) before the kernel
        (2, 2, 4, 50, 128, 4, 32, 16, 2, [50, 31]),
        (1, 1, 4, 24, 64, 8, 64, 16, 1, [24]),
    ],
)
def test_kernel_matches_reference(batch, heads, group, slots, head_dim, bits, saw, block_s,
                                  splits, lengths, layout="halves", **kw):
    q, k_arrays, v_arrays, rotation = random_case(batch, heads, group, slots, head_dim, bits,
                                                  saw)
    n_comp = jnp.array(lengths, jnp.int32)
    got = run_kernel(q, k_arrays, v_arrays, n_comp, rotation, bits=bits, block_s=block_s,
                     splits=splits, layout=layout, **kw)
    want = run_reference(q, k_arrays, v_arrays, n_comp, rotation, bits=bits)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=ATOL)
    # an empty row attends to nothing: zeros, like the reference
    for b, n in enumerate(lengths):
        if n == 0:
            assert np.all(np.asarray(got[b]) == 0)


@pytest.mark.parametrize("layout", ["halves", "bytes"])
@pytest.mark.parametrize("head_dim,bits", [(128, 4), (64, 4), (128, 2), (64, 8), (256, 2)])
def test_unit_permutation_matches_unpacking(head_dim, bits, layout):
    codes = jax.random.bits(jax.random.key(3), (5, head_dim * bits // 32), jnp.uint32)
    dims = np.asarray(unpack_bits(codes, bits, head_dim))
    units = np.asarray(unit_view(codes, layout)).astype(np.uint32)
    perm = unit_permutation(head_dim, bits, layout)
    per_unit = (16 if layout == "halves" else 8) // bits
    planes = np.concatenate([(units >> (bits * j)) & ((1 << bits) - 1)
                             for j in range(per_unit)], axis=-1)
    np.testing.assert_array_equal(planes, dims[:, perm])
    assert sorted(perm) == list(range(head_dim))


def test_rotation_inside_the_kernel():
    """The SAW query rotated by every program instead of before the kernel."""
    test_kernel_matches_reference(2, 2, 4, 50, 128, 4, 32, 16, 2, [50, 31],
                                  rotate_in_kernel=True)


@pytest.mark.parametrize("head_dim,group,lengths", [(128, 4, [70, 0])])
def test_bytes_layout_matches_reference(head_dim, group, lengths):
    """The 8-bit-unit layout with int-to-float conversions."""
    test_kernel_matches_reference(len(lengths), 2, group, max(lengths), head_dim, 4, None,
                                  16, 2, lengths, layout="bytes")


def test_tolerance_catches_a_dropped_block():
    q, k_arrays, v_arrays, _ = random_case(1, 1, 4, 48, 128, 4)
    full = run_reference(q, k_arrays, v_arrays, jnp.array([48]), None, bits=4)
    short = run_reference(q, k_arrays, v_arrays, jnp.array([32]), None, bits=4)
    assert np.max(np.abs(np.asarray(full - short))) > 10 * ATOL


def build_layer(codec_k, codec_v, *, lengths, window, sinks, heads, head_dim, seed=1):
    """A one-layer cache after a prefill of ``lengths`` tokens and one decode append."""
    return _build_layer(codec_k, codec_v, tuple(lengths), window, sinks, heads, head_dim,
                        seed)


@functools.partial(jax.jit, static_argnums=tuple(range(8)))
def _build_layer(codec_k, codec_v, lengths, window, sinks, heads, head_dim, seed):
    batch = len(lengths)
    max_len = max(lengths) + 1
    config = kc.CacheConfig(k=codec_k, v=codec_v, residual_window=window, sink_tokens=sinks)
    cache = kc.init_cache(jax.random.key(seed), config, num_layers=1, batch=batch,
                          num_kv_heads=heads, head_dim=head_dim, max_len=max_len,
                          dtype=jnp.bfloat16)
    keys = jax.random.split(jax.random.key(seed + 1), 4)
    total = max(lengths)
    k = jax.random.normal(keys[0], (batch, total + 1, heads, head_dim))
    v = jax.random.normal(keys[1], (batch, total + 1, heads, head_dim))
    step = kc.make_step(cache, total, jnp.array(lengths))
    view = kc.append(cache.layer(0), k[:, :total], v[:, :total], step)
    cache = kc.commit(cache.with_layer(0, view), step)
    step = kc.make_step(cache, 1)
    view = kc.append(cache.layer(0), k[:, total:], v[:, total:], step)
    return view, step, keys[2]


@pytest.mark.parametrize(
    "spec_k,spec_v,window,sinks,lengths,group",
    [
        ("int:4", "int:4", 0, 0, [45, 12], 4),       # no raw region but the decode token
        ("int:4", "int:4", 8, 2, [45, 3], 4),        # sinks + window; row 1 all raw
        ("saw:h64,signs", "int:4", 16, 0, [60, 30], 7),
        ("saw:h32,kv", "saw:h32,kv", 4, 0, [33], 1),  # rotated V, rotated back
        ("int:8", "int:8", 64, 0, [40], 4),          # window holds everything
    ],
)
def test_layer_decode_matches_reference_attention(spec_k, spec_v, window, sinks, lengths,
                                                  group):
    heads, head_dim = 2, 128
    view, step, qkey = build_layer(spec_k, spec_v, lengths=lengths, window=window,
                                   sinks=sinks, heads=heads, head_dim=head_dim)
    q = jax.random.normal(qkey, (len(lengths), 1, heads * group, head_dim))
    want = attend(q, view, step)[:, 0]
    lengths_now = step.start + step.valid
    got = api.decode_attention(q[:, 0], view, lengths_now, block_s=16, splits=2,
                               interpret=INTERPRET)
    np.testing.assert_allclose(got, want, atol=ATOL)
    spec_path = api.decode_attention(q[:, 0], view, lengths_now, use_kernel=False)
    np.testing.assert_allclose(spec_path, want, atol=2e-5)


def test_attend_pallas_dispatch_and_fallback():
    heads, head_dim = 1, 128
    view, step, qkey = build_layer("int:4", "int:4", lengths=[20], window=0, sinks=0,
                                   heads=heads, head_dim=head_dim)
    q = jax.random.normal(qkey, (1, 1, 4, head_dim))
    want = attend(q, view, step)
    with warnings.catch_warnings():
        # the kernel applies: no fallback warning
        warnings.simplefilter("error", UserWarning)
        got = attend(q, view, step, impl="pallas")
    np.testing.assert_allclose(got, want, atol=ATOL)
    view3, step3, _ = build_layer("int:3", "int:3", lengths=[20], window=0, sinks=0,
                                  heads=heads, head_dim=head_dim)
    with pytest.warns(UserWarning, match="not planar-packed"):
        got3 = attend(q, view3, step3, impl="pallas")
    np.testing.assert_array_equal(got3, attend(q, view3, step3))
    # "auto" never warns: on a CPU it is the reference itself, on a GPU the kernel
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        auto = attend(q, view3, step3, impl="auto")
        auto4 = attend(q, view, step, impl="auto")
    np.testing.assert_array_equal(auto, got3)
    if INTERPRET:
        np.testing.assert_array_equal(auto4, want)
    else:
        np.testing.assert_allclose(auto4, want, atol=ATOL)


@pytest.mark.parametrize("window,sinks,lengths", [(0, 0, [37, 5]), (8, 2, [40, 3, 0])])
def test_bf16_decode_path_matches_reference(window, sinks, lengths):
    """impl="xla" over a bf16 cache: bfloat16 operands (the stored values are bfloat16
    already; the query and the probabilities are rounded), float32 softmax."""
    view, step, qkey = build_layer("bf16", "bf16", lengths=lengths, window=window,
                                   sinks=sinks, heads=2, head_dim=64)
    q = jax.random.normal(qkey, (len(lengths), 1, 8, 64))
    want = attend(q, view, step)
    got = attend(q, view, step, impl="xla")
    assert not np.array_equal(got, want)   # a different path, not the reference again
    np.testing.assert_allclose(got, want, atol=2e-2)
    # other codecs: the reference itself
    view4, step4, _ = build_layer("int:4", "int:4", lengths=lengths, window=window,
                                  sinks=sinks, heads=2, head_dim=64)
    np.testing.assert_array_equal(attend(q, view4, step4, impl="xla"),
                                  attend(q, view4, step4))


@pytest.mark.parametrize("spec_k,spec_v,head_dim,kw,reason", [
    ("kivi:2,g32", "int:4", 128, {}, "not int:N or saw"),
    ("int:4", "fp8", 128, {}, "not int:N or saw"),
    ("int:4", "int:8", 128, {}, "bit widths differ"),
    ("int:3", "int:3", 128, {}, "not planar-packed"),
    ("int:4", "int:4", 80, {}, "power of two"),
    ("int:4", "int:4", 128, {"num_queries": 2}, "one query token"),
    ("int:4", "int:4", 128, {"sliding_window": 8}, "sliding window"),
])
def test_why_not(spec_k, spec_v, head_dim, kw, reason):
    config = kc.CacheConfig(k=spec_k, v=spec_v)
    cache = kc.init_cache(jax.random.key(0), config, num_layers=1, batch=1, num_kv_heads=1,
                          head_dim=head_dim, max_len=64)
    got = api.why_not(cache.layer(0), kw.get("num_queries", 1), kw.get("sliding_window"))
    assert reason in got
    with pytest.raises(ValueError, match="does not apply"):
        if "num_queries" in kw or "sliding_window" in kw:
            raise ValueError(f"int_decode kernel does not apply: {got}")
        api.decode_attention(jnp.zeros((1, 1, head_dim)), cache.layer(0), jnp.array([1]))


def test_default_blocking():
    assert api.default_blocking(None, None) == (128, 3)
    assert api.default_blocking(32, 4) == (32, 4)


def test_default_splits():
    # waves of 1056 programs of 2 warps
    assert api.default_splits(1, 8, 1 << 17, 128) == 119     # 952 programs: 0.90 of a wave
    assert api.default_splits(32, 8, 1 << 15, 128) == 4      # 1024
    assert api.default_splits(32, 8, 1 << 15, 128, num_warps=4) == 2    # 512 of 528
    assert api.default_splits(200, 8, 1 << 15, 128) == 1
    assert api.default_splits(1, 8, 100, 64) == 2            # no more splits than blocks
    for warps in (2, 4):
        wave = api.SMS * api.WARPS_PER_SM // warps
        for batch in range(1, 80):
            for heads in (3, 8):
                programs = batch * heads * api.default_splits(batch, heads, 1 << 20, 64, warps)
                waves = -(-programs // wave)
                assert programs / (waves * wave) >= 0.75, (batch, heads)


@pytest.mark.filterwarnings("ignore:impl='pallas'")   # the prefill falls back, as it says
def test_model_decode_step_through_the_kernel():
    """A decode step of a tiny llama over an int:4 cache: kernel vs reference logits."""
    import dataclasses

    from models import llama
    from models.config import ModelConfig

    config = ModelConfig(family="llama", vocab_size=64, hidden_size=128,
                         intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=64, max_position_embeddings=64,
                         attention_impl="reference")
    params = llama.init_params(jax.random.key(0), config)
    prompt = jax.random.randint(jax.random.key(1), (2, 21), 0, config.vocab_size)
    cache_config = kc.CacheConfig(k="saw:h32", v="int:4", residual_window=4)
    logits = {}
    for impl in ("reference", "pallas"):
        cfg = dataclasses.replace(config, attention_impl=impl)
        cache = llama.new_cache(cfg, cache_config, batch=2, max_len=32, dtype=jnp.float32)
        _, cache = llama.jit_forward(params, cfg, prompt, cache, jnp.array([21, 13]))
        step_logits, _ = llama.jit_forward(params, cfg, prompt[:, :1], cache, None)
        logits[impl] = np.asarray(step_logits)
    scale = np.max(np.abs(logits["reference"]))
    np.testing.assert_allclose(logits["pallas"], logits["reference"], atol=1e-2 * scale)
    assert not np.array_equal(logits["pallas"], logits["reference"])  # really the kernel
