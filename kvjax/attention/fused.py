"""The adapter between a cache layer view and the fused kernels of :mod:`pallas_kernels`.

A kernel sees arrays only: it returns the partial softmax ``(o, m, l)`` of the query rows
over the coded tokens (:mod:`pallas_kernels.partial`). This module is the one place that
opens a layer view for a kernel: it takes the arrays out of the stores through the
format each codec offers (:meth:`kvjax.codec.Codec.kernel_formats`), and merges the
kernel's partial with the raw sinks and the residual window (a few dozen tokens,
attended in jnp), for every kernel alike (:func:`merged_decode`).

A kernel over :class:`~kvjax.codec.IntFormat` codes registers with
:func:`int_codes_kernel`; one over rotated keys (a :class:`~kvjax.codec.RotatedKeyFormat`:
TurboQuant's codebook codes, ...) and :class:`~kvjax.codec.GroupIntFormat` values with
:func:`rotated_kernel`, naming its key format. A kernel over a new kind of format adds
its own small adapter here (how its entry takes the arrays of that format) and reuses
:func:`merged_decode` and :func:`decode_reason`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvjax.attention.dispatch import REGISTRY, Call, Impl
from kvjax.cache import Segment
from kvjax.codec import Codec, GroupIntFormat, IntFormat, KernelFormat, RotatedKeyFormat
from pallas_kernels.partial import dense_partial, merge_partials, normalize

#: a kernel's array-level entry, e.g. :func:`pallas_kernels.int_decode.api.int_decode`
Entry = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
#: ``(qg [B, K, G, D], coded tokens per row [B]) -> partial over the coded tokens``
CodedPartial = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


def merged_decode(q: jax.Array, layer: Segment, lengths: jax.Array, scale: float,
                  coded: CodedPartial) -> jax.Array:
    """Decode attention ``q [B, N, D] -> [B, N, D]`` (float32) over a layer view whose
    coded region ``coded`` attends; the raw sinks and the residual window (with the
    unfinished block) are attended here and every partial merged exactly.

    ``lengths [B]`` counts each row's stored tokens, the query's own included (append,
    then attend). K and V must hold their tokens in the same regions (equal blocks).
    """
    batch, num_heads, head_dim = q.shape
    k_store, v_store = layer.k, layer.v
    heads = k_store.raw.shape[1]
    qg = q.astype(jnp.float32).reshape(batch, heads, num_heads // heads, head_dim)
    n_sink, n_comp, n_raw = k_store.counts(lengths)
    parts = [coded(qg, n_comp)]
    if k_store.sinks:
        ok = jnp.arange(k_store.sinks)[None, :] < n_sink[:, None]
        parts.append(dense_partial(qg, k_store.sink, v_store.sink, ok, sm_scale=scale))
    if k_store.raw_capacity:
        ok = jnp.arange(k_store.raw_capacity)[None, :] < n_raw[:, None]
        parts.append(dense_partial(qg, k_store.raw, v_store.raw, ok, sm_scale=scale))
    return normalize(*merge_partials(parts)).reshape(batch, num_heads, head_dim)


def kernel_format(codec: Codec, kind: type[KernelFormat]) -> KernelFormat | None:
    """The format of class ``kind`` that ``codec`` offers, or None."""
    return next((f for f in codec.kernel_formats() if isinstance(f, kind)), None)


def decode_reason(call: Call) -> str | None:
    """Why a one-token decode kernel cannot serve ``call`` whatever its codecs (None:
    it may)."""
    if call.num_tokens != 1:
        return f"it decodes one query token per row, got {call.num_tokens}"
    if call.sliding_window is not None:
        return "it has no sliding window"
    return None


# -- kernels over IntFormat codes --------------------------------------------------------


def int_format(codec: Codec) -> IntFormat | None:
    """The :class:`~kvjax.codec.IntFormat` ``codec`` offers, or None."""
    return kernel_format(codec, IntFormat)


def _rotations(fmt: IntFormat, params, head_dim: int) -> jax.Array | None:
    """``[K, D, D]`` per-head rotation matrices of a store's ``params``, or None."""
    if fmt.rotate is None:
        return None
    return jax.vmap(lambda p: fmt.rotation(p, head_dim))(params)


