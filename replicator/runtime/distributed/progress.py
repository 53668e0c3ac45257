"""Where a worker is: the progress record the launcher's watchdog reads.

Under ``python -m replicator.launch`` every worker publishes one small JSON
record, ``REPLICATOR_PROGRESS_FILE``, rewritten (atomically, by a daemon
thread, at most every :data:`WRITE_INTERVAL_S`) whenever it moves::

    {"pid": 4242, "phase": "step", "step": 31, "steps_started": 32,
     "since": 1700000000.0, "detail": "", "code": null, "joined": true}

``steps_started`` counts calls of ``Replicator.run`` in this process (every
worker of a job makes the same calls, in the same order: each is a step of
collectives across all of them); ``since`` is when the worker entered the
phase (wall-clock seconds). Phases, in the order a worker passes them:

==================  ==========================================================
``starting``        the script runs, before ``initialize()``
``joining``         in ``initialize()``, waiting for every worker to join
``own-code``        in the user's code between steps (``step`` = the next one)
``checkpoint-gather``, ``checkpoint-write``, ``checkpoint-wait``
                    in a collective ``save``: gathering sharded leaves,
                    process 0 writing, waiting for process 0's commit
``input``           in ``input_fn``, drawing the batch of step ``step``
``compiling``       tracing, rewriting and compiling step ``step``
``step``            placing and dispatching step ``step`` (and waiting for
                    room: at most ``max_in_flight`` steps are queued)
``exited``          the script ended; ``code`` is its exit code
==================  ==========================================================

:func:`position` orders records along that path, so the worker furthest
behind is the one the others wait for. This module imports only the
standard library: the worker bootstrap loads it before JAX.

Promises:

1. ``position`` orders records along the path every worker takes; an exit stands where the worker stopped,
   before everything if it never joined
   (tests/test_watchdog.py::TestPosition::test_the_path_every_worker_takes_is_ordered,
   tests/test_watchdog.py::TestPosition::test_an_exit_stands_where_the_worker_stopped).
2. ``begin_step``, ``end_step``, ``phase`` and ``touch`` move the record as documented, the first step's end and
   the exit written at once (tests/test_watchdog.py::TestProgressRecord::test_steps_phases_and_the_file).
3. A ``phase`` block goes back to the phase, step and detail the worker was in, even when the block raises
   (tests/test_watchdog.py::test_a_phase_block_goes_back_to_where_the_worker_was_even_when_it_raises).
4. An older snapshot never replaces the exit record
   (tests/test_watchdog.py::TestProgressRecord::test_a_slow_periodic_write_never_replaces_the_exit_record).
5. ``read_progress`` is None for a missing, unreadable or partial record
   (tests/test_watchdog.py::TestProgressRecord::test_unreadable_records_are_none).
6. Without a file (no argument, no ``REPLICATOR_PROGRESS_FILE``) reporting is off: no thread, nothing written
   (tests/test_watchdog.py::test_reporting_is_off_without_a_file).
7. Loading it imports no JAX
   (tests/test_watchdog.py::TestBootstrap::test_runs_the_script_as_main_with_its_argv_and_path).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "ENV_PROGRESS_FILE",
    "PHASES",
    "WRITE_INTERVAL_S",
    "begin_step",
    "current_step",
    "end_step",
    "joined",
    "mark_exited",
    "mark_joined",
    "phase",
    "position",
    "read_progress",
    "set_phase",
    "start_reporting",
    "touch",
]

#: Set by the launcher: the file this worker's progress record is written to.
ENV_PROGRESS_FILE = "REPLICATOR_PROGRESS_FILE"
WRITE_INTERVAL_S = 0.2

#: Each phase's place within a step (``position = 10 * steps + offset``).
PHASES: dict[str, int] = {
    "own-code": 0,
    "checkpoint-gather": 1,
    "checkpoint-write": 2,
    "checkpoint-wait": 4,
    "input": 5,
    "compiling": 6,
    "step": 8,
}
_BEFORE_STEPS = {"starting": -20, "joining": -10}


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.phase = "starting"
        self.step: int | None = None
        self.steps_started = 0
        self.since = time.time()
        self.detail = ""
        self.code: int | None = None
        self.joined = False
        self.version = 0

    def record(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "phase": self.phase,
            "step": self.step,
            "steps_started": self.steps_started,
            "since": self.since,
            "detail": self.detail,
            "code": self.code,
            "joined": self.joined,
        }


_STATE = _State()
_WRITER: threading.Thread | None = None
_PATH: str | None = None


def set_phase(name: str, step: int | None = None, detail: str = "") -> None:
    """Enter phase ``name`` (of step ``step``) now."""
    s = _STATE
    with s.lock:
        s.phase, s.step, s.detail, s.since = name, step, detail, time.time()
        s.version += 1


def touch() -> None:
    """Progress within the current phase (e.g. bytes written): restart its clock."""
    s = _STATE
    s.since = time.time()
    s.version += 1


@contextlib.contextmanager
def phase(name: str, detail: str = "") -> Iterator[None]:
    """Be in phase ``name`` for the ``with`` block, then back where the worker was (clock restarted)."""
    s = _STATE
    before = (s.phase, s.step, s.detail)
    set_phase(name, current_step() if name in PHASES else None, detail)
    try:
        yield
    finally:
        set_phase(*before)


def begin_step() -> int:
    """A call of ``Replicator.run`` starts: its step index, in phase ``input``."""
    s = _STATE
    with s.lock:  # set_phase("input", k), inline: this runs on every step
        k = s.steps_started
        s.steps_started = k + 1
        s.phase, s.step, s.detail, s.since = "input", k, "", time.time()
        s.version += 1
    return k


def current_step() -> int:
    """The index of the step ``Replicator.run`` is in (or the next one, between steps)."""
    return max(0, _STATE.steps_started - 1) if _STATE.phase in ("input", "compiling", "step") else _STATE.steps_started


def end_step() -> None:
    """``Replicator.run`` returned: back in the user's code, before the next step.

    The first step's end is written at once, not by the writer thread
    :data:`WRITE_INTERVAL_S` later: the launcher times a restart's recovery to
    it, and a worker whose steps are short may die before the thread writes.
    """
    s = _STATE
    with s.lock:  # set_phase("own-code", steps_started), inline: this runs on every step
        s.phase, s.step, s.detail, s.since = "own-code", s.steps_started, "", time.time()
        s.version += 1
    if s.steps_started == 1:
        _write()


def mark_joined() -> None:
    """``initialize()`` returned: this worker is part of the job, in its own code before its first step."""
    _STATE.joined = True
    set_phase("own-code", _STATE.steps_started)


def joined() -> bool:
    """Whether ``initialize()`` has returned in this process."""
    return _STATE.joined


def mark_exited(code: int) -> None:
    """The script ended with ``code``: record it and write the file now (the process is about to exit)."""
    s = _STATE
    with s.lock:
        s.phase, s.code, s.since = "exited", code, time.time()
        s.version += 1
    _write()


def position(record: dict[str, Any]) -> int:
    """Where a record stands on the path every worker takes (higher: further along)."""
    name = record.get("phase")
    if name in _BEFORE_STEPS:
        return _BEFORE_STEPS[name]
    steps = int(record.get("steps_started") or 0)
    if name == "exited":  # where it stopped: a worker that never joined stopped before everything
        return 10 * steps if record.get("joined") else _BEFORE_STEPS["starting"]
    if name in ("input", "compiling", "step"):
        return 10 * (steps - 1) + PHASES[name]  # steps_started already counts this step
    return 10 * steps + PHASES.get(name, 0)


#: Held from taking a snapshot to renaming its file: the writer thread and ``mark_exited``
#: write one after the other, so an older snapshot never replaces a newer file (the exit
#: code once vanished that way on a loaded machine).
_WRITE_LOCK = threading.Lock()


def _write() -> None:
    path = _PATH
    if path is None:
        return
    with _WRITE_LOCK:
        with _STATE.lock:
            text = json.dumps(_STATE.record())
        try:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".progress-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except OSError:  # the launcher's directory is gone: nobody reads it any more
            pass


def _writer_loop() -> None:
    written = -1
    while True:
        version = _STATE.version
        if version != written:
            _write()
            written = version
        time.sleep(WRITE_INTERVAL_S)


def start_reporting(path: str | None = None) -> bool:
    """Start writing this worker's record to ``path`` (default: ``REPLICATOR_PROGRESS_FILE``).

    Returns whether reporting is on (it is off without a path). Idempotent.
    """
    global _WRITER, _PATH
    path = path or os.environ.get(ENV_PROGRESS_FILE) or None
    if path is None:
        return False
    if _WRITER is None:
        _PATH = path
        _WRITER = threading.Thread(target=_writer_loop, name="replicator-progress", daemon=True)
        _WRITER.start()
    return True


def read_progress(path: str) -> dict[str, Any] | None:
    """A worker's record, or None if it wrote none (or an unreadable one)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("phase"), str):
        return None
    if not isinstance(record.get("since"), (int, float)) or not isinstance(record.get("steps_started"), int):
        return None
    return record
