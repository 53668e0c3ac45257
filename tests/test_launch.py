"""The launcher: modes, environment, prefixed output, and stopping a failed job.

Most tests run ``launch()`` on a JAX-free toy worker (tests/multiproc/toy_worker.py),
which starts in milliseconds; one runs ``python -m replicator.launch`` itself. Workers that
start a child process of their own (tests/multiproc/child_worker.py) check that stopping a
job stops what its workers started. The jobs with real JAX workers are in
tests/test_distributed.py.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from utils import child_pids, kill_leftovers, still_running

from replicator import launch
from replicator.launch import LaunchError, blame, cli, processes
from replicator.runtime import distributed
from replicator.runtime.distributed import status
from replicator.runtime.mesh import with_device_count

ROOT = Path(__file__).resolve().parent.parent
TOY = str(Path(__file__).resolve().parent / "multiproc" / "toy_worker.py")
CHILD_WORKER = str(Path(__file__).resolve().parent / "multiproc" / "child_worker.py")
CLUSTER_VARS = ("SLURM_", "OMPI_", "REPLICATOR_")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLUSTER_VARS)}
    env.update(extra)
    return env


def run(*toy_args: str, **kwargs) -> tuple[int, str, str, float]:
    """launch() the toy worker; returns (exit code, stdout, stderr, seconds)."""
    out, err = io.StringIO(), io.StringIO()
    kwargs.setdefault("env", clean_env())
    kwargs.setdefault("max_time_s", 60)  # a backstop: no test may hang
    start = time.monotonic()
    code = launch.launch([sys.executable, TOY, *toy_args], stdout=out, stderr=err, **kwargs)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


class TestCommandLine:
    @pytest.mark.parametrize(
        "argv, options, command",
        [
            (
                ["--num-workers", "2", "train.py", "--num-workers", "5"],
                ["--num-workers", "2"],
                ["train.py", "--num-workers", "5"],
            ),
            (["--cores-per-worker=4", "train.py", "-x"], ["--cores-per-worker=4"], ["train.py", "-x"]),
            (
                ["--num-workers", "2", "-m", "pkg.train", "--lr", "1"],
                ["--num-workers", "2", "-m", "pkg.train"],
                ["--lr", "1"],
            ),
            (["--num-workers", "2", "--", "--weird.py"], ["--num-workers", "2"], ["--weird.py"]),
            (["--num-workers", "2"], ["--num-workers", "2"], []),
        ],
    )
    def test_options_end_at_the_script(self, argv, options, command):
        assert cli._split_argv(argv, cli._parser()) == (options, command)

    def test_worker_env(self):
        base = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8", "KEEP": "1"}
        env = launch.worker_env(
            base,
            coordinator="127.0.0.1:1234",
            num_workers=2,
            worker_id=1,
            cores_per_worker=4,
            start_timeout_s=7,
            heartbeat_timeout_s=3,
            shutdown_timeout_s=5,
        )
        assert env["KEEP"] == "1" and env["PYTHONUNBUFFERED"] == "1"
        assert env["XLA_FLAGS"].split() == [
            "--xla_cpu_enable_fast_math=false",
            "--xla_force_host_platform_device_count=4",
        ]
        assert (env[distributed.ENV_COORDINATOR], env[distributed.ENV_NUM_WORKERS], env[distributed.ENV_WORKER_ID]) == (
            "127.0.0.1:1234",
            "2",
            "1",
        )
        assert env[distributed.ENV_CORES_PER_WORKER] == "4"
        assert (env[distributed.ENV_START_TIMEOUT], env[distributed.ENV_HEARTBEAT_TIMEOUT]) == ("7", "3")
        assert env[distributed.ENV_SHUTDOWN_TIMEOUT] == "5"
        assert distributed.ENV_STATUS_DIR not in env

    def test_worker_env_status_dir(self):
        kwargs = dict(
            coordinator=None,
            num_workers=None,
            worker_id=None,
            cores_per_worker=None,
            start_timeout_s=1,
            heartbeat_timeout_s=1,
            shutdown_timeout_s=1,
        )
        env = launch.worker_env({distributed.ENV_STATUS_DIR: "/stale"}, status_dir="/tmp/s", **kwargs)
        assert env[distributed.ENV_STATUS_DIR] == "/tmp/s"
        assert distributed.ENV_STATUS_DIR not in launch.worker_env({distributed.ENV_STATUS_DIR: "/stale"}, **kwargs)

    @pytest.mark.parametrize(
        "kwargs, message",
        [
            ({}, "how many workers"),
            ({"num_workers": 2, "worker_id": 0}, "needs --coordinator"),
            ({"num_workers": 2, "worker_id": 2, "coordinator": "h:1"}, r"--worker-id must be in \[0, 2\)"),
            ({"num_workers": 2, "coordinator": "nohost"}, "is not HOST:PORT"),
            ({"num_workers": 0}, "--num-workers must be a positive int"),
            ({"num_workers": 2, "heartbeat_timeout_s": 0}, "--heartbeat-timeout must be a positive"),
        ],
    )
    def test_bad_arguments_say_what_to_pass(self, kwargs, message):
        with pytest.raises(LaunchError, match=message):
            launch.launch([sys.executable, TOY], env=clean_env(), **kwargs)

    def test_no_script(self, capsys):
        with pytest.raises(SystemExit) as e:
            launch.main(["--num-workers", "2"])
        assert e.value.code == 2
        assert "give the script to run" in capsys.readouterr().err


class TestLocalJobs:
    def test_output_is_prefixed_and_the_job_configured(self):
        names = [
            distributed.ENV_COORDINATOR,
            distributed.ENV_NUM_WORKERS,
            distributed.ENV_CORES_PER_WORKER,
            "XLA_FLAGS",
        ]
        code, out, err, _ = run("--env", *names, num_workers=2, cores_per_worker=3)
        assert code == 0, err
        lines = out.splitlines()
        for w in (0, 1):
            assert f"[worker {w}] hello from worker {w}" in lines
            assert f"[worker {w}] note from worker {w}" in err.splitlines()
            assert f"[worker {w}] {distributed.ENV_NUM_WORKERS}=2" in lines
            assert f"[worker {w}] {distributed.ENV_CORES_PER_WORKER}=3" in lines
            assert f"[worker {w}] XLA_FLAGS={with_device_count(os.environ['XLA_FLAGS'], 3)}" in lines  # others kept
        coordinators = {line.split("=", 1)[1] for line in lines if distributed.ENV_COORDINATOR in line}
        assert len(coordinators) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+", coordinators.pop())
        assert all(re.match(r"\[(worker \d|launcher)\] ", line) for line in lines + err.splitlines())

    def test_first_failure_stops_the_others_and_gives_its_exit_code(self):
        code, _, err, took = run(
            "--fail-worker", "1", "--code", "3", "--after", "0.5", "--sleep", "60", num_workers=3, kill_grace_s=2
        )
        assert code == 3
        # The launcher's line names the worker, the exit code and the error it reported.
        assert re.search(r"\[launcher\] worker 1 failed with exit code 3 after [\d.]+ s: ValueError: toy failure", err)
        assert "stopping worker(s) [0, 2]" in err
        assert took < 10, took  # the sleepers end on SIGTERM at once

    def test_a_failure_without_a_report_is_not_read_from_the_log(self):
        # The worker prints an exception-like line but writes no status file: the launcher
        # does not guess from the log, it says that there was no report.
        code, _, err, _ = run("--fail-worker", "0", "--code", "5", "--no-report", num_workers=2, kill_grace_s=1)
        assert code == 5
        launcher_line = next(line for line in err.splitlines() if line.startswith("[launcher] worker 0 failed"))
        assert re.fullmatch(
            r"\[launcher\] worker 0 failed with exit code 5 after [\d.]+ s \(no error report: .*initialize\(\).*\)",
            launcher_line,
        ), launcher_line

    def test_the_status_directory_is_private_to_the_job_and_removed(self):
        code, out, err, _ = run("--env", distributed.ENV_STATUS_DIR, num_workers=2)
        assert code == 0, err
        dirs = {line.split("=", 1)[1] for line in out.splitlines() if distributed.ENV_STATUS_DIR in line}
        assert len(dirs) == 1  # shared by the job's workers
        directory = dirs.pop()
        assert os.path.isabs(directory) and not os.path.exists(directory)

    def test_sigterm_is_escalated_to_sigkill(self):
        # JAX's runtime catches SIGTERM: the launcher must not rely on it.
        code, _, err, took = run(
            "--fail-worker", "0", "--code", "2", "--sleep", "60", "--ignore-sigterm", num_workers=2, kill_grace_s=1
        )
        assert code == 2
        assert "SIGKILL after 1 s" in err and "workers' exit codes: {0: 2, 1: -9}" in err
        assert took < 10, took

    def test_killed_worker_gives_128_plus_signal(self):
        code, _, err, _ = run("--fail-worker", "1", "--signal", "KILL", "--sleep", "60", num_workers=2, kill_grace_s=1)
        assert code == 128 + signal.SIGKILL
        assert "worker 1 was killed by SIGKILL" in err

    def test_max_time_bounds_the_job(self):
        code, _, err, took = run("--sleep", "60", num_workers=2, max_time_s=1, kill_grace_s=1)
        assert code == 124 and "longer than --max-time 1 s" in err
        assert took < 10, took

    def test_workers_stuck_after_another_finished_are_stopped(self):
        # Worker 0 finishes at once; worker 1 would sleep 60 s: stopped after 2 * 0.5 + 0.5 s.
        code, _, err, took = run(
            "--fail-worker", "1", "--after", "60", num_workers=2, shutdown_timeout_s=0.5, kill_grace_s=0.5
        )
        assert code == 1 and "worker(s) [1] still running" in err
        assert took < 10, took


class TestStatusFiles:
    def test_write_and_read(self, tmp_path):
        d = str(tmp_path)
        assert status.read_status(d, 0) is None
        assert status.claim_first_failure(d) and not status.claim_first_failure(d)
        path = status.write_status(
            d, 3, kind="exception", exception_type="pkg.MyError", message="bad\nthing", first_failure=True
        )
        assert path == status.status_path(d, 3) and path.endswith("worker-3.json")
        got = status.read_status(d, 3)
        assert got["exception_type"] == "pkg.MyError" and got["message"] == "bad\nthing"
        assert got["first_failure"] and not got["runtime_error"] and got["pid"] == os.getpid()
        assert sorted(os.listdir(d)) == ["first-failure", "worker-3.json"]  # no temporary file left

    def test_unreadable_files_are_no_report(self, tmp_path):
        d = str(tmp_path)
        Path(status.status_path(d, 0)).write_text("{not json")
        Path(status.status_path(d, 1)).write_text(json.dumps({"worker_id": 1, "kind": "exception"}))
        assert status.read_status(d, 0) is None and status.read_status(d, 1) is None
        assert status.write_status(str(tmp_path / "missing"), 0, kind="exception", message="x") is None

    @staticmethod
    def worker(tmp_path, worker_id: int, rc: int, ended: float, **report) -> processes.Worker:
        if report:
            status.write_status(str(tmp_path), worker_id, kind="exception", **report)
        proc = SimpleNamespace(returncode=rc, pid=0)
        return processes.Worker(worker_id, proc, 0.0, [], str(tmp_path), str(tmp_path / "none.json"), ended=ended)

    def test_blame_the_first_real_failure_not_its_echoes(self, tmp_path):
        # Worker 2 raised first; worker 0's collective broke because of it (a runtime error,
        # reported earlier), worker 1 was aborted by JAX: worker 2 is blamed.
        workers = [
            self.worker(tmp_path, 0, 1, 1.0, exception_type="jax.errors.JaxRuntimeError", message="peer gone",
                        runtime_error=True, first_failure=True),
            self.worker(tmp_path, 1, -signal.SIGABRT, 1.5),
            self.worker(tmp_path, 2, 1, 2.0, exception_type="ValueError", message="bad batch\nmore"),
        ]  # fmt: skip
        first = min(workers, key=blame.blame_order)
        assert first.worker_id == 2
        assert blame.error_summary(first) == "ValueError: bad batch"
        assert blame.error_summary(workers[1]) is None

    def test_a_killed_worker_is_blamed_before_its_peers_errors(self, tmp_path):
        workers = [
            self.worker(tmp_path, 0, 1, 1.0, exception_type="jax.errors.JaxRuntimeError", message="gloo failed",
                        runtime_error=True, first_failure=True),
            self.worker(tmp_path, 1, -signal.SIGKILL, 1.2),
        ]  # fmt: skip
        assert min(workers, key=blame.blame_order).worker_id == 1

    def test_the_first_reported_failure_wins(self, tmp_path):
        workers = [
            self.worker(tmp_path, 0, 1, 1.0, exception_type="ValueError", message="a", first_failure=False),
            self.worker(tmp_path, 1, 1, 1.1, exception_type="ValueError", message="b", first_failure=True),
        ]
        assert min(workers, key=blame.blame_order).worker_id == 1


class TestOtherModes:
    def test_one_worker_of_a_multi_host_job(self):
        names = [distributed.ENV_COORDINATOR, distributed.ENV_NUM_WORKERS, distributed.ENV_WORKER_ID]
        code, out, err, _ = run("--env", *names, num_workers=4, worker_id=2, coordinator="10.0.0.1:29500")
        assert code == 0, err
        assert out.splitlines() == [
            "[worker 2] hello from worker 2",
            f"[worker 2] {distributed.ENV_COORDINATOR}=10.0.0.1:29500",
            f"[worker 2] {distributed.ENV_NUM_WORKERS}=4",
            f"[worker 2] {distributed.ENV_WORKER_ID}=2",
        ]

    def test_under_slurm_one_worker_reads_the_cluster(self):
        slurm = {
            "SLURM_JOB_ID": "77",
            "SLURM_STEP_NODELIST": "node[1-2]",
            "SLURM_NTASKS": "4",
            "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1",
        }
        env = clean_env(**slurm)
        assert distributed.cluster_environment(env) == "slurm" and distributed.cluster_rank(env) == 3
        names = [distributed.ENV_COORDINATOR, distributed.ENV_NUM_WORKERS, distributed.ENV_HEARTBEAT_TIMEOUT]
        code, out, err, _ = run("--env", *names, env=env, heartbeat_timeout_s=4)
        assert code == 0, err
        assert out.splitlines()[1:] == [
            f"[worker 3] {distributed.ENV_COORDINATOR}=<unset>",  # jax.distributed detects SLURM itself
            f"[worker 3] {distributed.ENV_NUM_WORKERS}=<unset>",
            f"[worker 3] {distributed.ENV_HEARTBEAT_TIMEOUT}=4",
        ]


def test_command_line_end_to_end():
    proc = subprocess.run(
        [sys.executable, "-m", "replicator.launch", "--num-workers", "2", "--kill-grace", "1", TOY]
        + ["--fail-worker", "0", "--code", "4", "--sleep", "60"],
        env=clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 4, proc.stderr
    assert "[launcher] worker 0 failed with exit code 4" in proc.stderr
    assert "[worker 1] hello from worker 1" in proc.stdout


def test_sigterm_to_the_launcher_stops_the_job(tmp_path):
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "replicator.launch", "--num-workers", "2", "--kill-grace", "1", TOY]
        + ["--sleep", "60", "--ignore-sigterm", "--ready-file", str(ready)],
        env=clean_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready.{w}").exists() for w in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, "the workers did not start"
            time.sleep(0.05)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "[launcher] interrupted (SIGTERM)" in err and "job failed, exit code 143" in err
    assert "workers' exit codes: {0: -9, 1: -9}" in err  # they ignore SIGTERM: killed after the grace period
    assert time.monotonic() - start < 10


@pytest.mark.multiprocess
def test_a_job_that_succeeds_leaves_no_child_behind(tmp_path):
    """Both workers exit 0 and leave their children running: the launcher ends their process groups too."""
    prefix = tmp_path / "child"
    args = ["--pids", str(prefix), "--num-workers", "2", "--sleep", "0.2", "--leave-child"]
    out, err = io.StringIO(), io.StringIO()
    code = launch.launch(
        [sys.executable, CHILD_WORKER, *args], num_workers=2, kill_grace_s=0.5, max_time_s=60, env=clean_env(),
        stdout=out, stderr=err,
    )  # fmt: skip
    pids = child_pids(prefix)
    try:
        assert code == 0, err.getvalue()
        assert sorted(pids) == ["0.0", "1.0"], (pids, out.getvalue())
        left = still_running(list(pids.values()))
        assert not left, f"children {left} of {pids} outlived a job that succeeded"
    finally:
        kill_leftovers(list(pids.values()))


@pytest.mark.multiprocess
@pytest.mark.parametrize("child", ["default", "ignores-sigterm"])
def test_stopping_a_job_stops_what_its_workers_started(tmp_path, child):
    """Worker 1 fails and leaves its child behind; worker 0 is stopped: no child of either outlives the launcher.

    Each worker's process group is signalled, not its process alone (``os.killpg``): the
    children of a stopped worker and of one that already exited end too, also one that
    ignores SIGTERM (as JAX's runtime does).
    """
    prefix = tmp_path / "child"
    args = ["--pids", str(prefix), "--num-workers", "2", "--fail-worker", "1"]
    if child == "ignores-sigterm":
        args.append("--child-ignores-sigterm")
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = launch.launch(
        [sys.executable, CHILD_WORKER, *args], num_workers=2, kill_grace_s=0.5, max_time_s=60, env=clean_env(),
        stdout=out, stderr=err,
    )  # fmt: skip
    took = time.monotonic() - start
    pids = child_pids(prefix)
    try:
        assert code == 3, err.getvalue()
        assert sorted(pids) == ["0.0", "1.0"], (pids, out.getvalue())
        assert "stopping worker(s) [0]" in err.getvalue()
        left = still_running(list(pids.values()))
        assert not left, f"children {left} of {pids} outlived the launcher (workers: 0 stopped, 1 failed)"
        assert took < 10, took  # no output thread waited on a pipe a child held open
    finally:
        kill_leftovers(list(pids.values()))
