"""One launcher per host, agreeing through the rendezvous (:mod:`~replicator.launch.membership`): :func:`run_host`.

What ``python -m replicator.launch --nnodes N|MIN:MAX --rdzv-endpoint HOST:PORT``
runs on each host. Each round of the rendezvous starts this host's
``nproc_per_host`` workers as workers ``host_rank * nproc_per_host + i`` of
``num_hosts * nproc_per_host``, at the round's coordinator (host rank 0's
address: its first worker hosts JAX's coordination service), with the round
number as ``REPLICATOR_RESTART_COUNT``. They are supervised by
:func:`~replicator.launch.supervise.supervise`, as a job on one machine is
(blame, the watchdog, held error reports, ``--log-dir``, ``--max-time``,
signals, recovery lines), with the rendezvous read every heartbeat interval as
one more reason to stop them (:class:`_Watch`):

* a worker of this host failed (or the watchdog stopped them): a restart
  (:meth:`~replicator.launch.membership.Rendezvous.next_round`) while the rounds
  so far are at most ``max_restarts``, else the job ends with that exit code, for
  every host;
* another launcher started a restart: stop the workers, join the new round;
* a host of the round is gone: with fewer hosts allowed (``min_hosts`` below the
  round's size) a restart without it, else the job ends with
  :data:`HOST_LOST_EXIT_CODE`, naming the host;
* the rendezvous is lost: the same code, naming it;
* ``--max-time`` or a signal to this launcher: the job ends for every host with
  that code (124, ``128 + signal``);
* every host's workers finished: exit 0.

A launcher that comes while a round runs (a host back after it was lost, or a
late one under ``MIN:MAX``) waits outside it and joins the round of the next
restart; if none comes within the join timeout it ends alone
(:data:`HOST_LOST_EXIT_CODE`), the job untouched.

Promises:

1. A worker's failure on one host restarts the workers of every host, each
   start with the round number in ``REPLICATOR_RESTART_COUNT`` and the job's
   worker count in ``REPLICATOR_NUM_WORKERS``, and a job whose hosts' workers
   all finish ends with 0 on every host, and not before the last host's finish
   (tests/test_rendezvous.py::test_a_worker_failure_on_one_host_restarts_every_host,
   tests/test_hosts.py::test_a_worker_killed_on_host_1_restarts_every_host_and_the_job_ends_as_if_uninterrupted,
   tests/test_hosts_promises.py::test_a_round_is_done_only_when_every_host_has_finished).
2. Restarts are counted exactly: rounds ``1 .. max_restarts`` are restarts,
   and a failure in round ``max_restarts`` ends the job with that failure's
   code for every host
   (tests/test_hosts_promises.py::test_a_failure_is_restarted_exactly_max_restarts_times_then_ends_the_job_with_its_code,
   tests/test_rendezvous.py::test_a_failure_after_the_last_restart_ends_every_host_with_its_code).
3. A round that another launcher restarted stops this host's workers as a
   failure, never as a job that finished
   (tests/test_rendezvous.py::test_a_round_started_elsewhere_stops_this_hosts_workers_as_a_failure).
4. A host that is gone, or the rendezvous lost, stops the round with
   :data:`HOST_LOST_EXIT_CODE`, naming it
   (tests/test_hosts_promises.py::test_a_round_is_stopped_by_a_gone_host_a_lost_rendezvous_or_the_jobs_end);
   the job goes on without the host while at least ``min_hosts`` are left,
   else ends (tests/test_hosts_promises.py::test_a_lost_host_restarts_the_job_while_enough_are_left_else_ends_it_with_77,
   tests/test_hosts.py::test_a_lost_host_under_min_max_and_the_job_finishes_on_the_other),
   within the detection bound
   (tests/test_rendezvous.py::test_a_sigkilled_host_launcher,
   tests/test_rendezvous.py::test_a_sigkilled_rendezvous_host_ends_the_other_hosts_within_the_bound).
5. ``--max-time`` or a signal to a launcher ends the job for every host with
   its code, saying which
   (tests/test_rendezvous.py::test_a_round_not_to_restart_ends_the_job_for_every_host_saying_why).
6. A host slower to stop its workers than the last call is waited for, not
   dropped (tests/test_rendezvous.py::test_a_host_slower_to_stop_than_the_last_call_is_waited_for_not_dropped).
7. A launcher that comes while a round runs joins at the next restart
   (tests/test_launch_cli.py::TestAcrossHosts::test_a_host_that_comes_back_joins_at_the_restart_after);
   with none within the join timeout it ends alone, the job untouched
   (tests/test_launch_cli.py::TestAcrossHosts::test_a_host_that_waits_in_vain_for_a_restart_leaves_the_running_job_alone);
   one that comes after the end is told
   (tests/test_rendezvous.py::test_a_launcher_that_comes_after_the_end_is_told).
8. The rendezvous is read at most once per heartbeat interval
   (tests/test_hosts_promises.py::test_the_rendezvous_is_read_at_most_once_per_heartbeat_interval);
   the job's end reads back as its code and reason, and anything else in the
   store as a failure (code 1), never an exception
   (tests/test_hosts_promises.py::test_the_jobs_end_reads_back_as_written_and_anything_else_as_a_failure).
9. Bad settings are refused before the rendezvous is reached
   (tests/test_launch_cli.py::TestAcrossHosts::test_settings_are_checked_before_the_rendezvous).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

from replicator.launch.environment import LaunchError
from replicator.launch.membership import Assignment, LeftOut, Rendezvous
from replicator.launch.options import FROM_OPTIONS, FromOptions, LaunchOptions, merge
from replicator.launch.processes import EXIT_POLL_S, Output, Worker, stop
from replicator.launch.rendezvous import RendezvousError, StoreServer
from replicator.launch.restarts import Outcome, Recovery
from replicator.launch.supervise import _close_logs, _log_directory, _start_all, _summary, supervise

__all__ = ["HOST_LOST_EXIT_CODE", "run_host"]

#: The exit code of a launcher whose job ended because a host, or the rendezvous, was lost.
HOST_LOST_EXIT_CODE = 77


def _end(rdzv: Rendezvous, code: int, reason: str) -> tuple[int, str]:
    """Record the job's end (the first one recorded stands); its code and reason."""
    try:
        return _ended(rdzv.end(json.dumps({"code": code, "reason": reason})))
    except RendezvousError:
        return code, reason


