"""The promises of replicator/launch/restarts.py that no other test checks (its docstring lists them all).

Properties over any sequence of failures: no process is started.
"""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st

from replicator.launch import restarts
from replicator.launch.restarts import Outcome, Recovery, Shrinking

_blamed = st.one_of(st.none(), st.integers(0, 3))


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    blamed=_blamed,
    has_previous=st.booleans(),
    before=_blamed,
    restarted=st.one_of(st.none(), st.floats(0, 100)),
    after=st.floats(0, 100),
    window=st.floats(0.5, 50),
)
def test_a_worker_keeps_failing_only_when_blamed_again_within_the_window(
    blamed, has_previous, before, restarted, after, window
):
    """Blamed on the same worker as the failure before (no failure is none; no blame is nobody's) and detected
    at most the window after the restart in between."""
    previous = Outcome(1, blamed=before, detected=0.0) if has_previous else None
    detected = (restarted or 0.0) + after
    got = restarts.keeps_failing(Outcome(1, blamed=blamed, detected=detected), previous, restarted, window)
    want = blamed is not None and has_previous and restarted is not None and before == blamed
    assert got == (want and detected - (restarted or 0.0) <= window)  # the elapsed time as computed: no rounding


_failures = st.lists(st.tuples(_blamed, st.floats(0, 20)), min_size=1, max_size=12)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(initial=st.integers(1, 5), min_workers=st.integers(1, 6), failures=_failures)
def test_a_shrinking_job_loses_one_worker_per_repeated_failure_never_below_min_workers(initial, min_workers, failures):
    """Each failure (blamed worker, seconds after the restart before it) shrinks the job by at most one worker,
    only when that worker keeps failing, never below ``min_workers``, never when ``min_workers`` is the whole
    job; after a shrink it takes two new failures of one worker to shrink again."""
    s = Shrinking(initial=initial, min_workers=min_workers, window_s=10.0)
    restarted: float | None = None
    now = 0.0
    fresh = 0  # failures since the first start or the last shrink
    for blamed, after in failures:
        now = (restarted or 0.0) + after
        before = s.workers
        previous = s.previous
        line = s.next_start(Outcome(1, blamed=blamed, detected=now), restarted)
        repeated = restarts.keeps_failing(Outcome(1, blamed=blamed, detected=now), previous, restarted, 10.0)
        fresh += 1
        if s.workers < before:
            assert s.workers == before - 1 >= min_workers and min_workers < initial
            assert repeated and fresh >= 2 and "the job goes on without it" in line
            assert s.previous is None
            fresh = 0
        else:
            assert s.workers == before
            assert (line is not None) == (repeated and min_workers < initial)
        assert s.workers >= min(min_workers, initial)
        restarted = now + 1.0


def test_a_recovery_is_timed_once_and_in_order():
    r = Recovery(number=1, cause="x", detected=10.0, stopped=11.0)
    done = {"joined": True, "phase": "own-code", "steps_started": 1}
    assert not r.observe([], now=12.0)  # no worker's record yet: nothing to time
    assert r.observe([done, done], now=14.0)  # joined and stepped at the same look
    assert (r.joined, r.first_step, r.seconds) == (14.0, 14.0, 4.0)
    assert r.observe([None], now=20.0) and (r.first_step, r.seconds) == (14.0, 4.0)  # timed once
    assert r.line().startswith("restart 1 recovered in 4.0 s (failure detected -> first step done on every worker)")
