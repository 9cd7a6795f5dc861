"""Attention over a compressed cache, by a registry of implementations.

:func:`attend` runs the first implementation, of the name or ordered list of names it
is given (a cache config's ``attention``), that serves the call; ``"auto"`` is an ordered
list itself (:func:`auto_names`). Registered (:mod:`.registry`): ``"reference"``, the
float32 specification that serves everything (:mod:`.reference`); ``"xla"``, bfloat16
operands over windows of the cache, and cuDNN for a bf16 cache's decode on a GPU
(:mod:`.xla`); ``"int_decode"``, the fused Pallas kernel over ``int:N`` / SAW codes for
one-token decodes (:mod:`pallas_kernels.int_decode`); ``"codebook_decode"``, the fused
kernel over TurboQuant keys (MSE and QJL) and group-wise INT values
(:mod:`pallas_kernels.codebook_decode`); both through the adapter in :mod:`.fused`,
which merges the raw sinks and window for every kernel, as the other decode kernels
(``"octopus_decode"``, ``"polar_decode"``, ``"hqmq_decode"``, ``"rice_decode"``,
``"dense_decode"``) are; ``"chunk_flash"``, a fused flash attention for chunks of
several tokens (:mod:`.prefill`).
"""

from kvjax.attention import registry as _registry  # noqa: F401  (fills the registry)
from kvjax.attention.dispatch import (
    AUTO,
    REGISTRY,
    Call,
    Impl,
    NoImplementationError,
    attend,
    auto_names,
    check_names,
    decode_attention,
    register,
    registered,
    resolve,
)
from kvjax.attention.reference import dense_attention

__all__ = [
    "AUTO",
    "REGISTRY",
    "Call",
    "Impl",
    "NoImplementationError",
    "attend",
    "auto_names",
    "check_names",
    "decode_attention",
    "dense_attention",
    "register",
    "registered",
    "resolve",
]
