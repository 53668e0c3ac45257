"""Workers whose step programs differ only in a constant are stopped before the first step."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "multiproc" / "diverge_worker.py"


def _job(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "replicator.launch", "--num-workers", "2", "--cores-per-worker", "2"]
    return subprocess.run(
        [*command, str(WORKER), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=180
    )


@pytest.mark.multiprocess
def test_a_different_learning_rate_on_one_worker_is_an_error_before_step_one():
    proc = _job()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "the step's program with its constants" in out, out[-3000:]
    assert " ran: " not in proc.stdout, out[-3000:]


@pytest.mark.multiprocess
def test_the_same_program_on_every_worker_runs():
    proc = _job("--same")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stdout.count(" ran: ") == 2, proc.stdout


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (np.float32(1024.0), np.float32(2048.0)),  # a 0-d loss scale
        (np.int32(7), np.int32(8)),  # a 0-d step count
        (np.float32(1.0), np.float16(1.0)),  # the same value, a narrower dtype
        (np.float32(1.0), np.ones(1, np.float32)),  # a 0-d leaf against a 1-element one
        (np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32)),  # the same bytes, another shape
        ("adam(lr=1e-3)", "adam(lr=1e-4)"),
    ],
)
def test_the_cross_worker_fingerprint_tells_apart_what_the_workers_must_agree_on(a, b):
    """check_same_across_workers compares each value's fingerprint (dtype, shape and bytes) between workers:
    it must differ for every pair here, 0-d and narrow ones included, and agree for equal values."""
    from replicator.runtime.distributed.agreement import _digest

    def digest(v):
        return _digest(np.frombuffer(v.encode(), np.uint8) if isinstance(v, str) else np.asarray(v))

    assert not np.array_equal(digest(a), digest(b))
    assert np.array_equal(digest(a), digest(a if isinstance(a, str) else np.array(a, copy=True)))
