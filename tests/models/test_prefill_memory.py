"""A prefill's memory does not grow with the history it attends to.

A chunk attends to the cache it was appended to through implementations that read the
stored codes a tile at a time (the fused kernels over codes on a GPU, ``"xla"``'s
windows elsewhere), so its working memory is one chunk's, whatever the context: the
only arrays of context size are the cache's own, updated in place.

Two checks, on a tiny model, at two context lengths with the same chunk:

- compiled (``"xla"``, the pipeline a codec without a kernel runs on any device; for
  ``octopus:b2,qjl``, whose dense stream no kernel reads, with its keys scored by the
  codec's QJL estimator window by window):
  XLA's temporaries stay within 1.25x from the short context to the long one, and
  below the long cache's bytes plus a per-chunk bound (:data:`CHUNK_BYTES`);
- traced (each fused kernel's pipeline; on a CPU Pallas runs in interpret mode, whose
  interpreter copies a kernel's operands, so its temporaries say nothing of a GPU's):
  every intermediate outside the kernels whose shape depends on the context is the
  cache's own storage (a stored array or one layer of it, or a view of its bits as
  another type: of their bytes), never the history decoded (whose bytes a compressed
  cache's storage is a fraction of).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jcore

from kvjax.spec import parse_cache
from models import llama
from models.config import ModelConfig
from models.generate import _prefill, prefill_arguments, prefill_program

CONFIG = ModelConfig(family="llama", vocab_size=128, hidden_size=128, intermediate_size=256,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64,
                     max_position_embeddings=1 << 15)
BATCH, CHUNK = 1, 128
CONTEXTS = (2048, 8192)
#: the stated bound on a prefill chunk's working memory beyond its cache (this model and
#: chunk): its activations (~1 MiB), one window of ``"xla"``'s scores, and HQMQ's
#: encoding, which searches every secondary for ``ENCODE_BATCH`` quaternions at a time
#: (~40 MiB, the largest, whatever the chunk)
CHUNK_BYTES = 64 << 20
SPECS = ("bf16", "int:4", "turboquant:b4", "hqmq:s96,r4", "octopus:b2,qjl")


def _shapes(spec: str, context: int):
    params = jax.eval_shape(lambda: llama.init_params(jax.random.key(0), CONFIG,
                                                      jnp.bfloat16))
    cache = llama.cache_shape(CONFIG, parse_cache(spec), batch=BATCH, max_len=context)
    return prefill_arguments(params, CONFIG, cache, chunk=CHUNK), cache


def _nbytes(tree) -> int:
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("spec", SPECS)
def test_compiled_prefill_temporaries_do_not_grow_with_the_context(spec):
    temps, caches = [], []
    for context in CONTEXTS:
        (params, *_), cache = _shapes(f"{spec} attn=xla", context)
        compiled = prefill_program(params, CONFIG, cache, chunk=CHUNK)
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
        caches.append(_nbytes(cache))
    short, long = temps
    assert long <= 1.25 * short, (spec, temps)
    assert long <= caches[1] + CHUNK_BYTES, (spec, temps, caches)


def _outputs(jaxpr):
    """Every equation's output avals, sub-programs included, outside Pallas kernels, in
    program order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        yield from (v.aval for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    yield from _outputs(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    yield from _outputs(sub)


@pytest.mark.parametrize("spec", [
    "int:4 window=16 attn=int_decode",
    "turboquant:b4 attn=codebook_decode",
    "hqmq:s96,r4 window=16 sinks=4 attn=hqmq_decode",
    "polarquant:b3 attn=polar_decode",
    "bf16 window=16 attn=dense_decode",
    "bf16 attn=chunk_flash",
])
def test_fused_prefill_holds_no_decoded_history(spec):
    programs = []
    for context in CONTEXTS:
        args, cache = _shapes(spec, context)
        jaxpr = jax.make_jaxpr(_prefill, static_argnums=(1, 2))(*args)
        programs.append((list(_outputs(jaxpr.jaxpr)), cache))
    (short, _), (long, cache) = programs
    assert len(short) == len(long)
    # a stored array, one layer of it, or a view of its bits as another type
    stored = {_nbytes(leaf) // layers
              for leaf in jax.tree.leaves(cache) for layers in (1, CONFIG.num_layers)}
    grown = [b for a, b in zip(short, long, strict=True) if a.shape != b.shape]
    assert grown, "the cache's own arrays depend on the context"
    for aval in grown:
        assert _nbytes(aval) in stored, (spec, aval)
