"""Attention of a chunk of prefill queries over keys and values stored as 16-bit floats,
flash-attention style: the scores of a block of queries against a block of keys live in
registers, never in memory.

``api.py`` holds the entry, :func:`~pallas_kernels.chunk_attention.api.chunk_attention`
(the grouped queries, their positions and the stored keys and values in, the normalized
output out); ``reference.py`` the pure-jnp specification with the same signature;
``kernel.py`` the Pallas kernel.
"""
