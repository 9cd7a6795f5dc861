"""OCTOPUS's synthetic claims (sections 3.3, 3.5 and 4.1) against TurboQuant and PolarQuant.

    python experiments/octopus_synthetic.py --docs docs/octopus
    python experiments/octopus_synthetic.py --parts split,grid --split-seeds 16

Parts (``--parts``, comma-separated; default all):

The measurements are :mod:`kvjax.eval.rotation_probes`'; this script holds the codec
lists, the paper's numbers and the tables.

* ``keys``: Gaussian keys ``[1024, 128]`` and 16 Gaussian queries over 64 seeds
  (:func:`~kvjax.eval.rotation_probes.keys_part`) for ``turboquant:bB``,
  ``turboquant:bB,qjl``, ``polarquant:bB``, ``octopus:bB`` and ``octopus:bB,qjl`` at
  B in {2, 3, 4}, plus rate references (``turboquant:b5``, ``turboquant:b5,qjl``) for the
  equal-bits view: mean reconstruction cosine, per-coordinate MSE, mean ``|q.k - score|``
  through each codec's own :meth:`~kvjax.codec.Codec.scores`, the stored bits per element
  (the formula, checked against the bytes of the codes) and ``s(k, k) / |k|^2``, how much
  the codec's score of a key with itself shrinks (``self_score_gain``). The ratios the
  paper states, and each codec against TurboQuant at equal stored bits, are computed
  from these rows.
* ``needle``: one needle among 2048 Gaussian distractors, query ``k* + 0.1 |k*| e``
  (``e`` a random unit vector), logits ``score / sqrt(D)``, 128 seeds
  (:func:`kvjax.eval.synthetic.needle`): softmax mass on the needle for exact float32
  keys and each codec, and each codec's ratio to that baseline.
* ``split``: ``octopus:d{b+delta},n{b-delta}`` for b in {2, 3, 4} and delta in -2..2, MSE
  relative to the uniform split (delta = 0) and to the paper's (delta = +1), on the keys
  protocol with fewer seeds (16); and the equal-rate splits ``(b, b)`` and
  ``(b + 1, b - 2)``, which spend TurboQuant's 3b bits per triplet, next to
  ``turboquant:bB`` on the same seeds.
* ``grid``: ``kvjax.codecs.octopus.joint_round`` over the 3x3 neighbours of the scalar
  seed against the full grid of directions, on 10^4 rotated triplets at D = 128, for
  2..5 direction bits and norm bits ``b_dir - 2`` and 2: the fraction of triplets whose
  indices agree and the ratio of the two total errors.

Seeds. Trial ``s`` of ``--seed`` draws its data and its codec parameters (rotation signs,
QJL sketch) from ``fold_in(key(seed), s)`` (:mod:`kvjax.eval.synthetic`): every trial is
new data and a new rotation, and every codec sees the same data in the same trial.

With ``--docs DIR`` the results go to ``DIR/synthetic.json`` (every part run so far: a
part run alone replaces only its own entry; with the provenance of the run),
``DIR/synthetic.md`` (the command, each part's settings and its tables next to the
paper's numbers) and ``DIR/synthetic.png``. What the tables say is discussed in
``docs/octopus.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvjax import compile_cache
from kvjax.eval.rotation_probes import (
    BITS,
    DELTAS,
    GRID_BITS,
    equal_bits,
    grid_part,
    keys_part,
    metric_ratio,
    needle_part,
    split_part,
)
from kvjax.eval.sweep import write_json
from kvjax.spec import parse_codec

PARTS = ("keys", "needle", "split", "grid")
#: family -> spec template, in table order
FAMILIES = {
    "turboquant": "turboquant:b{b}",
    "turboquant-qjl": "turboquant:b{b},qjl",
    "polarquant": "polarquant:b{b}",
    "octopus": "octopus:b{b}",
    "octopus-qjl": "octopus:b{b},qjl",
}
RATE_REFS = ("turboquant:b5", "turboquant:b5,qjl")

#: the paper's statements (section 4.1, 3.3, 3.5) that the tables are set against
PAPER = {
    "mse_turboquant_b4_over_octopus_b4": 1.3,
    "mse_polarquant_b2_over_octopus_b2": 2.4,
    "ip_turboquant_qjl_over_octopus_qjl": 3.0,
    "needle_fp32": 0.960,
    "needle_b2": {"octopus:b2": 0.92, "turboquant:b2": 0.86, "turboquant:b2,qjl": 0.87,
                  "polarquant:b2": 0.33},
    "needle_octopus_qjl_gap": 0.001,
    "split_uniform_to_plus1": "-31% to -41%",
    "split_plus2": "+44% to +73%",
    "split_minus2": "an order of magnitude or more",
    "grid": "byte-identical in all buckets",
}


# -- codecs ---------------------------------------------------------------------------------


def codec_specs(bits: Sequence[int] = BITS) -> list[str]:
    """The compared codecs, bit width by bit width, in :data:`FAMILIES` order."""
    return [t.format(b=b) for b in bits for t in FAMILIES.values()]


def paper_ratios(rows: Sequence[dict]) -> list[dict]:
    """The ratios the paper states (and the same ratios at the other bit widths), each
    with the paper's number where it gives one."""
    out = []
    bits = sorted({r["b"] for r in rows if r["b"] is not None})
    ip = PAPER["ip_turboquant_qjl_over_octopus_qjl"]
    for b in bits:
        for num, den, metric, paper, note in (
            (f"turboquant:b{b}", f"octopus:b{b}", "mse",
             PAPER["mse_turboquant_b4_over_octopus_b4"] if b == 4 else None, "same B"),
            (f"polarquant:b{b}", f"octopus:b{b}", "mse",
             PAPER["mse_polarquant_b2_over_octopus_b2"] if b == 2 else None, "same B"),
            (f"turboquant:b{b},qjl", f"octopus:b{b},qjl", "ip_abs_err", ip,
             "same B: both MSE stages at B - 1"),
            (f"turboquant:b{b},qjl", f"octopus:b{b + 1},qjl", "ip_abs_err", None,
             "OCTOPUS stage at B plus QJL"),
            (f"turboquant:b{b},qjl", f"octopus:b{b}", "ip_abs_err", None,
             "OCTOPUS at B without QJL"),
        ):
            r = metric_ratio(rows, num, den, metric)
            if r is not None:
                out.append({**r, "paper": paper, "note": note})
    return out