def _say_end(rdzv: Rendezvous, output: Output, code: int, reason: str) -> int:
    """End the job for every host (unless another host did first), say why; the job's exit code."""
    code, reason = _end(rdzv, code, reason)
    output.launcher(f"the job ended: {reason}")
    return code


def _ended(value: str) -> tuple[int, str]:
    try:
        first = json.loads(value)
        return int(first["code"]), str(first["reason"])
    except (ValueError, KeyError, TypeError):
        return 1, value


class _Watch:
    """The rendezvous as seen from one round, read every heartbeat interval: :func:`supervise`'s ``stop_when``.

    :attr:`event` says what stopped the round: ``("lost" | "ended" | "restart" | "gone" | "done", code, line)``.
    """

    def __init__(self, rdzv: Rendezvous, a: Assignment, output: Output, done_key: str | None = None) -> None:
        self.rdzv, self.a, self.output, self.done_key = rdzv, a, output, done_key
        self.event: tuple[str, int, str] | None = None
        self.detected = 0.0
        self.next_poll = 0.0
        self.gone = 0  # hosts of the round seen gone
        self.newest = a.round  # the newest round seen

    def __call__(self, now: float) -> Outcome | None:
        if now < self.next_poll:
            return None
        self.next_poll = now + self.rdzv.heartbeat_interval_s
        event = self.look()
        if event is None:
            return None
        self.event, self.detected = event, now
        self.output.launcher(event[2])
        return Outcome(event[1], event[2], detected=now)

    def look(self) -> tuple[str, int, str] | None:
        rdzv, a = self.rdzv, self.a
        try:
            status = rdzv.poll()
            done = int(rdzv.client.get(self.done_key) or 0) if self.done_key else 0
        except (RendezvousError, ValueError) as e:
            return "lost", HOST_LOST_EXIT_CODE, f"rendezvous lost: {e}"
        if status.ended is not None:
            code, reason = _ended(status.ended)
            return "ended", code, reason if code == 0 else f"the job ended: {reason}"
        if self.done_key and done >= a.num_hosts:
            return "done", 0, f"every host's workers finished (round {a.round})"
        self.newest, self.gone = status.round, len(status.gone)
        if status.round != a.round:
            return "restart", 1, f"round {status.round} was started by another host: stopping this host's workers"
        if status.gone:
            names = ", ".join(
                f"host rank {rank} (launcher {lid}, silent for {age:.1f} s)" for lid, rank, age in status.gone
            )
            return "gone", HOST_LOST_EXIT_CODE, f"{names} gone (no heartbeat for over {rdzv.gone_after_s:g} s)"
        return None


