"""The promises of replicator/launch/blame.py that no other test checks (its docstring lists them all).

No process is started: a worker is a :class:`~replicator.launch.processes.Worker` around a stand-in
process (its pid is never signalled here) and a status file written as a worker's would be.
"""

from __future__ import annotations

import signal
from types import SimpleNamespace

import hypothesis
import hypothesis.strategies as st
import pytest

from replicator.launch import blame
from replicator.launch.processes import Worker
from replicator.runtime.distributed import status
from replicator.runtime.distributed.startup import START_TIMEOUT_EXIT_CODE


def _worker(tmp_path, worker_id: int, rc: int | None, ended: float | None, **report) -> Worker:
    if report:
        status.write_status(str(tmp_path), worker_id, kind="exception", **report)
    proc = SimpleNamespace(returncode=rc, pid=-1)
    return Worker(worker_id, proc, 0.0, [], str(tmp_path), str(tmp_path / f"none-{worker_id}.json"), ended=ended)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.integers(-64, 255))
def test_an_exit_is_described_with_the_shells_exit_code(rc):
    """A signal's death is ``128 + signal`` and names the signal; a start-up timeout says so; else the code."""
    text = blame.describe_exit(rc)
    if rc < 0:
        assert blame.exit_code(rc) == 128 - rc
        assert text.startswith("was killed by ") and text.endswith(f"exit code {128 - rc}")
        try:
            assert signal.Signals(-rc).name in text
        except ValueError:
            assert f"signal {-rc}" in text
    else:
        assert blame.exit_code(rc) == rc
        assert text.endswith(f"exit code {rc}")
        assert ("gave up waiting" in text) == (rc == START_TIMEOUT_EXIT_CODE)


def test_among_equal_failures_the_first_to_end_then_the_lowest_id_is_blamed(tmp_path):
    """Two plain failures without a report: the one that ended first; at the same moment, the lower id."""
    workers = [_worker(tmp_path, 0, 1, 2.0), _worker(tmp_path, 1, 1, 1.0), _worker(tmp_path, 2, 1, 1.0)]
    assert min(workers, key=blame.blame_order).worker_id == 1
    assert min(reversed(workers), key=blame.blame_order).worker_id == 1


def test_only_a_failed_worker_is_blamed_and_running_ones_are_named(tmp_path):
    """A worker that succeeded (even first) or still runs is never blamed; a blamed SIGABRT names those running."""
    workers = [_worker(tmp_path, 0, 0, 0.5), _worker(tmp_path, 1, None, None), _worker(tmp_path, 2, 3, 1.0)]
    first, line = blame.blame(workers)
    assert first.worker_id == 2 and line.startswith("worker 2 failed with exit code 3 after 1.0 s")
    workers[2] = _worker(tmp_path, 2, -signal.SIGABRT, 1.0)
    first, line = blame.blame(workers)
    assert first.worker_id == 2 and "(still running, maybe hung: worker(s) [1])" in line


def test_the_error_summary_is_the_first_line_cut_at_500_characters(tmp_path):
    long = "x" * 700
    w = _worker(tmp_path, 0, 1, 1.0, exception_type="pkg.Err", message=f"{long}\nsecond line")
    assert blame.error_summary(w) == "pkg.Err: " + "x" * 500 + " ..."
    assert blame.error_summary(_worker(tmp_path, 1, 1, 1.0)) is None  # no status file: no summary
    first, line = blame.blame([w])
    assert line.endswith(": pkg.Err: " + "x" * 500 + " ...") and "second line" not in line


@pytest.mark.parametrize("echo_rc", [-signal.SIGABRT, START_TIMEOUT_EXIT_CODE])
def test_a_worker_that_only_echoes_a_peer_is_blamed_after_the_one_that_failed_even_if_it_ended_first(tmp_path, echo_rc):
    """JAX's abort (a peer died) and giving up at start-up (a peer never came) come after a plain failure."""
    echo = _worker(tmp_path, 0, echo_rc, 1.0)
    failed = _worker(tmp_path, 1, 1, 2.0)
    assert min([echo, failed], key=blame.blame_order).worker_id == 1
    assert blame.blame([echo, failed])[0].worker_id == 1
