"""The examples run end to end (in a subprocess: they start their own JAX)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GLOBAL_BATCH = 256  # examples/train_mlp.py


def run_example(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_mlp.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=EXAMPLES.parent,
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("workers", [1, 2])
def test_train_mlp_matches_single_device(n_devices, workers):
    if n_devices % workers or GLOBAL_BATCH % n_devices:
        pytest.skip(f"{n_devices} devices do not split into {workers} workers and a batch of {GLOBAL_BATCH}")
    out = run_example("--steps", "20", "--devices", str(n_devices), "--workers", str(workers))
    assert out.splitlines()[-1] == "PASS", out
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)", out, flags=re.M)]
    assert len(losses) >= 2 and losses[-1] < losses[0], out
