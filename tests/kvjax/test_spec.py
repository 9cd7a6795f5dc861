"""kvjax.spec: the grammar of whole caches (codecs, window, sinks, layer rules, attention)."""

from __future__ import annotations

import dataclasses

import pytest

from kvjax.codec import CodecError
from kvjax.spec import CacheConfig, CacheSpecError, LayerRule, parse_cache, parse_codec


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("int:4", "int:4"),
        ("k=int:4", "int:4"),
        ("k=int:4 v=int:4", "int:4"),
        ("kivi:2,g32", "kivi:2,g32"),
        ("kivi:2, g32", "kivi:2,g32"),
        ("k=kivi:2,g32 v=kivi:2,g32,token", "kivi:2,g32"),
        ("k=kivi:2,g32 v=int:4", "k=kivi:2,g32 v=int:4"),
        ("sinks=4 window=32 kivi:2,g32", None),  # the bare codec must come first
        ("kivi:2,g32 sinks=4 window=32", "kivi:2,g32 window=32 sinks=4"),
        ("int:4 layers[0,-1]:k=bf16", "int:4 layers[0,-1]:k=bf16"),
        ("int:4 layers[ 0, -1 ]:k=bf16", None),  # spaces split clauses
        ("int:4 layers[4:12]:kv=int:2 layers[::2]:v=int:8", None),
        ("int:4 attn=int_decode,xla,reference", "int:4 attn=int_decode,xla,reference"),
        ("int:4 attn=auto", "int:4"),
        ("hqmq:s96,r4,med3 window=8", "hqmq:s96,r4,med3 window=8"),
    ],
)
def test_specs_parse_and_print_canonically(text, canonical):
    if canonical is None and text.startswith(("sinks", "int:4 layers[ 0")):
        with pytest.raises(CacheSpecError):
            parse_cache(text)
        return
    config = parse_cache(text)
    if canonical is not None:
        assert config.spec == canonical
    assert parse_cache(config.spec) == config
    assert parse_cache(config.spec).spec == config.spec


def test_one_spec_gives_v_the_value_codec():
    config = parse_cache("kivi:2,g32")
    assert config.k == parse_codec("kivi:2,g32")
    assert config.v == parse_codec("kivi:2,g32,token")
    assert CacheConfig(k="kivi:2,g32") == config


def test_layer_rules_apply_in_order_and_later_rules_win():
    config = parse_cache("int:4 layers[0:4]:kv=int:2 layers[0,-1]:k=bf16 layers[2]:v=int:8")
    pairs = [(k.spec, v.spec) for k, v in config.layer_codecs(6)]
    assert pairs == [
        ("bf16", "int:2"), ("int:2", "int:2"), ("int:2", "int:8"), ("int:2", "int:2"),
        ("int:4", "int:4"), ("bf16", "int:4"),
    ]


def test_layer_selections_accept_indices_and_slices():
    rule = LayerRule(select="0,-1,3:5,::4", role="k", codec="bf16")
    assert rule.layers(10) == {0, 9, 3, 4, 8}
    assert rule.spec == "layers[0,-1,3:5,::4]:k=bf16"


def test_layer_out_of_range_is_caught_against_the_model():
    config = parse_cache("int:4 layers[7]:k=bf16")
    with pytest.raises(CacheSpecError, match="names layer 7, the model has 3 layers"):
        config.layer_codecs(3)
    assert len(config.layer_codecs(8)) == 8


def test_defaults_fill_what_the_spec_does_not_say():
    config = parse_cache("int:4", residual_window=32, sink_tokens=2)
    assert (config.residual_window, config.sink_tokens) == (32, 2)
    with pytest.raises(CacheSpecError, match="already sets residual_window"):
        parse_cache("int:4 window=8", residual_window=32)
    same = parse_cache(config)
    assert same is config
    assert parse_cache(config, residual_window=4) == dataclasses.replace(config,
                                                                           residual_window=4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty cache spec"),
        ("   ", "empty cache spec"),
        ("foo=1", "unknown clause 'foo=1'"),
        ("int:4 int:2", "only the first clause may be a bare codec spec"),
        ("int:4 window=-1", "expected a non-negative integer"),
        ("int:4 window=x", "expected a non-negative integer"),
        ("int:4 window=+3", "expected a non-negative integer"),
        ("int:4 sinks=1_0", "expected a non-negative integer"),
        ("int:4 window=\u0663", "expected a non-negative integer"),
        ("v=int:4", "names no K codec"),
        ("int:4 layers[x]:k=bf16", "bad layer selection 'x'"),
        ("int:4 layers[]:k=bf16", "empty layer selection"),
        ("int:4 layers[1:2:0]:k=bf16", "bad layer selection"),
        ("int:4 layers[0]:q=bf16", "bad layer rule"),
        ("int:4 layers[0]k=bf16", "bad layer rule"),
        ("int:99", "bit width N must be an integer in 2..8"),
        ("nope:1", "unknown codec 'nope'"),
        ("k=int:4 k=int:2", "k is given twice"),
        ("int:4 attn=", "at least one implementation"),
    ],
)
def test_bad_specs_are_one_line_errors_that_say_what_is_valid(text, message):
    with pytest.raises(CacheSpecError, match=message) as err:
        parse_cache(text)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, CodecError) and isinstance(err.value, ValueError)


def test_unknown_clause_lists_the_valid_clauses():
    with pytest.raises(CacheSpecError) as err:
        parse_cache("int:4 windw=3")
    for clause in ("k=CODEC", "v=CODEC", "window=N", "sinks=N", "layers[SEL]", "attn="):
        assert clause in str(err.value)


def test_bad_fields_of_a_directly_built_config():
    with pytest.raises(CacheSpecError, match="residual_window"):
        CacheConfig(k="int:4", residual_window=-1)
    with pytest.raises(CacheSpecError, match="sink_tokens"):
        CacheConfig(k="int:4", sink_tokens=True)
    with pytest.raises(CacheSpecError, match="LayerRule"):
        CacheConfig(k="int:4", layers=("0:k=bf16",))
    with pytest.raises(CacheSpecError, match="role"):
        LayerRule(select="0", role="q", codec="bf16")
