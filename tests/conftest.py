"""Test-wide settings, applied before JAX initializes its backend.

Most of the suite's time on a 2-core CPU is XLA compiling small programs. LLVM's
expensive optimization passes buy nothing for arrays of a few KiB, so the suite turns
them off (the numerics are unchanged: neither setting enables fast-math), unless the
caller has chosen XLA_FLAGS already.
"""

import os

os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
)

# designed codebooks go to a fresh folder, not the user's cache
if "KVJAX_CODEBOOKS" not in os.environ:
    import tempfile

    os.environ["KVJAX_CODEBOOKS"] = tempfile.mkdtemp(prefix="kvjax-codebooks-")
