"""The adapter between a cache layer view and the fused kernels of :mod:`pallas_kernels`.

A kernel sees arrays only: it returns the partial softmax ``(o, m, l)`` of the query rows
over the coded tokens (:mod:`pallas_kernels.partial`). This module is the one place that
opens a layer view for a kernel: it takes the arrays out of the stores through the
format each codec offers (:meth:`kvjax.codec.Codec.kernel_formats`), and merges the
kernel's partial with the raw sinks and the residual window (a few dozen tokens,
attended in jnp), for every kernel alike (:func:`merged_attention`).

A kernel over :class:`~kvjax.codec.IntFormat` codes registers with
:func:`int_codes_kernel`; one over rotated keys (a :class:`~kvjax.codec.RotatedKeyFormat`:
TurboQuant's codebook codes, ...) and :class:`~kvjax.codec.GroupIntFormat` values with
:func:`rotated_kernel`, naming its key format. A kernel over a new kind of format adds
its own small adapter here (how its entry takes the arrays of that format, and which
formats it ``reads``) and registers through :func:`kernel_impl`, reusing
:func:`merged_attention` and :func:`decode_reason`. Benchmarks and profilers reach every
registered kernel the same way: :func:`find_kernel` (which kernel reads a K and a V
codec) and :func:`kernel_call` (that kernel bound to a cache of their codes).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvjax.attention.dispatch import REGISTRY, Call, Impl
from kvjax.attention.reference import group_queries, row_positions, ungroup_output
from kvjax.cache import Segment
from kvjax.codec import (
    Codec,
    DenseFormat,
    GroupIntFormat,
    HqmqFormat,
    IntFormat,
    KernelFormat,
    Params,
    RiceFormat,
    RotatedKeyFormat,
)
from pallas_kernels.partial import dense_partial, merge_partials, normalize

#: a kernel's array-level entry, e.g. :func:`pallas_kernels.int_decode.api.int_decode`
Entry = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
#: ``(qg [B, K, R, D], coded tokens each query row sees [B] or [B, R]) -> partial over
#: the coded tokens``
CodedPartial = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


def merged_attention(q: jax.Array, layer: Segment, lengths: jax.Array, scale: float,
                     coded: CodedPartial, positions: jax.Array | None = None) -> jax.Array:
    """Attention over a layer view whose coded region ``coded`` attends; the raw sinks
    and the residual window (with the unfinished block) are attended here and every
    partial merged exactly.

    ``q [B, N, D] -> [B, N, D]``: one decode query per row, after the row's every stored
    token; ``q [B, T, N, D] -> [B, T, N, D]`` with ``positions [B, T]``: a chunk's
    queries, each seeing the stored tokens at or before its position (causal), the
    coded ones through per-row token counts that the kernel walks tile by tile (so no
    layer is ever decoded whole). Float32 out. ``lengths [B]`` counts each row's stored
    tokens, the chunk's own included (append, then attend). K and V must hold their
    tokens in the same regions (equal blocks).
    """
    chunk = q.ndim == 4
    if chunk and positions is None:
        raise ValueError("a chunk's queries [B, T, N, D] need their positions [B, T]")
    if not chunk:
        q = q[:, None]
    batch, num_tokens, num_heads, _ = q.shape
    k_store, v_store = layer.k, layer.v
    heads = k_store.raw.shape[1]
    qg = group_queries(q.astype(jnp.float32), heads)  # rows ordered g * T + t
    n_sink, n_comp, n_raw = k_store.counts(lengths)
    if chunk:
        rows_pos = row_positions(positions, num_heads // heads)  # [B, R]
        # a row sees the coded tokens up to its position: slot s holds position sinks + s
        limits = jnp.clip(rows_pos - k_store.sinks + 1, 0, n_comp[:, None])
    else:
        limits = n_comp

    def seen(pos: jax.Array, stored: jax.Array) -> jax.Array:
        """Which tokens at ``pos [B, n]`` (``stored [B, n]``) each query row sees:
        ``[B, n]`` for a decode, ``[B, R, n]`` (causal) for a chunk."""
        if not chunk:
            return stored
        return stored[:, None, :] & (pos[:, None, :] <= rows_pos[:, :, None])

    parts = [coded(qg, limits)]
    if k_store.sinks:
        pos = jnp.broadcast_to(jnp.arange(k_store.sinks, dtype=jnp.int32), (batch, k_store.sinks))
        ok = seen(pos, pos < n_sink[:, None])
        parts.append(dense_partial(qg, k_store.sink, v_store.sink, ok, sm_scale=scale))
    if k_store.raw_capacity:
        slot = jnp.arange(k_store.raw_capacity, dtype=jnp.int32)[None, :]
        ok = seen(k_store.sinks + n_comp[:, None] + slot, slot < n_raw[:, None])
        parts.append(dense_partial(qg, k_store.raw, v_store.raw, ok, sm_scale=scale))
    out = ungroup_output(normalize(*merge_partials(parts)), num_tokens)
    return out if chunk else out[:, 0]


def kernel_format(codec: Codec, kind: type[KernelFormat]) -> KernelFormat | None:
    """The format of class ``kind`` that ``codec`` offers, or None."""
    return next((f for f in codec.kernel_formats() if isinstance(f, kind)), None)


def role_formats(k_codec: Codec, v_codec: Codec, kind: type[KernelFormat], missing: str
                 ) -> tuple[KernelFormat, KernelFormat] | str:
    """The formats of class ``kind`` a K and a V codec offer, or the reason naming the
    first that offers none (``"{role} '{spec}' {missing}"``)."""
    formats = []
    for role, codec in (("K", k_codec), ("V", v_codec)):
        fmt = kernel_format(codec, kind)
        if fmt is None:
            return f"{role} '{codec.spec}' {missing}"
        formats.append(fmt)
    return tuple(formats)


def decode_reason(call: Call) -> str | None:
    """Why a fused kernel over codes cannot serve ``call`` whatever its codecs (None: it
    may): a decode, or a chunk of several tokens, without a sliding window."""
    if call.sliding_window is not None:
        return "it has no sliding window"
    return None


def page_options(store) -> dict:
    """A kernel entry's paging arguments for a layer view's store: none for a
    contiguous one, else its rows' block tables and the tokens of a page."""
    if not store.page_blocks:
        return {}
    return {"pages": store.pages, "page_tokens": store.page_blocks * store.block}


