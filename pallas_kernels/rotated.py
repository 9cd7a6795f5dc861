"""What every decode kernel over rotated keys and group-wise INT values shares
(:mod:`pallas_kernels.codebook_decode`, :mod:`pallas_kernels.polar_decode`,
:mod:`pallas_kernels.octopus_decode`): the checks of the arrays, the pipeline of an entry,
the ``pallas_call`` with its inputs and the kernel around the key side, QJL's term in the
kernel and in the reference, and the reference around the decode of the keys.

Keys are stored rotated, ``k = |k| R^T y`` with ``R`` the codec's randomized
Walsh-Hadamard rotation (:class:`kvjax.codec.RotatedKeyFormat`). With ``q . k = |k| (R
q) . y`` the query is rotated once per call, by XLA, and a kernel never un-rotates a key:
it only rebuilds ``y`` from its codes, and that is all a kernel's own files say (its
:class:`KeyReader`, and the ``vectors`` of its reference). With QJL a key's score adds
``sqrt(pi / 2) / D * |r| * <G q, sign(G r)>``: ``G q`` is formed once per call, and in
the kernel the residual's sign bits become ``+-1`` planes
(:func:`~pallas_kernels.units.sign_plane`) in a second matmul with it, scaled by the
stored residual norms (:func:`logits`): the estimator's term, in the same pass. Values
are the shared group-wise INT side (:mod:`pallas_kernels.group_values`).

Every entry (and its reference, same signature) takes the same arrays, then its keys'
options, then the same value, scale and schedule arguments (:data:`STATIC_ARGNAMES`):

- ``q [B, K, G, D]`` float: the query rows that read kv head ``k``;
- ``k_codes [B, K, S, ...]`` (``[L, B, K, S, ...]`` with ``layer``): the key codes in
  the entry's layout; ``k_norm [B, K, S]`` (``[L, ...]``) fp16: each key's norm;
- ``v_codes`` uint32 ``[B, K, S, Wv]``: value codes, planar (split at 3 bits);
  ``v_scale``, ``v_zero`` ``[B, K, S, n]`` fp16: one per channel group;
- ``lengths`` int32 ``[B]``: coded tokens per row, the first ``lengths[b]`` of ``S``
  (or ``[B, G]``: the tokens each query row sees, a causal chunk's);
- ``layer`` int32 ``[]`` (None: unstacked codes): the layer of stacked codes;
- ``k_signs [K, D]`` ``+-1``: keys stored as ``H(s * k / |k|)``;
- QJL, all three or none: ``k_qjl`` uint32 ``[B, K, S, D / 32]`` (``sign(G r)``),
  ``k_residual_norm [B, K, S]`` fp16 (``|r|``), ``qjl_sketch [K, D, D]`` (``G``);
- ``value_bits`` (2, 3, 4 or 8), ``value_group`` (channels per value scale and zero),
  ``sm_scale`` (logits are ``sm_scale * score``), ``block_s`` (tokens per block),
  ``num_warps`` and ``num_stages`` (pipeline stages; the three default to the key
  reader's own decode blocking, :attr:`KeyReader.blocking`), ``splits`` (slices of
  ``S``, one program each; :func:`~pallas_kernels.flash.default_splits`), ``interpret``
  (Pallas interpret mode; default: off a GPU).

It returns the partial softmax ``o [B, K, G, D]``, ``m [B, K, G]``, ``l [B, K, G]`` in
float32 over the first ``lengths[b]`` coded tokens (:mod:`pallas_kernels.partial`; a row
with no coded token gets ``o = 0, l = 0, m = NEG``), and raises ``NotImplementedError``
where the kernel cannot serve the arrays, ``ValueError`` where they are malformed.

Dimension letters: ``B`` rows, ``K`` kv heads, ``G`` query rows per kv head, ``S`` code
slots, ``n`` channel groups of a value, ``D`` head dim, ``L`` layers, ``R`` query rows of
a program (``G`` padded), ``C`` the kernel's query columns.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kvjax.primitives.packing import unpack_bits
from kvjax.primitives.rotations import random_signs, randomized_hadamard
from pallas_kernels import group_values
from pallas_kernels.flash import (
    BLOCKING,
    MIN_DOT,
    OPERAND,
    Load,
    check_lengths,
    check_pages,
    check_stack,
    decode_call,
    dot_nt,
    layer_arrays,
    leading_inputs,
    pad_query_rows,
    page_block,
    paged_rows,
    row_spec,
    schedule,
    split_len,
    split_softmax,
    stacked_spec,
    visible_slots,
)
from pallas_kernels.partial import EXACT, empty_partial, logits_partial, merge_partials
from pallas_kernels.units import code_layout, sign_plane, unit_view

#: the QJL estimator's constant: <q, r> ~ sqrt(pi / 2) / D |r| <G q, sign(G r)>
QJL_CONSTANT = math.sqrt(math.pi / 2)
#: the static arguments every entry takes after its keys' options
STATIC_ARGNAMES = ("value_bits", "value_group", "sm_scale", "block_s", "splits",
                   "num_warps", "num_stages", "interpret", "page_tokens")
#: how the checks name the units of a key code dtype
_UNITS = {jnp.dtype(jnp.uint32): ("words", "uint32 packed words"),
          jnp.dtype(jnp.uint8): ("bytes", "uint8 bytes")}


@dataclasses.dataclass(frozen=True, eq=False)
class KeyReader:
    """How a kernel reads its key codes: all that its entry adds to the shared pipeline.

    The checks expect ``size`` units of ``dtype`` (uint32 words or uint8 bytes) per
    token. The query rows are padded for key matmul operands ``width`` columns wide, and
    the kernel's query column ``c`` holds dim ``columns[c]`` of the rotated query (``D``:
    a zero column). ``views(k_codes)`` gives the ``pallas_call``'s key inputs
    ``[L, B, K, S, ...]`` of the stacked codes (bitcast views, by XLA);
    ``scores(refs, sm_scale=..., asm=...)``, called once per program with its
    :class:`KernelRefs`, gives the ``scores(load)`` callback of
    :func:`~pallas_kernels.flash.split_softmax`. ``name`` names the ``pallas_call``.
    ``blocking``: the kernel's own ``(block_s, num_warps, num_stages)`` for a decode
    step's programs (at most :data:`~pallas_kernels.flash.MIN_DOT` query rows), which a
    call takes for each of them it leaves unset; a chunk's programs keep the library's.
    """

    name: str
    size: int
    dtype: Any
    width: int
    columns: np.ndarray
    views: Callable[[jax.Array], Sequence[jax.Array]]
    scores: Callable[..., Callable[[Load], jax.Array]]
    blocking: tuple[int, int, int] = BLOCKING


# -- checks --------------------------------------------------------------------------


def head_dim_of(q: jax.Array) -> int:
    """``D`` of the query rows ``q [B, K, G, D]``; ``ValueError`` for another rank."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, K, G, D], got shape {q.shape}")
    return q.shape[-1]


