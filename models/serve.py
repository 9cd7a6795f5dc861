"""A continuous-batching engine: requests join and leave a fixed set of rows while the
others go on, over a paged (or contiguous) kvjax cache.

:class:`Engine` keeps ``rows`` cache rows and two compiled programs, whatever the
requests: a prompt chunk of ``chunk`` tokens for ``prefill_rows`` of the rows
(:func:`_prefill_rows`: those rows taken out of the cache, run, put back; the work of a
step does not grow with the rows) and a decode of ``decode_steps`` tokens for every row
(:func:`_decode_rows`; rows not decoding append nothing). Each :meth:`Engine.step`
admits waiting requests into free rows, feeds one chunk of the oldest prefilling rows'
prompts, then decodes every row whose prompt is in; a row whose request is done is
retired (:func:`kvjax.cache.reset_rows`) and refilled by the next request without
recompiling anything.

Admission is by memory. A paged cache (``page=N``) keeps one pool of pages
(:class:`kvjax.paging.PagePool`): a request is admitted when a row is free and the pool
has every page its prompt and its ``max_new_tokens`` can fill, all reserved at once, so
a running request never runs out of pages and nothing is ever written over (no
preemption is needed); requests wait in arrival order. A contiguous cache gives every
row ``max_len`` slots: admission is by rows alone.

A request's tokens do not depend on what shares the batch: rows never mix, its prompt
goes in ``chunk``-token pieces from its first token (as :func:`models.generate.generate`
with ``prefill_chunk=chunk`` feeds it), and sampling draws from the request's own key
(its ``seed``) folded with the index of the token. Greedy requests get the tokens
``generate`` gives them alone with the same chunk.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache, put_rows, reset_rows, row_pages, take_rows, with_pages
from kvjax.paging import OutOfPagesError, PagePool
from kvjax.spec import CacheConfig
from models.config import ModelConfig
from models.generate import (
    TRACE_COUNTS,
    _choose,
    _compiled,
    _last_logits,
    _placed,
    _stop_tokens,
    _validate_sampling,
    token_log_prob,
)
from models.llama import Params, cache_shape, hidden_states, lm_logits, new_cache

#: stop tokens a request may name (a fixed width: one compiled decode for all requests)
MAX_STOP = 8
#: prompt tokens a step feeds at most by default (``prefill_rows`` rows of a chunk):
#: the prefill's work per step, which the decoding rows wait for
PREFILL_TOKENS = 1024


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation: ``prompt`` token ids, up to ``max_new_tokens`` new ones, greedy
    at ``temperature`` 0 else nucleus sampling (``top_p``) from ``seed``; generation
    stops at any of ``stop`` (default: the model's end-of-sequence tokens; ``()``:
    none), which is not returned."""

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: Sequence[int] | None = None
    seed: int = 0


@dataclasses.dataclass
class Completion:
    """A request's outcome and timeline (seconds of the engine's clock).

    ``reason``: ``"stop"`` (a stop token came, not included) or ``"length"``
    (``max_new_tokens`` reached). ``token_times[i]``: when token ``i`` reached the
    caller; the time to first token is ``token_times[0] - submitted``.
    ``log_probs[i]``: token ``i``'s log-probability under the model (before temperature
    and top-p), as :func:`models.generate.generate` records it."""

    id: int
    request: Request
    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    reason: str | None = None
    submitted: float = 0.0
    admitted: float | None = None
    finished: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.reason is not None


@dataclasses.dataclass(frozen=True)
class Event:
    """What :meth:`Engine.step` reports: a new ``token`` of request ``id`` and its
    ``log_prob`` (both None when the event only says the request is ``done``)."""

    id: int
    token: int | None
    done: bool
    log_prob: float | None = None


@dataclasses.dataclass
class _Row:
    id: int
    prompt: np.ndarray
    fed: int = 0  # prompt tokens in the cache
    pages: list[int] = dataclasses.field(default_factory=list)
    #: prompt pages whose prefix is registered for sharing, and the key of the last
    registered: int = 0
    key: str = ""

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


