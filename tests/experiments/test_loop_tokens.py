"""experiments/loop_tokens.py: where two token lists part, and a short run on the
embedded model (reference attention in both loops, float32 weights: they agree)."""

from experiments import loop_tokens


def test_first_difference():
    assert loop_tokens.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert loop_tokens.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert loop_tokens.first_difference([1, 2], [1, 2, 3]) == 2


def test_loops_agree_on_the_embedded_model(capsys, monkeypatch):
    monkeypatch.setattr(loop_tokens, "PROMPTS", ("The capital of France is",))
    args = ["--cache", "int:4", "--attention", "reference", "--new-tokens", "3",
            "--dtype", "float32"]
    assert loop_tokens.main(args) == 0
    assert "| int:4 | float32 | reference | 1 / 1 | - |" in capsys.readouterr().out
    assert loop_tokens.main(["--cache", "int:9"]) == 2
