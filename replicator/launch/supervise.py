"""Supervising a job: start its workers, watch them, stop them all at the first failure; :func:`launch`.

The supervision loop (:func:`supervise`) looks every
:data:`~replicator.launch.processes.EXIT_POLL_S` seconds for workers that
exited (the first failure stops the job, and
:func:`~replicator.launch.blame.blame` names the worker to blame), and every
:data:`~replicator.launch.watchdog.DIAGNOSE_INTERVAL_S` seconds asks the
watchdog about the workers' progress (a stalled job: their stacks are dumped
and the job stopped); it also bounds how long workers may outlive one that
finished, the whole job (``--max-time``), and stops on an interrupt.
:func:`launch` starts the workers and, with ``max_restarts``, starts them
again after a failure (see :mod:`~replicator.launch.restarts`).

Promises:

1. The first failure stops every other worker; the job's outcome is the
   blamed worker's exit code, restartable, naming it
   (tests/test_supervise_promises.py::test_the_first_failure_is_blamed_restartable_and_every_other_worker_stopped,
   tests/test_launch.py::TestLocalJobs::test_first_failure_stops_the_others_and_gives_its_exit_code);
   a worker killed by a signal gives ``128 + signal``
   (tests/test_launch.py::TestLocalJobs::test_killed_worker_gives_128_plus_signal).
2. Stopping escalates ``SIGTERM`` to ``SIGKILL`` after ``--kill-grace``, so a
   job that fails ends within about the grace
   (tests/test_launch.py::TestLocalJobs::test_sigterm_is_escalated_to_sigkill).
3. ``--max-time`` ends the job with 124, not restartable
   (tests/test_supervise_promises.py::test_max_time_ends_the_job_with_124_not_restartable,
   tests/test_launch.py::TestLocalJobs::test_max_time_bounds_the_job), also under a second
   (tests/test_launch.py::test_a_max_time_under_a_second_is_accepted).
4. Workers still running ``finish_timeout_s`` after one finished are stopped
   (tests/test_launch.py::TestLocalJobs::test_workers_stuck_after_another_finished_are_stopped).
5. An interrupt (``SIGINT``, ``SIGTERM`` to the launcher) ends the job with
   ``128 + signal``, not restartable
   (tests/test_supervise_promises.py::test_an_interrupt_ends_the_job_with_128_plus_the_signal_not_restartable,
   tests/test_launch.py::test_sigterm_to_the_launcher_stops_the_job).
6. Another reason to stop (``stop_when``: the rendezvous) ends the start with
   its outcome, the workers stopped
   (tests/test_supervise_promises.py::test_another_reason_to_stop_stops_the_workers_with_its_outcome).
7. A stalled job is named with the workers' stacks and stopped with code 76
   (tests/test_faults.py::test_a_worker_stuck_in_its_own_python_code_is_named_with_its_stack);
   a worker that leaves early too, at once
   (tests/test_faults.py::test_a_worker_that_leaves_the_loop_early_with_code_0_is_named_at_once).
8. Nothing the workers started outlives the job, when it succeeds too
   (tests/test_launch.py::test_a_job_that_succeeds_leaves_no_child_behind); the status
   directory is private to the job and removed
   (tests/test_launch.py::TestLocalJobs::test_the_status_directory_is_private_to_the_job_and_removed);
   an error in the launcher stops the workers before it propagates
   (tests/test_launch.py::test_an_error_in_the_launcher_stops_the_workers_before_it_propagates).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

from replicator.launch.blame import blame, exit_code
from replicator.launch.environment import LaunchError, check_port_free, free_port, worker_env
from replicator.launch.options import FROM_OPTIONS, FromOptions, LaunchOptions, merge
from replicator.launch.processes import EXIT_POLL_S, Output, Worker, start, stop
from replicator.launch.relay import WorkerLog, log_path
from replicator.launch.restarts import Outcome, Recovery, Shrinking
from replicator.launch.watchdog import DIAGNOSE_INTERVAL_S, Verdict, diagnose
from replicator.runtime.distributed.startup import cluster_environment, cluster_rank

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


def _interrupt(interrupted: threading.Event, output: Output) -> Outcome | None:
    """The outcome of a job whose launcher was interrupted (None: it was not), said once."""
    if not interrupted.is_set():
        return None
    signum = getattr(interrupted, "signum", signal.SIGINT)
    output.launcher(f"interrupted ({signal.Signals(signum).name})")
    return Outcome(128 + signum)


def supervise(
    workers: list[Worker],
    output: Output,
    *,
    kill_grace_s: float,
    finish_timeout_s: float,
    max_time_s: float | None,
    job_start: float,
    step_timeout_s: float | None,
    compile_timeout_s: float,
    interrupted: threading.Event,
    recovery: Recovery | None = None,
    stop_when: Callable[[float], Outcome | None] | None = None,
) -> Outcome:
    """Wait for the workers; on the first failure stop the rest. Returns how they ended.

    ``job_start`` is when the job (its first start) began, for ``max_time_s``;
    ``recovery``, after a restart, is timed to the workers' first step and
    logged then. ``stop_when(now)``, called at every look at the workers
    (``now``: ``time.monotonic()``), is one more reason to stop them: an
    outcome (the caller has said why) stops the job with it, None goes on; the
    rendezvous across hosts uses it (:mod:`~replicator.launch.hosts`).
    """
    next_watch = time.monotonic() + DIAGNOSE_INTERVAL_S
    while True:
        now = time.monotonic()
        if recovery is not None and recovery.first_step is None:
            if recovery.observe([w.progress for w in workers], now):
                output.launcher(recovery.line())
        ended = [w for w in workers if w.ended is not None]
        if any(w.returncode != 0 for w in ended):
            # The others fail soon after a peer dies (a collective errors, or JAX aborts them):
            # let those exits land, then blame a worker that did not just echo a peer's
            # failure, the first to end among them. Their error reports are held meanwhile
            # (see replicator.launch.relay): the launcher's line comes first.
            time.sleep(0.25)
            first, line = blame(workers)
            output.launcher(line)
            _settle(workers, {first.worker_id})
            outcome = Outcome(exit_code(first.returncode), line, restartable=True, detected=now, blamed=first.worker_id)
            break
        for w in workers:
            if w.log is not None and (w.ended is None or w.returncode == 0):
                w.log.release_stale(now)
        if len(ended) == len(workers):
            stop(workers, kill_grace_s, output)  # what the workers started and left running ends with them
            return Outcome(0)
        if now >= next_watch:
            next_watch = now + DIAGNOSE_INTERVAL_S
            verdict = _watch(workers, step_timeout_s or 0.0, compile_timeout_s)
            if verdict is not None:
                output.launcher(f"watchdog: {verdict.message}")
                if verdict.kind == "stalled":
                    _dump_stacks(workers, verdict.blame, output)  # shown whole: they are the diagnosis
                _settle(workers, set(verdict.blame))
                output.launcher(f"stopping the job (exit code {verdict.code})")
                blamed = verdict.blame[0] if len(verdict.blame) == 1 else None
                outcome = Outcome(
                    verdict.code, f"watchdog: {verdict.message}", restartable=True, detected=now, blamed=blamed
                )
                break
        if ended and now - min(w.ended for w in ended) > finish_timeout_s:
            done = min(ended, key=lambda w: w.ended)
            late = [w.worker_id for w in workers if w.ended is None]
            line = (
                f"worker(s) {late} still running {finish_timeout_s:g} s after worker {done.worker_id} "
                f"finished; they are stuck (e.g. waiting in a collective for a step the others did not run)"
            )
            output.launcher(line)
            _settle(workers, set())
            outcome = Outcome(1, line, restartable=True, detected=now)
            break
        if max_time_s is not None and now - job_start > max_time_s:
            output.launcher(f"the job ran longer than --max-time {max_time_s:g} s")
            _settle(workers, set())
            outcome = Outcome(124)
            break
        interrupt = _interrupt(interrupted, output)
        if interrupt is not None:
            _settle(workers, set())
            outcome = interrupt
            break
        elsewhere = stop_when(now) if stop_when is not None else None
        if elsewhere is not None:
            _settle(workers, set())
            outcome = elsewhere
            break
        time.sleep(EXIT_POLL_S)
    stop(workers, kill_grace_s, output)
    return outcome


def _settle(workers: list[Worker], blamed: set[int]) -> None:
    """The launcher has said why the job ends: the blamed workers' held errors now, the others' condensed later."""
    for w in workers:
        if w.log is not None:
            w.log.settle(w.worker_id in blamed)


def _close_logs(workers: list[Worker], blamed: int | None) -> None:
    """After a start ended: let the workers' output threads finish, then show or condense what their logs hold."""
    for w in workers:
        for t in w.threads:
            t.join(timeout=2.0)  # a grandchild may hold a pipe open: do not wait for it
    for w in workers:
        if w.log is not None:
            w.log.close(blamed=w.worker_id == blamed)


