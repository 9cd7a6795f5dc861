"""A long-context retrieval suite in the style of RULER, generated offline from a seed on
real haystack text, scored by exact match.

Tasks (:data:`TASKS`), each a chat turn whose reply is already begun so that the first
generated tokens are the answer:

- ``passkey``: one pass key (a 5-digit number) stated in the haystack, asked back.
- ``single``: one key-value needle ("One of the special magic numbers for *garden* is:
  7302941."), asked by its key.
- ``multikey``: four such needles with different keys; one key is asked, the other
  three numbers are distractors.
- ``multivalue``: four needles with the same key and different numbers; all four are
  asked for.
- ``vartrack``: a chain of assignments (``VAR QXJLM = 48213.``, ``VAR BTRWE = VAR
  QXJLM.``, ...) spread through the haystack in order; every variable that ends up
  holding the value is asked for.
- ``common_words``: no haystack; a numbered list of words (drawn from the corpus) in
  which a few words recur many times and the rest once; the most common ones are asked
  for.

A case's *length* is the context it fills: its prompt (template and question included)
plus :data:`ANSWER_ROOM` tokens for the answer, so a length of the model's context fits
it. The haystack or the word list is trimmed to that, up to the few
tokens re-tokenizing joined text changes (the prompt's real length is recorded). The
queried needle sits at the first line break after ``depth`` of the haystack's characters
(:func:`kvjax.eval.needle.plant`); the other needles of a case at depths drawn from the
seed (in order for ``vartrack``).

Scoring: the expected strings are numbers or words; an answer's numbers are its runs of
digits and its words its runs of letters (case-insensitive). ``recall`` is the share of
the expected strings among them; a case is ``correct`` when recall is 1 and, for the
tasks with one answer, the answer's first number is it (listing every number of the
haystack does not pass).

The model is an argument, never an import: :func:`run_retrieval` takes a ``generate``
callable (prompts and a token budget in, new token ids out).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvjax.eval.needle import EncodePrompt, check_grid, insertion_point, run_batched
from kvjax.eval.sweep import config_slug, run_label, write_json
from kvjax.spec import parse_cache

TASKS = ("passkey", "single", "multikey", "multivalue", "vartrack", "common_words")
#: tasks whose answer is one number
SINGLE_ANSWER = ("passkey", "single", "multikey")
#: needles of the multi-needle tasks, variables of a ``vartrack`` chain, common words
NUM_NEEDLES, CHAIN_VARIABLES, NUM_COMMON_WORDS = 4, 5, 5
#: new tokens read per task: room for its whole answer
NEW_TOKENS = {"passkey": 12, "single": 16, "multikey": 16, "multivalue": 48,
              "vartrack": 40, "common_words": 40}
#: tokens every case keeps for the answer: cases of one length are generated together,
#: for the longest answer among them
ANSWER_ROOM = max(NEW_TOKENS.values())
#: the keys of the key-value needles
KEYS = ("garden", "violin", "harbor", "lantern", "meadow", "canyon", "orchid", "falcon",
        "glacier", "compass", "velvet", "thunder", "saddle", "pepper", "marble", "island",
        "candle", "forest", "silver", "rocket", "anchor", "blanket", "cellar", "dolphin")

#: ``generate(prompts, new_tokens) -> new token ids per prompt`` (greedy)
Generate = Callable[[list[list[int]], int], list[list[int]]]


@dataclasses.dataclass(frozen=True)
class RetrievalCase:
    """One prompt of the suite.

    Attributes:
        task: one of :data:`TASKS`.
        length: the context the case fills: prompt plus answer tokens.
        depth: where the queried needle sits (fraction of the haystack's characters).
        trial: index of the repetition (other values, another stretch of haystack).
        expected: the strings the answer must contain.
        prompt: the prompt's token ids (its real length is ``len(prompt)``).
    """

    task: str
    length: int
    depth: float
    trial: int
    expected: tuple[str, ...]
    prompt: tuple[int, ...]

    @property
    def new_tokens(self) -> int:
        return NEW_TOKENS[self.task]


@dataclasses.dataclass(frozen=True)
class _Text:
    """What a task puts into a prompt: needles (text, depth) planted in the haystack,
    the question, the reply's beginning and the expected strings."""

    needles: tuple[tuple[str, float], ...]
    question: str
    prefix: str
    expected: tuple[str, ...]


def _number(rng: np.random.Generator, digits: int = 7) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10**digits)))


