"""FP8 (e4m3) storage with one fp16 scale per vector: ``fp8``.

``scale = amax / 448`` (448 is the largest e4m3fn value) maps each vector onto the full
e4m3 range; elements are divided by the *fp16-rounded* scale, clipped to ``+-448``
(e4m3fn has no infinity: an overflow would become NaN) and rounded to nearest-even.
The payload is stored as the raw bytes of the e4m3fn values, so consumers (caches,
kernels) only ever see ``uint8``.

Codes of ``x[..., T, D]``::

    codes  uint8[..., T, D]     e4m3fn bit patterns
    scale  float16[..., T, 1]

Bits per element: ``8 + 16 / D``. Error: at most ``2**-4 * |x|`` for elements in the
e4m3 normal range and ``2**-10 * scale`` below it (subnormal spacing ``2**-9``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codec import (
    FP16_MAX,
    FP16_TINY,
    Codec,
    Codes,
    Example,
    Limits,
    Params,
    register,
    round_to_dtype,
)
from kvjax.codecs.intn import exact_bits

E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Codec(Codec):
    """Per-vector scaled float8 e4m3fn (no options)."""

    name: ClassVar[str] = "fp8"
    #: the fp16 scale tops out at FP16_MAX, which bounds the representable amax
    limits: ClassVar[Limits] = Limits(element=E4M3_MAX * FP16_MAX)
    examples: ClassVar[tuple[Example, ...]] = (Example("fp8", rel_mse=1e-3),)

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        del params
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        # an explicit reciprocal: XLA would substitute one for a constant divisor under
        # jit only, and the stored scale should not depend on the calling context
        scale = amax * np.float32(1.0 / E4M3_MAX)
        # floored at the smallest normal fp16: the scale stays positive (all-zero vectors
        # decode to exactly 0) and its rounding relative; below the floor the payload's
        # own subnormals carry the vector, to within 2**-10 * FP16_TINY = FP16_STEP
        scale = round_to_dtype(jnp.maximum(scale, FP16_TINY), jnp.float16)
        # fp16 rounding may have lowered the scale a hair, pushing amax past 448
        y = jnp.clip(x / scale, -E4M3_MAX, E4M3_MAX)
        payload = jax.lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), jnp.uint8)
        return {"codes": payload, "scale": scale.astype(jnp.float16)}

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """The e4m3 values times the per-vector scale, cast to ``dtype``."""
        del params
        y = jax.lax.bitcast_convert_type(codes["codes"], jnp.float8_e4m3fn)
        return (y.astype(jnp.float32) * codes["scale"].astype(jnp.float32)).astype(dtype)

    def bits_per_element(self, head_dim: int) -> float:
        """One byte per element plus one fp16 scale per vector."""
        self.check_head_dim(head_dim)
        return exact_bits(8 * head_dim + 16, head_dim)
