"""Decode attention over token-wise INT-N codes (``int:N`` and SAW keys/values).

``reference.py`` is the specification (pure jnp), ``kernel.py`` the Pallas kernel that
reads the packed words and fp16 scales directly, ``api.py`` the layer-level entry point
that adds the raw regions of the cache and merges the partial softmaxes.
"""
