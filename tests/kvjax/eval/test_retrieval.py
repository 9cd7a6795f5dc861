"""Tests of the long-context retrieval suite (kvjax.eval.retrieval) with a toy tokenizer
and fake models."""

import itertools
import json
import re

import numpy as np
import pytest

from kvjax.eval import retrieval as rt
from kvjax.eval.sweep import config_slug
from tests.kvjax.eval.test_needle import CharTokenizer, encode_prompt

WORDS = ("amber bridge cedar dune ember fjord grove heron inlet juniper kestrel lagoon "
         "maple nectar osprey prairie quartz raven spruce tundra umber valley willow "
         "yarrow zephyr").split()


def haystack(n, seed=0):
    """Lines of corpus-like words (varied, so the common-words task has a vocabulary)."""
    rng = np.random.default_rng(seed)
    text, lines = "", []
    while len(text) < n:
        lines.append(" ".join(rng.choice(WORDS, 6)))
        text = "\n".join(lines) + "\n"
    return CharTokenizer().encode(text[:n])


def cases(**kw):
    args = {"lengths": [900, 1200], "depths": [0.2, 0.8], "trials": 1, "seed": 3, **kw}
    return rt.make_cases(CharTokenizer(), encode_prompt, haystack(4000), **args)


def text_of(case):
    return CharTokenizer().decode(case.prompt)


def test_every_task_length_and_depth_fits_its_length():
    got = cases()
    assert len(got) == len(rt.TASKS) * 2 * 2
    assert [c.task for c in got[::4]] == list(rt.TASKS)
    for c in got:
        room = c.length - rt.ANSWER_ROOM
        assert room - 10 <= len(c.prompt) <= room, (c.task, c.length, len(c.prompt))
        assert c.expected and all(isinstance(e, str) for e in c.expected)


def test_cases_are_deterministic_under_the_seed():
    assert cases() == cases()
    other = cases(seed=4)
    assert [c.expected for c in other] != [c.expected for c in cases()]


def test_needles_are_planted_and_the_queried_one_at_its_depth():
    for c in cases(tasks=["passkey", "single", "multikey", "multivalue", "vartrack"]):
        text = text_of(c)
        for e in c.expected:
            assert e in text
        if c.task in ("single", "multikey", "multivalue"):
            magic = re.findall(r"special magic numbers for (\w+) is: (\d+)\.", text)
            assert len(magic) == (1 if c.task == "single" else rt.NUM_NEEDLES)
            keys = {k for k, _ in magic}
            assert len(keys) == (1 if c.task in ("single", "multivalue") else rt.NUM_NEEDLES)
            if c.task == "multivalue":
                assert sorted(n for _, n in magic) == sorted(c.expected)
        if c.task in ("passkey", "single"):  # one needle: nothing else shifts it
            first = text.index(c.expected[0])
            body = text[:text.rindex("\n")]  # the haystack, before the question
            assert abs(first / len(body) - c.depth) < 0.15  # a line of 45 characters


def test_vartrack_chain_in_order():
    for c in cases(tasks=["vartrack"]):
        text = text_of(c)
        names = list(c.expected)
        assert len(names) == rt.CHAIN_VARIABLES
        positions = [text.index(f"VAR {n} =") for n in names]
        assert positions == sorted(positions)
        value = re.search(rf"VAR {names[0]} = (\d+)\.", text).group(1)
        for a, b in itertools.pairwise(names):
            assert f"VAR {b} = VAR {a}." in text
        assert f"assigned the value {value}" in text


def test_common_words_recur_more_than_any_other():
    for c in cases(tasks=["common_words"]):
        items = re.findall(r"\d+\. ([a-z]+)\n", text_of(c) + "\n")
        counts = {w: items.count(w) for w in set(items)}
        least_common = min(counts[w] for w in c.expected)
        others = [n for w, n in counts.items() if w not in c.expected]
        assert len(c.expected) == rt.NUM_COMMON_WORDS
        assert others and least_common >= 4 * max(others)


@pytest.mark.parametrize("task,answer,expected,want", [
    ("single", " 4829173.", ["4829173"], (1.0, True)),
    ("single", " 1111111 or 4829173", ["4829173"], (1.0, False)),  # first number wrong
    ("passkey", " 48291.", ["48291"], (1.0, True)),
    ("multivalue", ": 12, 34, 99", ["12", "34", "56"], (2 / 3, False)),
    ("multivalue", ": 56, 12 and 34.", ["12", "34", "56"], (1.0, True)),
    ("vartrack", " abcde, FGHIJ", ["ABCDE", "FGHIJ"], (1.0, True)),
    ("vartrack", " ABCDEX", ["ABCDE"], (0.0, False)),  # a whole word must match
    ("common_words", "\n1. Maple\n2. raven", ["maple", "raven", "ember"], (2 / 3, False)),
])
def test_score(task, answer, expected, want):
    recall, correct = rt.score(task, answer, expected)
    assert (recall, correct) == (pytest.approx(want[0]), want[1])


