"""Sweep KV codecs on one model and corpus: perplexity (and optionally needle retrieval)
per codec, one JSON per configuration, then a CSV, a markdown table and a Pareto plot.

    python experiments/sweep.py --preset demo
    python experiments/sweep.py --codec int:4 --codec kivi:2,g32 --codec int:4/int:2 \\
        --windows 8 --window-len 512 --window 32 --needle

A configuration is a codec spec for K and V (``int:4``; KIVI's spec gives V its
per-token variant) or ``KSPEC/VSPEC``. Results go to ``OUT/RUN/configs/*.json`` where
``RUN`` names the model, corpus, windows and cache settings, so a second run with the
same settings skips every configuration already done (resumable; ``--force`` redoes
them). ``bf16`` always runs: it is the baseline of every delta.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvjax.codec import CodecError
from kvjax.spec import CacheConfig, LayerRule, parse_kv

REPO = Path(__file__).resolve().parent.parent

#: named lists of configurations; ``demo`` is what ``make demo`` runs
PRESETS: dict[str, tuple[str, ...]] = {
    "demo": (
        "bf16", "fp8", "int:8", "int:6", "int:5", "int:4", "int:3", "int:2",
        "kivi:8,g32", "kivi:4,g32", "kivi:3,g32", "kivi:2,g32",
        "saw:h64", "saw:h64,b3", "saw:h64,b2",
        # each paper codec at two or three of its own operating points (the papers'
        # protocol scripts sweep them in full)
        "hqmq:s96,r4", "hqmq:s24,r3",
        "turboquant:b3", "turboquant:b2", "polarquant:b3", "polarquant:b2",
        "octopus:b3", "octopus:b2",
        "hyperquant:e8,4bps", "hyperquant:e8,3bps", "hyperquant:e8,2bps",
    ),
    "int": ("bf16", "int:8", "int:7", "int:6", "int:5", "int:4", "int:3", "int:2"),
    "kivi": ("bf16", "kivi:8,g32", "kivi:4,g32", "kivi:3,g32", "kivi:2,g32",
             "kivi:4,g64", "kivi:2,g64", "kivi:2,g128"),
    # the rotation-preconditioned family at nominal 2 / 3 / 4 bits (experiments/octopus_lm.py
    # runs it with the OCTOPUS paper's window and boundary layers)
    "rotation": ("bf16", *(f"{c}:b{b}" for b in (2, 3, 4)
                           for c in ("turboquant", "polarquant", "octopus"))),
    # HyperQuant's E8 over the rate range and the other lattices at 3 bps
    # (experiments/hyperquant_lm.py runs the paper's whole KV protocol)
    "hyperquant": ("bf16", *(f"hyperquant:e8,{r}bps" for r in (1.7, 2, 2.5, 3, 4)),
                   "hyperquant:d4,3bps", "hyperquant:a2,3bps", "hyperquant:z,3bps"),
    # SAW rotation blocks, sign flips and rotated V at 4 bits, vs plain int:4 (D = 64)
    "saw": ("bf16", "int:4", "saw:h16", "saw:h32", "saw:h64", "saw:h64,signs",
            "saw:h64,kv", "saw:h64,b8", "saw:h64,b3", "saw:h64,b2", "int:3", "int:2"),
}

#: JSON fields that must match for a stored result to count as done
SETTING_KEYS = ("model", "corpus", "windows", "window_len", "chunk", "residual_window",
                "sinks", "seed", "raw_k_layers")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything except the codec that a result depends on."""

    model: str
    corpus: str
    windows: int
    window_len: int
    chunk: int | None
    residual_window: int
    sinks: int
    seed: int
    raw_k_layers: tuple[int, ...] = ()
    needle_lengths: tuple[int, ...] = ()
    needle_depths: tuple[float, ...] = ()
    needle_trials: int = 0

    def run_name(self) -> str:
        """A directory name that differs whenever a ppl-relevant setting differs."""
        corpus = Path(self.corpus).stem if os.sep in self.corpus else self.corpus
        parts = [_slug(Path(self.model).stem), _slug(corpus),
                 f"{self.windows}x{self.window_len}"]
        if self.chunk:
            parts.append(f"c{self.chunk}")
        if self.residual_window:
            parts.append(f"w{self.residual_window}")
        if self.sinks:
            parts.append(f"s{self.sinks}")
        if self.raw_k_layers:
            parts.append("rawk" + "_".join(str(i) for i in self.raw_k_layers))
        parts.append(f"seed{self.seed}")
        return "-".join(parts)

    def needle_key(self) -> dict | None:
        if not self.needle_trials:
            return None
        return {"lengths": list(self.needle_lengths), "depths": list(self.needle_depths),
                "trials": self.needle_trials}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def config_slug(config: str) -> str:
    """A file name for a configuration: readable, and unique through a short hash."""
    digest = hashlib.sha1(config.encode()).hexdigest()[:6]
    return f"{_slug(config)}-{digest}"


