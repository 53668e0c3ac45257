"""One launcher per host, agreeing through the rendezvous (:mod:`~replicator.launch.membership`): :func:`run_host`.

A prototype of the loop that ``--nnodes`` will run (the command line does not
reach it yet): each round of the rendezvous starts this host's worker as
worker ``host_rank`` of ``num_hosts``, with the round's coordinator and the
round number as ``REPLICATOR_RESTART_COUNT``; then it watches both the worker
and the rendezvous, every heartbeat interval:

* the worker failed: a restart (:meth:`~replicator.launch.membership.Rendezvous.next_round`)
  while the rounds so far are at most ``max_restarts``, else the job ends with
  the worker's exit code, for every host;
* another launcher started a restart: stop the worker, join the new round;
* a host of the round is gone: with fewer hosts allowed (``min_hosts`` below
  the round's size) a restart without it, else the job ends with
  :data:`HOST_LOST_EXIT_CODE`, naming the host;
* the rendezvous is lost: the same code, naming it;
* every host's worker finished: exit 0.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import IO

from replicator.launch.blame import exit_code
from replicator.launch.environment import worker_env
from replicator.launch.membership import Assignment, Rendezvous
from replicator.launch.processes import DEFAULT_KILL_GRACE_S, EXIT_POLL_S, Output, Worker, start, stop
from replicator.launch.rendezvous import RendezvousError, StoreServer
from replicator.runtime.distributed.startup import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
)

__all__ = ["HOST_LOST_EXIT_CODE", "run_host"]

#: The exit code of a launcher whose job ended because a host, or the rendezvous, was lost.
HOST_LOST_EXIT_CODE = 77


def _end(rdzv: Rendezvous, code: int, reason: str) -> tuple[int, str]:
    """Record the job's end (the first one recorded stands); its code and reason."""
    try:
        first = json.loads(rdzv.end(json.dumps({"code": code, "reason": reason})))
        return int(first["code"]), str(first["reason"])
    except (RendezvousError, ValueError, KeyError, TypeError):
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


def run_host(
    command: Sequence[str],
    rdzv: Rendezvous,
    *,
    max_restarts: int = 0,
    cores_per_worker: int | None = None,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    kill_grace_s: float = DEFAULT_KILL_GRACE_S,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    store: StoreServer | None = None,
) -> int:
    """Run this host's worker through the rounds of ``rdzv`` (started); the job's exit code.

    Args:
      command: the worker's command line (see :func:`~replicator.launch.environment.worker_command`).
      rdzv: this launcher's :class:`~replicator.launch.membership.Rendezvous`, started.
      max_restarts: how many restarts (rounds after the first) the job may have.
      cores_per_worker, start_timeout_s, heartbeat_timeout_s, shutdown_timeout_s: as for
        :func:`~replicator.launch.supervise.launch`.
      kill_grace_s: between SIGTERM and SIGKILL when the worker is stopped.
      store: the rendezvous store, when this launcher hosts it: before returning, it waits (at most
        ``rdzv.detection_bound_s``) for the other launchers to leave, so that they read how the job ended.
    """
    output = Output(stdout or sys.stdout, stderr or sys.stderr)
    base = dict(os.environ if env is None else env)
    status_root = tempfile.mkdtemp(prefix="replicator-host-")
    settings = {
        "cores_per_worker": cores_per_worker,
        "start_timeout_s": start_timeout_s,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "shutdown_timeout_s": shutdown_timeout_s,
    }
    initial: int | None = None
    try:
        while True:
            try:
                a = rdzv.join()
            except RendezvousError as e:
                ended = _ended_now(rdzv)
                if ended is not None:
                    output.launcher(f"the job ended: {ended[1]}")
                    return ended[0]
                return _say_end(rdzv, output, HOST_LOST_EXIT_CODE, f"rendezvous: {e}")
            initial = a.num_hosts if initial is None else initial
            output.launcher(
                f"round {a.round}: host rank {a.host_rank} of {a.num_hosts} (coordinator {a.coordinator}, "
                f"launchers {list(a.members)})"
            )
            worker = _start(command, a, base, status_root, output, initial, max_restarts, settings)
            try:
                code = _watch(worker, a, rdzv, output, max_restarts, kill_grace_s, shutdown_timeout_s)
            except BaseException:  # an interrupt, or a bug here: the worker does not outlive its watch
                stop([worker], kill_grace_s, output)
                raise
            if code is not None:
                return code
    finally:
        shutil.rmtree(status_root, ignore_errors=True)
        if store is not None:
            _linger(rdzv)


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


