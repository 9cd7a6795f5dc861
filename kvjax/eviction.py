"""Token eviction, composed with any codec: keep a budget of a prompt's tokens, encode those.

Quantization shrinks every token; eviction drops whole tokens. A cache spec's
``evict=`` clause does both: ``int:4 evict=snapkv:25%`` keeps a quarter of each
prompt's tokens per (layer, kv head) and stores them as ``int:4`` codes. The policies::

    streaming:B[,sN]    StreamingLLM: the first N tokens (attention sinks, default 4)
                        and the most recent B - N.
    h2o:B[,rR]          H2O: the R most recent tokens (default: half the budget) and the
                        others with the most attention accumulated from every prompt
                        query ("heavy hitters").
    snapkv:B[,wW,pP]    SnapKV: the last W prompt tokens (default 32) are an observation
                        window whose attention, max-pooled over P neighbours (default 7),
                        votes for the other tokens; the window and the top voted are kept.
    all                 keeps every token: the same exact prefill, then the codec alone
                        (quantization under the protocol of the others, for comparison).

``B`` is a token count (``512``) or a share of each prompt (``25%``). A budget the prompt
fits in keeps every token.

How it runs (:func:`kvjax.cache.evict_into`): the prompt is prefilled exactly (a bf16
cache, full attention); the policy picks, per layer and kv head, the positions to keep
(the same number in every head, so a row keeps one length); only those tokens are
appended to the cache the spec describes, so an evicted token is never encoded (evict,
then quantize). The kept keys carry the rotary embedding of their original positions and
the cache counts each row's evicted tokens (``KVCache.evicted``), so the tokens after
the prompt sit at their true positions. Those tokens are stored without eviction: the
budget bounds the prompt, as in SnapKV's setting (the prompt is long, the answer short).
H2O is thus its one-shot form over the prompt's queries; its running form, which evicts
again at every generated token, is not implemented.

Everything here is pure and jit-compatible over arrays: :func:`attention_mass` scores
keys from queries, :meth:`Eviction.select` turns scores into kept positions.
"""

from __future__ import annotations

import dataclasses
import decimal
import math
import re

import jax
import jax.numpy as jnp

#: the policies of the ``evict=`` clause
POLICIES = ("streaming", "h2o", "snapkv", "all")
#: the options each policy takes: letter -> (field, default)
_OPTIONS = {
    "streaming": {"s": ("sinks", 4)},
    "h2o": {"r": ("recent", None)},
    "snapkv": {"w": ("window", 32), "p": ("pool", 7)},
    "all": {},
}
#: queries scored against the keys at once in :func:`attention_mass` (bounds its memory)
QUERY_BLOCK = 256


class EvictionSpecError(ValueError):
    """An ``evict=`` clause that does not parse."""


#: the most tokens any count of a cache spec may name (a window, sinks, a page, an
#: eviction budget or option): positions are int32 on the device, and sums of such
#: counts must not wrap
MAX_TOKENS = 2**30