def unsupported(head_dim: int, value_bits: int, value_group: int,
                min_head_dim: int) -> str | None:
    """Why a kernel over rotated keys cannot serve this head dim and these values (None:
    it can): the rotation wants a power of two, the kernel's layouts ``min_head_dim``."""
    if head_dim < min_head_dim or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= {min_head_dim}"
    return group_values.unsupported(value_bits, value_group, head_dim)


def check_magnitudes(magnitudes: tuple[float, ...], bits: int, codes: str) -> None:
    """``ValueError`` unless a symmetric codebook read by ``bits``-bit sign-magnitude
    ``codes`` (what the message calls them) has its ``2^(bits - 1)`` magnitudes."""
    if len(magnitudes) != 1 << (bits - 1):
        raise ValueError(f"{bits}-bit sign-magnitude {codes} need {1 << (bits - 1)} "
                         f"magnitudes, got {len(magnitudes)}")


def check_arrays(reader: KeyReader, q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths,
                 layer, k_signs, k_qjl, k_residual_norm, qjl_sketch, pages=None, *,
                 value_bits: int, value_group: int, page_tokens: int = 0) -> int:
    """The checks every entry (and its reference) makes after those of its keys'
    options: ``ValueError`` unless the arrays have the shapes and dtypes of the module
    docstring, ``k_codes`` with ``reader.size`` units of ``reader.dtype`` per token.
    Returns the token capacity of a row (:func:`~pallas_kernels.flash.check_pages`)."""
    head_dim = head_dim_of(q)
    batch, heads = q.shape[:2]
    unit, described = _UNITS[jnp.dtype(reader.dtype)]
    tokens = k_codes.shape[:-1]
    check_stack("k_codes", k_codes, 1 if pages is not None else batch, heads, layer,
                reader.size, f"{reader.size} {unit}", axes="S, ...")
    if k_codes.dtype != reader.dtype:
        raise ValueError(f"k_codes must be {described}, got {k_codes.dtype}")
    group_values.check_arrays(v_codes, v_scale, v_zero, tokens, head_dim, value_bits,
                              value_group)
    check_lengths(lengths, batch, q.shape[2])
    shapes = [("k_norm", k_norm, tokens)]
    qjl = [k_qjl is None, k_residual_norm is None, qjl_sketch is None]
    if any(qjl) and not all(qjl):
        raise ValueError("k_qjl, k_residual_norm and qjl_sketch come together")
    if not any(qjl):
        shapes += [("k_qjl", k_qjl, (*tokens, head_dim // 32)),
                   ("k_residual_norm", k_residual_norm, tokens),
                   ("qjl_sketch", qjl_sketch, (heads, head_dim, head_dim))]
    if k_signs is not None:
        shapes.append(("k_signs", k_signs, (heads, head_dim)))
    for name, a, shape in shapes:
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    if k_qjl is not None and k_qjl.dtype != jnp.uint32:
        raise ValueError(f"k_qjl must be uint32 packed words, got {k_qjl.dtype}")
    return check_pages(pages, page_tokens, batch, k_codes.shape[-2])


# -- the entry -----------------------------------------------------------------------


def query_sides(q: jax.Array, k_signs: jax.Array | None,
                qjl_sketch: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    """``(R q, G q)`` of ``q [B, K, G, D]`` in float32: the query in the keys' rotated
    space (``R`` the randomized Hadamard rotation of ``k_signs [K, D]``; ``q`` itself
    without signs) and, with a sketch ``G [K, D, D]``, its QJL projection (else None)."""
    q = q.astype(jnp.float32)
    q_rot = q if k_signs is None else randomized_hadamard(q, k_signs[None, :, None, :])
    gq = None
    if qjl_sketch is not None:
        gq = jnp.einsum("bkgd,ked->bkge", q, qjl_sketch.astype(jnp.float32), precision=EXACT)
    return q_rot, gq


def kernel_query(q: jax.Array, columns: np.ndarray) -> jax.Array:
    """``q [..., D]`` with its columns as the kernel reads them: column ``c`` is dim
    ``columns[c]``, or zero where that is ``D``."""
    if np.max(columns) >= q.shape[-1]:
        # one zero column past the dims: what a column without a dim reads
        q = jnp.pad(q, ((0, 0),) * (q.ndim - 1) + ((0, 1),))
    return q[..., columns]


def decode(reader: KeyReader, q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer,
           k_signs, k_qjl, k_residual_norm, qjl_sketch, pages=None, *, value_bits: int,
           value_group: int, sm_scale: float, block_s: int | None, splits: int | None,
           num_warps: int | None, num_stages: int | None, interpret: bool | None,
           page_tokens: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The pipeline of every entry, once its keys' options are checked and their
    ``reader`` made: the shared checks (:func:`check_arrays`), the query's rotation and
    sketch (once per call, by XLA), its column layout and row padding, the blocking, the
    ``pallas_call`` (:func:`codes_partial`) and the exact merge of the splits. Arguments
    and result as in the module docstring."""
    slots = check_arrays(reader, q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths,
                         layer, k_signs, k_qjl, k_residual_norm, qjl_sketch, pages,
                         value_bits=value_bits, value_group=value_group,
                         page_tokens=page_tokens)
    batch, heads, group, head_dim = q.shape
    if slots == 0:
        return empty_partial(q)
    own_block, own_warps, own_stages = reader.blocking if group <= MIN_DOT else BLOCKING
    block_s, num_warps = block_s or own_block, num_warps or own_warps
    num_stages = num_stages or own_stages
    block_s, num_stages, splits, interpret = schedule(
        batch, heads, slots, block_s=block_s, num_stages=num_stages, splits=splits,
        num_warps=num_warps, interpret=interpret, group=q.shape[2])
    block_s = page_block(block_s, page_tokens)
    q_rot, gq = query_sides(q, k_signs, qjl_sketch)
    width = max(reader.width, group_values.plane_width(head_dim, value_bits))
    q_rot = kernel_query(pad_query_rows(q_rot, width), reader.columns)
    if gq is not None:
        # the sign bits are 1-bit planar words, read as bytes
        gq = pad_query_rows(gq, width)[..., code_layout(head_dim, 1)[2]]
    o, m, l = codes_partial(
        reader, q_rot, gq, k_codes, k_norm, k_qjl, k_residual_norm, v_codes, v_scale, v_zero,
        lengths, layer, pages, head_dim=head_dim, value_bits=value_bits,
        value_group=value_group, sm_scale=sm_scale, block_s=block_s, splits=splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        page_tokens=page_tokens)
    o = group_values.restore_columns(o, head_dim, value_bits)
    return merge_partials((o[..., :group, :], m[..., :group], l[..., :group]), axis=2)


# -- the kernel ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelRefs:
    """The refs of one program, in the order :func:`codes_partial` passes them: the
    token counts, the layer, the query ``[R, C]``, ``G q [R, D]`` (QJL only), the key
    inputs of the reader's ``views``, the norms, the QJL sign bytes and residual norms
    (QJL only), the four value refs of :func:`pallas_kernels.group_values.inputs`, and
    the outputs ``o [R, D]``, ``m, l [R]``."""

    counts: Any
    layer: Any
    q: Any
    gq: Any
    keys: tuple
    norm: Any
    qjl: Any
    residual_norm: Any
    values: tuple
    o: Any
    m: Any
    l: Any

    @classmethod
    def of(cls, refs: Sequence, *, keys: int, qjl: bool) -> KernelRefs:
        """Name a kernel's refs: ``keys`` key inputs, and the QJL ones with ``qjl``."""
        rest = iter(refs)

        def take(count):
            return tuple(next(rest) for _ in range(count))

        counts, layer, q = take(3)
        gq = next(rest) if qjl else None
        key_refs, norm = take(keys), next(rest)
        qjl_ref, residual_norm = take(2) if qjl else (None, None)
        *values, o, m, l = rest
        return cls(counts, layer, q, gq, key_refs, norm, qjl_ref, residual_norm,
                   tuple(values), o, m, l)


def logits(refs: KernelRefs, *, sm_scale: float,
           asm: bool) -> Callable[[jax.Array, Load], jax.Array]:
    """``logits(dots, load)``: a block's logits from the query's dots with its unit
    vectors ``y`` ``[R, block_s]``, scaled by the stored norms, plus QJL's term where the
    program has its refs, times ``sm_scale``. ``G q``'s columns are loaded here: call it
    once per program, outside the loop."""
    head_dim = refs.o.shape[-1]
    qjl = refs.gq is not None
    qjl_scale = QJL_CONSTANT / head_dim
    if qjl:
        sign_width = head_dim // 8
        gq_slots = [refs.gq[:, pl.ds(j * sign_width, sign_width)].astype(OPERAND)
                    for j in range(8)]

    def scale(dots, load):
        s = dots * load(refs.norm).astype(jnp.float32)[None, :]
        if qjl:
            bits = load(refs.qjl)
            residual = sum(dot_nt(gq_slots[j], sign_plane(bits, j, -1.0, asm))
                           for j in range(8))
            rnorm = load(refs.residual_norm).astype(jnp.float32)
            s = s + residual * (qjl_scale * rnorm)[None, :]
        return s * sm_scale

    return scale


def _kernel(*refs, scores, keys, qjl, value_bits, value_group, block_s, split_len, splits,
            sm_scale, asm, page_tokens):
    refs = KernelRefs.of(refs, keys=keys, qjl=qjl)
    rows, head_dim = refs.q.shape[0], refs.o.shape[-1]
    values = group_values.Accumulator(refs.values, rows=rows, head_dim=head_dim,
                                      value_bits=value_bits, value_group=value_group, asm=asm)
    o, m, l = split_softmax(
        refs.counts, refs.layer, rows=rows, slots=refs.norm.shape[1], block_s=block_s,
        split_len=split_len, splits=splits, scores=scores(refs, sm_scale=sm_scale, asm=asm),
        accumulate=values.accumulate, init=values.init, page_tokens=page_tokens)
    values.store(refs.o, o)
    refs.m[...] = m
    refs.l[...] = l


def codes_partial(
    reader: KeyReader,
    q: jax.Array,
    gq: jax.Array | None,
    k_codes: jax.Array,
    k_norm: jax.Array,
    k_qjl: jax.Array | None,
    k_residual_norm: jax.Array | None,
    v_codes: jax.Array,
    v_scale: jax.Array,
    v_zero: jax.Array,
    lengths: jax.Array,
    layer: jax.Array | None = None,
    pages: jax.Array | None = None,
    *,
    head_dim: int,
    value_bits: int,
    value_group: int,
    sm_scale: float,
    block_s: int,
    splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    asm: bool = True,
    page_tokens: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-split partial softmaxes over the coded tokens: the ``pallas_call`` of a
    kernel over rotated keys, the key side from ``reader``.

    ``q [B, K, R, C]`` is the rotated query with ``R`` rows padded as the kernel needs,
    its columns laid out by ``reader.columns`` (:func:`kernel_query`); ``gq`` (QJL only)
    is ``G q [B, K, R, D]`` with its columns in the order of the sign planes
    (``unit_permutation(D, 1, "bytes")``). Codes are stacked (``[L, B, K, S, ...]``;
    ``layer`` None reads a stack of one). ``asm``: the units' inline PTX (off in
    interpret mode). With ``pages`` (block tables ``[B, P]`` of ``page_tokens`` pages)
    the stacks are a paged pool ``[L, 1, K, S, ...]`` that every row reads through its
    table. Returns ``o [B, K, splits, R, D]`` with its columns in the order of the value
    planes, ``m, l [B, K, splits, R]`` (float32).
    """
    batch, heads, rows, _ = q.shape
    qjl = gq is not None
    stack = [k_codes, k_norm, v_codes, v_scale, v_zero]
    if qjl:
        stack += [k_qjl, k_residual_norm]
    if layer is None:
        stack = [a[None] for a in stack]
        layer = 0
    k_codes, k_norm, v_codes, v_scale, v_zero, *rest = stack
    layers, slots = k_codes.shape[0], k_codes.shape[3]
    row_slots = slots if pages is None else pages.shape[1] * page_tokens
    shared = pages is not None
    key_inputs = list(reader.views(k_codes))
    kernel = functools.partial(
        _kernel, scores=reader.scores, keys=len(key_inputs), qjl=qjl, value_bits=value_bits,
        value_group=value_group, block_s=block_s,
        split_len=split_len(row_slots, splits, block_s), splits=splits, sm_scale=sm_scale,
        asm=asm and not interpret, page_tokens=page_tokens)
    args, in_specs = leading_inputs(lengths, layer, q, splits, pages)
    if qjl:
        # G q: one [R, D] block per program, like the query
        args.append(gq.astype(jnp.float32))
        in_specs.append(row_spec(gq.shape[2:], splits))
    args += [*key_inputs, k_norm]
    in_specs += [*(stacked_spec(layers, slots, a.shape[-1], shared=shared)
                   for a in key_inputs),
                 stacked_spec(layers, slots, shared=shared)]
    if qjl:
        k_qjl, k_residual_norm = rest
        qjl_bytes = unit_view(k_qjl, "bytes")
        args += [qjl_bytes, k_residual_norm]
        in_specs += [stacked_spec(layers, slots, qjl_bytes.shape[-1], shared=shared),
                     stacked_spec(layers, slots, shared=shared)]
    value_args, value_specs = group_values.inputs(v_codes, v_scale, v_zero, layers, slots,
                                                  shared)
    args += value_args
    in_specs += value_specs
    return decode_call(kernel, args, in_specs, batch=batch, heads=heads, splits=splits,
                       rows=rows, head_dim=head_dim, num_warps=num_warps,
                       num_stages=num_stages, interpret=interpret, name=reader.name)


# -- the reference -------------------------------------------------------------------


def qjl_scores(gq: jax.Array, k_qjl: jax.Array, k_residual_norm: jax.Array) -> jax.Array:
    """QJL's term ``sqrt(pi / 2) / D * |r| * <G q, sign(G r)>`` ``[B, K, G, S]``, exact,
    from ``G q [B, K, G, D]`` and one layer's sign words ``[B, K, S, D / 32]`` and
    residual norms ``[B, K, S]``."""
    head_dim = gq.shape[-1]
    signs = 2.0 * unpack_bits(k_qjl, 1, head_dim).astype(jnp.float32) - 1.0
    residual = jnp.einsum("bkgd,bksd->bkgs", gq, signs, precision=EXACT)
    weight = QJL_CONSTANT / head_dim * k_residual_norm.astype(jnp.float32)
    return residual * weight[:, :, None, :]


def reference(reader: KeyReader, vectors: Callable[..., jax.Array], q, k_codes, k_norm,
              v_codes, v_scale, v_zero, lengths, layer, k_signs, k_qjl, k_residual_norm,
              qjl_sketch, pages=None, *, value_bits: int, value_group: int,
              sm_scale: float, page_tokens: int = 0
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The exact partial of a reference, once its keys' options are checked: the checks
    of :func:`decode` (``reader`` says the codes' size and dtype), then keys scored in
    the rotated space (``|k| (R q) . y`` with ``y = vectors(k_codes, head_dim=D)``, one
    layer's unit vectors ``[B, K, S, D]`` float32) plus QJL's term, values dequantized
    per channel group, every product float32 at HIGHEST precision."""
    check_arrays(reader, q, k_codes, k_norm, v_codes, v_scale, v_zero, lengths, layer,
                 k_signs, k_qjl, k_residual_norm, qjl_sketch, pages, value_bits=value_bits,
                 value_group=value_group, page_tokens=page_tokens)
    head_dim = q.shape[-1]
    k_codes, k_norm, v_codes, v_scale, v_zero, k_qjl, k_residual_norm = paged_rows(
        layer_arrays((k_codes, k_norm, v_codes, v_scale, v_zero, k_qjl, k_residual_norm),
                     layer), pages, page_tokens, k_codes.shape[-2])
    q_rot, gq = query_sides(q, k_signs, qjl_sketch)
    y = vectors(k_codes, head_dim=head_dim)
    s = jnp.einsum("bkgd,bksd->bkgs", q_rot, y, precision=EXACT)
    s = s * k_norm.astype(jnp.float32)[:, :, None, :]
    if k_qjl is not None:
        s = s + qjl_scores(gq, k_qjl, k_residual_norm)
    values = group_values.dequantize(v_codes, v_scale, v_zero, value_bits, value_group,
                                     head_dim)
    valid = visible_slots(lengths, k_codes.shape[2])
    return logits_partial(s * sm_scale, values, valid)


def random_inputs(key: jax.Array, *, batch: int, heads: int, group: int, slots: int,
                  head_dim: int, key_words: int, value_bits: int, value_group: int = 32,
                  qjl: bool = False) -> dict[str, jax.Array]:
    """Random array arguments of an entry for a shape, its keys ``key_words`` uint32
    words per token: uniformly random packed words, fp16 norms, scales and zeros, seeded
    rotation signs (and a Gaussian sketch with ``qjl``), a normal query, every row full.
    A kernel's speed depends on the bytes, not the values: benchmarks can time these."""
    keys = jax.random.split(key, 10)
    tokens = (batch, heads, slots)
    groups = head_dim // value_group

    def words(k, count):
        return jax.random.bits(k, (*tokens, count), jnp.uint32)

    def fp16(k, shape, scale):
        return (jax.random.uniform(k, shape) * scale).astype(jnp.float16)

    out = {
        "q": jax.random.normal(keys[0], (batch, heads, group, head_dim), jnp.float32),
        "k_codes": words(keys[1], key_words),
        "k_norm": fp16(keys[2], tokens, 10.0),
        "v_codes": words(keys[3], value_bits * head_dim // 32),
        "v_scale": fp16(keys[4], (*tokens, groups), 0.1),
        "v_zero": fp16(keys[5], (*tokens, groups), -0.5),
        "lengths": jnp.full((batch,), slots, jnp.int32),
        "k_signs": jnp.stack([random_signs(k, head_dim)
                              for k in jax.random.split(keys[6], heads)]),
    }
    if qjl:
        out["k_qjl"] = words(keys[7], head_dim // 32)
        out["k_residual_norm"] = fp16(keys[8], tokens, 3.0)
        out["qjl_sketch"] = jax.random.normal(keys[9], (heads, head_dim, head_dim))
    return out
