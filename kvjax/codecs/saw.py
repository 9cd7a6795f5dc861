"""SAW-INT4: block-diagonal Hadamard rotation, then token-wise asymmetric INT-N.

Spec ``saw[:hH][,bN][,signs][,kv]``: rotation block ``H`` in {16, 32, 64, 128} (it must
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
from kvjax.primitives.rotations import block_hadamard, random_signs

BLOCKS = (16, 32, 64, 128)


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
    )
    examples: ClassVar[tuple[Example, ...]] = (
        Example("saw:h16,signs", rel_mse=0.012, seeded=True, bad_head_dims=(24,)),
        Example("saw:h64,b2,kv", rel_mse=0.25, bad_head_dims=(48,)),
        Example("saw", rel_mse=0.015, head_dim=128, bad_head_dims=(8, 24, 40)),
        Example("saw:kv", rel_mse=0.015, head_dim=64, bad_head_dims=(24,)),
    )

    #: the rotation block; None: the largest of :data:`BLOCKS` that divides the head dim
    block: int | None = None
    bits: int = 4
    signs: bool = False
    rotate_values: bool = False

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

    def init(self, key: jax.Array, head_dim: int) -> Params:
        """The sign vector ``float32[D]`` (all ones without ``signs``)."""
        self.check_head_dim(head_dim)
        if self.signs:
            return {"signs": random_signs(key, head_dim)}
        return {"signs": jnp.ones((head_dim,), jnp.float32)}

    def rotate(self, params: Params, x: jax.Array) -> jax.Array:
        """``R x = B (s * x)`` on the last axis (float32)."""
        block = self.rotation_block(int(x.shape[-1]))
        return block_hadamard(x.astype(jnp.float32) * params["signs"], block)

    def unrotate(self, params: Params, y: jax.Array) -> jax.Array:
        """``R^T y = s * B y`` on the last axis (float32): the inverse of :meth:`rotate`."""
        block = self.rotation_block(int(y.shape[-1]))
        return block_hadamard(y.astype(jnp.float32), block) * params["signs"]

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        return self._int._encode(None, self.rotate(params, x))

    def decode_rotated(self, params: Params, codes: Codes, dtype: Any = jnp.float32):
        """The stored vectors in the rotated space, ``R x_hat`` (what kernels read)."""
        return self._int.decode(None, codes, dtype)

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """``x_hat = R^T dequant(codes)``, cast to ``dtype``."""
        return self.unrotate(params, self._int.decode(None, codes, jnp.float32)).astype(dtype)

    def scores(self, params: Params, q: jax.Array, codes: Codes) -> jax.Array:
        """``q . x_hat = (R q) . dequant(codes)``: the query is rotated once."""
        y = self._int.decode(None, codes, jnp.float32)
        return jnp.einsum("...qd,...sd->...qs", self.rotate(params, q), y, precision=EXACT)

    def bits_per_element(self, head_dim: int) -> float:
        """Exactly ``int:N``'s: the rotation stores nothing per vector."""
        self.check_head_dim(head_dim)
        return self._int.bits_per_element(head_dim)

    # -- kernel formats -------------------------------------------------------------
    def kernel_formats(self) -> tuple[IntFormat, ...]:
        """``int:N``'s arrays of the rotated vectors ``R x`` (K and, when used for V, V:
        every vector this codec stores is rotated)."""
        return (IntFormat(bits=self.bits, rotate=self.rotate),)
