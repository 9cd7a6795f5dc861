"""Decode attention over HyperQuant's Rice-coded blocks (E8 lattice points, bit-stripped
and Rice coded in sub-streams, per token a norm; a block may fall back to a coarser scale
or to signs).

``api.py`` holds the entry, :func:`~pallas_kernels.rice_decode.api.rice_decode` (the
rotated query and the blocks' words, index words and norms in, the partial softmax over
the coded tokens out, in the codec's rotated frame); ``reference.py`` the pure-jnp
specification with the same signature; ``kernel.py`` the Pallas kernel.
"""
