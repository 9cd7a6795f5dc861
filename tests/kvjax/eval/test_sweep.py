"""kvjax.eval.sweep with a fake evaluator: settings and run names, resumption, the stored
rows, the reports and the helpers the protocol scripts share (the real model runs in
``make demo`` and in tests/experiments/test_sweep.py)."""

import csv
import dataclasses
import json

import pytest

from kvjax.eval import sweep
from kvjax.eval.provenance import KEY
from kvjax.spec import CacheSpecError, registered


class FakeEvaluate:
    """ppl falls with bits; records which configurations were measured."""

    def __init__(self):
        self.calls = []

    def __call__(self, config, cache_config, with_needle):
        self.calls.append(config)
        bits = 0.5 * (cache_config.k.bits_per_element(64) + cache_config.v.bits_per_element(64))
        row = {"ppl": 10.0 + 100.0 / bits**2, "nll": 1.0, "tokens": 10,
               "bits_per_element": bits, "k_bits_per_element": bits,
               "v_bits_per_element": bits, "seconds": 0.01}
        if with_needle:
            rows = [{"length": 64, "prompt_tokens": 64, "depth": d, "trial": 0,
                     "number": "123456", "answer": " 123456.", "correct": bits > 4}
                    for d in (0.1, 0.9)]
            row.update(needle_rows=rows, needle_accuracy=float(bits > 4))
        return row


SETTINGS = sweep.Settings(model="smollm2-135m", corpus="shakespeare", windows=8,
                          window_len=256)


def test_run_sweep_stores_rows_and_resumes(tmp_path):
    fake = FakeEvaluate()
    rows, run_dir = sweep.run_sweep(["int:4", "k=int:2 v=int:8"], SETTINGS, tmp_path, fake,
                                    progress=False)
    assert fake.calls == ["bf16", "int:4", "k=int:2 v=int:8"]   # bf16 always, first
    assert run_dir == tmp_path / "smollm2_135m-shakespeare-8x256-seed0"
    assert [r["config"] for r in rows] == fake.calls
    stored = json.loads((run_dir / "configs" / f"{sweep.config_slug('int:4')}.json")
                        .read_text())
    assert stored == rows[1]
    assert stored["cache_spec"] == "int:4" and stored["cache_options"] == ""
    assert stored["k_codec"] == stored["v_codec"] == "int:4" and stored["family"] == "int"
    mixed = rows[2]
    assert (mixed["cache_spec"], mixed["k_codec"], mixed["v_codec"]) == (
        "k=int:2 v=int:8", "int:2", "int:8")
    assert mixed["family"] == "int/int"
    for key in ("git", "versions", "device", "command", "time"):
        assert key in stored[KEY], key
    assert stored[KEY]["versions"]["jax"] and stored[KEY]["device"]["count"] >= 1
    assert not list((run_dir / "configs").glob("*.tmp"))   # written atomically

    again = FakeEvaluate()
    rows, _ = sweep.run_sweep(["int:4", "int:3"], SETTINGS, tmp_path, again, progress=False)
    assert again.calls == ["int:3"]
    # the reports cover every stored configuration, this run's first
    assert [r["config"] for r in rows] == ["bf16", "int:4", "int:3", "k=int:2 v=int:8"]
    (run_dir / "configs" / "broken.json").write_text("{")  # not a result: skipped
    rows, _ = sweep.run_sweep([], SETTINGS, tmp_path, FakeEvaluate(), progress=False)
    assert sorted(r["config"] for r in rows) == ["bf16", "int:3", "int:4", "k=int:2 v=int:8"]
    forced = FakeEvaluate()
    sweep.run_sweep(["int:4"], SETTINGS, tmp_path, forced, force=True, progress=False)
    assert forced.calls == ["bf16", "int:4"]