def launch(
    command: Sequence[str],
    *,
    num_workers: int | None = None,
    cores_per_worker: int | None | FromOptions = FROM_OPTIONS,
    coordinator: str | None = None,
    worker_id: int | None = None,
    start_timeout_s: float | FromOptions = FROM_OPTIONS,
    heartbeat_timeout_s: float | FromOptions = FROM_OPTIONS,
    shutdown_timeout_s: float | FromOptions = FROM_OPTIONS,
    kill_grace_s: float | FromOptions = FROM_OPTIONS,
    max_time_s: float | None | FromOptions = FROM_OPTIONS,
    step_timeout_s: float | None | FromOptions = FROM_OPTIONS,
    compile_timeout_s: float | FromOptions = FROM_OPTIONS,
    max_restarts: int | FromOptions = FROM_OPTIONS,
    min_workers: int | None | FromOptions = FROM_OPTIONS,
    failure_window_s: float | FromOptions = FROM_OPTIONS,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    interrupted: threading.Event | None = None,
    log_dir: str | os.PathLike | None | FromOptions = FROM_OPTIONS,
    show_runtime_logs: bool | FromOptions = FROM_OPTIONS,
    options: LaunchOptions | None = None,
) -> int:
    """Run ``command`` as the workers of a job; return the job's exit code.

    Modes: with ``worker_id`` one worker of a job spread over hosts (needs
    ``coordinator`` and ``num_workers``); with ``num_workers`` alone, all
    workers on this machine (the coordinator on ``127.0.0.1`` at a free port,
    or at ``coordinator``); with neither, under SLURM or Open MPI, one worker
    whose settings JAX reads from the cluster's environment.

    The options (timeouts, restarts, the watchdog, the logs) come from
    ``options`` (default :class:`~replicator.launch.options.LaunchOptions()`,
    the command line's defaults); each may be given as a keyword too, which
    overrides that field of ``options``. The rendezvous fields of ``options``
    are for jobs across hosts (:func:`~replicator.launch.hosts.run_host`) and
    not read here. For example, two workers on this machine, restarted up to
    3 times::

        code = launch([sys.executable, "train.py"], num_workers=2, options=LaunchOptions(max_restarts=3))
        code = launch([sys.executable, "train.py"], num_workers=2, max_restarts=3)  # the same

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
      max_restarts: when a worker fails (or the watchdog stops the job),
        stop the others and start every worker again, up to this many times
        (local jobs only); see :mod:`replicator.launch.restarts`.
      env: the base environment (default ``os.environ``).
      stdout, stderr: where the prefixed output goes (default ``sys``'s).
      interrupted: set it to stop the job (the CLI sets it on SIGINT/SIGTERM,
        and its ``signum`` attribute to the signal's number).
      log_dir: every worker's whole output goes to a file in a new directory
        under it (``worker-I.log``; ``worker-I.restart-R.log`` after a
        restart). Default: a new temporary directory, removed at the end
        unless the launcher named a file in it (everything else was shown).
      show_runtime_logs: show the runtime's chatter too (Gloo's connection
        lines; see :mod:`~replicator.launch.relay`); it is in the log files
        either way.
      min_workers, failure_window_s: restart on fewer workers when one keeps
        failing (see :class:`~replicator.launch.options.LaunchOptions`).
      options: the options (:class:`~replicator.launch.options.LaunchOptions`);
        the keywords above that are given override its fields.

    Returns:
      0 if every worker succeeded, else the first failed worker's exit code
      (``128 + signal`` if killed), 124 after ``max_time_s``, ``128 +
      interrupted.signum`` (130 without one) if interrupted, 1 if workers were
      still running ``2 * shutdown_timeout_s + kill_grace_s`` after one finished,
      76 when the watchdog stops a stalled job or a worker left it early, 75
      when a worker ended before joining. With ``max_restarts``, a job that
      failed more often than that ends with its last failure's code.

    Raises:
      LaunchError: on inconsistent arguments (the message says what to pass).
    """
    if not command:
        raise LaunchError("no command to run: give a script (train.py [args]) or a module (-m pkg.train [args]).")
    o = merge(
        options,
        cores_per_worker=cores_per_worker,
        start_timeout_s=start_timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
        shutdown_timeout_s=shutdown_timeout_s,
        kill_grace_s=kill_grace_s,
        max_time_s=max_time_s,
        step_timeout_s=step_timeout_s,
        compile_timeout_s=compile_timeout_s,
        max_restarts=max_restarts,
        min_workers=min_workers,
        failure_window_s=failure_window_s,
        log_dir=log_dir,
        show_runtime_logs=show_runtime_logs,
    )
    if num_workers is not None and num_workers < 1:
        raise LaunchError(f"--num-workers must be a positive int, got {num_workers!r}.")
    max_restarts, kill_grace_s = o.max_restarts, o.kill_grace_s
    if max_restarts and (worker_id is not None or num_workers is None):
        raise LaunchError(
            "--max-restarts restarts every worker of a job on this machine (--num-workers W without "
            "--worker-id). Across hosts the launchers agree on each restart through a rendezvous: run "
            "--nnodes N --rdzv-endpoint HOST:PORT --max-restarts R on each host instead of --coordinator/--worker-id."
        )
    shrinking = _shrinking(num_workers, worker_id, max_restarts, o.min_workers, o.failure_window_s)
    if coordinator is not None:
        host, sep, port = coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise LaunchError(f"--coordinator {coordinator!r} is not HOST:PORT, e.g. 10.0.0.1:29500.")

    base = dict(os.environ if env is None else env)
    plan = _plan(base, num_workers, coordinator, worker_id)
    settings = {
        "cores_per_worker": o.cores_per_worker,
        "start_timeout_s": o.start_timeout_s,
        "heartbeat_timeout_s": o.heartbeat_timeout_s,
        "shutdown_timeout_s": o.shutdown_timeout_s,
        "max_restarts": max_restarts,
        "initial_num_workers": num_workers,
    }
    output = Output(stdout or sys.stdout, stderr or sys.stderr)
    interrupted = interrupted or threading.Event()
    job_start = time.monotonic()
    every: list[Worker] = []  # of every start: whether a line named one of their log files
    recoveries: list[Recovery] = []
    logs = _log_directory(o.log_dir)
    status_root = tempfile.mkdtemp(prefix="replicator-launch-")  # private (mode 0700): the workers' status files
    try:
        while True:
            restart = len(recoveries)
            workers: list[Worker] = []
            try:
                _start_all(
                    workers, plan, command, base, settings, restart, status_root, output, logs, o.show_runtime_logs
                )
                every += workers
                outcome = supervise(
                    workers,
                    output,
                    kill_grace_s=kill_grace_s,
                    # JAX's shutdown barrier makes finishing workers wait for each other at most
                    # shutdown_timeout_s (then it aborts them): a worker running much longer is stuck.
                    finish_timeout_s=2 * o.shutdown_timeout_s + kill_grace_s,
                    max_time_s=o.max_time_s,
                    job_start=job_start,
                    step_timeout_s=o.step_timeout_s,
                    compile_timeout_s=o.compile_timeout_s,
                    interrupted=interrupted,
                    recovery=recoveries[-1] if recoveries else None,
                )
            except BaseException:
                stop(workers, kill_grace_s, output)
                _close_logs(workers, None)
                raise
            _close_logs(workers, outcome.blamed)
            if not outcome.code or not outcome.restartable or restart >= max_restarts:
                break
            stopped = time.monotonic()
            if shrinking is not None:
                line = shrinking.next_start(outcome, recoveries[-1].stopped if recoveries else None)
                if line:
                    output.launcher(line)
            size = num_workers if shrinking is None else shrinking.workers
            if coordinator is None:
                plan = _plan(base, size, None, None)  # a new port: nothing of the old job answers there
            elif len(plan) > 1:
                try:
                    _wait_until_free(coordinator, kill_grace_s + _PORT_WAIT_S)
                except LaunchError as e:  # the last failure stands
                    output.launcher(f"cannot restart: {e}")
                    break
                plan = [(i, coordinator, size) for i in range(size)]
            interrupt = _interrupt(interrupted, output)
            if interrupt is not None:
                outcome = interrupt
                break
            recovery = Recovery(restart + 1, outcome.cause, outcome.detected, stopped=stopped)
            output.launcher(
                f"restart {recovery.number} of at most {max_restarts} (the workers stopped "
                f"{stopped - outcome.detected:.1f} s after the failure), cause: {outcome.cause}"
            )
            recoveries.append(recovery)
    finally:
        shutil.rmtree(status_root, ignore_errors=True)
    _summary(outcome.code, workers, recoveries, output, num_workers)
    condensed = any(w.log is not None and w.log.condensed for w in every)
    if condensed or (outcome.code and o.log_dir is not None):
        output.launcher(f"every worker's whole output: {os.path.join(logs, 'worker-*.log')}")
    elif o.log_dir is None:  # nothing in it that was not shown
        shutil.rmtree(logs, ignore_errors=True)
    return outcome.code