# -- tables --------------------------------------------------------------------------------


def _fmt(v, spec: str = ".4f") -> str:
    return "–" if v is None else format(v, spec)


def _ms(v) -> str:
    return "–" if v is None else f"{1000 * v:.2f} ms"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:+.1f}%"


def keys_table(rows: Sequence[dict]) -> str:
    lines = ["| codec | stored bits | cosine | MSE | IP abs err | s(k, k) / |k|^2 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['codec']}` | {r['bits']:.4f} | {r['cosine']:.5f} "
                     f"| {r['mse']:.4e} ± {r['mse_std']:.1e} "
                     f"| {r['ip_abs_err']:.4f} ± {r['ip_abs_err_std']:.4f} "
                     f"| {_fmt(r.get('self_score_gain'))} |")
    return "\n".join(lines)


def ratios_table(ratios: Sequence[dict]) -> str:
    lines = ["| ratio | metric | pairing | stored bits (num / den) | ours | per-seed range "
             "| paper |", "|---|---|---|---|---|---|---|"]
    for r in ratios:
        paper = "–" if r["paper"] is None else f"{r['paper']:g}x"
        lines.append(f"| `{r['num']}` / `{r['den']}` | {r['metric']} | {r.get('note', '')} "
                     f"| {r['bits_num']:.4f} / {r['bits_den']:.4f} | {r['ratio']:.3f}x "
                     f"| {r['seed_min']:.3f}–{r['seed_max']:.3f} | {paper} |")
    return "\n".join(lines)


