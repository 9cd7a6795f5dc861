"""The adapter between a cache layer view and the fused kernels: the formats codecs
offer, the arrays it takes out of a view, the raw sinks and window it merges, and a
model's decode step through the kernel."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax.attention import REGISTRY, Call, NoImplementationError, attend, fused
from kvjax.codec import DenseFormat, IntFormat
from kvjax.spec import parse_cache, parse_codec
from pallas_kernels.int_decode import api, reference
from pallas_kernels.partial import normalize
from tests.kvjax.attention.helpers import build_layer

ATOL = 3e-3   # the kernel's float16 operands (tests/pallas_kernels/test_int_decode.py)
#: compiled on a GPU, Pallas interpret mode elsewhere
INTERPRET = jax.default_backend() != "gpu"


@pytest.mark.parametrize("spec,want", [
    ("int:4", IntFormat(bits=4)),
    ("int:3", IntFormat(bits=3)),
    ("bf16", "bfloat16"),
    ("f32", "float32"),
    ("kivi:2,g32", None),
    ("fp8", None),
    ("int:4,med3", None),
])
def test_kernel_formats_of_codecs(spec, want):
    formats = parse_codec(spec).kernel_formats()
    if want is None:
        assert formats == ()
    elif isinstance(want, str):
        [fmt] = formats
        assert isinstance(fmt, DenseFormat) and fmt.dtype == jnp.dtype(want)
        codec = parse_codec(spec)
        codes = codec.encode({}, jnp.ones((3, 8)))
        np.testing.assert_array_equal(fmt.values(codes), codec.values(codes))
    else:
        assert formats == (want,)


@pytest.mark.parametrize("spec", ["saw:h32,signs", "saw:h64,kv", "saw", "saw:signs,kv"])
def test_saw_offers_rotated_int_codes(spec):
    codec = parse_codec(spec)
    [fmt] = codec.kernel_formats()
    assert fmt.bits == 4 and fmt.rotate is not None
    params = codec.init(jax.random.key(0), 64)
    r = fmt.rotation(params, 64)
    x = jax.random.normal(jax.random.key(1), (5, 64))
    # full float32: a GPU would run a default-precision matmul in TF32
    rotated = jnp.matmul(x, r.T, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(rotated, codec.rotate(params, x), atol=1e-5)
    r = np.asarray(r, np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(64), atol=1e-5)
    codes = codec.encode(params, x)
    k_codes, scale, zero = fmt.arrays(codes)
    assert k_codes.shape == (5, 8) and scale.shape == zero.shape == (5,)
    assert IntFormat(bits=4).rotation(params, 64) is None


@functools.partial(jax.jit, static_argnames=("kernel", "options"))
def _decode(q, view, lengths, kernel, options=()):
    entry = api.int_decode if kernel else reference.int_decode
    return fused.int_codes_decode(q, view, lengths, entry=entry, **dict(options))


@pytest.mark.parametrize(
    "spec_k,spec_v,window,sinks,lengths,group",
    [
        ("int:4", "int:4", 0, 0, [45, 12], 4),       # no raw region but the decode token
        ("int:4", "int:4", 8, 2, [45, 3], 4),        # sinks + window; row 1 all raw
        ("saw:h64,signs", "int:4", 16, 0, [60, 30], 7),
        ("saw:h32,kv", "saw:h32,kv", 4, 0, [33], 1),  # rotated V, rotated back
        ("int:8", "int:8", 64, 0, [40], 4),          # window holds everything
        ("int:4", "saw:h32", 4, 0, [33], 4),         # V by SAW without "kv": still rotated
        # biased int8 lattice codes, a linear map (not a rotation) on the query and output
        ("hyperquant:e8,4bps,int8", "hyperquant:e8,4bps,int8", 8, 2, [45, 3], 4),
    ],
)
def test_layer_decode_matches_reference_attention(spec_k, spec_v, window, sinks, lengths,
                                                  group):
    heads, head_dim = 2, 128
    view, step, qkey = build_layer(spec_k, spec_v, lengths=lengths, window=window,
                                   sinks=sinks, heads=heads, head_dim=head_dim)
    q = jax.random.normal(qkey, (len(lengths), 1, heads * group, head_dim))
    want = attend(q, view, step, impl="reference")[:, 0]
    lengths_now = step.start + step.valid
    got = _decode(q[:, 0], view, lengths_now, True,
                  (("block_s", 16), ("splits", 2), ("interpret", INTERPRET)))
    np.testing.assert_allclose(got, want, atol=ATOL)
    spec_path = _decode(q[:, 0], view, lengths_now, False)
    np.testing.assert_allclose(spec_path, want, atol=2e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_saw_block_reaches_the_kernel(head_dim):
    """Plain ``saw`` (block = the head dim here) through the kernel: the query's rotation
    is built at the head dim of the query, as the codes were."""
    view, step, qkey = build_layer("saw:signs,kv", "saw:signs,kv", lengths=[40, 21],
                                   window=4, sinks=0, heads=1, head_dim=head_dim)
    q = jax.random.normal(qkey, (2, 1, 4, head_dim))
    want = attend(q, view, step, impl="reference")[:, 0]
    got = _decode(q[:, 0], view, step.start + step.valid, True,
                  (("block_s", 16), ("splits", 2), ("interpret", INTERPRET)))
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_merged_attention_hands_the_coded_region_to_the_kernel():
    """The kernel sees the grouped queries and the coded counts; the sinks and the
    window are merged in by the adapter."""
    view, step, qkey = build_layer("int:4", "int:4", lengths=[40, 9], window=8, sinks=4,
                                   heads=2, head_dim=64)
    q = jax.random.normal(qkey, (2, 8, 64))
    lengths = step.start + step.valid
    fmt, seen = IntFormat(bits=4), {}

    def coded(qg, n_comp):
        seen.update(qg=qg, n_comp=n_comp)
        return reference.int_decode(qg, *fmt.arrays(view.k.codes), *fmt.arrays(view.v.codes),
                                    n_comp, bits=4, sm_scale=64**-0.5)

    out = fused.merged_attention(q, view, lengths, 64**-0.5, coded)
    np.testing.assert_array_equal(seen["qg"], q.reshape(2, 2, 4, 64))
    np.testing.assert_array_equal(seen["n_comp"], view.k.counts(lengths)[1])
    assert seen["n_comp"].tolist() == [41 - 4 - 8, 0]
    np.testing.assert_allclose(out, attend(q[:, None], view, step)[:, 0], atol=2e-5)


@pytest.mark.parametrize("spec_k,spec_v,head_dim,kw,reason", [
    ("kivi:2,g32", "int:4", 128, {}, "K 'kivi:2,g32' offers no int-codes kernel format"),
    ("int:4", "fp8", 128, {}, "V 'fp8' offers no int-codes kernel format"),
    ("int:4", "int:8", 128, {}, "bit widths differ"),
    ("int:3", "int:3", 128, {}, "not planar-packed"),
    ("int:4", "int:4", 80, {}, "power of two"),
    ("int:4", "int:4", 128, {"num_queries": 2, "sliding_window": 8}, "sliding window"),
    ("int:4", "int:4", 128, {"sliding_window": 8}, "sliding window"),
    ("hyperquant:e8,4bps,dither,int8", "int:8", 128, {},
     "K 'hyperquant:e8,4bps,dither,int8' offers no int-codes kernel format"),
    ("hyperquant:e8,4bps,int8", "int:8", 128, {}, "code offsets differ (128 vs None)"),
])
def test_why_the_kernel_does_not_apply(spec_k, spec_v, head_dim, kw, reason):
    config = kc.CacheConfig(k=spec_k, v=spec_v)
    cache = kc.init_cache(jax.random.key(0), config, num_layers=1, batch=1, num_kv_heads=1,
                          head_dim=head_dim, max_len=64)
    num_queries = kw.get("num_queries", 1)
    step = kc.make_step(cache, num_queries)
    view = kc.append(cache.layer(0), jnp.ones((1, num_queries, 1, head_dim)),
                     jnp.ones((1, num_queries, 1, head_dim)), step)
    q = jnp.ones((1, num_queries, 4, head_dim))
    call = Call(q=q, layer=view, step=step, lengths=step.start + step.valid, scale=1.0,
                sliding_window=kw.get("sliding_window"))
    got = REGISTRY["int_decode"].supports(call)
    assert reason in got
    with pytest.raises(NoImplementationError, match=re.escape(reason)):
        attend(q, view, step, sliding_window=kw.get("sliding_window"), impl="int_decode")


@pytest.mark.parametrize("k,v,kernel", [
    ("saw:h32", "int:4", "int_decode"),
    ("turboquant:b3,qjl", "kivi:3,g32,token", "codebook_decode"),
    ("hyperquant:d4,4bps,int8", "hyperquant:d4,4bps,int8", "int_decode"),
    ("hqmq:s96,r4,med2,mb16,mp5,mpool", "hqmq:s96,r4,med2,mb16,mp5,mpool", "hqmq_decode"),
])
def test_model_decode_step_through_the_kernel(k, v, kernel):
    """A decode step of a tiny llama (two layers scanned over stacked codes): kernel vs
    reference logits, chosen by the cache config's attention list, after one prefill
    through the reference (a prefill through the kernel: the kernel suites' chunk
    cases)."""
    from models import llama
    from models.config import ModelConfig

    config = ModelConfig(family="llama", vocab_size=64, hidden_size=128,
                         intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=64, max_position_embeddings=64)
    params = llama.init_params(jax.random.key(0), config)
    prompt = jax.random.randint(jax.random.key(1), (2, 21), 0, config.vocab_size)
    logits = {}
    cache_config = kc.CacheConfig(k=k, v=v, residual_window=4, attention=("reference",))
    cache = llama.new_cache(config, cache_config, batch=2, max_len=32, dtype=jnp.float32)
    _, prompted = llama.jit_forward(params, config, prompt, cache, jnp.array([21, 13]))
    for impl in (("reference",), (kernel, "reference")):
        cache = dataclasses.replace(prompted, config=dataclasses.replace(cache_config,
                                                                         attention=impl))
        step_logits, _ = llama.jit_forward(params, config, prompt[:, :1], cache, None)
        logits[impl[0]] = np.asarray(step_logits)
    scale = np.max(np.abs(logits["reference"]))
    np.testing.assert_allclose(logits[kernel], logits["reference"], atol=1e-2 * scale)
    assert not np.array_equal(logits[kernel], logits["reference"])  # really the kernel


@pytest.mark.parametrize("spec,reason", [
    ("int:4", "K 'int:4' offers no CodebookFormat"),
    ("k=turboquant:b4 v=int:4", "V 'int:4' offers no group-wise INT kernel format"),
    ("turboquant:b5", "5-bit key codes"),
    ("turboquant:b4", None),
    ("turboquant:b3,qjl", None),
])
def test_when_the_codebook_kernel_applies(spec, reason):
    config = parse_cache(spec)
    cache = kc.init_cache(jax.random.key(0), config, num_layers=1, batch=1, num_kv_heads=1,
                          head_dim=128, max_len=64)
    step = kc.make_step(cache, 1)
    view = kc.append(cache.layer(0), jnp.ones((1, 1, 1, 128)), jnp.ones((1, 1, 1, 128)), step)
    call = Call(q=jnp.ones((1, 1, 4, 128)), layer=view, step=step,
                lengths=step.start + step.valid, scale=1.0, sliding_window=None)
    got = REGISTRY["codebook_decode"].supports(call)
    assert got == reason if reason is None else reason in got


@pytest.mark.parametrize("spec,name", [
    ("int:4", "int_decode"),
    ("k=saw:h32,signs v=int:4", "int_decode"),
    ("hyperquant:e8,4bps,int8", "int_decode"),
    ("turboquant:b4", "codebook_decode"),
    ("octopus:b4,qjl", "octopus_decode"),
    ("hqmq", "hqmq_decode"),
    ("hyperquant:e8,3bps", "rice_decode"),
    ("hyperquant:e8,3bps,haar", "rice_decode"),
    ("hyperquant:e8,4bps,signs", "rice_decode"),
])
def test_kernel_call_binds_the_kernel_to_a_cache(spec, name):
    """What the benchmarks time: the kernel that reads the spec, over arrays taken from
    the codecs' own codes (per-head parameters, tokens repeated), equals attention over
    the codecs' decode of those codes."""
    config = parse_cache(spec)
    batch, heads, group, slots, head_dim = 2, 2, 4, 40, 128
    call = fused.kernel_call(config.k, config.v, batch=batch, heads=heads, slots=slots,
                             head_dim=head_dim, key=jax.random.key(3), distinct=24)
    assert call.name == name and call.read_bytes > 0
    q = jax.random.normal(jax.random.key(4), (batch, heads, group, head_dim))
    got = normalize(*call(q, block_s=16, interpret=INTERPRET))
    k_params, k_codes, v_params, v_codes = call.codecs
    keys, values = (jax.vmap(codec.decode, in_axes=(0, 1), out_axes=1)(params, codes)
                    for codec, params, codes in ((config.k, k_params, k_codes),
                                                 (config.v, v_params, v_codes)))
    assert keys.shape == (batch, heads, slots, head_dim)
    np.testing.assert_array_equal(keys[:, :, 24:], keys[:, :, :16])  # repeated tokens
    if config.k.scores_reconstruct:
        s = jnp.einsum("bkgd,bksd->bkgs", q, keys, precision="highest")
    else:
        s = jax.vmap(config.k.scores, in_axes=(0, 1, 1), out_axes=1)(k_params, q, k_codes)
    want = jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(s * head_dim**-0.5, axis=-1), values,
                      precision="highest")
    np.testing.assert_allclose(got, want, atol=ATOL)


