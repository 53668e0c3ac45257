"""Test set-up: emulate CPU devices before JAX starts.

The device count defaults to 8 and can be changed with REPLICATOR_TEST_DEVICES;
tests are written in terms of ``jax.device_count()``.

XLA compiles with its optimizations off (``_jax_compat.fast_compile_xla_flags``):
most of the suite's time is compilation of small programs, and every test
compares numbers against a reference with a tolerance, which holds either way.
``REPLICATOR_TEST_XLA_DEFAULTS=1`` keeps XLA's defaults; flags already in
``XLA_FLAGS`` are kept. Worker processes that tests start inherit the setting.
"""

import os

import replicator as rp
from replicator._jax_compat import with_fast_compile_flags

# Every pipeline in the tests checks the graph invariants after every pass.
os.environ.setdefault("REPLICATOR_VERIFY", "1")

if os.environ.get("REPLICATOR_TEST_XLA_DEFAULTS") != "1":
    os.environ["XLA_FLAGS"] = with_fast_compile_flags(os.environ.get("XLA_FLAGS", ""))

rp.force_cpu_devices(int(os.environ.get("REPLICATOR_TEST_DEVICES", "8")))

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def n_devices() -> int:
    return jax.device_count()


@pytest.fixture(scope="session")
def repl(n_devices: int) -> rp.Replicator:
    """All devices as one worker."""
    return rp.Replicator(num_workers=1, cores_per_worker=n_devices)


@pytest.fixture(scope="session")
def repl2d(n_devices: int) -> rp.Replicator:
    """Two workers (when the device count allows), to exercise both mesh axes."""
    workers = 2 if n_devices % 2 == 0 and n_devices >= 2 else 1
    return rp.Replicator(num_workers=workers, cores_per_worker=n_devices // workers)


#: Modules whose tests take seconds each (whole examples, the Flax ImageNet port and
#: ResNet training); with the ``multiprocess`` tests they are most of the suite's time.
#: ``python -m pytest -m "not slow and not multiprocess"`` is the quick local subset;
#: CI runs everything.
SLOW_MODULES = {"test_examples.py", "test_flax_resnet.py", "test_ecosystem.py", "test_differential.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
