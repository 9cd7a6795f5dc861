"""Decode attention over HQMQ keys and values (per 4-dim chunk a Hurwitz-quaternion
codeword ``q_p q_s`` and a radius code, per token a scale).

``api.py`` holds the entry, :func:`~pallas_kernels.hqmq_decode.api.hqmq_decode` (the byte
streams, scales and codeword tables in, the partial softmax over the coded tokens out);
``reference.py`` the pure-jnp specification with the same signature; ``kernel.py`` the
Pallas kernel.
"""
