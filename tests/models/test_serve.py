"""The continuous-batching engine on a tiny random llama: each request's greedy tokens
are generate's alone, rows refill without recompiling, admission waits for pages,
sampling follows the request's seed, bad requests are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import init_cache, put_rows, reset_rows, take_rows
from kvjax.paging import OutOfPagesError
from kvjax.spec import parse_cache
from models import generate as gen
from models.config import ModelConfig
from models.llama import init_params
from models.serve import MAX_STOP, Engine, Request

CONFIG = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=128, eos_token_ids=(3,))
MAX_LEN, CHUNK = 64, 8
_rng = np.random.default_rng(0)
#: more requests than rows, prompts shorter and longer than a chunk
PROMPTS = [_rng.integers(4, 128, n).tolist() for n in (5, 19, 3, 33, 12)]
NEW = [9, 4, 12, 6, 10]


@pytest.fixture(scope="module")
def params():
    return init_params(jax.random.PRNGKey(0), CONFIG)


def _engine(params, spec, **kw):
    kw = {"rows": 3, "max_len": MAX_LEN, "chunk": CHUNK, "cache_dtype": jnp.float32, **kw}
    return Engine(params, CONFIG, parse_cache(spec), **kw)


def _alone_result(params, spec, prompt, new, **kw):
    return gen.generate(params, CONFIG, [prompt], cache_config=parse_cache(spec),
                        max_new_tokens=new, max_len=MAX_LEN, prefill_chunk=CHUNK,
                        cache_dtype=jnp.float32, **kw)


def _alone(params, spec, prompt, new, **kw):
    return _alone_result(params, spec, prompt, new, **kw).tokens[0]


@pytest.mark.parametrize("spec", [
    "bf16",                                               # contiguous rows
    "int:4 page=16",                                      # the INT codes in pages
    "k=saw:h16 v=turboquant:b4 window=4 sinks=2 center=first page=32",  # every row state
])
def test_each_request_gets_the_tokens_generate_gives_it_alone(params, spec):
    engine = _engine(params, spec, decode_steps=2)
    events = []
    done = engine.run([Request(p, n, stop=()) for p, n in zip(PROMPTS, NEW, strict=True)],
                      on_event=events.append)
    for prompt, new, completion in zip(PROMPTS, NEW, done, strict=True):
        alone = _alone_result(params, spec, prompt, new, eos_token_ids=())
        assert completion.tokens == alone.tokens[0]
        assert completion.reason == "length" and len(completion.token_times) == new
        # each token's log-probability as generate records it alone
        np.testing.assert_allclose(completion.log_probs, alone.log_probs[0], atol=1e-4)
    # streamed in order, each request's done event after its tokens
    for completion in done:
        mine = [e for e in events if e.id == completion.id]
        assert [e.token for e in mine[:-1]] == completion.tokens
        assert [e.log_prob for e in mine[:-1]] == completion.log_probs
        assert all(lp <= 0 for lp in completion.log_probs)
        assert mine[-1].done and mine[-1].token is None and mine[-1].log_prob is None
    # what stays held is the prompt prefixes kept for sharing, and nothing else
    assert engine.idle and engine.pages_used == engine.cached_pages


@pytest.mark.parametrize("spec", ["bf16", "int:4 window=4 page=16"])
def test_one_prompt_row_a_step_among_many_gives_the_same_tokens(params, spec):
    """prefill_rows=1: each step feeds one row's chunk, the others wait or decode."""
    engine = _engine(params, spec, prefill_rows=1)
    done = engine.run([Request(p, n, stop=()) for p, n in zip(PROMPTS, NEW, strict=True)])
    for prompt, new, completion in zip(PROMPTS, NEW, done, strict=True):
        assert completion.tokens == _alone(params, spec, prompt, new, eos_token_ids=())
    with pytest.raises(ValueError, match=r"prefill_rows must be an int in 1\.\.rows=3"):
        _engine(params, spec, prefill_rows=4)


