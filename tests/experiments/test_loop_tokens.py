"""experiments/loop_tokens.py: where two token lists part, and a short run on the
embedded model (reference attention in both loops, float32 weights: they agree)."""

import json

import pytest

from experiments import loop_tokens


def test_first_difference():
    assert loop_tokens.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert loop_tokens.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert loop_tokens.first_difference([1, 2], [1, 2, 3]) == 2


def test_loops_agree_on_the_embedded_model(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(loop_tokens, "PROMPTS", ("The capital of France is",))
    args = ["--cache", "int:4", "--attention", "reference", "--new-tokens", "3",
            "--dtype", "float32", "--json", str(tmp_path / "run.json")]
    assert loop_tokens.main(args) == 0
    assert "| int:4 | float32 | reference | 1 / 1 | - |" in capsys.readouterr().out
    record = json.loads((tmp_path / "run.json").read_text())
    assert len(record["prompts"]) == 1 and len(record["prompts"][0]) > 3
    # the same prompts read back as ids, the model loaded without its tokenizer
    monkeypatch.setattr(loop_tokens, "PROMPTS", ())
    again = ["--cache", "int:4", "--attention", "reference", "--new-tokens", "3",
             "--dtype", "float32", "--prompt-ids", str(tmp_path / "run.json")]
    assert loop_tokens.main(again) == 0
    assert "| int:4 | float32 | reference | 1 / 1 | - |" in capsys.readouterr().out
    assert loop_tokens.main(["--cache", "int:9"]) == 2


@pytest.mark.parametrize("text", ["[]", "[[1, 2], []]", '{"prompts": [[1, -2]]}', '"x"'])
def test_bad_prompt_ids_are_clear_errors(tmp_path, text, capsys):
    path = tmp_path / "ids.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="lists of token ids"):
        loop_tokens.read_prompt_ids(path)
    assert loop_tokens.main(["--prompt-ids", str(path)]) == 2
    assert "lists of token ids" in capsys.readouterr().err