#: warps per program of a chunk's call: its programs hold :data:`~pallas_kernels.flash.
#: BLOCK_ROWS` query rows, four times a decode's (whose programs run 2)
CHUNK_WARPS = 4


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
                     scale: float | None = None,
                     positions: jax.Array | None = None, **options) -> jax.Array:
    """Attention ``q [B, N, D] -> [B, N, D]`` (a decode; or a chunk's ``[B, T, N, D]`` at
    ``positions [B, T]``: :func:`merged_attention`), float32, over a layer view whose K
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
                     bits=k_fmt.bits, offset=k_fmt.offset, sm_scale=scale,
                     **page_options(k_store), **options)

    return merged_attention(q, layer, lengths, scale, coded, positions)


def int_formats(k_codec: Codec, v_codec: Codec) -> tuple[IntFormat, IntFormat] | str:
    """The :class:`~kvjax.codec.IntFormat` of a K and a V codec that one kernel call can
    read together (same width, same offset), or why there is none."""
    formats = role_formats(k_codec, v_codec, IntFormat, "offers no int-codes kernel format")
    if isinstance(formats, str):
        return formats
    for role, codec in (("K", k_codec), ("V", v_codec)):
        if not codec.scores_reconstruct:
            return f"{role} '{codec.spec}' scores keys by an estimator of its own"
    k_fmt, v_fmt = formats
    if k_fmt.bits != v_fmt.bits:
        return f"K and V bit widths differ ({k_fmt.bits} vs {v_fmt.bits})"
    if k_fmt.offset != v_fmt.offset:
        return f"K and V code offsets differ ({k_fmt.offset} vs {v_fmt.offset})"
    return k_fmt, v_fmt


def int_reads(k_codec: Codec, v_codec: Codec, head_dim: int,
              unsupported: Callable[[int, int], str | None]
              ) -> tuple[IntFormat, IntFormat] | str:
    """The formats a kernel over IntFormat codes reads from these codecs at ``head_dim``,
    or why it cannot; ``unsupported(bits, head_dim)`` is the kernel's own rule."""
    formats = int_formats(k_codec, v_codec)
    if isinstance(formats, str):
        return formats
    return unsupported(formats[0].bits, head_dim) or formats