def run_host(
    command: Sequence[str],
    rdzv: Rendezvous,
    *,
    nproc_per_host: int = 1,
    max_restarts: int | FromOptions = FROM_OPTIONS,
    cores_per_worker: int | None | FromOptions = FROM_OPTIONS,
    start_timeout_s: float | FromOptions = FROM_OPTIONS,
    heartbeat_timeout_s: float | FromOptions = FROM_OPTIONS,
    shutdown_timeout_s: float | FromOptions = FROM_OPTIONS,
    kill_grace_s: float | FromOptions = FROM_OPTIONS,
    max_time_s: float | None | FromOptions = FROM_OPTIONS,
    step_timeout_s: float | None | FromOptions = FROM_OPTIONS,
    compile_timeout_s: float | FromOptions = FROM_OPTIONS,
    interrupted: threading.Event | None = None,
    log_dir: str | os.PathLike | None | FromOptions = FROM_OPTIONS,
    show_runtime_logs: bool | FromOptions = FROM_OPTIONS,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    store: StoreServer | None = None,
    options: LaunchOptions | None = None,
) -> int:
    """Run this host's workers through the rounds of ``rdzv`` (started); the job's exit code.

    The options come from ``options`` (default
    :class:`~replicator.launch.options.LaunchOptions()`), each keyword given
    overriding its field, as for :func:`~replicator.launch.supervise.launch`;
    the rendezvous's timing is ``rdzv``'s, made with the same options'
    (:meth:`~replicator.launch.options.LaunchOptions.rendezvous_timing`).
    For example, on each host (a secret is needed beyond loopback)::

        options = LaunchOptions(max_restarts=3, rdzv_heartbeat_s=0.5)
        rdzv = Rendezvous("10.0.0.1:29400", min_hosts=2, secret=secret, **options.rendezvous_timing())
        rdzv.start()
        code = run_host([sys.executable, "train.py"], rdzv, options=options)

    Args:
      command: the worker's command line (see :func:`~replicator.launch.environment.worker_command`).
      rdzv: this launcher's :class:`~replicator.launch.membership.Rendezvous`, started.
      nproc_per_host: workers on this host (``--nproc-per-node``), the same on every host.
      max_restarts: how many restarts (rounds after the first) the job may have.
      cores_per_worker, start_timeout_s, heartbeat_timeout_s, shutdown_timeout_s, kill_grace_s, max_time_s,
        step_timeout_s, compile_timeout_s, interrupted, log_dir, show_runtime_logs, env, stdout, stderr: as for
        :func:`~replicator.launch.supervise.launch`.
      store: the rendezvous store, when this launcher hosts it: before returning, it waits (at most
        ``rdzv.detection_bound_s``) for the other launchers to leave, so that they read how the job ended.
      options: the options (:class:`~replicator.launch.options.LaunchOptions`); its ``min_workers`` must be
        None (across hosts, ``--nnodes MIN:MAX`` goes on with fewer hosts).

    Returns:
      0 when every host's workers finished; the failed worker's exit code when no restart was left;
      :data:`HOST_LOST_EXIT_CODE` (77) when a host (without ``MIN:MAX`` room) or the rendezvous was lost, and
      for this launcher alone when it came while a round ran without it and no restart let it in within
      ``rdzv.join_timeout_s`` (the job goes on);
      124 after ``max_time_s``; ``128 + signal`` when a launcher was interrupted; 1 when a host's workers
      were still running long after another's finished.

    Raises:
      LaunchError: on a bad option (the message says what to pass).
    """
    o = merge(
        options,
        max_restarts=max_restarts,
        cores_per_worker=cores_per_worker,
        start_timeout_s=start_timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
        shutdown_timeout_s=shutdown_timeout_s,
        kill_grace_s=kill_grace_s,
        max_time_s=max_time_s,
        step_timeout_s=step_timeout_s,
        compile_timeout_s=compile_timeout_s,
        log_dir=log_dir,
        show_runtime_logs=show_runtime_logs,
    )
    if isinstance(nproc_per_host, bool) or not isinstance(nproc_per_host, int) or nproc_per_host < 1:
        raise LaunchError(f"--nproc-per-node must be an int >= 1, got {nproc_per_host!r}.")
    if o.min_workers is not None:
        raise LaunchError(
            f"--min-workers {o.min_workers} does not go with a job across hosts; pass --nnodes MIN:MAX (the "
            "fewest hosts to go on with) to the Rendezvous instead (min_hosts=)."
        )
    max_restarts, kill_grace_s, max_time_s, log_dir = o.max_restarts, o.kill_grace_s, o.max_time_s, o.log_dir
    shutdown_timeout_s = o.shutdown_timeout_s
    output = Output(stdout or sys.stdout, stderr or sys.stderr)
    base = dict(os.environ if env is None else env)
    interrupted = interrupted or threading.Event()
    job_start = time.monotonic()
    finish_timeout_s = 2 * shutdown_timeout_s + kill_grace_s
    logs = _log_directory(log_dir)
    status_root = tempfile.mkdtemp(prefix="replicator-host-")  # private (mode 0700): the workers' status files
    every: list[Worker] = []
    workers: list[Worker] = []
    recoveries: list[Recovery] = []
    pending: Recovery | None = None  # the restart the next round recovers from
    initial: int | None = None
    code = HOST_LOST_EXIT_CODE
    try:
        while True:
            try:
                a = rdzv.join(stop=interrupted)
            except RendezvousError as e:
                if interrupted.is_set():
                    signum = getattr(interrupted, "signum", 2)
                    code = _say_end(rdzv, output, 128 + signum, f"a launcher was interrupted while joining ({e})")
                    break
                ended = _ended_now(rdzv)
                outside = _running_without(rdzv)
                if isinstance(e, LeftOut):  # dropped from the job: never a success, whatever the others did
                    output.launcher(f"{e} (exit code {HOST_LOST_EXIT_CODE})")
                    code = HOST_LOST_EXIT_CODE
                elif ended is not None:
                    output.launcher(f"the job ended: {ended[1]}")
                    code = ended[0]
                elif outside is not None:  # the job runs on: this launcher leaves it alone
                    output.launcher(
                        f"this host was not taken into the job: round {outside[0]} runs on {outside[1]} host(s) "
                        f"without this one and no restart came within --rdzv-join-timeout ({rdzv.join_timeout_s:g} s); "
                        f"the job goes on; to join it at its next restart, start this launcher again or give a "
                        f"longer --rdzv-join-timeout (exit code {HOST_LOST_EXIT_CODE})"
                    )
                    code = HOST_LOST_EXIT_CODE
                else:
                    code = _say_end(rdzv, output, HOST_LOST_EXIT_CODE, f"rendezvous: {e}")
                break
            initial = a.num_hosts if initial is None else initial
            output.launcher(
                f"round {a.round}: host rank {a.host_rank} of {a.num_hosts} (coordinator {a.coordinator}, "
                f"launchers {list(a.members)})"
            )
            for lid, rank in a.left:
                output.launcher(
                    f"host rank {rank} left the job at round {a.round}: it still heartbeats but did not rejoin within "
                    f"{rdzv.rejoin_timeout_s:g} s (launcher {lid}); going on with {a.num_hosts} of {a.previous_hosts} "
                    "hosts"
                )
            for lid, rank in a.lost:
                output.launcher(
                    f"host rank {rank} lost (launcher {lid}); going on with {a.num_hosts} of {a.previous_hosts} hosts"
                )
            if pending is not None:
                recoveries.append(pending)
            plan = [
                (a.host_rank * nproc_per_host + i, a.coordinator, a.num_hosts * nproc_per_host)
                for i in range(nproc_per_host)
            ]
            settings = {
                "cores_per_worker": o.cores_per_worker,
                "start_timeout_s": o.start_timeout_s,
                "heartbeat_timeout_s": o.heartbeat_timeout_s,
                "shutdown_timeout_s": shutdown_timeout_s,
                "max_restarts": max_restarts,
                "initial_num_workers": initial * nproc_per_host,
            }
            watch = _Watch(rdzv, a, output)
            workers = []
            try:
                _start_all(
                    workers, plan, command, base, settings, a.round, status_root, output, logs, o.show_runtime_logs
                )
                every += workers
                outcome = supervise(
                    workers,
                    output,
                    kill_grace_s=kill_grace_s,
                    finish_timeout_s=finish_timeout_s,
                    max_time_s=max_time_s,
                    job_start=job_start,
                    step_timeout_s=o.step_timeout_s,
                    compile_timeout_s=o.compile_timeout_s,
                    interrupted=interrupted,
                    recovery=pending,
                    stop_when=watch,
                )
            except BaseException:  # an interrupt, or a bug here: the workers do not outlive their watch
                stop(workers, kill_grace_s, output)
                _close_logs(workers, None)
                raise
            _close_logs(workers, outcome.blamed)
            pending = None
            if watch.event is None and outcome.code == 0:  # this host's workers finished: wait for the others'
                watch = _Watch(rdzv, a, output, done_key=f"hosts/done/{a.round}")
                outcome = _finished(rdzv, watch, output, finish_timeout_s)
            result = _next(rdzv, a, watch, outcome, output, max_restarts)
            if isinstance(result, int):
                code = result
                break
            pending = result
    finally:
        shutil.rmtree(status_root, ignore_errors=True)
        if store is not None:
            _linger(rdzv)
    _summary(code, workers, recoveries, output, None)
    condensed = any(w.log is not None and w.log.condensed for w in every)
    if condensed or (code and log_dir is not None):
        output.launcher(f"every worker's whole output: {os.path.join(logs, 'worker-*.log')}")
    elif log_dir is None:  # nothing in it that was not shown
        shutil.rmtree(logs, ignore_errors=True)
    return code


