"""The decode-step benchmark's smoke run on a CPU: every layout runs and agrees."""

from experiments import bench_decode_step


def test_layouts_agree_and_report_op_counts(capsys, tmp_path):
    args = ["--shape", "smollm2-135m", "--layers", "2", "--run", "int:4:2:40",
            "--steps", "2", "--repeats", "1", "--layout", "stacked", "--layout", "per-layer",
            "--layout", "sliced", "--hlo", str(tmp_path)]
    assert bench_decode_step.main(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"int_4-B2-S40-{layout}.hlo" for layout in ("per-layer", "sliced", "stacked")]
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("| int:4")]
    assert [line.split(" | ")[3] for line in lines] == ["stacked", "per-layer", "sliced"]
    assert all(" | True | " in line for line in lines)


def test_op_counts_read_the_optimized_text():
    hlo = ("  %a = f32[2]{0} fusion(f32[2]{0} %p), kind=kLoop\n"
           "  %b = f32[1]{0} dynamic-slice(f32[2]{0} %a, s32[] %i), dynamic_slice_sizes={1}\n"
           "  %c = f32[2]{0} copy(f32[2]{0} %a)\n")
    counts = bench_decode_step.op_counts(hlo)
    assert counts == {"fusion": 1, "custom-call": 0, "copy": 1, "dynamic-slice": 1,
                      "dynamic-update-slice": 0}


def test_bad_run_is_an_error(capsys):
    assert bench_decode_step.main(["--run", "nope:4:1:8"]) == 2
    assert "bad --run" in capsys.readouterr().err
