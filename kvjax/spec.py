"""The spec-string grammar of codecs: parsing sits above the codecs.

One grammar serves the CLI, sweeps and results files::

    name[:opt,opt,...]      e.g.  bf16   fp8   int:4   kivi:2,g32   kivi:2,g32,token

Any lossy token-wise codec also takes the outlier options ``medC[,mbN][,mpP]``
(``int:4,med3``, ``hqmq:s96,r4,med3``): see :mod:`kvjax.codecs.outliers`.

Options are positional values or ``<letter(s)><value>`` flags; each codec's
``from_options`` documents its own. ``parse_codec(codec.spec)`` returns an equal codec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

import kvjax.codecs  # noqa: F401  (the built-in codecs register on import)
from kvjax.codec import Codec, CodecError, registry
from kvjax.codecs.outliers import MedOutlierCodec, split_outlier_options


def registered() -> Mapping[str, type[Codec]]:
    """Name -> codec class of every registered codec."""
    return dict(registry())


def parse_codec(spec: str | Codec) -> Codec:
    """A codec from a spec string such as ``int:4`` (a codec passes through)."""
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise CodecError(f"empty codec spec; valid codecs: {', '.join(sorted(registered()))}")
    name, _, rest = spec.strip().partition(":")
    registry = registered()
    if name not in registry:
        raise CodecError(
            f"unknown codec '{name}' in spec '{spec}'; valid codecs: {', '.join(sorted(registry))}"
        )
    options = [o.strip() for o in rest.split(",")] if rest else []
    if any(not o for o in options):
        raise CodecError(f"empty option in codec spec '{spec}'")
    options, outliers = split_outlier_options(spec, options)
    codec = registry[name].from_options(options)
    return MedOutlierCodec(base=codec, **outliers) if outliers else codec


def parse_kv(
    codec: str | Codec | None = None,
    *,
    k: str | Codec | None = None,
    v: str | Codec | None = None,
) -> tuple[Codec, Codec]:
    """The (K codec, V codec) pair from ``--codec`` or from ``--k`` and ``--v``.

    One spec for both uses the codec for K and its :meth:`Codec.value_codec` for V
    (KIVI quantizes keys per channel and values per token). ``k``/``v`` override.
    """
    if codec is None and (k is None or v is None):
        if k is None and v is None:
            raise CodecError("give a codec spec, or both a K spec and a V spec")
        if codec is None:
            raise CodecError("give both a K spec and a V spec (or one spec for both)")
    base = parse_codec(codec) if codec is not None else None
    k_codec = parse_codec(k) if k is not None else base
    v_codec = parse_codec(v) if v is not None else base.value_codec()
    return k_codec, v_codec


# -- whole caches -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """What a cache stores and how: codecs, residual window, sinks, per-layer policy.

    Attributes:
        k, v: codecs (or spec strings) for keys and values.
        residual_window: the ``W`` most recent tokens stay raw.
        sink_tokens: the first tokens of every row stay raw (attention sinks).
        raw_k_layers, raw_v_layers: layers (negative indices count from the end) whose
            K or V is stored uncompressed with ``raw_codec``.
        raw_codec: the codec for raw layers (default ``bf16``).
    """

    k: Codec | str
    v: Codec | str
    residual_window: int = 0
    sink_tokens: int = 0
    raw_k_layers: tuple[int, ...] = ()
    raw_v_layers: tuple[int, ...] = ()
    raw_codec: Codec | str = "bf16"

    def __post_init__(self):
        for name in ("k", "v", "raw_codec"):
            object.__setattr__(self, name, parse_codec(getattr(self, name)))
        for name in ("residual_window", "sink_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        for name in ("raw_k_layers", "raw_v_layers"):
            object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))

    @classmethod
    def from_specs(
        cls, codec: str | None = None, *, k: str | None = None, v: str | None = None, **kw
    ) -> CacheConfig:
        """Build from ``--codec SPEC`` or ``--k SPEC --v SPEC`` (see :func:`parse_kv`)."""
        k_codec, v_codec = parse_kv(codec, k=k, v=v)
        return cls(k=k_codec, v=v_codec, **kw)

    def layer_codecs(self, num_layers: int) -> list[tuple[Codec, Codec]]:
        """The (K codec, V codec) of every layer after the per-layer policy."""
        def normalize(layers, what):
            out = set()
            for i in layers:
                j = i + num_layers if i < 0 else i
                if not 0 <= j < num_layers:
                    raise ValueError(f"{what} names layer {i}, model has {num_layers} layers")
                out.add(j)
            return out

        raw_k = normalize(self.raw_k_layers, "raw_k_layers")
        raw_v = normalize(self.raw_v_layers, "raw_v_layers")
        return [
            (self.raw_codec if i in raw_k else self.k, self.raw_codec if i in raw_v else self.v)
            for i in range(num_layers)
        ]
