"""Start a multi-worker job: ``python -m replicator.launch [options] script.py [args]``.

Each worker is a process that runs the same script; the script calls
:func:`replicator.runtime.distributed.initialize` first, which reads the settings the
launcher passes in environment variables (``REPLICATOR_COORDINATOR``,
``REPLICATOR_NUM_WORKERS``, ``REPLICATOR_WORKER_ID``,
``REPLICATOR_CORES_PER_WORKER`` and the timeouts). Every line a worker prints
is prefixed with ``[worker I] ``; the launcher's own lines with
``[launcher] ``.

Three ways to run::

    # all workers on this machine (coordinator on 127.0.0.1, a free port):
    python -m replicator.launch --num-workers 2 --cores-per-worker 4 train.py --steps 100

    # one worker per host: run this on every host, I = 0 on the coordinator's host
    python -m replicator.launch --coordinator 10.0.0.1:29500 --num-workers 4 --worker-id I train.py

    # under SLURM (srun) or Open MPI (mpirun), one task per worker: JAX reads the cluster's settings
    srun -n 4 python -m replicator.launch train.py

``--cores-per-worker C`` emulates ``C`` CPU devices per worker on CPU (it sets
``XLA_FLAGS=--xla_force_host_platform_device_count=C``; other platforms ignore
it) and tells the script through ``REPLICATOR_CORES_PER_WORKER``; on a GPU
host each local worker sees all of the host's GPUs, so run one worker per GPU
host there (multi-host mode). A module can
be run instead of a script: ``python -m replicator.launch --num-workers 2 -m
pkg.train``.

Nothing waits forever. When a worker exits with an error or is killed, the
launcher says which and why, stops the others (``SIGTERM``, then ``SIGKILL``
after ``--kill-grace`` seconds: JAX catches ``SIGTERM``) and exits with that
worker's exit code (``128 + signal`` for a signal), within about
``--kill-grace`` seconds. Workers started apart (several hosts) also end on
their own: a worker that does not join within ``--start-timeout`` makes the
others exit (code 75); a worker that dies is noticed by the others after
``--heartbeat-timeout`` seconds (default 10; JAX's own default is 100).
``--max-time`` bounds the whole job.

Each worker runs through :mod:`~replicator.runtime.distributed.bootstrap`
(``python -u bootstrap.py script.py args``): it dies with the launcher
(however the launcher dies), prints its Python stacks on ``SIGUSR1``, reports
its exit code (``sys.exit(n)`` included) and its progress. The watchdog
(:mod:`replicator.runtime.watchdog`) reads the progress: when no worker has
moved for ``--step-timeout`` seconds (default 20) while one waits for
another, it names the worker behind and where it is, asks every worker for
its stacks and ends the job with code 76; a worker whose script ended with 0
while the others went on to a step it will never run is named at once (76),
one that ended before joining the job too (75).

Why a worker failed comes from a structured signal, not from its log: the
launcher passes each worker a private directory in ``REPLICATOR_STATUS_DIR``,
where :func:`~replicator.runtime.distributed.initialize`'s exception hook
writes ``worker-<id>.json`` (the exception's type and message, and whether it
was the job's first failure; see :mod:`replicator.runtime.distributed.status`).
The launcher blames the first worker that failed on its own (not one aborted
by JAX, timed out at start-up, or hit by a runtime error after a peer failed),
using those files and the exit codes.

Library use: :func:`launch` runs a job and returns its exit code.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from replicator.runtime.distributed import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    ENV_COORDINATOR,
    ENV_CORES_PER_WORKER,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_NUM_WORKERS,
    ENV_SHUTDOWN_TIMEOUT,
    ENV_START_TIMEOUT,
    ENV_STATUS_DIR,
    ENV_WORKER_ID,
    START_TIMEOUT_EXIT_CODE,
    bootstrap,
    cluster_environment,
    cluster_rank,
    progress,
)
from replicator.runtime.distributed.status import read_status
from replicator.runtime.mesh import with_device_count
from replicator.runtime.watchdog import (
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_STEP_TIMEOUT_S,
    POLL_S,
    Verdict,
    diagnose,
)

__all__ = [
    "DEFAULT_KILL_GRACE_S",
    "LaunchError",
    "check_port_free",
    "free_port",
    "launch",
    "main",
    "worker_command",
    "worker_env",
]

DEFAULT_KILL_GRACE_S = 5.0
_POLL_S = 0.05
_SUMMARY_CHARS = 500  # of a worker's error message, in the launcher's line


class LaunchError(ValueError):
    """Bad launcher arguments; the message says what to pass."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(address: str) -> None:
    """Raise :class:`LaunchError` if worker 0 could not open the coordinator's port ``HOST:PORT`` here.

    Checked on the host that runs worker 0, before any worker starts: JAX's own
    error for a port in use ("Failed to start RPC server") names no port. A
    host that is not one of this machine's addresses is not checked.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server does: TIME_WAIT is no conflict
            s.bind((host, int(port)))
    except socket.gaierror:
        return  # a host name this machine cannot resolve: worker 0 runs elsewhere (JAX will say if not)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise LaunchError(
                f"the coordinator's port {port} on {host} is already in use (another job, or one that has not "
                f"ended yet); pass another port, e.g. --coordinator {host}:{free_port(host)}, or leave "
                f"--coordinator out for a local job (a free port is chosen)."
            ) from None
        if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            return  # not an address of this machine: worker 0 runs elsewhere
        raise LaunchError(f"cannot open the coordinator's port {address}: {e}.") from None


def worker_command(args: Sequence[str], module: str | None = None) -> list[str]:
    """The command line of a worker that runs ``script.py args`` (or ``-m module args``) through the bootstrap.

    The bootstrap (:mod:`~replicator.runtime.distributed.bootstrap`) makes the
    worker die with the launcher, report its progress and exit code, and
    print its stacks on ``SIGUSR1``.
    """
    entry = [bootstrap.__file__, "-m", module] if module else [bootstrap.__file__]
    return [sys.executable, "-u", *entry, *args]


def worker_env(
    base: dict[str, str],
    *,
    coordinator: str | None,
    num_workers: int | None,
    worker_id: int | None,
    cores_per_worker: int | None,
    start_timeout_s: float,
    heartbeat_timeout_s: float,
    shutdown_timeout_s: float,
    status_dir: str | None = None,
    progress_file: str | None = None,
) -> dict[str, str]:
    """The environment of one worker: ``base`` plus the job's settings.

    Args:
      base: the environment to start from.
      coordinator, num_workers, worker_id, cores_per_worker: the job's
        settings (None: unset, e.g. under SLURM).
      start_timeout_s, heartbeat_timeout_s, shutdown_timeout_s: the timeouts.
      status_dir: where the worker writes its status file (None: nowhere).
      progress_file: where the worker writes its progress record (None: nowhere).

    Returns:
      A new environment dict.
    """
    env = dict(base)
    for name, value in (
        (ENV_COORDINATOR, coordinator),
        (ENV_NUM_WORKERS, num_workers),
        (ENV_WORKER_ID, worker_id),
        (ENV_CORES_PER_WORKER, cores_per_worker),
        (ENV_STATUS_DIR, status_dir),
        (progress.ENV_PROGRESS_FILE, progress_file),
    ):
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    env[ENV_START_TIMEOUT] = f"{start_timeout_s:g}"
    env[ENV_HEARTBEAT_TIMEOUT] = f"{heartbeat_timeout_s:g}"
    env[ENV_SHUTDOWN_TIMEOUT] = f"{shutdown_timeout_s:g}"
    if cores_per_worker is not None:
        env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), cores_per_worker)
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the launcher as they are printed
    env[bootstrap.ENV_LAUNCHER_PID] = str(os.getpid())  # the worker dies with this process
    return env


# -- one worker process ----------------------------------------------------------


@dataclasses.dataclass
class _Worker:
    worker_id: int
    proc: subprocess.Popen
    started: float
    threads: list[threading.Thread]  # output pumps
    status_dir: str
    progress_file: str
    ended: float | None = None  # when it exited (set by its waiter thread: exact, for ordering)
    _status: dict[str, Any] | None = None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.ended is not None else None

    @property
    def status(self) -> dict[str, Any] | None:
        """The status file it wrote (read once it has exited), or None."""
        if self._status is None and self.ended is not None:
            self._status = read_status(self.status_dir, self.worker_id)
        return self._status

    @property
    def progress(self) -> dict[str, Any] | None:
        """Its latest progress record (None: none yet, or not run through the bootstrap)."""
        return progress.read_progress(self.progress_file)


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        why = {
            "SIGKILL": " (killed from outside, e.g. by the OOM killer or `kill -9`)",
            "SIGABRT": " (aborted; JAX aborts a worker whose peers died or did not join)",
        }.get(name, "")
        return f"was killed by {name}{why}, exit code {128 - rc}"
    if rc == START_TIMEOUT_EXIT_CODE:
        return f"gave up waiting for the other workers to start, exit code {rc}"
    return f"failed with exit code {rc}"


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


class _Output:
    """Prefixed, line-atomic copies of the workers' output."""

    def __init__(self, stdout: IO[str], stderr: IO[str]):
        self.stdout, self.stderr = stdout, stderr
        self.lock = threading.Lock()

    def write(self, stream: IO[str], text: str) -> None:
        with self.lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):  # our own output closed: keep draining the pipes
                pass

    def launcher(self, message: str) -> None:
        self.write(self.stderr, f"[launcher] {message}\n")


