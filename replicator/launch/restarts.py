"""Restarts (``--max-restarts N``): which endings are restarted, and how long each recovery took.

With ``--max-restarts N`` a job whose worker failed is not over. The worker may
have been killed, raised, exited with an error, or the watchdog may have stopped
the job: once the launcher has stopped the other workers, as it does without
restarts, it starts every worker again, up to ``N`` times. Each start gets a new
coordinator port (a local job without ``--coordinator``; otherwise the same
address, once the old coordinator has let it go), fresh status and progress
files, and the restart number in the workers' environment
(``REPLICATOR_RESTART_COUNT``, and torchrun's ``TORCHELASTIC_RESTART_COUNT``).
A script that builds its :class:`~replicator.Trainer` with ``resume_from=``
resumes from its newest intact checkpoint at the exact input position.

What is not a worker's failure ends the job as before: ``--max-time`` and a
signal to the launcher (:attr:`Outcome.restartable`). A job that fails an
``N+1``-th time ends with that failure's exit code and blame.

With ``--min-workers M`` (below the job's worker count) a worker that keeps
failing is left behind (:class:`Shrinking`): when a failure is blamed on the
same worker as the failure before it, and came within ``--failure-window W``
seconds (:data:`DEFAULT_FAILURE_WINDOW_S`) of the restart in between, the next
restart runs the job on one worker fewer, never fewer than ``M``; it counts
against ``--max-restarts`` like any restart. The workers read the new count in
``REPLICATOR_NUM_WORKERS`` and the first start's in
``REPLICATOR_INITIAL_NUM_WORKERS``; a ``Trainer`` with ``resume_from=``
restores its checkpoint onto the smaller mesh.

Every restart is logged with its cause, and its recovery with how long it took
(:class:`Recovery`): from the failure's detection to the end of the first step
that every restarted worker ran, read from their progress records, in stages.

>>> r = Recovery(number=1, cause="worker 1 was killed by SIGKILL", detected=100.0)
>>> r.stopped = 101.0
>>> r.observe([{"joined": True, "phase": "compiling", "steps_started": 1}], now=104.0)
False
>>> r.observe([{"joined": True, "phase": "own-code", "steps_started": 1}], now=106.5)
True
>>> print(r.line())
restart 1 recovered in 6.5 s (failure detected -> first step done on every worker): stopping 1.0 s, \
starting and joining 3.0 s, restoring, compiling and running the first step 2.5 s

Promises:

1. Restarts are counted exactly: a job is started at most ``N + 1`` times,
   each start with its number in ``REPLICATOR_RESTART_COUNT`` and
   ``TORCHELASTIC_RESTART_COUNT`` and a new coordinator port
   (tests/test_restarts.py::TestRestartLoop::test_restarts_until_the_job_succeeds);
   the ``N+1``-th failure ends the job with its own exit code and blame
   (tests/test_restarts.py::TestRestartLoop::test_a_job_failing_more_than_n_times_ends_with_the_last_failure).
2. A watchdog's verdict is restarted as a failure is
   (tests/test_restarts.py::TestRestartLoop::test_a_watchdog_verdict_is_restarted);
   ``--max-time`` is not (tests/test_restarts.py::TestRestartLoop::test_max_time_is_not_restarted);
   without ``--max-restarts`` a failure ends the job
   (tests/test_restarts.py::TestRestartLoop::test_without_max_restarts_a_failure_ends_the_job).
3. A coordinator address given is kept across restarts
   (tests/test_restarts.py::TestRestartLoop::test_a_given_coordinator_address_is_kept), and a
   restart starts only once what the failed start's workers started is gone
   (tests/test_restarts.py::test_a_restart_starts_after_what_the_failed_start_started_is_gone).
4. A worker keeps failing exactly when it is blamed again (a failure blamed
   on nobody never is) within ``--failure-window`` seconds of the restart
   after its previous failure
   (tests/test_restarts_promises.py::test_a_worker_keeps_failing_only_when_blamed_again_within_the_window,
   tests/test_restarts.py::TestFewerWorkers::test_a_failure_after_the_window_is_a_new_one).
5. With ``--min-workers`` each failure takes at most one worker away, only
   when one keeps failing, never below ``--min-workers``, and after a shrink
   only two new failures of one worker shrink the job again
   (tests/test_restarts_promises.py::test_a_shrinking_job_loses_one_worker_per_repeated_failure_never_below_min_workers,
   tests/test_restarts.py::TestFewerWorkers::test_never_fewer_than_min_workers); the workers
   read the new count and the first start's
   (tests/test_restarts.py::TestFewerWorkers::test_a_worker_that_keeps_failing_is_left_behind).
6. A recovery is timed once, to the first look at which every restarted
   worker has run its first step
   (tests/test_restarts.py::TestRecovery::test_recovery_waits_for_every_worker,
   tests/test_restarts_promises.py::test_a_recovery_is_timed_once_and_in_order,
   tests/test_restarts.py::TestRecovery::test_first_step_done).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_FAILURE_WINDOW_S", "Outcome", "Recovery", "Shrinking", "first_step_done", "keeps_failing"]

#: ``--failure-window``: a worker blamed again within this many seconds after the restart that
#: followed its failure keeps failing. Long enough for a restart's start-up, restore and
#: compilation; a worker that trained for longer than this after its restart fails anew.
DEFAULT_FAILURE_WINDOW_S = 300.0

_IN_A_STEP = ("input", "compiling", "step")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one start of the job's workers ended.

    Attributes:
      code: the exit code it would give the job (0: every worker succeeded).
      cause: the launcher's line about why it ended ("" on success).
      restartable: whether ``--max-restarts`` may start it again: a worker's
        failure or the watchdog's verdict, not ``--max-time`` nor a signal to
        the launcher.
      detected: when the launcher noticed the failure (``time.monotonic()``).
      blamed: the worker the launcher blamed (None: none, or several).
    """

    code: int
    cause: str = ""
    restartable: bool = False
    detected: float = 0.0
    blamed: int | None = None