def parse_config(config: str, settings: Settings) -> CacheConfig:
    """The cache configuration of ``SPEC`` or ``KSPEC/VSPEC`` (``CodecError`` if bad)."""
    if config.count("/") > 1:
        raise CodecError(f"'{config}': give SPEC or KSPEC/VSPEC")
    if "/" in config:
        k_spec, v_spec = config.split("/")
        k, v = parse_kv(k=k_spec, v=v_spec)
    else:
        k, v = parse_kv(config)
    layers = ()
    if settings.raw_k_layers:
        select = ",".join(str(i) for i in settings.raw_k_layers)
        layers = (LayerRule(select=select, role="k", codec="bf16"),)
    return CacheConfig(k=k, v=v, residual_window=settings.residual_window,
                       sink_tokens=settings.sinks, layers=layers)


def family(config: str) -> str:
    """The codec family of a configuration: the codec name(s) without options, with
    ``+med`` where outliers are extracted (``int:4,med3`` is ``int+med``)."""
    def one(part: str) -> str:
        name, _, options = part.partition(":")
        return name + ("+med" if any(o.startswith("med") for o in options.split(",")) else "")

    return "/".join(one(part) for part in config.split("/"))


def git_sha() -> str | None:
    """The checkout's commit (``+dirty`` when files differ from it); None outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty.strip() else "")


def _is_done(path: Path, settings: Settings, want_needle: bool) -> bool:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    # compared as JSON holds them (tuples come back as lists)
    wanted = json.loads(json.dumps(dataclasses.asdict(settings)))
    if any(stored.get(k, [] if k == "raw_k_layers" else None) != v
           for k, v in wanted.items() if k in SETTING_KEYS):
        return False
    return not want_needle or stored.get("needle") == settings.needle_key()


Evaluate = Callable[[str, CacheConfig, bool], dict]


def run_sweep(
    configs: Sequence[str],
    settings: Settings,
    out: Path,
    evaluate: Evaluate,
    *,
    force: bool = False,
    progress: bool = True,
) -> tuple[list[dict], Path]:
    """Evaluate every configuration not done yet and return all rows and the run folder.

    ``evaluate(config, cache_config, with_needle) -> dict`` measures one configuration
    (``ppl``, ``bits_per_element``, ...; ``needle_accuracy`` and ``needle`` rows when
    asked). Each result is written to ``out/RUN/configs/SLUG.json`` as soon as it exists,
    with the settings, the configuration, its family, the git commit and a timestamp.
    Configurations are validated before anything runs.
    """
    configs = list(dict.fromkeys(["bf16", *configs]))
    cache_configs = {c: parse_config(c, settings) for c in configs}
    run_dir = out / settings.run_name()
    (run_dir / "configs").mkdir(parents=True, exist_ok=True)
    want_needle = settings.needle_trials > 0
    sha = git_sha()
    todo = [c for c in configs
            if force or not _is_done(run_dir / "configs" / f"{config_slug(c)}.json",
                                     settings, want_needle)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(configs), initial=len(configs) - len(todo), desc="sweep",
                   unit="config")
    for config in todo:
        if bar is not None:
            bar.set_postfix_str(config)
        t0 = time.perf_counter()
        measured = evaluate(config, cache_configs[config], want_needle)
        cc = cache_configs[config]
        row = {
            "config": config, "family": family(config),
            "k_codec": cc.k.spec, "v_codec": cc.v.spec,
            **dataclasses.asdict(settings),
            "needle": settings.needle_key(),
            **measured,
            "wall_seconds": time.perf_counter() - t0,
            "git": sha, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        path = run_dir / "configs" / f"{config_slug(config)}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(row, indent=1))
        os.replace(tmp, path)   # a killed sweep never leaves a half-written result
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    rows = [json.loads((run_dir / "configs" / f"{config_slug(c)}.json").read_text())
            for c in configs]
    return rows, run_dir


CSV_FIELDS = ("config", "family", "k_codec", "v_codec", "bits_per_element",
              "k_bits_per_element", "v_bits_per_element", "ppl", "delta_pct", "nll",
              "tokens", "needle_accuracy", "fallback_blocks", "seconds", "model", "corpus",
              "windows", "window_len", "chunk", "residual_window", "sinks", "raw_k_layers",
              "seed", "git")


def with_deltas(rows: Sequence[dict]) -> list[dict]:
    """Rows with ``delta_pct``: ppl relative to the bf16 row, in percent."""
    base = next(r["ppl"] for r in rows if r["config"] == "bf16")
    return [{**r, "delta_pct": 100.0 * (r["ppl"] / base - 1.0)} for r in rows]


def write_csv(rows: Sequence[dict], path: Path) -> None:
    """All rows, one per configuration, the columns of ``CSV_FIELDS``."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in CSV_FIELDS})


