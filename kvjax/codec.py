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

Options. Each codec declares the options of its spec string once, as
:attr:`Codec.options` (a tuple of :class:`Option`): which dataclass field an option sets,
how it is written (``4``, ``g32``, ``3bps``, ``token``, ``e8``), its type, valid values
and default. :meth:`Codec.from_options` (parsing, with one-line errors that give the
usage), the field checks at construction, the canonical :attr:`Codec.spec` and
:meth:`Codec.usage` are all derived from that declaration. :attr:`Codec.examples` lists
specs, with the error each promises, that the conformance suite runs. Whole spec strings
(``int:4``, ``kivi:2,g32``) are parsed by :mod:`kvjax.spec`, which sits above the codecs;
this module imports no codec. ``register`` puts a class in the registry that the
grammar reads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.primitives.quaternion import HqmqLayout

Codes = dict[str, jax.Array]
Params = Any

#: float32 matmuls of the reference paths: GPUs would otherwise use TF32 by default
EXACT = jax.lax.Precision.HIGHEST


class CodecError(ValueError):
    """A codec spec or an input that a codec cannot represent."""


#: largest finite fp16: the bound of every scale, zero point and norm a codec stores in
#: fp16 (the papers' metadata type)
FP16_MAX = float(jnp.finfo(jnp.float16).max)
#: smallest normal fp16: metadata below it is kept as an fp16 subnormal, on a grid of
#: ``FP16_STEP``, so precision there is absolute rather than relative
FP16_TINY = float(jnp.finfo(jnp.float16).smallest_normal)
#: smallest positive fp16 (subnormal): metadata of smaller magnitude stores as zero
FP16_STEP = float(jnp.finfo(jnp.float16).smallest_subnormal)


@dataclasses.dataclass(frozen=True)
class Limits:
    """The largest magnitudes a codec's stored arrays can represent, per vector.

    ``element`` bounds every ``|x_i|`` (a scalar codec's fp16 zero point, bf16 storage);
    ``norm`` bounds ``|x|_2`` (a norm-direction codec's fp16 norm). A vector beyond either
    is *out of range*: :meth:`Codec.encode` raises on it outside ``jit`` and saturates it
    under ``jit`` (:meth:`Codec.saturate`), and the cache flags the row.
    """

    element: float = math.inf
    norm: float = math.inf


# -- options: the spec grammar that each codec declares once ---------------------------

