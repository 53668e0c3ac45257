"""A job across hosts, end to end: 2 launchers (``--nnodes --rdzv-endpoint``) on this machine with real JAX workers.

Each launcher runs one worker of ``tests/multiproc/restart_worker.py`` (a 2 x 2
``Trainer`` job with checkpoints and ``resume_from=``), so that the job is the one
``tests/test_restarts.py`` runs under one launcher. After a launcher is lost under
``--nnodes 1:2`` the reference is the issue's: the checkpoint host 0 went on from,
resumed by one launcher on one host. ``benchmarks/fault_matrix.py
--rows hosts`` runs these rows and three more (a launcher lost without ``MIN:MAX``,
the rendezvous host lost, hostile clients) with more steps.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from utils import finish

from replicator.launch.rendezvous import StoreClient

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "multiproc" / "restart_worker.py")
STEPS, EVERY = 30, 10

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(Path.home()), "JAX_PLATFORMS": "cpu"}


def _hosts(tmp: Path, nnodes: str, *worker_args: str, launcher_args: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    """Launchers for host ranks 0 and 1 (host 0 first: it serves the rendezvous), their output merged per host."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    procs = []
    for rank in (0, 1):
        command = [sys.executable, "-m", "replicator.launch", "--nnodes", nnodes, "--rdzv-endpoint", endpoint]
        command += ["--node-rank", str(rank), "--rdzv-heartbeat", "0.5", "--cores-per-worker", "2"]
        command += ["--max-restarts", "3", "--kill-grace", "2", "--max-time", "240", *launcher_args]
        command += [WORKER, "--steps", str(STEPS)]
        command += ["--every", str(EVERY), "--ckpt", str(tmp / "ckpt"), "--out", str(tmp / "out"), *worker_args]
        procs.append(
            subprocess.Popen(
                command,
                env=_env(),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )  # fmt: skip
        )
        if rank == 0:
            StoreClient(endpoint, connect_timeout_s=60).close()
    return procs


def _finish(procs: list[subprocess.Popen], timeout_s: float = 240) -> list[tuple[int, str]]:
    return finish(procs, timeout_s)


def _params(out: Path, worker: int) -> dict[str, np.ndarray]:
    files = sorted(out.glob(f"w{worker}_param_*.npy"))
    assert files, f"worker {worker} wrote no parameters into {out}"
    return {f.stem.split("_param_")[1]: np.load(f, allow_pickle=False) for f in files}


def _one_device_reference(steps: int) -> dict[str, np.ndarray]:
    from test_restarts import one_device_reference

    return one_device_reference(steps)


