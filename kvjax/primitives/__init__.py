"""Codec-independent building blocks: bit packing, rotations, Lloyd-Max design and its
codebook cache, lattices, Rice coding and quaternions.

Everything here depends on jax and numpy only (and on other primitives), so the codecs,
the fused kernels and user code can share it without importing a codec.
"""
