"""A sweep of cache configurations on one model and corpus, resumable, with its reports.

A configuration is a cache spec (:func:`kvjax.spec.parse_cache`): ``int:4``,
``k=int:4 v=int:2``, ``kivi:2,g32 layers[0,-1]:k=bf16``. :class:`Settings` holds
everything else a result depends on, including the cache clauses shared by every
configuration of a run (``cache_options``, e.g. ``window=32 layers[0,-1]:k=bf16``),
which are appended to each configuration's spec.

:func:`run_sweep` measures every configuration not done yet with an evaluator passed
in (``evaluate(config, cache_config, with_needle) -> dict``; the model is never
imported here) and writes one JSON per configuration to ``OUT/RUN/configs/``, where
``RUN`` (:meth:`Settings.run_name`) names the settings, so a second run with the same
settings skips what is done. ``bf16`` always runs: it is the baseline of every delta.
:func:`run_seeds` runs the configurations over several seeds, each seed its own run
folder: a configuration whose results depend on the seed (:func:`seed_dependent`) once
per seed, the others once; :func:`write_seed_reports` reports mean and spread over the
seeds in ``OUT/RUN-seedsLABEL`` (:meth:`Settings.seeds_name`).
The rest builds the reports: deltas to bf16, CSV, markdown tables, Pareto plots, and
the helpers the papers' protocol scripts share (seed tables, a lazily loaded
evaluator, their argument parser and published tables).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import functools
import hashlib
import json
import math
import os
import queue
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np

from kvjax.codec import Codec, CodecError
from kvjax.eval.provenance import KEY as PROVENANCE
from kvjax.eval.provenance import provenance, timestamp
from kvjax.spec import CacheConfig, CacheSpecError, parse_cache

#: the configuration every sweep includes and every delta is relative to
BASELINE = "bf16"

#: ``evaluate(config, cache_config, with_needle) -> dict`` measures one configuration
Evaluate = Callable[[str, CacheConfig, bool], dict]


def canonical_options(options: str) -> str:
    """The canonical form of cache clauses shared by every configuration (``window=``,
    ``sinks=``, ``layers[...]:...=`` and ``attn=``); ``""`` for none.

    Raises :class:`~kvjax.spec.CacheSpecError` for a bad clause or a codec clause
    (codecs belong to the configurations)."""
    options = " ".join(options.split())
    if not options:
        return ""
    try:
        config = parse_cache(f"{BASELINE} {options}")
    except CacheSpecError as err:
        raise CacheSpecError(f"cache options '{options}': {err}") from None
    if config.v.spec != BASELINE:
        raise CacheSpecError(f"cache options '{options}': give window=, sinks=, layers[...] "
                             "and attn= clauses; codecs belong to the configurations")
    return config.spec.removeprefix(BASELINE).strip()


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything except the configuration that a result depends on.

    ``cache_options`` are cache-spec clauses appended to every configuration (stored in
    canonical form); the needle fields are empty unless needle retrieval runs;
    ``distribution``: every configuration but the baseline is also compared with the
    bf16 cache (KL divergence and top-1 agreement), so a result stored without them is
    not taken for one with them.
    """

    model: str
    corpus: str
    windows: int
    window_len: int
    chunk: int | None = None
    cache_options: str = ""
    seed: int = 0
    needle_lengths: tuple[int, ...] = ()
    needle_depths: tuple[float, ...] = ()
    needle_trials: int = 0
    distribution: bool = True

    def __post_init__(self):
        object.__setattr__(self, "cache_options", canonical_options(self.cache_options))
        for name in ("needle_lengths", "needle_depths"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def _name_parts(self) -> list[str]:
        parts = [run_label(self.model, self.corpus), f"{self.windows}x{self.window_len}"]
        if self.chunk:
            parts.append(f"c{self.chunk}")
        if self.cache_options:
            parts.append(config_slug(self.cache_options))
        return parts

    def run_name(self) -> str:
        """A directory name that differs whenever a ppl-relevant setting differs."""
        return "-".join([*self._name_parts(), f"seed{self.seed}"])

    def seeds_name(self, seeds: Sequence[int]) -> str:
        """The directory name of a report over ``seeds``: :meth:`run_name` with
        ``seeds0-4`` (consecutive seeds) or ``seeds0_2_7`` in place of the seed."""
        seeds = sorted(set(seeds))
        if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[-1] + 1)):
            label = f"{seeds[0]}-{seeds[-1]}"
        else:
            label = "_".join(str(s) for s in seeds)
        return "-".join([*self._name_parts(), f"seeds{label}"])

    def title(self) -> str:
        """A plot title: model, corpus, windows and the shared cache clauses."""
        return (f"{self.model} on {self.corpus}: {self.windows} x {self.window_len} tokens"
                + (f", {self.cache_options}" if self.cache_options else ""))

    def needle_key(self) -> dict | None:
        """The needle settings a stored result must match (None: no needle)."""
        if not self.needle_trials:
            return None
        return {"lengths": list(self.needle_lengths), "depths": list(self.needle_depths),
                "trials": self.needle_trials}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_")


