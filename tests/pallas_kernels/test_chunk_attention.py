"""The chunk-attention kernel's entry against its pure-jnp reference (compiled on a GPU,
Pallas interpret mode elsewhere), the key blocks a program walks, and bad input.

The class takes its cases the way the kernel suite's do (``CASES`` and ``UNSUPPORTED``,
parametrized by ``conftest.py``) but does not inherit :class:`~tests.pallas_kernels.
suite.KernelSuite`: that suite checks the partial softmax of one-token decode kernels
(and a decode through the attention adapter), while this entry returns the normalized
output of a chunk of several tokens; its adapter is tested in
``tests/kvjax/attention/test_prefill.py``.

Tolerance: the kernel rounds the query and the probabilities to the values' 16-bit type
and accumulates in float32. Each rounding is a relative error of at most ``u``
(bfloat16 ``2**-8``, float16 ``2**-11``); rounded probabilities move an output, a
convex combination of the values, by at most ``u * max |v_i - o|``, a few ``u`` for
these Gaussian values, and the rounded query moves each logit by about ``u`` as much
again. 1e-2 (``2.5 u``) for bfloat16, 1.5e-3 (``3 u``) for float16; measured here: up
to ~5e-3 and ~7e-4.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.chunk_attention import api, reference
from pallas_kernels.chunk_attention.kernel import key_blocks
from tests.pallas_kernels.suite import Shape, layer_stacks


@dataclasses.dataclass(frozen=True)
class Case(Shape):
    """One call of the entry: ``group`` query heads per kv head over a chunk of
    ``tokens`` starting at ``starts[b]`` in row ``b``, which stores ``lengths[b]`` keys;
    the storage type, a sliding window, stacked layers and the blocking."""

    tokens: int
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    dtype: str = "bfloat16"
    window: int | None = None
    layers: int | None = None  # keys and values stacked over this many; layer 1 is read
    block_q: int | None = 16
    block_k: int | None = 32

    @property
    def id(self) -> str:
        return "-".join(filter(None, [
            self.shape_id, f"T{self.tokens}", self.dtype, f"bq{self.block_q}",
            f"bk{self.block_k}", "p" + ",".join(map(str, self.starts)),
            "n" + ",".join(map(str, self.lengths)), f"w{self.window}" * bool(self.window),
            f"L{self.layers}" * bool(self.layers)]))


CASES = (
    # GQA 4, S not a multiple of the block, padded query blocks; row 1 stores fewer keys
    # than its last positions (a chunk's padding), row 2 none at all
    Case(3, 2, 4, 100, 128, tokens=5, starts=(90, 20, 0), lengths=(95, 23, 0)),
    # GQA 1, a chunk of 64 at the library's default blocking: whole unmasked blocks
    Case(1, 1, 1, 200, 64, tokens=64, starts=(130,), lengths=(194,), dtype="float16",
         block_q=None, block_k=None),
    # GQA 7: 35 rows, query blocks that straddle query heads
    Case(2, 1, 7, 48, 64, tokens=5, starts=(40, 10), lengths=(45, 13), block_k=16),
    # a stack of layers read in place
    Case(2, 2, 4, 64, 64, tokens=8, starts=(50, 30), lengths=(58, 38), layers=3,
         block_k=16),
    # a sliding window: masked blocks at its start, unmasked ones, the masked diagonal
    Case(2, 2, 2, 128, 64, tokens=16, starts=(100, 5), lengths=(116, 21),
         dtype="float16", window=40, block_k=16),
    # one token per row; row 1's window lies wholly past its keys: it sees nothing
    Case(2, 2, 4, 70, 128, tokens=1, starts=(69, 30), lengths=(70, 20), window=4),
    # a chunk of more than 64 tokens with a window, blocks of 32
    Case(1, 2, 2, 96, 64, tokens=72, starts=(24,), lengths=(96,), window=33, block_q=32),
)

TOLERANCE: dict[str, float] = {"bfloat16": 1e-2, "float16": 1.5e-3}


def positions(case: Case) -> jax.Array:
    """``[B, G*T]``: row ``r`` is token ``r % T`` of the chunk (group_queries' order)."""
    t = np.tile(np.arange(case.tokens), case.group)
    return jnp.asarray(np.asarray(case.starts)[:, None] + t[None, :], jnp.int32)


def stored(case: Case, seed: int) -> tuple[jax.Array, jax.Array]:
    """Keys and values ``[B, K, S, D]`` in the case's storage type; slots past a row's
    length hold NaN (what is not stored must not be read)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    shape = (case.batch, case.heads, case.slots, case.head_dim)
    unset = (np.arange(case.slots)[None, :] >= np.asarray(case.lengths)[:, None])
    unset = jnp.asarray(unset)[:, None, :, None]
    return tuple(jnp.where(unset, jnp.nan, jax.random.normal(k, shape)).astype(case.dtype)
                 for k in (k1, k2))


def inputs(case: Case) -> dict:
    """The keyword arguments of the entry and its reference."""
    q = jax.random.normal(jax.random.key(9), (case.batch, case.heads,
                                              case.group * case.tokens, case.head_dim))
    keys, values, layer = layer_stacks(stored, case)
    return {"q": q, "keys": keys, "values": values, "q_positions": positions(case),
            "lengths": jnp.asarray(case.lengths, jnp.int32), "layer": layer,
            "sm_scale": case.head_dim**-0.5, "sliding_window": case.window,
            "block_q": case.block_q, "block_k": case.block_k}


class TestChunkAttention:
    CASES = CASES
    UNSUPPORTED = (
        (Case(1, 1, 4, 16, 128, tokens=4, starts=(12,), lengths=(16,), dtype="float32"),
         "it reads bfloat16 or float16"),
        (Case(1, 1, 4, 16, 96, tokens=4, starts=(12,), lengths=(16,)), "head_dim 96"),
        (Case(1, 1, 4, 16, 8, tokens=4, starts=(12,), lengths=(16,)), "head_dim 8"),
    )
    TOLERANCE: ClassVar[dict[str, float]] = TOLERANCE

    def test_entry_matches_reference(self, case):
        kw = inputs(case)
        got = np.asarray(api.chunk_attention(**kw))
        want = np.asarray(reference.chunk_attention(**kw))
        assert got.shape == want.shape == kw["q"].shape and got.dtype == np.float32
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, atol=self.TOLERANCE[case.dtype])
        # a row that sees no key gets zeros, like the reference
        sees = np.asarray(reference.visible(kw["q_positions"], kw["lengths"], case.slots,
                                            case.window)).any(-1)
        assert np.all(got.transpose(0, 2, 1, 3)[~sees] == 0)

    def test_query_blocks_first_order_gives_the_same_output(self, case):
        """The grid's order changes only which programs run together, not what each
        computes: the outputs are the same bits."""
        kw = inputs(case)
        rows = np.asarray(api.chunk_attention(**kw))
        queries = np.asarray(api.chunk_attention(**kw, order="queries"))
        np.testing.assert_array_equal(queries, rows)

    def test_cases_hold_rows_that_see_nothing(self):
        for case, row in ((CASES[0], 2), (CASES[5], 1)):
            kw = inputs(case)
            sees = reference.visible(kw["q_positions"], kw["lengths"], case.slots,
                                     case.window)
            assert not np.any(sees[row]) and np.all(np.any(sees[:row], axis=-1))

    def test_unsupported_arrays_raise(self, unsupported):
        case, reason = unsupported
        with pytest.raises(NotImplementedError, match=reason):
            api.chunk_attention(**inputs(case))

    def test_tolerance_catches_a_dropped_block(self):
        """Without the chunk's last key block the outputs move by far more than the
        tolerance: a kernel that skipped it could not pass."""
        case = CASES[1]
        kw = inputs(case)
        full = np.asarray(reference.chunk_attention(**kw))
        short = np.asarray(reference.chunk_attention(
            **{**kw, "lengths": kw["lengths"] - api.BLOCK_K}))
        assert np.max(np.abs(full - short)) > 10 * self.TOLERANCE[case.dtype]

    def test_malformed_arrays_raise_value_errors(self):
        kw = inputs(CASES[0])
        for name, bad, match in (
                ("keys", kw["keys"][..., :-1], "keys must be"),
                ("values", kw["values"][:, :, :-1], "values must match keys"),
                ("values", kw["values"].astype(jnp.float16), "values must match keys"),
                ("lengths", kw["lengths"][:2], "lengths must be integers of shape"),
                ("lengths", kw["lengths"].astype(jnp.float32), "lengths must be integers"),
                ("q_positions", kw["q_positions"][:, :-1], "q_positions must be"),
                ("q", kw["q"][0], "q must be"),
                ("q", kw["q"].astype(jnp.int32), "q must be a float array"),
                ("layer", jnp.int32(0), "keys must be \\[L, B, K, S, D\\]"),
                ("sliding_window", 0, "sliding_window must be"),
                ("block_q", 24, "block_q must be a power of two"),
                ("block_k", 8, "block_k must be a power of two"),
                ("order", "heads", "order must be one of")):
            with pytest.raises(ValueError, match=match):
                api.chunk_attention(**{**kw, name: bad})


@pytest.mark.parametrize("window", [None, 1, 5, 40])
@pytest.mark.parametrize("block_k,slots", [(16, 100), (32, 20)])
def test_key_blocks_cover_what_rows_see_and_skip_masks_only_where_all_see(
        window, block_k, slots):
    """For every span of query positions ``first .. last`` and length: each key some row
    may see lies in blocks ``lo .. hi - 1``, and every key of the unmasked blocks
    ``u0 .. u1 - 1`` is seen by every row."""
    grid = np.array(list(itertools.product(range(0, 60, 3), range(0, 60, 4),
                                           range(0, slots + 1, 5))))
    first, span, length = grid.T
    last = first + span
    lo, u0, u1, hi = (np.broadcast_to(a, first.shape) for a in key_blocks(
        jnp.asarray(first), jnp.asarray(last), jnp.asarray(length), block_k=block_k,
        window=window, slots=slots))
    assert np.all((lo <= u0) & (u0 <= u1) & (u1 <= hi))
    s = np.arange(slots)[None, :]
    reach = window or 10**6
    # some position p in first .. last sees s: s <= p, s > p - window, s < length
    some = (s < length[:, None]) & (s <= last[:, None]) & (s > first[:, None] - reach)
    every = (s < length[:, None]) & (s <= first[:, None]) & (s > last[:, None] - reach)
    block = s // block_k
    assert not np.any(some & ((block < lo[:, None]) | (block >= hi[:, None])))
    unmasked = (block >= u0[:, None]) & (block < u1[:, None])
    assert np.all(every[unmasked])
    # and the walk is tight: the unmasked run is as long as whole visible blocks allow
    if slots >= block_k:
        whole = every.reshape(len(grid), -1)[:, :slots // block_k * block_k]
        whole = whole.reshape(len(grid), -1, block_k).all(-1).sum(-1)
        np.testing.assert_array_equal(u1 - u0, whole)
