"""The promises of replicator/launch/relay.py that no other test checks (its docstring lists them all).

A :class:`~replicator.launch.relay.WorkerLog` is driven directly, with the times passed in: nothing waits.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from replicator.launch import relay

TRACEBACK = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>', "ValueError: bad"]


def _log(path: Path | str | None = None) -> tuple[relay.WorkerLog, list[tuple[bool, str]]]:
    shown: list[tuple[bool, str]] = []
    return relay.WorkerLog(2, lambda err, text: shown.append((err, text)), path and str(path)), shown


def test_stdout_is_never_held():
    log, shown = _log()
    for line in TRACEBACK:
        log.line(line, stderr=False)
    log.settle(blamed=False)  # even after a failure
    log.line("step 9", stderr=False)
    assert shown == [(False, f"[worker 2] {x}\n") for x in [*TRACEBACK, "step 9"]]


def test_an_error_report_is_held_until_hold_s_after_its_last_line_then_shown_in_order(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(relay.time, "monotonic", lambda: clock[0])
    log, shown = _log()
    log.line("a warning before it", stderr=True)  # not an error report: shown at once
    for line in TRACEBACK:
        log.line(line, stderr=True)
    clock[0] = 101.0
    log.line("more stderr after it", stderr=True)  # held with it
    log.release_stale(101.0 + relay.HOLD_S - 0.01)
    assert shown == [(True, "[worker 2] a warning before it\n")]
    log.release_stale(101.0 + relay.HOLD_S)
    assert shown[1:] == [(True, f"[worker 2] {x}\n") for x in [*TRACEBACK, "more stderr after it"]]


def test_after_a_failure_the_blamed_worker_shows_its_report_and_the_others_one_line(tmp_path):
    blamed, shown_blamed = _log(tmp_path / "blamed.log")
    other, shown_other = _log(tmp_path / "other.log")
    for log in (blamed, other):
        for line in TRACEBACK:
            log.line(line, stderr=True)
    blamed.settle(blamed=True)
    assert shown_blamed == [(True, f"[worker 2] {x}\n") for x in TRACEBACK]  # at once, in full
    other.settle(blamed=False)
    other.line("a consequence, printed later", stderr=True)  # held too: it follows the failure
    assert shown_other == []
    other.close(blamed=False)
    assert shown_other == [
        (True, f"[launcher] worker 2, after the failure: ValueError: bad (4 lines in full: {tmp_path / 'other.log'})\n")
    ]
    assert other.condensed
    assert (tmp_path / "other.log").read_text().splitlines() == [*TRACEBACK, "a consequence, printed later"]
    quiet, shown = _log(tmp_path / "quiet.log")  # nothing held when the job failed
    quiet.settle(blamed=False)
    quiet.line("WARNING: lost my peer", stderr=True)  # not an error report, but after the failure: held
    assert shown == []
    quiet.close(blamed=False)
    assert shown == [
        (
            True,
            f"[launcher] worker 2, after the failure: WARNING: lost my peer (1 line in full: {tmp_path / 'quiet.log'})\n",
        )
    ]
    without_file, shown = _log()
    without_file.line(TRACEBACK[0], stderr=True)
    without_file.settle(blamed=False)
    without_file.close(blamed=False)
    assert shown == [
        (True, "[launcher] worker 2, after the failure: Traceback (most recent call last): (1 line not shown)\n")
    ]
    assert not without_file.condensed


@pytest.mark.parametrize(
    "lines, summary",
    [
        (["Traceback (most recent call last):", "KeyError: 'a'", *TRACEBACK], "ValueError: bad"),  # the last one
        (["E1125 19:10:03.1 8630 a.cc:7] an error", "F1125 19:10:03.1 8630 a.cc:8] the fatal one"], "the fatal one"),
        (["noise", "E1125 19:10:03.1 8630 a.cc:7] an error", "E1125 19:10:03.1 8630 a.cc:9] another"], "an error"),
        (["noise", "Fatal Python error: Segmentation fault", "more"], "Fatal Python error: Segmentation fault"),
        (["", "   ", "  first words  ", "second"], "first words"),
        ([], ""),
        (["x" * 400], "x" * 300 + " ..."),
    ],
)
def test_the_summary_of_an_error_report(lines, summary):
    assert relay.summarize(lines) == summary


def test_log_files_are_named_by_worker_and_start(tmp_path):
    assert relay.log_path(str(tmp_path), 3, 0) == os.path.join(tmp_path, "worker-3.log")
    assert relay.log_path(str(tmp_path), 3, 2) == os.path.join(tmp_path, "worker-3.restart-2.log")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a file every write to fails)")
def test_a_log_file_that_cannot_be_written_does_not_stop_the_output():
    log, shown = _log("/dev/full")
    log.line("step 1", stderr=False)
    log.line("step 2", stderr=False)
    assert shown == [(False, "[worker 2] step 1\n"), (False, "[worker 2] step 2\n")] and log.lines == 2


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a file every write to fails)")
def test_closing_a_log_file_that_cannot_be_written_is_no_error():
    log, _ = _log("/dev/full")
    log.line("step 1", stderr=False)
    log.close()