def markdown_table(rows: Sequence[dict]) -> str:
    """Configurations sorted by bits: bits, ppl, delta to bf16 (and needle accuracy)."""
    needle = any(r.get("needle_accuracy") is not None for r in rows)
    head = "| codec | bits / element (K, V) | ppl | vs bf16 |"
    rule = "|---|---|---|---|"
    if needle:
        head += " needle |"
        rule += "---|"
    lines = [head, rule]
    for r in sorted(rows, key=lambda r: (-r["bits_per_element"], r["config"])):
        line = (f"| `{r['config']}` | {r['bits_per_element']:.3f} "
                f"({r['k_bits_per_element']:.2f}, {r['v_bits_per_element']:.2f}) | "
                f"{r['ppl']:.3f} | {r['delta_pct']:+.2f}% |")
        if needle:
            acc = r.get("needle_accuracy")
            line += f" {acc:.2f} |" if acc is not None else " - |"
        lines.append(line)
    return "\n".join(lines)


def pareto_front(rows: Sequence[dict]) -> list[dict]:
    """Rows no other row beats on both bits (fewer) and ppl (lower), by bits."""
    front, best = [], math.inf
    for r in sorted(rows, key=lambda r: (r["bits_per_element"], r["ppl"])):
        if r["ppl"] < best:
            front.append(r)
            best = r["ppl"]
    return front


