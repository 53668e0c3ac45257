"""Workers whose step programs differ only in a constant are stopped before the first step."""

import subprocess
import sys
from pathlib import Path

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