@pytest.mark.parametrize("spec", ["hqmq:s96,r4,med3", "hqmq:s96,r4,med3,mp10,mpool"])
def test_kernel_call_repeats_whole_blocks_of_outlier_codes(spec):
    """A cache of Med-C codes (blocks of 32 tokens; fixed or pooled slots) bound to the
    HQMQ kernel: the outliers reach it, and the kernel equals attention over the codecs'
    decode."""
    config = parse_cache(spec)
    batch, heads, group, slots, head_dim = 1, 2, 4, 96, 64
    call = fused.kernel_call(config.k, config.v, batch=batch, heads=heads, slots=slots,
                             head_dim=head_dim, key=jax.random.key(3), distinct=64)
    assert call.name == "hqmq_decode" and "k_outliers" in call.arrays
    assert call.arrays["k_outlier_flags"].shape[2] == slots // 32
    assert ("k_outlier_start" in call.arrays) == config.k.pooled
    q = jax.random.normal(jax.random.key(4), (batch, heads, group, head_dim))
    got = normalize(*call(q, interpret=INTERPRET))
    k_params, k_codes, v_params, v_codes = call.codecs
    keys, values = (jax.vmap(codec.decode, in_axes=(0, 1), out_axes=1)(params, codes)
                    for codec, params, codes in ((config.k, k_params, k_codes),
                                                 (config.v, v_params, v_codes)))
    np.testing.assert_array_equal(keys[:, :, 64:], keys[:, :, :32])  # repeated blocks
    s = jnp.einsum("bkgd,bksd->bkgs", q, keys, precision="highest")
    want = jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(s * head_dim**-0.5, axis=-1), values,
                      precision="highest")
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_no_kernel_reads_names_every_reason():
    config = parse_cache("fp8")
    with pytest.raises(ValueError, match=r"int_decode: K 'fp8' offers no int-codes.*"
                                         r"codebook_decode: K 'fp8' offers no Codebook"):
        fused.find_kernel(config.k, config.v, 128)