def run_label(model: str, corpus: str, *parts: str) -> str:
    """The start of a run directory's name: the model's and the corpus' short names (a
    path counts by its file name without suffix), then ``parts``, joined by ``-`` and
    reduced to characters every file system takes."""
    def short(name: str) -> str:
        return _slug(Path(name).stem if os.sep in name else name)

    return "-".join([short(model), short(corpus), *(_slug(p) for p in parts)])


def config_slug(config: str) -> str:
    """A file name for a configuration: readable, and unique through a short hash."""
    digest = hashlib.sha1(config.encode()).hexdigest()[:6]
    return f"{_slug(config)}-{digest}"


def cache_config(config: str, settings: Settings) -> CacheConfig:
    """The cache of ``config`` with the settings' shared clauses appended
    (:class:`~kvjax.spec.CacheSpecError`, a ``ValueError``, if bad)."""
    return parse_cache(f"{config} {settings.cache_options}".strip())


def family(config: str | CacheConfig) -> str:
    """The codec family of a configuration: the codec names without options, K's alone
    when V is K's value codec (``kivi:2,g32`` is ``kivi``), else ``K/V``
    (``k=int:4 v=int:2`` is ``int/int``); ``+med`` where outliers are extracted
    (``int:4,med3`` is ``int+med``). Layer rules do not change the family."""
    cc = parse_cache(config)

    def one(spec: str) -> str:
        name, _, options = spec.partition(":")
        return name + ("+med" if any(o.startswith("med") for o in options.split(",")) else "")

    specs = [cc.k.spec] if cc.v == cc.k.value_codec() else [cc.k.spec, cc.v.spec]
    return "/".join(one(s) for s in specs)


#: head dims :func:`is_seeded` draws a codec's parameters at, the first one it accepts
PROBE_HEAD_DIMS = (64, 128, 256, 96, 80, 48, 32, 16, 8)


@functools.cache
def _codec_seeded(codec: Codec, head_dim: int | None) -> bool:
    for dim in (head_dim,) if head_dim else PROBE_HEAD_DIMS:
        try:
            codec.check_head_dim(dim)
        except CodecError:
            continue
        a, b = (jax.tree.flatten(codec.init(jax.random.PRNGKey(s), dim)) for s in (0, 1))
        return a[1] != b[1] or not all(np.array_equal(x, y) for x, y in zip(a[0], b[0],
                                                                             strict=True))
    # no head dim to look at: counted seeded, which only costs measuring it per seed
    return True


def is_seeded(config: str | CacheConfig, *, head_dim: int | None = None) -> bool:
    """Whether a cache's codec parameters depend on the seed.

    Codecs do not declare it, so it is measured: every codec of the cache (K, V and
    those of the layer rules) draws its parameters (:meth:`~kvjax.codec.Codec.init`)
    from two keys, ``PRNGKey(0)`` and ``PRNGKey(1)``, at ``head_dim`` (default: the first
    of :data:`PROBE_HEAD_DIMS` it accepts), and the cache is seeded when any two
    parameter pytrees differ in structure or in a value. A codec is a function of its
    parameters (it carries no arrays), so equal parameters mean equal codes. A codec that
    accepts none of the head dims counts as seeded. The conformance suite checks the same
    property against each example's ``seeded``.
    """
    cc = parse_cache(config)
    codecs = dict.fromkeys([cc.k, cc.v, *(rule.codec for rule in cc.layers)])
    return any(_codec_seeded(codec, head_dim) for codec in codecs)


def seed_dependent(config: str, settings: Settings) -> bool:
    """Whether the results of ``config`` under ``settings`` depend on the seed.

    Perplexity sees the seed only through the codec parameters (``cache_perplexity``
    draws the cache's parameters from ``PRNGKey(seed)``; the windows are the corpus's
    first tokens), so it depends on the seed when the cache :func:`is_seeded`. The
    needle's prompts are drawn from the seed, so with the needle every configuration
    depends on it.
    """
    return settings.needle_trials > 0 or is_seeded(cache_config(config, settings))


def write_json(path: Path, data: dict, *, source: dict | None = None) -> dict:
    """Write ``data`` with its provenance (``source``, default :func:`provenance` now)
    under :data:`kvjax.eval.provenance.KEY`, atomically: a killed script never leaves a
    half-written file. Returns what was written."""
    path = Path(path)
    record = {**data, PROVENANCE: source if source is not None else provenance()}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=float) + "\n")
    os.replace(tmp, path)
    return record


