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
        ("int:4 evict=snapkv:25%", "int:4 evict=snapkv:25%"),
        ("int:4 evict=snapkv:512,w32,p7", "int:4 evict=snapkv:512"),
        ("bf16 evict=h2o:12.5%,r16", "bf16 evict=h2o:12.5%,r16"),
        ("int:4 evict=snapkv:33.3333333%", "int:4 evict=snapkv:33.3333333%"),
        ("int:4 evict=snapkv:0.001%", "int:4 evict=snapkv:0.001%"),
        ("kivi:2,g32 evict=streaming:64,s2", "kivi:2,g32 evict=streaming:64,s2"),
        ("int:8 evict=all", "int:8 evict=all"),
        ("saw:kv,c256 fit=runs/fit-a", "saw:b4,kv,c256 fit=runs/fit-a"),
        ("k=saw:hess,b2 v=int:2 fit=/tmp/x window=4", "saw:b2,hess window=4 fit=/tmp/x"),
        ("int:4 layers[0]:k=saw:c16 fit=f", "int:4 layers[0]:k=saw:b4,c16 fit=f"),
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
    # a slice that selects nothing is refused alike: the rule would silently do nothing
    for select in ("2:1", "100:200", "-1:0"):
        with pytest.raises(CacheSpecError, match=f"the slice '{select}' selects no layer "
                                                 "of a model with 30 layers"):
            parse_cache(f"int:4 layers[{select}]:k=bf16").layer_codecs(30)
    assert parse_cache("int:4 layers[28:200]:k=bf16").layer_codecs(30)[29][0].spec == "bf16"


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
        ("int:4,med3x window=8", "outlier multiplier C must be a number"),
        ("nope:1", "unknown codec 'nope'"),
        ("k=int:4 k=int:2", "k is given twice"),
        ("int:4 attn=", "at least one implementation"),
        ("int:4 evict=lru:5", "unknown eviction policy 'lru'"),
        ("int:4 evict=h2o", "give a budget"),
        ("int:4 evict=h2o:0", "positive token count or a share"),
        ("int:4 evict=h2o:150%", "positive token count or a share"),
        ("int:4 evict=snapkv:9,p4", "pooling width must be odd"),
        ("int:4 evict=h2o:9,w4", "bad option 'w4'; h2o takes rN"),
        ("int:4 evict=all:50%", "takes no budget"),
        ("int:4 evict=all evict=all", "evict is given twice"),
    ],
)
def test_bad_specs_are_one_line_errors_that_say_what_is_valid(text, message):
    with pytest.raises(CacheSpecError, match=message) as err:
        parse_cache(text)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, CodecError) and isinstance(err.value, ValueError)


#: the outlier wrapper's usage, which every error about its options ends with
OUTLIER_USAGE = "; usage: SPEC,medC[,mbN][,mpP][,mpool] with C in (0, 10000]"


@pytest.mark.parametrize(
    ("spec", "cause"),
    [
        # a number that is not one: the option's rule, not the base codec's
        ("int:4,med3x", "outlier multiplier C must be a number in (0, 10000], got '3x'"),
        ("int:4,med-3", "outlier multiplier C must be a number in (0, 10000], got '-3'"),
        ("int:4,med1e3", "got '1e3'"),
        ("int:4,med3.5.2", "got '3.5.2'"),
        ("int:4,med", "outlier multiplier C must be a number in (0, 10000], got ''"),
        ("int:4,med0", "got '0'"),
        ("hqmq:s24,med_3", "got '_3'"),
        ("int:4,med3,mb-2", "outlier block N must be an integer in 1..1024, got '-2'"),
        ("int:4,med3,mb8.5", "got '8.5'"),
        ("int:4,med3,mp5%", "outlier capacity % P must be a number in (0, 100], got '5%'"),
        # a misspelled outlier option: unknown to the wrapper, not a second bit width
        ("int:4,medx", "unknown option 'medx'; known: med, mb, mp, mpool"),
        ("int:4,mbx", "unknown option 'mbx'; known: med, mb, mp, mpool"),
        ("kivi:2,token,medium", "unknown option 'medium'; known: med, mb, mp, mpool"),
        # options of the wrapper without its multiplier, or twice, or on a codec it
        # cannot wrap
        ("int:4,mb8", "expected medC"),
        ("int:4,med3,med4", "option 'med' given twice"),
        ("kivi:2,med3", "needs a lossy token-wise codec"),
    ],
)
def test_malformed_outlier_options_report_their_cause(spec, cause):
    with pytest.raises(CodecError) as err:
        parse_codec(spec)
    message = str(err.value)
    assert message.startswith(f"{spec}: ") and cause in message, message
    assert OUTLIER_USAGE in message and "\n" not in message