def test_cache_options_reach_every_configuration_and_name_the_run(tmp_path):
    seen = {}

    def evaluate(config, cache_config, with_needle):
        seen[config] = cache_config
        return FakeEvaluate()(config, cache_config, with_needle)

    settings = dataclasses.replace(SETTINGS, cache_options="layers[0,-1]:k=bf16  window=32")
    # stored canonical: the same options in any order or spacing are the same run
    assert settings.cache_options == "window=32 layers[0,-1]:k=bf16"
    rows, run_dir = sweep.run_sweep(["int:4"], settings, tmp_path, evaluate, progress=False)
    assert seen["int:4"].spec == "int:4 window=32 layers[0,-1]:k=bf16"
    assert seen["bf16"].residual_window == 32
    assert run_dir.name.startswith("smollm2_135m-shakespeare-8x256-window_32_layers_0_1_k")
    assert run_dir.name.endswith("-seed0") and run_dir.name != SETTINGS.run_name()
    assert rows[1]["cache_spec"] == "int:4 window=32 layers[0,-1]:k=bf16"
    assert rows[1]["cache_options"] == "window=32 layers[0,-1]:k=bf16"
    # layers[0,1] is another run, though its slug reads the same
    other = dataclasses.replace(SETTINGS, cache_options="window=32 layers[0,1]:k=bf16")
    assert other.run_name() != settings.run_name()
    again = FakeEvaluate()
    sweep.run_sweep(["int:4"], dataclasses.replace(
        SETTINGS, cache_options="window=32 layers[0,-1]:k=bf16"), tmp_path, again,
        progress=False)
    assert again.calls == []


@pytest.mark.parametrize("options,message", [
    ("int:4", "bare codec"),
    ("v=int:2", "codecs belong to the configurations"),
    ("window=-1", "non-negative"),
    ("layers[x]:k=bf16", "bad layer selection"),
])
def test_bad_cache_options(options, message):
    with pytest.raises(CacheSpecError, match=message) as err:
        sweep.Settings(model="m", corpus="c", windows=1, window_len=8, cache_options=options)
    assert "cache options" in str(err.value) and "\n" not in str(err.value)


def test_a_configuration_clashing_with_the_options_fails_before_anything_runs(tmp_path):
    fake = FakeEvaluate()
    settings = dataclasses.replace(SETTINGS, cache_options="window=32")
    with pytest.raises(CacheSpecError, match="given twice"):
        sweep.run_sweep(["int:4 window=8"], settings, tmp_path, fake, progress=False)
    assert fake.calls == []


def test_a_broken_result_file_is_redone(tmp_path):
    sweep.run_sweep(["int:4"], SETTINGS, tmp_path, FakeEvaluate(), progress=False)
    path = (tmp_path / SETTINGS.run_name() / "configs" / f"{sweep.config_slug('int:4')}.json")
    path.write_text("{not json")
    again = FakeEvaluate()
    sweep.run_sweep(["int:4"], SETTINGS, tmp_path, again, progress=False)
    assert again.calls == ["int:4"]


def test_reports(tmp_path):
    rows, run_dir = sweep.run_sweep(["int:4", "int:2"], SETTINGS, tmp_path, FakeEvaluate(),
                                    progress=False)
    text = sweep.write_reports(rows, SETTINGS, run_dir)
    assert text.splitlines()[2].startswith("| `bf16` | 16.000 (16.00, 16.00) |")
    assert "| `int:2` | 2.500 (2.50, 2.50) |" in text
    assert (run_dir / "summary.md").read_text().strip() == text.split("\n\n")[0]
    csv = (run_dir / "summary.csv").read_text().splitlines()
    assert csv[0].split(",") == list(sweep.CSV_FIELDS)
    git = rows[0][KEY]["git"]
    assert csv[1].startswith("bf16,bf16,bf16,bf16,bf16,16.0,") and csv[1].endswith(
        f",{git}" if git else ",")
    for name in ("pareto.png", "pareto_zoom.png"):
        assert (run_dir / name).stat().st_size > 10_000
        assert str(run_dir / name) in text