def _log_directory(log_dir: str | os.PathLike | None) -> str:
    """A new directory for this job's log files: under ``log_dir``, else a temporary one."""
    try:
        if log_dir is None:
            return tempfile.mkdtemp(prefix="replicator-logs-")
        os.makedirs(log_dir, exist_ok=True)
        return tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=log_dir)
    except OSError as e:
        raise LaunchError(f"cannot create a directory for the workers' logs under --log-dir {log_dir}: {e}.") from None


_PORT_WAIT_S = 10.0  # how long a restart waits for a given coordinator port to be free again, after the grace


def _plan(
    base: dict[str, str], num_workers: int | None, coordinator: str | None, worker_id: int | None
) -> list[tuple[int, str | None, int | None]]:
    """The workers this launcher starts: ``(worker id, coordinator address, workers in the job)`` each."""
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
        return [(worker_id, coordinator, num_workers)]
    if num_workers is not None:
        if coordinator is not None and num_workers > 1:
            check_port_free(coordinator)
        address = coordinator or f"127.0.0.1:{free_port()}"
        return [(i, address, num_workers) for i in range(num_workers)]
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
    return [(rank if rank is not None else 0, None, None)]


def _shrinking(
    num_workers: int | None, worker_id: int | None, max_restarts: int, min_workers: int | None, window_s: float
) -> Shrinking | None:
    """``--min-workers`` and ``--failure-window`` (their values checked by LaunchOptions) against the job's shape.

    None: a job that is never restarted on fewer workers.
    """
    if min_workers is None:
        return None
    if num_workers is None or worker_id is not None:
        raise LaunchError(
            "--min-workers restarts a job on this machine on fewer workers (--num-workers W without --worker-id). "
            "Across hosts, --nnodes MIN:MAX --rdzv-endpoint HOST:PORT goes on without a lost host; a script "
            "with Trainer(..., resume_from=DIR) resumes from its checkpoints on any number of workers."
        )
    if min_workers > num_workers:
        raise LaunchError(f"--min-workers {min_workers} is more than the job's --num-workers {num_workers}.")
    if min_workers < num_workers and not max_restarts:
        raise LaunchError(
            f"--min-workers {min_workers} needs --max-restarts N: going on with fewer workers is a restart "
            f"(e.g. --max-restarts {num_workers - min_workers + 2})."
        )
    return Shrinking(num_workers, min_workers, window_s)