def _pump(pipe: IO[bytes], prefix: str, output: _Output, stream: IO[str]) -> None:
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        output.write(stream, f"{prefix}{line}\n")
    pipe.close()


def _start(
    worker_id: int, command: Sequence[str], env: dict[str, str], output: _Output, status_dir: str, progress_file: str
) -> _Worker:
    proc = subprocess.Popen(
        list(command),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: stopping it stops what it started
    )
    prefix = f"[worker {worker_id}] "
    threads = [
        threading.Thread(target=_pump, args=(proc.stdout, prefix, output, output.stdout), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, prefix, output, output.stderr), daemon=True),
    ]
    for t in threads:
        t.start()
    worker = _Worker(worker_id, proc, time.monotonic(), threads, status_dir, progress_file)

    def wait() -> None:
        proc.wait()
        worker.ended = time.monotonic()

    threading.Thread(target=wait, daemon=True).start()
    return worker


def _signal_group(worker: _Worker, sig: int) -> None:
    try:
        os.killpg(worker.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _error_summary(worker: _Worker) -> str | None:
    """Why the worker failed, from its status file: ``ValueError: ...`` (first line), or its own message."""
    status = worker.status
    if status is None:
        return None
    lines = status["message"].strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > _SUMMARY_CHARS:
        message = message[:_SUMMARY_CHARS] + " ..."
    if status["kind"] == "exception" and status["exception_type"]:
        return f"{status['exception_type']}: {message}" if message else status["exception_type"]
    return message or None


def _blame_order(worker: _Worker) -> tuple:
    """Sort key: the worker to blame first.

    A failure that may only echo a peer's comes last: JAX's abort (SIGABRT,
    a peer died or stopped sending heartbeats), giving up at start-up, or an
    error raised by JAX's runtime (a collective broken by a peer). Among the
    rest, the worker whose status says it failed first, then the first to
    exit (exit times alone cannot tell: a killed worker's sockets close
    before its parent hears of its death, and a peer's error can land first).
    """
    status = worker.status
    echo = worker.returncode in (-signal.SIGABRT, START_TIMEOUT_EXIT_CODE) or bool(status and status["runtime_error"])
    first = bool(status and status["first_failure"])
    return (echo, not first, worker.ended, worker.worker_id)


def _stop(workers: list[_Worker], grace_s: float, output: _Output) -> None:
    """SIGTERM every live worker, SIGKILL those still alive after ``grace_s``."""
    alive = [w for w in workers if w.ended is None]
    if not alive:
        return
    output.launcher(f"stopping worker(s) {[w.worker_id for w in alive]}: SIGTERM, then SIGKILL after {grace_s:g} s")
    for w in alive:
        _signal_group(w, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(w.ended is None for w in alive):
        time.sleep(_POLL_S)
    for w in alive:
        if w.ended is None:
            _signal_group(w, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(w.ended is None for w in alive):
        time.sleep(_POLL_S)
    for w in alive:
        if w.ended is None:  # unkillable (e.g. stuck in the kernel): stop waiting for it
            output.launcher(f"worker {w.worker_id} (pid {w.proc.pid}) did not die after SIGKILL; leaving it")


def _watch(workers: list[_Worker], step_timeout_s: float, compile_timeout_s: float) -> Verdict | None:
    """The watchdog's verdict on the workers' progress records (see :mod:`replicator.runtime.watchdog`)."""
    records = {w.worker_id: w.progress for w in workers}
    return diagnose(records, time.time(), step_timeout_s=step_timeout_s, compile_timeout_s=compile_timeout_s)


def _dump_stacks(workers: list[_Worker], blamed: list[int], output: _Output) -> None:
    """Ask the live workers (blamed ones first) to print their Python stacks (the bootstrap's SIGUSR1)."""
    live = [w for w in workers if w.ended is None and w.progress is not None]
    live.sort(key=lambda w: (w.worker_id not in blamed, w.worker_id))
    if not live:
        return
    output.launcher(f"Python stacks of worker(s) {[w.worker_id for w in live]} follow (SIGUSR1):")
    for w in live:
        try:
            os.kill(w.proc.pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            continue
        time.sleep(0.3)  # one worker's stacks at a time, in order
    time.sleep(0.5)


def _exit_hint(worker: _Worker) -> str:
    """What a worker's progress record says about how its script ended, for the launcher's line."""
    record = worker.progress
    if record is None or record["phase"] != "exited":
        return ""
    if not record.get("joined"):
        return " (its script exited before it joined the job, e.g. sys.exit() before initialize())"
    return f" (its script exited with this code after {record['steps_started']} step(s), e.g. through sys.exit)"


def _supervise(
    workers: list[_Worker],
    output: _Output,
    *,
    kill_grace_s: float,
    finish_timeout_s: float,
    max_time_s: float | None,
    step_timeout_s: float | None,
    compile_timeout_s: float,
    interrupted: threading.Event,
) -> int:
    """Wait for the workers; on the first failure stop the rest. Returns the job's exit code."""
    start = time.monotonic()
    next_watch = start + POLL_S
    code = 0
    while True:
        now = time.monotonic()
        ended = [w for w in workers if w.ended is not None]
        if any(w.returncode != 0 for w in ended):
            # The others fail soon after a peer dies (a collective errors, or JAX aborts them):
            # let those exits land, then blame a worker that did not just echo a peer's
            # failure, the first to end among them.
            time.sleep(0.25)
            failed = [w for w in workers if w.ended is not None and w.returncode != 0]
            first = min(failed, key=_blame_order)
            summary = _error_summary(first)
            running = [w.worker_id for w in workers if w.ended is None]
            hint = ""
            if first.returncode == -signal.SIGABRT and running:
                hint = f" (still running, maybe hung: worker(s) {running})"
            elif 0 < first.returncode != START_TIMEOUT_EXIT_CODE and first.status is None:
                hint = _exit_hint(first) or " (no error report: it failed before initialize(); see its output)"
            output.launcher(
                f"worker {first.worker_id} {_describe(first.returncode)} after {first.ended - first.started:.1f} s"
                + hint
                + (f": {summary}" if summary else "")
            )
            code = _exit_code(first.returncode)
            break
        if len(ended) == len(workers):
            return 0
        if now >= next_watch:
            next_watch = now + POLL_S
            verdict = _watch(workers, step_timeout_s or 0.0, compile_timeout_s)
            if verdict is not None:
                output.launcher(f"watchdog: {verdict.message}")
                if verdict.kind == "stalled":
                    _dump_stacks(workers, verdict.blame, output)
                output.launcher(f"stopping the job (exit code {verdict.code})")
                code = verdict.code
                break
        if ended and now - min(w.ended for w in ended) > finish_timeout_s:
            done = min(ended, key=lambda w: w.ended)
            late = [w.worker_id for w in workers if w.ended is None]
            output.launcher(
                f"worker(s) {late} still running {finish_timeout_s:g} s after worker {done.worker_id} "
                f"finished; they are stuck (e.g. waiting in a collective for a step the others did not run)"
            )
            code = 1
            break
        if max_time_s is not None and now - start > max_time_s:
            output.launcher(f"the job ran longer than --max-time {max_time_s:g} s")
            code = 124
            break
        if interrupted.is_set():
            signum = getattr(interrupted, "signum", signal.SIGINT)
            output.launcher(f"interrupted ({signal.Signals(signum).name})")
            code = 128 + signum
            break
        time.sleep(_POLL_S)
    _stop(workers, kill_grace_s, output)
    return code


def launch(
    command: Sequence[str],
    *,
    num_workers: int | None = None,
    cores_per_worker: int | None = None,
    coordinator: str | None = None,
    worker_id: int | None = None,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    kill_grace_s: float = DEFAULT_KILL_GRACE_S,
    max_time_s: float | None = None,
    step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S,
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    interrupted: threading.Event | None = None,
) -> int:
    """Run ``command`` as the workers of a job; return the job's exit code.

    Modes: with ``worker_id`` one worker of a job spread over hosts (needs
    ``coordinator`` and ``num_workers``); with ``num_workers`` alone, all
    workers on this machine (the coordinator on ``127.0.0.1`` at a free port,
    or at ``coordinator``); with neither, under SLURM or Open MPI, one worker
    whose settings JAX reads from the cluster's environment.

    Args:
      command: the worker's command line, e.g. ``[sys.executable, "train.py"]``.
      num_workers: workers in the job.
      cores_per_worker: devices per worker (emulated on CPU).
      coordinator: ``HOST:PORT`` of worker 0.
      worker_id: this host's worker (multi-host mode).
      start_timeout_s: how long workers wait for each other to join.
      heartbeat_timeout_s: after how long a silent worker counts as dead.
      shutdown_timeout_s: how long a finished worker waits for the others.
      kill_grace_s: between SIGTERM and SIGKILL when stopping workers.
      max_time_s: stop the job after this long (None: no limit).
      step_timeout_s: the watchdog stops the job when no worker made progress
        for this long while one waits for another (None or 0: no watchdog);
        see :mod:`replicator.runtime.watchdog`. Only workers started through
        :func:`worker_command` report progress.
      compile_timeout_s: the same while a worker compiles a step.
      env: the base environment (default ``os.environ``).
      stdout, stderr: where the prefixed output goes (default ``sys``'s).
      interrupted: set it to stop the job (the CLI sets it on SIGINT/SIGTERM,
        and its ``signum`` attribute to the signal's number).

    Returns:
      0 if every worker succeeded, else the first failed worker's exit code
      (``128 + signal`` if killed), 124 after ``max_time_s``, ``128 +
      interrupted.signum`` (130 without one) if interrupted, 1 if workers were
      still running ``2 * shutdown_timeout_s + kill_grace_s`` after one finished,
      76 when the watchdog stops a stalled job or a worker left it early, 75
      when a worker ended before joining.

    Raises:
      LaunchError: on inconsistent arguments (the message says what to pass).
    """
    if not command:
        raise LaunchError("no command to run: give a script (train.py [args]) or a module (-m pkg.train [args]).")
    for name, value in (
        ("--start-timeout", start_timeout_s),
        ("--heartbeat-timeout", heartbeat_timeout_s),
        ("--shutdown-timeout", shutdown_timeout_s),
    ):
        if not value > 0:
            raise LaunchError(f"{name} must be a positive number of seconds, got {value!r}.")
    if kill_grace_s < 0:
        raise LaunchError(f"--kill-grace must be >= 0 seconds, got {kill_grace_s!r}.")
    if max_time_s is not None and not max_time_s > 0:
        raise LaunchError(f"--max-time must be a positive number of seconds, got {max_time_s!r}.")
    if step_timeout_s is not None and not step_timeout_s >= 0:
        raise LaunchError(f"--step-timeout must be >= 0 seconds (0: no watchdog), got {step_timeout_s!r}.")
    if not compile_timeout_s > 0:
        raise LaunchError(f"--compile-timeout must be a positive number of seconds, got {compile_timeout_s!r}.")
    if cores_per_worker is not None and cores_per_worker < 1:
        raise LaunchError(f"--cores-per-worker must be a positive int, got {cores_per_worker!r}.")
    if num_workers is not None and num_workers < 1:
        raise LaunchError(f"--num-workers must be a positive int, got {num_workers!r}.")
    if coordinator is not None:
        host, sep, port = coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise LaunchError(f"--coordinator {coordinator!r} is not HOST:PORT, e.g. 10.0.0.1:29500.")

    base = dict(os.environ if env is None else env)
    timeouts = {
        "start_timeout_s": start_timeout_s,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "shutdown_timeout_s": shutdown_timeout_s,
    }
    if worker_id is not None:
        if coordinator is None or num_workers is None:
            raise LaunchError(
                "--worker-id starts one worker of a job spread over hosts and needs --coordinator HOST:PORT "
                "(worker 0's host, a port it can open) and --num-workers W, the same on every host."
            )
        if not 0 <= worker_id < num_workers:
            raise LaunchError(f"--worker-id must be in [0, {num_workers}) for --num-workers {num_workers}.")
        if worker_id == 0:
            check_port_free(coordinator)
        plan = [(worker_id, coordinator, num_workers)]
    elif num_workers is not None:
        if coordinator is not None and num_workers > 1:
            check_port_free(coordinator)
        address = coordinator or f"127.0.0.1:{free_port()}"
        plan = [(i, address, num_workers) for i in range(num_workers)]
    else:
        cluster = cluster_environment(base)
        if cluster is None:
            raise LaunchError(
                "how many workers? Pass --num-workers W to start W workers on this machine, or "
                "--coordinator HOST:PORT --num-workers W --worker-id I on each host, or run the launcher "
                "under SLURM (srun) or Open MPI (mpirun), one task per worker."
            )
        if coordinator is not None:
            raise LaunchError("--coordinator needs --num-workers (and --worker-id on each host).")
        rank = cluster_rank(base)
        plan = [(rank if rank is not None else 0, None, None)]

    output = _Output(stdout or sys.stdout, stderr or sys.stderr)
    interrupted = interrupted or threading.Event()
    workers: list[_Worker] = []
    status_dir = tempfile.mkdtemp(prefix="replicator-launch-")  # private (mode 0700): the workers' status files
    try:
        try:
            for label, address, count in plan:
                wenv = worker_env(
                    base,
                    coordinator=address,
                    num_workers=count,
                    worker_id=label if count is not None else None,
                    cores_per_worker=cores_per_worker,
                    status_dir=status_dir,
                    progress_file=os.path.join(status_dir, f"progress-{label}.json"),
                    **timeouts,
                )
                workers.append(_start(label, command, wenv, output, status_dir, wenv[progress.ENV_PROGRESS_FILE]))
            if len(plan) > 1:
                output.launcher(
                    f"started {len(plan)} workers (coordinator {plan[0][1]}): pids {[w.proc.pid for w in workers]}"
                )
            code = _supervise(
                workers,
                output,
                kill_grace_s=kill_grace_s,
                # JAX's shutdown barrier makes finishing workers wait for each other at most
                # shutdown_timeout_s (then it aborts them): a worker running much longer is stuck.
                finish_timeout_s=2 * shutdown_timeout_s + kill_grace_s,
                max_time_s=max_time_s,
                step_timeout_s=step_timeout_s,
                compile_timeout_s=compile_timeout_s,
                interrupted=interrupted,
            )
        except BaseException:
            _stop(workers, kill_grace_s, output)
            raise
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
    for w in workers:
        for t in w.threads:
            t.join(timeout=2.0)  # a grandchild may hold a pipe open: do not wait for it
    if code and len(workers) > 1:
        codes = {w.worker_id: w.proc.returncode for w in workers}
        output.launcher(f"job failed, exit code {code} (workers' exit codes: {codes})")
    return code


# -- command line ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m replicator.launch",
        usage="%(prog)s [options] (script.py | -m module) [args ...]",
        description="Run a replicator training script as the workers of a multi-process job.",
        epilog="Example: python -m replicator.launch --num-workers 2 --cores-per-worker 4 train.py --steps 100",
    )
    p.add_argument("--num-workers", type=int, metavar="W", help="workers (processes) in the job")
    p.add_argument(
        "--cores-per-worker", type=int, metavar="C", help="devices per worker; on CPU this many are emulated"
    )
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="HOST:PORT of worker 0 (default for local jobs: 127.0.0.1 at a free port)",
    )
    p.add_argument(
        "--worker-id", type=int, metavar="I", help="start only this worker (one per host; needs --coordinator)"
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        metavar="S",
        default=DEFAULT_START_TIMEOUT_S,
        help="seconds workers wait for all to join (default %(default)g)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        metavar="S",
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="seconds after which a silent worker counts as dead (default %(default)g)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        metavar="S",
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="seconds a finished worker waits for the others (default %(default)g)",
    )
    p.add_argument(
        "--kill-grace",
        type=float,
        metavar="S",
        default=DEFAULT_KILL_GRACE_S,
        help="seconds between SIGTERM and SIGKILL when stopping workers (default %(default)g)",
    )
    p.add_argument(
        "--max-time", type=float, metavar="S", help="stop the whole job after this many seconds (default: no limit)"
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        metavar="S",
        default=DEFAULT_STEP_TIMEOUT_S,
        help="stop the job when no worker made progress for S seconds while one waits for another; it names "
        "the worker behind and prints every worker's Python stack (default %(default)g; 0: off)",
    )
    p.add_argument(
        "--compile-timeout",
        type=float,
        metavar="S",
        default=DEFAULT_COMPILE_TIMEOUT_S,
        help="the same while a worker compiles a step (default %(default)g)",
    )
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a module as the worker's program, like python -m")
    return p


def _split_argv(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Launcher options | the worker's command: the first positional or ``-m MOD`` ends the options."""
    takes_value = {opt for a in parser._actions if a.nargs is None and a.option_strings for opt in a.option_strings}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1 :])
        if arg == "-m":
            return list(argv[: i + 2]), list(argv[i + 2 :])
        if not arg.startswith("-") or arg == "-":
            return list(argv[:i]), list(argv[i:])
        i += 2 if arg in takes_value else 1
    return list(argv), []


def main(argv: Sequence[str] | None = None) -> int:
    """The ``python -m replicator.launch`` command; returns the exit code."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    options, rest = _split_argv(argv, parser)
    args = parser.parse_args(options)
    if args.module:
        command = worker_command(rest, module=args.module)
    elif rest:
        command = worker_command(rest)
    else:
        parser.error("give the script to run (train.py [args]) or a module (-m pkg.train [args]).")

    interrupted = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        del frame
        interrupted.signum = signum  # type: ignore[attr-defined]
        interrupted.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return launch(
            command,
            num_workers=args.num_workers,
            cores_per_worker=args.cores_per_worker,
            coordinator=args.coordinator,
            worker_id=args.worker_id,
            start_timeout_s=args.start_timeout,
            heartbeat_timeout_s=args.heartbeat_timeout,
            shutdown_timeout_s=args.shutdown_timeout,
            kill_grace_s=args.kill_grace,
            max_time_s=args.max_time,
            step_timeout_s=args.step_timeout,
            compile_timeout_s=args.compile_timeout,
            interrupted=interrupted,
        )
    except LaunchError as e:
        parser.error(str(e))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
