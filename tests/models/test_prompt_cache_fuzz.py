"""Seeded fuzzing of a stored prompt cache's description (``kvjax.json``): whatever
field is changed to whatever JSON value, loading it gives the prompt cache that was
saved or one ``CheckpointError`` line, never another exception."""

import json
import shutil

import jax
import numpy as np
import pytest

from kvjax.checkpoint import METADATA_FILE, CheckpointError
from kvjax.spec import parse_cache
from models import generate as gen
from models.config import ModelConfig
from models.llama import init_params
from tests.fuzz import example_count, rng

CONFIG = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     max_position_embeddings=64)
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    params = init_params(jax.random.PRNGKey(0), CONFIG)
    path = tmp_path_factory.mktemp("prompt") / "p"
    pre = gen.prefill(params, CONFIG, PROMPTS, cache_config=parse_cache("int:4 window=2"),
                      max_len=24)
    gen.save_prompt_cache(path, pre, params=params, config=CONFIG, prompts=PROMPTS, seed=7)
    return params, path, json.loads((path / METADATA_FILE).read_text())


def _odd_value(g: np.random.Generator):
    return [None, True, -1, 0, 2**70, -(2**63), 1.5, float("nan"), "", "x", "float32",
            "0" * 64, [], [1, 2], [[1, 2]], {}, {"shape": [1], "dtype": "int8"},
            [[-3]], [[128]], [["1"]], [[True]]][int(g.integers(21))]


def _paths(node, prefix=()):
    """Every (path to a value) of a JSON tree, leaves and containers."""
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node[:3]):
            yield from _paths(value, (*prefix, i))


@pytest.mark.parametrize("index", range(example_count(40)))
def test_an_edited_description_loads_as_saved_or_is_one_line(tmp_path, saved, index):
    params, path, record = saved
    g = rng("prompt_cache_record", index)
    edited = json.loads(json.dumps(record))
    paths = [p for p in _paths(edited) if p]
    for _ in range(int(g.integers(1, 3))):
        where = paths[int(g.integers(len(paths)))]
        node = edited
        try:
            for key in where[:-1]:
                node = node[key]
            if g.random() < 0.2 and isinstance(node, dict):
                del node[where[-1]]
            else:
                node[where[-1]] = _odd_value(g)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit replaced a container on this path
    copy = tmp_path / "p"
    shutil.copytree(path, copy)
    (copy / METADATA_FILE).write_text(json.dumps(edited))
    try:
        stored = gen.load_prompt_cache(copy, params=params, config=CONFIG)
    except CheckpointError as err:
        assert "\n" not in str(err), str(err)
        return
    # what loads is what was saved
    assert stored.prompts == PROMPTS and stored.seed == 7
