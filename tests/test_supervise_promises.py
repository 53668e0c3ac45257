"""The promises of replicator/launch/supervise.py that no other test checks (its docstring lists them all).

:func:`~replicator.launch.supervise.supervise` watches tiny Python workers started with
:func:`~replicator.launch.processes.start`; they say they are ready through files, and every wait is bounded
(``max_time_s`` is a backstop far above what any test here takes).
"""

from __future__ import annotations

import io
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from utils import kill_left_running

from replicator.launch import processes
from replicator.launch import supervise as supervise_module
from replicator.launch.restarts import Outcome
from replicator.launch.supervise import supervise
from replicator.launch.watchdog import Verdict

pytestmark = pytest.mark.multiprocess

_SLEEPS = """
import sys, time
from pathlib import Path
Path(sys.argv[1]).write_text("1")
time.sleep(600)
"""
_FAILS = "import sys; sys.exit(4)"


_STARTED: list[processes.Worker] = []


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test():
    """Whatever a test (failing, or run against a broken module) leaves running is killed at its end."""
    yield
    kill_left_running(_STARTED)


def _start(tmp_path: Path, codes: list[str]) -> tuple[list[processes.Worker], processes.Output]:
    output = processes.Output(io.StringIO(), io.StringIO())
    workers = []
    for i, code in enumerate(codes):
        ready = tmp_path / f"ready.{i}"
        command = [sys.executable, "-c", code, str(ready)]
        workers.append(processes.start(i, command, {}, output, str(tmp_path), str(tmp_path / f"progress.{i}")))
        _STARTED.append(workers[-1])
    deadline = time.monotonic() + 120
    for i, code in enumerate(codes):
        while code == _SLEEPS and not (tmp_path / f"ready.{i}").exists():
            assert time.monotonic() < deadline, "a worker did not start"
            time.sleep(0.02)
    return workers, output


def _supervise(workers, output, **kwargs) -> Outcome:
    settings = dict(
        kill_grace_s=0.5,
        finish_timeout_s=300.0,
        max_time_s=300.0,
        job_start=time.monotonic(),
        step_timeout_s=None,
        compile_timeout_s=600.0,
        interrupted=threading.Event(),
    )
    return supervise(workers, output, **{**settings, **kwargs})


def _all_ended(workers: list[processes.Worker], within_s: float = 60.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(w.ended is None for w in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    return all(w.ended is not None for w in workers)


def test_the_first_failure_is_blamed_restartable_and_every_other_worker_stopped(tmp_path):
    workers, output = _start(tmp_path, [_SLEEPS, _FAILS, _SLEEPS])
    outcome = _supervise(workers, output)
    assert (outcome.code, outcome.blamed, outcome.restartable) == (4, 1, True)
    assert outcome.cause.startswith("worker 1 failed with exit code 4")
    assert _all_ended(workers) and [w.returncode for w in workers] == [-signal.SIGTERM, 4, -signal.SIGTERM]


def test_another_reason_to_stop_stops_the_workers_with_its_outcome(tmp_path):
    """``stop_when`` (the rendezvous of a job across hosts): its outcome ends the start, the workers stopped."""
    workers, output = _start(tmp_path, [_SLEEPS, _SLEEPS])
    elsewhere = Outcome(77, "host rank 1 gone", detected=1.0)
    looks: list[float] = []

    def stop_when(now: float) -> Outcome | None:
        looks.append(now)
        return elsewhere if len(looks) >= 3 else None

    assert _supervise(workers, output, stop_when=stop_when) is elsewhere
    assert _all_ended(workers) and [w.returncode for w in workers] == [-signal.SIGTERM] * 2


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_ends_the_job_with_128_plus_the_signal_not_restartable(tmp_path, signum):
    workers, output = _start(tmp_path, [_SLEEPS, _SLEEPS])
    interrupted = threading.Event()
    interrupted.signum = signum  # type: ignore[attr-defined]  # as cli.main's handler sets it
    interrupted.set()
    outcome = _supervise(workers, output, interrupted=interrupted)
    assert (outcome.code, outcome.restartable) == (128 + signum, False)
    assert f"[launcher] interrupted ({signal.Signals(signum).name})" in output.stderr.getvalue()
    assert _all_ended(workers)


def test_max_time_ends_the_job_with_124_not_restartable(tmp_path):
    workers, output = _start(tmp_path, [_SLEEPS])
    outcome = _supervise(workers, output, max_time_s=0.5, job_start=time.monotonic() - 1.0)
    assert (outcome.code, outcome.restartable) == (124, False)
    assert "the job ran longer than --max-time 0.5 s" in output.stderr.getvalue()
    assert _all_ended(workers)


@pytest.mark.parametrize(("blamed", "want"), [([1], 1), ([0, 1], None)])
def test_a_watchdog_verdict_blames_its_one_worker_or_none_of_several(tmp_path, monkeypatch, blamed, want):
    """A stall behind several workers blames none of them: --min-workers must not count it as one
    worker failing again (and shrink the job)."""
    verdict = Verdict("left-early", blamed, "worker(s) ahead left", 76)
    monkeypatch.setattr(supervise_module, "DIAGNOSE_INTERVAL_S", 0.0)
    monkeypatch.setattr(supervise_module, "_watch", lambda *args: verdict)
    workers, output = _start(tmp_path, [_SLEEPS, _SLEEPS])
    outcome = _supervise(workers, output)
    assert (outcome.code, outcome.blamed, outcome.restartable) == (76, want, True)
    assert _all_ended(workers)
