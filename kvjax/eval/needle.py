"""Needle-in-a-haystack retrieval: can the model still read one number from a long prompt?

A random 6-8 digit number is planted in corpus text (the haystack) at a relative depth,
inside a sentence ``"The secret number is N."``; the model is asked for it in one chat
turn whose reply is already begun with ``"The secret number is"``, so the first digits
it generates are its answer. Scoring is exact match of the first run of digits in the
generated text against ``N``; a number cut short or with one digit wrong is a miss.

The prompt's total length (chat template and question included) is the *length* of a
case; the haystack is trimmed to make it so, up to the few tokens that re-tokenizing the
joined text may add or remove (each case records its real length). The needle goes in
at the first line break after ``depth`` of the haystack's characters, so it starts a
line as the corpus's own sentences do.

The model is an argument, never an import: :func:`run_needle` takes a ``generate``
callable (prompts in, new token ids out) and the caller decides which cache it uses.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

QUESTION = ("What is the secret number mentioned in the text above? "
            "Answer with the number only.")
ANSWER_PREFIX = "The secret number is"
NEEDLE_TEMPLATE = "The secret number is {number}."

#: ``encode_prompt(user_text, answer_prefix) -> token ids`` (a chat turn, reply begun)
EncodePrompt = Callable[[str, str], list[int]]
#: ``generate(prompts) -> new token ids per prompt`` (greedy, a few tokens)
Generate = Callable[[list[list[int]]], list[list[int]]]


@dataclasses.dataclass(frozen=True)
class NeedleCase:
    """One prompt with a planted number.

    Attributes:
        length: the target prompt length in tokens.
        depth: where the needle sits, as a fraction of the haystack's characters.
        trial: index of the repetition (another number and another stretch of haystack).
        number: the planted number, as the digits the model must return.
        prompt: the prompt's token ids (its real length is ``len(prompt)``).
    """

    length: int
    depth: float
    trial: int
    number: str
    prompt: tuple[int, ...]


def random_number(rng: np.random.Generator) -> str:
    """A random 6-, 7- or 8-digit number (no leading zero), as a string."""
    digits = int(rng.integers(6, 9))
    return str(int(rng.integers(10 ** (digits - 1), 10**digits)))


def insertion_point(haystack: str, depth: float) -> int:
    """Where :func:`plant` inserts at ``depth``: just after the first line break at or
    after ``depth`` of the characters (the end if there is none)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    brk = haystack.find("\n", round(depth * len(haystack)))
    return len(haystack) if brk < 0 else brk + 1


def plant(haystack: str, needle: str, depth: float) -> str:
    """``haystack`` with ``needle`` inserted as a line at ``depth`` (0 = start, 1 = end).

    The insertion point is the first line break at or after ``depth`` of the characters
    (the end of the text if there is none), so the needle never splits a word.
    """
    at = insertion_point(haystack, depth)
    head, tail = haystack[:at], haystack[at:]
    if head and not head.endswith("\n"):
        head += "\n"
    return f"{head}{needle}\n{tail}"


def check_grid(lengths: Sequence[int], depths: Sequence[float], trials: int) -> None:
    """Raise ``ValueError`` unless there is a length and a depth, every depth is in
    [0, 1] and ``trials >= 1`` (cheap checks worth doing before a model loads)."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if not lengths or not depths:
        raise ValueError("give at least one length and one depth")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")


def make_cases(
    tokenizer,
    encode_prompt: EncodePrompt,
    haystack_ids: Sequence[int],
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int = 1,
    seed: int = 0,
) -> list[NeedleCase]:
    """Build the prompts of every (length, depth, trial), deterministically from ``seed``.

    ``haystack_ids`` is tokenized corpus text (e.g. :func:`kvjax.eval.corpus.tokenize_prefix`);
    trial ``t`` takes its haystack from token ``t * max(lengths)`` on, so the trials read
    different text, and every (length, depth) of one trial shares that text. Numbers are
    drawn per case from ``numpy.random.default_rng(seed)``. Raises ``ValueError`` when a
    length is too short for the question and template, or the haystack runs out.
    """
    check_grid(lengths, depths, trials)
    ids = [int(t) for t in haystack_ids]
    longest = max(lengths)
    if len(ids) < trials * longest:
        raise ValueError(f"the haystack has {len(ids)} tokens; {trials} trial(s) up to "
                         f"{longest} tokens need {trials * longest}")
    rng = np.random.default_rng(seed)
    cases = []
    for trial in range(trials):
        start = trial * longest
        for length in lengths:
            for depth in depths:
                number = random_number(rng)
                needle = NEEDLE_TEMPLATE.format(number=number)
                overhead = len(encode_prompt(f"{needle}\n\n{QUESTION}", ANSWER_PREFIX))
                budget = int(length) - overhead
                if budget < 1:
                    raise ValueError(f"length {length} leaves no room for a haystack: the "
                                     f"question and template take {overhead} tokens")
                hay = tokenizer.decode(ids[start : start + budget])
                text = f"{plant(hay, needle, depth)}\n{QUESTION}"
                prompt = tuple(int(t) for t in encode_prompt(text, ANSWER_PREFIX))
                cases.append(NeedleCase(int(length), float(depth), trial, number, prompt))
    return cases


_DIGITS = re.compile(r"\d+")


def extract_number(text: str) -> str | None:
    """The first run of digits in ``text`` (``None`` if there is none).

    Digit groups split by separators (``"4,829,173"``) count as separate runs: a model
    that reformats the number has not reproduced it.
    """
    match = _DIGITS.search(text)
    return match.group(0) if match else None


def is_correct(answer: str, number: str) -> bool:
    """Exact match: the answer's first run of digits is ``number``."""
    return extract_number(answer) == number


