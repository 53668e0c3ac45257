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

DEVICES = int(os.environ.get("REPLICATOR_TEST_DEVICES", "8"))
rp.force_cpu_devices(DEVICES)

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


def _two_worker_meshes(n: int) -> list:
    """``(workers, cores)`` of the two-level meshes a test runs on with ``mesh2d``.

    The ``repl2d`` mesh (``2 x n/2``), on which the two groups have different sizes, and
    the square ones (``2 x 2``; ``4 x 4`` with ``REPLICATOR_TEST_DEVICES=16``), on which
    ``'workers'`` and ``'cores'`` have the same size: a collective over one group taken
    for the other keeps its shapes there, and only the numbers tell.
    """
    shapes = [(2, n // 2)] if n % 2 == 0 and n >= 4 else []
    params = [pytest.param(s, id=f"{s[0]}x{s[1]}") for s in shapes]
    for k in (2, 4):
        if (k, k) in shapes:
            continue
        skip = pytest.mark.skipif(k * k > n, reason=f"a {k}x{k} mesh needs {k * k} devices (REPLICATOR_TEST_DEVICES)")
        params.append(pytest.param((k, k), id=f"{k}x{k}", marks=skip))
    return params


@pytest.fixture(params=_two_worker_meshes(DEVICES))
def mesh2d(request) -> tuple[int, int]:
    """``(workers, cores)``: each two-worker mesh in turn (the ``repl2d`` one, then square ones)."""
    return request.param


@pytest.fixture(scope="session")
def repl_square(n_devices: int) -> rp.Replicator:
    """Two workers of two cores (on the first 4 devices): ``'workers'`` and ``'cores'`` groups of one size."""
    if n_devices < 4:
        pytest.skip("a 2x2 mesh needs 4 devices")
    return rp.Replicator(num_workers=2, cores_per_worker=2, devices=jax.devices()[:4])


#: Modules whose tests take seconds each (whole examples, the Flax ImageNet port and
#: ResNet training); with the ``multiprocess`` tests they are most of the suite's time.
#: ``python -m pytest -m "not slow and not multiprocess"`` is the quick local subset;
#: CI runs everything.
SLOW_MODULES = {"test_examples.py", "test_flax_resnet.py", "test_ecosystem.py", "test_differential.py"}


#: Modules whose subject does not change between JAX releases: the launcher, the rendezvous store and
#: their fault drills (host-side Python; the workers' use of ``jax.distributed`` is tested on both legs by
#: test_distributed.py), the markdown and the examples (the API they call is tested on both legs by the
#: rest), the fuzzer's command line. Marked ``one_leg``: CI runs them on the JAX 0.10 leg only
#: (``.ci/run``; CONTRIBUTING.md, "Testing on two JAX versions"). A new test module runs on both legs unless
#: it is listed here.
ONE_LEG_MODULES = {
    "test_docs.py",
    "test_examples.py",
    "test_bench_pipeline.py",
    "test_launch.py",
    "test_launch_cli.py",
    "test_launch_options.py",
    "test_membership.py",
    "test_rendezvous.py",
    "test_hosts.py",
    "test_restarts.py",
    "test_watchdog.py",
    "test_blame_promises.py",
    "test_launch_promises.py",
    "test_cli_promises.py",
    "test_supervise_promises.py",
    "test_hosts_promises.py",
    "test_membership_promises.py",
    "test_rendezvous_promises.py",
    "test_watchdog_promises.py",
    "test_restarts_promises.py",
    "test_relay_promises.py",
    "test_environment_promises.py",
    "test_processes_promises.py",
    "test_faults.py",
    "test_checkpoint_faults.py",
    "test_fuzz_script.py",
}
#: Modules whose ``slow`` tests are more seeds of what their quick tests already run on both legs (the
#: pipeline fuzzer's long sample): ``one_leg`` too. The data-parallel fuzzer's sample (test_differential.py,
#: all ``slow``) runs on both legs.
ONE_LEG_WHEN_SLOW = {"test_pipelines.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        slow_sample = item.path.name in ONE_LEG_WHEN_SLOW and item.get_closest_marker("slow")
        if item.path.name in ONE_LEG_MODULES or slow_sample:
            item.add_marker(pytest.mark.one_leg)
