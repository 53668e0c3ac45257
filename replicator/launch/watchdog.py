"""The launcher's watchdog: which worker the others wait for, and since when.

Every worker publishes where it is (its progress record, see
:mod:`~replicator.runtime.distributed.progress`). :func:`diagnose` reads the
records of a job's workers and returns a :class:`Verdict` when the job can no
longer finish:

* **left early**: a worker's script ended with code 0 while another worker
  went on to a step (or a checkpoint save) that the first will never run;
  every step is a collective of all workers, so that one waits forever.
* **never joined**: a worker's script ended with code 0 before it joined the
  job (``initialize()`` never returned) while others wait for it to join.
* **stalled**: no worker made progress for ``step_timeout_s`` and at least
  one waits for another: the worker(s) furthest behind are named, with the
  phase they are in and for how long, and the others with what they wait in.
  While the worker(s) behind compile a step (tracing, the passes, and XLA
  compiling it during its first run) the limit is ``compile_timeout_s``. Workers all in their
  own code at the same place wait for nobody and are left alone (a slow
  evaluation on every worker is not a stall).

It only reads the records (files the workers write); the launcher calls it
every :data:`DIAGNOSE_INTERVAL_S` seconds.

>>> import time
>>> now = time.time()
>>> records = {
...     0: {"phase": "step", "step": 31, "steps_started": 32, "since": now - 25, "detail": ""},
...     1: {"phase": "own-code", "step": 31, "steps_started": 31, "since": now - 26, "detail": ""},
... }
>>> verdict = diagnose(records, now, step_timeout_s=20)
>>> verdict.kind, verdict.blame
('stalled', [1])

Promises:

1. A stall is judged exactly when the newest record is the timeout old,
   never earlier, blaming the worker(s) behind and naming where the others
   wait; its exit code is :data:`STALL_EXIT_CODE`
   (tests/test_watchdog_promises.py::test_a_stall_is_judged_exactly_when_the_last_progress_is_the_timeout_old,
   tests/test_watchdog.py::TestDiagnose::test_the_worker_behind_is_blamed_with_what_the_others_wait_in,
   tests/test_watchdog.py::TestDiagnose::test_no_verdict_while_any_worker_made_progress_recently).
2. The compile timeout applies while the worker(s) behind compile; the step
   timeout while they do anything else, even if others compile
   (tests/test_watchdog.py::TestDiagnose::test_compiling_workers_behind_get_the_compile_timeout,
   tests/test_watchdog.py::TestDiagnose::test_a_worker_behind_in_input_fn_gets_the_step_timeout_though_others_compile).
3. Workers all in their own code at one place are never a stall
   (tests/test_watchdog.py::TestDiagnose::test_workers_all_in_their_own_code_at_one_place_wait_for_nobody);
   workers all stuck in one step are, every one blamed
   (tests/test_watchdog.py::TestDiagnose::test_every_worker_stuck_in_the_same_step_is_a_stall_of_all);
   the checkpoint's writer is blamed, not those waiting for its commit
   (tests/test_watchdog.py::TestDiagnose::test_the_checkpoint_writer_is_blamed_not_the_workers_waiting_for_its_commit).
4. A worker that left early is named at once, whatever the timeouts (exit
   code 76); one that finished its last steps, or a final save after them, is
   not (tests/test_watchdog.py::TestDiagnose::test_a_worker_that_left_early_is_named_at_once,
   tests/test_watchdog_promises.py::test_a_worker_that_left_early_is_named_whatever_the_timeouts,
   tests/test_watchdog.py::TestDiagnose::test_workers_finishing_their_last_steps_are_not_early).
5. A worker that ended before joining is named once it has been gone
   :data:`NEVER_JOINED_SETTLE_S` (exit code 75); workers that all end so are
   not (tests/test_watchdog.py::TestDiagnose::test_a_worker_that_ended_before_joining_is_named_a_second_after,
   tests/test_watchdog.py::TestDiagnose::test_workers_that_never_join_and_end_together_are_not_blamed).
6. No stall is judged while a worker joins (the start-up timeout's job),
   while a worker has no record yet, or with the step timeout 0
   (tests/test_watchdog.py::TestDiagnose::test_joining_is_left_to_the_start_up_timeout,
   tests/test_watchdog.py::TestDiagnose::test_no_verdict_without_every_record_or_with_the_watchdog_off).
7. A duration in a verdict is never negative (a record from a clock ahead)
   (tests/test_watchdog_promises.py::test_where_a_worker_is_never_reads_a_negative_time).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from replicator.runtime.distributed import progress
from replicator.runtime.distributed.startup import START_TIMEOUT_EXIT_CODE

__all__ = [
    "DEFAULT_COMPILE_TIMEOUT_S",
    "DEFAULT_STEP_TIMEOUT_S",
    "DIAGNOSE_INTERVAL_S",
    "NEVER_JOINED_EXIT_CODE",
    "STALL_EXIT_CODE",
    "Verdict",
    "describe",
    "diagnose",
]

#: How often the launcher reads the workers' progress records and calls :func:`diagnose`:
#: a verdict needs seconds of silence, so it is read less often than exits are polled.
DIAGNOSE_INTERVAL_S = 0.5
DEFAULT_STEP_TIMEOUT_S = 20.0
DEFAULT_COMPILE_TIMEOUT_S = 600.0
#: The launcher's exit code when the watchdog stops a job (a stall, or a worker that left early).
STALL_EXIT_CODE = 76
#: The exit code when a worker ended before joining: the same as a start-up timeout (EX_TEMPFAIL).
NEVER_JOINED_EXIT_CODE = START_TIMEOUT_EXIT_CODE
#: A worker that ended with 0 before joining is blamed only once it has been gone this long while
#: others still run: workers whose script never joins at all (no JAX in it) end within it of each other.
NEVER_JOINED_SETTLE_S = 1.0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Why the job cannot finish: ``kind``, the workers to blame, the message, the exit code."""

    kind: str  # 'stalled' | 'left-early' | 'never-joined'
    blame: list[int]
    message: str
    code: int


