"""Decode attention over rotated OCTOPUS keys (triplets of rotated coordinates as a norm
level and an octahedral direction) and group-wise INT values (``kivi:N,gG,token``).

``api.py`` holds the entry, :func:`~pallas_kernels.octopus_decode.api.octopus_decode`
(the key bytes, norms, value codes, scales and zeros in, the partial softmax over the
coded tokens out); ``reference.py`` the pure-jnp specification with the same signature;
``kernel.py`` the Pallas kernel that reads the key bytes in windows.
"""
