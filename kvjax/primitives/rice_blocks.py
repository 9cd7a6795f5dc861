"""HyperQuant's stored Rice blocks (:mod:`kvjax.codecs.hyperquant`), as arrays: what a
block's words, index words and norms mean, for the codec and for a kernel that reads
them.

A block of ``tN`` tokens codes its lattice points' stripped symbols in ``n_sub``
Rice sub-streams (:mod:`kvjax.primitives.rice`) at one of :data:`LADDER` scales
``alpha 2**(-j/2)``, or holds the *sign fallback* (level :data:`SIGN_LEVEL`): the signs
of its rotated coordinates (:func:`kvjax.primitives.packing.pack_bits`, one bit each)
and each token's scale code after them. :func:`rotated_tokens` decodes blocks to the
codec's rotated frame; the codec's decode is its inverse rotation.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.primitives import rice
from kvjax.primitives.lattices import Lattice, lattice
from kvjax.primitives.packing import pack_bits, unpack_bits

#: scales tried, ``alpha 2^(-j/2)`` for ``j < LADDER``, besides the sign fallback
LADDER = 4
SIGN_LEVEL = LADDER


def symbol_classes(lat: Lattice, count: int) -> np.ndarray:
    return np.tile(np.asarray(lat.symbol_class, np.int32), count // lat.dim)


def symbol_parameters(k1: jax.Array, k2: jax.Array, classes: np.ndarray) -> jax.Array:
    """Per-symbol parameters ``[..., S]`` from a sub-stream's ``(k1, k2)``."""
    return jnp.where(jnp.asarray(classes == 0), k1[..., None], k2[..., None])


def reconstruct(lat: Lattice, codes: jax.Array, dither: jax.Array | None) -> jax.Array:
    """Point coordinates ``[..., D]`` of codes ``[..., D / n, n]`` (dither subtracted)."""
    pts = lat.point(codes)
    pts = pts.reshape(*pts.shape[:-2], pts.shape[-2] * pts.shape[-1])
    return pts if dither is None else pts - dither


@dataclasses.dataclass(frozen=True)
class RiceLayout:
    """The static shape of HyperQuant's Rice blocks at one head dim (module doc): a block
    of ``block`` tokens, ``n_sub`` sub-streams of ``substream`` symbols in ``words``
    words, the calibrated scale ``alpha`` (level ``j < LADDER`` codes at ``alpha
    2**(-j/2)``), and ``sign_scale_bits`` per token's scale in the sign fallback."""

    lattice: str
    head_dim: int
    block: int
    n_sub: int
    substream: int
    words: int
    alpha: float
    sign_scale_bits: int

    def level_scale(self, level: jax.Array) -> jax.Array:
        """``1 / (alpha_level sqrt D)`` (float32) of Rice levels ``0..LADDER-1``: what
        turns a block's lattice points into rotated unit-norm coordinates."""
        j = jnp.minimum(level, LADDER - 1).astype(jnp.float32)
        return 2.0 ** (j / 2) / np.float32(self.alpha * math.sqrt(self.head_dim))

    def sign_words(self) -> int:
        """Words the sign fallback's signs fill (its token scales follow)."""
        return -(-self.block * self.head_dim // 32)


def rotated_tokens(layout: RiceLayout, stream: jax.Array, index: jax.Array,
                   norm: jax.Array, dither: jax.Array | None = None) -> jax.Array:
    """The tokens ``[..., nb, tN, D]`` (float32) of Rice blocks in the rotated frame:
    ``|x| (P - U) / (alpha_level sqrt D)``, or ``|x| s sign / sqrt D`` for a block in the
    sign fallback; the codec's decode is their inverse rotation. ``stream [..., nb,
    W]``, ``index [..., nb, n_sub]``, ``norm [..., nb, tN]`` as stored; ``dither`` the
    codec's, or None."""
    lat = lattice(layout.lattice)
    head_dim, tokens = layout.head_dim, layout.block
    lead, nb = index.shape[:-2], index.shape[-2]
    start = (index & 0xFFFFFF).astype(jnp.int32)
    level = start[..., 0]
    offsets = start.at[..., 0].set(0)
    k1 = ((index >> 24) & 15).astype(jnp.int32)
    k2 = ((index >> 28) & 15).astype(jnp.int32)
    k = symbol_parameters(k1, k2, symbol_classes(lat, layout.substream))
    symbols = rice.decode(stream, offsets, k)
    c = lat.unstrip(symbols.reshape(*lead, nb, tokens, head_dim // lat.dim, lat.dim))
    pts = reconstruct(lat, c, dither)  # [..., nb, tN, D]
    y = pts * layout.level_scale(level)[..., None, None]
    signs, scale_codes = unpack_signs(stream, tokens, head_dim, layout.sign_scale_bits)
    scales = sign_scales(scale_codes, layout.sign_scale_bits)[..., None]
    y_sign = signs.reshape(y.shape) * scales / math.sqrt(head_dim)
    y = jnp.where((level == SIGN_LEVEL)[..., None, None], y_sign, y)
    return norm.astype(jnp.float32)[..., None] * y


def sign_scale_codes(y: jax.Array, bits: int) -> jax.Array:
    """Per token of ``y[..., tN, D]`` (mean square 1): the code of ``mean |y|``, the scale
    of ``sign(y)`` that reconstructs it best, on the grid ``(c + 1) / 2^bits`` (``uint32
    [..., tN]``; zeros when ``bits`` is 0)."""
    if not bits:
        return jnp.zeros(y.shape[:-1], jnp.uint32)
    levels = 1 << bits
    codes = jnp.round(jnp.mean(jnp.abs(y), axis=-1) * levels) - 1
    return jnp.clip(codes, 0, levels - 1).astype(jnp.uint32)


def sign_scales(codes: jax.Array, bits: int) -> jax.Array:
    """The scales of :func:`sign_scale_codes`; ``sqrt(2 / pi)`` (a Gaussian's mean
    ``|y|``) for every token when the budget has no room for them (``bits`` 0)."""
    if not bits:
        return jnp.full(codes.shape, math.sqrt(2.0 / math.pi), jnp.float32)
    return (codes.astype(jnp.float32) + 1.0) / (1 << bits)


def sign_words(y: jax.Array, scale_codes: jax.Array, scale_bits: int,
                num_words: int) -> jax.Array:
    """The sign fallback of blocks ``y[..., N]``: bits ``y >= 0`` packed LSB-first, then
    from the next word the tokens' scale codes ``[..., tN]`` at ``scale_bits`` each,
    zero-padded to ``num_words`` words."""
    parts = [pack_bits((y >= 0).astype(jnp.uint32), 1)]
    if scale_bits:
        parts.append(pack_bits(scale_codes, scale_bits))
    words = jnp.concatenate(parts, axis=-1)
    pad = num_words - words.shape[-1]
    return jnp.pad(words, [(0, 0)] * (words.ndim - 1) + [(0, pad)])


def unpack_signs(words: jax.Array, tokens: int, head_dim: int, scale_bits: int):
    """Inverse of :func:`sign_words`: signs ``+-1`` ``[..., tN * D]`` and the tokens'
    scale codes ``[..., tN]``."""
    count = tokens * head_dim
    n = -(-count // 32)
    signs = 2.0 * unpack_bits(words[..., :n], 1, count).astype(jnp.float32) - 1.0
    if not scale_bits:
        return signs, jnp.zeros((*words.shape[:-1], tokens), jnp.uint32)
    m = -(-tokens * scale_bits // 32)
    return signs, unpack_bits(words[..., n:n + m], scale_bits, tokens)
