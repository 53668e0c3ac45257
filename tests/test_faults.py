"""The fault matrix: real 2-worker jobs through ``python -m replicator.launch``, one fault each.

Each row injects one fault into ``tests/multiproc/fault_worker.py`` (2 workers x 2
emulated CPU devices, a small SGD loop) and checks that the job ends within a bound,
with the documented exit code and the right worker named. The watchdog runs with
``--step-timeout 6`` here to keep the suite fast; ``benchmarks/fault_matrix.py`` runs
the same rows with the launcher's defaults and prints the table in BENCHMARKS.md.

Rows tested elsewhere: different constants on the workers
(``tests/test_divergence.py``), a worker killed or raising (``tests/test_distributed.py``),
checkpoint corruption and two writers (``tests/test_checkpoint_faults.py``), bad input
(``tests/test_bad_input.py``), restarts after SIGKILLs (``--max-restarts``, with the final
parameters compared: ``tests/test_restarts.py``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replicator.launch.watchdog import STALL_EXIT_CODE
from replicator.runtime.distributed import START_TIMEOUT_EXIT_CODE

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "multiproc" / "fault_worker.py"
STEP_TIMEOUT_S = 6.0  # a step under load (a mutation run beside the suite) can take over 3 s
KILL_GRACE_S = 2.0
# After the fault: the watchdog's timeout, its poll, the workers' stacks, SIGTERM then
# SIGKILL after the grace; plus slack for a loaded 2-core machine.
STALL_BOUND_S = STEP_TIMEOUT_S + KILL_GRACE_S + 10.0
FAST_BOUND_S = KILL_GRACE_S + 8.0

pytestmark = pytest.mark.multiprocess


def env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home()), "JAX_PLATFORMS": "cpu"}


def launcher(*options: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "replicator.launch",
        "--num-workers",
        "2",
        "--cores-per-worker",
        "2",
        "--step-timeout",
        f"{STEP_TIMEOUT_S:g}",
        "--kill-grace",
        f"{KILL_GRACE_S:g}",
        "--max-time",
        "150",
        *options,
    ]


def job(*worker_args: str, options: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, float]:
    """Run one job; returns it and the seconds from the injected fault to the launcher's exit."""
    proc = subprocess.run(
        [*launcher(*options), str(WORKER), *worker_args],
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    ended = time.time()
    match = re.search(r"fault \S+ at ([0-9.]+)", proc.stdout)
    assert match, f"the fault never happened:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, ended - float(match.group(1))


def launcher_lines(proc: subprocess.CompletedProcess) -> str:
    return "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[launcher]"))


def test_a_worker_stuck_in_its_own_python_code_is_named_with_its_stack():
    proc, after = job("--fault", "sleep")
    said = launcher_lines(proc)
    assert proc.returncode == STALL_EXIT_CODE, said
    assert "Behind: worker 1 in its own code after step 4" in said, said
    assert "Waiting for it: worker 0 in step" in said, said
    assert 'fault_worker.py", line' in proc.stderr and "[worker 1] Current thread" in proc.stderr  # its stack
    assert after < STALL_BOUND_S, f"ended {after:.1f} s after the fault"


def test_a_worker_stuck_in_input_fn_is_named():
    proc, after = job("--fault", "input")
    said = launcher_lines(proc)
    assert proc.returncode == STALL_EXIT_CODE, said
    assert "Behind: worker 1 in input_fn, drawing the batch of step 5" in said, said
    assert after < STALL_BOUND_S, f"ended {after:.1f} s after the fault"


def test_process_0_stuck_writing_a_checkpoint_is_named_and_the_last_good_one_kept(tmp_path):
    import numpy as np

    import replicator as rp

    ckpt = tmp_path / "ckpt"
    proc, after = job("--fault", "checkpoint", "--worker", "0", "--ckpt", str(ckpt))
    said = launcher_lines(proc)
    assert proc.returncode == STALL_EXIT_CODE, said
    assert "Behind: worker 0 writing a checkpoint (step 5" in said, said
    assert "worker 1 in a checkpoint save, waiting for process 0 to commit it" in said, said
    assert after < STALL_BOUND_S, f"ended {after:.1f} s after the fault"
    assert rp.latest_step(ckpt) == 2  # the save of step 2 is intact, the hung one never committed
    step, w, _ = rp.restore_checkpoint(ckpt, np.zeros(3, np.float32))
    assert step == 2 and np.all(np.isfinite(w))


def test_sys_exit_gives_the_workers_own_code_at_once():
    proc, after = job("--fault", "exit", "--code", "3")
    said = launcher_lines(proc)
    assert proc.returncode == 3, said
    assert "worker 1 failed with exit code 3" in said and "after 5 step(s)" in said, said
    assert after < FAST_BOUND_S, f"ended {after:.1f} s after the fault"


def test_a_worker_that_leaves_the_loop_early_with_code_0_is_named_at_once():
    proc, after = job("--fault", "leave")
    said = launcher_lines(proc)
    assert proc.returncode == STALL_EXIT_CODE, said
    assert "worker 1 ended its script with exit code 0 after 5 step(s)" in said, said
    assert "left the training loop early" in said, said
    assert after < FAST_BOUND_S, f"ended {after:.1f} s after the fault"


def test_a_worker_that_exits_before_initialize_ends_the_job_with_the_start_up_code():
    proc, after = job("--fault", "before-init")
    said = launcher_lines(proc)
    assert proc.returncode == START_TIMEOUT_EXIT_CODE, said
    assert "worker 1 ended its script with exit code 0 before it joined the job" in said, said
    assert after < FAST_BOUND_S, f"ended {after:.1f} s after the fault"


def test_a_script_that_forgot_initialize_is_told_to_call_it(tmp_path):
    script = tmp_path / "no_init.py"
    script.write_text("import replicator as rp\nrp.Replicator(2, 2)\n")
    proc = subprocess.run([*launcher(), str(script)], env=env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "has not joined the job: call `info = replicator.runtime.distributed.initialize()`" in proc.stderr


def test_a_coordinator_port_in_use_is_named_before_any_worker_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            [*launcher("--coordinator", f"127.0.0.1:{port}"), str(WORKER)],
            env=env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr and "--coordinator 127.0.0.1:" in proc.stderr
    assert "started" not in proc.stderr


def test_workers_die_when_the_launcher_is_killed():
    proc = subprocess.Popen(
        [*launcher(), str(WORKER), "--steps", "1000000000"],
        env=env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = None
        deadline = time.monotonic() + 60
        for line in proc.stderr:
            found = re.search(r"pids \[(\d+), (\d+)\]", line)
            if found:
                pids = [int(found.group(1)), int(found.group(2))]
                break
            assert time.monotonic() < deadline
        assert pids, "the launcher did not start the workers"
        time.sleep(2.0)  # the workers import JAX and start training
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        killed = time.monotonic()
        while any(_alive(p) for p in pids):
            assert time.monotonic() - killed < 5.0, f"workers {[p for p in pids if _alive(p)]} outlived the launcher"
            time.sleep(0.05)
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
