"""Decode attention over token-wise INT-N codes (``int:N`` and SAW keys/values).

``api.py`` holds the entry, :func:`~pallas_kernels.int_decode.api.int_decode` (packed
codes, scales and zeros in, the partial softmax over the coded tokens out);
``reference.py`` the pure-jnp specification with the same signature; ``kernel.py`` the
Pallas kernel that reads the packed words and fp16 scales directly.
"""