@dataclasses.dataclass(frozen=True)
class Eviction:
    """A parsed ``evict=`` clause (:func:`parse_eviction`).

    Attributes:
        policy: one of :data:`POLICIES`.
        budget: kept tokens per row, or 0 where ``share`` is given.
        share: kept share of each prompt (0 < share <= 1), or 0.
        sinks: streaming's first tokens always kept.
        recent: h2o's most recent tokens always kept (None: half of the row's budget).
        window: snapkv's observation window (the last prompt tokens, always kept).
        pool: snapkv's max-pooling width over positions (odd).
    """

    policy: str
    budget: int = 0
    share: float = 0.0
    sinks: int = 4
    recent: int | None = None
    window: int = 32
    pool: int = 7

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise EvictionSpecError(f"unknown eviction policy '{self.policy}'; valid: "
                                    f"{', '.join(POLICIES)}")
        if self.policy == "all" and (self.budget or self.share != 1):
            raise EvictionSpecError("evict=all keeps every token and takes no budget")
        if (self.budget > 0) == (self.share > 0):
            raise EvictionSpecError("give the budget as tokens or as a share, one of them")
        if self.budget < 0 or not 0 <= self.share <= 1:
            raise EvictionSpecError(f"budget {self.budget} / share {self.share} out of range")
        for name in ("budget", "sinks", "recent", "window", "pool"):
            value = getattr(self, name)
            if value is not None and value > MAX_TOKENS:
                raise EvictionSpecError(f"the {name} of {value} tokens is past the most a "
                                        f"cache spec names, {MAX_TOKENS} (2**30)")
        if self.pool < 1 or self.pool % 2 == 0:
            raise EvictionSpecError(f"snapkv's pooling width must be odd, got {self.pool}")
        if self.window < 1:
            raise EvictionSpecError("snapkv's observation window needs at least one token")

    @property
    def spec(self) -> str:
        """The canonical clause value: ``parse_eviction(e.spec) == e``."""
        if self.policy == "all":
            return "all"
        size = f"{self.budget}" if self.budget else f"{_percent(self.share)}%"
        opts = []
        for letter, (field, default) in _OPTIONS[self.policy].items():
            value = getattr(self, field)
            if value != default:
                opts.append(f"{letter}{value}")
        return f"{self.policy}:{','.join([size, *opts])}"

    def capacity(self, prompt_len: int) -> int:
        """The most tokens a prompt of ``prompt_len`` tokens keeps (static)."""
        if self.budget:
            return min(self.budget, prompt_len)
        return min(prompt_len, math.ceil(self.share * prompt_len))

    def kept(self, lengths: jax.Array) -> jax.Array:
        """Per row: the tokens a prompt of ``lengths[B]`` tokens keeps."""
        lengths = jnp.asarray(lengths, jnp.int32)
        if self.budget:
            return jnp.minimum(lengths, self.budget)
        # the ceiling of share * length, in integers where the share is a whole percent,
        # and at least one token (as capacity() says) however small the share
        share = jnp.float32(self.share)
        kept = jnp.maximum(jnp.ceil(share * lengths - 1e-4).astype(jnp.int32), 1)
        return jnp.minimum(lengths, kept)

    @property
    def observes(self) -> bool:
        """Whether the policy needs the prompt queries' attention (:func:`attention_mass`)."""
        return self.policy in ("h2o", "snapkv")

    def query_weights(self, positions: jax.Array, lengths: jax.Array) -> jax.Array:
        """``[B, T]`` float32 weight of each query (at ``positions[B, T]`` of prompts of
        ``lengths[B]`` tokens) in the attention mass that scores the keys: every prompt
        query for h2o, the observation window's for snapkv."""
        inside = positions < lengths[:, None]
        if self.policy == "snapkv":
            inside = inside & (positions >= lengths[:, None] - self.window)
        return inside.astype(jnp.float32)

    def select(self, mass: jax.Array, lengths: jax.Array, capacity: int) -> jax.Array:
        """The positions kept per (row, kv head): ``int32[B, K, capacity]`` ascending;
        each row's first ``kept(lengths)`` entries are real, the rest equal ``S``.

        ``mass``: ``[B, K, S]`` attention mass of each of the ``S`` positions
        (:func:`attention_mass` summed over the prompt; streaming reads only its shape).
        ``capacity``: :meth:`capacity` of the prompts' padded length.
        """
        num_positions = mass.shape[-1]
        pos = jnp.arange(num_positions, dtype=jnp.int32)[None, None, :]
        n = jnp.asarray(lengths, jnp.int32)[:, None, None]
        kept = self.kept(lengths)[:, None, None]
        # priorities in tiers: kept outright in [2, 3), ranked in [0, 1], never below 0
        recency = pos.astype(jnp.float32) / num_positions
        if self.policy in ("streaming", "all"):  # all: the budget holds every token
            forced = pos < self.sinks
            ranked = recency
            tier = 2.5 - recency / 2  # the first sinks first, if the budget is smaller
        else:
            if self.policy == "h2o":
                recent = kept // 2 if self.recent is None else jnp.minimum(self.recent, kept)
                ranked = mass
            else:
                recent = jnp.int32(self.window)
                ranked = jax.lax.reduce_window(
                    mass.astype(jnp.float32), -jnp.inf, jax.lax.max, (1, 1, self.pool),
                    (1, 1, 1), "SAME")
            forced = pos >= n - recent
            peak = jnp.max(ranked, axis=-1, keepdims=True)
            ranked = ranked / jnp.maximum(peak, jnp.finfo(jnp.float32).tiny)
            tier = 2.0 + recency  # the most recent first, if the budget is smaller
        priority = jnp.where(forced, tier, ranked)
        priority = jnp.broadcast_to(jnp.where(pos < n, priority, -1.0), mass.shape)
        _, top = jax.lax.top_k(priority, capacity)
        rank = jnp.arange(capacity, dtype=jnp.int32)[None, None, :]
        top = jnp.where(rank < kept, top, num_positions)
        return jnp.sort(top, axis=-1).astype(jnp.int32)