def plot_pareto(rows: Sequence[dict], path: Path, title: str, *,
                max_ppl: float | None = None, max_bits: float | None = None) -> None:
    """ppl vs bits per element (log y), one marker per codec family, the front drawn.

    ``max_ppl`` / ``max_bits`` zoom in: rows beyond them are left out (bf16 stays as
    the dashed baseline)."""
    base_row = next(r for r in rows if r["config"] == "bf16")
    # styles follow the unfiltered families, so a family looks the same in every view
    style = {fam: i for i, fam in enumerate(dict.fromkeys(r["family"] for r in rows))}
    rows = [r for r in rows if r["config"] != "bf16" or max_bits is None]
    rows = [r for r in rows if (max_ppl is None or r["ppl"] <= max_ppl)
            and (max_bits is None or r["bits_per_element"] <= max_bits)]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = "osD^v<>pPX*h"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for fam in dict.fromkeys(r["family"] for r in rows):
        pts = sorted((r for r in rows if r["family"] == fam),
                     key=lambda r: r["bits_per_element"])
        i = style[fam]
        ax.plot([r["bits_per_element"] for r in pts], [r["ppl"] for r in pts],
                marker=markers[i % len(markers)], color=f"C{i % 10}", linestyle=":",
                label=fam)
        for r in pts:
            ax.annotate(r["config"].split(":", 1)[-1] if ":" in r["config"] else r["config"],
                        (r["bits_per_element"], r["ppl"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    front = pareto_front(rows)
    ax.step([r["bits_per_element"] for r in front], [r["ppl"] for r in front],
            where="post", color="0.6", linewidth=3, alpha=0.4, label="Pareto front")
    base = base_row["ppl"]
    ax.axhline(base, color="k", linestyle="--", linewidth=0.8, label=f"bf16 ({base:.2f})")
    ax.set_yscale("log")
    ax.set_xlabel("bits per stored K/V element (measured from the cache arrays)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


#: the zoomed plot keeps the codecs within this factor of bf16's perplexity
ZOOM_PPL = 1.5


def plot_pareto_views(rows: Sequence[dict], path: Path, title: str, *,
                      max_bits: float = 8.0) -> tuple[Path, Path]:
    """The whole front at ``path`` and a zoom beside it (``*_zoom.png``): the codecs
    within :data:`ZOOM_PPL` of bf16's perplexity and at most ``max_bits``, where the
    front is decided. Returns both paths."""
    plot_pareto(rows, path, title)
    base = next(r["ppl"] for r in rows if r["config"] == "bf16")
    zoom = path.with_name(f"{path.stem}_zoom{path.suffix}")
    plot_pareto(rows, zoom, f"ppl < {ZOOM_PPL:g}x bf16, bits <= {max_bits:g}; {title}",
                max_ppl=ZOOM_PPL * base, max_bits=max_bits)
    return path, zoom


def model_evaluator(settings: Settings, *, needle_batch: int | None = None,
                    progress: bool = False) -> Evaluate:
    """Load the model and corpus once; return the function that measures one config."""
    from models.evaluate import (
        cache_perplexity,
        load_model_and_windows,
        needle_cases,
        needle_retrieval,
    )

    config, params, tokenizer, text, wins = load_model_and_windows(
        settings.model, settings.corpus, settings.windows, settings.window_len)
    cases = None
    if settings.needle_trials:
        cases = needle_cases(config, tokenizer, text, lengths=settings.needle_lengths,
                             depths=settings.needle_depths, trials=settings.needle_trials,
                             seed=settings.seed)

    def evaluate(name: str, cache_config: CacheConfig, with_needle: bool) -> dict:
        result = cache_perplexity(params, config, cache_config, wins, chunk=settings.chunk,
                                  seed=settings.seed, progress=progress)
        row = dataclasses.asdict(result)
        if with_needle:
            answers = needle_retrieval(params, config, tokenizer, cache_config, cases,
                                       seed=settings.seed, batch_size=needle_batch)
            row["needle_rows"] = answers
            row["needle_accuracy"] = sum(a["correct"] for a in answers) / len(answers)
        return row

    return evaluate


def protocol_parser(description: str, parts: Sequence[str], name: str, *,
                    window_len: int, summary: str, published: str) -> argparse.ArgumentParser:
    """The arguments every codec's protocol script shares: which parts to run, the model
    and corpus, the windows, and where rows (``results/NAME``) and the tables, plots and
    ``summary`` (``--docs``; ``published`` names the folder of the published ones) go."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--part", action="append", choices=parts)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="shakespeare")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=window_len)
    p.add_argument("--out", type=Path, default=REPO / "results" / name)
    p.add_argument("--docs", type=Path, default=REPO / "results" / name / "docs",
                   help=f"where tables, plots and {summary} go ({published} for the "
                        "published ones)")
    p.add_argument("--no-progress", action="store_true")
    return p


def publish_tables(docs: Path, text: str, summary: dict, *, name: str = "lm") -> None:
    """Write a protocol's tables (``NAME_tables.md``) and summary (``NAME.json``) to
    ``docs``, print the tables and where they went."""
    (docs / f"{name}_tables.md").write_text(text + "\n")
    (docs / f"{name}.json").write_text(json.dumps(summary, indent=1, default=float))
    print(text)
    print(f"\nwritten: {docs / f'{name}_tables.md'}, {docs / f'{name}.json'}")


def build_parser() -> argparse.ArgumentParser:
    """The arguments of the sweep script."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codec", action="append", metavar="SPEC[/VSPEC]",
                   help="a configuration (repeat); added to the preset's if both are given")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named list of configurations (default: demo, without --codec)")
    p.add_argument("--model", default="smollm2-135m", metavar="NAME_OR_PATH")
    p.add_argument("--corpus", default="shakespeare", metavar="NAME|PATH")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=256)
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: window)")
    p.add_argument("--window", type=int, default=0, help="raw residual window (tokens)")
    p.add_argument("--sinks", type=int, default=0, help="raw sink tokens")
    p.add_argument("--raw-k-layers", type=int, nargs="+", default=[], metavar="LAYER",
                   help="layers whose K stays bf16 (negative counts from the end), e.g. "
                        "0 -1 for the first and last block; their bits are counted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--needle", action="store_true", help="also run needle retrieval")
    p.add_argument("--needle-lengths", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--needle-depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--needle-trials", type=int, default=2)
    p.add_argument("--needle-batch", type=int, default=None,
                   help="needle prompts per generate call (default: all of one length); "
                        "the reference attention holds [batch, heads, length, length] scores")
    p.add_argument("--out", type=Path, default=REPO / "results" / "sweep")
    p.add_argument("--force", action="store_true", help="redo finished configurations")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None, evaluate: Evaluate | None = None) -> int:
    """Run the sweep; prints the table and the paths of the CSV, table and plot.

    ``evaluate`` replaces the model evaluation (tests use it); by default the model and
    corpus of the arguments are loaded once. Returns 2 with a one-line reason on bad input.
    """
    args = build_parser().parse_args(argv)
    try:
        for name in ("windows", "window_len"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if args.needle and min(args.needle_trials, *args.needle_lengths,
                               args.needle_batch or 1) < 1:
            raise ValueError("--needle-trials, --needle-lengths and --needle-batch must be "
                             ">= 1")
        configs = list(PRESETS[args.preset]) if args.preset else []
        configs += args.codec or []
        if not configs:
            configs = list(PRESETS["demo"])
        settings = Settings(
            model=args.model, corpus=str(args.corpus), windows=args.windows,
            window_len=args.window_len, chunk=args.chunk, residual_window=args.window,
            sinks=args.sinks, seed=args.seed, raw_k_layers=tuple(args.raw_k_layers),
            needle_lengths=tuple(args.needle_lengths) if args.needle else (),
            needle_depths=tuple(args.needle_depths) if args.needle else (),
            needle_trials=args.needle_trials if args.needle else 0,
        )
        for config in configs:
            parse_config(config, settings)   # bad specs fail before the model loads
        if evaluate is None:
            evaluate = model_evaluator(settings, needle_batch=args.needle_batch)
        rows, run_dir = run_sweep(configs, settings, args.out, evaluate, force=args.force,
                                  progress=not args.no_progress)
    except (ValueError, OSError) as err:
        print(f"sweep: error: {err}", file=sys.stderr)
        return 2
    rows = with_deltas(rows)
    table = markdown_table(rows)
    write_csv(rows, run_dir / "summary.csv")
    (run_dir / "summary.md").write_text(table + "\n")
    title = (f"{settings.model} on {settings.corpus}: {settings.windows} x "
             f"{settings.window_len} tokens" + (f", window {settings.residual_window}"
                                                if settings.residual_window else "")
             + (f", K raw in layers {list(settings.raw_k_layers)}"
                if settings.raw_k_layers else ""))
    plot, zoom = plot_pareto_views(rows, run_dir / "pareto.png", title)
    print(table)
    if settings.needle_trials:
        from kvjax.eval.needle import accuracy_table

        answers = [{"codec": r["config"], **a} for r in rows for a in r["needle_rows"]]
        needle_table = accuracy_table(answers)
        (run_dir / "needle.md").write_text(needle_table + "\n")
        print(f"\nneedle retrieval (exact match, {settings.needle_trials} trial(s)):\n")
        print(needle_table)
    print(f"\nresults: {run_dir}/configs/*.json, {run_dir / 'summary.csv'}")
    print(f"plot:    {plot}, {zoom}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