def equal_bits_table(rows: Sequence[dict]) -> str:
    lines = ["| codec | stored bits | metric | value | reference | reference at these bits: "
             "log-linear / linear | ratio: log-linear / linear |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['codec']}` | {r['bits']:.4f} | {r['metric']} | {r['value']:.4g} "
                     f"| {r['reference']} | {r['reference_value']:.4g} / "
                     f"{r['reference_linear']:.4g} | {r['ratio']:.3f} / "
                     f"{r['ratio_linear']:.3f} |")
    return "\n".join(lines)


def _paper_mass(mass: float | None) -> str:
    """The paper's needle mass and its ratio to the paper's fp32 mass."""
    return "–" if mass is None else f"{mass:.2f} (/ fp32: {mass / PAPER['needle_fp32']:.3f})"


def needle_table(result: dict, gains: dict[str, float | None] | None = None) -> str:
    """The needle rows, with the keys part's ``s(k, k) / |k|^2`` of each codec if given.
    ``fp32 - mass`` is the mean over trials of the paired difference, ``SE`` its standard
    error (trials are paired: every codec sees the same keys and query)."""
    ref = result["reference"]
    paper = PAPER["needle_b2"]
    gains = gains or {}
    lines = ["| codec | stored bits | mass (mean ± std) | median | fp32 - mass (± SE) "
             "| mass / fp32 | median / fp32 median | top-1 | s(k, k) / |k|^2 | paper (b=2) |",
             "|---|---|---|---|---|---|---|---|---|---|",
             f"| fp32 (exact keys) | 32 | {ref['mass']:.4f} ± {ref['mass_std']:.4f} "
             f"| {ref['mass_median']:.4f} | 0 | 1 | 1 | {ref['top1']:.3f} | 1 "
             f"| {PAPER['needle_fp32']} |"]
    for r in result["rows"]:
        gap = np.asarray(ref["per_seed"], np.float64) - np.asarray(r["per_seed"], np.float64)
        se = gap.std(ddof=1) / math.sqrt(gap.size) if gap.size > 1 else math.nan
        lines.append(f"| `{r['codec']}` | {r['bits']:.4f} "
                     f"| {r['mass']:.4f} ± {r['mass_std']:.4f} | {r['mass_median']:.4f} "
                     f"| {gap.mean():.4f} ± {se:.4f} "
                     f"| {r['ratio']:.4f} | {r['median_ratio']:.4f} | {r['top1']:.3f} "
                     f"| {_fmt(gains.get(r['codec']))} "
                     f"| {_paper_mass(paper.get(r['codec']))} |")
    return "\n".join(lines)


def split_table(rows: Sequence[dict]) -> str:
    lines = ["| b | delta | (b_dir, b_nrm) | bits / triplet | stored bits | MSE "
             "| vs (b, b) | vs (b+1, b-1) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['b']} | {r['delta']:+d} | ({r['direction_bits']}, "
                     f"{r['norm_bits']}) | {r['bits_per_triplet']} | {r['bits']:.4f} "
                     f"| {r['mse']:.4e} | {_pct(r['vs_uniform'])} | {_pct(r['vs_plus1'])} |")
    return "\n".join(lines)


def rate_table(rows: Sequence[dict]) -> str:
    lines = ["| b | codec | bits / triplet | stored bits | MSE | MSE / turboquant:bB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['b']} | `{r['codec']}` | {_fmt(r['bits_per_triplet'], 'd')} "
                     f"| {r['bits']:.4f} | {r['mse']:.4e} | {r['vs_turboquant']:.3f} |")
    return "\n".join(lines)


