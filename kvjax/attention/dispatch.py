"""The dispatcher: a registry of attention implementations tried in the order asked for.

An implementation (:class:`Impl`) declares what it serves: ``supports(call)`` returns
None, or one line saying why it cannot serve this :class:`Call` (codec formats, query
length, head dim, sliding window, ...). :func:`attend` takes ``impl``, a name or an
ordered list of names, and runs the first implementation that serves the call; when
none does, one :class:`NoImplementationError` lists every name with its reason. The
name ``"auto"`` stands for an ordered list (:func:`auto_names`). The built-in
implementations are registered in :mod:`kvjax.attention.registry`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from kvjax.cache import Segment, Step

#: the name that stands for an ordered list of implementations (:func:`auto_names`)
AUTO = "auto"


class NoImplementationError(ValueError):
    """No implementation of those asked for serves the call; the message says why, each."""


@dataclasses.dataclass(frozen=True)
class Call:
    """One attention call, as implementations see it.

    q: ``[B, T, N, D]`` queries of the chunk just appended to ``layer`` by ``step``.
    lengths: int32 ``[B]`` stored tokens per row, the chunk included.
    scale: the logit scale; sliding_window: None or the positions a query sees.
    """

    q: jax.Array
    layer: Segment
    step: Step
    lengths: jax.Array
    scale: float
    sliding_window: int | None

    @property
    def num_tokens(self) -> int:
        return self.q.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]


@dataclasses.dataclass(frozen=True)
class Impl:
    """A registered attention implementation.

    supports: ``call -> None`` when it serves the call, else the reason it does not.
    run: ``call -> [B, T, N, D]`` attention output (any float dtype; cast to ``q``'s).
    fused: a fused kernel (``"auto"`` tries these first on a GPU).
    auto: whether ``"auto"`` includes it; a fused kernel whose compiled form has not
    passed its kernel suite on a GPU is reachable by name only.
    """

    name: str
    supports: Callable[[Call], str | None]
    run: Callable[[Call], jax.Array]
    fused: bool = False
    auto: bool = True


REGISTRY: dict[str, Impl] = {}


def register(impl: Impl) -> Impl:
    """Make ``impl`` reachable by its name (in ``attend(impl=...)`` and ``attn=``)."""
    if impl.name == AUTO or not impl.name or "," in impl.name:
        raise ValueError(f"attention implementation name {impl.name!r} is reserved or empty")
    if impl.name in REGISTRY and REGISTRY[impl.name] != impl:
        raise ValueError(f"attention implementation '{impl.name}' is registered already")
    REGISTRY[impl.name] = impl
    return impl


def registered() -> tuple[str, ...]:
    """The registered implementation names, in registration order (``"auto"`` aside)."""
    return tuple(REGISTRY)


def auto_names(backend: str | None = None) -> tuple[str, ...]:
    """What ``"auto"`` stands for on ``backend`` (default: JAX's): on a GPU every fused
    kernel in registration order, then ``"xla"``, then ``"reference"``; elsewhere the
    float32 ``"reference"`` (the fused kernels would run in Pallas interpret mode)."""
    backend = backend or jax.default_backend()
    if backend == "gpu":
        return (*(name for name, impl in REGISTRY.items() if impl.fused and impl.auto),
                "xla", "reference")
    return ("reference",)


def check_names(names: str | Sequence[str]) -> tuple[str, ...]:
    """``names`` (one name, a comma-separated string or a sequence) as a tuple, or a
    ``ValueError`` naming the unknown one and listing the valid names."""
    if isinstance(names, str):
        names = names.split(",")
    names = tuple(n.strip() if isinstance(n, str) else n for n in names)
    if not names:
        raise ValueError("no attention implementation given; valid: "
                         + ", ".join((AUTO, *registered())))
    for name in names:
        if name != AUTO and name not in REGISTRY:
            raise ValueError(f"unknown attention implementation {name!r}; valid: "
                             + ", ".join((AUTO, *registered())))
    return names


def resolve(names: str | Sequence[str], backend: str | None = None) -> tuple[str, ...]:
    """The ordered, validated names to try, ``"auto"`` expanded, repeats dropped."""
    out: list[str] = []
    for name in check_names(names):
        for n in auto_names(backend) if name == AUTO else (name,):
            if n not in out:
                out.append(n)
    return tuple(out)


def attend(
    q: jax.Array,
    layer: Segment,
    step: Step,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    impl: str | Sequence[str] | None = None,
) -> jax.Array:
    """Attention of a chunk's queries ``q[B, T, N, D]`` over a layer view it was appended to.

    ``step`` is the :class:`~kvjax.cache.Step` of that append. ``scale`` defaults to
    ``D ** -0.5``; ``sliding_window`` limits each query to its last ``w`` positions
    (Mistral). Queries past a row's valid count get well-defined but meaningless output.
    ``impl`` is an implementation name or an ordered list of them; the first that serves
    the call runs, and :class:`NoImplementationError` gives every one's reason when none
    does. By default the cache's own list (its spec's ``attn=`` clause, ``"auto"`` when it
    has none: the fused kernels on a GPU, the float32 reference elsewhere). Returns
    ``[B, T, N, D]`` in ``q.dtype``.

    Keys a cache stores centered or smoothed (:mod:`kvjax.centering`) are attended as
    stored: the centre shifts every score of a query alike, and the query is multiplied
    by the smoothing scale here, before any implementation sees it.
    """
    return _attend(q, layer, step, scale=scale, sliding_window=sliding_window,
                   names=resolve(layer.attention if impl is None else impl))


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "names"))
def _attend(q, layer, step, *, scale, sliding_window, names):
    head_dim, num_heads = q.shape[-1], q.shape[2]
    heads = layer.k.raw.shape[1]
    if head_dim != layer.k.raw.shape[-1]:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {layer.k.raw.shape[-1]}")
    if num_heads % heads:
        raise ValueError(f"{num_heads} query heads do not split over {heads} kv heads")
    if layer.k.scale is not None:
        # the keys are stored divided by the smoothing scale: the query takes it instead
        group = num_heads // heads
        scale_q = jnp.repeat(layer.k.scale.astype(jnp.float32), group, axis=1)
        q = (q.astype(jnp.float32) * scale_q[:, None]).astype(q.dtype)
    call = Call(q=q, layer=layer, step=step,
                lengths=jnp.minimum(step.start + step.valid, layer.k.max_len),
                scale=head_dim**-0.5 if scale is None else scale,
                sliding_window=sliding_window)
    reasons = []
    for name in names:
        impl = REGISTRY[name]
        reason = impl.supports(call)
        if reason is None:
            return impl.run(call).astype(q.dtype)
        reasons.append(f"{name}: {reason}")
    raise NoImplementationError(
        f"no attention implementation of {list(names)} serves {describe(call)}; "
        + "; ".join(reasons))


def describe(call: Call) -> str:
    """The call in the terms implementations decide by (for error messages)."""
    k, v = call.layer.k.codec, call.layer.v.codec
    window = ("" if call.sliding_window is None
              else f", sliding window {call.sliding_window}")
    return (f"T={call.num_tokens} over K '{k.spec}', V '{v.spec}', head_dim "
            f"{call.head_dim}{window}")


def decode_attention(q: jax.Array, layer: Segment, step: Step, **kw) -> jax.Array:
    """One decode token per row: ``q[B, N, D] -> [B, N, D]`` (see :func:`attend`)."""
    return attend(q[:, None], layer, step, **kw)[:, 0]