def write_table_reports(out: Path, title: str, table: str, rows: Sequence[dict],
                        fields: Sequence[str], csv_name: str, plot: Callable,
                        plot_name: str) -> str:
    """``summary.md`` (``title`` and the markdown ``table``), ``csv_name`` (``fields`` of
    every row) and ``plot_name`` (``plot(rows, path, title)``) in ``out``; returns the
    table and the three paths, to print."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(f"{title}\n\n{table}\n")
    with (out / csv_name).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows({k: r.get(k) for k in fields} for r in rows)
    plot(rows, out / plot_name, title)
    return "\n".join([table, f"\ntable:   {out / 'summary.md'}",
                      f"csv:     {out / csv_name}", f"plot:    {out / plot_name}"])


#: JSON fields that must match for a stored result to count as done
SETTING_KEYS = ("model", "corpus", "windows", "window_len", "chunk", "cache_options", "seed",
                "distribution")


def _is_done(path: Path, settings: Settings, spec: str, want_needle: bool) -> bool:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    # compared as JSON holds them (tuples come back as lists)
    wanted = json.loads(json.dumps(dataclasses.asdict(settings)))
    if stored.get("cache_spec") != spec or any(stored.get(k) != wanted[k]
                                               for k in SETTING_KEYS):
        return False
    return not want_needle or stored.get("needle") == settings.needle_key()


def _result_path(run_dir: Path, config: str) -> Path:
    return run_dir / "configs" / f"{config_slug(config)}.json"


def sweep_devices(count: int | None) -> list[jax.Device] | None:
    """The first ``count`` devices for a sweep to measure on, one configuration per device
    at a time (None or 1: the default device alone, serially). Raises ``ValueError``
    when there are fewer."""
    if count is None or count == 1:
        return None
    devices = jax.devices()
    if not isinstance(count, int) or count < 1 or count > len(devices):
        raise ValueError(f"a sweep over {count} devices needs 1..{len(devices)} "
                         f"({len(devices)} {devices[0].platform} devices here)")
    return devices[:count]


def _measure(todo: Sequence[tuple[Settings, str]], done: int, out: Path,
             cache_configs: dict[str, CacheConfig],
             evaluator: Callable[[Settings], Evaluate], *, progress: bool,
             show_seed: bool = False, devices: Sequence[jax.Device] | None = None) -> None:
    """Measure each ``(settings, config)`` of ``todo`` with ``evaluator(settings)`` and
    write its row; ``done`` counts the measurements already there, for the bar.

    ``devices``: measure ``len(devices)`` configurations at once, each in a thread whose
    default device is its own (``jax.default_device``: everything it creates and runs
    lives there; JAX lets go of the interpreter while a device computes). A row is
    written as soon as its configuration is measured, whichever finishes first, so
    resuming works as for a serial run, and each configuration's result is computed
    exactly as it would be alone."""
    source = provenance() if todo else None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=done + len(todo), initial=done, desc="sweep", unit="config")

    def measure(settings: Settings, config: str) -> dict:
        t0 = time.perf_counter()
        cc = cache_configs[config]
        want_needle = settings.needle_trials > 0
        measured = evaluator(settings)(config, cc, want_needle)
        return {
            "config": config, "family": family(config), "cache_spec": cc.spec,
            "k_codec": cc.k.spec, "v_codec": cc.v.spec,
            **dataclasses.asdict(settings),
            "needle": settings.needle_key(),
            **measured,
            "wall_seconds": time.perf_counter() - t0,
        }

    def record(settings: Settings, config: str, row: dict) -> None:
        path = _result_path(Path(out) / settings.run_name(), config)
        write_json(path, row, source={**source, "time": timestamp()})
        if bar is not None:
            bar.update(1)

    def label(settings: Settings, config: str) -> str:
        return f"seed {settings.seed}: {config}" if show_seed else config

    if devices is None or len(devices) < 2 or len(todo) < 2:
        for settings, config in todo:
            if bar is not None:
                bar.set_postfix_str(label(settings, config))
            record(settings, config, measure(settings, config))
    else:
        free: queue.Queue = queue.Queue()
        for device in devices:
            free.put(device)

        def on_a_device(settings: Settings, config: str) -> dict:
            device = free.get()
            try:
                with jax.default_device(device):
                    return measure(settings, config)
            finally:
                free.put(device)

        error = None
        with concurrent.futures.ThreadPoolExecutor(len(devices)) as pool:
            running = {pool.submit(on_a_device, s, c): (s, c) for s, c in todo}
            for future in concurrent.futures.as_completed(running):
                if future.cancelled():
                    continue
                if future.exception() is not None:
                    # the first failure stops what has not started; what runs still
                    # finishes and is kept, as a serial run keeps what came before
                    if error is None:
                        error = future.exception()
                        for other in running:
                            other.cancel()
                    continue
                settings, config = running[future]
                record(settings, config, future.result())
                if bar is not None:
                    bar.set_postfix_str(label(settings, config))
        if error is not None:
            if bar is not None:
                bar.close()
            raise error
    if bar is not None:
        bar.close()


def run_sweep(
    configs: Sequence[str],
    settings: Settings,
    out: Path,
    evaluate: Evaluate,
    *,
    force: bool = False,
    progress: bool = True,
    devices: Sequence[jax.Device] | None = None,
) -> tuple[list[dict], Path]:
    """Evaluate every configuration not done yet and return all rows and the run folder.

    ``evaluate(config, cache_config, with_needle) -> dict`` measures one configuration
    (``ppl``, ``bits_per_element``, ...; ``needle_accuracy`` and ``needle_rows`` when
    asked). Each result is written to ``out/RUN/configs/SLUG.json`` as soon as it exists,
    with the settings, the configuration, its family, the canonical cache spec, the K and
    V codec specs and the provenance. Configurations are validated before anything runs.
    ``devices`` (:func:`sweep_devices`): configurations measured at once, one per device,
    with the results a serial run gives (``evaluate`` is called from several threads,
    each under its device: :func:`lazy_evaluator` builds one evaluator per device).
    """
    configs = list(dict.fromkeys([BASELINE, *configs]))
    cache_configs = {c: cache_config(c, settings) for c in configs}
    run_dir = Path(out) / settings.run_name()
    (run_dir / "configs").mkdir(parents=True, exist_ok=True)
    want_needle = settings.needle_trials > 0
    todo = [c for c in configs if force or not _is_done(
        _result_path(run_dir, c), settings, cache_configs[c].spec, want_needle)]
    _measure([(settings, c) for c in todo], len(configs) - len(todo), out, cache_configs,
             lambda _: evaluate, progress=progress, devices=devices)
    return stored_rows(run_dir, settings, configs), run_dir


def stored_rows(run_dir: Path, settings: Settings, first: Sequence[str] = ()) -> list[dict]:
    """Every configuration stored in ``run_dir/configs`` that was measured with
    ``settings``: those of ``first`` in that order, then the others by file name. A
    sweep's reports are built from them all, so a rerun with other configurations into
    the same run folder adds to its summary and plots rather than replacing them
    (rerunning with any configuration, e.g. ``--codec bf16``, rebuilds them)."""
    wanted = json.loads(json.dumps(dataclasses.asdict(settings)))
    order = {_result_path(run_dir, c).name: i for i, c in enumerate(first)}
    rows = []
    for path in sorted((Path(run_dir) / "configs").glob("*.json"),
                       key=lambda p: (order.get(p.name, len(order)), p.name)):
        try:
            row = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # an unreadable file is not a result; the run that wrote it redoes it
        if isinstance(row, dict) and all(row.get(k) == wanted[k] for k in SETTING_KEYS):
            rows.append(row)
    return rows


def run_seeds(
    configs: Sequence[str],
    settings: Settings,
    seeds: Sequence[int],
    out: Path,
    build: Callable[[Settings], Evaluate],
    *,
    force: bool = False,
    progress: bool = True,
    devices: Sequence[jax.Device] | None = None,
) -> tuple[dict[int, list[dict]], Path]:
    """:func:`run_sweep` over ``seeds``: returns every seed's rows and the folder of the
    report over the seeds (``out/`` :meth:`Settings.seeds_name`, created).

    ``settings.seed`` is ignored; seed ``s`` runs with ``settings`` at ``seed=s`` and
    writes to that run's folder, as :func:`run_sweep` does, so a seed's results are
    found again there by either function. A configuration whose results depend on the
    seed (:func:`seed_dependent`) is measured for every seed; any other once, under the
    first seed whose folder holds it (the lowest seed when none does) and its row stands
    for every seed. Rows carry ``seeded`` (True for the former). ``build(settings)``
    returns the evaluator of a seed's settings; it is called only for a seed with
    something to measure (:func:`lazy_evaluator`). Measurements go seed by seed under
    one progress bar; configurations are validated before anything runs. ``devices``: as
    :func:`run_sweep`'s.
    """
    seeds = sorted(set(seeds))
    if not seeds:
        raise ValueError("run_seeds needs at least one seed")
    configs = list(dict.fromkeys([BASELINE, *configs]))
    cache_configs = {c: cache_config(c, settings) for c in configs}
    runs = {s: dataclasses.replace(settings, seed=s) for s in seeds}
    for run in runs.values():
        (Path(out) / run.run_name() / "configs").mkdir(parents=True, exist_ok=True)
    want_needle = settings.needle_trials > 0

    def done(seed: int, config: str) -> bool:
        run = runs[seed]
        return not force and _is_done(_result_path(Path(out) / run.run_name(), config), run,
                                      cache_configs[config].spec, want_needle)

    seeded = {c: seed_dependent(c, settings) for c in configs}
    measured_at = {c: next((s for s in seeds if done(s, c)), seeds[0])
                   for c in configs if not seeded[c]}
    plan = [(s, c) for s in seeds for c in configs if seeded[c] or measured_at[c] == s]
    todo = [(s, c) for s, c in plan if not done(s, c)]
    evaluators: dict = {}
    by_seed = {s: lazy_evaluator(run, evaluators, build) for s, run in runs.items()}
    _measure([(runs[s], c) for s, c in todo], len(plan) - len(todo), out, cache_configs,
             lambda run: by_seed[run.seed], progress=progress, show_seed=True,
             devices=devices)

    def row(seed: int, config: str) -> dict:
        at = seed if seeded[config] else measured_at[config]
        path = _result_path(Path(out) / runs[at].run_name(), config)
        return {**json.loads(path.read_text()), "seeded": seeded[config]}

    per_seed = {s: [row(s, c) for c in configs] for s in seeds}
    seeds_dir = Path(out) / settings.seeds_name(seeds)
    seeds_dir.mkdir(parents=True, exist_ok=True)
    return per_seed, seeds_dir


# -- reports ------------------------------------------------------------------------


CSV_FIELDS = ("config", "family", "cache_spec", "k_codec", "v_codec", "bits_per_element",
              "k_bits_per_element", "v_bits_per_element", "ppl", "delta_pct", "nll",
              "tokens", "needle_accuracy", "fallback_blocks", "outlier_chunks",
              "outlier_overflow", "medc_chunks", "outlier_overflow_share", "kl_mean",
              "kl_p99", "top1_agreement", "reference_ppl", "seconds",
              "model", "corpus", "windows", "window_len", "chunk", "cache_options", "seed",
              "git")


def with_deltas(rows: Sequence[dict]) -> list[dict]:
    """Rows with ``delta_pct``: ppl relative to the bf16 row, in percent."""
    base = next(r["ppl"] for r in rows if r["config"] == BASELINE)
    return [{**r, "delta_pct": 100.0 * (r["ppl"] / base - 1.0)} for r in rows]


def write_csv(rows: Sequence[dict], path: Path) -> None:
    """All rows, one per configuration, the columns of ``CSV_FIELDS`` (``git`` from the
    row's provenance)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            cells = {k: r.get(k) for k in CSV_FIELDS}
            cells["git"] = (r.get(PROVENANCE) or {}).get("git")
            writer.writerow(cells)


def markdown_table(rows: Sequence[dict]) -> str:
    """Configurations sorted by bits: bits, ppl, delta to bf16 (and needle accuracy);
    where rows were compared with the bf16 cache, mean and p99 KL and top-1 agreement
    (``-`` in the others: the baseline itself); where a row has Med-C outliers, the
    share of its over-threshold chunks that did not fit a block's slots
    (``outlier_overflow_share``; ``-`` in the other rows)."""
    needle = any(r.get("needle_accuracy") is not None for r in rows)
    overflow = any(r.get("outlier_overflow_share") is not None for r in rows)
    divergence = any(r.get("kl_mean") is not None for r in rows)
    head = "| codec | bits / element (K, V) | ppl | vs bf16 |"
    rule = "|---|---|---|---|"
    if divergence:
        head += " KL mean | KL p99 | top-1 |"
        rule += "---|---|---|"
    if needle:
        head += " needle |"
        rule += "---|"
    if overflow:
        head += " Med-C overflow |"
        rule += "---|"
    lines = [head, rule]
    for r in sorted(rows, key=lambda r: (-r["bits_per_element"], r["config"])):
        line = (f"| `{r['config']}` | {r['bits_per_element']:.3f} "
                f"({r['k_bits_per_element']:.2f}, {r['v_bits_per_element']:.2f}) | "
                f"{r['ppl']:.3f} | {r['delta_pct']:+.2f}% |")
        if divergence:
            if r.get("kl_mean") is None:
                line += " - | - | - |"
            else:
                line += (f" {r['kl_mean']:.4f} | {r['kl_p99']:.4f} | "
                         f"{100 * r['top1_agreement']:.1f}% |")
        if needle:
            acc = r.get("needle_accuracy")
            line += f" {acc:.2f} |" if acc is not None else " - |"
        if overflow:
            share = r.get("outlier_overflow_share")
            line += f" {100 * share:.2f}% |" if share is not None else " - |"
        lines.append(line)
    return "\n".join(lines)


def _finish(fig, ax, path: Path, title: str, *, legend_size: int) -> None:
    """Title, grid and legend, then the figure saved to ``path`` and closed."""
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def pareto_front(rows: Sequence[dict], metric: str = "ppl") -> list[dict]:
    """Rows no other row beats on both bits (fewer) and ``metric`` (lower), by bits."""
    front, best = [], math.inf
    for r in sorted(rows, key=lambda r: (r["bits_per_element"], r[metric])):
        if r[metric] < best:
            front.append(r)
            best = r[metric]
    return front


#: what the Pareto plots can put on the y axis (log scale): the row key and its label
METRICS = {
    "ppl": "perplexity",
    "kl_mean": "mean KL(P_bf16 || P) per token, nats",
    "kl_p99": "p99 KL(P_bf16 || P) per token, nats",
}


def plot_pareto(rows: Sequence[dict], path: Path, title: str, *,
                max_ppl: float | None = None, max_bits: float | None = None,
                spread: Mapping[str, tuple[float, float]] | None = None,
                spread_label: str = "", metric: str = "ppl") -> None:
    """``metric`` (:data:`METRICS`, default ppl) vs bits per element (log y), one marker
    per codec family, the front drawn.

    ``max_ppl`` / ``max_bits`` zoom in: rows beyond them are left out (bf16 stays as
    the dashed baseline). ``spread`` maps a configuration to the ``(low, high)`` ppl of
    an error bar around its point (none where low == high), named ``spread_label`` in
    the legend. Rows without ``metric`` (the baseline's KL) are left out."""
    base_row = next(r for r in rows if r["config"] == BASELINE)
    # styles follow the unfiltered families, so a family looks the same in every view
    style = {fam: i for i, fam in enumerate(dict.fromkeys(r["family"] for r in rows))}
    rows = [r for r in rows if r["config"] != BASELINE or max_bits is None]
    rows = [r for r in rows if (max_ppl is None or r["ppl"] <= max_ppl)
            and (max_bits is None or r["bits_per_element"] <= max_bits)
            and r.get(metric) is not None]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = "osD^v<>pPX*h"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    has_bars = False
    for fam in dict.fromkeys(r["family"] for r in rows):
        pts = sorted((r for r in rows if r["family"] == fam),
                     key=lambda r: r["bits_per_element"])
        i = style[fam]
        ax.plot([r["bits_per_element"] for r in pts], [r[metric] for r in pts],
                marker=markers[i % len(markers)], color=f"C{i % 10}", linestyle=":",
                label=fam)
        bars = [r for r in pts if metric == "ppl" and spread
                and spread[r["config"]][1] > spread[r["config"]][0]]
        if bars:
            lows, highs = zip(*(spread[r["config"]] for r in bars), strict=True)
            ax.errorbar([r["bits_per_element"] for r in bars], [r["ppl"] for r in bars],
                        yerr=[[r["ppl"] - lo for r, lo in zip(bars, lows, strict=True)],
                              [hi - r["ppl"] for r, hi in zip(bars, highs, strict=True)]],
                        fmt="none", ecolor=f"C{i % 10}", elinewidth=1, capsize=3)
            has_bars = True
        for r in pts:
            ax.annotate(r["config"].split(":", 1)[-1] if ":" in r["config"] else r["config"],
                        (r["bits_per_element"], r[metric]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    if has_bars:
        # the bars take their family's colour; the legend names them once, in grey
        ax.errorbar([], [], yerr=[], fmt="none", ecolor="0.4", elinewidth=1, capsize=3,
                    label=spread_label or "spread")
    front = pareto_front(rows, metric)
    ax.step([r["bits_per_element"] for r in front], [r[metric] for r in front],
            where="post", color="0.6", linewidth=3, alpha=0.4, label="Pareto front")
    if metric == "ppl":
        base = base_row["ppl"]
        ax.axhline(base, color="k", linestyle="--", linewidth=0.8, label=f"bf16 ({base:.2f})")
    ax.set_yscale("log")
    ax.set_xlabel("bits per stored K/V element (measured from the cache arrays)")
    ax.set_ylabel(f"{METRICS[metric]} (log scale)")
    _finish(fig, ax, path, title, legend_size=8)


#: the zoomed plot keeps the codecs within this factor of bf16's perplexity
ZOOM_PPL = 1.5


def plot_pareto_views(rows: Sequence[dict], path: Path, title: str, *,
                      max_bits: float = 8.0,
                      spread: Mapping[str, tuple[float, float]] | None = None,
                      spread_label: str = "") -> tuple[Path, Path]:
    """The whole front at ``path`` and a zoom beside it (``*_zoom.png``): the codecs
    within :data:`ZOOM_PPL` of bf16's perplexity and at most ``max_bits``, where the
    front is decided; ``spread`` as :func:`plot_pareto`'s. Returns both paths."""
    bars = {"spread": spread, "spread_label": spread_label}
    plot_pareto(rows, path, title, **bars)
    base = next(r["ppl"] for r in rows if r["config"] == BASELINE)
    zoom = path.with_name(f"{path.stem}_zoom{path.suffix}")
    plot_pareto(rows, zoom, f"ppl < {ZOOM_PPL:g}x bf16, bits <= {max_bits:g}; {title}",
                max_ppl=ZOOM_PPL * base, max_bits=max_bits, **bars)
    return path, zoom


def plot_kl_by_position(rows: Sequence[dict], path: Path, title: str) -> None:
    """Mean KL against the bf16 cache per position bucket of the window (log y), one
    line per configuration compared (``kl_by_position`` of the rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, r in enumerate(r for r in rows if r.get("kl_by_position")):
        buckets = [b for b in r["kl_by_position"] if b["tokens"]]
        ax.plot([(b["start"] + b["end"] - 1) / 2 for b in buckets],
                [b["kl_mean"] for b in buckets], marker="osD^v<>pPX*h"[i % 12],
                color=f"C{i % 10}", label=r["config"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("position in the window (bucket middle, log scale)")
    ax.set_ylabel(f"{METRICS['kl_mean']} (log scale)")
    _finish(fig, ax, path, title, legend_size=7)


def write_reports(rows: Sequence[dict], settings: Settings, run_dir: Path) -> str:
    """A finished sweep's reports in ``run_dir``: ``summary.csv``, ``summary.md``,
    ``pareto.png`` and ``pareto_zoom.png``; where rows were compared with the bf16
    cache, ``pareto_kl.png`` (mean KL vs bits) and ``kl_by_position.png``; and
    ``needle.md`` when the needle ran. Returns what to print: the tables and the
    paths."""
    from kvjax.eval.needle import accuracy_table

    rows = with_deltas(rows)
    table = markdown_table(rows)
    write_csv(rows, run_dir / "summary.csv")
    (run_dir / "summary.md").write_text(table + "\n")
    plot, zoom = plot_pareto_views(rows, run_dir / "pareto.png", settings.title())
    plots = [plot, zoom]
    if any(r.get("kl_mean") is not None for r in rows):
        plots += [run_dir / "pareto_kl.png", run_dir / "kl_by_position.png"]
        plot_pareto(rows, plots[2], settings.title(), metric="kl_mean")
        plot_kl_by_position(rows, plots[3], settings.title())
    text = [table]
    if settings.needle_trials:
        answers = [{"codec": r["config"], **a} for r in rows for a in r["needle_rows"]]
        needle_table = accuracy_table(answers)
        (run_dir / "needle.md").write_text(needle_table + "\n")
        text += [f"\nneedle retrieval (exact match, {settings.needle_trials} trial(s)):\n",
                 needle_table]
    text += [f"\nresults: {run_dir}/configs/*.json, {run_dir / 'summary.csv'}",
             "plots:   " + ", ".join(map(str, plots))]
    return "\n".join(text)


# -- what the protocol scripts share ------------------------------------------------


def lazy_evaluator(settings: Settings, cache: dict,
                   build: Callable[[Settings], Evaluate]) -> Evaluate:
    """An evaluator that calls ``build(settings)`` (which loads the model) only when a
    configuration actually needs measuring, so an aggregation of finished results loads
    nothing; evaluators are kept in ``cache`` and shared by runs whose settings differ
    only in their cache clauses (the seed draws the codecs' parameters inside the
    evaluator: a new seed is a new evaluator, and a ``build`` that keeps its loaded
    models, such as ``models.evaluate.sweep_builder()``, loads a model once for every
    seed). Called under ``jax.default_device`` (a sweep over several devices), it builds
    one evaluator per device, under that device."""
    plain = dataclasses.replace(settings, cache_options="")

    def evaluate(name: str, cache_config: CacheConfig, with_needle: bool) -> dict:
        key = (plain, jax.config.jax_default_device)
        if key not in cache:
            cache[key] = build(settings)
        return cache[key](name, cache_config, with_needle)

    return evaluate


def seed_rows(per_seed: dict[int, list[dict]], *, baseline: bool = False) -> list[dict]:
    """Per configuration present in every seed: family, bits, ppl per seed (in seed
    order), their mean, sample sd (0 for one seed), min and max, the delta of the mean
    to bf16's (bf16 has no random parameters: the lowest seed's stands for all), and
    ``seeded``, the rows' own (:func:`run_seeds` marks them; None when they do not say).
    bf16's row is left out unless ``baseline``."""
    seeds = sorted(per_seed)
    by_seed = {s: {r["config"]: r for r in rows} for s, rows in per_seed.items()}
    base = by_seed[seeds[0]][BASELINE]["ppl"]
    out = []
    for config, first in by_seed[seeds[0]].items():
        if (config == BASELINE and not baseline) or not all(config in by_seed[s]
                                                             for s in seeds):
            continue
        ppl = [by_seed[s][config]["ppl"] for s in seeds]
        mean = statistics.fmean(ppl)
        out.append({"config": config, "family": first.get("family") or family(config),
                    "bits_per_element": first["bits_per_element"], "ppl": ppl,
                    "mean": mean, "sd": statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
                    "min": min(ppl), "max": max(ppl), "delta_pct": 100 * (mean / base - 1),
                    "seeded": first.get("seeded")})
    return out


#: marks a configuration measured once for every seed in :func:`seed_table`
UNSEEDED_MARK = "†"


def seed_table(rows: Sequence[dict], seeds: Sequence[int], *,
               extremes: bool = False) -> str:
    """Markdown: configuration, bits, ppl per seed, mean +- sd (then min .. max with
    ``extremes``), delta of the mean. Rows whose ``seeded`` is False carry
    :data:`UNSEEDED_MARK`, explained under the table."""
    head = ("| codec | bits / element | " + " | ".join(f"seed {s}" for s in seeds)
            + " | mean +- sd |" + (" min .. max |" if extremes else "") + " vs bf16 |")
    lines = [head, "|---|---|" + "---|" * (len(seeds) + 2 + extremes)]
    for r in sorted(rows, key=lambda r: (r["bits_per_element"], r["config"])):
        mark = f" {UNSEEDED_MARK}" if r.get("seeded") is False else ""
        cells = [f"`{r['config']}`{mark}", f"{r['bits_per_element']:.3f}",
                 *(f"{p:.2f}" for p in r["ppl"]), f"{r['mean']:.2f} +- {r['sd']:.2f}"]
        if extremes:
            cells.append(f"{r['min']:.2f} .. {r['max']:.2f}")
        cells.append(f"{r['delta_pct']:+.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    if any(r.get("seeded") is False for r in rows):
        lines += ["", f"{UNSEEDED_MARK} parameters independent of the seed: measured once, "
                  "the same perplexity for every seed"]
    return "\n".join(lines)


def write_seed_csv(rows: Sequence[dict], seeds: Sequence[int], path: Path) -> None:
    """:func:`seed_rows` as CSV, one row per configuration: ``ppl_seedS`` per seed, then
    mean, sd, min, max and the delta of the mean; ``seeded`` False where measured once."""
    fields = ["config", "family", "seeded", "bits_per_element",
              *(f"ppl_seed{s}" for s in seeds), "mean", "sd", "min", "max", "delta_pct"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, **{f"ppl_seed{s}": p
                                     for s, p in zip(seeds, r["ppl"], strict=True)}})


def write_seed_reports(per_seed: dict[int, list[dict]], settings: Settings,
                       seeds_dir: Path) -> str:
    """The reports of :func:`run_seeds` in ``seeds_dir``: ``summary.csv``
    (:func:`write_seed_csv`), ``summary.md`` (:func:`seed_table` with min .. max, bf16
    included), ``pareto.png`` and ``pareto_zoom.png`` (the mean per configuration, its
    min .. max over the seeds as an error bar; the front is that of the means). Returns
    what to print: the table and the paths."""
    seeds = sorted(per_seed)
    rows = seed_rows(per_seed, baseline=True)
    table = seed_table(rows, seeds, extremes=True)
    write_seed_csv(rows, seeds, seeds_dir / "summary.csv")
    (seeds_dir / "summary.md").write_text(table + "\n")
    title = (f"{settings.title()}\nmean of seeds {', '.join(str(s) for s in seeds)} "
             "(bars: min .. max)")
    plot, zoom = plot_pareto_views(
        [{**r, "ppl": r["mean"]} for r in rows], seeds_dir / "pareto.png", title,
        spread={r["config"]: (r["min"], r["max"]) for r in rows},
        spread_label="min .. max over the seeds")
    runs = [seeds_dir.parent / dataclasses.replace(settings, seed=s).run_name() / "configs"
            for s in seeds]
    return "\n".join([table, "\nper seed: " + ", ".join(str(r) for r in runs),
                      f"results: {seeds_dir / 'summary.csv'}, {seeds_dir / 'summary.md'}",
                      f"plot:    {plot}, {zoom}"])


def protocol_parser(description: str, parts: Sequence[str], name: str, *,
                    window_len: int, summary: str, published: str,
                    cache_options: str = "") -> argparse.ArgumentParser:
    """The arguments every codec's protocol script shares: which parts to run, the model
    and corpus, the windows, the cache clauses shared by every configuration, and where
    rows (``results/NAME``) and the tables, plots and ``summary`` (``--docs``;
    ``published`` names the folder of the published ones) go. Paths are relative to the
    working directory, the repository root."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--part", action="append", choices=parts)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="shakespeare")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=window_len)
    p.add_argument("--cache-options", default=cache_options, metavar="CLAUSES",
                   help="cache-spec clauses added to every configuration, e.g. "
                        f"'window=32 sinks=4' (default: '{cache_options}')")
    p.add_argument("--out", type=Path, default=Path("results") / name)
    p.add_argument("--docs", type=Path, default=Path("results") / name / "docs",
                   help=f"where tables, plots and {summary} go ({published} for the "
                        "published ones)")
    p.add_argument("--no-progress", action="store_true")
    return p


def publish_tables(docs: Path, text: str, summary: dict, *, name: str = "lm") -> None:
    """Write a protocol's tables (``NAME_tables.md``) and summary (``NAME.json``, with
    its provenance) to ``docs``, print the tables and where they went."""
    (docs / f"{name}_tables.md").write_text(text + "\n")
    write_json(docs / f"{name}.json", summary)
    print(text)
    print(f"\nwritten: {docs / f'{name}_tables.md'}, {docs / f'{name}.json'}")


__all__ = [
    "BASELINE",
    "CSV_FIELDS",
    "PROBE_HEAD_DIMS",
    "SETTING_KEYS",
    "UNSEEDED_MARK",
    "ZOOM_PPL",
    "Evaluate",
    "Settings",
    "cache_config",
    "canonical_options",
    "config_slug",
    "family",
    "is_seeded",
    "lazy_evaluator",
    "markdown_table",
    "pareto_front",
    "plot_pareto",
    "plot_pareto_views",
    "protocol_parser",
    "publish_tables",
    "run_label",
    "run_seeds",
    "run_sweep",
    "seed_dependent",
    "seed_rows",
    "seed_table",
    "with_deltas",
    "write_csv",
    "write_json",
    "write_reports",
    "write_seed_csv",
    "write_seed_reports",
    "write_table_reports",
]
