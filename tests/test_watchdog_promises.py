"""The promises of replicator/launch/watchdog.py that no other test checks (its docstring lists them all).

Records are written as a worker's bootstrap writes them, with the time passed in: nothing waits.
"""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st

from replicator.launch import watchdog

NOW = 1_000_000.0


def rec(phase: str, steps: int, age: float, step: int | None = None, **extra) -> dict:
    return {"phase": phase, "steps_started": steps, "step": step, "since": NOW - age, "detail": "", **extra}


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    quiet=st.integers(0, 1000),
    newest=st.integers(0, 1),
    step_timeout=st.integers(1, 500),
    compile_timeout=st.integers(1, 1000),
    compiling=st.booleans(),
)
def test_a_stall_is_judged_exactly_when_the_last_progress_is_the_timeout_old(
    quiet, newest, step_timeout, compile_timeout, compiling
):
    """Worker 1 is behind (compiling, or in its own code), worker 0 waits in the next step; the newest record is
    ``quiet`` seconds old: a verdict exactly when ``quiet`` reaches the timeout that applies, blaming worker 1."""
    behind = rec("compiling", 5, quiet + 3 * (newest == 0), step=4) if compiling else rec("own-code", 4, quiet)
    records = {0: rec("step", 5, quiet + 3 * (newest == 1), step=4), 1: behind}
    verdict = watchdog.diagnose(records, NOW, step_timeout_s=step_timeout, compile_timeout_s=compile_timeout)
    limit = compile_timeout if compiling else step_timeout
    if quiet < limit:
        assert verdict is None
    else:
        assert verdict is not None and verdict.kind == "stalled" and verdict.blame == [1]
        assert verdict.code == watchdog.STALL_EXIT_CODE
        assert f"{'--compile-timeout' if compiling else '--step-timeout'} {limit}" in verdict.message


def test_where_a_worker_is_never_reads_a_negative_time():
    """A record written on a host whose clock is ahead: 0.0 s, not a negative duration."""
    assert watchdog.describe(rec("step", 3, -5.0, step=2), NOW) == (
        "in step 2 (its collectives wait for every worker), for 0.0 s"
    )


def test_a_worker_that_left_early_is_named_whatever_the_timeouts():
    """Left early and never joined need no silence: judged with the watchdog's timeouts off, too."""
    left = {0: rec("step", 7, 0.0, step=6), 1: rec("exited", 5, 0.0, code=0, joined=True)}
    v = watchdog.diagnose(left, NOW, step_timeout_s=0)
    assert v is not None and v.kind == "left-early" and v.blame == [1]
    never = {0: rec("joining", 0, 0.0), 1: rec("exited", 0, watchdog.NEVER_JOINED_SETTLE_S, code=0, joined=False)}
    v = watchdog.diagnose(never, NOW, step_timeout_s=0)
    assert v is not None and v.kind == "never-joined" and v.code == watchdog.NEVER_JOINED_EXIT_CODE
