"""The multi-host launcher's corners that scripts/mutate.py found untested (launch/ group).

Each test here kills a mutant that survived the rest of the launcher's fast tests: the
rendezvous's documented join timeout, the host range a launcher accepts, a launcher
leaving the store when it closes, the end a host says on ``--max-time`` or an
interrupt, the store server's hello (protocol version 1) and the client's default call
bound, a worker's stderr kept apart from its stdout, the SIGKILL that reaches what a
worker started after the worker itself ended on SIGTERM, ``--rdzv-last-call 0``, a
``--max-time`` under a second, and the workers stopped when supervising raises.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from utils import kill_leftovers, running, still_running

from replicator.launch import cli, hosts, processes, relay, supervise
from replicator.launch.membership import DEFAULT_JOIN_TIMEOUT_S, Rendezvous
from replicator.launch.rendezvous import StoreClient, StoreServer
from replicator.launch.restarts import Outcome

ROOT = Path(__file__).resolve().parent.parent
#: Heartbeats for the tests: a lost launcher is gone after 1 s.
FAST = {"heartbeat_interval_s": 0.25, "missed_heartbeats": 4}
#: An address nobody is asked to reach: the constructor of a Rendezvous does not connect.
NOWHERE = "127.0.0.1:9"


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer(handshake_timeout_s=0.5, frame_timeout_s=0.5, idle_timeout_s=5.0) as s:
        yield s


def _output() -> processes.Output:
    return processes.Output(io.StringIO(), io.StringIO())


def _said(output: processes.Output) -> str:
    assert isinstance(output.stderr, io.StringIO)
    return output.stderr.getvalue()


# -- membership: settings ----------------------------------------------------------------------------------------


def test_the_join_timeout_is_the_guides_120_s() -> None:
    """docs/guide/multihost.md promises a late launcher waits ``--rdzv-join-timeout`` (120 s) by default."""
    guide = (ROOT / "docs" / "guide" / "multihost.md").read_text()
    assert "`--rdzv-join-timeout` (120 s)" in guide
    assert DEFAULT_JOIN_TIMEOUT_S == 120.0
    assert Rendezvous(NOWHERE, min_hosts=1).join_timeout_s == 120.0


def test_without_max_hosts_the_job_has_exactly_min_hosts() -> None:
    """``--nnodes N`` is ``N:N``: host ranks 0..N-1, and N is also the most hosts."""
    r = Rendezvous(NOWHERE, min_hosts=2, rank=1)
    assert (r.min_hosts, r.max_hosts) == (2, 2)
    with pytest.raises(ValueError, match=r"host rank 2 is out of range for at most 2 hosts: give 0\.\.1"):
        Rendezvous(NOWHERE, min_hosts=2, rank=2)


def test_max_hosts_given_widens_the_ranks() -> None:
    """``--nnodes 1:3``: rank 2 is a valid host rank though one host is enough."""
    r = Rendezvous(NOWHERE, min_hosts=1, max_hosts=3, rank=2)
    assert (r.min_hosts, r.max_hosts, r.rank) == (1, 3, 2)
    with pytest.raises(ValueError, match="out of range for at most 3 hosts"):
        Rendezvous(NOWHERE, min_hosts=1, max_hosts=3, rank=3)


# -- membership: closing -----------------------------------------------------------------------------------------


def test_closing_a_launcher_leaves_the_store_and_disconnects(server: StoreServer) -> None:
    """close() says the launcher left (the others do not count it as lost) and closes its connections."""
    with StoreClient(server.address, timeout_s=2.0) as observer:
        r = Rendezvous(server.address, min_hosts=1, launcher_id="leaver", **FAST).start()
        assert "leaver" in observer.members()
        r.close()
        assert "leaver" not in observer.members()
        deadline = time.monotonic() + 2.0
        while len(server._conns) > 1 and time.monotonic() < deadline:  # the server sees its two sockets closed
            time.sleep(0.02)
        assert len(server._conns) == 1  # the observer's only


def test_closing_without_leaving_keeps_the_launcher_listed(server: StoreServer) -> None:
    """close(leave=False) (the rendezvous is ending badly): no leave is sent, so the launcher shows up as silent."""
    with StoreClient(server.address, timeout_s=2.0) as observer:
        r = Rendezvous(server.address, min_hosts=1, launcher_id="crashed", **FAST).start()
        r.close(leave=False)
        assert "crashed" in observer.members()


def test_closing_a_launcher_never_started_is_no_error() -> None:
    """close() before start() (a launcher stopped while setting up) does nothing and raises nothing."""
    Rendezvous(NOWHERE, min_hosts=1).close()


# -- hosts: the end of the job -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, reason",
    [
        (124, "--max-time ran out (exit code 124)"),
        (130, "host rank 0's launcher was interrupted (exit code 130)"),
        (143, "host rank 0's launcher was interrupted (exit code 143)"),
    ],
)
def test_a_round_not_to_restart_ends_the_job_for_every_host_saying_why(
    server: StoreServer, code: int, reason: str
) -> None:
    """``--max-time`` (124) or a signal to a launcher: no restart; the end, recorded for every host, says which."""
    output = _output()
    with Rendezvous(server.address, min_hosts=1, launcher_id="h0", join_timeout_s=5.0, **FAST) as r:
        a = r.join()
        watch = hosts._Watch(r, a, output)
        outcome = Outcome(code, "stopped", restartable=False, detected=time.monotonic())
        assert hosts._next(r, a, watch, outcome, output, max_restarts=3) == code
        ended = r.poll().ended
    assert ended is not None and json.loads(ended) == {"code": code, "reason": reason}
    assert f"[launcher] the job ended: {reason}\n" in _said(output)


# -- rendezvous: the wire protocol and the client's default bound ------------------------------------------------


def _read_frame(sock: socket.socket) -> dict:
    """One message as the protocol frames it: a 4-byte big-endian length, then that many bytes of JSON."""
    header = sock.recv(4, socket.MSG_WAITALL)
    (n,) = struct.unpack("!I", header)
    return json.loads(sock.recv(n, socket.MSG_WAITALL).decode("utf-8"))


@pytest.mark.parametrize("secret", [None, b"0123456789abcdef-test-secret"])
def test_the_server_speaks_first_with_service_version_1_and_a_nonce(secret: bytes | None) -> None:
    """The hello a launcher of another release reads first: protocol version 1, a fresh nonce, whether auth is on."""
    with StoreServer(secret=secret, handshake_timeout_s=0.5) as s:
        hellos = []
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", s.port), timeout=5) as sock:
                hellos.append(_read_frame(sock))
    for hello in hellos:
        assert set(hello) == {"service", "version", "nonce", "auth"}
        assert (hello["service"], hello["version"], hello["auth"]) == ("replicator-rendezvous", 1, secret is not None)
        assert re.fullmatch(r"[0-9a-f]{32}", hello["nonce"])
    assert hellos[0]["nonce"] != hellos[1]["nonce"]


def test_a_store_client_bounds_each_call_by_10_s_by_default(server: StoreServer) -> None:
    """StoreClient(address) as in rendezvous.py's example: each call answers within 10 s or raises."""
    with StoreClient(server.address) as c:
        assert c.timeout_s == 10.0


