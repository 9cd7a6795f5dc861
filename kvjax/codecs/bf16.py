"""Uncompressed bfloat16 storage: ``bf16``, the reference point of every bits axis.

Codes of ``x[..., T, D]``: ``{"x": bfloat16[..., T, D]}``; 16 bits per element.
``lossy`` is False: for bf16 inputs (the models' own K/V) storage is exact, so a cache
may keep these vectors as its raw window instead of encoding them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax.codec import Codec, Codes, Params, register
from kvjax.codecs.intn import saturate

#: float32 values beyond this round to bf16 infinity; under jit (where +-Inf input has
#: become the largest float32) clipping keeps the stored vectors finite
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Bf16Codec(Codec):
    """Identity storage as bfloat16. Spec ``bf16`` (no options)."""

    name: ClassVar[str] = "bf16"
    lossy: ClassVar[bool] = False

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        del params
        return {"x": saturate(x, BF16_MAX, self.spec).astype(jnp.bfloat16)}

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """The stored bfloat16 vectors cast to ``dtype``."""
        del params
        return codes["x"].astype(dtype)

    def bits_per_element(self, head_dim: int) -> float:
        """16: no metadata."""
        self.check_head_dim(head_dim)
        return 16.0


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class F32Codec(Codec):
    """Identity storage as float32. Spec ``f32`` (no options).

    The exact cache: model parity tests against float32 references use it, and it is the
    32-bit end of a bits axis.
    """

    name: ClassVar[str] = "f32"
    lossy: ClassVar[bool] = False

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        del params
        return {"x": x.astype(jnp.float32)}

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """The stored float32 vectors cast to ``dtype``."""
        del params
        return codes["x"].astype(dtype)

    def bits_per_element(self, head_dim: int) -> float:
        """32: no metadata."""
        self.check_head_dim(head_dim)
        return 32.0