@pytest.mark.parametrize("kernel,spec,reason", [
    ("hqmq_decode", "hqmq", None),
    ("hqmq_decode", "k=hqmq v=int:4", "V 'int:4' offers no HQMQ kernel format"),
    ("hqmq_decode", "k=hqmq v=hqmq:s48,r4", "streams differ in layout"),
    ("hqmq_decode", "hqmq:s24,r3", "not whole bytes and nibbles"),
    ("hqmq_decode", "hqmq:s96,r4,med3", None),
    ("hqmq_decode", "k=hqmq:s96,r4,med3 v=hqmq", None),
    ("hqmq_decode", "k=hqmq:s96,r4,med3,mpool v=hqmq:s96,r4,med3", None),
    ("hqmq_decode", "k=hqmq:s96,r4,med3,mb16 v=hqmq:s96,r4,med3", "outlier blocks differ"),
    ("hqmq_decode", "hqmq:s96,r4,med3,mb8", "outlier blocks of 8 tokens"),
    ("hqmq_decode", "int:4,med3", "offers no"),
    ("rice_decode", "hyperquant:e8,3bps", None),
    ("rice_decode", "hyperquant:e8,3bps,dither", "offers no Rice kernel format"),
    ("rice_decode", "hyperquant:d4,3bps", "reads E8 streams"),
    ("rice_decode", "k=hyperquant:e8,3bps v=hyperquant:e8,4bps", "blocks differ in layout"),
    ("rice_decode", "k=hyperquant:e8,3bps v=int:4", "V 'int:4' offers no Rice"),
])
def test_when_the_hqmq_and_rice_kernels_apply(kernel, spec, reason):
    config = parse_cache(spec)
    got = REGISTRY[kernel].reads(config.k, config.v, 128)
    if reason is None:
        assert not isinstance(got, str)
    else:
        assert reason in got