def test_med_c_overflow_reaches_the_csv_and_only_its_tables(tmp_path):
    class WithOutliers(FakeEvaluate):
        def __call__(self, config, cache_config, with_needle):
            row = super().__call__(config, cache_config, with_needle)
            if "med" in config:  # as PerplexityResult reports it
                row.update(outlier_chunks=30, outlier_overflow=10, medc_chunks=4000,
                           outlier_overflow_share=0.25)
            return row

    rows, run_dir = sweep.run_sweep(["int:4", "int:4,med3"], SETTINGS, tmp_path,
                                    WithOutliers(), progress=False)
    table = sweep.write_reports(rows, SETTINGS, run_dir).split("\n\n")[0].splitlines()
    assert table[0].endswith("| vs bf16 | Med-C overflow |")
    assert [line.rsplit("|", 2)[1] for line in table[2:]] == [" - ", " 25.00% ", " - "]
    with open(run_dir / "summary.csv") as f:
        med = next(r for r in csv.DictReader(f) if r["config"] == "int:4,med3")
    assert (med["outlier_chunks"], med["outlier_overflow"], med["medc_chunks"],
            med["outlier_overflow_share"]) == ("30", "10", "4000", "0.25")
    # tables without Med-C grow no column
    plain = [r for r in rows if "med" not in r["config"]]
    assert "overflow" not in sweep.markdown_table(sweep.with_deltas(plain))


def test_distribution_metrics_reach_the_csv_tables_and_plots(tmp_path):
    class WithDivergence(FakeEvaluate):
        def __call__(self, config, cache_config, with_needle):
            row = super().__call__(config, cache_config, with_needle)
            if config != "bf16":  # as the evaluator reports them, against bf16
                kl = 1.0 / row["bits_per_element"] ** 3
                row.update(kl_mean=kl, kl_p99=10 * kl, top1_agreement=1 - kl,
                           reference_ppl=12.0, kl_by_position=[
                               {"start": s, "end": e, "tokens": 5, "kl_mean": kl * (1 + s),
                                "kl_p99": 10 * kl, "top1_agreement": 1 - kl}
                               for s, e in ((0, 32), (32, 64), (64, 128), (128, 256))])
            return row

    rows, run_dir = sweep.run_sweep(["int:4", "int:2"], SETTINGS, tmp_path,
                                    WithDivergence(), progress=False)
    text = sweep.write_reports(rows, SETTINGS, run_dir)
    table = text.split("\n\n")[0].splitlines()
    assert table[0].endswith("| vs bf16 | KL mean | KL p99 | top-1 |")
    assert table[2].endswith("| - | - | - |")  # bf16, the reference itself
    assert table[4].endswith("| 0.0640 | 0.6400 | 93.6% |")  # int:2, 2.5 bits
    with open(run_dir / "summary.csv") as f:
        int2 = next(r for r in csv.DictReader(f) if r["config"] == "int:2")
    assert float(int2["kl_mean"]) == pytest.approx(0.064)
    assert float(int2["top1_agreement"]) == pytest.approx(0.936)
    for name in ("pareto_kl.png", "kl_by_position.png"):
        assert (run_dir / name).stat().st_size > 10_000
        assert str(run_dir / name) in text
    # rows without the metrics grow no column and no plot
    plain = sweep.run_sweep(["int:4"], SETTINGS, tmp_path / "plain", FakeEvaluate(),
                            progress=False)
    assert "KL" not in sweep.write_reports(*plain[:1], SETTINGS, plain[1])
    assert not (plain[1] / "pareto_kl.png").exists()


def test_pareto_front():
    rows = [{"config": c, "bits_per_element": b, "ppl": p}
            for c, b, p in [("a", 2, 100), ("b", 3, 120), ("c", 4, 50), ("d", 4, 60),
                            ("e", 16, 49)]]
    assert [r["config"] for r in sweep.pareto_front(rows)] == ["a", "c", "e"]


def test_family_and_slug():
    assert sweep.family("kivi:2,g32") == "kivi"
    assert sweep.family("k=int:4 v=int:2") == "int/int"
    assert sweep.family("k=hqmq:s96,r4,med3 v=int:4") == "hqmq+med/int"
    assert sweep.family("int:4 window=32 layers[0,-1]:k=bf16") == "int"
    assert sweep.config_slug("kivi:2,g32") != sweep.config_slug("kivi:2_g32")