#: characters of a number in a spec option (``g32``, ``2.5bps``, ``med2.5``)
_NUMBER = "0123456789."
_FORMS = ("value", "prefix", "suffix", "word", "choice")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Option:
    """One option of a codec's spec string, declared once on the codec class.

    A codec lists its options in :attr:`Codec.options`; parsing (:meth:`Codec.from_options`),
    field validation, the canonical :attr:`Codec.spec` and the usage text all read that
    declaration. Build options with the constructors :meth:`value`, :meth:`flag`,
    :meth:`suffix`, :meth:`word` and :meth:`choice`.

    Attributes:
        field: the dataclass field the option sets (or a value that
            :meth:`Codec.from_values` maps to fields, e.g. OCTOPUS's nominal bits).
        form: ``"value"`` a bare number (``int:4``), ``"prefix"`` text then a number
            (``g32``), ``"suffix"`` a number then text (``3bps``), ``"word"`` a bool set by
            its presence (``token``), ``"choice"`` one word of ``choices`` (``e8``).
        text: the prefix, suffix or word.
        type: ``int``, ``float``, ``bool`` (words) or ``str`` (choices).
        lo, hi: the valid range of a number (either may be None); ``lo_open`` excludes
            ``lo``.
        choices: the valid values (words of a choice, or the numbers of a prefix).
        what, metavar: names for messages and the usage text (``group size``, ``G``).
        always: the canonical spec writes the option even at its default.
        required: the spec must give it; None: when the field has no default.
        note: the usage text of the valid values, where the range alone would mislead.
    """

    field: str
    form: str
    text: str = ""
    type: type = int
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple[Any, ...] = ()
    what: str = ""
    metavar: str = ""
    always: bool = False
    required: bool | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.form not in _FORMS:
            raise TypeError(f"option form must be one of {_FORMS}, got {self.form!r}")

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def value(cls, field: str, what: str, metavar: str = "N", **kw: Any) -> Option:
        """A bare number, e.g. the ``4`` of ``int:4``."""
        return cls(field=field, form="value", what=what, metavar=metavar, **kw)

    @classmethod
    def flag(cls, field: str, prefix: str, what: str, metavar: str, **kw: Any) -> Option:
        """A prefixed number, e.g. ``g32`` (prefix ``g``)."""
        return cls(field=field, form="prefix", text=prefix, what=what, metavar=metavar, **kw)

    @classmethod
    def suffix(cls, field: str, suffix: str, what: str, metavar: str, **kw: Any) -> Option:
        """A number with a suffix, e.g. ``3bps`` (suffix ``bps``)."""
        return cls(field=field, form="suffix", text=suffix, what=what, metavar=metavar, **kw)

    @classmethod
    def word(cls, field: str, word: str, what: str) -> Option:
        """A bool field that is True when ``word`` is given, e.g. ``token``."""
        return cls(field=field, form="word", text=word, type=bool, what=what)

    @classmethod
    def choice(cls, field: str, choices: tuple[str, ...], what: str, metavar: str = "",
               **kw: Any) -> Option:
        """One word of ``choices``, e.g. the lattice ``e8`` of ``e8|d4|a2|z``."""
        return cls(field=field, form="choice", type=str, choices=tuple(choices), what=what,
                   metavar=metavar, **kw)

    # -- text ---------------------------------------------------------------------------
    @property
    def syntax(self) -> str:
        """How the option is written in the usage text: ``N``, ``gG``, ``RATEbps``..."""
        if self.form == "prefix":
            return self.text + self.metavar
        if self.form == "suffix":
            return self.metavar + self.text
        if self.form == "word":
            return self.text
        if self.form == "choice":
            return self.metavar or "|".join(self.choices)
        return self.metavar

    @property
    def key(self) -> str:
        """The option's name in lists of known options: its prefix, suffix or word(s)."""
        return "|".join(self.choices) if self.form == "choice" else self.text

    @property
    def label(self) -> str:
        """The option in messages: ``bit width N``."""
        return f"{self.what} {self.metavar}".strip()

    def is_required(self, defaults: Mapping[str, Any]) -> bool:
        """Whether a spec must give the option (``defaults``: the codec's field defaults)."""
        return self.required if self.required is not None else self.field not in defaults

    def valid_range(self) -> str:
        """The valid values in words: ``2..8``, ``(0, 100]``, ``16/32/64/128``; '' if any."""
        if self.choices:
            return "/".join(str(c) for c in self.choices)
        if self.lo is None and self.hi is None:
            return ""
        if self.hi is None:
            return f">= {self.lo:g}"
        if self.lo_open:
            return f"({self.lo:g}, {self.hi:g}]"
        return f"{self.lo:g}..{self.hi:g}"

    def requirement(self) -> str:
        """What a valid value is, for messages: ``an integer in 2..8``."""
        if self.type is bool:
            return "a bool"
        if self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        noun = {int: "an integer", float: "a number"}[self.type]
        span = self.valid_range()
        if not span:
            return noun
        return f"{noun} {span}" if span.startswith(">") else f"{noun} in {span}"

    def render(self, value: Any) -> str:
        """The option as the canonical spec writes it, for a value it writes."""
        if self.form == "word":
            return self.text
        text = f"{value:g}" if self.type is float else str(value)
        if self.form == "prefix":
            return self.text + text
        if self.form == "suffix":
            return text + self.text
        return text

    # -- values -------------------------------------------------------------------------
    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is a valid value of the field (type, range, choices)."""
        if self.type is bool:
            return isinstance(value, bool)
        if self.type is str:
            return isinstance(value, str) and value in self.choices
        numbers = (int, np.integer) if self.type is int else (int, float, np.integer, np.floating)
        if isinstance(value, bool) or not isinstance(value, numbers):
            return False
        if self.choices:
            return value in self.choices
        if self.lo is not None and not (value > self.lo if self.lo_open else value >= self.lo):
            return False
        return (self.hi is None or value <= self.hi) and (self.type is int or math.isfinite(value))

    def read(self, text: str) -> Any:
        """The value of an option's text (without its prefix or suffix); ValueError if
        it is not a valid value."""
        if self.form == "word":
            if text != self.text:
                raise ValueError(f"option '{self.text}' takes no value, got '{text}'")
            return True
        if self.type is not str and text.strip(_NUMBER):
            # Python's int()/float() would also take '1e3', '+4', '3_0', 'inf'
            raise ValueError(text)
        value = text if self.type is str else self.type(text)
        if not self.accepts(value):
            raise ValueError(text)
        return value

    def match(self, token: str) -> str | None:
        """The value text of ``token`` when it spells this option (a bare number matches
        no option: :meth:`Codec.parse_options` gives those to the value option)."""
        head = token.rstrip(_NUMBER)
        if self.form in ("word", "choice"):
            words = self.choices if self.form == "choice" else (self.text,)
            # a word with a number glued on is still that word (then its value is wrong)
            return token if token in words or (self.form == "word" and head == self.text) \
                else None
        if self.form == "prefix":
            # the prefix then anything but a letter is this option, its value maybe wrong
            # (``g3x``, ``med-1``); the prefix then a letter is another word (``tile16``
            # is not ``t``)
            rest = token[len(self.text):]
            if token.startswith(self.text) and not rest[:1].isalpha():
                return rest
            return None
        if self.form == "suffix" and token.endswith(self.text):
            number = token[: -len(self.text)]
            # a whole number, or one with digits after the point (``3bps``, ``2.5bps``)
            if number and not number.strip(_NUMBER) and "." not in (number[0], number[-1]):
                return number
        return None


def _usage(head: str, sep: str, options: tuple[Option, ...], defaults: Mapping[str, Any]) -> str:
    """``head`` followed by the options' syntax and their valid values: the usage text."""
    text = head
    for i, opt in enumerate(options):
        lead = sep if i == 0 else ","
        text += f"{lead}{opt.syntax}" if opt.is_required(defaults) else f"[{lead}{opt.syntax}]"
    details = []
    for opt in options:
        span = opt.valid_range()
        if opt.note:
            details.append(opt.note)
        elif opt.metavar and span:
            span = f"{opt.metavar} {span}" if span.startswith(">") else f"{opt.metavar} in {span}"
            default = defaults.get(opt.field)
            if default is not None and not opt.is_required(defaults):
                span += f" (default {default:g})" if opt.type is float else f" (default {default})"
            details.append(span)
    return text + (" with " + ", ".join(details) if details else "")


