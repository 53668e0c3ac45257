"""The launcher: modes, environment, prefixed output, and stopping a failed job.

Most tests run ``launch()`` on a JAX-free toy worker (tests/multiproc/toy_worker.py),
which starts in milliseconds; one runs ``python -m replicator.launch`` itself. Workers that
start a child process of their own (tests/multiproc/child_worker.py) check that stopping a
job stops what its workers started. The jobs with real JAX workers are in
tests/test_distributed.py. At the end, the parts one at a time: a worker's process
group and output (processes.py, relay.py), supervising (supervise.py) and a worker's
status summary (blame.py), each test killing a mutant that survived the rest
(scripts/mutate.py).
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from utils import child_pids, kill_leftovers, running, still_running

from replicator import launch
from replicator.launch import LaunchError, blame, cli, processes, relay, supervise
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


# -- a worker's process group and output (processes.py, relay.py) ------------------------------------------------

#: A worker that starts a child ignoring SIGTERM (as JAX's runtime does), writes the child's pid, and waits.
#: The worker itself ends on SIGTERM (Python's default), the child does not.
_WORKER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(child.pid))
import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


def test_a_workers_stderr_reaches_the_launchers_stderr_through_its_log(tmp_path: Path) -> None:
    """With a WorkerLog (the launcher's default), stdout lines go to stdout and stderr lines to stderr, prefixed."""
    shown: list[tuple[bool, str]] = []
    log = relay.WorkerLog(4, lambda to_stderr, text: shown.append((to_stderr, text)), str(tmp_path / "w.log"))
    code = "import sys; print('to out', flush=True); print('to err', file=sys.stderr, flush=True)"
    worker = processes.start(
        4,
        [sys.executable, "-c", code],
        dict(os.environ),
        processes.Output(io.StringIO(), io.StringIO()),
        str(tmp_path),
        str(tmp_path / "p"),
        log=log,
    )
    assert worker.proc.wait(timeout=30) == 0
    for t in worker.threads:
        t.join(timeout=10)
    log.close()
    assert sorted(shown) == [(False, "[worker 4] to out\n"), (True, "[worker 4] to err\n")]
    assert sorted((tmp_path / "w.log").read_text().splitlines()) == ["to err", "to out"]  # both kept whole


def test_stop_kills_what_a_worker_started_after_the_worker_ended_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM ends the worker at once; its child ignores SIGTERM and must still go, by the SIGKILL to the group."""
    pid_file = tmp_path / "child.pid"
    output = processes.Output(io.StringIO(), io.StringIO())
    worker = processes.start(
        0, [sys.executable, "-c", _WORKER, str(pid_file)], dict(os.environ), output, str(tmp_path), str(tmp_path / "p")
    )
    child: int | None = None
    try:
        deadline = time.monotonic() + 20.0
        while not ("ready" in output.stdout.getvalue() and pid_file.exists()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pid_file.exists() and "ready" in output.stdout.getvalue(), "the worker's child never started"
        child = int(pid_file.read_text())
        processes.stop([worker], grace_s=5.0, output=output)
        assert worker.returncode == -signal.SIGTERM  # the worker itself went on SIGTERM
        assert still_running([child], within_s=2.0) == []
        assert not running(child)
        assert "did not die" not in output.stderr.getvalue()  # said only of a worker SIGKILL could not end
    finally:
        try:
            os.killpg(worker.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if child is not None:
            kill_leftovers([child])


# -- supervising (supervise.py): short limits, errors in the launcher, the plan, clean-up -------------------------


def test_a_max_time_under_a_second_is_accepted() -> None:
    """``max_time_s`` is any positive number of seconds: 0.5 runs the job (it ends by itself or by the limit)."""
    out, err = io.StringIO(), io.StringIO()
    rc = supervise.launch(
        [sys.executable, "-c", "pass"], num_workers=1, env=clean_env(), stdout=out, stderr=err, max_time_s=0.5
    )
    assert rc in (0, 124), err.getvalue()


def test_an_error_in_the_launcher_stops_the_workers_before_it_propagates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception while supervising (a launcher bug, Ctrl-C in a program calling launch()) never leaves workers."""
    pid_file = tmp_path / "worker.pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    real = supervise._interrupt

    def boom(interrupted, output):  # once the worker runs
        if pid_file.exists() and pid_file.read_text():
            raise RuntimeError("a launcher bug")
        return real(interrupted, output)

    monkeypatch.setattr(supervise, "_interrupt", boom)
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(RuntimeError, match="a launcher bug"):
        supervise.launch(
            [sys.executable, "-c", code], num_workers=1, env=clean_env(), stdout=out, stderr=err, max_time_s=30,
            kill_grace_s=2.0,
        )  # fmt: skip
    pid = int(pid_file.read_text())
    try:
        assert still_running([pid], within_s=3.0) == [], err.getvalue()
    finally:
        kill_leftovers([pid])


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a socket is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


class TestMultiHostPlan:
    def test_worker_0_checks_the_coordinator_port(self, busy_port: int) -> None:
        """Worker 0 opens the coordinator's port: one in use fails before anything starts, naming it."""
        with pytest.raises(LaunchError, match=f"port {busy_port} on 127.0.0.1 is already in use"):
            supervise._plan({}, 2, f"127.0.0.1:{busy_port}", 0)

    def test_other_workers_do_not_check_it(self, busy_port: int) -> None:
        """Worker 1 only connects to the coordinator: the port being open (by worker 0) is no error."""
        address = f"127.0.0.1:{busy_port}"
        assert supervise._plan({}, 2, address, 1) == [(1, address, 2)]


def _launch_one(code: str) -> tuple[int, str]:
    """launch() one worker running ``python -c code``; returns (exit code, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    rc = supervise.launch(
        [sys.executable, "-c", code], num_workers=1, env=clean_env(), stdout=out, stderr=err, max_time_s=60
    )
    return rc, err.getvalue()


class TestCleanUp:
    def test_a_removed_status_directory_is_no_error(self) -> None:
        """The launcher's status directory removed under it (a /tmp cleaner): the job's exit code, no traceback."""
        code = "import os, shutil; shutil.rmtree(os.path.dirname(os.environ['REPLICATOR_STATUS_DIR'])); raise SystemExit(3)"
        rc, err = _launch_one(code)
        assert rc == 3, err

    def test_a_removed_log_directory_is_no_error(self, tmp_path, monkeypatch) -> None:
        """The same for the temporary directory of the workers' logs, removed at the end when nothing failed."""
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the launcher makes it
        code = f"import glob, shutil; [shutil.rmtree(d) for d in glob.glob({str(tmp_path)!r} + '/replicator-logs-*')]"
        rc, err = _launch_one(code)
        assert rc == 0, err
        assert not glob.glob(str(tmp_path / "replicator-logs-*"))


# -- a worker's status file and its summary (blame.py) -----------------------------------------------------------


def _worker(status_dir: str, ended: float | None) -> processes.Worker:
    """A worker record (its process an already finished ``true``), as the launcher keeps it."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return processes.Worker(
        worker_id=0,
        proc=proc,
        started=time.time(),
        threads=[],
        status_dir=status_dir,
        progress_file=os.path.join(status_dir, "progress-0.json"),
        ended=ended,
    )


class TestStatusSummary:
    def test_a_running_worker_has_no_status_yet(self, tmp_path) -> None:
        """The status file is read once the worker ended: one already there (an earlier start's) is not its own."""
        status.write_status(str(tmp_path), 0, kind="exception", exception_type="ValueError", message="old")
        worker = _worker(str(tmp_path), ended=None)
        assert worker.status is None
        worker.ended = time.time()
        assert worker.status is not None and worker.status["message"] == "old"

    @pytest.mark.parametrize(
        "kind, exception_type, message, expected",
        [
            ("exception", "ValueError", "bad value\nmore", "ValueError: bad value"),
            ("exception", None, "no type given", "no type given"),  # not "None: no type given"
            ("start-timeout", "TimeoutError", "peers never joined", "peers never joined"),  # only exceptions name one
            ("exception", "KeyError", "", "KeyError"),
        ],
    )
    def test_error_summary(self, tmp_path, kind: str, exception_type: str | None, message: str, expected: str) -> None:
        """``Type: first line`` for an exception with a type, else the message alone."""
        status.write_status(str(tmp_path), 0, kind=kind, exception_type=exception_type, message=message)
        assert blame.error_summary(_worker(str(tmp_path), ended=time.time())) == expected