def _magic(key: str, number: str) -> str:
    return f"One of the special magic numbers for {key} is: {number}."


def _single_question(key: str) -> tuple[str, str]:
    return (f"What is the special magic number for {key} mentioned in the text above? "
            "Answer with the number only.", f"The special magic number for {key} is")


def _variable(rng: np.random.Generator, taken: set[str]) -> str:
    while True:
        name = "".join(chr(ord("A") + int(i)) for i in rng.integers(0, 26, 5))
        if name not in taken:
            taken.add(name)
            return name


def _task_text(task: str, depth: float, rng: np.random.Generator) -> _Text:
    """The needles, question and answer of a haystack task."""
    if task == "passkey":
        key = _number(rng, 5)
        return _Text(((f"The pass key is {key}. Remember it. {key} is the pass key.",
                       depth),),
                     "What is the pass key? Answer with the number only.",
                     "The pass key is", (key,))
    if task in ("single", "multikey", "multivalue"):
        keys = [str(k) for k in rng.choice(KEYS, NUM_NEEDLES, replace=False)]
        numbers = list(dict.fromkeys(_number(rng) for _ in range(3 * NUM_NEEDLES)))
        others = sorted(float(d) for d in rng.uniform(0, 1, NUM_NEEDLES - 1))
        if task == "single":
            question, prefix = _single_question(keys[0])
            return _Text(((_magic(keys[0], numbers[0]), depth),), question, prefix,
                         (numbers[0],))
        if task == "multikey":
            needles = [(_magic(keys[0], numbers[0]), depth)]
            needles += [(_magic(k, n), d) for k, n, d in
                        zip(keys[1:], numbers[1:NUM_NEEDLES], others, strict=True)]
            question, prefix = _single_question(keys[0])
            return _Text(tuple(needles), question, prefix, (numbers[0],))
        values = numbers[:NUM_NEEDLES]
        needles = [(_magic(keys[0], values[0]), depth)]
        needles += [(_magic(keys[0], n), d) for n, d in zip(values[1:], others, strict=True)]
        return _Text(tuple(needles),
                     f"What are all the special magic numbers for {keys[0]} mentioned in "
                     "the text above? List them, separated by commas.",
                     f"The special magic numbers for {keys[0]} are", tuple(values))
    if task == "vartrack":
        value, taken = _number(rng, 5), set()
        names = [_variable(rng, taken) for _ in range(CHAIN_VARIABLES)]
        # the chain in order through the haystack, the first assignment at ``depth``
        rest = sorted(float(d) for d in rng.uniform(depth, 1, CHAIN_VARIABLES - 1))
        needles = [(f"VAR {names[0]} = {value}.", depth)]
        needles += [(f"VAR {b} = VAR {a}.", d)
                    for a, b, d in zip(names[:-1], names[1:], rest, strict=True)]
        return _Text(tuple(needles),
                     f"Find all variables that are assigned the value {value} in the "
                     "text above, directly or through other variables.",
                     f"Answer: the variables assigned the value {value} are",
                     tuple(names))
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def _plant_all(haystack: str, needles: Sequence[tuple[str, float]]) -> str:
    """``haystack`` with every needle on a line of its own at its depth, the depths all
    measured on the haystack itself (needles at one line break keep their order)."""
    points = sorted((insertion_point(haystack, d), i) for i, (_, d) in enumerate(needles))
    parts, last = [], 0
    for at, i in points:
        parts.append(haystack[last:at])
        if at and not haystack[:at].endswith("\n") and last < at:
            parts.append("\n")  # at the end of a haystack without a final line break
        parts.append(needles[i][0] + "\n")
        last = at
    parts.append(haystack[last:])
    return "".join(parts)


def corpus_words(text: str, min_len: int = 4) -> list[str]:
    """The distinct lowercase words of ``text`` (letters only, at least ``min_len``), in
    order of first appearance: the vocabulary of the ``common_words`` lists."""
    return list(dict.fromkeys(w.lower() for w in re.findall(r"[A-Za-z]+", text)
                              if len(w) >= min_len))


