"""HQMQ: Hurwitz-quaternion multiplicative quantization, ``hqmq:sS,rB``.

Each vector is cut into ``C = ceil(D / 4)`` chunks of 4 (zero-padded when ``4`` does not
divide ``D``), each chunk a quaternion ``x = r u`` with radius ``r = |x|`` and direction
``u`` on S^3. The direction becomes the codeword ``q_p * q_s`` (Hamilton product) with the
largest inner product ``<u, q_p q_s>``, ``q_p`` one of the 24 Hurwitz units (the group 2T,
:mod:`kvjax.primitives.quaternion`) and ``q_s`` one of ``S`` seeded Haar-random unit quaternions
drawn per (layer, kv head, K|V) by :meth:`HqmqCodec.init`: ``24 S`` codewords from ``S``
stored quaternions. The radius is quantized uniformly to ``B`` bits on ``[0, scale]``,
``scale`` the vector's largest chunk radius (stored fp16), levels ``k * scale / (2**B-1)``.

Encoding without trying all ``24 S`` codewords: right multiplication by a unit quaternion
is an isometry, so ``<u, q_p q_s> = <u conj(q_s), q_p>``; for each ``q_s`` the best ``q_p``
is the unit of 2T nearest to ``w_s = u conj(q_s)``, found in closed form
(:func:`kvjax.primitives.quaternion.nearest_hurwitz`). Cost: one Hamilton product and a dozen
comparisons per (chunk, ``q_s``) instead of 24 dot products; chunks go through in
batches of :data:`ENCODE_BATCH`, so a long prefill's memory stays bounded.

Storage. The joint index ``24 s + p`` has ``log2(24 S)`` bits of information, not a
whole number; :func:`kvjax.primitives.packing.radix_fields` splits ``24 S = odd * 2**t``
and packs the odd part's digits in mixed radix (5 base-9 digits per 16 bits for S in 24,
48, 96, 192), the rest as plain bits. A vector's ``C`` indices and ``C`` radius codes form one bit
stream, stored as bytes (the last word's unused bytes are not stored)::

    stream    uint8[..., T, H]    H = ceil(bits(C indices of 24 S, C radii of B bits) / 8)
    scale     float16[..., T, 1]
    head_dim  uint8[..., T, 0, D]  zero bytes; records D

Bits per element (:meth:`HqmqCodec.bits_per_element`): ``(8 H + 16) / D``. The paper's
fractional count (its Table 21), ``(log2(24 S) + B) / 4 + 16 / D`` at ``4 | D``, is
:meth:`HqmqCodec.fractional_bits_per_element`; for D = 128 the stored count is 0.02 bit
above it (s24_r3: 3.188 stored vs 3.167; s192_r6: 4.688 vs 4.667), for D = 64 0.08 bit.

Learned codebook (``hqmq:sS,rB,learn``): the paper keeps the secondary codebook
data-free; with ``learn`` its ``S`` quaternions are fitted to calibration vectors
(:meth:`HqmqCodec.fit`, generalized Lloyd on the chunks' directions weighted by their
squared radii; with ``score`` the keys' codebook is then refined with Adam, from
optax, for the calibration queries' score error) and read from a cache's ``fit=``
clause (:mod:`kvjax.calibration`).
Storage and kernels are the same; only the codebook differs.

Outliers (the paper's Med-C) are not part of this codec: any token-wise codec takes them
with the ``medC`` option, see :mod:`kvjax.codecs.outliers` (``hqmq:s96,r4,med3``).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.codec import (
    FP16_MAX,
    Codec,
    CodecError,
    Codes,
    Example,
    HqmqFormat,
    Limits,
    Option,
    Params,
    register,
)
from kvjax.codecs.intn import exact_bits, fp16_scale, head_dim_marker
from kvjax.primitives.packing import (
    fields_bits,
    from_units,
    pack_fields,
    radix_fields,
    radix_group_bits,
    radix_indices,
    radix_plan,
    radix_widths,
    to_units,
    unpack_fields,
)
from kvjax.primitives.quaternion import (
    NUM_HURWITZ,
    HqmqLayout,
    conjugate,
    haar_quaternions,
    hamilton,
    hurwitz_units,
    nearest_hurwitz,
    num_chunks,
    to_chunks,
)

MIN_SECONDARY, MAX_SECONDARY = 1, 4096
MIN_RADIUS_BITS, MAX_RADIUS_BITS = 1, 12
DEFAULT_SECONDARY, DEFAULT_RADIUS_BITS = 96, 4
#: chunks whose ``S`` candidate products are evaluated at once (memory ~ 64 S bytes each)
ENCODE_BATCH = 4096
#: generalized Lloyd iterations of a learned secondary codebook (``learn``)
LLOYD_ITERATIONS = 20
#: the score objective's refinement (``learn,score``): rounds of reassignment, Adam steps
#: per round and their learning rate (unit quaternions move by a few hundredths a step)
SCORE_ROUNDS, SCORE_STEPS, SCORE_LEARNING_RATE = 5, 40, 0.01


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class HqmqCodec(Codec):
    """Token-wise HQMQ with ``secondary`` (S) quaternions and ``radius_bits`` (B).

    Spec ``hqmq:sS,rB`` (both optional: ``hqmq`` is ``hqmq:s96,r4``, the paper's
    headline point). See the module docstring for the method and the layout.
    """

    name: ClassVar[str] = "hqmq"
    #: the fp16 scale is the largest chunk radius, which the vector's norm bounds
    limits: ClassVar[Limits] = Limits(norm=FP16_MAX)
    options: ClassVar[tuple[Option, ...]] = (
        Option.flag("secondary", "s", "secondary codebook size", "S", lo=MIN_SECONDARY,
                    hi=MAX_SECONDARY, always=True),
        Option.flag("radius_bits", "r", "radius bits", "B", lo=MIN_RADIUS_BITS,
                    hi=MAX_RADIUS_BITS, always=True),
        Option.word("learned", "learn", "secondary codebook fitted on calibration data"),
        Option.word("score", "score", "keys' codebook fitted for the attention-score error"),
    )
    examples: ClassVar[tuple[Example, ...]] = (
        Example("hqmq", rel_mse=0.025, seeded=True),
        Example("hqmq:s24,r3", rel_mse=0.06, head_dim=80, seeded=True),
        Example("hqmq:s24,r3,learn", rel_mse=0.06, head_dim=64, seeded=True),
        Example("hqmq:s24,r3,learn,score", rel_mse=0.06, head_dim=64, seeded=True),
    )

    secondary: int = DEFAULT_SECONDARY
    radius_bits: int = DEFAULT_RADIUS_BITS
    learned: bool = False
    score: bool = False

    def validate(self) -> None:
        """``score`` chooses how ``learn`` fits: it needs ``learn``."""
        super().validate()
        if self.score and not self.learned:
            raise CodecError(f"{self.name}: score is an objective of learn; write "
                             f"hqmq:s{self.secondary},r{self.radius_bits},learn,score")

    @property
    def alphabet(self) -> int:
        """Joint codewords ``24 S``."""
        return NUM_HURWITZ * self.secondary

    # -- protocol ---------------------------------------------------------------------
    def init(self, key: jax.Array, head_dim: int) -> Params:
        """``{"secondary": float32[S, 4]}``: Haar-random unit quaternions from ``key``
        (with ``learn``: where :meth:`fit` starts)."""
        self.check_head_dim(head_dim)
        return {"secondary": haar_quaternions(key, self.secondary)}

    @property
    def needs_fit(self) -> bool:
        """With ``learn`` the secondary codebook is fitted (:meth:`fit`)."""
        return self.learned

    def _fit(self, key: jax.Array, x: jax.Array, query_moment: jax.Array | None) -> Params:
        """A secondary codebook fitted to calibration vectors ``x[N, D]`` by generalized
        Lloyd iterations from the Haar-random one of ``key``: every chunk direction ``u``
        (weighted by its squared radius, so the objective is the chunks' squared
        reconstruction error at exact radii) goes to its best codeword ``q_p q_s``; each
        ``q_s`` then moves to the normalized weighted sum of ``conj(q_p) u`` over its
        chunks, which maximizes their summed inner products (left multiplication by a
        unit quaternion is an isometry). A ``q_s`` that gets no chunk stays.
        ``query_moment`` is not used."""
        params = self.init(key, int(x.shape[-1]))
        chunks = to_chunks(x).reshape(-1, 4)
        radius = jnp.linalg.norm(chunks, axis=-1)
        direction = chunks / jnp.maximum(radius, 1e-30)[:, None]
        weight = radius**2
        units = jnp.asarray(hurwitz_units())

        def step(_, secondary):
            index = self.nearest_codeword(secondary, direction)
            s = (index // NUM_HURWITZ).astype(jnp.int32)
            p = (index % NUM_HURWITZ).astype(jnp.int32)
            aligned = hamilton(conjugate(units[p]), direction) * weight[:, None]
            sums = jax.ops.segment_sum(aligned, s, num_segments=self.secondary)
            norm = jnp.linalg.norm(sums, axis=-1, keepdims=True)
            return jnp.where(norm > 0, sums / jnp.maximum(norm, 1e-30), secondary)

        secondary = jax.lax.fori_loop(0, LLOYD_ITERATIONS, step, params["secondary"])
        if self.score and query_moment is not None:
            secondary = self._refine_for_scores(secondary, chunks, query_moment)
        return {"secondary": secondary}

    def _refine_for_scores(self, secondary: jax.Array, chunks: jax.Array,
                           query_moment: jax.Array) -> jax.Array:
        """``secondary`` moved by Adam (optax) to lower the attention-score error of the
        chunks ``[N * C, 4]`` rather than their reconstruction error: with ``M_c`` the
        ``4 x 4`` block of the (trace-normalized) query moment on chunk ``c``, a chunk
        reconstructed as ``r q_p q_s`` errs by ``e^T M_c e``, ``e = x - r q_p q_s``, the
        expected squared score error it adds for the calibration queries (cross-chunk
        terms left out, so chunks stay independent). Each round reassigns the chunks as
        the encoder does (largest inner product), then takes Adam steps on unnormalized
        quaternions, normalized in the loss."""
        import optax

        c = num_chunks(query_moment.shape[-1])
        padded = jnp.zeros((4 * c, 4 * c), jnp.float32).at[
            :query_moment.shape[0], :query_moment.shape[1]].set(query_moment)
        padded = padded / jnp.maximum(jnp.trace(padded) / (4 * c), 1e-30)
        blocks = jnp.stack([padded[4 * i:4 * i + 4, 4 * i:4 * i + 4] for i in range(c)])
        block_of = blocks[jnp.arange(chunks.shape[0]) % c]  # [N * C, 4, 4]
        radius = jnp.linalg.norm(chunks, axis=-1)
        direction = chunks / jnp.maximum(radius, 1e-30)[:, None]
        units = jnp.asarray(hurwitz_units())
        optimizer = optax.adam(SCORE_LEARNING_RATE)

        def loss(raw, s, p):
            unit = raw / jnp.linalg.norm(raw, axis=-1, keepdims=True)
            error = chunks - radius[:, None] * hamilton(units[p], unit[s])
            return jnp.mean(jnp.einsum("ni,nij,nj->n", error, block_of, error))

        def round_(_, raw):
            index = self.nearest_codeword(raw / jnp.linalg.norm(raw, axis=-1,
                                                                 keepdims=True), direction)
            s = (index // NUM_HURWITZ).astype(jnp.int32)
            p = (index % NUM_HURWITZ).astype(jnp.int32)

            def adam(_, state):
                raw, opt = state
                grads = jax.grad(loss)(raw, s, p)
                updates, opt = optimizer.update(grads, opt)
                return optax.apply_updates(raw, updates), opt

            return jax.lax.fori_loop(0, SCORE_STEPS, adam, (raw, optimizer.init(raw)))[0]

        raw = jax.lax.fori_loop(0, SCORE_ROUNDS, round_, secondary)
        return raw / jnp.linalg.norm(raw, axis=-1, keepdims=True)

    def _widths(self, head_dim: int) -> list[tuple[int, int]]:
        """The stream's ``(count, bits)`` fields: the digits' groups, a pad that
        byte-aligns the fields after them where that costs no stored byte (so a kernel
        reads the low index bits and the radii as whole bytes or nibbles), the low
        index bits, the radii."""
        c = num_chunks(head_dim)
        radix = radix_widths(c, self.alphabet)
        low = radix.pop() if self.alphabet % 2 == 0 else None
        digits = fields_bits(radix)
        pad = -digits % 8
        rest = [*([low] if low else []), (c, self.radius_bits)]
        total = digits + fields_bits(rest)
        if pad and math.ceil((total + pad) / 8) == math.ceil(total / 8):
            radix.append((1, pad))
        return [*radix, *rest]

    def _pad_fields(self, head_dim: int) -> int:
        """How many pad fields (0 or 1) follow the digits' groups."""
        c = num_chunks(head_dim)
        return len(self._widths(head_dim)) - len(radix_widths(c, self.alphabet)) - 1

    def _stream_bits(self, head_dim: int) -> int:
        return fields_bits(self._widths(head_dim))

    def _encode(self, params: Params, x: jax.Array) -> Codes:
        head_dim = x.shape[-1]
        chunks = to_chunks(x)
        radius = jnp.linalg.norm(chunks, axis=-1)
        direction = chunks / jnp.maximum(radius, 1e-30)[..., None]
        index = self.nearest_codeword(params["secondary"], direction)

        levels = 2**self.radius_bits - 1
        # a subnormal scale rounds up, so that the largest radius keeps its top level
        scale = fp16_scale(jnp.max(radius, axis=-1, keepdims=True))
        positive = scale > 0
        q = jnp.round(radius / jnp.where(positive, scale, 1.0) * levels)
        q = jnp.where(positive, jnp.clip(q, 0, levels), 0).astype(jnp.uint32)
        fields = radix_fields(index, self.alphabet)
        if self._pad_fields(head_dim):
            low = [fields.pop()] if self.alphabet % 2 == 0 else []
            pad = self._widths(head_dim)[len(fields)][1]
            fields += [(jnp.zeros((*q.shape[:-1], 1), jnp.uint32), pad), *low]
        words = pack_fields([*fields, (q, self.radius_bits)])
        return {
            "stream": to_units(words, self._stream_bits(head_dim)),
            "scale": scale.astype(jnp.float16),
            "head_dim": head_dim_marker(x),
        }

    def nearest_codeword(self, secondary: jax.Array, direction: jax.Array) -> jax.Array:
        """Joint index ``24 s + p`` (uint32) of the codeword ``q_p q_s`` with the largest
        inner product with each quaternion of ``direction[..., 4]``."""
        conj = conjugate(secondary.astype(jnp.float32))  # [S, 4]

        def best(u):  # u [n, 4] -> [n]
            w = hamilton(u[:, None, :], conj[None, :, :])  # [n, S, 4]
            p, score = nearest_hurwitz(w)
            s = jnp.argmax(score, axis=-1)
            p = jnp.take_along_axis(p, s[:, None], axis=-1)[:, 0]
            return (s * NUM_HURWITZ + p).astype(jnp.uint32)

        flat = direction.reshape(-1, 4).astype(jnp.float32)
        n, batch = flat.shape[0], ENCODE_BATCH
        if n <= batch:
            return best(flat).reshape(direction.shape[:-1])
        pad = -n % batch
        batches = jnp.pad(flat, [(0, pad), (0, 0)]).reshape(-1, batch, 4)
        out = jax.lax.map(best, batches).reshape(-1)[:n]
        return out.reshape(direction.shape[:-1])

    def decode(self, params: Params, codes: Codes, dtype: Any = jnp.float32) -> jax.Array:
        """``scale * k / (2**B - 1) * (q_p q_s)`` per chunk, cast to ``dtype``."""
        head_dim = codes["head_dim"].shape[-1]
        c = num_chunks(head_dim)
        widths = self._widths(head_dim)
        fields = unpack_fields(from_units(codes["stream"], self._stream_bits(head_dim)),
                               widths)
        digits = fields[:-1]
        if self._pad_fields(head_dim):
            pad_at = len(radix_widths(c, self.alphabet)) - (self.alphabet % 2 == 0)
            del digits[pad_at]
        index = radix_indices(digits, c, self.alphabet)
        q = fields[-1]
        s = (index // NUM_HURWITZ).astype(jnp.int32)
        p = (index % NUM_HURWITZ).astype(jnp.int32)
        units = jnp.asarray(hurwitz_units())
        codeword = hamilton(units[p], jnp.take(params["secondary"].astype(jnp.float32), s,
                                                axis=0))
        levels = np.float32(1.0 / (2**self.radius_bits - 1))
        radius = q.astype(jnp.float32) * (codes["scale"].astype(jnp.float32) * levels)
        x = (radius[..., None] * codeword).reshape(*q.shape[:-1], 4 * c)
        return x[..., :head_dim].astype(dtype)

    def kernel_formats(self) -> tuple[HqmqFormat, ...]:
        """The byte stream and its codewords as an :class:`~kvjax.codec.HqmqFormat`."""
        return (HqmqFormat(secondary=self.secondary, radius_bits=self.radius_bits,
                           layout=self.kernel_layout, codewords=self.codewords),)

    def codewords(self, params: Params) -> jax.Array:
        """``float32[24 S, 4]``: codeword ``q_p q_s`` of joint index ``24 s + p``."""
        units = jnp.asarray(hurwitz_units())
        secondary = params["secondary"].astype(jnp.float32)
        return hamilton(units[None, :, :], secondary[:, None, :]).reshape(-1, 4)

    def kernel_layout(self, head_dim: int) -> HqmqLayout | None:
        """Where each chunk's fields lie in a token's stream (:class:`~kvjax.primitives.
        quaternion.HqmqLayout`), or None when the low index bits are not whole bytes, the radius
        codes not nibbles, or a digits' group not one or two whole bytes."""
        c = num_chunks(head_dim)
        odd, low, group, full, rest = radix_plan(c, self.alphabet)
        widths = self._widths(head_dim)
        digit_bits = radix_group_bits(odd, group)
        rest_bits = radix_group_bits(odd, rest) if rest else 0
        pad_field = bool(full) + bool(rest)
        padded = rest_bits + (widths[pad_field][1] if self._pad_fields(head_dim) else 0)
        low_offset = full * digit_bits + padded
        radius_offset = low_offset + c * low
        if (low != 8 or self.radius_bits != 4 or digit_bits != 16
                or padded not in (0, 8) or low_offset % 8):
            return None
        return HqmqLayout(chunks=c, odd=odd, group=group, full=full, low_bits=low,
                          radius_bits=self.radius_bits, low_offset=low_offset // 8,
                          radius_offset=radius_offset // 8,
                          size=math.ceil(self._stream_bits(head_dim) / 8))

    def bits_per_element(self, head_dim: int) -> float:
        """The stored stream's bytes plus the fp16 scale, per element."""
        self.check_head_dim(head_dim)
        return exact_bits(8 * math.ceil(self._stream_bits(head_dim) / 8) + 16, head_dim)

    def fractional_bits_per_element(self, head_dim: int) -> float:
        """The paper's count: ``log2(24 S) + B`` bits per chunk of 4 (padding included)
        plus the fp16 scale, per element (Table 21's last column at D = 128)."""
        self.check_head_dim(head_dim)
        c = num_chunks(head_dim)
        return (c * (math.log2(self.alphabet) + self.radius_bits) + 16) / head_dim

    def padding_overhead(self, head_dim: int) -> Fraction:
        """Fraction of extra elements the zero-padding to whole chunks costs
        (``ceil(D / 4) * 4 / D - 1``; the paper's Appendix U.1)."""
        return Fraction(4 * num_chunks(head_dim), head_dim) - 1

