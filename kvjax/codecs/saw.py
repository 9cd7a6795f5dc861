"""SAW-INT4: block-diagonal Hadamard rotation, then token-wise asymmetric INT-N.

Spec ``saw[:hH][,bN][,signs][,kv][,cC][,hess]``: rotation block ``H`` in {16, 32, 64, 128} (it must
divide the head dim), ``N`` bits (default 4), ``signs`` for seeded random sign flips
before the rotation, ``kv`` to rotate V too (by default only K is rotated and V uses
plain ``int:N``, the paper's default: rotating V as well did not change accuracy).

Without ``hH`` the block is the largest of 16, 32, 64 and 128 that divides the head
dim (:meth:`SawCodec.rotation_block`): 128 at D = 128 or 256, 64 at D = 64, 32 at D =
96, 16 at D = 48 or 80; a head dim that none divides (24, 40) is refused. A codec carries
no head dim, so that default is a value of its own, ``block=None``, resolved wherever the
head dim is known (``init``, ``bits_per_element``, the rotation of a vector); its
canonical spec leaves ``h`` out (``saw:b4``). ``saw`` and ``saw:h64`` therefore compute
the same at D = 64 but are different codecs with different specs: a result records
whether its block was chosen or followed the model's head dim.

Each vector ``x[D]`` is stored as the ``int:N`` codes of ``y = B(s * x)``, where ``B``
is the orthonormal block-diagonal Hadamard matrix (self-inverse, symmetric) and ``s``
the signs (all ones without ``signs``). The rotation spreads a channel's outlier over
its block, so the per-token range that ``int:N`` spans shrinks and the grid gets finer
where the mass is. Storage is exactly ``int:N``'s: packed codes + fp16 scale and zero
per vector, ``N + 32/D`` bits; the rotation costs nothing stored (the signs are
codec parameters, drawn from the seed).

Calibrated variants (the paper's ablations; :meth:`SawCodec.fit` fits their parameters
on calibration vectors, :mod:`kvjax.calibration` for a whole model, and a cache reads
them from the ``fit=DIR`` clause):

- ``cC`` (C in 1/16/256/2048): residual vector quantization. k-means centroids of the
  rotated vectors; each vector stores the index of its nearest centroid (``uint8``, or
  ``uint16`` for 2048; none for C = 1, whose centroid is the mean) and the ``int:N``
  codes of its residual. ``N + 32/D + 8/D`` bits (``+ 16/D`` at 2048, ``+ 0`` at 1).
- ``hess``: a query-aware basis before the Hadamard rotation, ``R = B diag(s) E^T``
  with ``E`` the eigenvectors of the calibration queries' damped second moment
  ``M = E[q q^T] + lambda I`` (the key error's score error is ``dk^T M dk``; queries of
  every head that shares the kv head pool). For V (with ``kv``) ``E`` comes from the
  values' own second moment. Still orthogonal: attention stays exact in the rotated
  space and the fused int kernel reads it.

Unfitted, their parameters are neutral (identity basis, zero centroids): the codec then
computes plain SAW with the index's storage, so a cache refuses them without ``fit=``.

Attention never un-rotates keys: with ``R = B diag(s)`` orthogonal,
``q . x = (R q) . (R x)``, so :meth:`SawCodec.scores` rotates the query once and takes
inner products with the stored rotated vectors. For a rotated V the attention output
``sum_i p_i v_i = R^T sum_i p_i (R v_i)`` is rotated back once per query
(:meth:`SawCodec.unrotate`); :meth:`SawCodec.decode` un-rotates each vector and is the
reference reconstruction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax.codec import (
    EXACT,
    FP16_MAX,
    Codec,
    CodecError,
    Codes,
    Example,
    IntFormat,
    Limits,
    Option,
    Params,
    register,
)
from kvjax.codecs.intn import MAX_BITS, MIN_BITS, IntCodec
from kvjax.primitives.kmeans import damped_eigenbasis, kmeans, nearest
from kvjax.primitives.rotations import block_hadamard, random_signs

BLOCKS = (16, 32, 64, 128)
#: the centroid counts of the paper's residual VQ ablation
CENTROIDS = (1, 16, 256, 2048)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class SawCodec(Codec):
    """Block-diagonal Hadamard rotation (optionally sign-flipped) + token-wise INT-N.

    See the module docstring.
    """

    name: ClassVar[str] = "saw"
    #: ``int:N``'s fp16 zero point bounds the elements of the *rotated* vector; no
    #: element of ``R x`` exceeds ``|R x| = |x|``, so bounding the norm guarantees it
    #: whatever the rotation (an element bound on ``x`` would need ``sqrt(H)`` of margin)
    limits: ClassVar[Limits] = Limits(norm=FP16_MAX)
    options: ClassVar[tuple[Option, ...]] = (
        Option.flag("block", "h", "rotation block", "H", choices=BLOCKS,
                    note="H in 16/32/64/128 (default: the largest that divides the head "
                         "dim)"),
        Option.flag("bits", "b", "bit width", "N", lo=MIN_BITS, hi=MAX_BITS, always=True),
        Option.word("signs", "signs", "seeded sign flips"),
        Option.word("rotate_values", "kv", "rotated V"),
        Option.flag("centroids", "c", "k-means centroids", "C", choices=CENTROIDS,
                    note="C in 1/16/256/2048 (fitted residual VQ)"),
        Option.word("hessian", "hess", "query-aware basis (fitted)"),
    )
    examples: ClassVar[tuple[Example, ...]] = (
        Example("saw:h16,signs", rel_mse=0.012, seeded=True, bad_head_dims=(24,)),
        Example("saw:h64,b2,kv", rel_mse=0.25, bad_head_dims=(48,)),
        Example("saw", rel_mse=0.015, head_dim=128, bad_head_dims=(8, 24, 40)),
        Example("saw:kv", rel_mse=0.015, head_dim=64, bad_head_dims=(24,)),
        Example("saw:h16,c16,hess", rel_mse=0.015, bad_head_dims=(24,)),
    )

    #: the rotation block; None: the largest of :data:`BLOCKS` that divides the head dim
    block: int | None = None
    bits: int = 4
    signs: bool = False
    rotate_values: bool = False
    #: k-means centroids of the residual VQ; None: none
    centroids: int | None = None
    hessian: bool = False

    @property
    def _int(self) -> IntCodec:
        return IntCodec(bits=self.bits)

    def value_codec(self) -> Codec:
        """V is rotated only with ``kv``; otherwise it is plain ``int:N``."""
        return self if self.rotate_values else self._int

    def check_head_dim(self, head_dim: int) -> None:
        """The rotation block must divide the head dim (without ``hH``: one of them)."""
        self.rotation_block(head_dim)

    def rotation_block(self, head_dim: int) -> int:
        """The block of the rotation at ``head_dim``: ``H``, or without ``hH`` the largest
        of 16/32/64/128 that divides ``head_dim``; :class:`CodecError` when it does not
        divide (none does)."""
        super().check_head_dim(head_dim)
        if self.block is None:
            fits = [b for b in BLOCKS if head_dim % b == 0]
            if not fits:
                raise CodecError(f"{self.spec}: no rotation block of "
                                 f"{'/'.join(map(str, BLOCKS))} divides head_dim {head_dim}")
            return fits[-1]
        if head_dim % self.block:
            raise CodecError(f"{self.spec}: rotation block {self.block} does not divide "
                             f"head_dim {head_dim}; pick an hH that does, or leave hH out "
                             "for the largest that does")
        return self.block

    @property
    def needs_fit(self) -> bool:
        """Centroids or a query-aware basis: parameters that :meth:`fit` fits."""
        return bool(self.centroids) or self.hessian

    @property
    def _index_dtype(self):
        return jnp.uint16 if (self.centroids or 0) > 256 else jnp.uint8

    def init(self, key: jax.Array, head_dim: int) -> Params:
        """``signs float32[D]`` (all ones without ``signs``); with ``hess`` the basis
        ``float32[D, D]`` (identity until fitted), with ``cC`` the centroids
        ``float32[C, D]`` of the rotated vectors (zeros until fitted)."""
        self.check_head_dim(head_dim)
        params = {"signs": (random_signs(key, head_dim) if self.signs
                            else jnp.ones((head_dim,), jnp.float32))}
        if self.hessian:
            params["basis"] = jnp.eye(head_dim, dtype=jnp.float32)
        if self.centroids:
            params["centroids"] = jnp.zeros((self.centroids, head_dim), jnp.float32)
        return params

    def _fit(self, key: jax.Array, x: jax.Array, query_moment: jax.Array | None) -> Params:
        """Parameters fitted on calibration vectors ``x[N, D]`` of one (layer, kv head,
        K|V): with ``hess`` the eigenbasis of the damped second moment
        ``query_moment[D, D]`` of the queries that attend to these keys (None, for
        values: ``x``'s own), with ``cC`` k-means centroids
        (:func:`kvjax.primitives.kmeans.kmeans`, seeded by ``key``) of the vectors
        rotated by that basis."""
        head_dim = int(x.shape[-1])
        sign_key, kmeans_key = jax.random.split(key)
        params = self.init(sign_key, head_dim)
        if self.hessian:
            moment = (jnp.matmul(x.T, x, precision=EXACT) if query_moment is None
                      else jnp.asarray(query_moment, jnp.float32))
            params["basis"] = damped_eigenbasis(moment)
        if self.centroids:
            if x.shape[0] < self.centroids:
                raise CodecError(f"{self.spec}: {x.shape[0]} calibration vectors for "
                                 f"{self.centroids} centroids; calibrate on more tokens")
            params["centroids"] = kmeans(kmeans_key, self.rotate(params, x), self.centroids)
        return params

    def rotate(self, params: Params, x: jax.Array) -> jax.Array:
        """``R x = B (s * E^T x)`` on the last axis (float32; ``E = I`` without
        ``hess``)."""
        block = self.rotation_block(int(x.shape[-1]))
        x = x.astype(jnp.float32)
        if "basis" in params:
            x = jnp.matmul(x, params["basis"], precision=EXACT)
        return block_hadamard(x * params["signs"], block)

    def unrotate(self, params: Params, y: jax.Array) -> jax.Array:
        """``R^T y = E (s * B y)`` on the last axis (float32): the inverse of
        :meth:`rotate`."""
        block = self.rotation_block(int(y.shape[-1]))
        x = block_hadamard(y.astype(jnp.float32), block) * params["signs"]
        if "basis" in params:
            x = jnp.matmul(x, params["basis"].T, precision=EXACT)
        return x

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        y = self.rotate(params, x)
        if not self.centroids:
            return self._int._encode(None, y)
        index = nearest(y, params["centroids"])
        codes = self._int._encode(None, y - params["centroids"][index])
        if self.centroids > 1:
            codes["index"] = index[..., None].astype(self._index_dtype)
        return codes

    def decode_rotated(self, params: Params, codes: Codes, dtype: Any = jnp.float32):
        """The stored vectors in the rotated space, ``R x_hat`` (what kernels read)."""
        if not self.centroids:
            return self._int.decode(None, codes, dtype)
        residual = {k: v for k, v in codes.items() if k != "index"}
        y = self._int.decode(None, residual, jnp.float32)
        index = codes["index"][..., 0].astype(jnp.int32) if "index" in codes else 0
        return (y + params["centroids"][index]).astype(dtype)

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """``x_hat = R^T (centroid + dequant(codes))``, cast to ``dtype``."""
        y = self.decode_rotated(params, codes, jnp.float32)
        return self.unrotate(params, y).astype(dtype)

    def scores(self, params: Params, q: jax.Array, codes: Codes) -> jax.Array:
        """``q . x_hat = (R q) . (centroid + dequant(codes))``: the query is rotated
        once."""
        y = self.decode_rotated(params, codes, jnp.float32)
        return jnp.einsum("...qd,...sd->...qs", self.rotate(params, q), y, precision=EXACT)

    def bits_per_element(self, head_dim: int) -> float:
        """``int:N``'s, plus the centroid index (8 bits a vector, 16 at C = 2048, none at
        C = 1): the rotation stores nothing per vector."""
        self.check_head_dim(head_dim)
        index = 0 if (self.centroids or 1) == 1 else 8 * jnp.dtype(self._index_dtype).itemsize
        return self._int.bits_per_element(head_dim) + index / head_dim

    # -- kernel formats -------------------------------------------------------------
    def kernel_formats(self) -> tuple[IntFormat, ...]:
        """``int:N``'s arrays of the rotated vectors ``R x`` (K and, when used for V, V:
        every vector this codec stores is rotated); none with centroids, whose vectors
        add a centroid to the codes."""
        if self.centroids:
            return ()
        return (IntFormat(bits=self.bits, rotate=self.rotate),)
