"""The codec protocol, the codec registry and the spec-string grammar.

A codec turns key or value vectors of one attention head into really packed codes.
It is a frozen, keyword-only dataclass (hashable, so it can be a static ``jax.jit``
argument) and carries no arrays. Everything data-independent that a codec needs
(codebooks, sign flips, rotations) comes from :meth:`Codec.init` as a pytree of arrays.

Shapes. ``encode`` takes ``x[..., T, D]``: the vectors of *one* kv head, tokens on the
second-to-last axis. Token-wise codecs treat every leading axis alike; codecs that
quantize across tokens (KIVI keys) group along the token axis in blocks of
:attr:`Codec.block_tokens`. The returned codes are a dict of arrays whose leading axes
are ``[..., T // block_tokens]`` (one entry per block), so a cache can store them in
fixed block slots. The cache calls ``init``/``encode``/``decode`` once per
(layer, kv head, K|V) through ``jax.vmap``; a codec never sees the head axis.

Spec strings (``int:4``, ``kivi:2,g32``) are parsed by :mod:`kvjax.spec`, which sits
above the codecs; this module imports no codec. ``register`` puts a class in the
registry that the grammar reads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

Codes = dict[str, jax.Array]
Params = Any

#: float32 matmuls of the reference paths: GPUs would otherwise use TF32 by default
EXACT = jax.lax.Precision.HIGHEST


class CodecError(ValueError):
    """A codec spec or an input that a codec cannot represent."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Codec:
    """Base class of every codec. Subclasses override the ``_encode``/``decode`` pair."""

    #: registry name, the part of the spec before ``:``
    name: ClassVar[str] = ""
    #: tokens quantized together; the cache keeps an unfinished block raw
    block_tokens: ClassVar[int] = 1
    #: False for codecs that store vectors unchanged (bf16); the cache treats them as raw
    lossy: ClassVar[bool] = True
    #: True when :meth:`scores` is ``q . decode(codes)`` up to rounding (a query-side
    #: rotation included), so attention may decode keys and multiply; False for codecs
    #: whose scores are an estimator of their own (QJL), which only ``scores`` computes
    scores_reconstruct: ClassVar[bool] = True

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_options(cls, options: list[str]) -> Codec:
        """Build from the comma-separated options of a spec string."""
        if options:
            raise CodecError(f"codec '{cls.name}' takes no options, got {options}")
        return cls()

    @property
    def spec(self) -> str:
        """The canonical spec string: ``parse_codec(c.spec) == c``."""
        return self.name

    def value_codec(self) -> Codec:
        """The codec that V uses when one spec names a K/V pair (``--codec SPEC``)."""
        return self

    def check_head_dim(self, head_dim: int) -> None:
        """Raise :class:`CodecError` when this codec cannot encode vectors of ``head_dim``."""
        if not isinstance(head_dim, int | np.integer) or head_dim < 1:
            raise CodecError(f"{self.spec}: head_dim must be a positive int, got {head_dim!r}")

    # -- the protocol -------------------------------------------------------------
    def init(self, key: jax.Array, head_dim: int) -> Params:
        """Seeded, data-independent parameters for one (layer, kv head, K|V)."""
        del key
        self.check_head_dim(head_dim)
        return {}

    def encode(self, params: Params, x: jax.Array) -> Codes:
        """Packed codes of ``x[..., T, D]`` (``T`` a multiple of ``block_tokens``).

        Non-finite input: outside ``jit`` this raises :class:`CodecError`; under ``jit``
        (where values cannot be inspected) NaN is encoded as 0 and +-Inf as the largest
        finite float32, so the output stays finite; the cache records such rows
        (see :func:`kvjax.cache.check`).
        """
        x = self._check_input(x)
        # the barrier makes the codes real even when encode and decode share a program:
        # without it XLA may fold a narrowing cast and its widening inverse into nothing
        # (excess precision, applied on GPU), and a fused round trip would not quantize
        return jax.lax.optimization_barrier(self._encode(params, x))

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        raise NotImplementedError

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """Reconstruct ``x_hat[..., T, D]`` from codes. The reference path: kernels agree."""
        raise NotImplementedError

    def scores(self, params: Params, q: jax.Array, codes: Codes) -> jax.Array:
        """Inner products ``q[..., Q, D] . k_hat[..., S, D] -> [..., Q, S]`` in float32.

        The default reconstructs then multiplies; codecs with an estimator of their own
        (QJL) or a query-side rotation override it.
        """
        k_hat = self.decode(params, codes, jnp.float32)
        q = q.astype(jnp.float32)
        return jnp.einsum("...qd,...sd->...qs", q, k_hat, precision=EXACT)

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per vector element by formula (metadata included)."""
        raise NotImplementedError

    # -- kernel formats -------------------------------------------------------------
    def kernel_formats(self) -> tuple[KernelFormat, ...]:
        """The layouts of this codec's stored arrays that fused attention reads directly
        (:class:`IntFormat`, :class:`DenseFormat`); :mod:`kvjax.attention` matches them
        against the formats its kernels take. None by default: attention then decodes."""
        return ()

    # -- helpers ------------------------------------------------------------------
    def _check_input(self, x: jax.Array) -> jax.Array:
        if x.ndim < 2:
            raise CodecError(f"{self.spec}: expected x[..., T, D], got shape {x.shape}")
        self.check_head_dim(int(x.shape[-1]))
        if x.shape[-2] % self.block_tokens:
            raise CodecError(
                f"{self.spec}: token axis {x.shape[-2]} is not a multiple of the "
                f"block of {self.block_tokens} tokens"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise CodecError(f"{self.spec}: expected floating input, got {x.dtype}")
        if not isinstance(x, jax.core.Tracer):
            # a concrete array may still meet the check inside a trace (a closed-over
            # constant): evaluate it eagerly there too
            with jax.ensure_compile_time_eval():
                finite = bool(jnp.all(jnp.isfinite(x)))
            if not finite:
                raise CodecError(f"{self.spec}: input contains NaN or Inf")
        return sanitize(x)


def sanitize(x: jax.Array) -> jax.Array:
    """Replace NaN by 0 and +-Inf by the largest finite float32 (computed in float32)."""
    return jnp.nan_to_num(x.astype(jnp.float32), nan=0.0)


def round_to_dtype(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` rounded to the nearest value of the float ``dtype``, returned as float32.

    A value that a codec both stores narrow (fp16 scales, bf16 raw tokens) and computes
    with must be rounded explicitly: XLA may drop an ``f32 -> f16 -> f32`` round trip
    (``xla_allow_excess_precision``, which it applies on GPU), so ``x.astype(f16)`` used
    inside the same program could differ from what is stored. ``reduce_precision``
    cannot be elided. The result casts to ``dtype`` exactly; ``dtype``'s subnormals flush
    to zero, so callers keep stored scales at or above ``finfo(dtype).smallest_normal``.
    """
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(
        x.astype(jnp.float32), exponent_bits=info.nexp, mantissa_bits=info.nmant
    )


