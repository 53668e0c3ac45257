"""The promises of replicator/launch/processes.py that no other test checks (its docstring lists them all).

Workers here are tiny Python processes started with :func:`~replicator.launch.processes.start`; every
wait on them is bounded, and what they do is signalled through files, not timed.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from utils import kill_left_running

from replicator.launch import processes

#: Ignores SIGTERM (as JAX's runtime catches it), then says it is ready.
_IGNORES_SIGTERM = """
import signal, sys, time
from pathlib import Path
flag = Path(sys.argv[1])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
flag.with_suffix(".ready").write_text("1")
while True:
    time.sleep(0.05)
"""
_SLEEPS = """
import sys, time
from pathlib import Path
Path(sys.argv[1]).with_suffix(".ready").write_text("1")
time.sleep(600)
"""


_STARTED: list[processes.Worker] = []


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test():
    """Whatever a test (failing, or run against a broken module) leaves running is killed at its end."""
    yield
    kill_left_running(_STARTED)


def _start(tmp_path: Path, code: str, worker_id: int = 0) -> tuple[processes.Worker, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    flag = tmp_path / f"w{worker_id}"
    w = processes.start(
        worker_id, [sys.executable, "-c", code, str(flag)], {}, processes.Output(out, err), str(tmp_path), "none"
    )
    _STARTED.append(w)
    deadline = time.monotonic() + 120
    while not flag.with_suffix(".ready").exists():
        assert time.monotonic() < deadline and w.ended is None, "the worker did not start"
        time.sleep(0.02)
    return w, err


def _wait_ended(workers: list[processes.Worker], within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while any(w.ended is None for w in workers):
        assert time.monotonic() < deadline, "a waiter thread did not note its worker's exit"
        time.sleep(0.02)


@pytest.mark.multiprocess
def test_sigterm_comes_first_and_sigkill_only_after_the_grace(tmp_path, monkeypatch):
    """A worker that goes on after SIGTERM: SIGTERM to its group at once, SIGKILL not before the grace."""
    w, err = _start(tmp_path, _IGNORES_SIGTERM)
    sent: list[tuple[int, float]] = []
    real = processes.signal_group

    def signal_group(worker: processes.Worker, sig: int) -> None:
        sent.append((sig, time.monotonic()))
        real(worker, sig)

    monkeypatch.setattr(processes, "signal_group", signal_group)
    t0 = time.monotonic()
    processes.stop([w], 1.0, processes.Output(io.StringIO(), err))
    _wait_ended([w])
    assert [sig for sig, _ in sent] == [signal.SIGTERM, signal.SIGKILL], sent
    assert sent[1][1] - t0 >= 1.0, sent
    assert w.returncode == -signal.SIGKILL
    assert "stopping worker(s) [0]: SIGTERM, then SIGKILL after 1 s" in err.getvalue()


@pytest.mark.multiprocess
def test_stop_does_not_wait_out_the_grace_for_workers_that_exit_on_sigterm(tmp_path):
    workers = [_start(tmp_path, _SLEEPS, i)[0] for i in range(2)]
    t0 = time.monotonic()
    processes.stop(workers, 120.0, processes.Output(io.StringIO(), io.StringIO()))
    assert time.monotonic() - t0 < 60  # they died at SIGTERM: far less than the grace
    _wait_ended(workers)
    assert [w.returncode for w in workers] == [-signal.SIGTERM] * 2


class _Clock:
    """A stand-in for the ``time`` module: sleeping advances it at once (a test that would hang raises)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        assert self.now < 2000.0, "stop() waited more than 1000 s"


def test_stop_gives_up_on_a_worker_that_does_not_die_within_a_bound(monkeypatch):
    """A worker whose exit is never noted (stuck in the kernel): stop() waits the grace, then 10 s after
    SIGKILL, says so, and returns."""
    stuck = processes.Worker(7, SimpleNamespace(pid=4242, returncode=None), 0.0, [], "", "none")
    clock, sent = _Clock(), []
    monkeypatch.setattr(processes, "time", clock)
    monkeypatch.setattr(processes, "signal_group", lambda w, sig: sent.append((sig, clock.now)))  # no real signal
    err = io.StringIO()
    processes.stop([stuck], 2.0, processes.Output(io.StringIO(), err))
    assert sent == [(signal.SIGTERM, 1000.0), (signal.SIGKILL, pytest.approx(1002.0, abs=0.1))]
    assert 1012.0 <= clock.now <= 1012.5, clock.now
    assert "worker 7 (pid 4242) did not die after SIGKILL; leaving it" in err.getvalue()


def test_signalling_a_worker_that_is_gone_is_no_error():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    processes.signal_group(processes.Worker(0, gone, 0.0, [], "", "none"), 0)  # 0: only looks whether it is there


def test_the_launchers_output_closed_does_not_stop_the_copying():
    out = io.StringIO()
    out.close()
    output = processes.Output(out, out)
    output.write(out, "[worker 0] a line\n")
    output.launcher("a line of its own")


@pytest.mark.multiprocess
def test_each_line_is_copied_whole_with_its_prefix(tmp_path):
    """Lines as the worker printed them (``\\r\\n`` ends, bytes that are not UTF-8), each with its worker's
    prefix, stdout to stdout and stderr to stderr."""
    code = (
        "import os; os.write(1, b'one\\r\\ntw\\xffo\\n'); os.write(2, b'err line\\n'); "
        "os.write(1, b'no newline at the end')"
    )
    out, err = io.StringIO(), io.StringIO()
    w = processes.start(3, [sys.executable, "-c", code], {}, processes.Output(out, err), str(tmp_path), "none")
    _STARTED.append(w)
    _wait_ended([w])
    for t in w.threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert out.getvalue() == "[worker 3] one\n[worker 3] tw\ufffdo\n[worker 3] no newline at the end\n"
    assert err.getvalue() == "[worker 3] err line\n"
