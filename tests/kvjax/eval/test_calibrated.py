"""The calibrated-vs-data-free grid: families, widths, the table."""

from kvjax.eval import calibrated


def test_families_and_widths():
    assert calibrated.family("saw:b2,kv,c256,hess") == "saw c256 hess"
    assert calibrated.family("saw:b4,kv") == "saw"
    assert calibrated.family("int:3") == "int"
    assert calibrated.family("hqmq:s96,r4,learn") == "hqmq learn"
    assert calibrated.family("hqmq:s96,r4") == "hqmq"
    assert calibrated.family("hqmq:s96,r4,learn,score") == "hqmq learn score"
    assert calibrated.family("k=int:4 v=int:2 layers[0]:k=int:8") == "allocated"
    assert calibrated.width("saw:b3,kv,c16") == 3 and calibrated.width("int:2") == 2
    assert calibrated.width("bf16") is None


def test_the_default_grid_covers_every_ablation_at_every_width():
    configs = calibrated.default_configs((2, 4), (1, 16), hqmq=("s24,r3",))
    assert configs == ["hqmq:s24,r3", "hqmq:s24,r3,learn", "hqmq:s24,r3,learn,score",
                       "int:2", "saw:b2,kv", "saw:b2,kv,c1", "saw:b2,kv,c16",
                       "saw:b2,kv,hess", "saw:b2,kv,c256,hess",
                       "int:4", "saw:b4,kv", "saw:b4,kv,c1", "saw:b4,kv,c16",
                       "saw:b4,kv,c2048", "saw:b4,kv,hess", "saw:b4,kv,c256,hess"]


def test_run_names_differ_with_every_setting():
    a = calibrated.CalibrationSettings(model="m", fit_corpus="shakespeare",
                                       eval_corpus="austen")
    names = {a.run_name()}
    for change in ({"fit_corpus": "austen", "eval_corpus": "shakespeare"}, {"fit_len": 64},
                   {"windows": 2}, {"seed": 1}, {"fit_windows": 3}, {"window_len": 32}):
        names.add(calibrated.CalibrationSettings(**{**a.__dict__, **change}).run_name())
    assert len(names) == 7