def test_rows_taken_out_and_put_back_change_only_themselves():
    for spec in ("int:4 window=4 sinks=2 center=first", "int:4 window=4 page=16"):
        cache = init_cache(jax.random.PRNGKey(0), parse_cache(spec), num_layers=2, batch=4,
                           num_kv_heads=2, head_dim=16, max_len=40)
        cache = jax.tree.map(lambda a: jnp.asarray(
            np.random.default_rng(0).integers(0, 3, a.shape)).astype(a.dtype), cache)
        rows = jnp.asarray([2, 0])
        part = take_rows(cache, rows)
        assert part.batch == 2
        back = put_rows(cache, rows, part)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(cache), strict=True):
            np.testing.assert_array_equal(a, b)
        moved = put_rows(cache, rows, jax.tree.map(
            lambda a: ~a if a.dtype == jnp.bool_ else a + 1, part))
        np.testing.assert_array_equal(moved.lengths, cache.lengths + np.asarray([1, 0, 1, 0]))
        raw, was = np.asarray(moved.segments[0].k.raw), np.asarray(cache.segments[0].k.raw)
        np.testing.assert_array_equal(raw[:, [1, 3]], was[:, [1, 3]])
        np.testing.assert_array_equal(raw[:, [0, 2]], was[:, [0, 2]] + 1)


def test_rows_are_refilled_without_compiling_again(params, monkeypatch):
    monkeypatch.setattr(gen, "_COMPILED", {})
    engine = _engine(params, "int:4 page=16", rows=2)
    programs = dict(gen._COMPILED)
    # both compiled with the engine, before its cache existed
    assert sorted(key[0] for key in programs) == ["engine_decode", "engine_prefill"]
    traced = gen.TRACE_COUNTS.copy()
    engine.run([Request(p, n, stop=()) for p, n in zip(PROMPTS, NEW, strict=True)])
    engine.run([Request(PROMPTS[0], 3, stop=())])
    assert gen._COMPILED == programs and gen.TRACE_COUNTS == traced


def test_admission_waits_for_pages_in_arrival_order(params):
    spec = "int:4 page=16"
    engine = _engine(params, spec, num_pages=3)
    requests = [Request(PROMPTS[3], 6, stop=()), Request(PROMPTS[0], 9, stop=()),
                Request(PROMPTS[2], 12, stop=())]
    assert [engine.pages_needed(r) for r in requests] == [3, 1, 1]
    ids = [engine.submit(r) for r in requests]
    peak = 0
    while not engine.idle:
        engine.step()
        peak = max(peak, engine.pages_used)
        assert engine.pages_used <= 3
    assert engine.pages_used == engine.cached_pages
    done = [engine.completions[i] for i in ids]
    # the first held every page: the others waited for it, then ran side by side
    assert done[1].admitted >= done[0].finished and done[2].admitted >= done[0].finished
    assert done[1].admitted == done[2].admitted and peak == 3
    for request, completion in zip(requests, done, strict=True):
        assert completion.tokens == _alone(params, spec, list(request.prompt),
                                           request.max_new_tokens, eos_token_ids=())
    with pytest.raises(OutOfPagesError, match="4 needed"):
        engine.submit(Request(PROMPTS[3], 30, stop=()))


def test_stop_tokens_end_a_request_and_are_not_returned(params):
    want = _alone(params, "bf16", PROMPTS[1], 12, eos_token_ids=())
    stop = want[5]
    cut = want[:want.index(stop)]
    engine = _engine(params, "bf16")
    named, default = engine.run([Request(PROMPTS[1], 12, stop=(stop,)),
                                 Request(PROMPTS[1], 12)])
    assert named.tokens == cut and named.reason == "stop"
    # without stop=, the model's end-of-sequence tokens stop it, as generate's default
    assert default.tokens == _alone(params, "bf16", PROMPTS[1], 12)


def test_sampling_follows_the_request_seed_not_its_neighbours(params):
    def sample(seed, others):
        engine = _engine(params, "int:4 page=16")
        requests = [Request(PROMPTS[0], 10, temperature=0.8, top_p=0.9, seed=seed, stop=())]
        requests += [Request(p, 5, temperature=1.0, seed=9, stop=()) for p in others]
        return engine.run(requests)[0].tokens

    alone = sample(1, [])
    assert sample(1, PROMPTS[1:4]) == alone
    assert sample(2, []) != alone