@dataclasses.dataclass(frozen=True)
class Example:
    """A spec that the conformance suite (``tests/kvjax/codecs/test_conformance.py``) runs
    for its codec, with what the codec promises for it.

    Attributes:
        spec: the codec spec.
        rel_mse: bound on ``sum((x - x_hat)^2) / sum(x^2)`` of a round trip of standard
            Gaussian vectors (0 for exact storage).
        head_dim: the head dim to run it at.
        seeded: ``init`` draws parameters from the key (different keys give different
            parameters and codes); False: the parameters do not depend on the key.
        bad_head_dims: positive head dims that the codec rejects (a power of two or a
            divisor it needs), besides the non-positive ones every codec rejects.
    """

    spec: str
    rel_mse: float
    head_dim: int = 64
    seeded: bool = False
    bad_head_dims: tuple[int, ...] = ()


@functools.cache
def _fields(cls: type) -> tuple[frozenset[str], dict[str, Any]]:
    """``(field names, {field: default})`` of a codec dataclass."""
    names, defaults = set(), {}
    for f in dataclasses.fields(cls):
        names.add(f.name)
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            defaults[f.name] = f.default_factory()
    return frozenset(names), defaults


def _written(name: str, options: Sequence[str]) -> str:
    """The spec as written, to quote in error messages."""
    return f"{name}:{','.join(options)}" if options else name


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
    #: the key of a codes leaf held as one pool per row rather than per block (a cache
    #: writes it through the codec's ``encode_after`` and never slices it by block)
    row_pool: ClassVar[str | None] = None

    #: the options of the spec string, in the order the canonical spec writes them
    options: ClassVar[tuple[Option, ...]] = ()
    #: specs that the conformance suite runs (every registered codec needs some)
    examples: ClassVar[tuple[Example, ...]] = ()
    #: what the stored arrays can represent (see :meth:`in_range`)
    limits: ClassVar[Limits] = Limits()
    #: for a layout that cannot be read fast on a GPU: why, as measured, and the
    #: sibling spec to use for speed (``python -m kvjax codecs`` prints it)
    decode_note: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        keys = [opt.key for opt in cls.options]
        if [opt.form for opt in cls.options].count("value") > 1 or len(set(keys)) < len(keys):
            raise TypeError(f"{cls.__name__}: options need distinct names and at most one "
                            f"bare value, got {keys}")

    # -- construction -------------------------------------------------------------
    def __post_init__(self) -> None:
        """Check every declared option's field (float ones become floats), then
        :meth:`validate`."""
        names, defaults = _fields(type(self))
        for opt in self.options:
            if opt.field not in names:
                continue
            value = getattr(self, opt.field)
            if value is None and opt.field in defaults and defaults[opt.field] is None:
                continue
            if not opt.accepts(value):
                raise CodecError(f"{self.name}: {opt.label} must be {opt.requirement()}, "
                                 f"got {value!r}")
            if opt.type is float:
                object.__setattr__(self, opt.field, float(value))
        self.validate()

    def validate(self) -> None:
        """Checks across fields that the option declarations cannot state; raise
        :class:`CodecError` with a message that starts with ``'{name}: '``."""

    @classmethod
    def usage(cls, head: str | None = None, sep: str = ":") -> str:
        """The spec grammar with the valid values, e.g.
        ``kivi:N[,gG][,token] with N in 2..8, G in 1..4096 (default 32)``; ``head`` and
        ``sep`` are what the options follow (the name and ``:``)."""
        return _usage(head or cls.name, sep, cls.options, _fields(cls)[1])

    @classmethod
    def claims(cls, token: str) -> bool:
        """Whether ``token`` spells one of this codec's options other than a bare value."""
        return any(opt.match(token) is not None for opt in cls.options)

    @classmethod
    def parse_options(cls, options: Sequence[str], spec: str | None = None) -> dict[str, Any]:
        """``{field: value}`` of the comma-separated options of a spec string.

        Every option must spell a declared one (a bare number is the value option), at
        most once and with a valid value; required ones must be there. ``spec`` is
        quoted in errors: a :class:`CodecError` of one line with the usage.
        """
        spec = spec or _written(cls.name, options)
        if not cls.options:
            if options:
                raise CodecError(f"{spec}: codec '{cls.name}' takes no options, "
                                 f"got {list(options)}")
            return {}
        defaults = _fields(cls)[1]

        def fail(problem: str) -> CodecError:
            return CodecError(f"{spec}: {problem}; usage: {cls.usage()}")

        def read(opt: Option, text: str) -> Any:
            try:
                return opt.read(text)
            except ValueError as err:
                if opt.form == "word":
                    raise fail(str(err)) from None
                raise fail(f"{opt.label} must be {opt.requirement()}, got '{text}'") from None

        bare_value = next((opt for opt in cls.options if opt.form == "value"), None)
        # a codec whose one option is a bare value reads every option as that value, so
        # that a wrong one is reported against what the value must be
        only_value = len(cls.options) == 1 and bare_value is not None
        values: dict[str, Any] = {}
        given: dict[str, str] = {}
        bare: list[str] = []
        for token in options:
            match = None if only_value else next(
                ((opt, text) for opt in cls.options if (text := opt.match(token)) is not None),
                None)
            if match is None:
                is_number = not token.strip(_NUMBER)
                if only_value or (bare_value is not None and is_number):
                    bare.append(token)
                    continue
                if is_number:
                    raise fail(f"unexpected value '{token}': {cls.name} takes no bare number")
                known = ", ".join(opt.key for opt in cls.options if opt.form != "value")
                raise fail(f"unknown option '{token}'; known: {known}")
            opt, text = match
            if opt.field in given:
                if opt.form == "choice" and given[opt.field] != token:
                    raise fail(f"at most one {opt.what} ({opt.key}), got "
                               f"'{given[opt.field]}' and '{token}'")
                raise fail(f"option '{opt.key}' given twice")
            given[opt.field] = token
            values[opt.field] = read(opt, text)
        if bare_value is not None:
            if len(bare) > 1 or (not bare and bare_value.is_required(defaults)):
                raise fail(f"expected exactly one {bare_value.label} in "
                           f"{bare_value.valid_range()}, got {len(bare)} such options")
            if bare:
                values[bare_value.field] = read(bare_value, bare[0])
        missing = [opt.syntax for opt in cls.options
                   if opt.form != "value" and opt.is_required(defaults)
                   and opt.field not in values]
        if missing:
            raise fail("expected " + " and ".join(missing))
        return values

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> Codec:
        """The codec of parsed option values; override where an option is not a field."""
        return cls(**values)

    @classmethod
    def from_options(cls, options: Sequence[str], *, spec: str | None = None,
                     **fields: Any) -> Codec:
        """Build from the comma-separated options of a spec string (``fields``: fields
        that the spec does not give, e.g. a wrapper's base codec)."""
        spec = spec or _written(cls.name, options)
        values = cls.parse_options(options, spec)
        try:
            return cls.from_values({**fields, **values})
        except CodecError as err:
            reason = str(err).removeprefix(f"{cls.name}: ")
            raise CodecError(f"{spec}: {reason}; usage: {cls.usage()}") from None

    def spec_values(self) -> dict[str, Any]:
        """``{field: value}`` that the canonical spec writes (from the declared options);
        override to leave out options that do not apply."""
        return {opt.field: getattr(self, opt.field) for opt in self.options}

    def spec_options(self) -> list[str]:
        """The options of the canonical spec: declared order; defaults left out unless
        the option is ``always`` written; words when True."""
        defaults = _fields(type(self))[1]
        values = self.spec_values()
        out = []
        for opt in self.options:
            value = values.get(opt.field)
            if value is None or value is False:
                continue
            if not opt.always and opt.field in defaults and value == defaults[opt.field]:
                continue
            out.append(opt.render(value))
        return out

    @property
    def spec(self) -> str:
        """The canonical spec string: ``parse_codec(c.spec) == c``."""
        return _written(self.name, self.spec_options())

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

    @property
    def needs_fit(self) -> bool:
        """Whether the parameters come from :meth:`fit` on calibration data (a cache
        then reads them from its ``fit=`` clause) rather than from :meth:`init`."""
        return False

    def fit(self, key: jax.Array, x: jax.Array, query_moment: jax.Array | None = None
            ) -> Params:
        """Parameters of one (layer, kv head, K|V) fitted on its calibration vectors
        ``x[N, D]``; ``query_moment[D, D]``: ``sum q q^T`` of the queries that attend to
        them (keys only). The structure and shapes are :meth:`init`'s.
        :class:`CodecError` for a codec that needs no fit, or ``x`` not ``[N, D]``."""
        if not self.needs_fit:
            raise CodecError(f"{self.spec}: this codec has no fitted parameters")
        x = jnp.asarray(x, jnp.float32)
        if x.ndim != 2:
            raise CodecError(f"{self.spec}: calibration vectors must be [N, D], got "
                             f"{x.shape}")
        return self._fit(key, x, query_moment)

    def _fit(self, key: jax.Array, x: jax.Array, query_moment: jax.Array | None) -> Params:
        raise NotImplementedError

    def encode(self, params: Params, x: jax.Array) -> Codes:
        """Packed codes of ``x[..., T, D]`` (``T`` a multiple of ``block_tokens``).

        Input the storage cannot represent (NaN/Inf, or finite vectors beyond
        :attr:`limits`): outside ``jit`` this raises :class:`CodecError`; under ``jit``
        (where values cannot be inspected) NaN is encoded as 0, +-Inf as the largest
        finite float32, and every vector is then saturated into range
        (:meth:`saturate`), so the output stays finite; the cache records such rows
        (see :func:`kvjax.cache.check`).
        """
        x = self.saturate(self._check_input(x))
        # the barrier makes the codes real even when encode and decode share a program:
        # without it XLA may fold a narrowing cast and its widening inverse into nothing
        # (excess precision, applied on GPU), and a fused round trip would not quantize
        return jax.lax.optimization_barrier(self._encode(params, x))

    def in_range(self, x: jax.Array) -> jax.Array:
        """``bool[..., T]``: which vectors of ``x[..., T, D]`` are finite and within
        :attr:`limits` (so encode stores them without saturating)."""
        x = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x), axis=-1, initial=0.0)
        ok = jnp.all(jnp.isfinite(x), axis=-1) & (amax <= self.limits.element)
        if math.isfinite(self.limits.norm):
            ok &= safe_norm(x)[..., 0] <= self.limits.norm
        return ok

    def saturate(self, x: jax.Array) -> jax.Array:
        """Finite ``x[..., T, D]`` brought into :attr:`limits`: elements clipped to
        ``+-element``, then vectors longer than ``norm`` scaled down to that length
        (direction kept). Vectors in range pass unchanged."""
        x = x.astype(jnp.float32)
        if math.isfinite(self.limits.element):
            x = jnp.clip(x, -self.limits.element, self.limits.element)
        if math.isfinite(self.limits.norm):
            scaled, power = _power_scaled(x)
            scaled_norm = jnp.sqrt(_tree_sum(scaled * scaled))
            # a norm beyond float32 (several elements near its largest value) is inf,
            # still beyond the limit; the direction comes from the scaled copy, finite
            over = scaled_norm / power > self.limits.norm
            # a hair below the limit, so the norm recomputed from the result stays in range
            target = np.float32(self.limits.norm) * np.float32(1 - 2.0**-20)
            shrink = target / jnp.where(scaled_norm > 0, scaled_norm, 1.0)
            x = jnp.where(over, scaled * shrink, x)
        return x

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
            with jax.ensure_compile_time_eval():
                outside = not bool(jnp.all(self.in_range(x)))
            if outside:
                raise CodecError(f"{self.spec}: {self._range_problem(x)}")
        return sanitize(x)

    def _range_problem(self, x: jax.Array) -> str:
        """Why concrete finite ``x`` is out of range, for the error message."""
        amax = float(jnp.max(jnp.abs(x)))
        if amax > self.limits.element:
            return (f"input magnitude {amax:.4g} exceeds {self.limits.element:.6g}, the "
                    "largest element this codec's storage can represent")
        norm = float(jnp.max(safe_norm(x)))
        return (f"a vector norm of {norm:.4g} exceeds {self.limits.norm:.6g}, the largest "
                "norm this codec's storage can represent")