@dataclasses.dataclass(frozen=True)
class KernelImpl(Impl):
    """A registered fused decode kernel, with what a benchmark needs to call it directly:
    its array-level ``entry`` and ``reads(k_codec, v_codec, head_dim)``, the K and V
    formats it reads from those codecs or why it cannot."""

    entry: Entry | None = None
    reads: Callable[[Codec, Codec, int], tuple | str] | None = None


def kernel_impl(name: str, entry: Entry, reads: Callable[[Codec, Codec, int], tuple | str],
                decode: Callable[..., jax.Array], auto: bool = True) -> KernelImpl:
    """The registry entry of a fused kernel over codes: it serves a call whose codecs it
    ``reads``, a decode (``decode(q [B, N, D], layer, lengths, scale=...)``) or a
    chunk's queries (``q [B, T, N, D]`` with ``positions=``), walking the coded tokens in
    place tile by tile either way, through a paged cache's block tables too (its
    ``decode`` passes the entry :func:`page_options`)."""

    def supports(call: Call) -> str | None:
        reason = decode_reason(call)
        if reason is None:
            formats = reads(call.layer.k.codec, call.layer.v.codec, call.head_dim)
            reason = formats if isinstance(formats, str) else None
        return reason

    def run(call: Call) -> jax.Array:
        if call.num_tokens == 1:
            return decode(call.q[:, 0], call.layer, call.lengths, scale=call.scale)[:, None]
        return decode(call.q, call.layer, call.lengths, scale=call.scale,
                      positions=call.step.positions(call.num_tokens), num_warps=CHUNK_WARPS)

    return KernelImpl(name=name, supports=supports, run=run, fused=True, auto=auto,
                      entry=entry, reads=reads)


def int_codes_kernel(name: str, entry: Entry,
                     unsupported: Callable[[int, int], str | None]) -> KernelImpl:
    """The registry entry of a fused decode kernel over IntFormat codes: ``entry`` takes
    the arrays of :func:`pallas_kernels.int_decode.api.int_decode`'s signature and
    ``unsupported(bits, head_dim)`` says what it cannot read."""
    return kernel_impl(name, entry,
                       functools.partial(int_reads, unsupported=unsupported),
                       functools.partial(int_codes_decode, entry=entry))


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
                         positions: jax.Array | None = None, **options) -> jax.Array:
    """Attention ``q [B, N, D] -> [B, N, D]`` (a decode; or a chunk's ``[B, T, N, D]`` at
    ``positions [B, T]``: :func:`merged_attention`), float32, over a layer view whose K
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
                     **page_options(k_store), **options)

    return merged_attention(q, layer, lengths, static["sm_scale"], coded, positions)


def rotated_reads(k_codec: Codec, v_codec: Codec, head_dim: int, *,
                  key_format: type[RotatedKeyFormat], unsupported: Callable[..., str | None]
                  ) -> tuple[RotatedKeyFormat, GroupIntFormat] | str:
    """The formats a kernel over ``key_format`` keys and group-wise INT values reads from
    these codecs at ``head_dim``, or why it cannot; ``unsupported(head_dim, value_bits,
    value_group, **key_options)`` is the kernel's own rule."""
    formats = rotated_formats(k_codec, v_codec, key_format)
    if isinstance(formats, str):
        return formats
    k_fmt, v_fmt = formats
    return unsupported(head_dim, v_fmt.bits, v_fmt.group, **k_fmt.options(head_dim)) or formats


def rotated_kernel(name: str, entry: Entry, key_format: type[RotatedKeyFormat],
                   unsupported: Callable[..., str | None], auto: bool = True) -> KernelImpl:
    """The registry entry of a fused decode kernel over ``key_format`` keys and
    group-wise INT values: ``entry`` takes the arrays of :func:`pallas_kernels.
    codebook_decode.api.codebook_decode`'s signature with the key options of the format,
    ``unsupported`` says what it cannot read (:func:`rotated_reads`); ``auto``: whether
    ``"auto"`` includes it."""
    return kernel_impl(name, entry,
                       functools.partial(rotated_reads, key_format=key_format,
                                         unsupported=unsupported),
                       functools.partial(rotated_codes_decode, entry=entry,
                                         key_format=key_format), auto=auto)


# -- kernels over HQMQ codes ---------------------------------------------------------------


