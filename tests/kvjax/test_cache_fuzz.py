"""Cache fuzzing under ``jit``: random append sequences against a plain Python model.

Each example draws a cache layout (residual window, sink tokens) for a codec pair and
runs random sequences of appends through one jitted program: ragged ``valid`` counts
(negative ones and ones past the chunk among them), sequences that run past capacity,
NaN/Inf and values beyond the storage's range, junk in the padding. The model says what
every row must hold: position ``p`` holds the ``p``-th real token appended to the row,
tokens past capacity are dropped, a bad count is clamped into ``0..T``. After every
append the cache must read back exactly that (raw and sink positions bit for bit, the
compressed ones as the codec's own round trip of the same tokens), with the lengths and
every flag the model predicts; so no stored token is ever lost or moved.

CI runs a few layouts per codec pair; ``KVJAX_FUZZ_EXAMPLES=N`` runs ``N`` (each compiles
one program, then reuses it for several sequences).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax.codec import Limits
from kvjax.codecs.intn import IntCodec
from tests import fuzz


class _Limited(IntCodec):
    """``int`` storage that holds elements up to 6 and vectors of norm up to 12 only, so
    that the codec's saturation is reachable with ordinary values."""

    name = "limited-int"
    limits = Limits(element=6.0, norm=12.0)


@dataclasses.dataclass(frozen=True)
class Case:
    """A codec pair and the fixed shapes its programs compile for."""

    k: object
    v: object
    chunk: int  # T of every append
    steps: int  # appends per sequence
    max_len: int
    dtype: object = jnp.bfloat16  # raw tokens
    batch: int = 3
    heads: int = 2
    head_dim: int = 8


CASES = {
    # token-wise codes beside exact storage
    "int4-bf16": Case(k="int:4", v="bf16", chunk=3, steps=7, max_len=15),
    # blocks of 4 tokens: key groups wait raw until whole
    "kivi-g4": Case(k="kivi:2,g4", v="kivi:2,g4,token", chunk=5, steps=6, max_len=21),
    # one-token decode steps against a block codec
    "decode-kivi": Case(k="bf16", v="kivi:4,g4", chunk=1, steps=14, max_len=11),
    # float16 raw tokens and a codec with finite limits: both saturation causes
    "limited-fp16": Case(k=_Limited(bits=4), v="int:8", chunk=4, steps=6, max_len=17,
                         dtype=jnp.float16),
}

#: layouts the examples draw from (static: each distinct one compiles once)
WINDOWS = (0, 1, 2, 5)
SINKS = (0, 1, 3)
SEQUENCES = 3  # random append sequences per compiled layout


@jax.jit
def _run(cache, xk, xv, valid, stream_k, stream_v):
    """Append ``xk/xv[step]`` with ``valid[step]`` under one program; after every append
    return the lengths, every flag and both stores read back densely. Also returns the
    codec round trip of the model's streams over the compressed region (what the codes
    of those tokens must decode to) and which of the streams' tokens are in the codec's
    range."""

    def body(c, inputs):
        k, v, n = inputs
        step = kc.make_step(c, k.shape[1], n)
        c = kc.commit(c.with_layer(0, kc.append(c.layer(0), k, v, step)), step)
        view = c.layer(0)
        return c, dict(
            lengths=c.lengths, overflowed=c.overflowed, bad_valid=c.bad_valid,
            nonfinite=(view.k.nonfinite, view.v.nonfinite),
            saturated=(view.k.saturated, view.v.saturated),
            dense=(kc.dense(view.k, c.lengths), kc.dense(view.v, c.lengths)),
        )

    _, outs = jax.lax.scan(body, cache, (xk, xv, valid))
    view = cache.layer(0)
    trips, in_range = [], []
    for store, stream in ((view.k, stream_k), (view.v, stream_v)):
        in_range.append(store.codec.in_range(stream))
        n = store.slots * store.block
        if not n:
            trips.append(jnp.zeros((*stream.shape[:2], 0, stream.shape[-1])))
            continue
        part = stream[:, :, store.sinks:store.sinks + n]
        trips.append(kc.decode_heads(store.codec, store.params,
                                     kc._encode_heads(store.codec, store.params, part)))
    return outs, trips, in_range


def _stored(x, dtype):
    """What the cache keeps of ``x``: NaN -> 0, Inf -> the largest float32, clipped to the
    raw dtype's range and rounded to it (as float32)."""
    limit = float(jnp.finfo(dtype).max)
    x = np.nan_to_num(np.asarray(x, np.float32), nan=0.0)
    return np.clip(x, -limit, limit).astype(np.dtype(dtype)).astype(np.float32)


def _values(rng, case, shape):
    """Chunk values exact in the raw dtype, at a random scale per token, with rare NaN,
    Inf and values beyond float16."""
    scale = 10.0 ** rng.integers(-3, 2, size=(*shape[:-1], 1))
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    x = x.astype(np.dtype(case.dtype)).astype(np.float32)
    specials = [np.nan, np.inf, -np.inf, 1e5, -7e4, 3e38]
    hits = rng.random(shape) < rng.choice([0.0, 0.0, 0.001, 0.005])
    x[hits] = rng.choice(specials, size=int(hits.sum()))
    return x


def _valid_counts(rng, case):
    """``[steps, B]`` counts: mostly in ``0..T``, a few outside, density per sequence."""
    t = case.chunk
    full = rng.random() < 0.3
    counts = np.where(full, t, rng.integers(0, t + 1, size=(case.steps, case.batch)))
    bad = rng.random((case.steps, case.batch)) < 0.1
    wild = rng.choice([-t - 2, -1, t + 1, 2 * t + 3], size=counts.shape)
    return np.where(bad, wild, counts).astype(np.int32)