def int_codes_decode(q: jax.Array, layer: Segment, lengths: jax.Array, *, entry: Entry,
                     scale: float | None = None, **options) -> jax.Array:
    """Decode attention ``q [B, N, D] -> [B, N, D]`` (float32) over a layer view whose K
    and V offer :class:`~kvjax.codec.IntFormat` codes, with ``entry`` (a kernel's
    array-level entry, or its reference) over the coded region. ``options`` go to
    ``entry`` (blocking, ``interpret``)."""
    k_store, v_store = layer.k, layer.v
    k_fmt, v_fmt = int_format(k_store.codec), int_format(v_store.codec)
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale

    def coded(qg, n_comp):
        # in a scan over layers the codes are the segment's whole stack (Store.layer)
        return entry(qg, *k_fmt.arrays(k_store.codes), *v_fmt.arrays(v_store.codes), n_comp,
                     k_store.layer, _rotations(k_fmt, k_store.params, head_dim),
                     _rotations(v_fmt, v_store.params, head_dim),
                     bits=k_fmt.bits, offset=k_fmt.offset, sm_scale=scale, **options)

    return merged_decode(q, layer, lengths, scale, coded)


def int_codes_supports(call: Call, unsupported: Callable[[int, int], str | None]) -> str | None:
    """Why a kernel over IntFormat codes cannot serve ``call`` (None: it can);
    ``unsupported(bits, head_dim)`` is the kernel's own rule."""
    reason = decode_reason(call)
    if reason is not None:
        return reason
    formats = []
    for role, codec in (("K", call.layer.k.codec), ("V", call.layer.v.codec)):
        fmt = int_format(codec)
        if fmt is None:
            return f"{role} '{codec.spec}' offers no int-codes kernel format"
        if not codec.scores_reconstruct:
            return f"{role} '{codec.spec}' scores keys by an estimator of its own"
        formats.append(fmt)
    k_fmt, v_fmt = formats
    if k_fmt.bits != v_fmt.bits:
        return f"K and V bit widths differ ({k_fmt.bits} vs {v_fmt.bits})"
    if k_fmt.offset != v_fmt.offset:
        return f"K and V code offsets differ ({k_fmt.offset} vs {v_fmt.offset})"
    return unsupported(k_fmt.bits, call.head_dim)


def int_codes_kernel(name: str, entry: Entry,
                     unsupported: Callable[[int, int], str | None]) -> Impl:
    """The registry entry of a fused decode kernel over IntFormat codes: ``entry`` takes
    the arrays of :func:`pallas_kernels.int_decode.api.int_decode`'s signature and
    ``unsupported(bits, head_dim)`` says what it cannot read."""

    def run(call: Call) -> jax.Array:
        out = int_codes_decode(call.q[:, 0], call.layer, call.lengths, entry=entry,
                               scale=call.scale)
        return out[:, None]

    return Impl(name=name, supports=lambda call: int_codes_supports(call, unsupported),
                run=run, fused=True)


# -- kernels over rotated keys and GroupIntFormat values -----------------------------------


def rotated_formats(k_codec: Codec, v_codec: Codec, key_format: type[RotatedKeyFormat]
                    ) -> tuple[RotatedKeyFormat, GroupIntFormat] | str:
    """The formats a kernel over ``key_format`` keys and group-wise INT values reads from
    a K and a V codec, or why they offer none."""
    k_fmt = kernel_format(k_codec, key_format)
    v_fmt = kernel_format(v_codec, GroupIntFormat)
    if k_fmt is None:
        return f"K '{k_codec.spec}' offers no {key_format.__name__}"
    if v_fmt is None:
        return f"V '{v_codec.spec}' offers no group-wise INT kernel format"
    return k_fmt, v_fmt