def test_bad_requests_and_engines_are_refused(params):
    engine = _engine(params, "int:4 page=16", num_pages=2)
    for request, match in [
        (Request([], 4), "non-empty"),
        (Request([1, 500], 4), "token ids must lie in 0..127"),
        (Request([1, 2], 0), "max_new_tokens must be a positive int"),
        (Request([1] * 60, 6), "need 65 slots; a row holds 64"),
        (Request([1, 2], 4, temperature=float("nan")), "temperature"),
        (Request([1, 2], 4, top_p=0.0), "top_p"),
        (Request([1, 2], 4, stop=tuple(range(MAX_STOP + 1))), f"at most {MAX_STOP} stop"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.submit(request)
    with pytest.raises(OutOfPagesError):
        engine.submit(Request([1] * 40, 10))
    assert engine.idle
    with pytest.raises(ValueError, match="evict"):
        _engine(params, "bf16 evict=h2o:16")
    with pytest.raises(ValueError, match="not paged"):
        _engine(params, "int:4", num_pages=4)
    with pytest.raises(ValueError, match="rows must be a positive int"):
        _engine(params, "bf16", rows=0)


def test_reset_rows_empties_the_rows_named_and_no_other():
    cc = parse_cache("int:4 window=4 sinks=2 center=first")
    cache = init_cache(jax.random.PRNGKey(0), cc, num_layers=2, batch=3, num_kv_heads=2,
                       head_dim=16, max_len=32)
    # every row as if written: ones everywhere a row keeps state
    used = jax.tree.map(jnp.ones_like, cache)
    reset = reset_rows(used, jnp.asarray([True, False, True]))
    (seg,), (was,) = reset.segments, used.segments
    for store, before in ((seg.k, was.k), (seg.v, was.v)):
        for name, empty in (("raw", 0), ("sink", 0), ("nonfinite", False),
                            ("saturated", 0), ("shift", 0)):
            got = getattr(store, name)
            if got is None:
                continue
            got = np.asarray(got)
            assert (got[:, [0, 2]] == empty).all(), name
            np.testing.assert_array_equal(got[:, 1], np.asarray(getattr(before, name))[:, 1])
        # codes stay: nothing reads past a row's length
        for a, b in zip(jax.tree.leaves(store.codes),
                        jax.tree.leaves(before.codes), strict=True):
            np.testing.assert_array_equal(a, b)
    assert seg.k.shift is not None
    np.testing.assert_array_equal(reset.lengths, [0, 1, 0])
    np.testing.assert_array_equal(reset.overflowed, [False, True, False])
    np.testing.assert_array_equal(reset.evicted, [0, 1, 0])


def test_requests_share_the_pages_of_a_common_prompt_prefix(params):
    """A system prompt of 40 tokens: its 2 whole pages are fed once and read by every
    later request; the tokens stay those each request gets alone."""
    spec = "int:4 page=16"
    system = PROMPTS[3][:40] if len(PROMPTS[3]) >= 40 else (PROMPTS[3] * 2)[:40]
    prompts = [system + PROMPTS[i] for i in (0, 2, 4)]
    requests = [Request(p, 6, stop=()) for p in prompts]
    shared = _engine(params, spec, rows=1)
    got = shared.run(requests)
    for prompt, completion in zip(prompts, got, strict=True):
        assert completion.tokens == _alone(params, spec, prompt, 6, eos_token_ids=())
    total = sum(len(p) for p in prompts)
    assert shared.shared_tokens == 2 * 32  # the later two each skip 2 pages
    assert shared.prefilled_tokens == total - shared.shared_tokens
    alone = _engine(params, spec, rows=1, share_prefixes=False)
    assert [c.tokens for c in alone.run(requests)] == [c.tokens for c in got]
    assert alone.shared_tokens == 0 and alone.prefilled_tokens == total
    assert alone.cached_pages == 0 and alone.pages_used == 0
    # a raw window keeps the newest tokens outside the pages: nothing is shared
    windowed = _engine(params, "int:4 window=4 page=16", rows=1)
    windowed.run(requests)
    assert windowed.shared_tokens == 0 and not windowed.sharing


def test_kept_prefixes_give_their_pages_back_when_a_request_needs_them(params):
    engine = _engine(params, "int:4 page=16", rows=1, num_pages=4)
    engine.run([Request(PROMPTS[3], 6, stop=())])   # 33 prompt tokens: 2 pages kept
    assert engine.cached_pages == 2 and engine.pool.free == 2
    # 40 + 12 - 1 tokens need 4 pages: the kept prefix is dropped to make room
    (done,) = engine.run([Request(PROMPTS[1] * 2 + PROMPTS[0] + [9, 9, 9], 12, stop=())])
    assert len(done.tokens) == 12 and engine.pages_used <= 4
