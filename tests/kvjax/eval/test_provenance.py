"""kvjax.eval.provenance: what every results file records about its origin."""

import re
import subprocess
from pathlib import Path

import jax
import pytest

from kvjax.eval import provenance as prov


def test_provenance_fields():
    record = prov.provenance(["experiments/sweep.py", "--codec", "k=int:4 v=int:2"])
    assert set(record) == {"git", "code", "versions", "device", "command", "time"}
    assert record["command"] == "python experiments/sweep.py --codec 'k=int:4 v=int:2'"
    assert record["versions"]["jax"] == jax.__version__
    assert set(record["versions"]) == {"python", *prov.PACKAGES}
    assert record["device"]["backend"] == jax.default_backend()
    assert record["device"]["count"] == jax.device_count()
    assert record["device"]["device_kind"] == jax.devices()[0].device_kind
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", record["time"])


def test_git_sha_of_the_checkout_or_none(tmp_path):
    sha = prov.git_sha()
    root = Path(prov.__file__).resolve().parent
    inside = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                            text=True, check=False)
    if inside.returncode == 0:
        assert sha.removesuffix("+dirty") == inside.stdout.strip()
    else:
        assert sha is None
    assert prov.git_sha(tmp_path) is None   # not a checkout


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_code_digest_follows_the_code_and_nothing_else(tmp_path):
    files = {"kvjax/a.py": "x = 1\n", "models/b.py": "y = 2\n", "pyproject.toml": "[p]\n",
             "docs/notes.md": "prose\n", "kvjax/data.npz": "bytes"}
    one = prov.code_digest(_tree(tmp_path / "one", files))
    assert re.fullmatch(r"[0-9a-f]{16}", one)
    assert prov.code_digest(_tree(tmp_path / "two", files)) == one
    # docs, data and caches are not code
    assert prov.code_digest(_tree(tmp_path / "two", {
        "docs/notes.md": "other\n", "kvjax/__pycache__/a.py": "junk"})) == one
    assert prov.code_digest(_tree(tmp_path / "three", {**files, "kvjax/a.py": "x = 3\n"})) != one
    # a file moved is another tree
    moved = {**{k: v for k, v in files.items() if k != "models/b.py"}, "models/c.py": "y = 2\n"}
    assert prov.code_digest(_tree(tmp_path / "four", moved)) != one


def test_a_commits_digest_is_its_checkouts(tmp_path):
    repo = _tree(tmp_path, {"kvjax/a.py": "x = 1\n", "experiments/e.py": "run()\n",
                            "pyproject.toml": "[p]\n"})

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=k", "-c", "user.email=k@k", *args],
                              cwd=repo, capture_output=True, text=True, check=True).stdout
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    assert prov.commit_code_digest("HEAD", repo) == prov.code_digest(repo)
    (repo / "kvjax/a.py").write_text("x = 2\n")
    assert prov.commit_code_digest("HEAD", repo) != prov.code_digest(repo)
    with pytest.raises(subprocess.CalledProcessError):
        prov.commit_code_digest("no-such-commit", repo)
    assert prov.provenance([])["code"] == prov.code_digest()
