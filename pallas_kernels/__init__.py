"""Fused Pallas GPU kernels that attend directly over packed KV codes.

One sub-package per kernel, each with ``kernel.py`` (Pallas), ``reference.py`` (pure
jnp, the specification) and ``api.py`` (the array-level entry: codes, scales and
lengths in, the partial softmax ``(o, m, l)`` out; ``NotImplementedError`` with the
reason where the kernel does not apply). :mod:`pallas_kernels.chunk_attention` is the
prefill's: a chunk of queries over 16-bit keys and values, its output normalized.
:mod:`pallas_kernels.partial` holds what they share: the masked logit, the exact merge
of partials, the dense partial over raw tokens. This package depends on jax and
:mod:`kvjax.primitives` only; caches and codecs are :mod:`kvjax.attention`'s business.
"""