def rotated_options(k_fmt: RotatedKeyFormat, v_fmt: GroupIntFormat, head_dim: int,
                    scale: float | None = None) -> dict:
    """The static arguments of such a kernel's entry for these formats: the keys' own
    (:meth:`~kvjax.codec.RotatedKeyFormat.options`), the values' width and group, and
    ``sm_scale`` (default ``D ** -0.5``)."""
    return {**k_fmt.options(head_dim), "value_bits": v_fmt.bits, "value_group": v_fmt.group,
            "sm_scale": head_dim**-0.5 if scale is None else scale}


def rotated_codes_decode(q: jax.Array, layer: Segment, lengths: jax.Array, *, entry: Entry,
                         key_format: type[RotatedKeyFormat], scale: float | None = None,
                         **options) -> jax.Array:
    """Decode attention ``q [B, N, D] -> [B, N, D]`` (float32) over a layer view whose K
    offers ``key_format`` codes and V :class:`~kvjax.codec.GroupIntFormat` codes, with
    ``entry`` (a kernel's array-level entry, or its reference; the signature of
    :func:`pallas_kernels.codebook_decode.api.codebook_decode`) over the coded region.
    ``options`` go to ``entry``."""
    k_store, v_store = layer.k, layer.v
    k_fmt, v_fmt = rotated_formats(k_store.codec, v_store.codec, key_format)
    static = rotated_options(k_fmt, v_fmt, q.shape[-1], scale)

    def coded(qg, n_comp):
        codes, norm, *qjl = k_fmt.arrays(k_store.codes)
        sketch = k_store.params["sketch"] if k_fmt.qjl else None
        k_qjl, residual_norm = qjl if k_fmt.qjl else (None, None)
        return entry(qg, codes, norm, *v_fmt.arrays(v_store.codes), n_comp, k_store.layer,
                     k_store.params["signs"], k_qjl, residual_norm, sketch, **static,
                     **options)

    return merged_decode(q, layer, lengths, static["sm_scale"], coded)


def rotated_supports(call: Call, key_format: type[RotatedKeyFormat],
                     unsupported: Callable[..., str | None]) -> str | None:
    """Why a kernel over ``key_format`` keys and group-wise INT values cannot serve
    ``call`` (None: it can); ``unsupported(head_dim, value_bits, value_group,
    **key_options)`` is the kernel's own rule."""
    reason = decode_reason(call)
    if reason is not None:
        return reason
    formats = rotated_formats(call.layer.k.codec, call.layer.v.codec, key_format)
    if isinstance(formats, str):
        return formats
    k_fmt, v_fmt = formats
    return unsupported(call.head_dim, v_fmt.bits, v_fmt.group, **k_fmt.options(call.head_dim))


@dataclasses.dataclass(frozen=True)
class RotatedImpl(Impl):
    """A registered kernel over rotated keys and group-wise INT values, with what a
    benchmark needs to call it directly: its array-level ``entry``, the ``key_format``
    it reads and its ``unsupported(head_dim, value_bits, value_group, **key_options)``
    rule."""

    entry: Entry | None = None
    key_format: type[RotatedKeyFormat] | None = None
    unsupported: Callable[..., str | None] | None = None


def rotated_kernel(name: str, entry: Entry, key_format: type[RotatedKeyFormat],
                   unsupported: Callable[..., str | None], auto: bool = True) -> RotatedImpl:
    """The registry entry of a fused decode kernel over ``key_format`` keys and
    group-wise INT values: ``entry`` takes the arrays of :func:`pallas_kernels.
    codebook_decode.api.codebook_decode`'s signature with the key options of the format,
    ``unsupported`` says what it cannot read (:func:`rotated_supports`); ``auto``:
    whether ``"auto"`` includes it."""

    def run(call: Call) -> jax.Array:
        out = rotated_codes_decode(call.q[:, 0], call.layer, call.lengths, entry=entry,
                                   key_format=key_format, scale=call.scale)
        return out[:, None]

    return RotatedImpl(
        name=name, supports=lambda call: rotated_supports(call, key_format, unsupported),
        run=run, fused=True, auto=auto, entry=entry, key_format=key_format,
        unsupported=unsupported)


