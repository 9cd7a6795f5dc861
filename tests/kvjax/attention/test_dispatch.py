"""The dispatcher: registry, names and "auto", fallback order, reasons collected."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention
from kvjax.attention import (
    Impl,
    NoImplementationError,
    attend,
    auto_names,
    check_names,
    register,
    registered,
    resolve,
)
from tests.kvjax.attention.helpers import build_layer

ATOL = 3e-3   # the kernel's float16 operands (tests/pallas_kernels/test_int_decode.py)
#: compiled on a GPU, Pallas interpret mode elsewhere
INTERPRET = jax.default_backend() != "gpu"


def test_registry_and_auto():
    assert registered()[:4] == ("reference", "xla", "int_decode", "codebook_decode")
    fused = ("int_decode", "codebook_decode", "octopus_decode", "polar_decode", "hqmq_decode",
             "rice_decode", "chunk_flash", "dense_decode")
    assert auto_names("gpu") == (*fused, "xla", "reference")
    assert auto_names("cpu") == ("reference",)
    assert resolve("auto", "gpu") == (*fused, "xla", "reference")
    assert resolve(["xla", "auto"], "gpu") == ("xla", *fused, "reference")
    assert resolve("int_decode,reference", "cpu") == ("int_decode", "reference")
    assert resolve(("reference", "auto"), "cpu") == ("reference",)


def test_unknown_and_empty_names():
    for bad in ("magic", ["reference", "pallas"], "int_decode,,xla"):
        with pytest.raises(ValueError,
                           match="valid: auto, reference, xla, int_decode, codebook_decode"):
            check_names(bad)
    with pytest.raises(ValueError, match="no attention implementation given"):
        check_names(())
    assert check_names(" xla , reference") == ("xla", "reference")


def test_register_refuses_reserved_and_taken_names():
    impl = Impl(name="reference", supports=lambda call: None, run=lambda call: call.q)
    with pytest.raises(ValueError, match="registered already"):
        register(impl)
    for name in ("auto", "", "a,b"):
        with pytest.raises(ValueError, match="reserved or empty"):
            register(Impl(name=name, supports=lambda call: None, run=lambda call: call.q))


def test_the_first_that_serves_runs_and_reasons_are_collected(monkeypatch):
    def fixed(value):
        return lambda call: jnp.full(call.q.shape, value, jnp.float32)

    monkeypatch.setitem(attention.REGISTRY, "never", Impl(
        name="never", supports=lambda call: "it never does", run=fixed(1.0)))
    monkeypatch.setitem(attention.REGISTRY, "ones", Impl(
        name="ones", supports=lambda call: None, run=fixed(1.0)))
    monkeypatch.setitem(attention.REGISTRY, "twos", Impl(
        name="twos", supports=lambda call: None, run=fixed(2.0)))
    view, step, qkey = build_layer("int:4", "int:4", lengths=[9], window=0, sinks=0,
                                   heads=1, head_dim=64)
    q = jax.random.normal(qkey, (1, 1, 2, 64))
    assert np.all(np.asarray(attend(q, view, step, impl=("never", "twos", "ones"))) == 2)
    assert np.all(np.asarray(attend(q, view, step, impl=["ones", "twos"])) == 1)
    with pytest.raises(NoImplementationError) as err:
        attend(q, view, step, impl=("never", "xla"))
    message = str(err.value)
    assert "T=1 over K 'int:4', V 'int:4', head_dim 64" in message
    assert "never: it never does" in message
    assert "xla: a one-token decode runs over a bf16 cache only (K is 'int:4')" in message
    assert isinstance(err.value, ValueError)


def test_attend_kernel_dispatch_and_fallback():
    heads, head_dim = 1, 128
    view, step, qkey = build_layer("int:4", "int:4", lengths=[20], window=0, sinks=0,
                                   heads=heads, head_dim=head_dim)
    q = jax.random.normal(qkey, (1, 1, 4, head_dim))
    want = attend(q, view, step, impl="reference")
    got = attend(q, view, step, impl="int_decode")   # the kernel applies
    np.testing.assert_allclose(got, want, atol=ATOL)
    assert not np.array_equal(got, want)
    view3, step3, _ = build_layer("int:3", "int:3", lengths=[20], window=0, sinks=0,
                                  heads=heads, head_dim=head_dim)
    with pytest.raises(NoImplementationError, match="not planar-packed"):
        attend(q, view3, step3, impl="int_decode")
    # listed after it, the reference serves what the kernel does not
    got3 = attend(q, view3, step3, impl=("int_decode", "reference"))
    np.testing.assert_array_equal(got3, attend(q, view3, step3))
    # "auto": on a CPU the reference itself, on a GPU the kernel where it applies
    auto = attend(q, view3, step3, impl="auto")
    auto4 = attend(q, view, step, impl="auto")
    np.testing.assert_array_equal(auto, got3)
    if INTERPRET:
        np.testing.assert_array_equal(auto4, want)
    else:
        np.testing.assert_allclose(auto4, want, atol=ATOL)


def test_decode_attention_takes_the_same_names():
    view, step, qkey = build_layer("int:4", "int:4", lengths=[9, 3], window=2, sinks=0,
                                   heads=1, head_dim=64)
    q = jax.random.normal(qkey, (2, 4, 64))
    np.testing.assert_array_equal(
        attention.decode_attention(q, view, step, impl=("xla", "reference")),
        attend(q[:, None], view, step)[:, 0])


def test_attend_runs_the_caches_own_implementations_by_default(monkeypatch):
    monkeypatch.setitem(attention.REGISTRY, "fives", Impl(
        name="fives", supports=lambda call: None,
        run=lambda call: jnp.full(call.q.shape, 5.0, jnp.float32)))
    view, step, qkey = build_layer("int:4", "int:4", lengths=[9], window=0, sinks=0,
                                   heads=1, head_dim=64)
    q = jax.random.normal(qkey, (1, 1, 2, 64))
    assert view.attention == ("auto",)
    want = attend(q, view, step, impl="auto")
    np.testing.assert_array_equal(attend(q, view, step), want)
    # a view of a cache whose spec names its implementations runs them unless told
    named = dataclasses.replace(view, attention=("fives", "reference"))
    assert np.all(np.asarray(attend(q, named, step)) == 5)
    np.testing.assert_array_equal(attend(q, named, step, impl="auto"), want)


def test_a_cache_passes_its_attn_clause_to_every_layer_view():
    from kvjax import cache as kc
    from kvjax.spec import parse_cache

    cache = kc.init_cache(jax.random.key(0), parse_cache("int:4 attn=xla,reference "
                                                         "layers[0]:k=bf16"),
                          num_layers=3, batch=1, num_kv_heads=1, head_dim=64, max_len=32)
    assert [cache.layer(i).attention for i in range(3)] == [("xla", "reference")] * 3