@dataclasses.dataclass
class _Prefix:
    """A registered prompt prefix of whole pages: its last page (its parent holds the
    ones before), held by the registry so that it outlives the request that wrote it."""

    page: int
    parent: str
    children: int = 0
    used: int = 0


def _prefix_key(parent: str, tokens: np.ndarray) -> str:
    return hashlib.sha256(parent.encode() + np.asarray(tokens, np.int64).tobytes()).hexdigest()


def _decode_rows(params, config, steps, logits, cache, live, emitted, budget, stop, keys,
                 temperature, top_p):
    """``steps`` decode steps of every ``live`` row: choose a token from its logits
    (argmax at temperature 0, else nucleus sampling with ``fold_in(key, emitted)``),
    record it (and its log-probability) unless it is a stop token, feed it back while the
    row goes on. Returns ``(tokens [B, steps] (-1: none), log_probs [B, steps], logits,
    cache, emitted, live)``."""
    TRACE_COUNTS["engine_decode"] += 1
    batch = logits.shape[0]

    def sample(logits, emitted):
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

        def nucleus():
            pick = jax.vmap(lambda lg, key, t, p: _choose(lg[None], key, t, p, False)[0])
            return pick(logits, jax.vmap(jax.random.fold_in)(keys, emitted), temperature,
                        top_p)

        sampled = jax.lax.cond(jnp.any(temperature > 0), nucleus, lambda: greedy)
        return jnp.where(temperature > 0, sampled, greedy)

    def step(i, state):
        logits, cache, live, emitted, out, logp = state
        tok = sample(logits, emitted)
        stopped = jnp.any(tok[:, None] == stop, axis=-1)
        record = live & ~stopped
        out = out.at[:, i].set(jnp.where(record, tok, -1))
        logp = logp.at[:, i].set(token_log_prob(logits, tok))
        emitted = emitted + record
        feed = record & (emitted < budget)
        h, cache = hidden_states(params, config, tok[:, None], cache, feed.astype(jnp.int32))
        logits = jnp.where(feed[:, None], lm_logits(params, config, h[:, 0]), logits)
        return logits, cache, feed, emitted, out, logp

    out = jnp.full((batch, steps), -1, jnp.int32)
    logp = jnp.zeros((batch, steps), jnp.float32)
    logits, cache, live, emitted, out, logp = jax.lax.fori_loop(
        0, steps, step, (logits, cache, live, emitted, out, logp))
    return out, logp, logits, cache, emitted, live


_decode_rows_jit = jax.jit(_decode_rows, static_argnums=(1, 2), donate_argnums=(3, 4))


def _decode_program(params, config: ModelConfig, steps: int, cache: KVCache):
    """:func:`_decode_rows` compiled for ``cache``'s rows (a cache or its shape), once
    per shape in a process."""
    rows, i32, f32 = cache.batch, jnp.int32, jnp.float32
    args = (params, config, steps, _placed((rows, config.vocab_size), f32), cache,
            _placed((rows,), bool), _placed((rows,), i32), _placed((rows,), i32),
            _placed((rows, MAX_STOP), i32), _placed((rows, 2), jnp.uint32),
            _placed((rows,), f32), _placed((rows,), f32))
    return _compiled("engine_decode", _decode_rows_jit, (config, steps), args, (1, 2))


def _prefill_rows(params, config, tokens, valid, rows, cache):
    """One prompt chunk ``tokens [P, C]`` (``valid [P]`` of them real) of cache rows
    ``rows [P]`` (distinct), the others untouched: the rows taken out, run as a cache of
    ``P`` rows, put back (:func:`kvjax.cache.take_rows`). Returns each of the ``P`` rows'
    next-token logits and the cache."""
    TRACE_COUNTS["engine_prefill"] += 1
    part = take_rows(cache, rows)
    h, part = hidden_states(params, config, tokens, part, valid)
    return _last_logits(params, config, h, valid), put_rows(cache, rows, part)


_prefill_rows_jit = jax.jit(_prefill_rows, static_argnums=(1,), donate_argnums=(5,))


