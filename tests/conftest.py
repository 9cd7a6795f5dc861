"""Test-wide settings, applied before JAX initializes its backend.

Most of the suite's time on a 2-core CPU is XLA compiling small programs. LLVM's
expensive optimization passes buy nothing for arrays of a few KiB, so the suite turns
them off (the numerics are unchanged: neither setting enables fast-math), unless the
caller has chosen XLA_FLAGS already. It also asks for :data:`TEST_DEVICES` virtual CPU
devices for the sharding tests.
"""

import inspect
import os

import pytest

#: CPU devices the suite runs with (tests/kvjax/test_sharding.py, tests/models/test_sharded.py)
TEST_DEVICES = 8

os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
)
# the sharding tests split caches and models over meshes of up to 8 devices; on a CPU
# those are virtual devices of the host (everything else runs on the first)
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={TEST_DEVICES}"

# the suite compiles anew in every run: the CLI and the experiments it calls leave JAX's
# persistent compilation cache off (tests/kvjax/test_compile_cache.py turns it on itself)
os.environ["KVJAX_COMPILE_CACHE"] = "off"

# designed codebooks go to a fresh folder, not the user's cache
if "KVJAX_CODEBOOKS" not in os.environ:
    import tempfile

    os.environ["KVJAX_CODEBOOKS"] = tempfile.mkdtemp(prefix="kvjax-codebooks-")


@pytest.fixture(scope="session", autouse=True)
def embedded_model_loaded_once():
    """``models.load`` of a registered model, memoized per dtype and layout for the session.

    The CLI, evaluation and GGUF tests each load the embedded SmolLM2 (header, weights and
    tokenizer: over ten seconds on 2 cores every time). The params are immutable JAX
    arrays, so the first load of each dtype is real and the later ones share it. Paths,
    unknown names and every error still go through the real loader on each call.
    """
    import jax.numpy as jnp

    import models

    real_load = models.load
    signature = inspect.signature(real_load)
    loaded = {}

    def load(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        name, dtype = bound.arguments["name_or_path"], bound.arguments["dtype"]
        target = os.fspath(name)
        if target not in models.REGISTRY:
            return real_load(*args, **kwargs)
        key = (target, models.registered_path(target), jnp.dtype(dtype).name,
               bound.arguments["per_layer"])
        if key not in loaded:
            loaded[key] = real_load(*args, **kwargs)
        return loaded[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "load", load)
        yield loaded


@pytest.fixture(scope="module", autouse=True)
def compiled_programs_released_per_module():
    """Drop JAX's compiled programs after each test module.

    Every program XLA compiles for the CPU keeps its own memory mappings, and one process
    running the whole suite compiles thousands: the mapping count climbs past the
    kernel's ``vm.max_map_count`` (65530 by default) and the next compilation segfaults.
    Clearing the caches lets the programs of finished modules be freed; a module
    recompiles only what it uses itself.
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
