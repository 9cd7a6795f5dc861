"""Seeded fuzzing of the key transforms' inputs: calibration files (mutated bytes, odd
arrays) load or give one line naming the file; first chunks with huge or non-finite
keys leave a finite centre, flag what was left out, and store every later clean
key as a clean first chunk would."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kc
from kvjax import centering
from kvjax.spec import parse_cache
from tests.fuzz import example_count, rng

SHAPE = (2, 3, 16)  # layers, kv heads, head dim


def _good_bytes(tmp_path) -> bytes:
    good = tmp_path / "good.npz"
    centering.KeyCalibration(center=np.zeros(SHAPE), rms=np.ones(SHAPE), tokens=9).save(good)
    return good.read_bytes()


def _odd_array(g: np.random.Generator):
    kind = g.integers(8)
    shape = tuple(int(n) for n in g.integers(0, 4, g.integers(0, 4)))
    if kind == 0:
        return g.standard_normal(SHAPE)
    if kind == 1:
        return g.standard_normal(shape)
    if kind == 2:
        return np.full(SHAPE, g.choice([np.nan, np.inf, -np.inf, 1e38, -1.0]))
    if kind == 3:
        return np.array(["x"] * int(g.integers(1, 4)))
    if kind == 4:
        return np.array(int(g.integers(-5, 2**40)))
    if kind == 5:
        return np.zeros(SHAPE, g.choice([np.int8, np.uint64, np.float16, np.bool_]))
    if kind == 6:
        return np.array([1.5, 2.5])
    return np.complex64(1 + 2j) * np.ones(SHAPE)


@pytest.mark.parametrize("index", range(example_count(60)))
def test_a_calibration_file_loads_or_is_one_line_naming_it(tmp_path, index):
    g = rng("calibration_file", index)
    path = tmp_path / f"case{index}.npz"
    if g.random() < 0.5:  # a real file with bytes changed, cut or added
        data = bytearray(_good_bytes(tmp_path))
        for _ in range(int(g.integers(1, 8))):
            op = g.integers(3)
            at = int(g.integers(0, len(data)))
            if op == 0:
                data[at] = int(g.integers(256))
            elif op == 1:
                del data[at:]
            else:
                data[at:at] = g.bytes(int(g.integers(1, 32)))
        path.write_bytes(bytes(data))
    else:  # an archive of odd arrays under the right or wrong names
        names = [str(n) for n in g.choice(["center", "rms", "tokens", "x"],
                                          size=int(g.integers(0, 5)), replace=False)]
        np.savez(path, **{n: _odd_array(g) for n in names})
    try:
        calibration = centering.KeyCalibration.load(path)
    except ValueError as err:
        message = str(err)
        assert "\n" not in message and str(path) in message, message
        return
    assert np.isfinite(calibration.center).all() and (calibration.rms >= 0).all()
    assert calibration.center.shape == calibration.rms.shape
    assert calibration.tokens >= 0


def _first_chunk(g: np.random.Generator, tokens: int):
    """K/V ``[B=2, T, K=2, D=32]`` with offset channels; keys spoiled at random places."""
    k = g.standard_normal((2, tokens, 2, 32)).astype(np.float32)
    k[..., 5] += 30.0
    v = g.standard_normal((2, tokens, 2, 32)).astype(np.float32)
    bad = k.copy()
    spoiled = np.zeros(2, bool)
    # robust statistics hold while fewer than half the counted tokens are spoiled
    for _ in range(int(g.integers(0, 4 if tokens > 8 else 2))):
        row, t = int(g.integers(2)), int(g.integers(1, tokens))  # token 0 is not counted
        head, dim = int(g.integers(2)), int(g.integers(32))
        kind = g.integers(4)
        if kind == 0:
            bad[row, t, head, dim] = g.choice([-1.0, 1.0]) * 10 ** g.uniform(4, 30)
            spoiled[row] = True
        elif kind == 1:
            bad[row, t, head, dim] = g.choice([np.nan, np.inf, -np.inf])
        elif kind == 2:
            bad[row, t, head] = bad[row, t, head] * 10 ** g.uniform(3, 6)
            spoiled[row] = True
        else:
            bad[row, t, head] = np.nan  # a whole key
    return k, bad, v, spoiled


@pytest.mark.parametrize("index", range(example_count(8)))
def test_a_spoiled_first_chunk_leaves_later_keys_as_a_clean_one_does(index):
    g = rng("spoiled_first_chunk", index)
    tokens = int(g.choice([5, 16, 48]))
    clean, bad, v, spoiled = _first_chunk(g, tokens)
    spec = str(g.choice(["int:4 center=first", "f32 center=first smooth=first"]))
    later = jnp.asarray(_first_chunk(g, 16)[0])
    later_v = jnp.asarray(g.standard_normal((2, 16, 2, 32)), jnp.float32)
    errors = []
    for keys in (clean, bad):
        cache = kc.init_cache(jax.random.key(0), parse_cache(spec), num_layers=1, batch=2,
                              num_kv_heads=2, head_dim=32, max_len=tokens + 16,
                              dtype=jnp.float32)
        for chunk, values in ((jnp.asarray(keys), jnp.asarray(v)), (later, later_v)):
            step = kc.make_step(cache, chunk.shape[1])
            cache = kc.commit(cache.with_layer(0, kc.append(cache.layer(0), chunk, values,
                                                             step)), step)
        store = cache.layer(0).k
        assert np.isfinite(np.asarray(store.shift, np.float32)).all()
        if store.scale is not None:
            assert np.isfinite(np.asarray(store.scale, np.float32)).all()
        got = np.asarray(kc.dense(store, cache.lengths, restore_keys=True))[:, :, tokens:]
        want = np.asarray(jnp.swapaxes(later, 1, 2))
        errors.append(np.sqrt(np.sum((got - want) ** 2, axis=(1, 2, 3))
                              / np.sum(want ** 2, axis=(1, 2, 3))))
        flags = np.bitwise_or.reduce(np.asarray(store.saturated), axis=0)
    outlying = (flags & kc.STATISTICS_OUTLIERS) != 0
    # a key 1e4 times its channel's spread is always left out and flagged
    assert (outlying >= spoiled).all(), (outlying, spoiled)
    assert (errors[1] <= 1.5 * errors[0] + 0.02).all(), errors