def test_write_json_is_atomic_and_carries_provenance(tmp_path):
    path = tmp_path / "summary.json"
    sweep.write_json(path, {"rows": [1, 2]})
    stored = json.loads(path.read_text())
    assert stored["rows"] == [1, 2] and set(stored[KEY]) == {
        "git", "code", "versions", "device", "command", "time"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_lazy_evaluator_loads_once_per_seed():
    """The seed draws the codec parameters inside the evaluator, so each seed needs its
    own; the same seed reuses the loaded one, whatever the cache options."""
    built = []

    def build(settings):
        built.append(settings.seed)
        return lambda name, cache_config, with_needle: {"seed": settings.seed}

    cache = {}
    base = sweep.Settings(model="m", corpus="c", windows=1, window_len=8)
    runs = [sweep.lazy_evaluator(base, cache, build),
            sweep.lazy_evaluator(dataclasses.replace(base, seed=1), cache, build),
            sweep.lazy_evaluator(dataclasses.replace(base, cache_options="window=4"), cache,
                                 build)]
    assert built == []   # nothing loads before a configuration needs measuring
    assert [fn("x", None, False)["seed"] for fn in runs] == [0, 1, 0]
    assert built == [0, 1]
    import jax

    with jax.default_device(jax.devices()[1]):   # a sweep's thread on another device
        runs[0]("x", None, False)
    assert built == [0, 1, 0]


def test_seed_rows_and_table():
    def rows(seed):
        return [{"config": "bf16", "bits_per_element": 16.0, "ppl": 10.0},
                {"config": "int:4", "bits_per_element": 4.5, "ppl": 11.0 + seed}]

    (row,) = sweep.seed_rows({0: rows(0), 1: rows(1), 2: rows(2)})
    assert row["config"] == "int:4" and row["ppl"] == [11.0, 12.0, 13.0]
    assert row["mean"] == 12.0 and row["sd"] == 1.0 and row["delta_pct"] == pytest.approx(20)
    table = sweep.seed_table([row], [0, 1, 2])
    assert table.splitlines()[2] == ("| `int:4` | 4.500 | 11.00 | 12.00 | 13.00 | "
                                     "12.00 +- 1.00 | +20.0% |")


#: what a seed adds to the ppl of a seeded cache in SeedFake
OFFSETS = {0: 0.0, 1: 2.0, 2: 4.0, 3: 1.0}


class SeedFake:
    """``build(settings)`` for run_seeds: FakeEvaluate's ppl plus the seed's offset for
    the rotation codecs; records the evaluators built and the (seed, config) measured."""

    def __init__(self):
        self.built, self.calls = [], []

    def __call__(self, settings):
        self.built.append(settings.seed)
        fake = FakeEvaluate()

        def evaluate(config, cache_config, with_needle):
            self.calls.append((settings.seed, config))
            row = fake(config, cache_config, with_needle)
            if "turboquant" in cache_config.spec:
                row["ppl"] += OFFSETS[settings.seed]
            return row

        return evaluate


SEEDED = ["turboquant:b3", "k=int:4 v=turboquant:b3"]


def test_run_seeds_measures_seeded_configurations_per_seed_and_the_others_once(tmp_path):
    fake = SeedFake()
    per_seed, seeds_dir = sweep.run_seeds(["int:4", *SEEDED], SETTINGS, [2, 0, 1], tmp_path,
                                          fake, progress=False)
    assert fake.calls == [(0, "bf16"), (0, "int:4"), *((s, c) for s in (0, 1, 2)
                                                       for c in SEEDED)]
    assert fake.built == [0, 1, 2]
    assert seeds_dir == tmp_path / "smollm2_135m-shakespeare-8x256-seeds0-2"
    assert seeds_dir.is_dir()
    assert sorted(per_seed) == [0, 1, 2]
    for seed, rows in per_seed.items():
        by_config = {r["config"]: r for r in rows}
        assert list(by_config) == ["bf16", "int:4", *SEEDED]
        assert [by_config[c]["seeded"] for c in by_config] == [False, False, True, True]
        assert by_config["int:4"]["seed"] == 0 and by_config["turboquant:b3"]["seed"] == seed
        assert by_config["turboquant:b3"]["ppl"] == per_seed[0][2]["ppl"] + OFFSETS[seed]
        # each seed's results are where a run of that one seed keeps them
        run_dir = tmp_path / dataclasses.replace(SETTINGS, seed=seed).run_name()
        stored = {p.name for p in (run_dir / "configs").iterdir()}
        expected = ["bf16", "int:4", *SEEDED] if seed == 0 else SEEDED
        assert stored == {f"{sweep.config_slug(c)}.json" for c in expected}


def test_run_seeds_resumes_across_seeds(tmp_path):
    configs = ["int:4", "turboquant:b3"]
    # seed 1 alone first: its unseeded results serve the run over seeds 0 and 1
    sweep.run_sweep(configs, dataclasses.replace(SETTINGS, seed=1), tmp_path,
                    FakeEvaluate(), progress=False)
    fake = SeedFake()
    per_seed, _ = sweep.run_seeds(configs, SETTINGS, [0, 1], tmp_path, fake, progress=False)
    assert fake.calls == [(0, "turboquant:b3")] and fake.built == [0]
    assert {r["config"]: r["seed"] for r in per_seed[0]} == {
        "bf16": 1, "int:4": 1, "turboquant:b3": 0}
    # nothing left: nothing measured, no evaluator built (no model loaded)
    again = SeedFake()
    sweep.run_seeds(configs, SETTINGS, [0, 1], tmp_path, again, progress=False)
    assert again.calls == [] and again.built == []
    # a seed more measures only the seeded configuration
    more = SeedFake()
    sweep.run_seeds(configs, SETTINGS, [0, 1, 2], tmp_path, more, progress=False)
    assert more.calls == [(2, "turboquant:b3")]
    # an interrupted run keeps what it measured
    broken = SeedFake()

    def build(settings):
        evaluate = broken(settings)

        def fail_at_seed_3(config, cache_config, with_needle):
            if settings.seed == 3:
                raise RuntimeError("interrupted")
            return evaluate(config, cache_config, with_needle)

        return fail_at_seed_3

    with pytest.raises(RuntimeError):
        sweep.run_seeds(["int:3", "turboquant:b3"], SETTINGS, [0, 3], tmp_path, build,
                        progress=False)
    # bf16 was measured under seed 1 alone, not one of these seeds
    assert broken.calls == [(0, "bf16"), (0, "int:3")]
    resumed = SeedFake()
    sweep.run_seeds(["int:3", "turboquant:b3"], SETTINGS, [0, 3], tmp_path, resumed,
                    progress=False)
    assert resumed.calls == [(3, "turboquant:b3")]
    # --force redoes every measurement, the unseeded ones under the lowest seed
    forced = SeedFake()
    sweep.run_seeds(configs, SETTINGS, [0, 1], tmp_path, forced, force=True, progress=False)
    assert forced.calls == [(0, "bf16"), (0, "int:4"), (0, "turboquant:b3"),
                            (1, "turboquant:b3")]


def test_run_seeds_with_the_needle_measures_every_configuration_per_seed(tmp_path):
    settings = dataclasses.replace(SETTINGS, needle_lengths=(64,), needle_depths=(0.5,),
                                   needle_trials=1)
    assert sweep.seed_dependent("int:4", settings)
    fake = SeedFake()
    per_seed, _ = sweep.run_seeds(["int:4"], settings, [0, 1], tmp_path, fake,
                                  progress=False)
    assert fake.calls == [(s, c) for s in (0, 1) for c in ("bf16", "int:4")]
    assert all(r["seeded"] for rows in per_seed.values() for r in rows)


def test_seed_reports_on_fake_numbers(tmp_path):
    fake = SeedFake()
    per_seed, seeds_dir = sweep.run_seeds(["int:4", "turboquant:b3"], SETTINGS, [0, 1, 2],
                                          tmp_path, fake, progress=False)
    rows = {r["config"]: r for r in sweep.seed_rows(per_seed, baseline=True)}
    base, int4, tq = (per_seed[0][i]["ppl"] for i in range(3))
    assert rows["turboquant:b3"]["ppl"] == [tq, tq + 2, tq + 4]
    assert rows["turboquant:b3"]["mean"] == pytest.approx(tq + 2)
    assert rows["turboquant:b3"]["sd"] == pytest.approx(2.0)   # sample sd of 0, 2, 4
    assert (rows["turboquant:b3"]["min"], rows["turboquant:b3"]["max"]) == (tq, tq + 4)
    assert rows["turboquant:b3"]["delta_pct"] == pytest.approx(100 * ((tq + 2) / base - 1))
    assert rows["turboquant:b3"]["seeded"] is True
    assert rows["int:4"]["ppl"] == [int4] * 3 and rows["int:4"]["sd"] == 0.0
    assert rows["int:4"]["min"] == rows["int:4"]["max"] == rows["int:4"]["mean"] == int4
    assert rows["int:4"]["seeded"] is False and rows["int:4"]["family"] == "int"
    assert rows["bf16"]["delta_pct"] == 0.0
    assert "bf16" not in {r["config"] for r in sweep.seed_rows(per_seed)}

    text = sweep.write_seed_reports(per_seed, SETTINGS, seeds_dir)
    table = (seeds_dir / "summary.md").read_text().strip()
    assert text.startswith(table)
    lines = table.splitlines()
    assert lines[0] == ("| codec | bits / element | seed 0 | seed 1 | seed 2 | mean +- sd | "
                        "min .. max | vs bf16 |")
    i4 = f"{int4:.2f}"
    assert f"| `int:4` {sweep.UNSEEDED_MARK} | 4.500 | {i4} | {i4} | {i4} | {i4} +- 0.00 | "\
        f"{i4} .. {i4} |" in table
    assert (f"| `turboquant:b3` | {rows['turboquant:b3']['bits_per_element']:.3f} | "
            f"{tq:.2f} | {tq + 2:.2f} | {tq + 4:.2f} | {tq + 2:.2f} +- 2.00 | "
            f"{tq:.2f} .. {tq + 4:.2f} |") in table
    assert lines[-1].startswith(f"{sweep.UNSEEDED_MARK} parameters independent of the seed")
    with open(seeds_dir / "summary.csv") as f:
        stored = {r["config"]: r for r in csv.DictReader(f)}
    assert list(next(iter(stored.values()))) == [
        "config", "family", "seeded", "bits_per_element", "ppl_seed0", "ppl_seed1",
        "ppl_seed2", "mean", "sd", "min", "max", "delta_pct"]
    assert stored["int:4"]["seeded"] == "False" and float(stored["int:4"]["sd"]) == 0.0
    assert float(stored["turboquant:b3"]["ppl_seed2"]) == tq + 4
    assert float(stored["turboquant:b3"]["max"]) == tq + 4
    for name in ("pareto.png", "pareto_zoom.png"):
        assert (seeds_dir / name).stat().st_size > 10_000
        assert str(seeds_dir / name) in text
    assert str(tmp_path / dataclasses.replace(SETTINGS, seed=2).run_name() / "configs") in text


def test_seed_table_marks_only_what_the_rows_say():
    row = {"config": "int:4", "bits_per_element": 4.5, "ppl": [11.0, 13.0], "mean": 12.0,
           "sd": 1.5, "min": 11.0, "max": 13.0, "delta_pct": 20.0}
    assert sweep.seed_table([row], [0, 1]).splitlines()[-1] == (
        "| `int:4` | 4.500 | 11.00 | 13.00 | 12.00 +- 1.50 | +20.0% |")
    marked = sweep.seed_table([{**row, "seeded": False}], [0, 1], extremes=True)
    assert marked.splitlines()[1] == "|---|---|---|---|---|---|---|"
    assert marked.splitlines()[2] == (f"| `int:4` {sweep.UNSEEDED_MARK} | 4.500 | 11.00 | "
                                      "13.00 | 12.00 +- 1.50 | 11.00 .. 13.00 | +20.0% |")


def test_seeds_name():
    assert SETTINGS.seeds_name([4, 0, 1, 2, 3, 2]) == "smollm2_135m-shakespeare-8x256-seeds0-4"
    assert SETTINGS.seeds_name([7, 0, 2]).endswith("-8x256-seeds0_2_7")
    assert SETTINGS.seeds_name([3]).endswith("-seeds3")
    assert dataclasses.replace(SETTINGS, seed=5).seeds_name([0, 1]) == SETTINGS.seeds_name(
        [0, 1])


@pytest.mark.parametrize(("cls", "example"), [
    pytest.param(cls, ex, id=ex.spec) for _, cls in sorted(registered().items())
    for ex in cls.examples])
def test_is_seeded_agrees_with_the_codec_examples(cls, example):
    assert sweep.is_seeded(example.spec, head_dim=example.head_dim) == example.seeded


def test_is_seeded_looks_at_every_codec_of_the_cache():
    assert not sweep.is_seeded("bf16") and not sweep.is_seeded("kivi:2,g32")
    assert sweep.is_seeded("k=int:4 v=turboquant:b3")
    assert sweep.is_seeded("int:4 layers[0]:k=turboquant:b3")
    assert not sweep.is_seeded("int:4 window=32 layers[0,-1]:k=bf16")
    assert sweep.is_seeded("saw:h64,signs") and not sweep.is_seeded("saw:h64")
    # saw:h128 rejects the first probe head dim, 64
    assert sweep.is_seeded("saw:h128,signs") and not sweep.is_seeded("saw:h128")
    assert not sweep.seed_dependent("int:4", SETTINGS)
    assert sweep.seed_dependent("int:4", dataclasses.replace(
        SETTINGS, cache_options="layers[0]:k=turboquant:b3"))


class DeviceEvaluate:
    """A real computation on the thread's default device: the codec's round-trip error
    of fixed K, and where it ran; a config named in ``fail`` raises."""

    def __init__(self, fail=()):
        self.devices, self.fail = [], fail

    def __call__(self, config, cache_config, with_needle):
        import jax
        import jax.numpy as jnp

        if config in self.fail:
            raise RuntimeError(f"{config} failed")
        codec = cache_config.k
        x = jax.random.normal(jax.random.key(0), (codec.block_tokens, 64))
        params = codec.init(jax.random.key(1), 64)
        error = jax.jit(lambda p, x: jnp.mean((codec.decode(p, codec.encode(p, x)) - x) ** 2)
                        )(params, x)
        self.devices.append(next(iter(error.devices())))
        bits = codec.bits_per_element(64)
        return {"ppl": float(error) + 1.0, "nll": 0.0, "tokens": 1, "bits_per_element": bits,
                "k_bits_per_element": bits, "v_bits_per_element": bits, "seconds": 0.0}


CONFIGS = ["int:4", "int:2", "kivi:4,g32", "int:8"]


def test_a_sweep_over_devices_gives_the_serial_results(tmp_path):
    import jax

    serial = DeviceEvaluate()
    rows, _ = sweep.run_sweep(CONFIGS, SETTINGS, tmp_path / "serial", serial, progress=False)
    assert set(serial.devices) == {jax.devices()[0]}
    spread = DeviceEvaluate()
    devices = sweep.sweep_devices(3)
    got, _ = sweep.run_sweep(CONFIGS, SETTINGS, tmp_path / "spread", spread, progress=False,
                             devices=devices)
    assert [r["ppl"] for r in got] == [r["ppl"] for r in rows]
    assert set(spread.devices) <= set(devices) and len(set(spread.devices)) > 1
    with pytest.raises(ValueError, match=r"a sweep over 99 devices needs 1\.\.8"):
        sweep.sweep_devices(99)
    assert sweep.sweep_devices(1) is None and sweep.sweep_devices(None) is None


def test_a_failure_on_one_device_keeps_what_finished_and_the_rerun_resumes(tmp_path):
    devices = sweep.sweep_devices(2)
    with pytest.raises(RuntimeError, match="int:2 failed"):
        sweep.run_sweep(CONFIGS, SETTINGS, tmp_path, DeviceEvaluate(fail=("int:2",)),
                        progress=False, devices=devices)
    finished = {json.loads(p.read_text())["config"]
                for p in (tmp_path / SETTINGS.run_name() / "configs").glob("*.json")}
    assert "int:2" not in finished and "bf16" in finished
    again = DeviceEvaluate()
    rows, _ = sweep.run_sweep(CONFIGS, SETTINGS, tmp_path, again, progress=False,
                              devices=devices)
    assert len(again.devices) == len(CONFIGS) + 1 - len(finished)
    assert [r["config"] for r in rows] == ["bf16", *CONFIGS]