def describe(record: dict[str, Any], now: float) -> str:
    """Where a worker is, in words: ``in its own code after step 30, for 21.0 s``."""
    name = record.get("phase")
    step = record.get("step")
    started = int(record.get("steps_started") or 0)
    detail = f" ({record['detail']})" if record.get("detail") else ""
    where = {
        "starting": "starting, before initialize()",
        "joining": "in initialize(), waiting for every worker to join",
        "own-code": f"in its own code after step {started - 1}" if started else "in its own code before its first step",
        "checkpoint-gather": "in a checkpoint save, gathering leaves sharded over the workers",
        "checkpoint-write": "writing a checkpoint",
        "checkpoint-wait": "in a checkpoint save, waiting for process 0 to commit it",
        "input": f"in input_fn, drawing the batch of step {step}",
        "compiling": f"compiling step {step}",
        "step": f"in step {step} (its collectives wait for every worker)",
        "exited": f"ended its script with exit code {record.get('code')}",
    }.get(name, f"in phase {name!r}")
    return f"{where}{detail}, for {max(0.0, now - float(record['since'])):.1f} s"


def diagnose(
    records: dict[int, dict[str, Any] | None],
    now: float,
    *,
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
) -> Verdict | None:
    """A :class:`Verdict` if the workers' records show a job that cannot finish, else None.

    Args:
      records: each worker's latest progress record (None: none yet), for
        the workers whose process has not ended with an error.
      now: the current wall-clock time (``time.time()``).
      step_timeout_s: how long no worker may make progress (0: never a stall).
      compile_timeout_s: the same, while a worker compiles.
    """
    known = {w: r for w, r in records.items() if r is not None}
    exited = {w: r for w, r in known.items() if r["phase"] == "exited" and r.get("code") == 0}
    live = {w: r for w, r in known.items() if r["phase"] != "exited"}
    for w, r in sorted(exited.items()):
        # Ahead: started a step it never will. A final save or evaluation after its last step is not.
        steps = int(r.get("steps_started") or 0)
        ahead = sorted(v for v, q in live.items() if int(q.get("steps_started") or 0) > steps)
        if not r.get("joined") and live:
            if now - float(r.get("since") or 0.0) < NEVER_JOINED_SETTLE_S:
                continue  # the others may be about to end too
            waiting = sorted(live)
            return Verdict(
                "never-joined",
                [w],
                f"worker {w} ended its script with exit code 0 before it joined the job (initialize() never "
                f"returned); worker(s) {waiting} cannot start without it. Call "
                f"replicator.runtime.distributed.initialize() at the top of the script, before any early exit.",
                NEVER_JOINED_EXIT_CODE,
            )
        if ahead:
            where = "; ".join(f"worker {v} {describe(live[v], now)}" for v in ahead)
            return Verdict(
                "left-early",
                [w],
                f"worker {w} ended its script with exit code 0 after {steps} step(s), but the others went on "
                f"({where}), and every step needs every worker: worker {w} left the training loop early (or "
                f"the others run more steps or saves than it). Make every worker run the same steps.",
                STALL_EXIT_CODE,
            )
    if not step_timeout_s or not live or len(known) < len(records):
        return None
    if any(r["phase"] == "joining" for r in live.values()):
        return None  # initialize() has its own start-up timeout
    positions = {w: progress.position(r) for w, r in live.items()}
    lowest = min(positions.values())
    behind = sorted(w for w, p in positions.items() if p == lowest)
    waiting = sorted(w for w in live if w not in behind)
    compiling = any(live[w]["phase"] == "compiling" for w in behind)  # what the others wait for is compiling
    limit = compile_timeout_s if compiling else step_timeout_s
    quiet = now - max(float(r["since"]) for r in live.values())
    if quiet < limit:
        return None
    if not waiting and all(live[w]["phase"] == "own-code" for w in behind):
        return None  # all in their own code at the same place: nobody waits for anybody
    option = "--compile-timeout" if compiling else "--step-timeout"
    lines = [f"no worker made progress for {quiet:.1f} s ({option} {limit:g})."]
    if waiting:
        lines.append(
            "Behind: "
            + "; ".join(f"worker {w} {describe(live[w], now)}" for w in behind)
            + ". Waiting for it: "
            + "; ".join(f"worker {w} {describe(live[w], now)}" for w in waiting)
            + "."
        )
    else:
        lines.append(
            "Every worker is at the same place: "
            + "; ".join(f"worker {w} {describe(live[w], now)}" for w in behind)
            + " (a collective that never completes, or a step slower than the timeout)."
        )
    lines.append(f"If a step or a pause between steps legitimately takes longer, raise {option}.")
    return Verdict("stalled", behind, " ".join(lines), STALL_EXIT_CODE)