def codes_nbytes(codes: Codes) -> int:
    """Bytes of every stored array of a codes pytree."""
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(codes)))


def measured_bits_per_element(codes: Codes, num_elements: int) -> float:
    """Bits per element measured from the bytes of the stored arrays."""
    if num_elements <= 0:
        raise ValueError("num_elements must be positive")
    return 8.0 * codes_nbytes(codes) / num_elements


# -- kernel formats ------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelFormat:
    """A layout of a codec's stored arrays that attention kernels read without decoding
    (:meth:`Codec.kernel_formats`). Frozen and hashable, like the codecs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntFormat(KernelFormat):
    """Token-wise integer codes: each stored vector is ``zero + scale * c`` with ``c``
    the ``bits``-bit codes of its ``D`` dims.

    Codes pytree: ``"codes"`` uint32 ``[..., T, W]`` (:func:`kvjax.primitives.packing.
    pack_bits` words), ``"scale"`` and ``"zero"`` ``[..., T, 1]``. ``rotate``: None, or
    the orthogonal map ``(params, x) -> R x`` (on the last axis) that every vector went
    through before it was quantized; attention then takes ``q . k = (R q) . (R k)`` for
    keys and rotates a weighted sum of values back (``R^T``) once.
    """

    bits: int
    rotate: Callable[[Params, jax.Array], jax.Array] | None = None

    def arrays(self, codes: Codes) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(codes [..., T, W], scale [..., T], zero [..., T])`` of a codes pytree (the
        unit axis of the scales dropped: a reshape, no copy)."""
        return codes["codes"], codes["scale"][..., 0], codes["zero"][..., 0]

    def rotation(self, params: Params, head_dim: int) -> jax.Array | None:
        """The matrix ``R [D, D]`` (stored ``y = R x``) of one head's ``params``, or None
        when the vectors are stored as they are."""
        if self.rotate is None:
            return None
        # row i of rotate(I) is (R e_i)^T, the i-th column of R
        return self.rotate(params, jnp.eye(head_dim, dtype=jnp.float32)).T


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseFormat(KernelFormat):
    """Vectors stored as they are, in ``dtype``; ``values(codes) -> [..., T, D]`` gives
    them back without a copy."""

    dtype: Any
    values: Callable[[Codes], jax.Array]


