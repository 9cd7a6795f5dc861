"""Tests of the needle-in-a-haystack task (kvjax.eval.needle) with a toy tokenizer, and
one real run of ``python -m kvjax needle`` with the embedded model."""

import json

import numpy as np
import pytest

from kvjax.cli import main
from kvjax.eval import needle as nd


class CharTokenizer:
    """One token per character (ids = code points): lengths are easy to reason about."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def encode_prompt(text, prefix):
    return CharTokenizer().encode(f"<user>{text}</user><assistant>{prefix}")


def haystack(n):
    line = "the quick brown fox\n"
    return CharTokenizer().encode((line * (n // len(line) + 1))[:n])


@pytest.mark.parametrize("text,number,expected", [
    (" 4829173.", "4829173", True),
    ("4829173", "4829173", True),
    (" 4829173 and 12", "4829173", True),
    (" 482917.", "4829173", False),        # cut short
    (" 48291730.", "4829173", False),      # one digit too many
    (" 4,829,173", "4829173", False),      # reformatted
    (" I do not know.", "4829173", False),
    ("", "4829173", False),
])
def test_exact_match_scoring(text, number, expected):
    assert nd.is_correct(text, number) is expected


def test_random_number_digits():
    rng = np.random.default_rng(0)
    numbers = [nd.random_number(rng) for _ in range(300)]
    assert {len(n) for n in numbers} == {6, 7, 8}
    assert all(n[0] != "0" and n.isdigit() for n in numbers)


def test_plant_at_line_breaks():
    hay = "aa\nbb\ncc\n"
    assert nd.plant(hay, "N", 0.0) == "aa\nN\nbb\ncc\n"
    assert nd.plant(hay, "N", 0.5) == "aa\nbb\nN\ncc\n"
    assert nd.plant(hay, "N", 1.0) == "aa\nbb\ncc\nN\n"
    assert nd.plant("no breaks", "N", 0.5) == "no breaks\nN\n"
    with pytest.raises(ValueError, match="depth"):
        nd.plant(hay, "N", 1.5)


def test_make_cases_lengths_depths_and_determinism():
    tok = CharTokenizer()
    kw = {"lengths": [300, 600], "depths": [0.0, 0.5, 1.0], "trials": 2, "seed": 3}
    cases = nd.make_cases(tok, encode_prompt, haystack(2000), **kw)
    assert len(cases) == 12
    assert cases == nd.make_cases(tok, encode_prompt, haystack(2000), **kw)
    other = nd.make_cases(tok, encode_prompt, haystack(2000), **{**kw, "seed": 4})
    assert [c.number for c in cases] != [c.number for c in other]
    for case in cases:
        text = tok.decode(case.prompt)
        assert nd.NEEDLE_TEMPLATE.format(number=case.number) in text
        assert text.endswith(nd.ANSWER_PREFIX) and nd.QUESTION in text
        # a character tokenizer: only the planting's line breaks change the length
        assert case.length <= len(case.prompt) <= case.length + 2
    # deeper needles sit later in the prompt
    first = [tok.decode(c.prompt).index("secret number is") for c in cases[:3]]
    assert first[0] < first[1] < first[2]


def test_make_cases_errors():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="no room"):
        nd.make_cases(tok, encode_prompt, haystack(1000), lengths=[50], depths=[0.5])
    with pytest.raises(ValueError, match="haystack has"):
        nd.make_cases(tok, encode_prompt, haystack(500), lengths=[400], depths=[0.5], trials=2)
    with pytest.raises(ValueError, match="depth"):
        nd.make_cases(tok, encode_prompt, haystack(1000), lengths=[400], depths=[-0.1])
    with pytest.raises(ValueError, match="trials"):
        nd.make_cases(tok, encode_prompt, haystack(1000), lengths=[400], depths=[0.5],
                      trials=0)


def test_run_needle_scores_a_hand_made_model():
    """A fake model that answers right only when the needle is in the first half of the
    prompt: accuracy must be 1 at depth 0 and 0 at depth 1, batched per length."""
    tok = CharTokenizer()
    cases = nd.make_cases(tok, encode_prompt, haystack(3000), lengths=[400, 800],
                          depths=[0.0, 1.0], trials=2)
    calls = []

    def generate(prompts):
        calls.append(len(prompts))
        out = []
        for p in prompts:
            text = tok.decode(p)
            at = text.index("secret number is ") + len("secret number is ")
            number = text[at:].split(".")[0]
            out.append(tok.encode(f" {number}." if at < len(text) / 2 else " 12345."))
        return out

    rows = nd.run_needle(cases, generate, tok.decode)
    assert calls == [4, 4]        # one batch per length
    assert [r["correct"] for r in rows] == [r["depth"] == 0.0 for r in rows]
    table = nd.accuracy_table([{"codec": "fake", **r} for r in rows])
    assert table.splitlines()[0] == "| codec | length | depth 0 | depth 1 | mean |"
    assert table.splitlines()[2] == "| fake | 400 | 1.00 | 0.00 | 0.50 |"
    assert nd.run_needle(cases, generate, tok.decode, batch_size=3) == rows
    assert calls[2:] == [3, 1, 3, 1]


def test_run_needle_rejects_wrong_output_count():
    tok = CharTokenizer()
    cases = nd.make_cases(tok, encode_prompt, haystack(1000), lengths=[400], depths=[0.5])
    with pytest.raises(ValueError, match="outputs"):
        nd.run_needle(cases, lambda prompts: [], tok.decode)


def test_needle_cli_real_model(capsys):
    args = ["needle", "--lengths", "160", "--depths", "0.5", "--trials", "1", "--json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["cache"] == "bf16" and rows[0]["length"] == 160
    # the embedded instruct model finds a number in a short haystack
    assert rows[0]["correct"], rows[0]


@pytest.mark.parametrize("args,needle", [
    (["--lengths", "9000"], "context"),
    (["--codec", "int:1"], "2..8"),
    (["--corpus", "no-such-corpus"], "no-such-corpus"),
    (["--depths", "2"], "depth"),
])
def test_needle_cli_bad_input_exits_2(capsys, args, needle):
    assert main(["needle", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