def rotated_entry(k_codec: Codec, v_codec: Codec, head_dim: int
                  ) -> tuple[RotatedImpl, RotatedKeyFormat, GroupIntFormat]:
    """The first registered kernel over rotated keys (registration order) that reads
    these codecs at ``head_dim``, with the formats it reads; a ``ValueError`` naming each
    kernel's reason otherwise."""
    reasons = []
    for impl in REGISTRY.values():
        if not isinstance(impl, RotatedImpl):
            continue
        formats = rotated_formats(k_codec, v_codec, impl.key_format)
        if isinstance(formats, str):
            reasons.append(f"{impl.name}: {formats}")
            continue
        k_fmt, v_fmt = formats
        reason = impl.unsupported(head_dim, v_fmt.bits, v_fmt.group, **k_fmt.options(head_dim))
        if reason is None:
            return impl, k_fmt, v_fmt
        reasons.append(f"{impl.name}: {reason}")
    raise ValueError(f"no kernel over rotated keys reads K '{k_codec.spec}' and V "
                     f"'{v_codec.spec}' at head_dim {head_dim}: " + "; ".join(reasons))


def encoded_cache(k_codec: Codec, v_codec: Codec, *, batch: int, heads: int, slots: int,
                  head_dim: int, key: jax.Array) -> tuple:
    """``(k_params, k_codes, v_codes)``: ``slots`` Gaussian keys and values of each of
    ``batch`` rows and ``heads`` kv heads encoded by the codecs (codes ``[B, K, S, ...]``),
    one parameter draw of the key codec per head."""
    keys = jax.random.split(key, 3)
    k = jax.random.normal(keys[0], (batch, heads, slots, head_dim))
    v = jax.random.normal(keys[1], (batch, heads, slots, head_dim))
    params = jax.vmap(lambda kk: k_codec.init(kk, head_dim))(jax.random.split(keys[2], heads))
    k_codes = jax.vmap(k_codec.encode, in_axes=(0, 1), out_axes=1)(params, k)
    return params, k_codes, v_codec.encode(None, v)


def entry_arrays(k_codec: Codec, v_codec: Codec, k_fmt: RotatedKeyFormat,
                 v_fmt: GroupIntFormat, *, batch: int, heads: int, slots: int, head_dim: int,
                 key: jax.Array, distinct: int | None = None
                 ) -> tuple[dict[str, jax.Array], tuple]:
    """The arrays a rotated-key kernel's entry takes (``k_codes`` .. ``qjl_sketch``,
    every row full) for ``slots`` tokens of ``heads`` kv heads encoded by the codecs
    from Gaussian vectors (one parameter draw per head) and read through the formats
    (:func:`rotated_entry`), and ``(k_params, k_codes, v_codes)``, the codecs' own
    pytrees. ``distinct``: encode that many tokens and repeat them along the cache (a
    kernel's speed depends on the bytes, not on which tokens repeat; encoding a 32k
    cache would cost more than the benchmark)."""
    count = slots if distinct is None else min(slots, distinct)
    params, k_codes, v_codes = encoded_cache(k_codec, v_codec, batch=batch, heads=heads,
                                             slots=count, head_dim=head_dim, key=key)
    if count < slots:
        index = jnp.arange(slots) % count
        k_codes, v_codes = (jax.tree.map(lambda a: jnp.take(a, index, axis=2), c)
                            for c in (k_codes, v_codes))
    codes, norm, *qjl = k_fmt.arrays(k_codes)
    v_words, v_scale, v_zero = v_fmt.arrays(v_codes)
    arrays = {"k_codes": codes, "k_norm": norm, "v_codes": v_words, "v_scale": v_scale,
              "v_zero": v_zero, "lengths": jnp.full((batch,), slots, jnp.int32),
              "k_signs": params["signs"]}
    if k_fmt.qjl:
        arrays.update(k_qjl=qjl[0], k_residual_norm=qjl[1], qjl_sketch=params["sketch"])
    return arrays, (params, k_codes, v_codes)