def shared_layout(k_codec: Codec, v_codec: Codec, head_dim: int, kind: type[KernelFormat],
                  name: str, what: str) -> tuple | str:
    """``(k_fmt, v_fmt, layout)``: the K and V formats of class ``kind`` and the layout
    they share at ``head_dim`` (one kernel call reads both), or why there are none
    (``name`` names the format, ``what`` its codes in the reasons)."""
    formats = role_formats(k_codec, v_codec, kind, f"offers no {name} kernel format")
    if isinstance(formats, str):
        return formats
    k_fmt, v_fmt = formats
    layout = k_fmt.layout(head_dim)
    if v_fmt.layout(head_dim) != layout:
        return f"K '{k_codec.spec}' and V '{v_codec.spec}' {what} differ in layout"
    return k_fmt, v_fmt, layout


def hqmq_reads(k_codec: Codec, v_codec: Codec, head_dim: int,
               unsupported: Callable[..., str | None]) -> tuple[HqmqFormat, HqmqFormat] | str:
    """The formats a kernel over HQMQ keys and values reads from these codecs at
    ``head_dim``, or why it cannot; ``unsupported(layout, head_dim, outlier_blocks)``
    (the Med-C blocks of the roles that have them) is the kernel's own rule."""
    shared = shared_layout(k_codec, v_codec, head_dim, HqmqFormat, "HQMQ", "streams")
    if isinstance(shared, str):
        return shared
    k_fmt, v_fmt, layout = shared
    blocks = tuple(f.outliers.block for f in (k_fmt, v_fmt) if f.outliers is not None)
    return unsupported(layout, head_dim, blocks) or (k_fmt, v_fmt)


def hqmq_tables(fmt: HqmqFormat, params) -> jax.Array:
    """``[K, 4, 24 S]`` codeword tables of a store's per-head ``params``."""
    return jax.vmap(lambda p: fmt.codewords(p).T)(params)


def hqmq_outliers(k_fmt: HqmqFormat, k_codes, v_fmt: HqmqFormat, v_codes) -> dict:
    """The Med-C arrays of the HQMQ kernel's entry (``k_outlier_flags``, ``k_outliers``,
    pooled ``k_outlier_start``, ``v_...``) for the roles whose format has outliers."""
    out = {}
    for role, fmt, codes in (("k", k_fmt, k_codes), ("v", v_fmt, v_codes)):
        arrays = fmt.outlier_arrays(codes)
        if arrays is not None:
            names = ("outlier_flags", "outliers", "outlier_start")[:len(arrays)]
            out.update({f"{role}_{name}": a for name, a in zip(names, arrays, strict=True)})
    return out


def hqmq_codes_decode(q: jax.Array, layer: Segment, lengths: jax.Array, *, entry: Entry,
                      scale: float | None = None,
                      positions: jax.Array | None = None, **options) -> jax.Array:
    """Attention ``q [B, N, D] -> [B, N, D]`` (a decode; or a chunk's ``[B, T, N, D]`` at
    ``positions [B, T]``: :func:`merged_attention`), float32, over a layer view whose K
    and V offer :class:`~kvjax.codec.HqmqFormat` codes, with ``entry`` (the signature of
    :func:`pallas_kernels.hqmq_decode.api.hqmq_decode`) over the coded region."""
    k_store, v_store = layer.k, layer.v
    k_fmt = kernel_format(k_store.codec, HqmqFormat)
    v_fmt = kernel_format(v_store.codec, HqmqFormat)
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale

    def coded(qg, n_comp):
        return entry(qg, *k_fmt.arrays(k_store.codes), *v_fmt.arrays(v_store.codes), n_comp,
                     hqmq_tables(k_fmt, k_store.params), hqmq_tables(v_fmt, v_store.params),
                     k_store.layer, **hqmq_outliers(k_fmt, k_store.codes, v_fmt, v_store.codes),
                     layout=k_fmt.layout(head_dim), sm_scale=scale, **page_options(k_store),
                     **options)

    return merged_attention(q, layer, lengths, scale, coded, positions)


def hqmq_kernel(name: str, entry: Entry, unsupported: Callable[..., str | None],
                auto: bool = True) -> KernelImpl:
    """The registry entry of a fused decode kernel over HQMQ keys and values: ``entry``
    takes the arrays of :func:`pallas_kernels.hqmq_decode.api.hqmq_decode`'s signature,
    ``unsupported(layout, head_dim)`` says what it cannot read."""
    return kernel_impl(name, entry, functools.partial(hqmq_reads, unsupported=unsupported),
                       functools.partial(hqmq_codes_decode, entry=entry), auto=auto)


# -- kernels over Rice-coded HyperQuant blocks ------------------------------------------