def run_batched(cases: Sequence, key: Callable, generate: Callable[[list], list],
                row: Callable[[Any, list[int]], dict], *, batch_size: int | None = None,
                progress: bool = False, desc: str = "prompts") -> list[dict]:
    """``generate(batch) -> outputs`` over ``cases`` grouped by ``key(case)`` (in order
    of first appearance), ``batch_size`` at a time (default: a whole group), with a
    progress bar over the cases; ``row(case, output)`` of every case, in order."""
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    groups: dict = {}
    for case in cases:
        groups.setdefault(key(case), []).append(case)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(cases), desc=desc, unit="prompt")
    rows = []
    for group in groups.values():
        size = batch_size or len(group)
        for i in range(0, len(group), size):
            batch = group[i:i + size]
            outputs = generate(batch)
            if len(outputs) != len(batch):
                raise ValueError(f"generate returned {len(outputs)} outputs for "
                                 f"{len(batch)} prompts")
            rows += [row(case, list(out)) for case, out in zip(batch, outputs, strict=True)]
            if bar is not None:
                bar.update(len(batch))
    if bar is not None:
        bar.close()
    return rows


def run_needle(
    cases: Sequence[NeedleCase],
    generate: Generate,
    decode: Callable[[list[int]], str],
    *,
    batch_size: int | None = None,
    progress: bool = False,
) -> list[dict]:
    """Generate an answer for every case and score it.

    Cases of one length go to ``generate`` together, ``batch_size`` at a time (default:
    all of that length), so a jitted model compiles once per length. Returns one dict per
    case: ``length``, ``prompt_tokens`` (the real length), ``depth``, ``trial``,
    ``number``, ``answer`` (decoded text) and ``correct``.
    """
    def row(case: NeedleCase, out: list[int]) -> dict:
        answer = decode(out)
        return {"length": case.length, "prompt_tokens": len(case.prompt),
                "depth": case.depth, "trial": case.trial, "number": case.number,
                "answer": answer, "correct": is_correct(answer, case.number)}

    return run_batched(cases, lambda c: c.length,
                       lambda batch: generate([list(c.prompt) for c in batch]), row,
                       batch_size=batch_size, progress=progress, desc="needle")


def accuracy_table(rows: Sequence[dict], key: str = "codec") -> str:
    """A markdown table of exact-match accuracy: one row per (``key``, length), one
    column per depth, and the mean over depths. ``rows`` come from :func:`run_needle`
    with a ``key`` field added (e.g. the codec spec)."""
    if not rows:
        raise ValueError("no needle results to tabulate")
    depths = sorted({r["depth"] for r in rows})
    cells: dict[tuple, list[bool]] = {}
    order: list[tuple] = []
    for r in rows:
        group = (r.get(key, ""), r["length"])
        if group not in order:
            order.append(group)
        cells.setdefault((*group, r["depth"]), []).append(bool(r["correct"]))
    head = f"| {key} | length | " + " | ".join(f"depth {d:g}" for d in depths) + " | mean |"
    rule = "|" + "---|" * (len(depths) + 3)
    body = []
    for group in order:
        accs = [np.mean(cells[(*group, d)]) if (*group, d) in cells else float("nan")
                for d in depths]
        shown = " | ".join("-" if np.isnan(a) else f"{a:.2f}" for a in accs)
        body.append(f"| {group[0]} | {group[1]} | {shown} | {np.nanmean(accs):.2f} |")
    return "\n".join([head, rule, *body])


__all__ = [
    "ANSWER_PREFIX",
    "NEEDLE_TEMPLATE",
    "QUESTION",
    "NeedleCase",
    "accuracy_table",
    "extract_number",
    "insertion_point",
    "is_correct",
    "make_cases",
    "plant",
    "random_number",
    "run_batched",
    "run_needle",
]
