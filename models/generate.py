"""Batched generation: one jitted prefill, one jitted ``lax.while_loop`` decode.

The prompts are right-padded to the longest one and prefilled in a single call; each
row's next-token logits are taken at its own last prompt token. The decode loop then
runs entirely on device with the cache donated, one token per row per step; a row that
emitted an end-of-sequence token stops appending to its cache (its ``valid`` count drops
to 0) while the others go on.

Compilation is done ahead of time and kept in a module-level table keyed by every
static input (config, shapes, dtypes, cache structure, greedy or not), so the reported
``prefill_s`` / ``decode_s`` exclude compilation (reported as ``compile_s``) and two
calls with the same shapes compile once. ``TRACE_COUNTS`` counts how often each jitted
function was traced (a Python side effect in the traced code; tests read it).

A batch that does not fit in device memory (XLA's ``RESOURCE_EXHAUSTED``, while the cache
is allocated or the prefill or decode program is compiled or run) raises
:class:`OutOfMemoryError`: one line naming the program, the batch and context, the bytes
it needed and the bytes free on the device, and what to try instead.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from kvjax.cache import KVCache, check, evict_into, memory_bytes
from kvjax.checkpoint import CheckpointError, disk_bytes, load_cache, save_cache
from kvjax.sharding import (
    ROWS_HEADS,
    check_split,
    place_cache,
    sharded_evict_into,
    sharded_zeros,
)
from kvjax.spec import CacheConfig
from models.config import ModelConfig
from models.llama import (
    Params,
    attention_observer,
    cache_shape,
    forward,
    hidden_states,
    lm_logits,
    new_cache,
    shard_params,
)

#: how many times the prefill / decode functions were traced (for compile-once tests)
TRACE_COUNTS: collections.Counter[str] = collections.Counter()

_COMPILED: dict[Any, Any] = {}

#: the padded prompt width is rounded up to a multiple of this (capped at the capacity)
PREFILL_BUCKET = 16


@dataclasses.dataclass
class GenerateResult:
    """What :func:`generate` returns.

    Attributes:
        tokens: the new tokens of every prompt; a row ends *before* its first EOS token
            (EOS is excluded) or after ``max_new_tokens``.
        prefill_s, decode_s: wall seconds of the prefill and of the decode loop,
            compilation excluded.
        compile_s: seconds spent tracing and compiling (0 when both were cached), the sum
            of ``prefill_compile_s`` and ``decode_compile_s`` (each program's).
        decode_tok_per_s: new tokens of all rows per decode second (the loop samples the
            first one from the prefill logits and runs every forward after it).
        cache_bytes: :func:`kvjax.cache.memory_bytes` of the final cache.
        cache: the final cache (prompts + generated tokens, EOS tokens not stored).
        log_probs: per row, float32 ``[len(tokens[i])]``: each new token's
            log-probability under the model's distribution at that step (before
            temperature and top-p), as the decode loop saw it through the cache.
    """

    tokens: list[list[int]]
    prefill_s: float
    decode_s: float
    compile_s: float
    decode_tok_per_s: float
    cache_bytes: int
    cache: KVCache
    prefill_compile_s: float = 0.0
    decode_compile_s: float = 0.0
    log_probs: list[np.ndarray] = dataclasses.field(default_factory=list)


def _last_logits(params, config, h, valid):
    last = jnp.take_along_axis(h, jnp.maximum(valid - 1, 0)[:, None, None], axis=1)[:, 0]
    return lm_logits(params, config, last)


def _prefill(params, config, mesh, tokens, valid, cache):
    TRACE_COUNTS["prefill"] += 1
    h, cache = hidden_states(params, config, tokens, cache, valid, mesh=mesh)
    return _last_logits(params, config, h, valid), cache


def _observed_prefill(params, config, mesh, tokens, valid, cache, weights, mass):
    TRACE_COUNTS["prefill"] += 1
    h, cache, mass = hidden_states(params, config, tokens, cache, valid,
                                   observe=(attention_observer(config, weights), mass),
                                   mesh=mesh)
    return _last_logits(params, config, h, valid), cache, mass


def token_log_prob(logits: jax.Array, tok: jax.Array) -> jax.Array:
    """Each row's log-probability of ``tok [B]`` under ``logits [B, V]``: the model's own
    distribution, before temperature and top-p; one reduction over the vocabulary, no
    ``[B, V]`` array of log-probabilities."""
    chosen = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0]
    return chosen - jax.nn.logsumexp(logits, axis=-1)


def _choose(logits, key, temperature, top_p, greedy: bool):
    """Next tokens ``[B]`` from logits ``[B, V]``: argmax, or nucleus sampling."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # a floor keeps tiny temperatures from overflowing the scaled logits to inf
    logits = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # a token stays if the mass strictly before it is below top_p, so the most likely
    # token always stays and the kept set is the smallest one reaching top_p
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = (before < top_p) | (top_p >= 1.0)  # rounding must not trim the tail at 1
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    pick = jax.random.categorical(key, sorted_logits, axis=-1)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


#: decode steps between checks whether every row is done: XLA stops a GPU stream to read
#: a while loop's data-dependent condition on the host, and the next step's ~1000 kernel
#: launches then run exposed instead of ahead of the GPU (B=1 with a 4k cache: 8.5 ms
#: per step checking every step against 6.2 in a loop of known length); a block of
#: steps is a loop of known length
CHECK_EVERY = 8