def test_outlier_options_after_a_codec_without_options_need_the_colon():
    with pytest.raises(CodecError) as err:
        parse_codec("hqmq,med3")
    assert "options follow a ':' after the codec name, e.g. 'hqmq:med3'" in str(err.value)
    assert parse_codec("hqmq:med3").spec == "hqmq:s96,r4,med3"


@pytest.mark.parametrize(
    ("spec", "cause"),
    [
        # a prefix followed by a non-letter is that option with a bad value
        ("kivi:2,g3x", "group size G must be an integer in 1..4096, got '3x'"),
        ("hyperquant:e8,3bps,t2x", "tokens per block N must be an integer in 1..256, got '2x'"),
        # Python's int() and float() would read these
        ("int:+4", "bit width N must be an integer in 2..8, got '+4'"),
        ("int:4_0", "got '4_0'"),
        ("hyperquant:e8,3bps,m1e1", "margin X must be a number in 0..20, got '1e1'"),
        # a prefix followed by a letter is another word
        ("kivi:2,gx", "unknown option 'gx'"),
    ],
)
def test_malformed_option_values_name_the_option(spec, cause):
    with pytest.raises(CodecError) as err:
        parse_codec(spec)
    assert cause in str(err.value), str(err.value)


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


@pytest.mark.parametrize("spec,clause", [("int:4 window=2147483648", "window"),
                                         ("int:4 sinks=1073741825", "sinks"),
                                         ("int:4 page=2147483648", "page")])
def test_token_counts_past_the_bound_are_refused_before_they_overflow(spec, clause):
    with pytest.raises(CacheSpecError, match=rf"{clause}=\d+ is past the most tokens"):
        parse_cache(spec)
    assert parse_cache("int:4 window=1073741824").residual_window == 2**30


@pytest.mark.parametrize("spec,message", [
    ("int:4 fit=runs/x", "no codec of this cache takes any"),
    ("saw:c16 fit=", "fit= takes a directory"),
    ("saw:c16 fit=a fit=b", "given twice"),
])
def test_a_fit_clause_needs_a_codec_that_takes_it(spec, message):
    with pytest.raises(CacheSpecError, match=message):
        parse_cache(spec)


def test_needs_fit_follows_every_codec_of_the_cache():
    assert not parse_cache("saw:b4").needs_fit
    assert parse_cache("saw:b4,c1").needs_fit
    assert not parse_cache("saw:b4,c16").v.needs_fit  # V is int:4 unless kv
    assert parse_cache("int:4 layers[-1]:v=saw:kv,hess").needs_fit


@pytest.mark.parametrize("index", range(40))
def test_a_layer_rule_selects_what_python_indexing_selects_or_is_one_line(index):
    from tests.fuzz import rng

    g = rng("layer_rule", index)
    num_layers = int(g.integers(1, 40))

    def item():
        kind = g.integers(4)
        if kind == 0:
            return str(int(g.integers(-50, 50)))
        if kind == 1:
            bounds = [str(int(g.integers(-50, 50))) if g.random() < 0.7 else ""
                      for _ in range(int(g.integers(2, 4)))]
            return ":".join(bounds)
        return str(g.choice(["", "x", "1.5", "2:3:0", "::", "-0", "1_0"]))

    select = ",".join(item() for _ in range(int(g.integers(1, 4))))
    text = f"int:4 layers[{select}]:k=bf16"
    try:
        config = parse_cache(text)
        pairs = config.layer_codecs(num_layers)
    except CacheSpecError as err:
        assert "\n" not in str(err)
        return
    want = set()
    for part in select.split(","):
        if ":" in part:
            bounds = [int(b) if b else None for b in part.split(":")]
            chosen = range(num_layers)[slice(*bounds)]
            assert chosen  # a slice selecting nothing is refused
            want |= set(chosen)
        else:
            i = int(part)
            assert -num_layers <= i < num_layers
            want.add(i % num_layers)
    assert {i for i, (k, _) in enumerate(pairs) if k.spec == "bf16"} == want