def _finished(rdzv: Rendezvous, watch: _Watch, output: Output, finish_timeout_s: float) -> Outcome:
    """This host's workers finished: count it in the store, then watch until every host's did (or another event)."""
    a = watch.a
    assert watch.done_key is not None
    finished_at = time.monotonic()
    try:
        rdzv.client.add(watch.done_key)
    except RendezvousError as e:
        watch.event = ("lost", HOST_LOST_EXIT_CODE, f"rendezvous lost: {e}")
        output.launcher(watch.event[2])
        return Outcome(HOST_LOST_EXIT_CODE, watch.event[2], detected=finished_at)
    while True:
        now = time.monotonic()
        outcome = watch(now)
        if outcome is not None:
            return outcome
        if now - finished_at > finish_timeout_s:
            line = f"only some of the {a.num_hosts} hosts' workers finished {now - finished_at:.0f} s after this host's"
            watch.event = ("stuck", 1, line)
            output.launcher(line)
            return Outcome(1, line, restartable=True, detected=now)
        time.sleep(EXIT_POLL_S)


def _next(
    rdzv: Rendezvous, a: Assignment, watch: _Watch, outcome: Outcome, output: Output, max_restarts: int
) -> int | Recovery:
    """After a round: the job's exit code, or the restart (a :class:`Recovery` to time) that the next round is."""
    stopped = time.monotonic()
    kind = watch.event[0] if watch.event is not None else None
    if kind == "done":
        _end(rdzv, 0, watch.event[2])  # for hosts still waiting to join
        return 0
    if kind in ("lost", "ended"):
        return outcome.code
    if kind == "restart":
        return Recovery(watch.newest, watch.event[2], watch.detected, stopped=stopped)
    if kind == "gone":
        if a.num_hosts - watch.gone < rdzv.min_hosts:
            return _say_end(
                rdzv, output, HOST_LOST_EXIT_CODE, f"{outcome.cause}; at least {rdzv.min_hosts} hosts needed"
            )
        cause = outcome.cause
    elif not outcome.restartable:  # --max-time, or this launcher was interrupted: the job ends everywhere
        why = "--max-time ran out" if outcome.code == 124 else f"host rank {a.host_rank}'s launcher was interrupted"
        return _say_end(rdzv, output, outcome.code, f"{why} (exit code {outcome.code})")
    else:
        cause = f"host rank {a.host_rank}: {outcome.cause}"
    if a.round >= max_restarts:
        return _say_end(rdzv, output, outcome.code, f"{cause}; no restart left (--max-restarts {max_restarts})")
    try:
        new = rdzv.next_round(a.round, cause)
    except RendezvousError as e:
        output.launcher(f"rendezvous lost: {e}")
        return HOST_LOST_EXIT_CODE
    if rdzv.restarted_here:
        output.launcher(f"restart {new} of at most {max_restarts}, cause: {cause}")
    else:
        output.launcher(f"round {new} was started by another host")
    return Recovery(new, cause, outcome.detected or stopped, stopped=stopped)


def _linger(rdzv: Rendezvous) -> None:
    """Wait until no other launcher is connected (each leaves when it ends), at most ``rdzv.detection_bound_s``."""
    deadline = time.monotonic() + rdzv.detection_bound_s
    while time.monotonic() < deadline:
        try:
            others = [m for m, age in rdzv.client.members().items() if m != rdzv.id and age <= rdzv.gone_after_s]
        except RendezvousError:
            return
        if not others:
            return
        time.sleep(EXIT_POLL_S)


def _running_without(rdzv: Rendezvous) -> tuple[int, int] | None:
    """``(round, hosts)`` when a closed round runs without this launcher (it came late, or back), else None."""
    try:
        status = rdzv.poll()
        _, state = rdzv._state()
    except RendezvousError:
        return None
    if status.closed and status.ended is None and rdzv.id not in state["ranks"]:
        return status.round, len(state["ranks"])
    return None


def _ended_now(rdzv: Rendezvous) -> tuple[int, str] | None:
    try:
        status = rdzv.poll()
    except RendezvousError:
        return None
    return None if status.ended is None else _ended(status.ended)