def _word_list(words: Sequence[str], budget: int, encode, rng: np.random.Generator
               ) -> tuple[str, tuple[str, ...]]:
    """A numbered list of about ``budget`` tokens (``encode(text) -> ids``) in which
    :data:`NUM_COMMON_WORDS` words recur at least four times as often as any other
    word; returns the list and the common words."""
    if len(words) < 2 * NUM_COMMON_WORDS:
        raise ValueError(f"the corpus has {len(words)} distinct words; the word list "
                         f"needs at least {2 * NUM_COMMON_WORDS}")
    pool = [str(w) for w in rng.permutation(np.asarray(words, dtype=object))]
    common, rare = pool[:NUM_COMMON_WORDS], pool[NUM_COMMON_WORDS:]
    shuffle_seed = int(rng.integers(2**31))

    def build(entries: int) -> list[str]:
        # a quarter of the entries are the common words; the rare ones fill the rest,
        # repeated as often as the corpus' vocabulary makes them
        rare_repeats = max(1, -(-(entries - entries // 4) // len(rare)))
        repeats = max(4 * rare_repeats, -(-(entries // 4) // NUM_COMMON_WORDS))
        items = [w for w in common for _ in range(repeats)]
        items += [rare[i % len(rare)] for i in range(max(0, entries - len(items)))]
        order = np.random.default_rng(shuffle_seed).permutation(len(items))
        return [items[i] for i in order]

    def text(items: list[str]) -> str:
        return "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))

    def fits(entries: int) -> bool:
        return len(encode(text(build(entries)))) <= budget

    # the longest list that fits: every common word at least four times and twice as
    # many rare entries as common words
    shortest = 8 * NUM_COMMON_WORDS
    if not fits(shortest):
        raise ValueError(f"{budget} tokens leave no room for a word list")
    sample = rare[:50]
    estimate = int(budget / max(1.0, len(encode(text(sample))) / len(sample)))
    lo, hi = shortest, max(shortest + 1, estimate)
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return text(build(lo)), tuple(common)


def make_cases(
    tokenizer,
    encode_prompt: EncodePrompt,
    haystack_ids: Sequence[int],
    *,
    tasks: Sequence[str] = TASKS,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int = 1,
    seed: int = 0,
) -> list[RetrievalCase]:
    """Every (task, length, depth, trial) case, deterministically from ``seed``.

    ``haystack_ids``: tokenized corpus text; trial ``t`` reads it from token ``t *
    max(lengths)`` on (``common_words`` draws its words from the same text).
    ``encode_prompt(user_text, answer_prefix) -> ids`` builds the chat turn. Raises
    ``ValueError`` for an unknown task, a bad grid, a length too short for a task's
    question and needles, or a haystack that runs out."""
    check_grid(lengths, depths, trials)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown task(s) {unknown}; known: {', '.join(TASKS)}")
    ids = [int(t) for t in haystack_ids]
    longest = max(lengths)
    if len(ids) < trials * longest:
        raise ValueError(f"the haystack has {len(ids)} tokens; {trials} trial(s) up to "
                         f"{longest} tokens need {trials * longest}")
    rng = np.random.default_rng(seed)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    cases = []
    for trial in range(trials):
        start = trial * longest
        words = corpus_words(tokenizer.decode(ids[start:start + longest])) \
            if "common_words" in tasks else []
        for task in tasks:
            for length in lengths:
                for depth in depths:
                    if task == "common_words":
                        question = (f"What are the {NUM_COMMON_WORDS} most common words "
                                    "in the list above? Answer with the words only.")
                        prefix = f"The {NUM_COMMON_WORDS} most common words are:"
                        overhead = len(encode_prompt(f"\n{question}", prefix))
                        budget = int(length) - ANSWER_ROOM - overhead
                        listing, expected = _word_list(words, budget, encode, rng)
                        text = f"{listing}\n{question}"
                    else:
                        spec = _task_text(task, float(depth), rng)
                        needles = "\n".join(n for n, _ in spec.needles)
                        overhead = len(encode_prompt(f"{needles}\n\n{spec.question}",
                                                     spec.prefix))
                        budget = int(length) - ANSWER_ROOM - overhead
                        if budget < 1:
                            raise ValueError(
                                f"length {length} leaves no room for a haystack in task "
                                f"{task}: its needles, question, template and answer "
                                f"take {overhead + ANSWER_ROOM} tokens")
                        prefix, expected = spec.prefix, spec.expected
                        room = int(length) - ANSWER_ROOM
                        # planting adds line breaks the overhead did not count: trim the
                        # haystack by what the prompt overshoots
                        for _ in range(4):
                            hay = tokenizer.decode(ids[start:start + budget])
                            text = f"{_plant_all(hay, spec.needles)}\n{spec.question}"
                            over = len(encode_prompt(text, prefix)) - room
                            if over <= 0:
                                break
                            budget -= over
                    prompt = tuple(int(t) for t in encode_prompt(text, prefix))
                    cases.append(RetrievalCase(task, int(length), float(depth), trial,
                                               tuple(expected), prompt))
    return cases


_NUMBERS = re.compile(r"\d+")
_WORDS = re.compile(r"[A-Za-z]+")


def score(task: str, answer: str, expected: Sequence[str]) -> tuple[float, bool]:
    """``(recall, correct)`` of ``answer`` (module docstring)."""
    numbers = _NUMBERS.findall(answer)
    found = set(numbers) | {w.lower() for w in _WORDS.findall(answer)}
    want = [e.lower() for e in expected]
    recall = sum(e in found for e in want) / len(want)
    correct = recall == 1.0
    if task in SINGLE_ANSWER:
        correct = bool(numbers) and numbers[0] == expected[0]
    return recall, correct


def run_retrieval(
    cases: Sequence[RetrievalCase],
    generate: Generate,
    decode: Callable[[list[int]], str],
    *,
    batch_size: int | None = None,
    progress: bool = False,
) -> list[dict]:
    """Generate and score an answer for every case.

    Cases of one length go to ``generate`` together, ``batch_size`` at a time (default:
    all of them), with the largest token budget among them, so a jitted model compiles
    once per length; each answer is cut to its own task's budget before it is decoded
    and scored, as if generated alone.
    Returns one dict per case: ``task``, ``length``, ``prompt_tokens`` (the real
    length), ``depth``, ``trial``, ``expected``, ``answer`` (decoded), ``recall`` and
    ``correct``.
    """
    def run(batch: list[RetrievalCase]) -> list:
        return generate([list(c.prompt) for c in batch], max(c.new_tokens for c in batch))

    def row(case: RetrievalCase, out: list[int]) -> dict:
        answer = decode(out[:case.new_tokens])
        recall, correct = score(case.task, answer, case.expected)
        return {"task": case.task, "length": case.length, "prompt_tokens": len(case.prompt),
                "depth": case.depth, "trial": case.trial, "expected": list(case.expected),
                "answer": answer, "recall": recall, "correct": correct}

    return run_batched(cases, lambda c: c.length, run, row, batch_size=batch_size,
                       progress=progress, desc="retrieval")


def accuracy(rows: Sequence[dict], key: str = "codec") -> dict[tuple, float]:
    """Exact-match accuracy per ``(key, task, length)`` (and ``(key, "mean", length)``,
    the mean over the tasks) of :func:`run_retrieval` rows with a ``key`` field."""
    cells: dict[tuple, list[bool]] = {}
    for r in rows:
        cells.setdefault((r.get(key, ""), r["task"], r["length"]), []).append(
            bool(r["correct"]))
    out = {k: float(np.mean(v)) for k, v in cells.items()}
    for name, length in {(k[0], k[2]) for k in cells}:
        per_task = [v for k, v in out.items() if k[0] == name and k[2] == length]
        out[(name, "mean", length)] = float(np.mean(per_task))
    return out


def accuracy_table(rows: Sequence[dict], key: str = "codec") -> str:
    """Markdown: one row per (``key``, task), one column per length, and the mean over
    tasks per ``key``."""
    if not rows:
        raise ValueError("no retrieval results to tabulate")
    acc = accuracy(rows, key)
    lengths = sorted({r["length"] for r in rows})
    names = list(dict.fromkeys(r.get(key, "") for r in rows))
    tasks = [t for t in (*TASKS, "mean") if any(k[1] == t for k in acc)]
    lines = [f"| {key} | task | " + " | ".join(str(n) for n in lengths) + " |",
             "|" + "---|" * (len(lengths) + 2)]
    for name in names:
        for task in tasks:
            cells = [acc.get((name, task, n)) for n in lengths]
            shown = " | ".join("-" if c is None else f"{c:.2f}" for c in cells)
            label = f"**{task}**" if task == "mean" else task
            lines.append(f"| {name} | {label} | {shown} |")
    return "\n".join(lines)


def plot_accuracy(rows: Sequence[dict], path, title: str, key: str = "codec") -> None:
    """Accuracy vs prompt length, one panel per task and one for the mean, one line per
    ``key`` (codec)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = accuracy(rows, key)
    names = list(dict.fromkeys(r.get(key, "") for r in rows))
    tasks = [t for t in (*TASKS, "mean") if any(k[1] == t for k in acc)]
    cols = min(4, len(tasks))
    nrows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.6 * cols, 3.0 * nrows), squeeze=False,
                             sharey=True)
    for ax, task in zip(axes.flat, tasks, strict=False):
        for i, name in enumerate(names):
            points = sorted((k[2], v) for k, v in acc.items() if k[0] == name and k[1] == task)
            if points:
                ax.plot(*zip(*points, strict=True), marker="osD^v<>pPX*h"[i % 12],
                        color=f"C{i % 10}", label=name)
        ax.set_title(task, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("prompt tokens", fontsize=8)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    axes[0][0].set_ylabel("exact-match accuracy")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- a resumable run over cache configurations -------------------------------------------


@dataclasses.dataclass(frozen=True)
class SuiteSettings:
    """What a suite's answers depend on besides the cache: a stored result counts as
    done only when all of it matches."""

    model: str
    corpus: str
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int = 1
    seed: int = 0

    def __post_init__(self):
        for name in ("tasks", "lengths", "depths"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def run_name(self) -> str:
        """A directory name that differs whenever a setting differs."""
        tasks = [] if self.tasks == TASKS else ["_".join(self.tasks)]
        return run_label(self.model, self.corpus, f"L{'_'.join(map(str, self.lengths))}",
                         f"d{'_'.join(f'{d:g}' for d in self.depths)}", f"t{self.trials}",
                         *tasks, f"seed{self.seed}")

    def title(self) -> str:
        return (f"{self.model} on {self.corpus}: retrieval, depths "
                f"{', '.join(f'{d:g}' for d in self.depths)}, {self.trials} trial(s)")


#: ``answer(config, cache_config) -> rows`` of :func:`run_retrieval` for that cache
Answer = Callable[[str, object], list[dict]]


def run_suite(configs: Sequence[str], settings: SuiteSettings, out: Path, answer: Answer,
              *, force: bool = False, progress: bool = False) -> tuple[list[dict], Path]:
    """Answer the suite with every cache configuration (cache specs; ``bf16`` first,
    added when missing), one JSON per configuration in ``out/RUN/configs/`` written as
    soon as it is done (with provenance); a configuration whose stored file matches
    ``settings`` and its cache spec is read back instead (``force`` redoes it). Returns
    every row, with a ``codec`` field, and the run folder."""
    configs = list(dict.fromkeys(["bf16", *configs]))
    cache_configs = {c: parse_cache(c) for c in configs}  # bad specs fail before any run
    run_dir = Path(out) / settings.run_name()
    (run_dir / "configs").mkdir(parents=True, exist_ok=True)
    wanted = json.loads(json.dumps(dataclasses.asdict(settings)))
    rows: list[dict] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(configs), desc="suite", unit="config")
    for config in configs:
        path = run_dir / "configs" / f"{config_slug(config)}.json"
        spec = cache_configs[config].spec
        stored = None
        if path.exists() and not force:
            try:
                stored = json.loads(path.read_text())
            except ValueError:
                stored = None
            if stored is not None and (stored.get("cache_spec") != spec or any(
                    stored.get(k) != v for k, v in wanted.items())):
                stored = None
        if stored is None:
            if bar is not None:
                bar.set_postfix_str(config)
            answers = answer(config, cache_configs[config])
            stored = write_json(path, {"config": config, "cache_spec": spec, **wanted,
                                       "rows": answers})
        rows += [{"codec": config, **r} for r in stored["rows"]]
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return rows, run_dir


def write_suite_reports(rows: Sequence[dict], settings: SuiteSettings, run_dir: Path) -> str:
    """``summary.md`` (accuracy per codec, task and length) and ``accuracy.png`` in
    ``run_dir``; returns the table and the paths."""
    table = accuracy_table(rows)
    (Path(run_dir) / "summary.md").write_text(table + "\n")
    plot = Path(run_dir) / "accuracy.png"
    plot_accuracy(rows, plot, settings.title())
    return "\n".join([table, f"\nresults: {run_dir}/configs/*.json", f"plot:    {plot}"])


__all__ = [
    "ANSWER_ROOM",
    "NEW_TOKENS",
    "SINGLE_ANSWER",
    "TASKS",
    "RetrievalCase",
    "SuiteSettings",
    "accuracy",
    "accuracy_table",
    "corpus_words",
    "make_cases",
    "plot_accuracy",
    "run_retrieval",
    "run_suite",
    "score",
    "write_suite_reports",
]