def test_a_worker_killed_on_host_1_restarts_every_host_and_the_job_ends_as_if_uninterrupted(tmp_path):
    (rc0, out0), (rc1, out1) = _finish(_hosts(tmp_path, "2", "--kill", "0:1:step:15"))
    assert (rc0, rc1) == (0, 0), out0[-3000:] + out1[-3000:]
    assert re.search(r"\[worker 1\] .*?killing myself at [\d.]+ in step after 15 steps", out1), out1
    # One host opens round 1 and names its cause: host 1 (its worker was killed) or, when host 0's
    # worker failed first on its dead peer's collective, host 0; the other host follows.
    opened = [out for out in (out0, out1) if "restart 1 of at most 3, cause: host rank " in out]
    assert len(opened) == 1, out0[-3000:] + out1[-3000:]
    followed = out1 if opened[0] is out0 else out0
    assert "round 1 was started by another host" in followed, followed
    if opened[0] is out1:
        assert "[launcher] worker 1 was killed by SIGKILL" in out1, out1
    for out in (out0, out1):  # every host restarted, from the checkpoint of step 10, and finished
        assert "[launcher] round 1: host rank" in out and "restart 1 recovered in" in out, out
        assert "from step 10" in out and "job finished after 1 restart(s)" in out, out
    uninterrupted = subprocess.run(
        [sys.executable, "-m", "replicator.launch", "--num-workers", "2", "--cores-per-worker", "2", WORKER,
         "--steps", str(STEPS), "--every", str(EVERY), "--ckpt", str(tmp_path / "ckpt-whole"),
         "--out", str(tmp_path / "whole")],
        env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    whole, reference = _params(tmp_path / "whole", 0), _one_device_reference(STEPS)
    for w in (0, 1):
        got = _params(tmp_path / "out", w)
        assert got.keys() == whole.keys() == reference.keys()
        for name in got:
            np.testing.assert_array_equal(got[name], whole[name], err_msg=f"worker {w}'s {name}")  # bit for bit
            np.testing.assert_allclose(got[name], reference[name], rtol=0, atol=1e-6, err_msg=name)


def test_a_lost_host_under_min_max_and_the_job_finishes_on_the_other(tmp_path):
    # Round 0 must hold both hosts: under MIN:MAX it closes a last call after the first host joined,
    # and host 1's launcher may take longer than the 3 s default to start on a loaded machine (a flake
    # of the loop in benchmarks/results/flakes.md). With 20 s it closes as soon as both are in.
    procs = _hosts(tmp_path, "1:2", "--print-steps", launcher_args=("--rdzv-last-call", "20"))
    lines = []
    for line in procs[0].stdout:  # host 0's output, until worker 0 has done step 15
        lines.append(line)
        if re.fullmatch(r"\[worker 0\] step 15\n", line):
            break
    os.kill(procs[1].pid, signal.SIGKILL)  # host 1's launcher; its worker dies with it
    killed = time.monotonic()
    (rc0, out0), _ = _finish(procs)
    out0 = "".join(lines) + out0
    assert rc0 == 0, out0[-4000:]
    assert "[launcher] round 1: host rank 0 of 1" in out0, out0
    assert "host rank 1 lost (launcher " in out0 and "going on with 1 of 2 hosts" in out0, out0
    # From the last checkpoint both hosts wrote (every 10 steps): step 10, or step 20 where this test read
    # host 0's "step 15" late, the worker already past step 20 when host 1 was killed (a loaded machine,
    # in the loop of benchmarks/results/flakes.md: worker 0 failed at step 29). REPLICATOR_INITIAL_NUM_WORKERS=2.
    assert re.search(r"worker 0: start 1, 1 of 2 workers, from step (10|20)\n", out0), out0
    assert "keep_batch='global': the global batch of 64 rows is kept" in out0, out0
    assert time.monotonic() - killed < 120
    got = _params(tmp_path / "out", 0)
    # The reference: the checkpoint host 0 restarted from, resumed by one launcher on one host.
    resumed = _resume_on_one_host(tmp_path, int(re.search(r"worker 0: start 1, .*, from step (\d+)", out0).group(1)))
    assert got.keys() == resumed.keys()
    for name in got:
        np.testing.assert_allclose(got[name], resumed[name], rtol=0, atol=1e-6, err_msg=name)
    reference = _one_device_reference(STEPS)
    for name in got:
        # The global batch is kept: one device's math, summed in another order (fault_matrix.py: 1.2e-7).
        np.testing.assert_allclose(got[name], reference[name], rtol=0, atol=1e-5, err_msg=name)


def _resume_on_one_host(tmp: Path, step: int) -> dict[str, np.ndarray]:
    """The job resumed from ``tmp/ckpt``'s checkpoint of ``step`` alone by one launcher (1 worker x 2 devices)."""
    (tmp / "resume").mkdir()
    shutil.copytree(tmp / "ckpt" / f"step_{step:08d}", tmp / "resume" / f"step_{step:08d}")
    resumed = subprocess.run(
        [sys.executable, "-m", "replicator.launch", "--num-workers", "1", "--cores-per-worker", "2", WORKER,
         "--steps", str(STEPS), "--every", str(EVERY), "--ckpt", str(tmp / "resume"), "--out", str(tmp / "resumed")],
        env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0 and f"from step {step}" in resumed.stdout, resumed.stdout[-3000:] + resumed.stderr
    return _params(tmp / "resumed", 0)
