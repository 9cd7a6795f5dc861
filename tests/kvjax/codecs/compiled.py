"""Compiled helpers the codec tests share.

Eager dispatch compiles every primitive of a rotation or a packing on its own; one small
program compiled with LLVM's cheap passes is faster on a 2-core CPU (the conformance
suite checks that jit and eager give the same codes).
"""

from __future__ import annotations

import functools

import jax

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def encode_decode(codec, params, x):
    """Codes and reconstruction of ``x[..., T, D]``, in one compiled program."""
    codes = codec.encode(params, x)
    return codes, codec.decode(params, codes)