class Model:
    """The rows of a cache, in plain Python: each row's stored tokens and flags."""

    def __init__(self, case):
        self.case = case
        self.rows = [{"k": [], "v": []} for _ in range(case.batch)]
        self.overflowed = np.zeros(case.batch, bool)
        self.bad_valid = np.zeros(case.batch, bool)
        self.nonfinite = {r: np.zeros(case.batch, bool) for r in "kv"}
        self.raw_clipped = {r: np.zeros(case.batch, bool) for r in "kv"}

    def append(self, k, v, valid):
        limit = float(jnp.finfo(self.case.dtype).max)
        for b, row in enumerate(self.rows):
            real = min(max(int(valid[b]), 0), self.case.chunk)
            room = self.case.max_len - len(row["k"])
            self.bad_valid[b] |= not 0 <= valid[b] <= self.case.chunk
            self.overflowed[b] |= real > room
            for role, x in (("k", k), ("v", v)):
                kept = x[b, :min(real, room)]  # [n, K, D]
                row[role].extend(kept)
                self.nonfinite[role][b] |= not np.isfinite(kept).all()
                self.raw_clipped[role][b] |= bool(
                    (np.isfinite(kept) & (np.abs(kept) > limit)).any())

    def lengths(self):
        return np.array([len(row["k"]) for row in self.rows])

    def stream(self, role):
        """``[B, K, max_len, D]`` of the stored values (zeros past each row's length)."""
        c = self.case
        out = np.zeros((c.batch, c.heads, c.max_len, c.head_dim), np.float32)
        for b, row in enumerate(self.rows):
            if row[role]:
                out[b, :, :len(row[role])] = np.swapaxes(
                    _stored(np.stack(row[role]), c.dtype), 0, 1)
        return out


def _compressed(length, store):
    return max(0, length - store.sinks - store.window) // store.block * store.block


def _check_sequence(case, cache, rng, label):
    c = case
    xk = np.stack([_values(rng, c, (c.batch, c.chunk, c.heads, c.head_dim))
                   for _ in range(c.steps)])
    xv = np.stack([_values(rng, c, (c.batch, c.chunk, c.heads, c.head_dim))
                   for _ in range(c.steps)])
    valid = _valid_counts(rng, c)
    model, expected = Model(c), []
    for i in range(c.steps):
        model.append(xk[i], xv[i], valid[i])
        expected.append(dict(lengths=model.lengths(), overflowed=model.overflowed.copy(),
                             bad_valid=model.bad_valid.copy(),
                             nonfinite={r: model.nonfinite[r].copy() for r in "kv"},
                             raw_clipped={r: model.raw_clipped[r].copy() for r in "kv"}))
    streams = [model.stream("k"), model.stream("v")]
    outs, trips, in_range = jax.tree.map(np.asarray, _run(cache, xk, xv, valid, *streams))
    view = cache.layer(0)
    stores = (view.k, view.v)

    for i, want in enumerate(expected):
        where = f"{label}, append {i} (valid {valid[: i + 1].T.tolist()})"
        lengths = want["lengths"]
        np.testing.assert_array_equal(outs["lengths"][i], lengths, err_msg=where)
        np.testing.assert_array_equal(outs["overflowed"][i], want["overflowed"], err_msg=where)
        np.testing.assert_array_equal(outs["bad_valid"][i], want["bad_valid"], err_msg=where)
        for j, (role, store) in enumerate(zip("kv", stores, strict=True)):
            stream, trip = streams[j], trips[j]
            np.testing.assert_array_equal(outs["nonfinite"][j][i], want["nonfinite"][role],
                                          err_msg=where)
            read = outs["dense"][j][i]
            assert np.isfinite(read).all(), where
            flags = outs["saturated"][j][i]
            codec_hit = np.zeros(c.batch, bool)
            for b in range(c.batch):
                n_comp = _compressed(lengths[b], store)
                # every stored token where the model puts it, nothing past the length
                want_row = stream[b].copy()
                want_row[:, lengths[b]:] = 0
                comp = slice(store.sinks, store.sinks + n_comp)
                want_row[:, comp] = trip[b, :, :n_comp]
                np.testing.assert_array_equal(read[b], want_row,
                                              err_msg=f"{where}, {role} row {b}")
                # a token encoded outside the codec's range was saturated
                codec_hit[b] = not in_range[j][b, :, comp].all()
            want_flags = (np.where(want["raw_clipped"][role], kc.SATURATED_RAW, 0)
                          | np.where(codec_hit, kc.SATURATED_CODEC, 0))
            np.testing.assert_array_equal(flags, want_flags, err_msg=f"{where}, {role}")


@pytest.mark.parametrize("name", list(CASES))
def test_appends_under_jit_match_the_model(name):
    case = CASES[name]
    for index in range(fuzz.example_count(3)):
        rng = fuzz.rng(f"cache-fuzz-{name}", index)
        window, sinks = int(rng.choice(WINDOWS)), int(rng.choice(SINKS))
        config = kc.CacheConfig(k=case.k, v=case.v, residual_window=window,
                                sink_tokens=sinks)
        cache = kc.init_cache(jax.random.key(index), config, num_layers=1,
                              batch=case.batch, num_kv_heads=case.heads,
                              head_dim=case.head_dim, max_len=case.max_len, dtype=case.dtype)
        for seq in range(SEQUENCES):
            label = f"{name} example {index} (window {window}, sinks {sinks}) sequence {seq}"
            _check_sequence(case, cache, rng, label)
