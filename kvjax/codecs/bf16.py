"""Uncompressed storage: ``bf16`` (the reference point of every bits axis) and ``f32``.

Codes of ``x[..., T, D]``: ``{"x": uint16[..., T, D]}``, the bits of the bfloat16
values, 16 per element (``f32``: uint32, the bits of float32, the exact cache of parity
tests). The bits are kept as unsigned integers because a cache writes new tokens into
its buffers with a scatter, and XLA widens a 16-bit float scatter to float32, converting
the whole buffer there and back on every append; an integer scatter of the same width
moves the same bytes in place. :meth:`_IdentityCodec.values` gives them back as floats.
``lossy`` is False: for bf16 inputs (the models' own K/V) storage is exact, so a cache
may keep these vectors as its raw window instead of encoding them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax.codec import Codec, Codes, DenseFormat, Example, Limits, Params, register

#: float32 values beyond this round to bf16 infinity
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _IdentityCodec(Codec):
    """Vectors stored unchanged in ``storage`` dtype (no metadata)."""

    lossy: ClassVar[bool] = False
    storage: ClassVar[Any] = jnp.float32

    @property
    def _bits(self):
        return jnp.dtype(f"uint{8 * jnp.dtype(self.storage).itemsize}")

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        del params
        return {"x": jax.lax.bitcast_convert_type(x.astype(self.storage), self._bits)}

    def values(self, codes: Codes) -> jax.Array:
        """The stored vectors in the storage dtype (a bitcast of the codes, no copy)."""
        return jax.lax.bitcast_convert_type(codes["x"], self.storage)

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """The stored vectors cast to ``dtype``."""
        del params
        return self.values(codes).astype(dtype)

    def bits_per_element(self, head_dim: int) -> float:
        """The storage dtype's width: no metadata."""
        self.check_head_dim(head_dim)
        return float(8 * jnp.dtype(self.storage).itemsize)

    # -- kernel formats -------------------------------------------------------------
    def kernel_formats(self) -> tuple[DenseFormat, ...]:
        """The vectors themselves, in the storage dtype (:meth:`values`)."""
        return (DenseFormat(dtype=jnp.dtype(self.storage), values=self.values),)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Bf16Codec(_IdentityCodec):
    """Identity storage as bfloat16 (no options)."""

    name: ClassVar[str] = "bf16"
    examples: ClassVar[tuple[Example, ...]] = (Example("bf16", rel_mse=4e-6),)
    storage: ClassVar[Any] = jnp.bfloat16
    limits: ClassVar[Limits] = Limits(element=BF16_MAX)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class F32Codec(_IdentityCodec):
    """Identity storage as float32 (no options).

    The exact cache: model parity tests against float32 references use it, and it is the
    32-bit end of a bits axis.
    """

    name: ClassVar[str] = "f32"
    examples: ClassVar[tuple[Example, ...]] = (Example("f32", rel_mse=0.0),)