def grid_table(rows: Sequence[dict]) -> str:
    lines = ["| b_dir | b_nrm | full-grid candidates | triplets | identical (all 3) "
             "| identical direction | error local / full | max excess | time local / full |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['direction_bits']} | {r['norm_bits']} | {r['candidates_full']} "
                     f"| {r['triplets']} | {r['identical']:.4f} "
                     f"| {r['identical_direction']:.4f} | {r['ratio']:.6f} "
                     f"| {r['max_excess']:.2e} | {_ms(r['seconds_local'])} / "
                     f"{_ms(r['seconds_full'])} |")
    return "\n".join(lines)


# -- figure --------------------------------------------------------------------------------

STYLE = {
    "turboquant": ("o", "C0"), "turboquant-qjl": ("s", "C1"), "polarquant": ("^", "C2"),
    "octopus": ("D", "C3"), "octopus-qjl": ("v", "C4"), "octopus-split": ("x", "C3"),
}


def plot(summary: dict, path: Path) -> None:
    """MSE vs stored bits (log y) and needle mass / fp32 vs stored bits, one marker and
    colour per family; the equal-rate OCTOPUS splits as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3))
    keys = summary.get("keys", {}).get("rows", [])
    rate = [r for r in summary.get("split", {}).get("rate", []) if r["split"]]
    points = [*keys, *({**r, "family": "octopus-split"} for r in rate)]
    for fam, (marker, colour) in STYLE.items():
        pts = sorted((r["bits"], r["mse"], r["codec"]) for r in points if r["family"] == fam)
        if pts:
            left.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=colour,
                      linestyle="none" if fam == "octopus-split" else "-",
                      label="octopus (b, b), (b+1, b-2): 3b bits / triplet"
                      if fam == "octopus-split" else fam)
    left.set_yscale("log")
    left.set_xlabel("stored bits per element")
    left.set_ylabel("per-coordinate MSE (Gaussian keys)")
    left.set_title("keys: reconstruction error vs stored bits", fontsize=10)
    hay = summary.get("needle", {}).get("rows", [])
    for fam, (marker, colour) in STYLE.items():
        pts = sorted((r["bits"], r["ratio"]) for r in hay if r["family"] == fam)
        if pts:
            right.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=colour,
                       label=fam)
    if hay:
        right.axhline(1.0, color="k", linestyle="--", linewidth=0.8, label="fp32 keys")
    right.set_xlabel("stored bits per element")
    right.set_ylabel("needle softmax mass / fp32 mass")
    right.set_title("needle: mass kept vs stored bits", fontsize=10)
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# -- markdown ------------------------------------------------------------------------------


def _gains(summary: dict) -> dict[str, float | None]:
    return {r["codec"]: r.get("self_score_gain") for r in summary.get("keys", {}).get("rows", [])}


def markdown(summary: dict) -> str:
    """synthetic.md: the commands, then each part's settings and tables."""
    commands = list(dict.fromkeys(summary[p]["command"] for p in PARTS if p in summary))
    out = ["# OCTOPUS synthetic probes against TurboQuant and PolarQuant", "", "```",
           *commands, "```", ""]
    if "keys" in summary:
        s = summary["keys"]
        st = s["settings"]
        out += ["## Keys", "",
                f"Gaussian keys [{st['keys']}, {st['head_dim']}], {st['queries']} Gaussian "
                f"queries, {st['seeds']} seeds (trial s of seed {st['seed']}: new keys, "
                "queries and codec parameters). MSE is per coordinate against the "
                "unnormalized keys (± std over seeds); IP abs err is the mean |q.k - score| "
                "with each codec's own `scores` (the QJL estimator for `,qjl`). Stored bits "
                "are the codec's formula, checked equal to the bytes of the codes. "
                "s(k, k) / |k|^2 is the mean ratio of a key's score with itself to its "
                f"exact value, over {st.get('gain_seeds')} trials of {st['keys']} keys of "
                f"their own. ({s['seconds']:.0f} s)", "", keys_table(s["rows"]), "",
                "### The ratios the paper states", "", ratios_table(s["ratios"]), "",
                "### Equal stored bits", "",
                "PolarQuant's and OCTOPUS's MSE and IP error against TurboQuant-MSE's, and "
                "OCTOPUS-QJL's IP error against TurboQuant-QJL's, at the same stored bits: "
                "the reference "
                "is interpolated in stored bits between its two rows around the codec's "
                "bits (`turboquant:b5` and `turboquant:b5,qjl` are run as rate references "
                "for this), log-linearly and linearly.", "",
                equal_bits_table(s["equal_bits"]), ""]
    if "needle" in summary:
        s = summary["needle"]
        st = s["settings"]
        out += ["## Needle", "",
                f"{st['distractors']} Gaussian distractors plus one needle k* at a random "
                f"position, D = {st['head_dim']}, query q = k* + {st['noise']} ||k*|| e "
                "(e a random unit vector), logits `scores(q, k) / sqrt(D)` over all keys "
                f"encoded together, softmax mass on the needle over {st['seeds']} seeds "
                "(new keys, needle position, query noise and codec parameters per seed). "
                "Ratios are to the fp32 baseline (exact keys) of this protocol; the "
                "paper's masses are shown with their ratio to its own 0.960. The gap to "
                "fp32 is paired over trials (± its standard error). "
                f"({s['seconds']:.0f} s)", "", needle_table(s, _gains(summary)), ""]
    if "split" in summary:
        s = summary["split"]
        st = s["settings"]
        out += ["## Bit split", "",
                f"`octopus:d(b+delta),n(b-delta)` on the keys protocol with {st['seeds']} "
                f"seeds, keys [{st['keys']}, {st['head_dim']}]; a triplet costs 3b + delta "
                f"bits. Paper: delta = +1 is {PAPER['split_uniform_to_plus1']} vs (b, b); "
                f"{PAPER['split_plus2']} at delta = +2; {PAPER['split_minus2']} at "
                f"delta = -2. ({s['seconds']:.0f} s)", "", split_table(s["rows"]), ""]
        if s["rate"]:
            out += ["### Equal rate: OCTOPUS at TurboQuant's 3b bits per triplet", "",
                    "The splits that spend exactly 3b bits per triplet, as `turboquant:bB` "
                    "spends 3b bits per three coordinates, on the same seeds.", "",
                    rate_table(s["rate"]), ""]
    if "grid" in summary:
        s = summary["grid"]
        st = s["settings"]
        out += ["## Local 3x3 rounding vs the full grid", "",
                f"{st['triplets']} triplets of rotated unit Gaussian vectors at D = "
                f"{st['head_dim']} (the 42 whole triplets of each vector; one seeded "
                "sign-flipped Walsh-Hadamard rotation), `joint_round` with the 3x3 "
                "neighbours of the scalar seed and with all 4^b_dir directions. Paper: "
                f"{PAPER['grid']} for b_dir in 2..5.", "", grid_table(s["rows"]), ""]
    return "\n".join(out)