def attention_mass(q: jax.Array, keys: jax.Array, q_positions: jax.Array,
                   key_lengths: jax.Array, weights: jax.Array, scale: float) -> jax.Array:
    """``[B, K, S]`` float32: per key position, the causal softmax attention it receives
    from the queries, summed over queries weighted by ``weights`` and over the query
    heads that share its kv head.

    ``q[B, T, N, D]`` at positions ``q_positions[B, T]``; ``keys[B, K, S, D]`` at
    positions ``0 .. S - 1``, the first ``key_lengths[B]`` stored; ``weights[B, T]``
    (:meth:`Eviction.query_weights`); ``scale`` the logit scale. Queries are scored
    :data:`QUERY_BLOCK` at a time, so memory stays ``[B, N, QUERY_BLOCK, S]``, and a
    block whose weights are all zero costs nothing.
    """
    batch, num_tokens, num_heads, head_dim = q.shape
    heads, num_positions = keys.shape[1], keys.shape[2]
    group = num_heads // heads
    block = min(QUERY_BLOCK, num_tokens)
    pad = -num_tokens % block
    q = jnp.pad(q.astype(jnp.float32) * scale, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q_positions = jnp.pad(q_positions, ((0, 0), (0, pad)))
    weights = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, pad)))
    blocks = (num_tokens + pad) // block

    def split(a):  # [B, T, ...] -> [blocks, B, block, ...]
        return jnp.moveaxis(a.reshape(batch, blocks, block, *a.shape[2:]), 1, 0)

    keys = keys.astype(jnp.float32)
    key_pos = jnp.arange(num_positions, dtype=jnp.int32)

    def scored(qb, pb, wb):
        qb = qb.reshape(batch, block, heads, group, head_dim)
        scores = jnp.einsum("btkgd,bksd->bkgts", qb, keys,
                            precision=jax.lax.Precision.HIGHEST)
        visible = ((key_pos[None, None, :] <= pb[:, :, None])
                   & (key_pos[None, None, :] < key_lengths[:, None, None]))  # [B, t, S]
        visible = visible[:, None, None]
        logits = jnp.where(visible, scores, -jnp.inf)
        peak = jnp.max(logits, axis=-1, keepdims=True)
        p = jnp.where(visible, jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0)), 0)
        p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
        return jnp.einsum("bkgts,bt->bks", p, wb)

    def one(total, inputs):
        # a block of queries that all weigh nothing (SnapKV's, before its window) is skipped
        mass = jax.lax.cond(jnp.any(inputs[2] != 0), scored,
                            lambda *_: jnp.zeros_like(total), *inputs)
        return total + mass, None

    zero = jnp.zeros((batch, heads, num_positions), jnp.float32)
    total, _ = jax.lax.scan(one, zero, (split(q), split(q_positions), split(weights)))
    return total


def _percent(share: float) -> str:
    """The shortest percentage that parses back to ``share`` exactly."""
    for digits in range(1, 18):
        # written out in full: 50, not 5e+01
        text = f"{decimal.Decimal(f'{share * 100:.{digits}g}'):f}"
        if _share_of(text) == share:
            return text
    # the share's own shortest decimal, a hundred times: exact in decimal arithmetic
    return f"{decimal.Decimal(repr(share)).scaleb(2).normalize():f}"


def _share_of(percent: str) -> float:
    """``percent`` / 100, rounded once (decimal arithmetic), so every share printed by
    :func:`_percent` parses back to itself."""
    if not re.fullmatch(r"(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", percent, re.ASCII):
        raise ValueError(percent)  # float() and Decimal() take underscores and blanks
    return float(decimal.Decimal(percent).scaleb(-2))


def parse_eviction(text: str) -> Eviction:
    """An :class:`Eviction` from a clause value such as ``snapkv:25%,w64``."""
    name, colon, rest = text.strip().partition(":")
    if name not in POLICIES:
        raise EvictionSpecError(f"unknown eviction policy '{name}' in '{text}'; valid: "
                                f"{', '.join(POLICIES)}")
    if name == "all":
        if colon:
            raise EvictionSpecError(f"'{text}': evict=all keeps every token and takes "
                                    "no budget or option")
        return Eviction(policy="all", share=1.0)
    if not colon or not rest:
        raise EvictionSpecError(f"'{text}': give a budget, e.g. {name}:512 or {name}:25%")
    size, *opts = rest.split(",")
    fields: dict = {}
    try:
        if size.endswith("%"):
            fields["share"] = _share_of(size[:-1])
            if not 0 < fields["share"] <= 1:
                raise ValueError
        else:
            if not (size.isascii() and size.isdigit()) or int(size) < 1:
                raise ValueError
            fields["budget"] = int(size)
    except (ValueError, decimal.InvalidOperation):
        raise EvictionSpecError(f"'{text}': the budget is a positive token count or a "
                                "share in (0, 100]%") from None
    allowed = _OPTIONS[name]
    for opt in opts:
        letter, digits = opt[:1], opt[1:]
        if letter not in allowed or not (digits.isascii() and digits.isdigit()):
            usage = ", ".join(f"{k}N ({f})" for k, (f, _) in allowed.items())
            raise EvictionSpecError(f"'{text}': bad option '{opt}'; {name} takes {usage}")
        field = allowed[letter][0]
        if field in fields:
            raise EvictionSpecError(f"'{text}': option '{letter}' is given twice")
        fields[field] = int(digits)
    return Eviction(policy=name, **fields)


__all__ = ["MAX_TOKENS", "POLICIES", "QUERY_BLOCK", "Eviction", "EvictionSpecError",
           "attention_mass", "parse_eviction"]
