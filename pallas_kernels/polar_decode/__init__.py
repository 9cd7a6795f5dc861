"""Decode attention over PolarQuant keys at full depth (the rotated unit vector as
``D - 1`` polar angles) and group-wise INT values (``kivi:N,gG,token``).

``api.py`` holds the entry, :func:`~pallas_kernels.polar_decode.api.polar_decode`
(packed angle codes, norms, scales and zeros in, the partial softmax over the coded
tokens out); ``reference.py`` the pure-jnp specification with the same signature;
``kernel.py`` the Pallas kernel that rebuilds the unit vectors from the packed words by
products of cosines and sines.
"""
