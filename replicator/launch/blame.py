"""Which failed worker to blame, and the launcher's line about it.

When workers fail, most only echo a peer's failure (JAX aborts them, or a
collective breaks): :func:`blame_order` puts the worker that failed on its own
first, from the exit codes and the status files the workers wrote (see
:mod:`replicator.runtime.distributed.status`), and :func:`blame` says which
worker failed, how, and why, in one line.

Promises:

1. A worker killed by a signal is described by the signal's name and the
   shell's exit code ``128 + signal``; exit code 75 as giving up waiting for
   the others at start-up; any other code as itself
   (tests/test_blame_promises.py::test_an_exit_is_described_with_the_shells_exit_code).
2. A worker that only echoes a peer's failure (JAX's SIGABRT, a start-up
   timeout, an error of JAX's runtime) is blamed after every other failed
   worker (tests/test_launch.py::TestStatusFiles::test_blame_the_first_real_failure_not_its_echoes).
3. A worker killed from outside is blamed before its peers' runtime errors,
   even ones reported earlier
   (tests/test_launch.py::TestStatusFiles::test_a_killed_worker_is_blamed_before_its_peers_errors).
4. Among the rest, the worker whose status file claims the job's first
   failure is blamed (tests/test_launch.py::TestStatusFiles::test_the_first_reported_failure_wins).
5. Then the first to end, then the lowest worker id: the choice does not
   depend on the order of the workers
   (tests/test_blame_promises.py::test_among_equal_failures_the_first_to_end_then_the_lowest_id_is_blamed).
6. Only a worker that ended with a non-zero code is blamed, never one that
   succeeded or still runs; a blamed SIGABRT names the workers still running
   (tests/test_blame_promises.py::test_only_a_failed_worker_is_blamed_and_running_ones_are_named).
7. The reason in the line is the exception's type and the first line of its
   message, cut at 500 characters (then `` ...``); a worker without a status
   file has none (tests/test_blame_promises.py::test_the_error_summary_is_the_first_line_cut_at_500_characters),
   and its output is not read for one
   (tests/test_launch.py::TestLocalJobs::test_a_failure_without_a_report_is_not_read_from_the_log).
"""

from __future__ import annotations

import signal

from replicator.launch.processes import Worker
from replicator.runtime.distributed.startup import START_TIMEOUT_EXIT_CODE

__all__ = ["blame", "blame_order", "describe_exit", "error_summary", "exit_code"]

_SUMMARY_CHARS = 500  # of a worker's error message, in the launcher's line


def describe_exit(rc: int) -> str:
    """How a process ended, from its return code: ``failed with exit code 3``, ``was killed by SIGKILL ...``."""
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


def exit_code(rc: int) -> int:
    """A return code as a shell's exit code: ``128 + signal`` for a process killed by a signal."""
    return 128 - rc if rc < 0 else rc


def error_summary(worker: Worker) -> str | None:
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


def blame_order(worker: Worker) -> tuple:
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


def _exit_hint(worker: Worker) -> str:
    """What a worker's progress record says about how its script ended, for the launcher's line."""
    record = worker.progress
    if record is None or record["phase"] != "exited":
        return ""
    if not record.get("joined"):
        return " (its script exited before it joined the job, e.g. sys.exit() before initialize())"
    return f" (its script exited with this code after {record['steps_started']} step(s), e.g. through sys.exit)"


def blame(workers: list[Worker]) -> tuple[Worker, str]:
    """The failed worker to blame (at least one has failed), and the launcher's line about it."""
    failed = [w for w in workers if w.ended is not None and w.returncode != 0]
    first = min(failed, key=blame_order)
    summary = error_summary(first)
    running = [w.worker_id for w in workers if w.ended is None]
    hint = ""
    if first.returncode == -signal.SIGABRT and running:
        hint = f" (still running, maybe hung: worker(s) {running})"
    elif 0 < first.returncode != START_TIMEOUT_EXIT_CODE and first.status is None:
        hint = _exit_hint(first) or " (no error report: it failed before initialize(); see its output)"
    line = (
        f"worker {first.worker_id} {describe_exit(first.returncode)} after {first.ended - first.started:.1f} s"
        + hint
        + (f": {summary}" if summary else "")
    )
    return first, line