def _decode(params, config, mesh, max_new_tokens, greedy, logits, cache, eos, key,
            temperature, top_p):
    TRACE_COUNTS["decode"] += 1
    batch = logits.shape[0]
    block = min(CHECK_EVERY, max_new_tokens)
    steps = -(-max_new_tokens // block) * block

    def is_eos(tok):
        return jnp.any(tok[:, None] == eos[None, :], axis=-1)

    def cond(state):
        i, _, _, done, _, _ = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def step(_, state):
        i, logits, cache, done, out, logp = state
        tok = _choose(logits, jax.random.fold_in(key, i), temperature, top_p, greedy)
        # steps past max_new_tokens (the last block's padding) feed nothing back, so they
        # write nothing to the cache; what they record lands past the columns returned
        done_now = done | is_eos(tok)
        out = out.at[:, i].set(jnp.where(done_now, -1, tok))
        logp = logp.at[:, i].set(token_log_prob(logits, tok))
        # the token is fed back only if generation goes on after it; the last step's
        # forward is spent but keeps the loop body uniform
        feed = ~done_now & (i + 1 < max_new_tokens)
        h, cache = hidden_states(params, config, tok[:, None], cache, feed.astype(jnp.int32),
                                 mesh=mesh)
        return i + 1, lm_logits(params, config, h[:, 0]), cache, done_now, out, logp

    def body(state):
        return jax.lax.fori_loop(0, block, step, state)

    out = jnp.full((batch, steps), -1, jnp.int32)
    logp = jnp.zeros((batch, steps), jnp.float32)
    state = (jnp.int32(0), logits, cache, jnp.zeros((batch,), bool), out, logp)
    _, _, cache, _, out, logp = jax.lax.while_loop(cond, body, state)
    return out[:, :max_new_tokens], logp[:, :max_new_tokens], cache


_prefill_jit = jax.jit(_prefill, static_argnums=(1, 2), donate_argnums=5)
_observed_prefill_jit = jax.jit(_observed_prefill, static_argnums=(1, 2),
                                donate_argnums=(5, 7))
_decode_jit = jax.jit(_decode, static_argnums=(1, 2, 3, 4), donate_argnums=6)


def _signature(*trees) -> Any:
    leaves, treedef = jax.tree.flatten(trees)
    # a sharded argument compiles for its layout: the layout is part of the signature
    return treedef, tuple((tuple(np.shape(a)), str(getattr(a, "dtype", type(a))),
                           str(getattr(a, "sharding", None))) for a in leaves)


def _compiled(name, jitted, static, args, static_argnums):
    key = (name, static, _signature(*(a for i, a in enumerate(args) if i not in static_argnums)))
    if key not in _COMPILED:
        _COMPILED[key] = jitted.lower(*args).compile()
    return _COMPILED[key]


def _placed(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    """A small argument's shape, its placement left to the program (as an array made
    without one): always passed as this shape, so its key never changes."""
    return jax.ShapeDtypeStruct(shape, dtype)


def prefill_arguments(params: Params, config: ModelConfig, cache: KVCache, *, chunk: int,
                      mesh: Mesh | None = None) -> tuple:
    """The arguments the prefill program is compiled for: one chunk of ``chunk`` tokens
    of every row of ``cache`` (a cache or :func:`models.llama.cache_shape`'s), the
    tokens and lengths as shapes."""
    i32 = jnp.int32
    return (params, config, mesh, _placed((cache.batch, chunk), i32),
            _placed((cache.batch,), i32), cache)


def prefill_program(params: Params, config: ModelConfig, cache: KVCache, *, chunk: int,
                    mesh: Mesh | None = None):
    """The compiled prefill of one ``chunk``-token piece of every row into ``cache`` (a
    cache or its shape, :func:`models.llama.cache_shape`), called as
    ``program(params, tokens [B, chunk], valid [B], cache) -> (logits, cache)`` with the
    cache donated. Compiled once per shape in a process: the program :func:`prefill`
    runs. Compile it from the cache's shape before the cache exists and XLA's
    compile-time scratch does not compete with the cache for memory."""
    return _compiled("prefill", _prefill_jit, (config, mesh),
                     prefill_arguments(params, config, cache, chunk=chunk, mesh=mesh), (1, 2))


def decode_arguments(params: Params, config: ModelConfig, logits: Any, cache: KVCache, *,
                     max_new_tokens: int, greedy: bool, num_eos: int = 1,
                     mesh: Mesh | None = None) -> tuple:
    """The arguments the decode loop is compiled for, ``logits [B, V]`` and ``cache``
    arrays or shapes, the stop tokens (``num_eos`` of them), the sampling key and the
    sampling parameters as shapes."""
    f32 = jnp.float32
    return (params, config, mesh, max_new_tokens, greedy, logits, cache,
            _placed((max(1, num_eos),), jnp.int32), _placed((2,), jnp.uint32),
            _placed((), f32), _placed((), f32))


def decode_program(params: Params, config: ModelConfig, logits: Any, cache: KVCache, *,
                   max_new_tokens: int, greedy: bool, num_eos: int = 1,
                   mesh: Mesh | None = None):
    """The compiled decode loop of ``max_new_tokens`` steps over ``cache`` (arrays or
    shapes, as :func:`prefill_program`'s), called as ``program(params, logits, cache,
    eos [num_eos], key, temperature, top_p) -> (tokens, cache)``: the program
    :func:`decode` runs, compiled once per shape in a process."""
    return _compiled("decode", _decode_jit, (config, mesh, max_new_tokens, greedy),
                     decode_arguments(params, config, logits, cache,
                                      max_new_tokens=max_new_tokens, greedy=greedy,
                                      num_eos=num_eos, mesh=mesh), (1, 2, 3, 4))


class OutOfMemoryError(MemoryError):
    """A prefill or decode program that did not fit in device memory.

    ``str(err)`` is one line: the program, the batch and context, the bytes it needed,
    the bytes free on the device, and what to try. The same as attributes: ``program``
    (``"prefill"`` or ``"decode"``), ``batch``, ``context`` (the cache's capacity in
    tokens), ``requested`` (the bytes XLA failed to allocate, from its message),
    ``program_bytes`` (the compiled program's ``argument`` / ``output`` / ``alias`` /
    ``temp`` sizes) and ``free`` (bytes free on the device with the least free); each
    None when unknown (a CPU reports no free memory; a program that failed to compile
    has no sizes). The XLA error is the ``__cause__``.
    """

    def __init__(self, message: str, *, program: str, batch: int, context: int,
                 requested: int | None = None, program_bytes: dict[str, int] | None = None,
                 free: int | None = None):
        super().__init__(message)
        self.program, self.batch, self.context = program, batch, context
        self.requested, self.program_bytes, self.free = requested, program_bytes, free


_EXHAUSTED = re.compile(r"\bRESOURCE_EXHAUSTED\b")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SCALED = r"(\d+(?:\.\d+)?)\s*([KMGT])i?B\b"
#: how XLA's allocators word the bytes they could not get, most exact first
_REQUESTED = (
    (re.compile(r"allocat\w*\s+(?:request for\s+)?(\d+)\s*bytes\b"), False),
    (re.compile(r"\((\d+)\s*B\)"), False),  # 'request for 32.35GiB (34735783936B)'
    (re.compile(r"rounded to (\d+)"), False),
    (re.compile(r"allocat\w*\s+(?:request for\s+)?" + _SCALED), True),
    (re.compile(r"(\d+)\s*bytes\b"), False),
    (re.compile(_SCALED), True),
)


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is XLA running out of device memory (a runtime error whose message
    carries ``RESOURCE_EXHAUSTED``: ``jax.errors.JaxRuntimeError``, or jaxlib's
    ``XlaRuntimeError`` in older versions; both are ``RuntimeError``)."""
    return isinstance(err, RuntimeError) and bool(_EXHAUSTED.search(str(err)))


def requested_bytes(message: str) -> int | None:
    """The bytes an XLA out-of-memory message says it could not allocate ('Out of memory
    while trying to allocate 34735783936 bytes', 'Failed to allocate request for 32.35GiB
    (34735783936B)', 'trying to allocate 256.02GiB with allocator GPU_0_bfc': then to
    the precision given), or None when it names none."""
    return _requested(message)[0]


def _requested(message: str) -> tuple[int | None, bool]:
    """:func:`requested_bytes`, and whether the message gave them exactly."""
    for pattern, scaled in _REQUESTED:
        found = pattern.search(message)
        if found is not None:
            if not scaled:
                return int(found.group(1)), True
            return round(float(found.group(1)) * _UNITS[found.group(2)]), False
    return None, False


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def _bytes(n: int) -> str:
    """``n`` bytes, exactly and (from 1 KiB) at a glance."""
    return f"{n} bytes" if abs(n) < 2**10 else f"{n} bytes ({_size(n)})"


def _program_bytes(compiled) -> dict[str, int] | None:
    """A compiled program's argument, output, alias and temp bytes, or None."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # a backend without the analysis, or a stand-in program
        return None
    if isinstance(stats, list | tuple):
        stats = stats[0] if stats else None
    if stats is None:
        return None
    sizes = {}
    for part in ("argument", "output", "alias", "temp"):
        value = getattr(stats, f"{part}_size_in_bytes", None)
        if not isinstance(value, int | np.integer):
            return None
        sizes[part] = int(value)
    return sizes


def free_bytes(devices: Sequence[Any]) -> tuple[int | None, Any]:
    """The bytes free on the device of ``devices`` with the least free (its
    ``memory_stats()``: ``bytes_limit - bytes_in_use``) and that device; ``(None,
    None)`` when any of them does not say (a CPU)."""
    least = None
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # a backend without memory statistics
            stats = None
        if not stats or "bytes_limit" not in stats:
            return None, None
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        if least is None or free < least[0]:
            least = (free, device)
    return least if least is not None else (None, None)


def out_of_memory(err: BaseException, program: str, *, batch: int, context: int,
                  detail: str = "", compiled: Any = None,
                  devices: Sequence[Any] = (),
                  free_at_start: tuple[int | None, Any] | None = None) -> OutOfMemoryError:
    """The :class:`OutOfMemoryError` of XLA's out-of-memory error ``err`` in
    ``program`` (``"prefill"`` or ``"decode"``) at ``batch`` rows and a cache of
    ``context`` tokens: the bytes XLA asked for, the compiled program's sizes when it
    got that far (``compiled``), the bytes free and what to try. The bytes free are
    ``free_at_start`` (:func:`free_bytes` taken when the program was about to run, its
    arguments allocated) where given: after the failure a donated cache is already
    released, and the device's free bytes then would count it as free. Else those of
    ``devices`` now."""
    message = str(err)
    requested, exact = _requested(message)
    sizes = None if compiled is None else _program_bytes(compiled)
    free, device = free_bytes(devices) if free_at_start is None else free_at_start
    when = "" if free_at_start is None else " when the program started"
    parts = [f"{program} does not fit in device memory at batch {batch}, context "
             f"{context} tokens{detail}"]
    if requested is not None:
        parts.append(f"XLA could not allocate "
                     f"{_bytes(requested) if exact else f'about {_size(requested)}'}")
    if sizes is not None:
        beyond = sizes["output"] - sizes["alias"] + sizes["temp"]
        parts.append(f"the program needs {_bytes(beyond)} beyond its "
                     f"arguments (arguments {_size(sizes['argument'])}, outputs "
                     f"{_size(sizes['output'])}, {_size(sizes['alias'])} of them in "
                     f"place, temporaries {_size(sizes['temp'])})")
    if requested is None and sizes is None:
        parts.append("bytes needed: unknown")
    parts.append("free on the device: unknown" if free is None
                 else f"{_bytes(free)} free on {device}{when}")
    chunk = ", a smaller prefill chunk" if program == "prefill" else ""
    parts.append(f"try a smaller batch, a shorter context{chunk} or a more compressed "
                 "cache (e.g. int:4, kivi:2,g32)")
    return OutOfMemoryError(" ".join("; ".join(parts).split()), program=program,
                            batch=batch, context=context, requested=requested,
                            program_bytes=sizes, free=free)


class _MemoryBoundary:
    """``with _MemoryBoundary(...) as boundary:`` turns XLA's out-of-memory errors
    inside into :class:`OutOfMemoryError` (:func:`out_of_memory`); ``boundary.compiled``
    is the program once compiled, for its sizes. Setting it also takes the devices'
    free bytes, with the program's arguments allocated, for the message."""

    def __init__(self, program: str, *, batch: int, context: int, mesh: Mesh | None,
                 detail: str = ""):
        self.program, self.batch, self.context, self.detail = program, batch, context, detail
        self.devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
        self._compiled = None
        self.free_at_start = None

    @property
    def compiled(self):
        return self._compiled

    @compiled.setter
    def compiled(self, program):
        self._compiled = program
        self.free_at_start = free_bytes(self.devices)

    def __enter__(self):
        return self

    def __exit__(self, kind, err, traceback):
        if err is None or not is_out_of_memory(err):
            return False
        raise out_of_memory(err, self.program, batch=self.batch, context=self.context,
                            detail=self.detail, compiled=self.compiled,
                            devices=self.devices, free_at_start=self.free_at_start) from err


def _stop_tokens(config: ModelConfig, eos_token_ids: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(config.eos_token_ids if eos_token_ids is None else eos_token_ids)


def _validate_sampling(max_new_tokens, temperature, top_p):
    if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not (np.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _validate(config, prompts, max_new_tokens, temperature, top_p, max_len):
    _validate_sampling(max_new_tokens, temperature, top_p)
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside 0..{config.vocab_size - 1}: "
                             f"{bad[:5]}")
    need = max(len(p) for p in prompts) + max_new_tokens
    if max_len is None:
        max_len = need
    if need > max_len:
        raise ValueError(f"longest prompt + max_new_tokens = {need} exceeds the cache "
                         f"capacity max_len={max_len}")
    if need > config.max_position_embeddings:
        raise ValueError(f"longest prompt + max_new_tokens = {need} exceeds "
                         f"max_position_embeddings={config.max_position_embeddings}")
    return max_len


@dataclasses.dataclass
class Prefill:
    """What :func:`prefill` returns: each row's next-token ``logits [B, V]``, the
    ``cache`` holding the prompts, and the wall seconds of the prefill and of its
    compilation."""

    logits: jax.Array
    cache: KVCache
    seconds: float
    compile_s: float
    #: seconds spent compiling the decode loop ahead of the cache (:func:`generate`)
    decode_compile_s: float = 0.0


def prefill(
    params: Params,
    config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    cache_config: CacheConfig,
    max_len: int,
    room: int = 0,
    cache_dtype: Any = jnp.bfloat16,
    chunk: int | None = None,
    key: jax.Array | None = None,
    calibration: Any = None,
    mesh: Mesh | None = None,
) -> Prefill:
    """Feed ``prompts`` (right-padded into one batch) through a new cache of
    ``cache_config`` of ``max_len`` slots, ``chunk`` tokens at a time (one compiled
    prefill for all chunks; default: the whole padded width at once).

    With an ``evict=`` clause the prompts go through an exact cache (``bf16``, or ``f32``
    for a float32 ``cache_dtype``) while the prefill records the attention the policy
    scores by, and the cache returned holds only the kept tokens
    (:func:`kvjax.cache.evict_into`), with ``room`` slots after them for what follows.
    ``key`` draws the codec parameters. ``mesh`` (:func:`kvjax.sharding.make_mesh`):
    the model runs tensor-parallel over it and the cache is split over its rows and kv
    heads (:func:`models.llama.hidden_states`); the prompts must split over its data
    axis. The program is compiled before the cache is allocated (for the cache's shape),
    so that XLA's compile-time buffers never sit beside it. A cache or program that does
    not fit in device memory raises :class:`OutOfMemoryError`.
    """
    return _prefill_prompts(params, config, prompts, cache_config=cache_config, max_len=max_len,
                    room=room, cache_dtype=cache_dtype, chunk=chunk, key=key,
                    calibration=calibration, mesh=mesh)


def _prefill_prompts(params, config, prompts, *, cache_config, max_len, room, cache_dtype,
                     chunk, key, calibration, mesh,
                     decode_ahead: tuple[int, bool, int] | None = None) -> Prefill:
    """:func:`prefill`; ``decode_ahead = (max_new_tokens, greedy, num_eos)`` also
    compiles the decode loop that will follow, before the cache exists."""
    batch = len(prompts)
    if mesh is not None:  # shard_params checks the heads
        check_split(mesh, rows=batch)
        params = shard_params(params, config, mesh)
    # prompts are padded to a multiple of PREFILL_BUCKET so that prompt sets of similar
    # lengths share one compiled prefill; `valid` keeps the padding out of the cache
    longest = max(len(p) for p in prompts)
    width = min(-(-longest // PREFILL_BUCKET) * PREFILL_BUCKET, max_len)
    chunk = width if chunk is None else min(int(chunk), width)
    num_chunks = -(-width // chunk)
    width = num_chunks * chunk
    tokens = np.zeros((batch, width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    valid = jnp.asarray([len(p) for p in prompts], jnp.int32)
    tokens = jnp.asarray(tokens)
    key = jax.random.PRNGKey(0) if key is None else key
    policy = cache_config.evict
    observe = policy is not None and policy.observes
    if policy is None:
        made = dict(cache_config=cache_config, batch=batch, max_len=max_len, dtype=cache_dtype,
                    key=key, calibration=calibration, mesh=mesh)
    else:
        exact = CacheConfig(k="f32" if jnp.dtype(cache_dtype) == jnp.float32 else "bf16")
        made = dict(cache_config=exact, batch=batch, max_len=width, dtype=cache_dtype,
                    mesh=mesh)
    mass_shape = (config.num_layers, batch, config.num_kv_heads, width)

    def arguments(start, cache, mass):
        piece = tokens[:, start:start + chunk]
        args = (params, config, mesh, piece, jnp.clip(valid - start, 0, chunk), cache)
        if not observe:
            return args
        positions = start + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        weights = policy.query_weights(jnp.broadcast_to(positions, piece.shape), valid)
        return (*args, weights, mass)

    boundary = _MemoryBoundary("prefill", batch=batch, context=max_len, mesh=mesh,
                               detail=f" (prompts of {width} tokens, {chunk} at a time)")
    with boundary:
        t0 = time.perf_counter()
        shape = cache_shape(config, **made)
        if observe:
            mass = jax.ShapeDtypeStruct(mass_shape, jnp.float32, sharding=(
                jnp.zeros(()).sharding if mesh is None
                else NamedSharding(mesh, ROWS_HEADS)))
            compiled = _compiled("prefill_observed", _observed_prefill_jit, (config, mesh),
                                 arguments(0, shape, mass), (1, 2))
        else:
            compiled = prefill_program(params, config, shape, chunk=chunk, mesh=mesh)
        boundary.compiled = compiled
        t1 = time.perf_counter()
        decode_compile_s = 0.0
        if decode_ahead is not None:
            logits_shape, final = compiled.out_info[:2]
            if policy is not None:
                final = cache_shape(config, cache_config, batch=batch,
                                    max_len=policy.capacity(width) + room, dtype=cache_dtype,
                                    key=key, calibration=calibration, mesh=mesh)
            new_tokens, greedy, num_eos = decode_ahead
            decode_program(params, config, logits_shape, final, max_new_tokens=new_tokens,
                           greedy=greedy, num_eos=num_eos, mesh=mesh)
            decode_compile_s = time.perf_counter() - t1
        # the cache is allocated here too: where a batch that does not fit fails first
        cache = new_cache(config, **made)
        mass = None
        if observe:
            # on a mesh made split as the cache is: no device holds every row's scores
            mass = (jnp.zeros(mass_shape, jnp.float32) if mesh is None
                    else sharded_zeros(mesh, mass_shape, jnp.float32, ROWS_HEADS))
        t2 = time.perf_counter()
        logits = None
        for start in range(0, width, chunk):
            params_, _, _, *rest = arguments(start, cache, mass)
            chunk_logits, cache, *observed = compiled(params_, *rest)
            if observe:
                mass = observed[0]
            # each row's next-token logits come from the chunk holding its last token
            here = ((valid > start) & (valid <= start + chunk))[:, None]
            logits = chunk_logits if logits is None else jnp.where(here, chunk_logits, logits)
        if policy is not None:
            target = new_cache(config, cache_config, batch=batch,
                               max_len=policy.capacity(width) + room, dtype=cache_dtype, key=key,
                               calibration=calibration, mesh=mesh)
            cache = (evict_into(cache, mass, target) if mesh is None
                     else sharded_evict_into(mesh, cache, mass, target))
        jax.block_until_ready((logits, cache))
    return Prefill(logits=logits, cache=cache, seconds=time.perf_counter() - t2,
                   compile_s=t1 - t0, decode_compile_s=decode_compile_s)


def _seeded_prefill(params, config, prompts, *, cache_config, max_len, room, cache_dtype,
                    prefill_chunk, seed, calibration, mesh, decode_ahead=None) -> Prefill:
    """The prefill of :func:`generate` and :func:`score`: ``prefill_chunk`` checked, the
    codec parameters drawn from ``seed``."""
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int | np.integer)
                                      or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
    with warnings.catch_warnings():
        # CPU backends cannot donate buffers and say so on every call
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return _prefill_prompts(
            params, config, prompts, cache_config=cache_config, max_len=max_len, room=room,
            cache_dtype=cache_dtype, chunk=prefill_chunk,
            key=jax.random.fold_in(jax.random.PRNGKey(seed), 0), calibration=calibration,
            mesh=mesh, decode_ahead=decode_ahead)


def generate(
    params: Params,
    config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    cache_config: CacheConfig,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    max_len: int | None = None,
    cache_dtype: Any = jnp.bfloat16,
    prefill_chunk: int | None = None,
    calibration: Any = None,
    save_prompt: str | Path | None = None,
    mesh: Mesh | None = None,
) -> GenerateResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt, batched.

    Greedy when ``temperature == 0``; otherwise temperature + top-p (nucleus) sampling
    with keys derived from ``seed`` (same seed, same inputs: same tokens). Generation of a
    row stops at any of ``eos_token_ids`` (default: ``config.eos_token_ids``; pass ``()``
    to disable), which is not included in the output. ``max_len`` (default: longest
    prompt + ``max_new_tokens``) is the cache capacity; raw cache tokens are stored in
    ``cache_dtype``. Codec parameters (rotations, codebooks) are drawn from ``seed`` too,
    so with a lossy codec even greedy output may depend on it. ``prefill_chunk`` feeds
    the prompts through the cache ``prefill_chunk`` tokens at a time (one compiled
    prefill for all chunks): the reference attention's scores then take ``[B, N, chunk,
    max_len]`` instead of ``[B, N, prompt, max_len]``, which long prompts need. Raises
    ``ValueError`` for bad arguments and, after generation, for a cache whose flags
    :func:`kvjax.cache.check` reports (overflow, non-finite or saturated K/V), and
    :class:`OutOfMemoryError` for a batch that does not fit in device memory. The loop
    checks whether every row is done once every :data:`CHECK_EVERY` steps, so after the
    last row's EOS up to ``CHECK_EVERY - 1`` steps may still run (recording nothing).
    ``calibration`` serves a cache spec's ``calib`` clauses
    (:func:`models.evaluate.calibrate_keys`). ``save_prompt``: a directory where the
    prefilled cache is stored (:func:`save_prompt_cache`, replacing what is there) before
    decoding, for :func:`load_prompt_cache` and :func:`decode` to continue from later.
    ``mesh`` (:func:`kvjax.sharding.make_mesh`): tensor-parallel over its ``model``
    axis, the prompts split over its ``data`` axis (their count must divide), the cache
    split over both; the same tokens as on one device.
    """
    max_len = _validate(config, prompts, max_new_tokens, temperature, top_p, max_len)
    # both programs compiled before the cache exists
    pre = _seeded_prefill(params, config, prompts, cache_config=cache_config,
                          max_len=max_len, room=max_new_tokens, cache_dtype=cache_dtype,
                          prefill_chunk=prefill_chunk, seed=seed, calibration=calibration,
                          mesh=mesh, decode_ahead=(max_new_tokens, temperature == 0,
                                                   len(_stop_tokens(config, eos_token_ids))))
    if save_prompt is not None:
        save_prompt_cache(save_prompt, pre, params=params, config=config, prompts=prompts,
                          seed=seed, overwrite=True)
    return decode(params, config, pre, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_p=top_p, seed=seed,
                  eos_token_ids=eos_token_ids, mesh=mesh)


def decode(
    params: Params,
    config: ModelConfig,
    pre: Prefill,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> GenerateResult:
    """The decode half of :func:`generate`: up to ``max_new_tokens`` tokens per row after
    a prefill (:func:`prefill`, or a prompt cache from :func:`load_prompt_cache`), with
    :func:`generate`'s sampling, seed and end-of-sequence rules; the same ``seed`` as the
    prefill's :func:`generate` call gives the same tokens. The prefill's cache is donated
    to the decode loop: use ``result.cache`` afterwards. Raises ``ValueError`` when the
    cache has no room for the tokens or their positions pass the model's context, and
    :class:`OutOfMemoryError` when the decode program does not fit in device memory.
    ``mesh``: as :func:`generate`'s (a prompt cache read from disk is split over it)."""
    _validate_sampling(max_new_tokens, temperature, top_p)
    cache = pre.cache
    logits = pre.logits
    if mesh is not None:
        check_split(mesh, rows=cache.batch)
        params = shard_params(params, config, mesh)
        cache = place_cache(mesh, cache)
    longest = int(jnp.max(cache.lengths))
    if longest + max_new_tokens - 1 > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} tokens, {longest} of them taken: "
                         f"room for {cache.max_len - longest + 1} new tokens, not "
                         f"{max_new_tokens}")
    last = int(jnp.max(cache.lengths + cache.evicted))
    if last + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"{last} prompt positions + max_new_tokens = "
                         f"{last + max_new_tokens} exceeds max_position_embeddings="
                         f"{config.max_position_embeddings}")
    eos = _stop_tokens(config, eos_token_ids)
    eos_arr = jnp.asarray(eos if eos else (-1,), jnp.int32)
    greedy = temperature == 0
    temperature_arr = jnp.float32(temperature if not greedy else 1.0)
    top_p_arr = jnp.float32(top_p)
    sample_key = jax.random.fold_in(jax.random.PRNGKey(seed), 1)

    boundary = _MemoryBoundary("decode", batch=cache.batch, context=cache.max_len, mesh=mesh,
                               detail=f" ({longest} of them taken, {max_new_tokens} new)")
    with warnings.catch_warnings(), boundary:
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        t2 = time.perf_counter()
        compiled = boundary.compiled = decode_program(
            params, config, logits, cache, max_new_tokens=max_new_tokens, greedy=greedy,
            num_eos=len(eos), mesh=mesh)
        t3 = time.perf_counter()
        out, logp, cache = compiled(params, logits, cache, eos_arr, sample_key,
                                    temperature_arr, top_p_arr)
        out, logp = np.asarray(jax.block_until_ready(out)), np.asarray(logp)
        t4 = time.perf_counter()

    check(cache)
    new_tokens, log_probs = [], []
    for row, row_logp in zip(out, logp, strict=True):
        stop = np.nonzero(row < 0)[0]
        end = stop[0] if stop.size else len(row)
        new_tokens.append(row[:end].tolist())
        log_probs.append(row_logp[:end].astype(np.float32))
    decoded = sum(len(t) for t in new_tokens)
    decode_s = t4 - t3
    return GenerateResult(
        tokens=new_tokens,
        prefill_s=pre.seconds,
        decode_s=decode_s,
        compile_s=pre.compile_s + pre.decode_compile_s + (t3 - t2),
        prefill_compile_s=pre.compile_s,
        decode_compile_s=pre.decode_compile_s + (t3 - t2),
        decode_tok_per_s=decoded / decode_s if decode_s > 0 else float("nan"),
        cache_bytes=memory_bytes(cache),
        cache=cache,
        log_probs=log_probs,
    )


# -- prompt caches on disk ----------------------------------------------------------------

#: values of every weight array that :func:`model_fingerprint` reads, from each end
FINGERPRINT_VALUES = 4096


def model_fingerprint(config: ModelConfig, params: Params) -> str:
    """16 hex digits that tell models apart: the config, and the shapes and first and
    last :data:`FINGERPRINT_VALUES` values (rounded to bf16) of the embedding, the final
    norm and every layer's norms. The same whatever the weights' dtype or layer layout
    (stacked or per layer), so a prompt cache moves between CPU and GPU loads."""
    digest = hashlib.sha256(repr(config).encode())
    layers = params["layers"]
    stacked = (layers if isinstance(layers, dict)
               else {k: jnp.stack([layer[k] for layer in layers]) for k in layers[0]})
    for name, leaf in [("embed", params["embed"]), ("final_norm", params["final_norm"]),
                       *((f"layers.{k}", stacked[k]) for k in sorted(stacked)
                         if k.endswith("norm"))]:
        flat = jnp.ravel(leaf)
        ends = jnp.concatenate([flat[:FINGERPRINT_VALUES], flat[-FINGERPRINT_VALUES:]])
        digest.update(f"{name}{tuple(leaf.shape)}".encode())
        digest.update(np.asarray(ends.astype(jnp.bfloat16)).tobytes())
    return digest.hexdigest()[:16]


@dataclasses.dataclass
class Scores:
    """What :func:`score` measured: ``log_probs[i]`` float32 ``[len(continuations[i])]``,
    the model's log-probability of each continuation token after its prompt and the
    continuation tokens before it; ``cache``: the cache after the whole continuation."""

    log_probs: list[np.ndarray]
    cache: KVCache

    @property
    def totals(self) -> list[float]:
        """Per row: the continuation's log-probability (the sum over its tokens)."""
        return [float(np.sum(lp, dtype=np.float64)) for lp in self.log_probs]


def _forward_program(params, config, mesh, tokens, valid, cache):
    logits, cache = forward(params, config, tokens, cache, valid, mesh=mesh)
    return jax.nn.log_softmax(logits, axis=-1), cache


_forward_jit = jax.jit(_forward_program, static_argnums=(1, 2), donate_argnums=5)


def score(
    params: Params,
    config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    cache_config: CacheConfig,
    cache_dtype: Any = jnp.bfloat16,
    prefill_chunk: int | None = None,
    seed: int = 0,
    calibration: Any = None,
    mesh: Mesh | None = None,
) -> Scores:
    """Log-probabilities of ``continuations[i]`` after ``prompts[i]`` through a cache of
    ``cache_config`` (as HF's forward over prompt and continuation gives logits, here with
    the prompt compressed, as :func:`generate` would hold it).

    Each prompt is prefilled as :func:`generate` prefills it (``prefill_chunk``, ``seed``
    for the codec parameters, ``calibration``, ``mesh`` alike; an ``evict=`` clause
    evicts from the prompt), the first continuation token is scored by the prefill's
    next-token logits and the rest are fed as one chunk after each row's prompt (its
    positions follow the prompt's, padding neither stored nor attended to), each token
    scored by the logits of the one before it. Ragged prompts and continuations are
    fine; every continuation needs at least one token. ``ValueError`` for bad arguments
    or a cache whose flags :func:`kvjax.cache.check` reports."""
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
    if not continuations or any(len(c) == 0 for c in continuations):
        raise ValueError("every continuation needs at least one token to score")
    width = max(len(c) for c in continuations)
    _validate(config, prompts, width, 0.0, 1.0, None)
    for c in continuations:
        if any(not 0 <= int(t) < config.vocab_size for t in c):
            raise ValueError(f"continuation token ids must be in 0..{config.vocab_size - 1}")
    max_len = max(len(p) for p in prompts) + width
    pre = _seeded_prefill(params, config, prompts, cache_config=cache_config,
                          max_len=max_len, room=width, cache_dtype=cache_dtype,
                          prefill_chunk=prefill_chunk, seed=seed, calibration=calibration,
                          mesh=mesh)
    first = jax.nn.log_softmax(pre.logits.astype(jnp.float32), axis=-1)
    follow = np.zeros((len(prompts), max(width - 1, 1)), np.int32)
    for i, c in enumerate(continuations):
        follow[i, :len(c) - 1] = c[:-1]
    valid = jnp.asarray([len(c) - 1 for c in continuations], jnp.int32)
    placed = params if mesh is None else shard_params(params, config, mesh)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        rest, cache = _forward_jit(placed, config, mesh, jnp.asarray(follow), valid,
                                   pre.cache)
    check(cache)
    first, rest = np.asarray(first), np.asarray(rest)
    log_probs = []
    for i, c in enumerate(continuations):
        tokens = np.asarray(c, np.int64)
        picked = [first[i, tokens[0]]]
        picked += [rest[i, j, tokens[j + 1]] for j in range(len(c) - 1)]
        log_probs.append(np.asarray(picked, np.float32))
    return Scores(log_probs=log_probs, cache=cache)


@dataclasses.dataclass
class PromptCache:
    """A prefill read back from disk (:func:`load_prompt_cache`): ``prefill`` (its
    ``seconds`` is the time to read it), the ``prompts`` it holds, the ``seed`` of the
    call that made it, and its ``disk_bytes``."""

    prefill: Prefill
    prompts: list[list[int]]
    seed: int
    disk_bytes: int


def save_prompt_cache(path: str | Path, pre: Prefill, *, params: Params, config: ModelConfig,
                      prompts: Sequence[Sequence[int]], seed: int = 0,
                      overwrite: bool = False) -> int:
    """Write a prefill's compressed cache (packed, as stored) and next-token logits to the
    directory ``path`` with the model's :func:`model_fingerprint`, the prompts and the
    seed (:mod:`kvjax.checkpoint`); returns the bytes on disk."""
    metadata = {"model": model_fingerprint(config, params),
                "prompts": [[int(t) for t in p] for p in prompts], "seed": int(seed)}
    return save_cache(path, pre.cache, metadata=metadata, extra={"logits": pre.logits},
                      overwrite=overwrite)


def load_prompt_cache(path: str | Path, *, params: Params, config: ModelConfig) -> PromptCache:
    """The prefill :func:`save_prompt_cache` wrote at ``path``, for :func:`decode`.
    Raises :class:`kvjax.checkpoint.CheckpointError` for a cache of another model (its
    fingerprint differs), format or kvjax version, and for a truncated or corrupt one."""
    t0 = time.perf_counter()
    cache, extra, metadata = load_cache(path,
                                        expect={"model": model_fingerprint(config, params)})
    if set(extra) != {"logits"} or extra["logits"].shape != (cache.batch, config.vocab_size):
        raise CheckpointError(f"{path}: no next-token logits [{cache.batch}, "
                              f"{config.vocab_size}] stored with the cache")
    prompts, seed = metadata.get("prompts"), metadata.get("seed")
    if not (isinstance(prompts, list) and len(prompts) == cache.batch and all(
            isinstance(p, list) and p and all(
                isinstance(t, int) and not isinstance(t, bool)
                and 0 <= t < config.vocab_size for t in p) for p in prompts)):
        raise CheckpointError(f"{path}: the stored prompts are not {cache.batch} lists of "
                              f"token ids in 0..{config.vocab_size - 1}: the description "
                              "was edited or damaged")
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**63):
        raise CheckpointError(f"{path}: the stored seed {seed!r} is not an integer in "
                              "0..2**63-1: the description was edited or damaged")
    jax.block_until_ready(cache)
    pre = Prefill(logits=extra["logits"], cache=cache, seconds=time.perf_counter() - t0,
                  compile_s=0.0)
    return PromptCache(prefill=pre, prompts=prompts, seed=seed, disk_bytes=disk_bytes(path))
