"""Seeded fuzzing of the mesh grammar and of a mesh's splits: every text is a mesh of
positive sizes that prints back to itself, or one ``MeshError`` line; a split either
divides or names each count that does not."""

import jax
import pytest

from kvjax.sharding import MeshError, check_split, describe, make_mesh, parse_mesh
from tests.fuzz import example_count, rng

NAMES = ("data", "model", "Data", "mdl", "", " data ")
SIZES = ("1", "2", "3", "4", "8", "0", "-1", "1_0", "٣", "2.0", " 2", "", "x",
         "99999999999999999999", "+2")


def _text(g) -> str:
    parts = []
    for _ in range(int(g.integers(0, 4))):
        name, size = str(g.choice(NAMES)), str(g.choice(SIZES))
        parts.append(name if g.random() < 0.1 else f"{name}={size}")
    return str(g.choice([",", ", ", ",,"])).join(parts)


@pytest.mark.parametrize("index", range(example_count(200)))
def test_a_mesh_text_parses_to_positive_sizes_or_is_one_line(index):
    g = rng("mesh_text", index)
    text = _text(g)
    try:
        sizes = parse_mesh(text)
    except MeshError as err:
        assert "\n" not in str(err)
        return
    assert set(sizes) == {"data", "model"} and min(sizes.values()) >= 1
    assert all(type(v) is int for v in sizes.values())
    devices = jax.devices()
    try:
        mesh = make_mesh(text)
    except MeshError as err:
        assert sizes["data"] * sizes["model"] > len(devices) and "\n" not in str(err)
        return
    assert parse_mesh(describe(mesh)) == sizes
    rows, heads = int(g.integers(1, 17)), int(g.integers(1, 17))
    try:
        check_split(mesh, rows=rows, kv_heads=heads)
    except MeshError as err:
        message = str(err)
        assert (rows % sizes["data"] != 0) == (f"{rows} row" in message)
        assert (heads % sizes["model"] != 0) == (f"{heads} kv heads" in message)
    else:
        assert rows % sizes["data"] == 0 and heads % sizes["model"] == 0