# -- main ----------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _csv(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def _list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen parts, print their tables, and with ``--docs`` write the files."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated subset of {','.join(PARTS)} (default all)")
    p.add_argument("--bits", default=_csv(BITS),
                   help="nominal bit widths of the compared codecs")
    p.add_argument("--codec", action="append", metavar="SPEC",
                   help="replace the compared codecs (repeat)")
    p.add_argument("--rate-ref", action="append", metavar="SPEC",
                   help="an extra keys row for the equal-bits view (repeat; default "
                        f"{' '.join(RATE_REFS)})")
    p.add_argument("--no-rate-refs", action="store_true", help="no extra keys rows")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--keys", type=int, default=1024)
    p.add_argument("--queries", type=int, default=16)
    p.add_argument("--seeds", type=int, default=64, help="keys seeds")
    p.add_argument("--gain-seeds", type=int, default=8,
                   help="trials of the self-score gain in the keys part (0: skip it)")
    p.add_argument("--needle-seeds", type=int, default=128)
    p.add_argument("--distractors", type=int, default=2048)
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--split-seeds", type=int, default=16)
    p.add_argument("--split-bits", default=_csv(BITS))
    p.add_argument("--split-deltas", default=_csv(DELTAS))
    p.add_argument("--no-equal-rate", action="store_true",
                   help="skip the equal-rate splits and turboquant rows of the split part")
    p.add_argument("--grid-bits", default=_csv(GRID_BITS),
                   help="direction bits of the grid part")
    p.add_argument("--grid-triplets", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", type=Path, help="write synthetic.md/.json/.png here")
    p.add_argument("--no-progress", action="store_true")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.from_args(args)
    parts = _list(args.parts)
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    specs = args.codec or codec_specs(_ints(args.bits))
    rate_refs = [] if args.no_rate_refs else args.rate_ref or list(RATE_REFS)
    for spec in [*specs, *rate_refs]:
        parse_codec(spec)  # bad specs fail before any work
    progress = not args.no_progress
    command = shlex.join(["python", "experiments/octopus_synthetic.py", *argv])

    summary: dict[str, Any] = {}
    json_path = args.docs / "synthetic.json" if args.docs else None
    if json_path is not None and json_path.exists():
        summary = json.loads(json_path.read_text())  # parts not run now are kept
    base = {"head_dim": args.head_dim, "seed": args.seed}
    keys_settings = {**base, "keys": args.keys, "queries": args.queries}

    if "keys" in parts:
        start = time.perf_counter()
        rows = keys_part([*specs, *(r for r in rate_refs if r not in specs)],
                         seeds=args.seeds, gain_seeds=args.gain_seeds, progress=progress,
                         **keys_settings)
        compared = [r for r in rows if r["codec"] in {parse_codec(s).spec for s in specs}]
        summary["keys"] = {
            "command": command,
            "settings": {**keys_settings, "seeds": args.seeds, "gain_seeds": args.gain_seeds},
            "rows": rows, "ratios": paper_ratios(compared), "equal_bits": equal_bits(rows),
            "seconds": time.perf_counter() - start}
        s = summary["keys"]
        print(keys_table(rows), "", ratios_table(s["ratios"]), "",
              equal_bits_table(s["equal_bits"]), "", sep="\n")
    if "needle" in parts:
        start = time.perf_counter()
        settings = {**base, "distractors": args.distractors, "noise": args.noise,
                    "seeds": args.needle_seeds}
        result = needle_part(specs, progress=progress, **settings)
        summary["needle"] = {"command": command, "settings": settings, **result,
                             "seconds": time.perf_counter() - start}
        print(needle_table(result, _gains(summary)), "", sep="\n")
    if "split" in parts:
        start = time.perf_counter()
        result = split_part(_ints(args.split_bits), _ints(args.split_deltas),
                            seeds=args.split_seeds, equal_rate=not args.no_equal_rate,
                            progress=progress, **keys_settings)
        summary["split"] = {"command": command,
                            "settings": {**keys_settings, "seeds": args.split_seeds},
                            **result, "seconds": time.perf_counter() - start}
        print(split_table(result["rows"]), "", sep="\n")
        if result["rate"]:
            print(rate_table(result["rate"]), "", sep="\n")
    if "grid" in parts:
        start = time.perf_counter()
        settings = {**base, "triplets": args.grid_triplets}
        rows = grid_part(_ints(args.grid_bits), head_dim=args.head_dim,
                         triplets=args.grid_triplets, seed=args.seed)
        summary["grid"] = {"command": command, "settings": settings, "rows": rows,
                           "seconds": time.perf_counter() - start}
        print(grid_table(rows), "", sep="\n")

    if args.docs is not None:
        args.docs.mkdir(parents=True, exist_ok=True)
        write_json(json_path, summary)
        md = args.docs / "synthetic.md"
        md.write_text(markdown(summary))
        plot(summary, args.docs / "synthetic.png")
        print(f"written: {md}, {json_path}, {args.docs / 'synthetic.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
