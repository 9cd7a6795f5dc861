"""Seeded fuzzing of the eviction clause: every text either parses to a policy whose
canonical spec parses back to it, keeps at least one and at most the prompt's tokens,
and says the same in ``capacity`` and ``kept``, or is one ``CacheSpecError`` line."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.eviction import MAX_TOKENS, Eviction
from kvjax.spec import CacheSpecError, parse_cache
from tests.fuzz import example_count, rng

POLICIES = ("h2o", "snapkv", "streaming", "all", "lru", "")
LETTERS = ("r", "w", "p", "s", "x", "")


def _number(g: np.random.Generator) -> str:
    kind = g.integers(9)
    if kind == 0:
        return str(int(g.integers(1, 2**12)))
    if kind == 1:
        return str(int(g.integers(0, 2)) * MAX_TOKENS + int(g.integers(-2, 3)))
    if kind == 2:
        return str(2 ** int(g.integers(30, 80)))
    if kind == 3:
        return f"{g.uniform(0, 100):.{int(g.integers(0, 12))}f}%"
    if kind == 4:
        return f"{10 ** g.uniform(-12, 2.5):.{int(g.integers(1, 18))}g}%"
    if kind == 5:
        return f"{1 / g.integers(1, 999) * 100!r}%"
    return str(g.choice(["nan%", "inf%", "-5%", "0%", "1_0%", " 5%", "5", "0", "%", "1e999%",
                         "0x10", "٣", "12.5%%", "1e-400%", "100%", "100.0000001%"]))


def _clause(g: np.random.Generator) -> str:
    policy = str(g.choice(POLICIES))
    if policy == "all" and g.random() < 0.7:
        return "all"
    opts = [_number(g)] + [f"{g.choice(LETTERS)}{_number(g).rstrip('%')}"
                           for _ in range(int(g.integers(0, 3)))]
    return f"{policy}:{','.join(opts)}"


@pytest.mark.parametrize("index", range(example_count(300)))
def test_an_eviction_clause_parses_round_trips_and_keeps_what_it_says(index):
    g = rng("eviction_clause", index)
    text = f"int:4 evict={_clause(g)}"
    try:
        config = parse_cache(text)
    except CacheSpecError as err:
        assert "\n" not in str(err) and "evict=" in str(err)
        return
    policy = config.evict
    assert isinstance(policy, Eviction)
    assert parse_cache(config.spec) == config, (text, config.spec)
    assert "e" not in config.evict.spec.split(":", 1)[-1].split(",")[0]  # 50%, not 5e+01%
    lengths = np.sort(g.integers(1, 2**16, 4))
    for n in lengths:
        cap = policy.capacity(int(n))
        assert 1 <= cap <= n
    kept = np.asarray(policy.kept(jnp.asarray(lengths, jnp.int32)))
    caps = np.asarray([policy.capacity(int(n)) for n in lengths])
    np.testing.assert_array_equal(kept, caps)
