"""The promises of replicator/launch/hosts.py that no other test checks (its docstring lists them all).

The end of a round (``hosts._next``) and the rendezvous as one round sees it (``hosts._Watch``) are driven in
this process: a launcher on a store in a thread, or a stand-in that only answers ``poll()``.
"""

from __future__ import annotations

import dataclasses
import io
import json

import hypothesis
import hypothesis.strategies as st
import pytest

from replicator.launch import hosts, processes
from replicator.launch.membership import Assignment, Rendezvous, Status
from replicator.launch.rendezvous import RendezvousError, StoreServer
from replicator.launch.restarts import Outcome, Recovery

FAST = {"heartbeat_interval_s": 0.25, "missed_heartbeats": 40}  # nobody is gone by a slow machine here


@pytest.fixture
def server():
    with StoreServer(handshake_timeout_s=5.0, frame_timeout_s=5.0, idle_timeout_s=60.0) as s:
        yield s


def _output() -> processes.Output:
    return processes.Output(io.StringIO(), io.StringIO())


def _said(output: processes.Output) -> str:
    assert isinstance(output.stderr, io.StringIO)
    return output.stderr.getvalue()


def test_a_failure_is_restarted_exactly_max_restarts_times_then_ends_the_job_with_its_code(server):
    with Rendezvous(server.address, min_hosts=1, launcher_id="h0", last_call_s=0.0, join_timeout_s=60.0, **FAST) as r:
        for round_ in range(3):
            a = r.join()
            assert a.round == round_
            output = _output()
            watch = hosts._Watch(r, a, output)
            failed = Outcome(3, "worker 0 failed with exit code 3", restartable=True, detected=1.0)
            got = hosts._next(r, a, watch, failed, output, max_restarts=2)
            if round_ < 2:
                assert isinstance(got, Recovery) and got.number == round_ + 1
                assert f"restart {round_ + 1} of at most 2, cause: host rank 0: worker 0 failed" in _said(output)
                assert r.poll().ended is None
            else:
                assert got == 3
                assert "no restart left (--max-restarts 2)" in _said(output)
                assert json.loads(r.poll().ended)["code"] == 3  # for every host
                assert r.poll().round == 2  # no round 3


def test_a_lost_host_restarts_the_job_while_enough_are_left_else_ends_it_with_77(server):
    with Rendezvous(server.address, min_hosts=1, max_hosts=2, launcher_id="h0", last_call_s=0.0, **FAST) as r:
        a = dataclasses.replace(r.join(), num_hosts=2)  # as if host rank 1 had been in round 0
        watch = hosts._Watch(r, a, _output())
        watch.event, watch.gone = ("gone", hosts.HOST_LOST_EXIT_CODE, "host rank 1 (launcher h1) gone"), 1
        lost = Outcome(hosts.HOST_LOST_EXIT_CODE, "host rank 1 (launcher h1) gone", detected=1.0)
        got = hosts._next(r, a, watch, lost, _output(), max_restarts=3)
        assert isinstance(got, Recovery) and got.number == 1 and r.poll().ended is None
        a = dataclasses.replace(r.join(), num_hosts=2)
        r.min_hosts = 2  # --nnodes 2: one host left is too few
        output = _output()
        assert hosts._next(r, a, watch, lost, output, max_restarts=3) == hosts.HOST_LOST_EXIT_CODE
        assert "host rank 1 (launcher h1) gone; at least 2 hosts needed" in _said(output)
        assert json.loads(r.poll().ended)["code"] == hosts.HOST_LOST_EXIT_CODE


class _Polled:
    """A rendezvous that only answers poll() (the status given, or an error: the rendezvous lost)."""

    heartbeat_interval_s = 0.25
    gone_after_s = 1.0

    def __init__(self, status: Status | Exception) -> None:
        self.status, self.polls = status, 0

    def poll(self) -> Status:
        self.polls += 1
        if isinstance(self.status, Exception):
            raise self.status
        return self.status


A = Assignment(1, 0, 2, ("a", "b"), ("h0", "h1"), "h0:1")


@pytest.mark.parametrize(
    "status, kind, code, said",
    [
        (
            Status(1, True, (("b", 1, 9.0),), (), None),
            "gone",
            77,
            "host rank 1 (launcher b, silent for 9.0 s) gone (no heartbeat for over 1 s)",
        ),
        (RendezvousError("connection reset"), "lost", 77, "rendezvous lost: connection reset"),
        (Status(1, True, (), (), '{"code": 5, "reason": "r"}'), "ended", 5, "the job ended: r"),
        (Status(1, True, (), (), '{"code": 0, "reason": "all done"}'), "ended", 0, "all done"),
    ],
)
def test_a_round_is_stopped_by_a_gone_host_a_lost_rendezvous_or_the_jobs_end(status, kind, code, said):
    output = _output()
    watch = hosts._Watch(_Polled(status), A, output)  # type: ignore[arg-type]
    outcome = watch(now=10.0)
    assert outcome is not None and outcome.code == code and watch.event == (kind, code, said)
    assert _said(output) == f"[launcher] {said}\n"


def test_a_round_is_done_only_when_every_host_has_finished():
    """Found by the third hidden mutant set: with one host of two finished, the round goes on (the other
    host's workers are still running); with both, it is done, code 0, on every host."""

    class _Finished(_Polled):
        def __init__(self, done: int) -> None:
            super().__init__(Status(1, True, (), (), None))
            self.client = self
            self.done = done

        def get(self, key: str) -> str:
            assert key == "hosts/done/1"
            return str(self.done)

    assert hosts._Watch(_Finished(1), A, _output(), done_key="hosts/done/1")(now=10.0) is None  # type: ignore[arg-type]
    output = _output()
    watch = hosts._Watch(_Finished(2), A, output, done_key="hosts/done/1")  # type: ignore[arg-type]
    outcome = watch(now=10.0)
    assert outcome is not None and outcome.code == 0 and watch.event[0] == "done"
    assert "every host's workers finished (round 1)" in _said(output)


def test_the_rendezvous_is_read_at_most_once_per_heartbeat_interval():
    polled = _Polled(Status(1, True, (), (), None))
    watch = hosts._Watch(polled, A, _output())  # type: ignore[arg-type]
    for now in (10.0, 10.1, 10.2, 10.24):
        assert watch(now) is None
    assert polled.polls == 1
    watch(10.25)
    assert polled.polls == 2


_NOT_AN_END = ["", "not json", "[1]", "0", '"x"', "null", '{"code": null, "reason": "r"}', '{"reason": "r"}']


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
    code=st.integers(0, 255),
    reason=st.text(max_size=30),
    garbage=st.one_of(st.sampled_from(_NOT_AN_END), st.text(alphabet="abc{}[]:, ", max_size=20)),
)
def test_the_jobs_end_reads_back_as_written_and_anything_else_as_a_failure(code, reason, garbage):
    """What a launcher wrote reads back as its code and reason; anything else in the store is a failure (code
    1) that shows the text, never an exception in the launcher."""
    assert hosts._ended(json.dumps({"code": code, "reason": reason})) == (code, reason)
    assert hosts._ended(garbage) == (1, garbage)
