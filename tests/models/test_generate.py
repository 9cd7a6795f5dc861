"""Jitted generation on a tiny random llama: correctness, compile-once, batching, sampling.

The cache stores raw tokens in float32 and encodes with ``bf16`` unless a test says
otherwise. Compile time dominates, so most tests share shapes (B=1 or B=3 prompts,
``max_len=MAX_LEN``) and hit :mod:`models.generate`'s compiled-function table.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import dense, stored_bits
from kvjax.checkpoint import CheckpointError
from kvjax.spec import CacheConfig, parse_cache
from models import generate as gen
from models.config import ModelConfig
from models.llama import (
    decode_layout,
    forward,
    init_params,
    logits_no_cache,
    new_cache,
    unstack_layers,
)

CONFIG = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=64)
BF16 = CacheConfig(k="bf16", v="bf16")
MAX_LEN, NEW = 48, 32
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def params():
    return init_params(jax.random.PRNGKey(0), CONFIG)


def _generate(params, prompts, **kw):
    kw = {"cache_config": BF16, "max_new_tokens": NEW, "max_len": MAX_LEN,
          "cache_dtype": jnp.float32, **kw}
    return gen.generate(params, CONFIG, prompts, **kw)


def _cache_lengths_ok(result, prompts, max_new=NEW):
    # a row that ran to max_new fed back all its tokens but the last; a row stopped by
    # EOS fed back all of its (EOS-free) tokens and never the EOS itself
    expected = [len(p) + len(t) - (len(t) == max_new)
                for p, t in zip(prompts, result.tokens, strict=True)]
    return np.asarray(result.cache.lengths).tolist() == expected


@pytest.fixture(scope="module")
def batch_result(params):
    return _generate(params, PROMPTS)


def test_greedy_matches_repeated_full_forwards(params):
    prompt = PROMPTS[0]
    result = _generate(params, [prompt])
    assert len(result.tokens[0]) == NEW
    assert _cache_lengths_ok(result, [prompt])
    # reference: a fresh full forward over the growing sequence for every new token;
    # right padding to one width keeps one compiled shape and, being causal, changes
    # nothing at the last real position
    seq = list(prompt)
    width = len(prompt) + NEW
    for _ in range(NEW):
        padded = np.zeros((1, width), np.int32)
        padded[0, : len(seq)] = seq
        logits = logits_no_cache(params, CONFIG, jnp.asarray(padded), BF16)
        seq.append(int(np.argmax(np.asarray(logits)[0, len(seq) - 1])))
    assert result.tokens[0] == seq[len(prompt) :]
    assert result.prefill_s > 0 and result.decode_s > 0 and result.decode_tok_per_s > 0
    assert result.cache_bytes > 0


@pytest.mark.parametrize("chunk", [2, 5])
def test_chunked_prefill_gives_the_same_tokens(params, batch_result, chunk):
    before = gen.TRACE_COUNTS["prefill"]
    result = _generate(params, PROMPTS, prefill_chunk=chunk)
    assert result.tokens == batch_result.tokens
    assert _cache_lengths_ok(result, PROMPTS)
    assert gen.TRACE_COUNTS["prefill"] - before <= 1   # one compiled chunk shape


def test_decode_compiles_once(params):
    shapes = {"max_new_tokens": 8}
    before = gen.TRACE_COUNTS.copy()
    first = _generate(params, [[1, 2, 3, 4]], **shapes)
    after_first = gen.TRACE_COUNTS.copy()
    second = _generate(params, [[9, 8, 7, 6]], **shapes)
    assert after_first["decode"] - before["decode"] == 1
    # the B=1 prefill may already be compiled by another test (prompts share a bucket)
    assert after_first["prefill"] - before["prefill"] <= 1
    assert gen.TRACE_COUNTS == after_first
    assert first.compile_s > 0 and second.compile_s < first.compile_s
    assert first.decode_compile_s > 0 and first.compile_s == (
        first.prefill_compile_s + first.decode_compile_s)
    assert first.tokens != second.tokens


def programs_at_allocation(monkeypatch, generate):
    """The names of the programs compiled when each cache of ``generate()`` was
    allocated, and the programs compiled in all."""
    monkeypatch.setattr(gen, "_COMPILED", {})
    seen, real = [], gen.new_cache

    def new_cache(*args, **kw):
        seen.append(sorted(key[0] for key in gen._COMPILED))
        return real(*args, **kw)

    monkeypatch.setattr(gen, "new_cache", new_cache)
    generate()
    return seen, sorted(key[0] for key in gen._COMPILED)


@pytest.mark.parametrize("spec,prefill", [("bf16", "prefill"),
                                          ("bf16 evict=h2o:16", "prefill_observed")])
def test_both_programs_compile_before_the_cache_exists(params, monkeypatch, spec, prefill):
    """XLA's compile-time buffers (autotuning's among them) never sit beside the cache;
    the decode compiled ahead is the one that runs (compiled once)."""
    seen, compiled = programs_at_allocation(
        monkeypatch, lambda: _generate(params, PROMPTS, cache_config=parse_cache(spec),
                                       max_new_tokens=8))
    assert seen and all(names == ["decode", prefill] for names in seen)
    assert compiled == ["decode", prefill]


@pytest.mark.parametrize("every", [1, 3])
def test_done_checked_every_few_steps_gives_the_same_tokens(params, batch_result,
                                                              monkeypatch, every):
    """Steps run in blocks between checks for finished rows; a last, padded block (NEW
    = 32 is no multiple of 3) neither records tokens nor writes the cache."""
    monkeypatch.setattr(gen, "CHECK_EVERY", every)
    monkeypatch.setattr(gen, "_COMPILED", {})
    jax.clear_caches()  # the block size is read when the loop is traced
    try:
        got = _generate(params, PROMPTS)
        assert got.tokens == batch_result.tokens and _cache_lengths_ok(got, PROMPTS)
        eos = batch_result.tokens[0][6]
        cut = _generate(params, PROMPTS, eos_token_ids=[eos])
        assert cut.tokens[0] == batch_result.tokens[0][:6]
        assert _cache_lengths_ok(cut, PROMPTS)
    finally:
        jax.clear_caches()


def test_batch_rows_equal_single_prompts(params, batch_result):
    assert _cache_lengths_ok(batch_result, PROMPTS)
    for prompt, tokens in zip(PROMPTS, batch_result.tokens, strict=True):
        assert _generate(params, [prompt]).tokens[0] == tokens


def test_eos_stops_a_row(params, batch_result):
    row0 = batch_result.tokens[0]
    eos = row0[6]
    assert eos not in row0[:6]
    result = _generate(params, PROMPTS, eos_token_ids=[eos])
    assert result.tokens[0] == row0[:6]
    for full, cut in zip(batch_result.tokens, result.tokens, strict=True):
        assert cut == (full[: full.index(eos)] if eos in full else full)
    assert _cache_lengths_ok(result, PROMPTS)


def test_sampling_reproducible_and_seeded(params, batch_result):
    kw = {"temperature": 0.9, "top_p": 0.95}
    a = _generate(params, PROMPTS, seed=3, **kw)
    b = _generate(params, PROMPTS, seed=3, **kw)
    c = _generate(params, PROMPTS, seed=4, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert a.tokens != batch_result.tokens
    assert all(0 <= t < CONFIG.vocab_size for row in a.tokens for t in row)
    # a nucleus that holds only the most likely token is greedy decoding
    narrow = _generate(params, PROMPTS, seed=3, temperature=0.9, top_p=1e-6)
    assert narrow.tokens == batch_result.tokens


@pytest.mark.parametrize("spec", ["int:4", "kivi:2,g4"])
def test_compressed_codecs_run(params, spec):
    cache_config = parse_cache(spec, residual_window=4)
    result = _generate(params, [PROMPTS[2]], cache_config=cache_config, max_new_tokens=16,
                       cache_dtype=jnp.bfloat16)
    assert len(result.tokens[0]) == 16
    assert _cache_lengths_ok(result, [PROMPTS[2]], max_new=16)
    bits = stored_bits(result.cache)["bits_per_element"]
    assert bits < 16


@pytest.mark.parametrize(("prompts", "kw", "match"), [
    ([], {}, "no prompts"),
    ([[1, 2], []], {}, "prompt 1 is empty"),
    ([[1, 200]], {}, "outside"),
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens"),
    ([[1, 2]], {"prefill_chunk": 0}, "prefill_chunk"),
    ([[1, 2]], {"temperature": -0.5}, "temperature"),
    ([[1, 2]], {"temperature": float("nan")}, "temperature"),
    ([[1, 2]], {"top_p": 0.0}, "top_p"),
    ([[1, 2]], {"top_p": 1.5}, "top_p"),
    ([[1] * 40], {"max_new_tokens": 10}, "capacity"),
    ([[1] * 40], {"max_new_tokens": 30, "max_len": 100}, "max_position_embeddings"),
])
def test_bad_inputs(params, prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        _generate(params, prompts, **kw)


def test_per_layer_weights_give_the_same_tokens(params, batch_result):
    result = _generate(unstack_layers(params), PROMPTS)
    assert result.tokens == batch_result.tokens
    assert _cache_lengths_ok(result, PROMPTS)


@pytest.mark.parametrize("spec,kernel,prefill", [("int:4", "int_decode", "int_decode"),
                                                 ("bf16", "dense_decode", "chunk")])
def test_the_optimized_loop_gives_the_reference_loops_tokens(params, spec, kernel, prefill,
                                                              monkeypatch):
    """The loop as a GPU runs it (the decode layout's weights, done-checks in blocks, the
    decode through the fused kernel and the prefill chunks through a fused kernel too:
    int:4's read its codes in place, bf16's go through the flash kernel; here in Pallas
    interpret mode) against the reference loop (stacked weights, reference attention):
    the same greedy tokens."""
    tokens = {}
    optimized = (*(("chunk_flash",) if prefill == "chunk" else ()), kernel, "reference")
    for name, layers, attention in (("reference", params, ("reference",)),
                                    ("kernel", decode_layout(params), optimized)):
        monkeypatch.setattr(gen, "_COMPILED", {})
        result = _generate(layers, PROMPTS, max_new_tokens=8, cache_dtype=jnp.bfloat16,
                           cache_config=CacheConfig(k=spec, v=spec, attention=attention))
        tokens[name] = result.tokens
        programs = {key[0]: c.as_text() for key, c in gen._COMPILED.items()}
        # the kernels really ran: the decode's in the loop, the prefill's in the prefill
        assert (f"{kernel}_attention" in programs["decode"]) == (name == "kernel")
        assert (f"{prefill}_attention" in programs["prefill"]) == (name == "kernel")
    assert tokens["kernel"] == tokens["reference"]


@pytest.mark.parametrize("spec,kernel", [("int:4", "int_decode"), ("bf16", "chunk_flash")])
def test_flash_prefill_logits_match_the_reference(params, spec, kernel):
    """A prompt prefilled through a fused kernel (interpret mode: the flash kernel over a
    bf16 cache, the INT kernel reading int:4 codes in place) gives the reference
    attention's next-token logits to within its 16-bit operands (int:4's codes of later
    layers move with the rounding), and the same token."""
    prompt = jnp.asarray([PROMPTS[2]])
    logits = {}
    for attention in (("reference",), (kernel,)):
        cache = new_cache(CONFIG, CacheConfig(k=spec, v=spec, attention=attention),
                          batch=1, max_len=MAX_LEN, dtype=jnp.bfloat16)
        logits[attention[0]] = np.asarray(forward(params, CONFIG, prompt, cache)[0][0, -1])
    np.testing.assert_allclose(logits[kernel], logits["reference"], atol=0.05)
    assert not np.array_equal(logits[kernel], logits["reference"])  # really the kernel
    assert logits[kernel].argmax() == logits["reference"].argmax()


def _weights_temp_bytes(intermediate: int, per_layer: bool) -> int:
    """XLA's temporary bytes for the compiled decode loop of a float32 model (no dtype
    conversion of the weights on a CPU), its layers stacked or per layer."""
    config = ModelConfig(family="llama", vocab_size=64, hidden_size=64,
                         intermediate_size=intermediate, num_layers=3, num_heads=2,
                         num_kv_heads=2, head_dim=32, max_position_embeddings=256)
    weights = init_params(jax.random.key(0), config)
    weights = unstack_layers(weights) if per_layer else weights
    cache = new_cache(config, BF16, batch=2, max_len=256)
    compiled = gen._decode_jit.lower(
        weights, config, None, 4, True, jnp.zeros((2, 64), jnp.float32), cache,
        jnp.asarray((-1,), jnp.int32), jax.random.key(1), jnp.float32(1), jnp.float32(1),
    ).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_per_layer_weights_are_read_in_place():
    """Per-layer weights feed the decode step's matmuls as they are: the compiled loop's
    temporaries do not grow with the MLP's weights (6 MiB a layer here). Control:
    stacked weights, whose per-layer slices the compiler materializes."""
    layer_bytes = 3 * 64 * 8192 * 4
    per_layer = _weights_temp_bytes(8192, True) - _weights_temp_bytes(256, True)
    stacked = _weights_temp_bytes(8192, False) - _weights_temp_bytes(256, False)
    assert per_layer < 0.05 * layer_bytes
    assert stacked > 0.9 * layer_bytes


def _decode_temp_bytes(num_layers: int, spec: str) -> tuple[int, int]:
    """(XLA's temporary bytes for the compiled decode loop, bytes of the cache's codes)."""
    config = ModelConfig(family="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_layers=num_layers, num_heads=2, num_kv_heads=2, head_dim=128,
                         max_position_embeddings=8192)
    weights = init_params(jax.random.key(0), config, jnp.bfloat16)
    cache = new_cache(config, parse_cache(spec), batch=2, max_len=8192)
    codes = sum(x.nbytes for seg in cache.segments for store in (seg.k, seg.v)
                for x in jax.tree.leaves(store.codes))
    compiled = gen._decode_jit.lower(
        weights, config, None, 4, True, jnp.zeros((2, 64), jnp.float32), cache,
        jnp.asarray((-1,), jnp.int32), jax.random.key(1), jnp.float32(1), jnp.float32(1),
    ).compile()
    return compiled.memory_analysis().temp_size_in_bytes, codes


@pytest.mark.parametrize("spec", ["int:4", "bf16"])
def test_decode_updates_the_cache_in_place(spec):
    """A decode step writes its token into the cache's buffers without copying them: the
    compiled loop's temporaries do not grow with the layers' codes (scanning the cache
    as scan inputs and outputs made them grow by more than the codes themselves, and a
    bfloat16 scatter was widened to float32 over the whole stack)."""
    temp_small, codes_small = _decode_temp_bytes(2, spec)
    temp_large, codes_large = _decode_temp_bytes(12, spec)
    assert codes_large - codes_small > 40 * 2**20
    assert temp_large - temp_small < 0.25 * (codes_large - codes_small)


# -- eviction: the prompt prefilled exactly, then kept in part (kvjax.eviction) ----------


@pytest.mark.parametrize("spec", ["f32 evict=all", "f32 evict=snapkv:100%",
                                  "f32 evict=h2o:100%"])
def test_an_eviction_that_keeps_every_token_changes_nothing(params, spec):
    base = _generate(params, PROMPTS, cache_config=parse_cache("f32"), max_new_tokens=8)
    kept = _generate(params, PROMPTS, cache_config=parse_cache(spec), max_new_tokens=8,
                     prefill_chunk=4)  # the observed attention sums over chunks
    assert kept.tokens == base.tokens
    assert kept.cache.evicted.tolist() == [0, 0, 0]


def test_observed_prefill_chunks_sum_to_the_whole_prompts_attention(params):
    config = parse_cache("f32 evict=h2o:50%")
    whole = gen.prefill(params, CONFIG, PROMPTS, cache_config=config, max_len=MAX_LEN,
                        cache_dtype=jnp.float32)
    chunked = gen.prefill(params, CONFIG, PROMPTS, cache_config=config, max_len=MAX_LEN,
                          cache_dtype=jnp.float32, chunk=4)
    assert whole.cache.lengths.tolist() == [3, 2, 5]
    assert whole.cache.evicted.tolist() == [2, 1, 4]
    np.testing.assert_allclose(whole.logits, chunked.logits, rtol=1e-5, atol=1e-5)
    for i in range(CONFIG.num_layers):
        np.testing.assert_allclose(
            dense(whole.cache.layer(i).k, whole.cache.lengths),
            dense(chunked.cache.layer(i).k, chunked.cache.lengths), rtol=1e-6, atol=1e-6)


def test_tokens_after_an_eviction_sit_at_their_true_positions():
    # one layer: the prompt's K/V do not depend on attention, so keeping the last w - 1
    # prompt tokens must equal a sliding window of w over the whole cache (in which the
    # next token also sees itself), provided the next token takes position n
    one = dataclasses.replace(CONFIG, num_layers=1)
    window = 4
    params = init_params(jax.random.PRNGKey(3), one)
    prompt = [5, 17, 99, 3, 42, 8, 9, 10, 11, 12]
    nxt = jnp.asarray([[77]])
    evicted = gen.prefill(params, one, [prompt],
                          cache_config=parse_cache(f"f32 evict=streaming:{window - 1},s0"),
                          max_len=16, room=1, cache_dtype=jnp.float32).cache
    assert evicted.evicted.tolist() == [len(prompt) - window + 1]
    got, _ = forward(params, one, nxt, evicted)
    windowed = dataclasses.replace(one, sliding_window=window)
    cache = new_cache(windowed, parse_cache("f32"), batch=1, max_len=16, dtype=jnp.float32)
    _, cache = forward(params, windowed, jnp.asarray([prompt]), cache)
    want, _ = forward(params, windowed, nxt, cache)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # and a wrong position (the stored count) gives other logits
    shifted = dataclasses.replace(evicted, evicted=jnp.zeros_like(evicted.evicted))
    wrong, _ = forward(params, one, nxt, shifted)
    assert np.abs(np.asarray(wrong) - np.asarray(want)).max() > 1e-3


# -- prompt caches on disk ---------------------------------------------------------------


@pytest.mark.parametrize("spec", ["bf16", "kivi:2,g32 window=4", "int:4 evict=h2o:50%"])
def test_a_stored_prompt_decodes_as_if_never_stopped(params, tmp_path, spec):
    kw = {"cache_config": parse_cache(spec), "max_new_tokens": 12, "seed": 3}
    whole = _generate(params, PROMPTS, **kw, save_prompt=tmp_path / "p")
    stored = gen.load_prompt_cache(tmp_path / "p", params=params, config=CONFIG)
    assert stored.prompts == PROMPTS and stored.seed == 3 and stored.disk_bytes > 0
    resumed = gen.decode(params, CONFIG, stored.prefill, max_new_tokens=12, seed=3)
    assert resumed.tokens == whole.tokens
    for a, b in zip(jax.tree.leaves(whole.cache), jax.tree.leaves(resumed.cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    sampled = {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 5}
    runs = [gen.decode(params, CONFIG, gen.load_prompt_cache(
        tmp_path / "p", params=params, config=CONFIG).prefill, **sampled).tokens
        for _ in range(2)]
    assert runs[0] == runs[1]


def test_a_stored_prompt_refuses_another_model_and_too_many_tokens(params, tmp_path):
    _generate(params, PROMPTS, max_new_tokens=4, save_prompt=tmp_path / "p")
    other = init_params(jax.random.PRNGKey(1), CONFIG)
    with pytest.raises(CheckpointError, match="model: checkpoint has"):
        gen.load_prompt_cache(tmp_path / "p", params=other, config=CONFIG)
    stored = gen.load_prompt_cache(tmp_path / "p", params=params, config=CONFIG)
    with pytest.raises(ValueError, match="room for"):
        gen.decode(params, CONFIG, stored.prefill, max_new_tokens=MAX_LEN)


def _edits(record):
    """Edits a user might make to a prompt cache's kvjax.json, each a function of the
    record (seeded: the same every run)."""
    meta = record["metadata"]
    name = sorted(record["arrays"])[0]
    return {
        "seed a string": lambda r: r["metadata"].update(seed="3"),
        "seed a float": lambda r: r["metadata"].update(seed=3.5),
        "seed 2**70": lambda r: r["metadata"].update(seed=2**70),
        "seed null": lambda r: r["metadata"].update(seed=None),
        "no seed": lambda r: r["metadata"].pop("seed"),
        "no prompts": lambda r: r["metadata"].pop("prompts"),
        "prompts a string": lambda r: r["metadata"].update(prompts="hello"),
        "a prompt too few": lambda r: r["metadata"].update(prompts=meta["prompts"][:-1]),
        "a token past the vocabulary": lambda r: r["metadata"].update(
            prompts=[[CONFIG.vocab_size], *meta["prompts"][1:]]),
        "metadata a list": lambda r: r.update(metadata=[1, 2]),
        "arrays a list": lambda r: r.update(arrays=[1, 2]),
        "a shape of strings": lambda r: r["arrays"][name].update(shape=["a"]),
        "a dtype unknown": lambda r: r["arrays"][name].update(dtype="float99"),
        "a digest missing": lambda r: r["arrays"][name].pop("sha256"),
    }


def test_an_edited_prompt_cache_description_is_one_checkpoint_error(params, tmp_path):
    import json as json_

    _generate(params, PROMPTS, max_new_tokens=4, save_prompt=tmp_path / "p")
    file = tmp_path / "p" / "kvjax.json"
    original = file.read_text()
    for what, edit in _edits(json_.loads(original)).items():
        record = json_.loads(original)
        edit(record)
        file.write_text(json_.dumps(record))
        with pytest.raises(CheckpointError) as caught:
            gen.load_prompt_cache(tmp_path / "p", params=params, config=CONFIG)
        assert len(str(caught.value).splitlines()) == 1, what
    file.write_text(original)
    assert gen.load_prompt_cache(tmp_path / "p", params=params, config=CONFIG).seed == 0


def test_the_model_fingerprint_follows_the_weights_not_their_layout(params):
    print_ = gen.model_fingerprint(CONFIG, params)
    assert gen.model_fingerprint(CONFIG, unstack_layers(params)) == print_
    as_bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    assert gen.model_fingerprint(CONFIG, as_bf16) == print_
    other = init_params(jax.random.PRNGKey(1), CONFIG)
    assert gen.model_fingerprint(CONFIG, other) != print_
    wider = dataclasses.replace(CONFIG, max_position_embeddings=128)
    assert gen.model_fingerprint(wider, params) != print_


# -- a batch that does not fit --------------------------------------------------------------

EXHAUSTED = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 34735783936 bytes."


class _Exhausted:
    """A compiled program that XLA could not find the memory to run."""

    def __init__(self, compiled, message=EXHAUSTED):
        self.compiled, self.message = compiled, message

    def __getattr__(self, name):  # memory_analysis, out_info: the real program's
        return getattr(self.compiled, name)

    def __call__(self, *args):
        raise jax.errors.JaxRuntimeError(self.message)


@pytest.mark.parametrize("message,expected", [
    (EXHAUSTED, 34735783936),
    ("RESOURCE_EXHAUSTED: Failed to allocate request for 32.35GiB (34735783936B) on device "
     "ordinal 0", 34735783936),
    # XLA 0.11.2's words on an H100, compiling a prefill whose attention scores take 256 GiB
    ("RESOURCE_EXHAUSTED: Failed to get configs for: 7 out of 44 instructions. See logs for "
     "all failures. Example failure: \nOut of memory while trying to allocate 256.02GiB with "
     "allocator GPU_0_bfc on device 0. [tf-allocator-allocation-error='']",
     round(256.02 * 2**30)),
    ("RESOURCE_EXHAUSTED: the device is busy", None),
])
def test_the_bytes_xla_asked_for_are_read_from_its_message(message, expected):
    assert gen.requested_bytes(message) == expected


def test_a_decode_that_does_not_fit_is_one_line(params, batch_result, monkeypatch):
    real = gen._compiled

    def compiled(name, *args):
        program = real(name, *args)
        return _Exhausted(program) if name == "decode" else program

    monkeypatch.setattr(gen, "_compiled", compiled)
    with pytest.raises(gen.OutOfMemoryError) as caught:
        _generate(params, PROMPTS)
    err = caught.value
    message = str(err)
    assert isinstance(err, MemoryError) and len(message.splitlines()) == 1
    assert message.startswith(f"decode does not fit in device memory at batch 3, context "
                              f"{MAX_LEN} tokens")
    assert "XLA could not allocate 34735783936 bytes (32.35 GiB)" in message
    # the compiled loop's own sizes: the donated cache comes back in place
    sizes = err.program_bytes
    assert sizes["temp"] > 0 and sizes["alias"] > 0
    assert f"temporaries {gen._size(sizes['temp'])}" in message
    assert "free on the device: unknown" in message and err.free is None  # a CPU
    assert "try a smaller batch" in message and "prefill chunk" not in message
    assert (err.program, err.batch, err.context, err.requested) == (
        "decode", 3, MAX_LEN, 34735783936)
    assert isinstance(err.__cause__, jax.errors.JaxRuntimeError)


def test_a_prefill_that_does_not_compile_names_its_chunk(params, monkeypatch):
    def compiled(name, *args):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Failed to allocate request for 1.50GiB (1610612736B)")

    monkeypatch.setattr(gen, "_compiled", compiled)
    with pytest.raises(gen.OutOfMemoryError, match=(
            r"^prefill does not fit in device memory at batch 3, context 48 tokens \(prompts "
            r"of 16 tokens, 8 at a time\); XLA could not allocate 1610612736 bytes "
            r"\(1.50 GiB\); free on the device: unknown; try a smaller batch, a shorter "
            r"context, a smaller prefill chunk or a more compressed cache")):
        _generate(params, PROMPTS, prefill_chunk=8)
    # another runtime error is not a memory error
    monkeypatch.undo()
    real = gen._compiled
    monkeypatch.setattr(gen, "_compiled",
                        lambda *args: _Exhausted(real(*args), "INTERNAL: boom"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: boom"):
        _generate(params, PROMPTS)


class _Device:
    def __init__(self, name, stats):
        self.name, self.stats = name, stats

    def memory_stats(self):
        return self.stats

    def __str__(self):
        return self.name


def test_the_free_bytes_are_the_least_free_devices():
    tight = _Device("gpu:1", {"bytes_limit": 2**31, "bytes_in_use": 2**31 - 3 * 2**20})
    roomy = _Device("gpu:0", {"bytes_limit": 2**31, "bytes_in_use": 2**20})
    assert gen.free_bytes([roomy, tight]) == (3 * 2**20, tight)
    assert gen.free_bytes([roomy, _Device("cpu:0", None)]) == (None, None)
    err = gen.out_of_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: no room"),
                            "decode", batch=8, context=4096, devices=[roomy, tight])
    assert err.free == 3 * 2**20
    assert "bytes needed: unknown; 3145728 bytes (3.00 MiB) free on gpu:1;" in str(err)
    err = gen.out_of_memory(jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.50GiB"), "prefill",
        batch=8, context=4096)
    assert "; XLA could not allocate about 2.50 GiB; free on the device: unknown;" in str(err)
    assert err.requested == 5 * 2**29


def test_the_free_bytes_are_taken_before_the_program_runs():
    """A failed program has released its donated cache by the time the error arrives:
    the message gives the bytes free when it started, not after."""
    device = _Device("gpu:0", {"bytes_limit": 2**34, "bytes_in_use": 2**34 - 2**30})
    boundary = gen._MemoryBoundary("prefill", batch=13, context=32784, mesh=None)
    boundary.devices = [device]
    with pytest.raises(gen.OutOfMemoryError) as caught, boundary:
        boundary.compiled = None  # the program about to run, its arguments allocated
        device.stats = {"bytes_limit": 2**34, "bytes_in_use": 2**32}  # the cache released
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying "
                                         "to allocate 26.01GiB")
    assert caught.value.free == 2**30
    assert "1073741824 bytes (1.00 GiB) free on gpu:0 when the program started;" in str(
        caught.value)


@pytest.mark.parametrize("spec", ["int:4 window=4", "int:4 evict=snapkv:50%"])
def test_a_paged_cache_generates_what_the_contiguous_one_does(params, spec):
    prompts = [list(range(1, 40)), list(range(5, 20))]
    kw = {"max_new_tokens": 8, "eos_token_ids": (), "prefill_chunk": 16, "max_len": None}
    contiguous = _generate(params, prompts, cache_config=parse_cache(spec), **kw)
    paged = _generate(params, prompts, cache_config=parse_cache(spec + " page=16"), **kw)
    assert paged.tokens == contiguous.tokens
    assert paged.cache.pages is not None and paged.cache.config.page_tokens == 16


def test_a_paged_prompt_cache_resumes_as_generated(params, tmp_path):
    prompts = [list(range(1, 30)), list(range(5, 20))]
    kw = {"max_new_tokens": 6, "eos_token_ids": (), "max_len": 40}
    config = parse_cache("int:4 window=4 page=16")
    whole = gen.generate(params, CONFIG, prompts, cache_config=config,
                         save_prompt=tmp_path / "prompt", **kw)
    stored = gen.load_prompt_cache(tmp_path / "prompt", params=params, config=CONFIG)
    np.testing.assert_array_equal(stored.prefill.cache.pages, whole.cache.pages)
    resumed = gen.decode(params, CONFIG, stored.prefill, max_new_tokens=6, eos_token_ids=())
    assert resumed.tokens == whole.tokens


# -- scoring -----------------------------------------------------------------------------


def test_scores_are_the_log_probs_of_the_whole_sequence(params):
    continuations = [[4, 60, 61], [100], [9, 8, 7, 6, 5]]
    f32 = CacheConfig(k="f32", v="f32")
    got = gen.score(params, CONFIG, PROMPTS, continuations, cache_config=f32,
                    cache_dtype=jnp.float32, prefill_chunk=4)
    for prompt, cont, lp in zip(PROMPTS, continuations, got.log_probs, strict=True):
        seq = jnp.asarray([prompt + cont])
        logp = jax.nn.log_softmax(logits_no_cache(params, CONFIG, seq)[0], axis=-1)
        want = [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(cont)]
        np.testing.assert_allclose(lp, want, rtol=1e-4, atol=1e-4)
    assert got.totals == pytest.approx([float(np.sum(lp)) for lp in got.log_probs])
    np.testing.assert_array_equal(got.cache.lengths, [len(p) + len(c) - 1 for p, c in
                                                      zip(PROMPTS, continuations, strict=True)])


def test_a_compressed_prompt_scores_near_the_exact_one_and_greedy_tokens_score_highest(
        params, batch_result):
    greedy = [t[:6] for t in batch_result.tokens]
    exact = gen.score(params, CONFIG, PROMPTS, greedy, cache_config=BF16,
                      cache_dtype=jnp.float32)
    packed = gen.score(params, CONFIG, PROMPTS, greedy, cache_config=parse_cache("int:8"),
                       cache_dtype=jnp.float32)
    for a, b in zip(exact.log_probs, packed.log_probs, strict=True):
        np.testing.assert_allclose(a, b, atol=5e-2)
    # a greedy token is the most likely one: no other token scores above it
    other = [[(t + 1) % CONFIG.vocab_size for t in g] for g in greedy]
    worse = gen.score(params, CONFIG, PROMPTS, [[o[0]] for o in other], cache_config=BF16,
                      cache_dtype=jnp.float32)
    for a, b in zip(exact.log_probs, worse.log_probs, strict=True):
        assert a[0] >= b[0]


@pytest.mark.parametrize("continuations, match", [
    ([[1], [2]], "3 prompts but 2 continuations"),
    ([[1], [], [2]], "at least one token"),
    ([[1], [2], [128]], r"continuation token ids must be in 0..127"),
    ([[1] * 60, [2], [3]], "max_position_embeddings"),
])
def test_bad_scoring_input_is_refused(params, continuations, match):
    with pytest.raises(ValueError, match=match):
        gen.score(params, CONFIG, PROMPTS, continuations, cache_config=BF16)


def test_generated_tokens_come_with_their_log_probs(params, batch_result):
    result = batch_result
    assert [len(lp) for lp in result.log_probs] == [len(t) for t in result.tokens]
    # greedy: each token is the argmax, and its log-prob is what scoring the same
    # tokens after the prompt gives (the first exactly: the prefill's logits)
    scored = gen.score(params, CONFIG, PROMPTS, result.tokens, cache_config=BF16,
                       cache_dtype=jnp.float32)
    for got, want in zip(result.log_probs, scored.log_probs, strict=True):
        assert got.dtype == np.float32 and np.all(got <= 0)
        np.testing.assert_allclose(got, want, atol=2e-3)
    sampled = _generate(params, PROMPTS, temperature=1.5, seed=4)
    assert all(np.all(lp <= 0) and np.isfinite(lp).all() for lp in sampled.log_probs)
