"""The spec grammar of codecs and of whole caches; parsing sits above the codecs.

One grammar serves the CLI, sweeps and results files. A codec::

    name[:opt,opt,...]      e.g.  bf16   fp8   int:4   kivi:2,g32   kivi:2,g32,token

Any lossy token-wise codec also takes the outlier options ``medC[,mbN][,mpP]``
(``int:4,med3``, ``hqmq:s96,r4,med3``): see :mod:`kvjax.codecs.outliers`.

Each codec declares its options (:attr:`kvjax.codec.Codec.options`; ``python -m kvjax
codecs`` lists them); options that the codec does not spell and that start like one of
the outlier wrapper's (``med``, ``mb``, ``mp``) go to the wrapper, so a misspelled one is
reported against its usage; the others go to the codec. ``parse_codec(codec.spec)``
returns an equal codec.

A whole cache (:func:`parse_cache`, :class:`CacheConfig`): clauses separated by spaces::

    int:4                                  K int:4, V its value codec (int:4)
    kivi:2,g32 window=32 sinks=4           + a raw residual window and raw sink tokens
    k=kivi:2,g32 v=int:4                   K and V apart
    k=int:4 layers[0,-1]:k=bf16            K of the first and last layer stored as bf16
    k=int:4 layers[4:12]:kv=int:2          layers 4..11 (a slice) at 2 bits, K and V
    int:4 attn=int_decode,xla,reference    the attention implementations, in order
    turboquant:b4 center=first             keys stored centered (exact for attention)
    int:4 center=calib smooth=calib        centered and channel-smoothed from calibration
    int:4 evict=snapkv:25%                 a quarter of each prompt kept, as int:4 codes
    saw:c256 fit=runs/fit-c256             codec parameters fitted on calibration text
    int:4 page=256                         codes in a pool of 256-token pages (paged)

A first clause without ``=`` is the codec of K, whose value codec (KIVI: the per-token
variant) serves V unless ``v=`` is given. Layer rules apply in order (a later rule wins
where two name the same layer) and take ``k``, ``v`` or ``kv``. ``center=`` and
``smooth=`` (``first`` or ``calib``) transform the keys every layer stores, exactly for
attention (:mod:`kvjax.centering`). ``fit=DIR`` names the fitted parameters
(:mod:`kvjax.calibration`) of the codecs that take them (``saw:c256``, ``saw:hess``).
``page=N`` stores the coded tokens in a pool of pages of ``N`` tokens that rows address
through block tables (:mod:`kvjax.paging`); ``N`` must be a multiple of every codec's
block.
``CacheConfig.spec`` is canonical:
``parse_cache(config.spec) == config``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

import kvjax.codecs  # noqa: F401  (the built-in codecs register on import)
from kvjax.centering import MODES as CENTER_MODES
from kvjax.codec import Codec, CodecError, registry
from kvjax.codecs.outliers import MedOutlierCodec
from kvjax.eviction import MAX_TOKENS, Eviction, EvictionSpecError, parse_eviction


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
    head, comma, tail = name.partition(",")
    if name not in registry and comma and head in registry and not rest:
        # ``hqmq,med3``: the outlier usage ``SPEC,medC`` read with a SPEC without options
        raise CodecError(f"codec spec '{spec}': options follow a ':' after the codec name, "
                         f"e.g. '{head}:{tail}'")
    if name not in registry:
        raise CodecError(
            f"unknown codec '{name}' in spec '{spec}'; valid codecs: {', '.join(sorted(registry))}"
        )
    options = [o.strip() for o in rest.split(",")] if rest else []
    if any(not o for o in options):
        raise CodecError(f"empty option in codec spec '{spec}'")
    written = f"{name}:{','.join(options)}" if options else name
    # an option the base codec spells stays with it, however it starts
    base = registry[name]
    outliers = [o for o in options if not base.claims(o) and MedOutlierCodec.claims(o)]
    codec = base.from_options([o for o in options if o not in outliers], spec=written)
    if outliers:
        return MedOutlierCodec.from_options(outliers, spec=written, base=codec)
    return codec


# -- whole caches -------------------------------------------------------------------

#: the clauses of a cache spec, for error messages
CACHE_CLAUSES = ("CODEC", "k=CODEC", "v=CODEC", "window=N", "sinks=N",
                 "layers[SEL]:k|v|kv=CODEC", "attn=IMPL[,IMPL...]", "center=first|calib",
                 "smooth=first|calib", "evict=all|streaming|h2o|snapkv:BUDGET[,OPT...]",
                 "fit=DIR", "page=N")
#: a layer selection: indices and Python slices, e.g. ``0,-1`` or ``4:12`` or ``::2``
_LAYER_RULE = re.compile(r"layers\[([^\]]*)\]:(k|v|kv)=(.+)", re.S)
_DEFAULT_ATTENTION = ("auto",)


class CacheSpecError(CodecError):
    """A cache spec that does not parse; the message lists the valid clauses."""


@dataclasses.dataclass(frozen=True)
class LayerRule:
    """Store ``role`` (``"k"``, ``"v"`` or ``"kv"``) of the selected layers with ``codec``.

    ``select`` is the text between the brackets of ``layers[...]``: comma-separated
    layer indices (negative ones count from the end) and slices ``start:stop[:step]``.
    """

    select: str
    role: str
    codec: Codec

    def __post_init__(self):
        if self.role not in ("k", "v", "kv"):
            raise CacheSpecError(f"layer rule role must be k, v or kv, got '{self.role}'")
        object.__setattr__(self, "codec", parse_codec(self.codec))
        object.__setattr__(self, "select", self.select.replace(" ", ""))
        _selection(self.select, None)  # syntax only; the layer count comes later

    def layers(self, num_layers: int) -> set[int]:
        """The selected layer indices of a model with ``num_layers`` layers."""
        return _selection(self.select, num_layers)

    @property
    def spec(self) -> str:
        return f"layers[{self.select}]:{self.role}={self.codec.spec}"


def _selection(select: str, num_layers: int | None) -> set[int]:
    """Layer indices named by ``select`` (syntax check only when ``num_layers`` is None)."""
    out: set[int] = set()
    if not select:
        raise CacheSpecError("empty layer selection 'layers[]'; e.g. layers[0,-1] or layers[4:12]")
    for item in select.split(","):
        try:
            if ":" in item:
                bounds = [int(b) if b else None for b in item.split(":")]
                if len(bounds) > 3 or bounds[2:] == [0]:
                    raise ValueError
                chosen = None if num_layers is None else range(num_layers)[slice(*bounds)]
            else:
                index = int(item)
        except ValueError:
            raise CacheSpecError(
                f"bad layer selection '{item}' in layers[{select}]; give indices and "
                "slices, e.g. layers[0,-1] or layers[4:12]") from None
        if ":" in item:
            if chosen is not None and not chosen:
                # refused as an index out of range is: the rule would do nothing
                raise CacheSpecError(f"layers[{select}]: the slice '{item}' selects no layer "
                                     f"of a model with {num_layers} layers")
            out.update(chosen or ())
            continue
        if num_layers is not None:
            if not -num_layers <= index < num_layers:
                raise CacheSpecError(
                    f"layers[{select}] names layer {index}, the model has {num_layers} layers")
            out.add(index % num_layers)
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """What a cache stores and how: the parsed form of a cache spec (:func:`parse_cache`).

    Attributes:
        k: the codec (or spec string) of keys.
        v: the codec of values; None takes ``k.value_codec()``.
        residual_window: the ``W`` most recent tokens stay raw.
        sink_tokens: the first tokens of every row stay raw (attention sinks).
        layers: per-layer rules, applied in order over the K/V codecs above.
        attention: names of attention implementations, tried in order
            (:mod:`kvjax.attention` validates them).
        center: ``""``, ``"first"`` or ``"calib"``: where the vector subtracted from
            every stored key comes from (:mod:`kvjax.centering`).
        smooth: the same for the per-channel key scales folded into the query.
        evict: None, or the eviction that bounds each prompt's stored tokens
            (:mod:`kvjax.eviction`).
        fit: ``""``, or the directory of the fitted codec parameters
            (:func:`kvjax.calibration.save_fitted`) of codecs that need them.
        page_tokens: 0 (each row's codes contiguous), or the tokens of a page of the
            paged pool that every row's coded tokens live in (:mod:`kvjax.paging`).
    """

    k: Codec | str
    v: Codec | str | None = None
    residual_window: int = 0
    sink_tokens: int = 0
    layers: tuple[LayerRule, ...] = ()
    attention: tuple[str, ...] = _DEFAULT_ATTENTION
    center: str = ""
    smooth: str = ""
    evict: Eviction | None = None
    fit: str = ""
    page_tokens: int = 0

    def __post_init__(self):
        k = parse_codec(self.k)
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "v", k.value_codec() if self.v is None else parse_codec(self.v))
        for name in ("residual_window", "sink_tokens", "page_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
                raise CacheSpecError(f"{name} must be a non-negative int, got {value!r}")
            if value > MAX_TOKENS:
                clause = {"residual_window": "window", "sink_tokens": "sinks",
                          "page_tokens": "page"}[name]
                raise CacheSpecError(f"{clause}={value} is past the most tokens a cache spec "
                                     f"names, {MAX_TOKENS} (2**30)")
            object.__setattr__(self, name, int(value))
        rules = tuple(self.layers)
        if not all(isinstance(r, LayerRule) for r in rules):
            raise CacheSpecError("layers must be LayerRule objects (or use parse_cache)")
        object.__setattr__(self, "layers", rules)
        attention = (self.attention,) if isinstance(self.attention, str) else self.attention
        attention = tuple(a.strip() for a in attention)
        if not attention or not all(attention):
            raise CacheSpecError("attn= needs at least one implementation name")
        object.__setattr__(self, "attention", attention)
        for name in ("center", "smooth"):
            if getattr(self, name) not in ("", *CENTER_MODES):
                raise CacheSpecError(f"{name}={getattr(self, name)!r}: valid values are "
                                     f"{', '.join(CENTER_MODES)}")
        if isinstance(self.evict, str):
            object.__setattr__(self, "evict", parse_eviction(self.evict))
        if self.evict is not None and not isinstance(self.evict, Eviction):
            raise CacheSpecError(f"evict must be an Eviction or its spec, got {self.evict!r}")
        if not isinstance(self.fit, str) or any(c.isspace() for c in self.fit):
            raise CacheSpecError(f"fit must be a directory path without spaces, got "
                                 f"{self.fit!r}")
        if self.fit and not self.needs_fit:
            raise CacheSpecError(f"fit={self.fit} names fitted parameters, but no codec of "
                                 "this cache takes any (e.g. saw:c256 or saw:hess do)")

    def reference(self) -> CacheConfig:
        """The uncompressed cache this one is compared with: bf16 K and V with the same
        residual window and sinks (which a bf16 cache holds the same either way), no
        layer rules, no key transform, no eviction."""
        return CacheConfig(k="bf16", residual_window=self.residual_window,
                           sink_tokens=self.sink_tokens)

    @property
    def needs_fit(self) -> bool:
        """Whether a codec of some layer takes fitted parameters."""
        return any(c.needs_fit for c in (self.k, self.v, *(r.codec for r in self.layers)))

    @property
    def calibrated(self) -> bool:
        """Whether the keys' transform needs a calibration (a ``calib`` clause)."""
        return "calib" in (self.center, self.smooth)

    @property
    def spec(self) -> str:
        """The canonical cache spec: ``parse_cache(config.spec) == config``."""
        if self.v == self.k.value_codec():
            clauses = [self.k.spec]
        else:
            clauses = [f"k={self.k.spec}", f"v={self.v.spec}"]
        if self.residual_window:
            clauses.append(f"window={self.residual_window}")
        if self.sink_tokens:
            clauses.append(f"sinks={self.sink_tokens}")
        clauses += [rule.spec for rule in self.layers]
        if self.attention != _DEFAULT_ATTENTION:
            clauses.append("attn=" + ",".join(self.attention))
        clauses += [f"{name}={getattr(self, name)}" for name in ("center", "smooth")
                    if getattr(self, name)]
        if self.evict is not None:
            clauses.append(f"evict={self.evict.spec}")
        if self.fit:
            clauses.append(f"fit={self.fit}")
        if self.page_tokens:
            clauses.append(f"page={self.page_tokens}")
        return " ".join(clauses)

    def layer_codecs(self, num_layers: int) -> list[tuple[Codec, Codec]]:
        """The (K codec, V codec) of every layer after the layer rules."""
        pairs = [[self.k, self.v] for _ in range(num_layers)]
        for rule in self.layers:
            for i in rule.layers(num_layers):
                if "k" in rule.role:
                    pairs[i][0] = rule.codec
                if "v" in rule.role:
                    pairs[i][1] = rule.codec
        return [(k, v) for k, v in pairs]


def _split_clauses(text: str) -> list[str]:
    """Clauses separated by whitespace (commas inside a codec spec never hold spaces,
    but ``kivi:2, g32`` is forgiven: a clause starting with a space-split option joins
    the clause before it)."""
    clauses: list[str] = []
    for word in text.split():
        if clauses and (clauses[-1].endswith(",") or word.startswith(",")):
            clauses[-1] += word
        else:
            clauses.append(word)
    return clauses


def _non_negative(clause: str, value: str) -> int:
    # int() also takes signs, underscores, spaces and non-ASCII digits: a spec is plain
    # ASCII decimal, so it reads the same everywhere it is written down
    if not (value.isascii() and value.isdigit()):
        raise CacheSpecError(f"'{clause}': expected a non-negative integer")
    return int(value)


def parse_cache(spec: str | CacheConfig, **defaults: Any) -> CacheConfig:
    """A :class:`CacheConfig` from a cache spec (see the module docstring).

    ``defaults`` are :class:`CacheConfig` fields for what the spec does not say
    (``parse_cache("int:4", residual_window=32)``); a field given both ways raises.
    Raises :class:`CacheSpecError` (a ``ValueError``) with a one-line message that
    lists the valid clauses.
    """
    if isinstance(spec, CacheConfig):
        return dataclasses.replace(spec, **defaults) if defaults else spec
    if not isinstance(spec, str) or not spec.strip():
        raise CacheSpecError(f"empty cache spec; clauses: {' '.join(CACHE_CLAUSES)}")
    fields: dict[str, Any] = {}
    rules: list[LayerRule] = []

    def put(name: str, value: Any, clause: str) -> None:
        if name in fields:
            raise CacheSpecError(f"'{clause}': {name} is given twice in '{spec}'")
        fields[name] = value

    for n, clause in enumerate(_split_clauses(spec)):
        key, eq, value = clause.partition("=")
        rule = _LAYER_RULE.fullmatch(clause)
        try:
            if rule:
                select, role, codec = rule.groups()
                rules.append(LayerRule(select=select, role=role, codec=codec))
            elif clause.startswith("layers["):
                raise CacheSpecError(
                    f"bad layer rule '{clause}'; the form is layers[SEL]:k|v|kv=CODEC, "
                    "e.g. layers[0,-1]:k=bf16")
            elif not eq or ":" in key or "," in key:
                if n:
                    raise CacheSpecError(
                        f"'{clause}': only the first clause may be a bare codec spec")
                put("k", parse_codec(clause), clause)
            elif key in ("k", "v"):
                put(key, parse_codec(value), clause)
            elif key == "window":
                put("residual_window", _non_negative(clause, value), clause)
            elif key == "sinks":
                put("sink_tokens", _non_negative(clause, value), clause)
            elif key == "page":
                tokens = _non_negative(clause, value)
                if tokens < 1:
                    raise CacheSpecError(f"'{clause}': a page holds at least one token")
                put("page_tokens", tokens, clause)
            elif key == "attn":
                put("attention", tuple(value.split(",")), clause)
            elif key in ("center", "smooth"):
                if value not in CENTER_MODES:
                    raise CacheSpecError(f"'{clause}': {key}= takes "
                                         f"{' or '.join(CENTER_MODES)}")
                put(key, value, clause)
            elif key == "evict":
                put("evict", parse_eviction(value), clause)
            elif key == "fit":
                if not value:
                    raise CacheSpecError(f"'{clause}': fit= takes a directory")
                put("fit", value, clause)
            else:
                raise CacheSpecError(f"unknown clause '{clause}'")
        except CacheSpecError as err:
            raise CacheSpecError(f"{err}; clauses: {' '.join(CACHE_CLAUSES)}") from None
        except (CodecError, EvictionSpecError) as err:
            raise CacheSpecError(f"in '{clause}': {err}") from None
    if rules:
        fields["layers"] = tuple(rules)
    for name, value in defaults.items():
        if name in fields:
            raise CacheSpecError(f"cache spec '{spec}' already sets {name}")
        fields[name] = value
    if "k" not in fields:
        raise CacheSpecError(f"cache spec '{spec}' names no K codec; e.g. 'int:4' or "
                             "'k=int:4 v=int:2'")
    return CacheConfig(**fields)