def _oracle(cases_by_prompt, extra=""):
    """A fake model that answers every case right (then rambles with ``extra``)."""
    def generate(prompts, new_tokens):
        outs = []
        for p in prompts:
            case = cases_by_prompt[tuple(p)]
            outs.append(CharTokenizer().encode(" " + ", ".join(case.expected) + extra))
        return outs
    return generate


def test_run_retrieval_scores_and_batches():
    got = cases(lengths=[900])
    by_prompt = {c.prompt: c for c in got}
    calls = []

    def generate(prompts, new_tokens):
        calls.append((len(prompts), new_tokens))
        return _oracle(by_prompt)(prompts, new_tokens)

    rows = rt.run_retrieval(got, generate, CharTokenizer().decode, batch_size=5)
    assert len(rows) == len(got) and all(r["correct"] for r in rows)
    assert [n for n, _ in calls] == [5, 5, 2]  # one length: 12 cases, 5 at a time
    assert all(t == max(rt.NEW_TOKENS.values()) or t >= rt.NEW_TOKENS["passkey"]
               for _, t in calls)
    assert set(rows[0]) == {"task", "length", "prompt_tokens", "depth", "trial",
                            "expected", "answer", "recall", "correct"}


def test_answers_are_cut_to_their_tasks_budget():
    """Characters past a task's budget are not read: an answer that only gets there
    late is wrong, as it would be generated alone."""
    [case] = cases(tasks=["passkey"], lengths=[600], depths=[0.5])

    def late(prompts, new_tokens):
        return [CharTokenizer().encode(" " * rt.NEW_TOKENS["passkey"] + case.expected[0])]

    [row] = rt.run_retrieval([case], late, CharTokenizer().decode)
    assert not row["correct"] and row["recall"] == 0


@pytest.mark.parametrize("kw,match", [
    ({"tasks": ["nope"]}, "unknown task"),
    ({"lengths": [120]}, "no room"),
    ({"lengths": [9000]}, "haystack has"),
    ({"trials": 0}, "trials"),
])
def test_bad_input(kw, match):
    with pytest.raises(ValueError, match=match):
        cases(**kw)


def test_accuracy_table_and_plot(tmp_path):
    got = cases(lengths=[900, 1200], depths=[0.5])
    rows = [{"codec": codec, "task": c.task, "length": c.length,
             "correct": codec == "bf16" or c.length == 900}
            for codec in ("bf16", "int:2") for c in got]
    acc = rt.accuracy(rows)
    assert acc[("int:2", "passkey", 900)] == 1.0 and acc[("int:2", "mean", 1200)] == 0.0
    table = rt.accuracy_table(rows)
    assert table.splitlines()[0] == "| codec | task | 900 | 1200 |"
    assert "| int:2 | **mean** | 1.00 | 0.00 |" in table
    rt.plot_accuracy(rows, tmp_path / "a.png", "title")
    assert (tmp_path / "a.png").stat().st_size > 10_000


def test_run_suite_is_resumable(tmp_path):
    settings = rt.SuiteSettings(model="m", corpus="c", tasks=("passkey",), lengths=(600,),
                                depths=(0.5,))
    calls = []

    def answer(config, cache_config):
        calls.append(config)
        return [{"task": "passkey", "length": 600, "correct": config == "bf16"}]

    rows, run_dir = rt.run_suite(["int:4"], settings, tmp_path, answer)
    assert calls == ["bf16", "int:4"] and [r["codec"] for r in rows] == ["bf16", "int:4"]
    stored = json.loads((run_dir / "configs" / f"{config_slug('int:4')}.json").read_text())
    assert stored["cache_spec"] == "int:4" and stored["lengths"] == [600]
    rt.run_suite(["int:4"], settings, tmp_path, answer)
    assert calls == ["bf16", "int:4"]
    rt.run_suite(["int:4"], settings, tmp_path, answer, force=True)
    assert calls[2:] == ["bf16", "int:4"]
    # other settings are another run
    _, other = rt.run_suite(["int:4"], rt.SuiteSettings(**{
        **settings.__dict__, "depths": (0.1,)}), tmp_path, answer)
    assert other != run_dir and len(calls) == 6
    text = rt.write_suite_reports(rows, settings, run_dir)
    assert "| int:4 | passkey | 0.00 |" in text and (run_dir / "accuracy.png").exists()