def _prefill_program(params, config: ModelConfig, rows: int, chunk: int, cache: KVCache):
    """:func:`_prefill_rows` of ``rows`` rows of ``chunk`` tokens compiled for ``cache``
    (a cache or its shape), once per shape in a process."""
    i32 = jnp.int32
    args = (params, config, _placed((rows, chunk), i32), _placed((rows,), i32),
            _placed((rows,), i32), cache)
    return _compiled("engine_prefill", _prefill_rows_jit, (config,), args, (1,))


@jax.jit
def _take_logits(logits, fresh, rows, ready):
    """``logits [B, V]`` with rows ``rows [P]`` replaced by ``fresh [P, V]`` where
    ``ready [P]``."""
    return logits.at[rows].set(jnp.where(ready[:, None], fresh, logits[rows]))


class Engine:
    """Continuous batching of :class:`Request` s through ``rows`` rows of a cache of
    ``cache_config`` (``max_len`` tokens a row; a paged config's pool has ``num_pages``
    pages, by default as many as ``rows`` contiguous rows would fill).

    ``chunk``: prompt tokens each prefilling row feeds per step, ``prefill_rows`` rows
    a step (default: as many as make :data:`PREFILL_TOKENS`, at most ``rows``);
    ``decode_steps``:
    tokens each decoding row makes per step (more amortise the host's work per call,
    fewer stream tokens sooner). ``seed`` draws the codec parameters (rotations,
    codebooks) as :func:`models.generate.generate`'s does; ``calibration`` serves a
    spec's ``calib`` clauses. ``clock``: the time source of the completions'
    timelines. Raises ``ValueError`` for a spec the engine cannot serve (``evict=``,
    whose prefill keeps what the whole prompt lets it) and bad arguments."""

    def __init__(self, params: Params, config: ModelConfig, cache_config: CacheConfig, *,
                 rows: int, max_len: int, num_pages: int | None = None, chunk: int = 256,
                 decode_steps: int = 1, cache_dtype: Any = jnp.bfloat16, seed: int = 0,
                 calibration: Any = None, share_prefixes: bool = True,
                 prefill_rows: int | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        for name, value in (("rows", rows), ("max_len", max_len), ("chunk", chunk),
                            ("decode_steps", decode_steps)):
            if not isinstance(value, int | np.integer) or isinstance(value, bool) \
                    or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if cache_config.evict is not None:
            raise ValueError(f"cache spec '{cache_config.spec}' evicts after a whole "
                             "prompt: the engine serves caches without evict=")
        if max_len > config.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds the model's "
                             f"max_position_embeddings={config.max_position_embeddings}")
        if num_pages is not None and not cache_config.page_tokens:
            raise ValueError(f"num_pages={num_pages} given for cache spec "
                             f"'{cache_config.spec}', which is not paged (add page=N)")
        self.params, self.config, self.cache_config = params, config, cache_config
        self.rows, self.max_len, self.chunk = int(rows), int(max_len), int(chunk)
        if prefill_rows is None:
            prefill_rows = min(self.rows, max(1, PREFILL_TOKENS // self.chunk))
        if not isinstance(prefill_rows, int | np.integer) or not 1 <= prefill_rows <= rows:
            raise ValueError(f"prefill_rows must be an int in 1..rows={rows}, got "
                             f"{prefill_rows!r}")
        self.prefill_rows = int(prefill_rows)
        self.decode_steps, self.clock = int(decode_steps), clock
        self.row_pages = row_pages(cache_config, max_len)
        if cache_config.page_tokens:
            num_pages = self.rows * self.row_pages if num_pages is None else num_pages
            self.pool: PagePool | None = PagePool(num_pages)
        else:
            self.pool = None
        made = dict(batch=self.rows, max_len=self.max_len, dtype=cache_dtype,
                    key=jax.random.fold_in(jax.random.PRNGKey(seed), 0),
                    calibration=calibration,
                    num_pages=None if self.pool is None else self.pool.num_pages)
        # both programs compiled before the cache exists, as generate does
        shape = cache_shape(config, cache_config, **made)
        self._prefill = _prefill_program(params, config, self.prefill_rows, self.chunk,
                                         shape)
        self._decode = _decode_program(params, config, self.decode_steps, shape)
        self.cache: KVCache = new_cache(config, cache_config, **made)
        self._tables = np.full((self.rows, self.row_pages), -1, np.int32)
        self._logits = jnp.zeros((self.rows, config.vocab_size), jnp.float32)
        self._slots: list[_Row | None] = [None] * self.rows
        self._emitted = np.zeros(self.rows, np.int32)
        self._budget = np.zeros(self.rows, np.int32)
        self._stop = np.full((self.rows, MAX_STOP), -1, np.int32)
        self._keys = np.zeros((self.rows, 2), np.uint32)
        self._temperature = np.zeros(self.rows, np.float32)
        self._top_p = np.ones(self.rows, np.float32)
        self._waiting: collections.deque[int] = collections.deque()
        self.completions: dict[int, Completion] = {}
        self._ids = itertools.count()
        self.sharing = bool(share_prefixes) and self.pool is not None and not (
            cache_config.sink_tokens or cache_config.residual_window
            or "first" in (cache_config.center, cache_config.smooth))
        self._prefixes: dict[str, _Prefix] = {}
        self._uses = itertools.count(1)
        #: prompt tokens the prefill program fed, and those shared pages spared it
        self.prefilled_tokens = 0
        self.shared_tokens = 0

    # -- requests --------------------------------------------------------------------

    def pages_needed(self, request: Request) -> int:
        """Pool pages a request holds while it runs (0 for a contiguous cache): those
        its prompt and all its new tokens but the last fill with codes."""
        if self.pool is None:
            return 0
        return row_pages(self.cache_config, len(request.prompt) + request.max_new_tokens - 1)

    def submit(self, request: Request, at: float | None = None) -> int:
        """Queue ``request`` (``at``: when it arrived, on :attr:`clock`; default: now);
        returns its id. Raises ``ValueError`` for a request that
        no row could hold (a bad prompt, too long for ``max_len``, too many stop
        tokens, bad sampling values) and :class:`kvjax.paging.OutOfPagesError` for one
        needing more pages than the whole pool has."""
        prompt = np.asarray(list(request.prompt), dtype=np.int64)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError("a request's prompt must be a non-empty sequence of token ids")
        if prompt.min() < 0 or prompt.max() >= self.config.vocab_size:
            raise ValueError(f"prompt token ids must lie in 0..{self.config.vocab_size - 1}")
        _validate_sampling(request.max_new_tokens, request.temperature, request.top_p)
        if len(prompt) + request.max_new_tokens - 1 > self.max_len:
            raise ValueError(f"{len(prompt)} prompt tokens + {request.max_new_tokens} new "
                             f"need {len(prompt) + request.max_new_tokens - 1} slots; a row "
                             f"holds {self.max_len}")
        if len(self._stop_tokens(request)) > MAX_STOP:
            raise ValueError(f"a request names at most {MAX_STOP} stop tokens, got "
                             f"{len(self._stop_tokens(request))}")
        if self.pool is not None and self.pages_needed(request) > self.pool.num_pages:
            raise OutOfPagesError(self.pages_needed(request), self.pool.free,
                                  self.pool.num_pages)
        rid = next(self._ids)
        self.completions[rid] = Completion(id=rid, request=request,
                                           submitted=self.clock() if at is None else at)
        self._waiting.append(rid)
        return rid

    def _stop_tokens(self, request: Request) -> tuple[int, ...]:
        return _stop_tokens(self.config, request.stop)

    # -- state ----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests queued, not yet in a row."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests in a row (prefilling or decoding)."""
        return sum(slot is not None for slot in self._slots)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self.running

    @property
    def pages_used(self) -> int:
        """Pool pages held by running requests or kept for their prompt prefixes (0
        for a contiguous cache)."""
        return 0 if self.pool is None else self.pool.used

    @property
    def cached_pages(self) -> int:
        """Pages of registered prompt prefixes, kept for later requests to share."""
        return len(self._prefixes)

    # -- stepping -------------------------------------------------------------------

    def _shared_prefix(self, prompt: np.ndarray) -> tuple[list[int], list[str]]:
        """The pages (and their keys) of the longest registered prefix of ``prompt`` that
        leaves at least one token to feed and ends where a chunk would (so the rest is
        fed in the chunks the request alone would be fed in)."""
        page = self.cache_config.page_tokens
        pages, keys, key = [], [], ""
        for k in range(1, (len(prompt) - 1) // page + 1):
            key = _prefix_key(key, prompt[(k - 1) * page:k * page])
            if key not in self._prefixes:
                break
            pages.append(self._prefixes[key].page)
            keys.append(key)
        while pages and (len(pages) * page) % self.chunk:
            pages.pop()
            keys.pop()
        return pages, keys

    def _evict_prefixes(self, needed: int, keep: set[str]) -> None:
        """Drop registered prefixes, least recently used leaves first, until ``needed``
        pages are free or none is left to drop (``keep``: prefixes about to be used)."""
        while self.pool.free < needed:
            leaves = [(p.used, key) for key, p in self._prefixes.items()
                      if not p.children and key not in keep]
            if not leaves:
                return
            _, key = min(leaves)
            prefix = self._prefixes.pop(key)
            if prefix.parent:
                self._prefixes[prefix.parent].children -= 1
            self.pool.release([prefix.page])

    def _register(self, row: _Row) -> None:
        """Register the whole prompt pages the row has fed (its shared ones are)."""
        page = self.cache_config.page_tokens
        while (row.registered + 1) * page <= row.fed:
            if row.key and row.key not in self._prefixes:
                return  # its prefix was dropped for room: the chain ends there
            k = row.registered
            key = _prefix_key(row.key, row.prompt[k * page:(k + 1) * page])
            if key in self._prefixes:
                self._prefixes[key].used = next(self._uses)
            else:
                self.pool.share([row.pages[k]])
                self._prefixes[key] = _Prefix(page=row.pages[k], parent=row.key,
                                              used=next(self._uses))
                if row.key:
                    self._prefixes[row.key].children += 1
            row.registered, row.key = k + 1, key

    def _admit(self) -> tuple[np.ndarray, np.ndarray]:
        admitted = np.zeros(self.rows, bool)
        starts = np.zeros(self.rows, np.int32)
        now = self.clock()
        while self._waiting:
            free = [r for r, slot in enumerate(self._slots) if slot is None]
            if not free:
                break
            rid = self._waiting[0]
            request = self.completions[rid].request
            prompt = np.asarray(list(request.prompt), np.int32)
            pages: list[int] = []
            shared, keys = [], []
            if self.pool is not None:
                if self.sharing:
                    shared, keys = self._shared_prefix(prompt)
                needed = self.pages_needed(request) - len(shared)
                if self.sharing and needed > self.pool.free:
                    self._evict_prefixes(needed, set(keys))
                if needed > self.pool.free:
                    break  # in arrival order: the first waits for pages, the rest behind it
                self.pool.share(shared)
                pages = shared + self.pool.allocate(needed)
            self._waiting.popleft()
            r = free[0]
            start = len(shared) * (self.cache_config.page_tokens or 0)
            self._slots[r] = _Row(id=rid, prompt=prompt, pages=pages, fed=start,
                                  registered=len(shared), key=keys[-1] if keys else "")
            for key in keys:
                self._prefixes[key].used = next(self._uses)
            self.shared_tokens += start
            starts[r] = start
            self._tables[r] = -1
            self._tables[r, :len(pages)] = pages
            stop = self._stop_tokens(request)
            self._stop[r] = -1
            self._stop[r, :len(stop)] = stop
            self._emitted[r], self._budget[r] = 0, request.max_new_tokens
            self._keys[r] = np.asarray(jax.random.fold_in(jax.random.PRNGKey(request.seed),
                                                          1))
            self._temperature[r], self._top_p[r] = request.temperature, request.top_p
            self.completions[rid].admitted = now
            admitted[r] = True
        return admitted, starts

    def _retire(self, r: int, reason: str, now: float, events: list[Event]) -> None:
        row = self._slots[r]
        done = self.completions[row.id]
        done.reason, done.finished = reason, now
        if self.pool is not None and row.pages:
            self.pool.release(row.pages)
        self._tables[r] = -1
        self._slots[r] = None
        events.append(Event(row.id, None, True))

    def step(self) -> list[Event]:
        """One round: admit, one prompt chunk of every prefilling row, ``decode_steps``
        tokens of every decoding row. Returns the new tokens and finished requests."""
        events: list[Event] = []
        admitted, starts = self._admit()
        if admitted.any():
            self.cache = reset_rows(self.cache, jnp.asarray(admitted), jnp.asarray(starts))
            if self.pool is not None:
                self.cache = with_pages(self.cache, self._tables)
        # the oldest requests' prompts first, ``prefill_rows`` of them a step
        prefilling = sorted((r for r, slot in enumerate(self._slots)
                             if slot is not None and slot.prefilling),
                            key=lambda r: self._slots[r].id)[:self.prefill_rows]
        if prefilling:
            # rows with nothing to feed fill the program's other places (valid 0:
            # they come back as they were)
            idle = [r for r in range(self.rows) if r not in prefilling]
            rows = prefilling + idle[:self.prefill_rows - len(prefilling)]
            tokens = np.zeros((self.prefill_rows, self.chunk), np.int32)
            valid = np.zeros(self.prefill_rows, np.int32)
            for i, r in enumerate(prefilling):
                row = self._slots[r]
                piece = row.prompt[row.fed:row.fed + self.chunk]
                tokens[i, :len(piece)] = piece
                valid[i] = len(piece)
                row.fed += len(piece)
            self.prefilled_tokens += int(valid.sum())
            logits, self.cache = self._prefill(self.params, jnp.asarray(tokens),
                                               jnp.asarray(valid), jnp.asarray(rows, jnp.int32),
                                               self.cache)
            if self.sharing:
                for r in prefilling:
                    self._register(self._slots[r])
            ready = np.array([i < len(prefilling) and not self._slots[r].prefilling
                              for i, r in enumerate(rows)])
            if ready.any():
                self._logits = _take_logits(self._logits, logits,
                                            jnp.asarray(rows, jnp.int32), jnp.asarray(ready))
        decoding = np.array([slot is not None and not slot.prefilling
                             for slot in self._slots])
        if decoding.any():
            out, logp, self._logits, self.cache, emitted, live = self._decode(
                self.params, self._logits, self.cache, *map(jnp.asarray, (
                    decoding, self._emitted, self._budget, self._stop, self._keys,
                    self._temperature, self._top_p)))
            out, logp = np.asarray(out), np.asarray(logp)
            emitted, live = np.asarray(emitted), np.asarray(live)
            now = self.clock()
            for r in np.nonzero(decoding)[0]:
                row = self._slots[r]
                done = self.completions[row.id]
                for tok, lp in zip(out[r], logp[r], strict=True):
                    if tok < 0:
                        break
                    done.tokens.append(int(tok))
                    done.log_probs.append(float(lp))
                    done.token_times.append(now)
                    events.append(Event(row.id, int(tok), False, float(lp)))
                self._emitted[r] = emitted[r]
                if not live[r]:
                    self._retire(r, "length" if emitted[r] >= self._budget[r] else "stop",
                                 now, events)
        return events

    def run(self, requests: Iterable[Request] = (),
            on_event: Callable[[Event], None] | None = None) -> list[Completion]:
        """Submit ``requests`` and step until every request is done; returns their
        completions in submission order (``on_event`` sees each event as it comes)."""
        ids = [self.submit(request) for request in requests]
        while not self.idle:
            for event in self.step():
                if on_event is not None:
                    on_event(event)
        return [self.completions[rid] for rid in ids]