def rice_reads(k_codec: Codec, v_codec: Codec, head_dim: int,
               unsupported: Callable[..., str | None]) -> tuple[RiceFormat, RiceFormat] | str:
    """The formats a kernel over Rice blocks reads from these codecs at ``head_dim``, or
    why it cannot; ``unsupported(layout, head_dim)`` is the kernel's own rule."""
    shared = shared_layout(k_codec, v_codec, head_dim, RiceFormat, "Rice", "blocks")
    if isinstance(shared, str):
        return shared
    k_fmt, v_fmt, layout = shared
    return unsupported(layout, head_dim) or (k_fmt, v_fmt)


def per_head(fn: Callable[[Params, jax.Array], jax.Array], params, x: jax.Array) -> jax.Array:
    """``fn`` of each kv head's parameters (leaves ``[K, ...]``) on ``x [B, K, ...]``."""
    return jax.vmap(fn, in_axes=(0, 1), out_axes=1)(params, x)


def rice_entry(q: jax.Array, k_params, v_params, *arrays, entry: Entry, k_fmt: RiceFormat,
               v_fmt: RiceFormat, **options):
    """``entry`` (the Rice kernel's or its reference's) on a query in the original frame:
    rotated by the keys' rotation on the way in, the output by the values' inverse on
    the way out."""
    o, m, l = entry(per_head(k_fmt.rotate, k_params, q), *arrays, **options)
    return per_head(v_fmt.unrotate, v_params, o), m, l


def rice_codes_decode(q: jax.Array, layer: Segment, lengths: jax.Array, *, entry: Entry,
                      scale: float | None = None,
                      positions: jax.Array | None = None, **options) -> jax.Array:
    """Attention ``q [B, N, D] -> [B, N, D]`` (a decode; or a chunk's ``[B, T, N, D]`` at
    ``positions [B, T]``: :func:`merged_attention`), float32, over a layer view whose K
    and V offer :class:`~kvjax.codec.RiceFormat` blocks, with ``entry`` (the signature
    of :func:`pallas_kernels.rice_decode.api.rice_decode`) over the coded region."""
    k_store, v_store = layer.k, layer.v
    k_fmt = kernel_format(k_store.codec, RiceFormat)
    v_fmt = kernel_format(v_store.codec, RiceFormat)
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale

    def coded(qg, n_comp):
        return rice_entry(qg, k_store.params, v_store.params, *k_fmt.arrays(k_store.codes),
                          *v_fmt.arrays(v_store.codes), n_comp, k_store.layer, entry=entry,
                          k_fmt=k_fmt, v_fmt=v_fmt, layout=k_fmt.layout(head_dim),
                          sm_scale=scale, **page_options(k_store), **options)

    return merged_attention(q, layer, lengths, scale, coded, positions)


def rice_kernel(name: str, entry: Entry, unsupported: Callable[..., str | None],
                auto: bool = True) -> KernelImpl:
    """The registry entry of a fused decode kernel over Rice-coded HyperQuant blocks:
    ``entry`` takes the arrays of :func:`pallas_kernels.rice_decode.api.rice_decode`'s
    signature, ``unsupported(layout, head_dim)`` says what it cannot read."""
    return kernel_impl(name, entry, functools.partial(rice_reads, unsupported=unsupported),
                       functools.partial(rice_codes_decode, entry=entry), auto=auto)


# -- kernels over values stored as they are ----------------------------------------------


def dense_reads(k_codec: Codec, v_codec: Codec, head_dim: int,
                unsupported: Callable[..., str | None]
                ) -> tuple[DenseFormat, DenseFormat] | str:
    """The :class:`~kvjax.codec.DenseFormat` of a K and a V codec that a kernel over
    stored values reads at ``head_dim``, or why it cannot; ``unsupported(dtype,
    head_dim)`` is the kernel's own rule."""
    formats = role_formats(k_codec, v_codec, DenseFormat,
                           "does not store its vectors as they are")
    if isinstance(formats, str):
        return formats
    k_fmt, v_fmt = formats
    if jnp.dtype(k_fmt.dtype) != jnp.dtype(v_fmt.dtype):
        return (f"K and V are stored as different types ({jnp.dtype(k_fmt.dtype).name} vs "
                f"{jnp.dtype(v_fmt.dtype).name})")
    return unsupported(k_fmt.dtype, head_dim) or (k_fmt, v_fmt)


