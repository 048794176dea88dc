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
