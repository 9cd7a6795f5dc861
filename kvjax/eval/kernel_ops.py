"""What a fused decode kernel does per cached token, counted from its traced program.

A kernel's time on a GPU follows the instructions it issues (docs/kernels.md: every
kernel here issues instructions in about half its cycles and reads DRAM at a fraction
of its peak). The compiled instruction count needs the GPU; what the kernel *asks for*
is readable anywhere: :func:`kernel_ops` traces a registered kernel's entry (the
compiled path, with its inline PTX, not interpret mode) and counts the operations of
one iteration of its flash loop over full blocks, per element of each operation's
result, divided by the tokens of a block: **element operations per cached token and kv
head**, by kind.

- ``arith``: elementwise arithmetic, comparisons, selects, bit operations and
  reductions (a reduction counts the elements it reads).
- ``lookup``: the inline PTX (register lookups, bit-plane unpacking), its instructions
  per element (statements of the PTX over the elements one instance makes).
- ``convert``: dtype conversions and bitcasts.
- ``load``: elements loaded from the kernel's inputs by slices (tiles).
- ``gather``: elements loaded at indices computed per element (a table's codewords):
  each its own address and load, and much dearer than an element operation.
- ``layout``: broadcasts, iotas, reshapes and the like, which the compiler may fold.
- ``mma``: multiply-adds of the tensor-core products (``dot_general``), reported apart:
  they are not instruction issue in the same sense.

Triton may pack two float16 elements in one instruction or fold a broadcast away, so
these are the work the program states, not SASS; they move when a lever removes work,
which is what they are for (``python experiments/kernel_ops.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

#: the counted kinds, in the order tables print them
KINDS = ("arith", "lookup", "convert", "load", "gather", "layout")
LOAD = frozenset({"load", "masked_load", "get", "gather"})
CONVERT = frozenset({"convert_element_type", "bitcast_convert_type", "reduce_precision"})
LAYOUT = frozenset({"broadcast_in_dim", "iota", "reshape", "squeeze", "expand_dims",
                    "transpose", "concatenate", "stack", "slice", "dynamic_slice",
                    "copy", "copy_p"})
REDUCE = frozenset({"reduce_max", "reduce_min", "reduce_sum", "reduce_and", "reduce_or",
                    "argmax", "argmin", "cumsum"})
#: primitives that write or do nothing per element
SKIP = frozenset({"swap", "store", "masked_swap", "program_id", "num_programs"})


@dataclasses.dataclass(frozen=True)
class KernelOps:
    """Per cached token and kv head: ``ops[kind]`` element operations, ``mma``
    tensor-core multiply-adds; ``block_s`` tokens per loop iteration; ``kernel`` the
    registered kernel traced; ``by_primitive`` the arithmetic by primitive name."""

    kernel: str
    block_s: int
    ops: dict[str, float]
    mma: float
    by_primitive: dict[str, float]

    @property
    def total(self) -> float:
        """Every counted kind but ``layout`` (which compilers mostly fold)."""
        return sum(v for k, v in self.ops.items() if k != "layout")


def ptx_instructions(code: str) -> int:
    """Instructions in an inline PTX string: its statements less register
    declarations and braces."""
    statements = [s.strip().strip("{}").strip() for s in code.split(";")]
    return sum(1 for s in statements if s and not s.startswith(".reg"))


def _size(var) -> int:
    shape = getattr(var.aval, "shape", ())
    return math.prod(shape) if shape else 1


def _inner_jaxprs(eqn) -> Iterator:
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(item, "jaxpr", None)
            if inner is not None:
                yield inner if hasattr(inner, "eqns") else inner.jaxpr


def _all(jaxpr, name: str) -> Iterator:
    """Every equation of primitive ``name`` in ``jaxpr`` and the programs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            yield eqn
        for inner in _inner_jaxprs(eqn):
            yield from _all(inner, name)


def _first(jaxpr, name: str):
    """The first of :func:`_all`, or None."""
    return next(_all(jaxpr, name), None)


