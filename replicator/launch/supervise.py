"""Supervising a job: start its workers, watch them, stop them all at the first failure; :func:`launch`.

The supervision loop looks every :data:`~replicator.launch.processes.EXIT_POLL_S`
seconds for workers that exited (the first failure stops the job, and
:func:`~replicator.launch.blame.blame` names the worker to blame), and every
:data:`~replicator.launch.watchdog.DIAGNOSE_INTERVAL_S` seconds asks the
watchdog about the workers' progress (a stalled job: their stacks are dumped
and the job stopped); it also bounds how long workers may outlive one that
finished, the whole job (``--max-time``), and stops on an interrupt.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

from replicator.launch.blame import blame, exit_code
from replicator.launch.environment import LaunchError, check_port_free, free_port, worker_env
from replicator.launch.processes import DEFAULT_KILL_GRACE_S, EXIT_POLL_S, Output, Worker, start, stop
from replicator.launch.watchdog import (
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_STEP_TIMEOUT_S,
    DIAGNOSE_INTERVAL_S,
    Verdict,
    diagnose,
)
from replicator.runtime.distributed import progress
from replicator.runtime.distributed.startup import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    cluster_environment,
    cluster_rank,
)

__all__ = ["launch", "supervise"]


def _watch(workers: list[Worker], step_timeout_s: float, compile_timeout_s: float) -> Verdict | None:
    """The watchdog's verdict on the workers' progress records (see :mod:`replicator.launch.watchdog`)."""
    records = {w.worker_id: w.progress for w in workers}
    return diagnose(records, time.time(), step_timeout_s=step_timeout_s, compile_timeout_s=compile_timeout_s)


def _dump_stacks(workers: list[Worker], blamed: list[int], output: Output) -> None:
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


def supervise(
    workers: list[Worker],
    output: Output,
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
    next_watch = start + DIAGNOSE_INTERVAL_S
    code = 0
    while True:
        now = time.monotonic()
        ended = [w for w in workers if w.ended is not None]
        if any(w.returncode != 0 for w in ended):
            # The others fail soon after a peer dies (a collective errors, or JAX aborts them):
            # let those exits land, then blame a worker that did not just echo a peer's
            # failure, the first to end among them.
            time.sleep(0.25)
            first, line = blame(workers)
            output.launcher(line)
            code = exit_code(first.returncode)
            break
        if len(ended) == len(workers):
            return 0
        if now >= next_watch:
            next_watch = now + DIAGNOSE_INTERVAL_S
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
        time.sleep(EXIT_POLL_S)
    stop(workers, kill_grace_s, output)
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
        see :mod:`replicator.launch.watchdog`. Only workers started through
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

    output = Output(stdout or sys.stdout, stderr or sys.stderr)
    interrupted = interrupted or threading.Event()
    workers: list[Worker] = []
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
                workers.append(start(label, command, wenv, output, status_dir, wenv[progress.ENV_PROGRESS_FILE]))
            if len(plan) > 1:
                output.launcher(
                    f"started {len(plan)} workers (coordinator {plan[0][1]}): pids {[w.proc.pid for w in workers]}"
                )
            code = supervise(
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
            stop(workers, kill_grace_s, output)
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
