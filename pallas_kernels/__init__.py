"""Fused Pallas GPU kernels that attend directly over packed KV codes.

One sub-package per kernel, each with ``kernel.py`` (Pallas), ``reference.py`` (pure
jnp, the specification) and ``api.py`` (dispatch and shape checks). This package
depends on jax only and never imports ``models``.
"""
