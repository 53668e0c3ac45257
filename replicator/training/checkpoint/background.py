"""A checkpoint save running in a background thread: started once, waited for with a bound.

Promises:

1. The work runs in a new thread named ``replicator-checkpoint-<step>``, not a daemon, so an interpreter that
   exits without waiting still lets it finish
   (tests/test_checkpoint.py::test_join_returns_what_the_work_raised_even_a_base_exception).
2. :meth:`BackgroundSave.join` returns what the work raised, any ``BaseException``, or None; it never raises it
   (tests/test_checkpoint.py::test_join_returns_what_the_work_raised_even_a_base_exception,
   tests/test_checkpoint_async.py::test_a_failed_async_save_raises_at_the_next_save_and_leaves_the_earlier_ones).
3. :meth:`BackgroundSave.join` waits at most ``timeout_s``, then returns a CheckpointError saying the save is still
   writing, and leaves the thread running
   (tests/test_checkpoint.py::test_join_gives_up_on_a_stuck_save_after_its_timeout_not_a_second_later).
4. Waiting in :meth:`BackgroundSave.join` counts as progress of the waiting thread; the background thread's own
   writes never count (tests/test_checkpoint.py::test_waiting_for_a_background_save_counts_as_progress_of_the_waiting_thread,
   tests/test_checkpoint.py::test_a_background_save_never_counts_as_progress_of_the_training_thread).
5. :func:`lower_thread_priority` raises the niceness of the calling thread only, to at most 19 (Linux)
   (tests/test_checkpoint_async.py::test_writer_nice_lowers_the_priority_of_the_writer_thread_only).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from replicator.runtime.distributed import progress
from replicator.training.checkpoint.encoding import CheckpointError

__all__ = ["WAIT_S", "BackgroundSave", "lower_thread_priority"]

#: How long a background save may take: the bound of ``CheckpointManager.wait``, and of process 0's wait for
#: the other processes' shards in a multi-process job.
WAIT_S = 600.0


def lower_thread_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's niceness (Linux, where a thread has its own; elsewhere nothing).

    A niceness above 0 makes the thread yield the cores to the training
    thread's step (which XLA's CPU backend runs on every core) and use what is
    left, so the save takes longer and the steps it overlaps are slowed less.
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # not permitted here: the save runs at the training thread's priority
        pass


class BackgroundSave:
    """Runs ``work()`` (writing and committing step ``step``'s checkpoint) in a new thread, now.

    The thread is not a daemon: an interpreter that exits without waiting
    still lets it finish (its own waits are bounded).
    """

    def __init__(self, step: int, final: str, work: Callable[[], None], nice: int = 0):
        self.step, self.final, self.nice = step, final, nice
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"replicator-checkpoint-{step}")
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        lower_thread_priority(self.nice)
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - reported on the training thread by join()
            self.error = e

    @property
    def running(self) -> bool:
        """Whether the thread is still writing or committing."""
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> BaseException | None:
        """Wait (at most ``timeout_s``) for the thread to end; returns its exception, or one saying it still runs.

        While it waits, each second counts as progress for the launcher's
        watchdog: the thread is alive and bounded by its own waits.
        """
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(min(1.0, max(0.0, deadline - time.monotonic())))
            progress.touch()
        if self._thread.is_alive():
            return CheckpointError(
                f"the background save of step {self.step} into {self.final} is still writing after {timeout_s:g} s "
                f"(a slow or stuck file system?); it was not committed. Check the disk, or save less often."
            )
        return self.error
