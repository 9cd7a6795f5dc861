"""Decode attention over tokens stored as they are, in a 16-bit float (a ``bf16`` or
``fp16`` cache), read in place from a stack of layers.

``api.py`` holds the entry, :func:`~pallas_kernels.dense_decode.api.dense_decode` (the
query and the stored keys and values in, the partial softmax over them out);
``reference.py`` the pure-jnp specification with the same signature; ``kernel.py`` the
Pallas kernel.
"""