# -- processes: stopping process groups --------------------------------------------------------------------------

#: A worker that starts a child ignoring SIGTERM (as JAX's runtime does), writes the child's pid, and waits.
#: The worker itself ends on SIGTERM (Python's default), the child does not.
_WORKER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(child.pid))
import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


def test_a_workers_stderr_reaches_the_launchers_stderr_through_its_log(tmp_path: Path) -> None:
    """With a WorkerLog (the launcher's default), stdout lines go to stdout and stderr lines to stderr, prefixed."""
    shown: list[tuple[bool, str]] = []
    log = relay.WorkerLog(4, lambda to_stderr, text: shown.append((to_stderr, text)), str(tmp_path / "w.log"))
    code = "import sys; print('to out', flush=True); print('to err', file=sys.stderr, flush=True)"
    worker = processes.start(
        4, [sys.executable, "-c", code], dict(os.environ), _output(), str(tmp_path), str(tmp_path / "p"), log=log
    )
    assert worker.proc.wait(timeout=30) == 0
    for t in worker.threads:
        t.join(timeout=10)
    log.close()
    assert sorted(shown) == [(False, "[worker 4] to out\n"), (True, "[worker 4] to err\n")]
    assert sorted((tmp_path / "w.log").read_text().splitlines()) == ["to err", "to out"]  # both kept whole


