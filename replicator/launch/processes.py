"""The workers' processes: starting them, copying their output with prefixes, stopping them.

Each worker runs in its own process group, so that signalling it reaches what
it started; its output is copied line by line with a ``[worker I] `` prefix
(the launcher's own lines get ``[launcher] ``). Stopping is ``SIGTERM``, then
``SIGKILL`` after a grace period (JAX catches ``SIGTERM``), to each worker's whole
process group: what a worker started (a data loader, a compiler) goes with it, also
when the worker itself exited first (a failed worker's children would otherwise keep
cores, ports and devices into the next start).

Promises:

1. Every line a worker prints is copied whole, with its ``[worker I] ``
   prefix, stdout to stdout and stderr to stderr, whatever its line ending or
   bytes (tests/test_processes_promises.py::test_each_line_is_copied_whole_with_its_prefix,
   tests/test_launch.py::TestLocalJobs::test_output_is_prefixed_and_the_job_configured).
2. Stopping sends ``SIGTERM`` first and ``SIGKILL`` only after the grace
   (tests/test_processes_promises.py::test_sigterm_comes_first_and_sigkill_only_after_the_grace);
   a worker that ignores ``SIGTERM`` is killed
   (tests/test_launch.py::TestLocalJobs::test_sigterm_is_escalated_to_sigkill).
3. Workers that exit on ``SIGTERM`` are not waited for until the grace ends
   (tests/test_processes_promises.py::test_stop_does_not_wait_out_the_grace_for_workers_that_exit_on_sigterm).
4. Stopping reaches each worker's whole process group, also of a worker that
   already exited, and of a job that succeeded
   (tests/test_launch.py::test_stopping_a_job_stops_what_its_workers_started,
   tests/test_launch.py::test_a_job_that_succeeds_leaves_no_child_behind).
5. Stopping is bounded: a worker still not dead 10 s after ``SIGKILL`` is
   named and left (tests/test_processes_promises.py::test_stop_gives_up_on_a_worker_that_does_not_die_within_a_bound).
6. Signalling a worker that is gone is no error
   (tests/test_processes_promises.py::test_signalling_a_worker_that_is_gone_is_no_error),
   nor is the launcher's own output closed: the pipes are still drained
   (tests/test_processes_promises.py::test_the_launchers_output_closed_does_not_stop_the_copying).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from replicator.launch.relay import WorkerLog
from replicator.runtime.distributed import progress
from replicator.runtime.distributed.status import read_status

__all__ = ["DEFAULT_KILL_GRACE_S", "EXIT_POLL_S", "Output", "Worker", "signal_group", "start", "stop"]

DEFAULT_KILL_GRACE_S = 5.0
#: How often the launcher looks whether its workers exited: while it supervises them (a failure
#: is acted on within this), and while it waits for stopped ones to die.
EXIT_POLL_S = 0.05


@dataclasses.dataclass
class Worker:
    """One worker process of the job, as the launcher follows it."""

    worker_id: int
    proc: subprocess.Popen
    started: float
    threads: list[threading.Thread]  # output pumps
    status_dir: str
    progress_file: str
    ended: float | None = None  # when it exited (set by its waiter thread: exact, for ordering)
    log: WorkerLog | None = None  # where its output goes (None: copied as it is)
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


class Output:
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


def _pump(
    pipe: IO[bytes], prefix: str, output: Output, stream: IO[str], log: WorkerLog | None = None, stderr: bool = False
) -> None:
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        if log is not None:
            log.line(line, stderr=stderr)
        else:
            output.write(stream, f"{prefix}{line}\n")
    pipe.close()


def start(
    worker_id: int,
    command: Sequence[str],
    env: dict[str, str],
    output: Output,
    status_dir: str,
    progress_file: str,
    log: WorkerLog | None = None,
) -> Worker:
    """Start worker ``worker_id``'s process, the threads that copy its output, and one that notes its exit.

    With ``log`` its output goes through it (:class:`~replicator.launch.relay.WorkerLog`: chatter
    left out, errors held, a log file); else every line is copied with its prefix.
    """
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
        threading.Thread(target=_pump, args=(proc.stdout, prefix, output, output.stdout, log), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, prefix, output, output.stderr, log, True), daemon=True),
    ]
    for t in threads:
        t.start()
    worker = Worker(worker_id, proc, time.monotonic(), threads, status_dir, progress_file, log=log)

    def wait() -> None:
        proc.wait()
        worker.ended = time.monotonic()

    threading.Thread(target=wait, daemon=True).start()
    return worker


def signal_group(worker: Worker, sig: int) -> None:
    """Send ``sig`` to the worker's process group (nothing if it is gone)."""
    try:
        os.killpg(worker.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(workers: list[Worker], grace_s: float, output: Output) -> None:
    """SIGTERM every live worker's process group, SIGKILL the groups after ``grace_s`` (or once the workers exited).

    The groups of workers that already exited get SIGKILL at once: what such a worker
    started is left without it.
    """
    alive = [w for w in workers if w.ended is None]
    for w in workers:
        if w.ended is not None:
            signal_group(w, signal.SIGKILL)
    if not alive:
        return
    output.launcher(f"stopping worker(s) {[w.worker_id for w in alive]}: SIGTERM, then SIGKILL after {grace_s:g} s")
    for w in alive:
        signal_group(w, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(w.ended is None for w in alive):
        time.sleep(EXIT_POLL_S)
    for w in alive:  # also a worker that exited on SIGTERM: what it started may ignore SIGTERM
        signal_group(w, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(w.ended is None for w in alive):
        time.sleep(EXIT_POLL_S)
    for w in alive:
        if w.ended is None:  # unkillable (e.g. stuck in the kernel): stop waiting for it
            output.launcher(f"worker {w.worker_id} (pid {w.proc.pid}) did not die after SIGKILL; leaving it")
