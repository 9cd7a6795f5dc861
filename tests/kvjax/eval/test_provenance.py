"""kvjax.eval.provenance: what every results file records about its origin."""

import re
import subprocess
from pathlib import Path

import jax

from kvjax.eval import provenance as prov


def test_provenance_fields():
    record = prov.provenance(["experiments/sweep.py", "--codec", "k=int:4 v=int:2"])
    assert set(record) == {"git", "versions", "device", "command", "time"}
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