def test_stop_kills_what_a_worker_started_after_the_worker_ended_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM ends the worker at once; its child ignores SIGTERM and must still go, by the SIGKILL to the group."""
    pid_file = tmp_path / "child.pid"
    output = _output()
    worker = processes.start(
        0, [sys.executable, "-c", _WORKER, str(pid_file)], dict(os.environ), output, str(tmp_path), str(tmp_path / "p")
    )
    child: int | None = None
    try:
        deadline = time.monotonic() + 20.0
        while not ("ready" in output.stdout.getvalue() and pid_file.exists()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pid_file.exists() and "ready" in output.stdout.getvalue(), "the worker's child never started"
        child = int(pid_file.read_text())
        processes.stop([worker], grace_s=5.0, output=output)
        assert worker.returncode == -signal.SIGTERM  # the worker itself went on SIGTERM
        assert still_running([child], within_s=2.0) == []
        assert not running(child)
        assert "did not die" not in output.stderr.getvalue()  # said only of a worker SIGKILL could not end
    finally:
        try:
            os.killpg(worker.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if child is not None:
            kill_leftovers([child])


# -- the CLI's and launch()'s settings ---------------------------------------------------------------------------

TOY = str(ROOT / "tests" / "multiproc" / "toy_worker.py")


def test_rdzv_last_call_0_is_allowed_and_a_negative_one_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``--rdzv-last-call 0``: close a MIN:MAX round as soon as MIN hosts joined; below 0 is an error (exit 2)."""
    common = ["--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--rdzv-last-call"]
    args, _ = cli.parse([*common, "0", TOY])
    assert (args.rdzv_last_call, args.hosts) == (0.0, (1, 2))
    with pytest.raises(SystemExit) as e:
        cli.parse([*common, "-0.5", TOY])
    assert e.value.code == 2
    assert "--rdzv-last-call must be >= 0 seconds, got -0.5" in capsys.readouterr().err


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "REPLICATOR_"))}


def test_a_max_time_under_a_second_is_accepted() -> None:
    """``max_time_s`` is any positive number of seconds: 0.5 runs the job (it ends by itself or by the limit)."""
    out, err = io.StringIO(), io.StringIO()
    rc = supervise.launch(
        [sys.executable, "-c", "pass"], num_workers=1, env=_env(), stdout=out, stderr=err, max_time_s=0.5
    )
    assert rc in (0, 124), err.getvalue()


def test_an_error_in_the_launcher_stops_the_workers_before_it_propagates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception while supervising (a launcher bug, Ctrl-C in a program calling launch()) never leaves workers."""
    pid_file = tmp_path / "worker.pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    real = supervise._interrupt

    def boom(interrupted, output):  # once the worker runs
        if pid_file.exists() and pid_file.read_text():
            raise RuntimeError("a launcher bug")
        return real(interrupted, output)

    monkeypatch.setattr(supervise, "_interrupt", boom)
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(RuntimeError, match="a launcher bug"):
        supervise.launch(
            [sys.executable, "-c", code], num_workers=1, env=_env(), stdout=out, stderr=err, max_time_s=30,
            kill_grace_s=2.0,
        )  # fmt: skip
    pid = int(pid_file.read_text())
    try:
        assert still_running([pid], within_s=3.0) == [], err.getvalue()
    finally:
        kill_leftovers([pid])


class _Polled:
    """A rendezvous that only answers poll(), with the status given."""

    heartbeat_interval_s = 0.25
    gone_after_s = 1.0

    def __init__(self, status: object) -> None:
        self.status = status

    def poll(self) -> object:
        return self.status


def test_a_round_started_elsewhere_stops_this_hosts_workers_as_a_failure() -> None:
    """Another host opening round 2 must stop this host's round-1 workers with a non-zero code (a restart, not a
    job that finished), naming the round."""
    from replicator.launch.membership import Assignment, Status

    a = Assignment(1, 0, 2, ("a", "b"), ("h0", "h1"), "h0:1")
    output = _output()
    watch = hosts._Watch(_Polled(Status(2, True, (), (), None)), a, output)  # type: ignore[arg-type]
    outcome = watch(now=10.0)
    assert outcome is not None and outcome.code != 0
    assert watch.event is not None and watch.event[0] == "restart" and watch.event[1] == outcome.code
    assert "round 2 was started by another host: stopping this host's workers" in _said(output)
    assert hosts._Watch(_Polled(Status(1, True, (), (), None)), a, _output())(now=10.0) is None  # its own round