def dense_codes_decode(q: jax.Array, layer: Segment, lengths: jax.Array, *, entry: Entry,
                       scale: float | None = None,
                       positions: jax.Array | None = None, **options) -> jax.Array:
    """Attention ``q [B, N, D] -> [B, N, D]`` (a decode; or a chunk's ``[B, T, N, D]`` at
    ``positions [B, T]``: :func:`merged_attention`), float32, over a layer view whose K
    and V offer :class:`~kvjax.codec.DenseFormat` values, with ``entry`` over the coded
    region: the segment's whole stack and the layer's index, read in place."""
    k_store, v_store = layer.k, layer.v
    k_fmt = kernel_format(k_store.codec, DenseFormat)
    v_fmt = kernel_format(v_store.codec, DenseFormat)
    scale = q.shape[-1]**-0.5 if scale is None else scale

    def coded(qg, n_comp):
        return entry(qg, k_fmt.values(k_store.codes), v_fmt.values(v_store.codes), n_comp,
                     k_store.layer, sm_scale=scale, **page_options(k_store), **options)

    return merged_attention(q, layer, lengths, scale, coded, positions)


def dense_kernel(name: str, entry: Entry, unsupported: Callable[..., str | None],
                 auto: bool = True) -> KernelImpl:
    """The registry entry of a fused decode kernel over stored values: ``entry`` takes
    the arrays of :func:`pallas_kernels.dense_decode.api.dense_decode`'s signature,
    ``unsupported(dtype, head_dim)`` says what it cannot read."""
    return kernel_impl(name, entry, functools.partial(dense_reads, unsupported=unsupported),
                       functools.partial(dense_codes_decode, entry=entry), auto=auto)


def encoded_cache(k_codec: Codec, v_codec: Codec, *, batch: int, heads: int, slots: int,
                  head_dim: int, key: jax.Array) -> tuple:
    """``(k_params, k_codes, v_params, v_codes)``: ``slots`` Gaussian keys and values of
    each of ``batch`` rows and ``heads`` kv heads encoded by the codecs (codes ``[B, K,
    S, ...]``), one parameter draw of each codec per head (leaves ``[K, ...]``)."""
    out = []
    for codec, k in zip((k_codec, v_codec), jax.random.split(key), strict=True):
        kx, kp = jax.random.split(k)
        x = jax.random.normal(kx, (batch, heads, slots, head_dim))
        params = jax.vmap(lambda kk, codec=codec: codec.init(kk, head_dim))(
            jax.random.split(kp, heads))
        out += [params, jax.vmap(codec.encode, in_axes=(0, 1), out_axes=1)(params, x)]
    return tuple(out)


def find_kernel(k_codec: Codec, v_codec: Codec, head_dim: int
                ) -> tuple[KernelImpl, KernelFormat, KernelFormat]:
    """The first registered fused kernel (registration order) that reads these codecs at
    ``head_dim``, with the K and V formats it reads; a ``ValueError`` naming each
    kernel's reason otherwise."""
    reasons = []
    for impl in REGISTRY.values():
        if not isinstance(impl, KernelImpl):
            continue
        formats = impl.reads(k_codec, v_codec, head_dim)
        if not isinstance(formats, str):
            return impl, *formats
        reasons.append(f"{impl.name}: {formats}")
    raise ValueError(f"no fused kernel reads K '{k_codec.spec}' and V '{v_codec.spec}' at "
                     f"head_dim {head_dim}: " + "; ".join(reasons))


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """A registered fused kernel bound to a cache of a K and a V codec's codes, for
    benchmarks and profilers: ``name``, the entry's array arguments ``arrays`` (every
    row full), its static ones ``static``, the bytes a call must read ``read_bytes``,
    and the codecs' own pytrees ``codecs`` (``k_params, k_codes, v_params, v_codes``)."""

    name: str
    entry: Entry
    arrays: dict
    static: dict
    read_bytes: int
    codecs: tuple

    def __call__(self, qg: jax.Array, arrays: dict | None = None, **options):
        """The partial ``(o, m, l)`` of ``qg [B, K, G, D]`` over the cache (``arrays``:
        the same arrays, passed as a traced argument)."""
        return self.entry(qg, **(self.arrays if arrays is None else arrays), **self.static,
                          **options)


def _nbytes(arrays) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(arrays))