def _count(jaxpr, counts: collections.Counter, by_primitive: collections.Counter,
           mma: list[float]) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call"):
            for inner in _inner_jaxprs(eqn):
                _count(inner, counts, by_primitive, mma)
            continue
        if name == "cond":
            # the costlier branch: a kernel's branches are per-program, not per element
            branches = []
            for inner in _inner_jaxprs(eqn):
                sub, sub_by, sub_mma = collections.Counter(), collections.Counter(), [0.0]
                _count(inner, sub, sub_by, sub_mma)
                branches.append((sum(sub.values()), sub, sub_by, sub_mma))
            if branches:
                _, sub, sub_by, sub_mma = max(branches, key=lambda b: b[0])
                counts.update(sub)
                by_primitive.update(sub_by)
                mma[0] += sub_mma[0]
            continue
        if name in SKIP:
            continue
        out = max((_size(v) for v in eqn.outvars), default=1)
        if name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            mma[0] += out * math.prod(lhs[d] for d in contracting)
        elif name == "elementwise_inline_asm_p":
            counts["lookup"] += out * ptx_instructions(eqn.params["asm"]) / eqn.params["pack"]
        elif name in LOAD:
            # an index array among the indexers (not a slice's scalar start): a gather
            indexed = any(len(getattr(v.aval, "shape", ())) for v in eqn.invars[1:])
            counts["gather" if indexed else "load"] += out
        elif name in CONVERT:
            counts["convert"] += out
        elif name in LAYOUT:
            counts["layout"] += out
        else:
            size = max((_size(v) for v in eqn.invars), default=out) if name in REDUCE else out
            counts["arith"] += size
            by_primitive[name] += size


def kernel_ops(spec: str, *, head_dim: int = 128, group: int = 4, slots: int = 1024,
               **options) -> KernelOps:
    """:class:`KernelOps` of the fused kernel :func:`kvjax.attention.fused.find_kernel`
    picks for cache spec ``spec`` (its K and V codecs) at ``head_dim``, ``group`` query
    heads per kv head, traced (not run) over a cache of ``slots`` tokens with the
    kernel's ``options`` (e.g. ``block_s``). A ``ValueError`` where no kernel reads the
    spec."""
    from kvjax.attention import fused
    from kvjax.spec import parse_cache

    config = parse_cache(spec)
    call = fused.kernel_call(config.k, config.v, batch=1, heads=1, slots=slots,
                             head_dim=head_dim, key=jax.random.key(0))
    qg = jax.ShapeDtypeStruct((1, 1, group, head_dim), jnp.float32)
    traced = jax.make_jaxpr(lambda q: call(q, interpret=False, **options))(qg)
    kernel = _first(traced.jaxpr, "pallas_call")
    if kernel is None:
        raise ValueError(f"{call.name} traced to no pallas_call")
    # the flash loop over full blocks comes first (flash.split_softmax), the masked
    # tail after it
    loop = _first(kernel.params["jaxpr"], "while")
    if loop is None:
        raise ValueError(f"{call.name}: no loop over blocks in its kernel")
    body = loop.params["body_jaxpr"].jaxpr
    # the softmax's probabilities are [query rows, block tokens]; its other
    # exponential, the rescale of the running sums, is [query rows]
    block_s = max((e.outvars[0].aval.shape[-1] for e in _all(body, "exp")
                   if len(e.outvars[0].aval.shape) == 2), default=0)
    if not block_s:
        raise ValueError(f"{call.name}: no softmax over a block in its loop")
    counts, by_primitive, mma = collections.Counter(), collections.Counter(), [0.0]
    _count(body, counts, by_primitive, mma)
    return KernelOps(kernel=call.name, block_s=block_s,
                     ops={kind: counts[kind] / block_s for kind in KINDS},
                     mma=mma[0] / block_s,
                     by_primitive={k: v / block_s for k, v in by_primitive.most_common()})


__all__ = ["KINDS", "KernelOps", "kernel_ops", "ptx_instructions"]