def _ended_now(rdzv: Rendezvous) -> tuple[int, str] | None:
    try:
        status = rdzv.poll()
    except RendezvousError:
        return None
    return None if status.ended is None else _ended(status.ended)


def _start(
    command: Sequence[str],
    a: Assignment,
    base: dict[str, str],
    status_root: str,
    output: Output,
    initial: int,
    max_restarts: int,
    settings: dict,
) -> Worker:
    status_dir = os.path.join(status_root, f"round-{a.round}")
    os.mkdir(status_dir, 0o700)
    progress_file = os.path.join(status_dir, f"progress-{a.host_rank}.json")
    wenv = worker_env(
        base,
        coordinator=a.coordinator,
        num_workers=a.num_hosts,
        worker_id=a.host_rank,
        **settings,
        status_dir=status_dir,
        progress_file=progress_file,
        restart_count=a.round,
        max_restarts=max_restarts,
        initial_num_workers=initial,
    )
    return start(a.host_rank, command, wenv, output, status_dir, progress_file)


def _watch(
    worker: Worker,
    a: Assignment,
    rdzv: Rendezvous,
    output: Output,
    max_restarts: int,
    kill_grace_s: float,
    shutdown_timeout_s: float,
) -> int | None:
    """Watch this host's worker and the rendezvous until the round ends: the job's exit code, or None to go on."""
    done_key = f"hosts/done/{a.round}"
    finished_at: float | None = None
    next_poll = 0.0
    while True:
        now = time.monotonic()
        if worker.ended is not None and worker.returncode != 0:
            code = exit_code(worker.returncode)
            cause = f"host rank {a.host_rank}'s worker failed with exit code {code}"
            output.launcher(cause)
            stop([worker], kill_grace_s, output)
            return _after_failure(rdzv, a, output, max_restarts, cause, code)
        if worker.ended is not None and finished_at is None:
            finished_at = now
            try:
                rdzv.client.add(done_key)
            except RendezvousError as e:
                output.launcher(f"rendezvous: {e}")
                return HOST_LOST_EXIT_CODE
        if now >= next_poll:
            next_poll = now + rdzv.heartbeat_interval_s
            try:
                status = rdzv.poll()
                done = int(rdzv.client.get(done_key) or 0)
            except RendezvousError as e:
                stop([worker], kill_grace_s, output)
                output.launcher(f"rendezvous lost: {e}")
                return HOST_LOST_EXIT_CODE
            if status.ended is not None:
                stop([worker], kill_grace_s, output)
                code, reason = _ended(status.ended)
                output.launcher(f"the job ended: {reason}")
                return code
            if done >= a.num_hosts:
                output.launcher(f"every host's worker finished (round {a.round})")
                _end(rdzv, 0, f"every host's worker finished (round {a.round})")  # for hosts waiting to join
                return 0
            if status.round != a.round:
                output.launcher(f"round {status.round} was started by another host: stopping this host's worker")
                stop([worker], kill_grace_s, output)
                return None
            if status.gone:
                names = ", ".join(
                    f"host rank {rank} (launcher {lid}, silent for {age:.1f} s)" for lid, rank, age in status.gone
                )
                cause = f"{names} gone (no heartbeat for over {rdzv.gone_after_s:g} s)"
                output.launcher(cause)
                stop([worker], kill_grace_s, output)
                if a.num_hosts - len(status.gone) < rdzv.min_hosts:
                    return _say_end(
                        rdzv, output, HOST_LOST_EXIT_CODE, f"{cause}; at least {rdzv.min_hosts} hosts needed"
                    )
                return _after_failure(rdzv, a, output, max_restarts, cause, HOST_LOST_EXIT_CODE)
            if finished_at is not None and now - finished_at > 2 * shutdown_timeout_s + kill_grace_s:
                line = f"only {done} of {a.num_hosts} hosts' workers finished {now - finished_at:.0f} s after this one"
                return _say_end(rdzv, output, 1, line)
        time.sleep(EXIT_POLL_S)


def _after_failure(
    rdzv: Rendezvous, a: Assignment, output: Output, max_restarts: int, cause: str, code: int
) -> int | None:
    """A restart if one is left (None: go on), else the job's end for every host (its code)."""
    if a.round >= max_restarts:
        return _say_end(rdzv, output, code, f"{cause}; no restart left (--max-restarts {max_restarts})")
    try:
        new = rdzv.next_round(a.round, cause)
    except RendezvousError as e:
        output.launcher(f"rendezvous lost: {e}")
        return HOST_LOST_EXIT_CODE
    output.launcher(f"restart {new} of at most {max_restarts}, cause: {cause}")
    return None
