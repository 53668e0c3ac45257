"""Test set-up: emulate CPU devices before JAX starts.

The device count defaults to 8 and can be changed with REPLICATOR_TEST_DEVICES;
tests are written in terms of ``jax.device_count()``.
"""

import os

import replicator as rp

# Every pipeline in the tests checks the graph invariants after every pass.
os.environ.setdefault("REPLICATOR_VERIFY", "1")

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
