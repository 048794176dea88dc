import os

# Tests run on the CPU, with 8 virtual devices for the sharding tests; set before jax is imported.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import gc  # noqa: E402

import jax  # noqa: E402  (after the environment above)
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    """Every CPU executable XLA keeps holds memory mappings until jax's caches drop it; a whole-suite run
    otherwise passes the kernel's 65530-mapping limit (vm.max_map_count) and XLA segfaults in a compile."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def fast_compiles():
    """For a module whose time is XLA compiling tiny models, not running them (`pytestmark =
    pytest.mark.usefixtures("fast_compiles")`): `jax_disable_most_optimizations` (XLA:CPU's LLVM at optimisation
    level 0, no expensive passes; the same HLO) compiles about twice as fast, a tiny DeepSeek's generate program
    ~20 -> ~12 s and `init_params`' per-shape ops ~14 -> ~7 s. Results differ from the optimised build's by
    rounding only (~3e-8 in a 0.05-std weight), as on a CPU of another ISA."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.clear_caches()  # nothing compiled here is reused by an optimised module
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture
def optimised_compiles():
    """XLA's optimisations back on for one test of a `fast_compiles` module whose time is running, not compiling
    (hundreds of rows sampled: unoptimised code runs ~3x slower there)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


def pytest_addoption(parser):
    parser.addoption("--heavy", action="store_true",
                     help="also run the tests marked heavy (beyond CI's time budget on 2 cores; `make test-heavy`)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--heavy"):
        return
    skip = pytest.mark.skip(reason="heavy: beyond CI's time budget; run with --heavy (make test-heavy)")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)
