"""A chunk's attention through the fused kernels (compiled on a GPU, Pallas interpret
mode elsewhere) against the float32 reference: ``"chunk_flash"`` over a 16-bit cache it
reads in place, the kernels over codes (``"int_decode"``, ``"dense_decode"`` with raw
sinks and window beside the codes) walking the stored codes tile by tile, and ``"xla"``'s
windows where no kernel serves (a sliding window over codes).

Tolerance: that of ``impl="xla"`` (tests/kvjax/attention/test_attention.py), whose
operand types are the same, 3e-2. Rounding the probabilities to bfloat16 (relative
``u = 2**-8``) moves an output by up to ``u * max |v_i - o|``, which for Gaussian values
over the few keys the chunk's first queries see reaches ~2e-2; a codec's values decoded
to bfloat16 (``int:4``) are rounded by ``u`` too. Measured here: up to ~1.2e-2, the same
as ``"xla"``'s.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax.attention import REGISTRY, Call, attend, auto_names, registered
from kvjax.attention.prefill import in_place_reason, supports
from kvjax.spec import parse_cache

ATOL = 3e-2
HEADS, HEAD_DIM, GROUP = 2, 32, 3
#: (tokens, valid per row) of the chunks appended one after the other (one shape, one
#: compilation)
CHUNKS = ((16, (16, 10)), (16, (16, 7)))


def _data(batch, total, layers=1, seed=0):
    """Keys, values ``[layers, B, total, K, D]`` and queries ``[B, total, N, D]``."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    shape = (layers, batch, total, HEADS, HEAD_DIM)
    q = jax.random.normal(k3, (batch, total, HEADS * GROUP, HEAD_DIM))
    return jax.random.normal(k1, shape), jax.random.normal(k2, shape), q


@pytest.mark.parametrize("spec,sliding,impl", [
    ("bf16", None, "chunk_flash"),              # one dense bf16 region: read in place
    ("bf16", 7, "chunk_flash"),
    ("int:4", None, "int_decode"),              # codes, read where they are
    ("bf16 sinks=2 window=3", None, "dense_decode"),  # raw sinks and window beside them
    ("int:4 sinks=3 window=4", 6, "xla"),       # no kernel has a sliding window
])
def test_chunks_match_the_reference(spec, sliding, impl):
    config = parse_cache(spec)
    batch, total = 2, sum(n for n, _ in CHUNKS)
    k, v, q = _data(batch, total)
    cache = kc.init_cache(jax.random.key(0), config, num_layers=1, batch=batch,
                          num_kv_heads=HEADS, head_dim=HEAD_DIM, max_len=total + 3)
    pos = 0
    for n, valid in CHUNKS:
        step = kc.make_step(cache, n, jnp.array(valid))
        view = kc.append(cache.layer(0), k[0, :, pos:pos + n], v[0, :, pos:pos + n], step)
        assert (in_place_reason(view, HEAD_DIM) is None) == (impl == "chunk_flash")
        chunk = q[:, pos:pos + n]
        got = attend(chunk, view, step, sliding_window=sliding, impl=impl)
        want = attend(chunk, view, step, sliding_window=sliding)
        assert got.shape == chunk.shape
        # the chunk's padding queries too: both see every stored key up to their position
        np.testing.assert_allclose(got, want, atol=ATOL)
        assert not np.array_equal(got, want)  # really the kernel
        cache = kc.commit(cache.with_layer(0, view), step)
        pos += n


def test_layers_scanned_over_their_stack_are_read_in_place():
    """In a scan over layers a view's codes are the segment's whole stack and its index:
    the kernel reads each layer's own (other layers hold other values)."""
    layers, batch, (n, valid) = 2, 2, CHUNKS[0]
    k, v, q = _data(batch, n, layers, seed=1)
    cache = kc.init_cache(jax.random.key(0), parse_cache("bf16"), num_layers=layers,
                          batch=batch, num_kv_heads=HEADS, head_dim=HEAD_DIM, max_len=n + 5)
    step = kc.make_step(cache, n, jnp.array(valid))

    def body(err, xs, view):
        view = kc.append(view, xs[0], xs[1], step)
        assert view.k.layer is not None and in_place_reason(view, HEAD_DIM) is None
        got = attend(q, view, step, impl="chunk_flash")
        want = attend(q, view, step, impl="reference")
        return jnp.maximum(err, jnp.max(jnp.abs(got - want))), view

    err, _ = jax.jit(lambda c: kc.scan_layers(body, jnp.float32(0), c, (k, v)))(cache)
    assert 0 < float(err) < ATOL


def test_registered_in_auto_on_a_gpu_only():
    assert "chunk_flash" in registered()
    impl = REGISTRY["chunk_flash"]
    assert impl.fused and impl.auto
    # before "dense_decode", which serves a bf16 cache's chunks too
    assert auto_names("gpu")[-4:] == ("chunk_flash", "dense_decode", "xla", "reference")
    assert "chunk_flash" not in auto_names("cpu")
    assert registered()[:4] == ("reference", "xla", "int_decode", "codebook_decode")


def _call(spec, tokens, head_dim=HEAD_DIM):
    cache = kc.init_cache(jax.random.key(0), parse_cache(spec), num_layers=1, batch=1,
                          num_kv_heads=1, head_dim=head_dim, max_len=16)
    step = kc.make_step(cache, tokens)
    kv = jnp.ones((1, tokens, 1, head_dim))
    view = kc.append(cache.layer(0), kv, kv, step)
    return Call(q=jnp.ones((1, tokens, 2, head_dim)), layer=view, step=step,
                lengths=step.start + step.valid, scale=1.0, sliding_window=None)


@pytest.mark.parametrize("spec,tokens,head_dim,reason", [
    ("bf16", 4, 32, None),
    ("int:4", 4, 32, "does not store its vectors as they are"),  # the kernels over codes'
    ("f32", 4, 32, "it reads bfloat16 or float16"),
    ("bf16", 1, 32, "got one (a decode)"),
    ("bf16", 4, 48, "head_dim 48"),
])
def test_which_calls_it_serves(spec, tokens, head_dim, reason):
    got = supports(_call(spec, tokens, head_dim))
    assert got == reason if reason is None else reason in got


def test_estimator_scores_are_left_to_others():
    import dataclasses

    from kvjax.codecs.intn import IntCodec

    class Estimating(IntCodec):
        scores_reconstruct = False

    call = _call("int:4", 4)
    view = call.layer
    view = dataclasses.replace(view, k=dataclasses.replace(view.k, codec=Estimating(bits=4)))
    layer_call = dataclasses.replace(call, layer=view)
    assert "estimator of its own" in REGISTRY["int_decode"].supports(layer_call)
    assert supports(layer_call) is not None


@pytest.mark.parametrize("spec,reason", [
    ("bf16", None),
    ("f32", "it reads bfloat16 or float16"),
    ("int:4", "K 'int:4' does not store its vectors as they are"),
    ("k=bf16 v=int:4", "V 'int:4' does not store its vectors as they are"),
    ("bf16 sinks=2", "K keeps tokens in sinks or a raw window"),
    ("bf16 window=4", "K keeps tokens in sinks or a raw window"),
])
def test_when_it_reads_the_codes_in_place(spec, reason):
    got = in_place_reason(_call(spec, 4).layer, HEAD_DIM)
    assert got == reason if reason is None else reason in got