#: vectors whose largest element lies outside ``[2^-60, 2^60]`` are rescaled by a power of
#: two before squaring (squares of float32 overflow beyond ~1.8e19 and underflow below
#: ~1e-19); the bounds leave room for sums over any head dim
_SQUARE_SAFE, _RESCALE = 2.0**60, 2.0**100


def _power_scaled(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x * p, p)`` over the last axis of float32 ``x``, ``p`` a power of two (1 for most
    vectors) that brings the largest element into ``[2^-60, 2^60]``.

    A power of two scales exactly, and it is a normal float32 both ways: dividing by the
    largest element instead, as a compiler may do through its reciprocal, flushes that
    reciprocal to zero for elements near float32's largest (a subnormal)."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True, initial=0.0)
    power = jnp.where(amax > _SQUARE_SAFE, np.float32(1 / _RESCALE),
                      jnp.where(amax < 1 / _SQUARE_SAFE, np.float32(_RESCALE), np.float32(1)))
    return x * power, power


def _tree_sum(x: jax.Array) -> jax.Array:
    """The sum over the last axis (kept as a size-1 axis) as a fixed tree of pairwise adds.

    XLA vectorizes a reduction according to the whole array's shape, which moves the last
    bit of a row's sum with the rows around it; elementwise adds of fixed halves give the
    same bits for a vector whatever batch it comes in, so saturating it does too."""
    if x.shape[-1] == 0:
        return jnp.zeros((*x.shape[:-1], 1), x.dtype)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        pairs = x[..., :half] + x[..., half : 2 * half]
        x = jnp.concatenate([pairs, x[..., 2 * half :]], axis=-1) if x.shape[-1] % 2 else pairs
    return x


