"""Decode attention over rotated scalar-codebook keys (TurboQuant-MSE and -QJL) and
group-wise INT values (``kivi:N,gG,token``).

``api.py`` holds the entry, :func:`~pallas_kernels.codebook_decode.api.codebook_decode`
(packed codes, norms, scales and zeros in, the partial softmax over the coded tokens
out); ``reference.py`` the pure-jnp specification with the same signature;
``kernel.py`` the Pallas kernel that reads the packed words directly.
"""