# -- registry ------------------------------------------------------

_REGISTRY: dict[str, type[Codec]] = {}


def registry() -> Mapping[str, type[Codec]]:
    """Name -> class of every codec registered so far (no codec is imported here:
    :func:`kvjax.spec.registered` loads the built-in ones first)."""
    return dict(_REGISTRY)


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec reachable by its ``name`` in spec strings."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise TypeError(f"codec name '{cls.name}' is taken by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


# -- option parsing shared by codecs -------------------------------------------------


def parse_int(value: str, what: str, spec: str, lo: int, hi: int) -> int:
    """An int option in ``[lo, hi]`` or a :class:`CodecError` that says what is valid."""
    try:
        out = int(value)
    except ValueError:
        raise CodecError(
            f"{spec}: {what} must be an integer in {lo}..{hi}, got '{value}'"
        ) from None
    if not lo <= out <= hi:
        raise CodecError(f"{spec}: {what} must be in {lo}..{hi}, got {out}")
    return out


def check_range(value: int, what: str, codec_name: str, lo: int, hi: int) -> None:
    """Validate a dataclass field at construction."""
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or not lo <= value <= hi:
        raise CodecError(f"{codec_name}: {what} must be an int in {lo}..{hi}, got {value!r}")


def split_flags(options: list[str], spec: str, known: dict[str, Callable[[str], Any]]):
    """Split ``['4', 'g32', 'token']`` into positional values and ``{prefix: value}``.

    ``known`` maps a flag prefix (``'g'``) or a bare word (``'token'``) to a converter.
    Unknown options raise :class:`CodecError` listing the known ones.
    """
    positional, flags = [], {}

    def put(flag, value):
        if flag in flags:
            raise CodecError(f"{spec}: option '{flag}' given twice")
        flags[flag] = value

    for opt in options:
        if opt in known:
            put(opt, known[opt](opt))
            continue
        prefix = opt.rstrip("0123456789.")
        if prefix and prefix in known and len(prefix) < len(opt):
            put(prefix, known[prefix](opt[len(prefix) :]))
        elif not prefix:
            positional.append(opt)
        else:
            raise CodecError(
                f"{spec}: unknown option '{opt}'; known: {', '.join(sorted(known)) or 'none'}"
            )
    return positional, flags


def fp16_scale_bits(head_dim: int, count: int = 1) -> float:
    """Bits per element of ``count`` fp16 numbers stored per vector of ``head_dim``."""
    return 16.0 * count / head_dim


def packed_words(num_codes: int, bits: int) -> int:
    """uint32 words that hold ``num_codes`` codes of ``bits`` bits packed densely."""
    return math.ceil(num_codes * bits / 32)
