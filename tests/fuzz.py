"""Seeded example generation shared by the adversarial suites.

Every fuzzing test draws its cases from a ``numpy`` generator seeded by the test's name
and the example index, so a failure names an index that reproduces it on its own. CI runs
a bounded number of examples per test; ``KVJAX_FUZZ_EXAMPLES=N`` runs ``N`` instead (the
longer run that docs/robustness.md records).
"""

from __future__ import annotations

import os
import zlib

import numpy as np


def example_count(default: int) -> int:
    """Examples per fuzzing test: ``KVJAX_FUZZ_EXAMPLES`` when set, else ``default``."""
    value = os.environ.get("KVJAX_FUZZ_EXAMPLES")
    if value is None:
        return default
    count = int(value)
    if count < 1:
        raise ValueError(f"KVJAX_FUZZ_EXAMPLES must be a positive int, got {value!r}")
    return count


def rng(name: str, index: int) -> np.random.Generator:
    """The generator of example ``index`` of the test ``name`` (stable across runs)."""
    return np.random.default_rng([zlib.crc32(name.encode()), index])