def safe_norm(x: jax.Array) -> jax.Array:
    """``|x|_2`` over the last axis (kept as a size-1 axis) in float32, without the
    overflow of squaring elements beyond ~1.8e19 (or the underflow of tiny ones): computed
    on ``x`` rescaled by a power of two. Norms beyond float32's range are ``inf``. The
    bits of a vector's norm do not depend on the batch it comes in."""
    scaled, power = _power_scaled(x.astype(jnp.float32))
    return jnp.sqrt(_tree_sum(scaled * scaled)) / power


def sanitize(x: jax.Array) -> jax.Array:
    """Replace NaN by 0 and +-Inf by the largest finite float32 (computed in float32)."""
    return jnp.nan_to_num(x.astype(jnp.float32), nan=0.0)


def round_to_dtype(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` rounded to the nearest value of the float ``dtype``, returned as float32.

    A value that a codec both stores narrow (fp16 scales, bf16 raw tokens) and computes
    with must be rounded explicitly: XLA may drop an ``f32 -> f16 -> f32`` round trip
    (``xla_allow_excess_precision``, which it applies on GPU), so ``x.astype(f16)`` used
    inside the same program could differ from what is stored. ``reduce_precision``
    cannot be elided. The result casts to ``dtype`` exactly, ``dtype``'s subnormals
    included (``reduce_precision`` alone flushes them to zero).
    """
    info = jnp.finfo(dtype)
    x = x.astype(jnp.float32)
    normal = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if info.nexp >= 8:
        # float32's own exponent range: its subnormals are float32 subnormals too
        return normal
    # subnormals are evenly spaced: round to that grid (scaling by a power of two is
    # exact, and round-half-even matches the cast)
    step = float(info.smallest_subnormal)
    subnormal = jnp.round(x * np.float32(1 / step)) * np.float32(step)
    return jnp.where(jnp.abs(x) < float(info.smallest_normal), subnormal, normal)


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
    """Token-wise integer codes: each stored vector is ``R^T (zero + scale * c)`` with
    ``c`` the ``bits``-bit codes of its ``D`` dims.

    Codes pytree: ``"codes"`` uint32 ``[..., T, W]`` (:func:`kvjax.primitives.packing.
    pack_codes` words), ``"scale"`` and ``"zero"`` ``[..., T, 1]``; with ``offset``, signed
    codes stored with that bias and no zeros (``zero = -offset * scale``), the scale
    under the key ``scale_key``. ``rotate``: None (``R = I``), or the linear map ``(params,
    x) -> R x`` (on the last axis); attention then takes ``q . k = (R q) . (zero + scale
    c)`` for keys and maps a weighted sum of values back with ``R^T`` once. For a codec
    that rotated every vector by an orthogonal ``R`` before quantizing it (SAW), ``R^T``
    is the inverse; a codec whose codes need a linear map of its own to become the vector
    (HyperQuant: lattice coordinates, a scale and an inverse rotation) gives its
    transpose as ``R``.
    """

    bits: int
    rotate: Callable[[Params, jax.Array], jax.Array] | None = None
    offset: int | None = None
    scale_key: str = "scale"

    def arrays(self, codes: Codes) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """``(codes [..., T, W], scale [..., T], zero [..., T] or None)`` of a codes
        pytree (the unit axis of the scales dropped: a reshape, no copy)."""
        zero = None if self.offset is not None else codes["zero"][..., 0]
        return codes["codes"], codes[self.scale_key][..., 0], zero

    def rotation(self, params: Params, head_dim: int) -> jax.Array | None:
        """The matrix ``R [D, D]`` of one head's ``params``, or None when the codes are
        the vector itself."""
        if self.rotate is None:
            return None
        # row i of rotate(I) is (R e_i)^T, the i-th column of R
        return self.rotate(params, jnp.eye(head_dim, dtype=jnp.float32)).T


@dataclasses.dataclass(frozen=True)
class OutlierBlocks:
    """Med-C outliers over a token-wise format (:mod:`kvjax.codecs.outliers`): per
    ``block`` tokens a flag bit per chunk of 4 (token-major) and a fixed number of fp16
    chunk slots, filled in the flags' order; the base codes of a flagged chunk decode to
    zero (the base encoded it zeroed), so a reader adds the stored chunks to the base's
    vectors. ``pooled``: the slots are one pool per row and block ``b``'s chunks lie
    from slot ``start[b]`` on (codes ``"start"``, see :mod:`kvjax.codecs.outliers`)."""

    block: int
    pooled: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class HqmqFormat(KernelFormat):
    """HQMQ codes (:mod:`kvjax.codecs.hqmq`): per 4-dim chunk a joint index ``24 s + p``
    of the codeword ``q_p q_s`` and a radius code ``k``, the chunk ``scale * k / (2**B -
    1) * (q_p q_s)``. Codes pytree: ``"stream"`` uint8 ``[..., T, H]``, ``"scale"``
    float16 ``[..., T, 1]``. ``layout(head_dim)``: the stream's
    :class:`~kvjax.primitives.quaternion.HqmqLayout`,
    or None where its fields are not whole bytes and nibbles; ``codewords(params)``: the
    ``24 S`` codewords ``float32[24 S, 4]`` of one head's parameters, by joint index.
    ``outliers``: with Med-C outliers (:class:`OutlierBlocks`), the codes are the outlier
    codec's (``"base"`` holds the HQMQ codes by block, beside ``"flags"`` and
    ``"outliers"``)."""

    secondary: int
    radius_bits: int
    layout: Callable[[int], HqmqLayout | None]
    codewords: Callable[[Params], jax.Array]
    outliers: OutlierBlocks | None = None

    def arrays(self, codes: Codes) -> tuple[jax.Array, jax.Array]:
        """``(stream [..., T, H], scale [..., T])``."""
        if self.outliers is None:
            return codes["stream"], codes["scale"][..., 0]
        base = codes["base"]
        stream, scale = base["stream"], base["scale"][..., 0]
        return (stream.reshape(*stream.shape[:-3], -1, stream.shape[-1]),
                scale.reshape(*scale.shape[:-2], -1))

    def outlier_arrays(self, codes: Codes) -> tuple[jax.Array, ...] | None:
        """``(flags uint32 [..., NB, W], outliers float16 [..., NB, 4 slots])`` (None
        without outliers): per block of ``outliers.block`` tokens; pooled, then ``start
        uint32 [..., NB, 1]``, each block's first slot in the row's pool."""
        if self.outliers is None:
            return None
        chunks = codes["outliers"]
        arrays = (codes["flags"], chunks.reshape(*chunks.shape[:-2], -1))
        return (*arrays, codes["start"]) if self.outliers.pooled else arrays


@dataclasses.dataclass(frozen=True, kw_only=True)
class RiceFormat(KernelFormat):
    """HyperQuant's Rice-coded blocks (:mod:`kvjax.codecs.hyperquant`, without dither):
    per block of ``tN`` tokens the words of its sub-streams, an index word per
    sub-stream, and the tokens' fp16 norms. Codes pytree: ``"stream"`` uint32 ``[..., NB,
    W]``, ``"index"`` uint32 ``[..., NB, n_sub]``, ``"norm"`` float16 ``[..., NB, tN]``.
    ``layout(head_dim)``: the blocks' static shape
    (:class:`kvjax.primitives.rice_blocks.RiceLayout`); ``rotate(params, x)`` and
    ``unrotate(params, x)``: the codec's orthogonal map of vectors into the frame its
    tokens are coded in and back (a kernel rotates the query once and its output back)."""

    layout: Callable[[int], Any]
    rotate: Callable[[Params, jax.Array], jax.Array]
    unrotate: Callable[[Params, jax.Array], jax.Array]

    def arrays(self, codes: Codes) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(stream [..., NB, W], index [..., NB, n_sub], norm [..., NB, tN])``."""
        return codes["stream"], codes["index"], codes["norm"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupIntFormat(KernelFormat):
    """Token-wise integer codes with a scale and zero per group of ``group`` channels:
    dim ``d`` of a stored vector is ``zero[d // group] + scale[d // group] * c[d]`` (the
    value variant of KIVI).

    Codes pytree: ``"codes"`` uint32 ``[..., T, W]`` (:func:`kvjax.primitives.packing.
    pack_codes` words of ``bits``-bit codes), ``"scale"`` and ``"zero"`` ``[..., T,
    ceil(D / group)]``.
    """

    bits: int
    group: int

    def arrays(self, codes: Codes) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(codes [..., T, W], scale [..., T, n], zero [..., T, n])``."""
        return codes["codes"], codes["scale"], codes["zero"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RotatedKeyFormat(KernelFormat):
    """Keys stored rotated (:mod:`kvjax.codecs.rotated`): a stored vector is ``|x| R^T
    y`` with ``R`` the randomized Walsh-Hadamard rotation of ``params["signs"]`` and the
    unit vector ``y`` coded as the subclass says, so a kernel rotates the query once and
    scores ``|x| (R q) . y`` without un-rotating a key.

    Codes pytree: ``"codes"`` (the subclass's layout), ``"norm"`` float16 ``[..., T, 1]``;
    with ``qjl`` also ``"qjl"`` uint32 ``[..., T, D / 32]`` (1-bit planar signs of ``G
    r``) and ``"residual_norm"`` float16 ``[..., T, 1]``, and ``params["sketch"]`` is
    ``G``: the score of a query ``q`` adds ``sqrt(pi / 2) / D * |r| * <G q, sign(G r)>``.
    """

    qjl: bool

    def arrays(self, codes: Codes) -> tuple[jax.Array, ...]:
        """``(codes, norm [..., T])`` and with QJL ``(qjl [..., T, D / 32],
        residual_norm [..., T])`` after them."""
        out = (codes["codes"], codes["norm"][..., 0])
        if self.qjl:
            out += (codes["qjl"], codes["residual_norm"][..., 0])
        return out

    def options(self, head_dim: int) -> dict[str, Any]:
        """The static keyword arguments a kernel's entry needs to read these keys (their
        widths and codebooks, as hashable numbers)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodebookFormat(RotatedKeyFormat):
    """Rotated scalar-codebook keys (TurboQuant): every coordinate of ``y`` is read from a
    symmetric codebook by a ``bits``-bit sign-magnitude code (top bit the sign, the rest
    the rank of the magnitude); ``"codes"`` is uint32 ``[..., T, W]``
    (:func:`kvjax.primitives.packing.pack_codes` words). ``magnitudes(head_dim, bits)``
    gives the codebook's ``2^(bits-1)`` magnitudes, ascending.
    """

    bits: int
    magnitudes: Callable[[int, int], tuple[float, ...]]

    def options(self, head_dim: int) -> dict[str, Any]:
        """``key_bits`` and ``magnitudes``."""
        return {"key_bits": self.bits, "magnitudes": self.magnitudes(head_dim, self.bits)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseFormat(KernelFormat):
    """Vectors stored as they are, in ``dtype``; ``values(codes) -> [..., T, D]`` gives
    them back without a copy."""

    dtype: Any
    values: Callable[[Codes], jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolarFormat(RotatedKeyFormat):
    """Rotated PolarQuant keys at full depth: ``y`` is the unit vector of ``D - 1`` polar
    angles (``bits + 1``-bit codes at level 1, ``bits - 1`` deeper), ``"angles"`` uint32
    ``[..., T, D * bits / 32]`` holds each angle's code at a fixed bit offset, and
    ``"norm"`` is float16 ``[..., T, 1]``. ``centroids(head_dim)`` gives every level's
    centroids (level 1 first), ``offsets(head_dim)`` each angle's bit offset in level
    order (-1: a level of no bits), or None where the codes are one dense byte stream
    that no kernel reads."""

    bits: int
    centroids: Callable[[int], tuple[tuple[float, ...], ...]]
    offsets: Callable[[int], tuple[int, ...] | None]

    def arrays(self, codes: Codes) -> tuple[jax.Array, ...]:
        """``(angles [..., T, W], norm [..., T])``."""
        return codes["angles"], codes["norm"][..., 0]

    def options(self, head_dim: int) -> dict[str, Any]:
        """``angle_bits``, ``centroids`` and ``offsets``."""
        return {"angle_bits": self.bits, "centroids": self.centroids(head_dim),
                "offsets": self.offsets(head_dim)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OctopusFormat(RotatedKeyFormat):
    """Rotated OCTOPUS keys: ``y`` is cut into triplets, each ``rho m(xi, eta)`` with ``m``
    the normalized octahedral lift of two ``direction_bits`` coordinates and ``rho`` a
    ``norm_bits`` norm level (:mod:`kvjax.codecs.octopus`); ``"codes"`` is uint8 ``[...,
    T, bytes]``. ``layout(head_dim, direction_bits, norm_bits)`` says where each code
    lies (:func:`kvjax.codecs.octopus.byte_layout`), or None where the codes are one
    dense stream that no kernel reads; ``magnitudes(direction_bits)`` gives the
    coordinates' symmetric codebook as its magnitudes, ascending (a sign-magnitude code
    ranks them), and ``norms(head_dim, norm_bits)`` the norm levels."""

    direction_bits: int
    norm_bits: int
    layout: Callable[[int, int, int], Any]
    magnitudes: Callable[[int], tuple[float, ...]]
    norms: Callable[[int, int], tuple[float, ...]]

    def options(self, head_dim: int) -> dict[str, Any]:
        """``direction_bits``, ``magnitudes``, ``norms`` and ``layout``."""
        return {"direction_bits": self.direction_bits,
                "magnitudes": self.magnitudes(self.direction_bits),
                "norms": self.norms(head_dim, self.norm_bits),
                "layout": self.layout(head_dim, self.direction_bits, self.norm_bits)}


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


# -- bit accounting shared by codecs ------------------------------------------------


def fp16_scale_bits(head_dim: int, count: int = 1) -> float:
    """Bits per element of ``count`` fp16 numbers stored per vector of ``head_dim``."""
    return 16.0 * count / head_dim


def packed_words(num_codes: int, bits: int) -> int:
    """uint32 words that hold ``num_codes`` codes of ``bits`` bits packed densely."""
    return math.ceil(num_codes * bits / 32)
