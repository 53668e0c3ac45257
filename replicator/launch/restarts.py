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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["Outcome", "Recovery", "first_step_done"]

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
    """

    code: int
    cause: str = ""
    restartable: bool = False
    detected: float = 0.0


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