def _start_all(
    workers: list[Worker],
    plan: list[tuple[int, str | None, int | None]],
    command: Sequence[str],
    base: dict[str, str],
    settings: dict,
    restart: int,
    status_root: str,
    output: Output,
    logs: str,
    show_runtime_logs: bool,
) -> None:
    """Start the workers of ``plan`` (appended to ``workers`` one by one), with their own status directory.

    Each worker's output goes through a :class:`~replicator.launch.relay.WorkerLog` into ``logs``.
    """
    status_dir = os.path.join(status_root, f"start-{restart}")
    os.mkdir(status_dir, 0o700)

    def write(to_stderr: bool, text: str) -> None:
        output.write(output.stderr if to_stderr else output.stdout, text)

    for label, address, count in plan:
        progress_file = os.path.join(status_dir, f"progress-{label}.json")
        wenv = worker_env(
            base,
            coordinator=address,
            num_workers=count,
            worker_id=label if count is not None else None,
            status_dir=status_dir,
            progress_file=progress_file,
            restart_count=restart,
            **settings,
        )
        log = WorkerLog(label, write, log_path(logs, label, restart), show_runtime_logs=show_runtime_logs)
        workers.append(start(label, command, wenv, output, status_dir, progress_file, log))
    if len(plan) > 1 or restart:
        which = f"restart {restart}: " if restart else ""
        output.launcher(
            f"{which}started {len(plan)} worker{'s' if len(plan) > 1 else ''} (coordinator {plan[0][1]}): pids {[w.proc.pid for w in workers]}"
        )


def _wait_until_free(address: str, timeout_s: float) -> None:
    """Wait until worker 0 could open the coordinator's port again; raise LaunchError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check_port_free(address)
            return
        except LaunchError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _summary(code: int, workers: list[Worker], recoveries: list[Recovery], output: Output, initial: int | None) -> None:
    """The launcher's last line: how the job ended, after how many restarts, on how many workers."""
    restarts = f" after {len(recoveries)} restart(s)" if recoveries else ""
    if initial is not None and len(workers) < initial:
        restarts += f", on {len(workers)} of its {initial} workers"
    if code and len(workers) > 1:
        codes = {w.worker_id: w.proc.returncode for w in workers}
        output.launcher(f"job failed{restarts}, exit code {code} (workers' exit codes: {codes})")
    elif not code and recoveries:
        timed = any(r.seconds is not None for r in recoveries)  # workers not run through the bootstrap: none
        took = "; ".join(
            f"restart {r.number}: {r.seconds:.1f} s" if r.seconds is not None else f"restart {r.number}: no step"
            for r in recoveries
        )
        output.launcher(f"job finished{restarts}" + (f"; recovery (failure -> first step): {took}" if timed else ""))