def keeps_failing(outcome: Outcome, previous: Outcome | None, restarted: float | None, window_s: float) -> bool:
    """Whether ``outcome``'s worker keeps failing.

    It does when the failure before (``previous``) was blamed on the same
    worker and ``outcome`` was detected at most ``window_s`` seconds after the
    restart in between started its workers (``restarted``, monotonic seconds).

    >>> first = Outcome(137, blamed=1, detected=10.0)
    >>> keeps_failing(Outcome(137, blamed=1, detected=40.0), first, restarted=12.0, window_s=300)
    True
    >>> keeps_failing(Outcome(137, blamed=0, detected=40.0), first, restarted=12.0, window_s=300)
    False
    >>> keeps_failing(Outcome(137, blamed=1, detected=400.0), first, restarted=12.0, window_s=300)
    False
    """
    if outcome.blamed is None or previous is None or restarted is None:
        return False
    return previous.blamed == outcome.blamed and outcome.detected - restarted <= window_s


@dataclasses.dataclass
class Shrinking:
    """``--min-workers``: how many workers each restart starts, one fewer after a worker kept failing.

    On one machine the workers are interchangeable processes: whichever
    worker was blamed, the job goes on with one process fewer, numbered
    ``0 .. workers - 1`` (JAX numbers a job's workers from 0). After a
    shrink, a worker keeps failing only if it fails twice anew.

    Attributes:
      initial: the job's worker count at its first start.
      min_workers: the fewest workers to go on with.
      window_s: ``--failure-window`` (see :func:`keeps_failing`).
      workers: the worker count of the latest start.
      previous: the failure before the latest restart (None: none since the
        first start or the last shrink).
    """

    initial: int
    min_workers: int
    window_s: float = DEFAULT_FAILURE_WINDOW_S
    workers: int = 0
    previous: Outcome | None = None

    def __post_init__(self) -> None:
        self.workers = self.workers or self.initial

    def next_start(self, outcome: Outcome, restarted: float | None) -> str | None:
        """Note a failure that will be restarted; drop a worker if it keeps failing and the job may shrink.

        Args:
          outcome: the failure.
          restarted: when the latest restart started its workers (None: the
            failure is the first start's).

        Returns:
          The launcher's line about a worker that keeps failing (None: it
          does not, or ``--min-workers`` is the job's worker count); the
          next start runs :attr:`workers` workers.
        """
        previous, self.previous = self.previous, outcome
        if self.min_workers >= self.initial or not keeps_failing(outcome, previous, restarted, self.window_s):
            return None
        assert restarted is not None
        why = (
            f"worker {outcome.blamed} keeps failing (blamed again {outcome.detected - restarted:.1f} s after the "
            f"restart, within --failure-window {self.window_s:g} s)"
        )
        if self.workers - 1 < self.min_workers:
            return f"{why}; the job already runs on --min-workers {self.min_workers}: restarting it as it is"
        self.workers -= 1
        self.previous = None
        return (
            f"{why}: the job goes on without it, on {self.workers} of its {self.initial} workers "
            f"(--min-workers {self.min_workers}); the workers read REPLICATOR_NUM_WORKERS={self.workers} and "
            f"REPLICATOR_INITIAL_NUM_WORKERS={self.initial}"
        )


def first_step_done(record: dict[str, Any]) -> bool:
    """Whether a worker's progress record shows its first step (``Replicator.run`` call) returned."""
    started = int(record.get("steps_started") or 0)
    return started >= 2 or (started == 1 and record.get("phase") not in _IN_A_STEP)


@dataclasses.dataclass
class Recovery:
    """The timeline of one restart (``time.monotonic()`` seconds), from the failure to the first step after it.

    Attributes:
      number: the restart's number (1 for the first).
      cause: why the job was restarted (the launcher's line about the failure).
      detected: when the launcher noticed the failure.
      stopped: when every worker of the failed start had ended (the new ones start then).
      joined: when every new worker had joined the job (``initialize()`` returned).
      first_step: when every new worker had run its first step.
    """

    number: int
    cause: str
    detected: float
    stopped: float | None = None
    joined: float | None = None
    first_step: float | None = None

    @property
    def seconds(self) -> float | None:
        """From the failure's detection to the first step after the restart (None: not there yet)."""
        return None if self.first_step is None else self.first_step - self.detected

    def observe(self, records: Sequence[dict[str, Any] | None], now: float) -> bool:
        """Note what the restarted workers' progress records show at ``now``; True once each ran its first step."""
        if self.first_step is not None:
            return True
        if not records or any(r is None for r in records):
            return False
        if self.joined is None and all(r.get("joined") for r in records):
            self.joined = now
        if all(first_step_done(r) for r in records):
            self.joined = self.joined or now
            self.first_step = now
            return True
        return False

    def line(self) -> str:
        """The launcher's line about a recovery that reached its first step."""
        assert self.first_step is not None and self.stopped is not None and self.joined is not None
        return (
            f"restart {self.number} recovered in {self.seconds:.1f} s (failure detected -> first step done on "
            f"every worker): stopping {self.stopped - self.detected:.1f} s, starting and joining "
            f"{self.joined - self.stopped:.1f} s, restoring, compiling and running the first step "
            f"{self.first_step - self.joined:.1f} s"
        )