def kernel_call(k_codec: Codec, v_codec: Codec, *, batch: int, heads: int, slots: int,
                head_dim: int, key: jax.Array, distinct: int | None = None,
                scale: float | None = None) -> KernelCall:
    """The kernel :func:`find_kernel` picks for these codecs, bound to ``slots`` tokens of
    ``heads`` kv heads encoded from Gaussian vectors (:func:`encoded_cache`).
    ``distinct``: encode that many tokens and repeat them along the cache (a
    kernel's speed depends on the bytes, not on which tokens repeat; encoding a 32k
    cache would cost more than the benchmark)."""
    impl, k_fmt, v_fmt = find_kernel(k_codec, v_codec, head_dim)
    count = slots if distinct is None else min(slots, distinct)
    codecs = encoded_cache(k_codec, v_codec, batch=batch, heads=heads, slots=count,
                           head_dim=head_dim, key=key)
    k_params, k_codes, v_params, v_codes = codecs
    if count < slots:
        # codes are per block of the codec's tokens: repeat whole blocks
        k_codes, v_codes = (
            jax.tree.map(lambda a, n=codec.block_tokens: jnp.take(
                a, jnp.arange(slots // n) % (count // n), axis=2), c)
            for codec, c in ((k_codec, k_codes), (v_codec, v_codes)))
        codecs = k_params, k_codes, v_params, v_codes
    lengths = jnp.full((batch,), slots, jnp.int32)
    sm_scale = head_dim**-0.5 if scale is None else scale
    if isinstance(k_fmt, HqmqFormat):
        stored = dict(zip(("k_stream", "k_scale", "v_stream", "v_scale"),
                          (*k_fmt.arrays(k_codes), *v_fmt.arrays(v_codes)), strict=True))
        arrays = {**stored, "lengths": lengths, "k_table": hqmq_tables(k_fmt, k_params),
                  "v_table": hqmq_tables(v_fmt, v_params),
                  **hqmq_outliers(k_fmt, k_codes, v_fmt, v_codes)}
        static = {"layout": k_fmt.layout(head_dim), "sm_scale": sm_scale}
    elif isinstance(k_fmt, RiceFormat):
        stored = dict(zip(("k_stream", "k_index", "k_norm", "v_stream", "v_index", "v_norm"),
                          (*k_fmt.arrays(k_codes), *v_fmt.arrays(v_codes)), strict=True))
        arrays = {**stored, "lengths": lengths, "k_params": k_params, "v_params": v_params}
        static = {"layout": k_fmt.layout(head_dim), "sm_scale": sm_scale}
        entry = functools.partial(rice_entry, entry=impl.entry, k_fmt=k_fmt, v_fmt=v_fmt)
        return KernelCall(name=impl.name, entry=entry, arrays=arrays,
                          static=static, read_bytes=_nbytes(list(stored.values())),
                          codecs=codecs)
    elif isinstance(k_fmt, DenseFormat):
        stored = {"keys": k_fmt.values(k_codes), "values": v_fmt.values(v_codes)}
        arrays = {**stored, "lengths": lengths}
        static = {"sm_scale": sm_scale}
    elif isinstance(k_fmt, RotatedKeyFormat):
        codes, norm, *qjl = k_fmt.arrays(k_codes)
        v_words, v_scale, v_zero = v_fmt.arrays(v_codes)
        stored = {"k_codes": codes, "k_norm": norm, "v_codes": v_words, "v_scale": v_scale,
                  "v_zero": v_zero}
        if k_fmt.qjl:
            stored.update(k_qjl=qjl[0], k_residual_norm=qjl[1])
        arrays = {**stored, "lengths": lengths, "k_signs": k_params["signs"]}
        if k_fmt.qjl:
            arrays["qjl_sketch"] = k_params["sketch"]
        static = rotated_options(k_fmt, v_fmt, head_dim, sm_scale)
    else:
        names = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
        stored = dict(zip(names, (*k_fmt.arrays(k_codes), *v_fmt.arrays(v_codes)),
                          strict=True))
        arrays = {**stored, "lengths": lengths,
                  "q_rotation": _rotations(k_fmt, k_params, head_dim),
                  "v_rotation": _rotations(v_fmt, v_params, head_dim)}
        static = {"bits": k_fmt.bits, "offset": k_fmt.offset, "sm_scale": sm_scale}
    return KernelCall(name=impl.name, entry=impl.entry, arrays=arrays, static=static,
                      read_bytes=_nbytes([a for a in stored.values() if a is not None]),
                      codecs=codecs)
