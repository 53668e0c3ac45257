"""The rendezvous across hosts: its store (secure by default, robust to hostile peers, every wait bounded) and rounds.

Hosts are launchers in threads of this process, and a few real processes where a
SIGKILL must be seen (replicator/launch/rendezvous.py, membership.py); the end of a
round of one launcher per host (hosts.py) is run here too, in this process (the jobs
across hosts with real JAX workers are in tests/test_hosts.py). Settings and closing of
a single launcher's rendezvous: tests/test_membership.py.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import io
import json
import math
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import pytest
from utils import finish

from replicator.launch import hosts, membership, processes, rendezvous
from replicator.launch.membership import Assignment, Rendezvous, Status, parse_nnodes
from replicator.launch.rendezvous import RendezvousError, RendezvousTimeout, StoreClient, StoreServer
from replicator.launch.restarts import Outcome

ROOT = Path(__file__).resolve().parent.parent
SECRET = b"0123456789abcdef-test-secret"
#: Heartbeats for the tests: a lost launcher is gone after 1 s, seen within 1.25 s.
FAST = {"heartbeat_interval_s": 0.25, "missed_heartbeats": 4}


@pytest.fixture
def server():
    with StoreServer(handshake_timeout_s=0.5, frame_timeout_s=0.5, idle_timeout_s=5.0) as s:
        yield s


def _raw(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    return sock


def _frame(obj: object) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("!I", len(body)) + body


def _read_frame(sock: socket.socket) -> dict:
    (n,) = struct.unpack("!I", sock.recv(4, socket.MSG_WAITALL))
    return json.loads(sock.recv(n, socket.MSG_WAITALL))


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` within ``within_s`` (whatever it sent before is read and dropped)."""
    sock.settimeout(within_s)
    end = time.monotonic() + within_s
    try:
        while time.monotonic() < end:
            if not sock.recv(1 << 16):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def _served(server: StoreServer) -> None:
    """A fresh client is served at once: the store still works."""
    t0 = time.monotonic()
    with StoreClient(server.address, secret=server.secret, timeout_s=2.0) as c:
        c.set("alive", "yes")
        assert c.get("alive") == "yes"
    assert time.monotonic() - t0 < 1.0


# -- the store ---------------------------------------------------------------------------------------------------


def test_store_operations(server):
    with StoreClient(server.address) as c:
        assert c.get("k") is None
        c.set("k", "v")
        assert c.get("k") == "v"
        assert [c.add("n"), c.add("n", 5), c.add("n", -2)] == [1, 6, 4]
        assert c.compare_set("cas", None, "a") == (True, "a")
        assert c.compare_set("cas", "zzz", "b") == (False, "a")
        assert c.compare_set("cas", "a", "b") == (True, "b")
        c.delete("k")
        assert c.get("k") is None
        with pytest.raises(RendezvousError, match="not a counter"):
            c.add("cas")
        c.heartbeat("m1")
        assert set(c.members()) == {"m1"}
        c.leave("m1")
        assert c.members() == {}


def test_wait_returns_when_another_client_sets_and_times_out_otherwise(server):
    with StoreClient(server.address) as a, StoreClient(server.address) as b:
        threading.Timer(0.3, lambda: b.set("late", "here")).start()
        t0 = time.monotonic()
        assert a.wait(["late"], timeout_s=5.0) == {"late": "here"}
        assert 0.2 < time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        with pytest.raises(RendezvousTimeout, match="not all set"):
            a.wait(["never"], timeout_s=0.4)
        assert time.monotonic() - t0 < 1.5


def test_counter_is_atomic_across_clients(server):
    clients = [StoreClient(server.address) for _ in range(4)]
    threads = [threading.Thread(target=lambda c=c: [c.add("n") for _ in range(50)]) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clients[0].get("n") == "200"
    for c in clients:
        c.close()


# -- secure by default -------------------------------------------------------------------------------------------


def test_non_loopback_bind_needs_a_secret():
    with pytest.raises(ValueError, match="without a shared secret.*--rdzv-secret-file"):
        StoreServer("0.0.0.0").start()
    assert rendezvous.is_loopback("127.0.0.1") and rendezvous.is_loopback("::1") and rendezvous.is_loopback("localhost")
    assert not rendezvous.is_loopback("0.0.0.0") and not rendezvous.is_loopback("")
    with StoreServer("0.0.0.0", secret=SECRET) as s:  # with one: allowed, and reached through loopback too
        with StoreClient(f"127.0.0.1:{s.port}", secret=SECRET) as c:
            c.set("a", "b")


def test_wrong_or_missing_secret_is_refused_and_the_store_goes_on():
    with StoreServer(secret=SECRET, handshake_timeout_s=0.5) as s:
        with pytest.raises(RendezvousError, match="refused this launcher"):
            StoreClient(s.address, secret=b"another-secret-of-enough-bytes")
        with pytest.raises(RendezvousError, match="requires a shared secret"):
            StoreClient(s.address)
        assert any("wrong or missing secret" in d for d in s.dropped)
        _served(s)
    with StoreServer() as s, pytest.raises(RendezvousError, match="does not check a secret"):
        StoreClient(s.address, secret=SECRET)  # a client with a secret does not trust a server without one


class _SlowRecord(collections.deque):
    """A ``dropped`` record that takes its time: what a loaded machine does to the server's thread."""

    def append(self, item):
        time.sleep(0.3)
        super().append(item)


def test_a_refusal_is_recorded_before_the_client_reads_it():
    """The server publishes why it dropped a connection before it sends the refusal: a client (or a test) that
    has read the refusal finds the record, however slow the server's thread is (it once failed 48 times in 300
    on a loaded machine, the record written after the reply)."""
    with StoreServer(secret=SECRET, handshake_timeout_s=2.0) as s:
        s.dropped = _SlowRecord(maxlen=256)
        with pytest.raises(RendezvousError, match="refused this launcher"):
            StoreClient(s.address, secret=b"another-secret-of-enough-bytes")
        assert any("wrong or missing secret" in d for d in s.dropped), list(s.dropped)


def test_a_client_that_skips_the_handshake_gets_nothing(server):
    sock = _raw(server.address)
    _read_frame(sock)  # the server's hello
    sock.sendall(_frame({"op": "get", "key": "k"}))  # no hello: dropped
    assert _closed_by_server(sock, 2.0)
    sock.close()
    with StoreServer(secret=SECRET) as s:
        sock = _raw(s.address)
        hello = _read_frame(sock)
        sock.sendall(_frame({"op": "hello", "nonce": "x" * 32, "mac": "0" * 64}))
        assert _read_frame(sock) == {"ok": False, "error": "wrong or missing secret", "refused": True}
        assert _closed_by_server(sock, 2.0)
        assert hello["auth"] is True


# -- the handshake, field by field (docs/design/rendezvous.md lists each message's fields) -------------------------

_HELLO_FIELDS = {"op": "hello", "nonce": "n" * 32, "mac": "0" * 64}


@pytest.mark.parametrize("missing", ["op", "nonce", "mac"])
def test_a_client_hello_with_a_field_missing_is_dropped_and_the_store_goes_on(missing):
    """The client's hello without one of its fields (not a wrong value: absent) is never taken for a valid one."""
    with StoreServer(secret=SECRET, handshake_timeout_s=2.0) as s:
        sock = _raw(s.address)
        _read_frame(sock)
        sock.sendall(_frame({k: v for k, v in _HELLO_FIELDS.items() if k != missing}))
        assert _closed_by_server(sock, 3.0)
        sock.close()
        why = "wrong or missing secret" if missing == "mac" else "no valid hello"
        assert any(why in d for d in s.dropped), list(s.dropped)
        _served(s)


def _fake_server(hello: dict | None, answer: dict | None) -> tuple[str, threading.Thread]:
    """A one-connection server that sends ``hello`` (raw), reads the client's hello and sends ``answer`` (a
    callable of the client's hello and the server's nonce, or a dict); None: close instead."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            return
        with conn:
            conn.settimeout(10)
            if hello is None:
                return
            conn.sendall(_frame(hello))
            try:
                theirs = _read_frame(conn)
            except (OSError, struct.error, ValueError):
                return
            if answer is not None:
                conn.sendall(_frame(answer(theirs, hello.get("nonce")) if callable(answer) else answer))
            time.sleep(0.2)
        listener.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", t


_SERVER_HELLO = {"service": "replicator-rendezvous", "version": 1, "nonce": "s" * 32, "auth": True}


@pytest.mark.parametrize("missing", ["service", "nonce"])
def test_a_server_hello_with_a_field_missing_is_refused(missing):
    address, t = _fake_server({k: v for k, v in _SERVER_HELLO.items() if k != missing}, {"ok": True})
    with pytest.raises(RendezvousError, match="is not a replicator rendezvous"):
        StoreClient(address, secret=SECRET, connect_timeout_s=2)
    t.join(timeout=5)


@pytest.mark.parametrize("mac", [None, "0" * 64, 17])
def test_a_server_answer_without_the_right_mac_is_refused(mac):
    """The server's proof of the secret missing, wrong or of another type: the client refuses to trust it."""
    answer = {"ok": True} if mac is None else {"ok": True, "mac": mac}
    address, t = _fake_server(_SERVER_HELLO, answer)
    with pytest.raises(RendezvousError, match="does not know the secret"):
        StoreClient(address, secret=SECRET, connect_timeout_s=2)
    t.join(timeout=5)


def test_a_server_that_knows_the_secret_is_trusted_and_the_macs_cover_the_documented_text():
    """The MACs are HMAC-SHA256 of 'replicator-rendezvous|ROLE|A|B' (the design's text), checked in constant time
    on both sides (hmac.compare_digest; a plain == would leak how much of a guess is right)."""

    def mac(role: str, a: str, b: str) -> str:
        return hmac.new(SECRET, f"replicator-rendezvous|{role}|{a}|{b}".encode(), hashlib.sha256).hexdigest()

    seen: dict = {}

    def answer(theirs: dict, ours: str) -> dict:
        seen["client_mac_ok"] = theirs.get("mac") == mac("client", ours, theirs["nonce"])
        return {"ok": True, "mac": mac("server", theirs["nonce"], ours)}

    address, t = _fake_server(_SERVER_HELLO, answer)
    StoreClient(address, secret=SECRET, connect_timeout_s=2).close()
    t.join(timeout=5)
    assert seen == {"client_mac_ok": True}


def test_both_sides_compare_macs_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(rendezvous.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    with StoreServer(secret=SECRET) as s, StoreClient(s.address, secret=SECRET) as c:
        c.set("k", "v")
    assert len(calls) == 2  # the server's check of the client, the client's of the server


@hypothesis.settings(max_examples=40, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(
    hello=st.dictionaries(
        st.sampled_from(["op", "nonce", "mac", "extra"]),
        st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=140), st.lists(st.integers(), max_size=3)),
    )
)
def test_any_hello_but_a_valid_one_is_dropped_never_crashing_the_store(hypothesis_server, hello):
    """Whatever fields a hello has, missing or of any type, the server drops it (or refuses it) and goes on."""
    sock = _raw(hypothesis_server.address)
    _read_frame(sock)
    sock.sendall(_frame(hello))
    assert _closed_by_server(sock, 3.0)
    sock.close()
    _served(hypothesis_server)


@pytest.fixture(scope="module")
def hypothesis_server():
    with StoreServer(secret=SECRET, handshake_timeout_s=2.0) as s:
        yield s


def test_load_secret(tmp_path, monkeypatch):
    monkeypatch.delenv(rendezvous.ENV_SECRET, raising=False)
    assert rendezvous.load_secret() is None
    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    f.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        rendezvous.load_secret(str(f))
    f.chmod(0o600)
    assert rendezvous.load_secret(str(f)) == SECRET
    with pytest.raises(ValueError, match="cannot read"):
        rendezvous.load_secret(str(tmp_path / "missing"))
    assert rendezvous.load_secret(environ={rendezvous.ENV_SECRET: SECRET.decode()}) == SECRET
    with pytest.raises(ValueError, match="at least 16"):
        rendezvous.load_secret(environ={rendezvous.ENV_SECRET: "short"})


# -- hostile peers: the connection is dropped, the store goes on ---------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        pytest.param(b"\xff" + os.urandom(4095), "message length", id="random-bytes"),
        pytest.param(struct.pack("!I", 0xFFFFFFFF), "message length", id="huge-length"),
        pytest.param(struct.pack("!I", 0), "message length", id="zero-length"),
        pytest.param(struct.pack("!I", 9) + b"not json!", "not JSON", id="not-json"),
        pytest.param(_frame([1, 2]), "not a JSON object", id="json-not-object"),
        pytest.param(struct.pack("!I", 60000) + b"[" * 60000, "not JSON", id="deep-nesting"),
        pytest.param(struct.pack("!I", 4) + b"\xff\xfe\xfd\xfc", "not JSON", id="not-utf8"),
    ],
)
def test_malformed_messages_drop_the_connection_not_the_store(server, payload, why):
    sock = _raw(server.address)
    _read_frame(sock)
    t0 = time.monotonic()
    sock.sendall(payload)
    assert _closed_by_server(sock, 2.0)
    assert time.monotonic() - t0 < 0.4  # at once: not by the frame timeout (0.5 s)
    assert why in server.dropped[-1]
    sock.close()
    _served(server)


def test_malformed_requests_after_the_handshake(server):
    with StoreClient(server.address) as c:
        for bad in (
            {"op": "nope"},
            {"op": "set", "key": 1, "value": "v"},
            {"op": "add", "key": "n", "amount": True},
            {"op": "wait", "keys": [], "timeout": 1},
            {"op": "wait", "keys": ["k"], "timeout": -1},
            {"op": "wait", "keys": ["k"], "timeout": 1e309},  # json: Infinity
        ):
            with pytest.raises(RendezvousError, match="refused"):
                c._call(bad)
        c.set("still", "fine")  # an error answer leaves the connection usable
        assert c.get("still") == "fine"
    # a frame that arrives after the handshake but is not JSON: dropped, like before it
    sock = _raw(server.address)
    _read_frame(sock)
    sock.sendall(_frame({"op": "hello", "nonce": "n" * 32}))
    assert _read_frame(sock)["ok"]
    sock.sendall(struct.pack("!I", 3) + b"{{{")
    assert _closed_by_server(sock, 2.0)
    _served(server)


def test_silent_and_slow_clients_are_dropped_while_others_are_served(server):
    silent = _raw(server.address)  # connects, never says anything
    slow = _raw(server.address)  # slowloris: one byte at a time
    _read_frame(slow)
    stop = threading.Event()

    def dribble() -> None:
        body = _frame({"op": "hello", "nonce": "n" * 32})
        for b in body:
            if stop.wait(0.15):
                return
            try:
                slow.sendall(bytes([b]))
            except OSError:
                return

    t = threading.Thread(target=dribble)
    t.start()
    _served(server)  # meanwhile
    t0 = time.monotonic()
    assert _closed_by_server(silent, 3.0)
    assert _closed_by_server(slow, 3.0)
    assert time.monotonic() - t0 < 2.0  # the handshake/frame bound (0.5 s here), with slack
    stop.set()
    t.join()
    _served(server)


def test_a_full_store_evicts_its_oldest_unauthenticated_connection_for_a_new_one():
    with StoreServer(max_connections=4, handshake_timeout_s=30) as s:
        hogs = [_raw(s.address) for _ in range(4)]
        for h in hogs:
            _read_frame(h)  # each was accepted (the server's hello)
        extra = _raw(s.address)
        assert _read_frame(extra)["service"]  # taken in, long before any handshake timeout
        assert _closed_by_server(hogs[0], 5.0)  # the oldest made room
        assert any("evicted unauthenticated" in d for d in s.dropped), list(s.dropped)
        _served(s)  # and a real client gets in too (evicting the next hog)
        for h in [*hogs, extra]:
            h.close()


def test_a_client_told_ok_is_never_evicted_by_a_newcomer():
    """Found by a full run under load: the server told a client "ok" and only then counted it authenticated,
    so a newcomer arriving in between evicted a client that had already been let in. A server slow after
    each handshake widens that window to half a second."""

    class SlowAfterHandshake(StoreServer):
        def _handshake(self, conn):
            super()._handshake(conn)
            time.sleep(0.5)

    with SlowAfterHandshake(max_connections=2) as s:
        first, second = StoreClient(s.address), StoreClient(s.address)  # both told "ok"
        newcomer = _raw(s.address)
        deadline = time.monotonic() + 10
        while not s.dropped and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [d for d in s.dropped if "over 2 connections" in d], list(s.dropped)  # turned away
        assert not [d for d in s.dropped if "evicted" in d], list(s.dropped)
        first.set("k", "v")
        assert second.get("k") == "v"
        newcomer.close()
        first.close()
        second.close()


def test_a_full_store_of_authenticated_clients_turns_a_newcomer_away_until_one_leaves():
    """Authenticated connections are never evicted: a newcomer's connection is closed at once ("over N
    connections"), and the client tries again within its connect timeout, getting in when a slot frees."""
    with StoreServer(max_connections=2) as s:
        first, second = StoreClient(s.address), StoreClient(s.address)
        box: list = []

        def come() -> None:
            try:
                box.append(StoreClient(s.address, connect_timeout_s=20))
            except BaseException as e:  # noqa: BLE001 - reported by the test
                box.append(e)

        t = threading.Thread(target=come)
        t.start()
        deadline = time.monotonic() + 10
        while not any("over 2 connections" in d for d in s.dropped) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("over 2 connections" in d for d in s.dropped), list(s.dropped)
        assert not box  # still trying
        first.close()
        t.join(timeout=20)
        assert isinstance(box[0], StoreClient), box
        box[0].set("k", "v")
        assert second.get("k") == "v"
        with pytest.raises(RendezvousError, match=r"tries in 0.5 s\): the store may be at its connection limit"):
            StoreClient(s.address, connect_timeout_s=0.5)  # full again: gives up at its deadline, saying why
        for c in (second, box[0]):
            c.close()


def test_a_flood_of_idle_connections_does_not_keep_a_launcher_out():
    """140 silent sockets against the store's 128 connections: a launcher joins at once, not after the flood's
    handshake timeout (30 s here); before, it failed at once ("closed the connection")."""
    with StoreServer(handshake_timeout_s=30) as s:
        flood = [_raw(s.address) for _ in range(140)]
        try:
            started = time.monotonic()
            with Rendezvous(s.address, min_hosts=1, launcher_id="late", last_call_s=0.0, **FAST) as r:
                assert r.join().members == ("late",)
            assert time.monotonic() - started < 15  # far below the flood's 30 s
        finally:
            for f in flood:
                f.close()


def test_every_client_call_is_bounded():
    # nothing listens: connecting gives up after connect_timeout_s, naming the address
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(RendezvousTimeout, match=f"no rendezvous at 127.0.0.1:{port} after 0.5 s"):
        StoreClient(f"127.0.0.1:{port}", connect_timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0
    # something listens but never answers: the handshake is bounded by timeout_s
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match="no valid answer"):
            StoreClient(f"127.0.0.1:{mute.getsockname()[1]}", timeout_s=0.5)
        assert time.monotonic() - t0 < 2.0
    # the store goes away: the next call says so, naming it
    s = StoreServer().start()
    c = StoreClient(s.address)
    s.close()
    with pytest.raises(RendezvousError, match=f"rendezvous at {s.address}"):
        c.get("k")


# -- rounds ------------------------------------------------------------------------------------------------------


def _join_all(address: str, specs: list[dict], **kw) -> tuple[list[Rendezvous], list[Assignment | BaseException]]:
    """Start one launcher per spec in threads, join them all; their rendezvous and assignments (or errors)."""
    rdzvs = [Rendezvous(address, **{**FAST, "last_call_s": 0.5, "join_timeout_s": 10.0, **kw, **s}) for s in specs]
    results: list[Assignment | BaseException] = [RuntimeError("not joined")] * len(rdzvs)

    def go(i: int) -> None:
        try:
            results[i] = rdzvs[i].start().join()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(rdzvs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    return rdzvs, results


def _agree(results: list) -> None:
    """Every launcher got the same round, members and coordinator, and its own place in it."""
    assert all(isinstance(r, Assignment) for r in results), results
    first = results[0]
    for r in results:
        assert (r.round, r.members, r.coordinator, r.num_hosts) == (
            first.round,
            first.members,
            first.coordinator,
            first.num_hosts,
        )
    assert sorted(r.host_rank for r in results) == list(range(len(results)))


def test_parse_nnodes():
    assert parse_nnodes("3") == (3, 3) and parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "3:2", "a", "1:2:3", ""):
        with pytest.raises(ValueError, match="MIN:MAX"):
            parse_nnodes(bad)


def test_fixed_hosts_agree_and_asked_ranks_are_honored(server):
    specs = [
        {"launcher_id": "a", "rank": 2, "address": "10.0.0.1"},
        {"launcher_id": "b", "address": "10.0.0.2"},
        {"launcher_id": "c", "rank": 0, "address": "10.0.0.3", "coordinator_port": 4242},
    ]
    rdzvs, results = _join_all(server.address, specs, min_hosts=3)
    _agree(results)
    by_id = {r.members[r.host_rank]: r for r in results}
    assert by_id["a"].host_rank == 2 and by_id["c"].host_rank == 0 and by_id["b"].host_rank == 1
    assert results[0].coordinator == "10.0.0.3:4242"  # host rank 0's address and port
    assert results[0].addresses == ("10.0.0.3", "10.0.0.2", "10.0.0.1")
    for r in rdzvs:
        r.close()


def test_a_taken_rank_is_refused(server):
    with Rendezvous(server.address, min_hosts=2, rank=1, launcher_id="a", **FAST) as first:
        t = threading.Thread(target=lambda: pytest.raises(RendezvousTimeout, first.join))
        first.join_timeout_s = 1.0
        t.start()
        time.sleep(0.3)
        with Rendezvous(server.address, min_hosts=2, rank=1, launcher_id="b", **FAST) as second:
            with pytest.raises(RendezvousError, match="host rank 1 is taken by launcher a"):
                second.join()
        t.join()


def test_launchers_given_another_nnodes_or_a_foreign_state_are_refused(server):
    with Rendezvous(server.address, min_hosts=2, launcher_id="a", join_timeout_s=1.0, **FAST) as a:
        a._enter(*a._state())
        with Rendezvous(server.address, min_hosts=1, max_hosts=3, launcher_id="b", **FAST) as b:
            with pytest.raises(RendezvousError, match="runs on 2 hosts but this launcher was given --nnodes 1:3"):
                b.join()
        a.client.set("rdzv/state", '{"not": "ours"}')
        with pytest.raises(RendezvousError, match="not one this launcher wrote"):
            a.join()


def test_min_max_closes_after_last_call_and_a_late_host_joins_the_next_round(server):
    rdzvs, results = _join_all(server.address, [{"launcher_id": "a"}, {"launcher_id": "b"}], min_hosts=1, max_hosts=3)
    _agree(results)
    assert results[0].num_hosts == 2 and results[0].round == 0
    a, b = rdzvs
    late = Rendezvous(server.address, min_hosts=1, max_hosts=3, launcher_id="c", last_call_s=0.5, **FAST).start()
    box: list = []
    t = threading.Thread(target=lambda: box.append(late.join()))
    t.start()
    time.sleep(0.5)
    assert not box and a.poll().waiting == ("c",)  # round 0 is closed: c waits
    # a failure on host b: a restart; every launcher sees round 1 and joins it, c too
    assert b.next_round(0, "worker on b failed") == 1
    assert a.next_round(0, "the same failure, seen by a") == 1  # already done: no second restart
    assert a.poll().round == 1
    again = [None, None]
    ts = [threading.Thread(target=lambda i=i, r=r: again.__setitem__(i, r.join())) for i, r in enumerate(rdzvs)]
    for x in ts:
        x.start()
    for x in [*ts, t]:
        x.join(timeout=10)
    new = [*again, *box]
    _agree(new)
    assert new[0].round == 1 and new[0].num_hosts == 3
    assert new[0].members[:2] == results[0].members  # the hosts of round 0 keep their ranks
    for r in [*rdzvs, late]:
        r.close()


def _restart(server: StoreServer, **kw) -> tuple[Rendezvous, Rendezvous, Assignment]:
    """Launchers 'a' (host rank 0) and 'b' (1) under --nnodes 1:2 in round 0; 'b' starts a restart (its worker
    failed). Returns a and b."""
    rdzvs, results = _join_all(
        server.address, [{"launcher_id": "a", "rank": 0}, {"launcher_id": "b", "rank": 1}], min_hosts=1, max_hosts=2
    )
    _agree(results)
    a, b = rdzvs
    assert b.next_round(0, "host rank 1: worker 1 was killed") == 1
    return a, b


def _join_in_thread(r: Rendezvous) -> tuple[threading.Thread, list]:
    box: list = []

    def go() -> None:
        try:
            box.append(r.join())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            box.append(e)

    t = threading.Thread(target=go)
    t.start()
    return t, box


def test_a_restart_round_waits_for_a_host_that_still_heartbeats(server):
    """Host 0 is slow to stop its workers (longer than the last call): the restart round waits for it instead
    of closing with host 1 alone (a healthy host dropped without a word, the job's result changed)."""
    a, b = _restart(server)
    t, box = _join_in_thread(b)
    time.sleep(3 * b.last_call_s)  # a is still stopping its workers; it heartbeats
    assert not box, box  # round 1 is still open: it waits for a
    assert a.join().members == ("a", "b")  # a comes: the round closes with both, ranks kept
    t.join(timeout=10)
    assert isinstance(box[0], Assignment) and box[0].members == ("a", "b") and not box[0].left and not box[0].lost
    for r in (a, b):
        r.close()


def test_a_host_that_does_not_rejoin_in_time_is_named_and_never_told_success(server):
    """Past the rejoin timeout the round closes without the heartbeating host: the others are told its rank left
    the job; it is told so when it comes, even after the job ended with success."""
    a, b = _restart(server)
    b.rejoin_timeout_s = a.rejoin_timeout_s = 1.0
    t, box = _join_in_thread(b)
    t.join(timeout=10)
    got = box[0]
    assert isinstance(got, Assignment) and got.members == ("b",), got
    assert (got.left, got.lost, got.previous_hosts) == ((("a", 0),), (), 2)
    b.end('{"code": 0, "reason": "every host\'s workers finished (round 1)"}')
    with pytest.raises(membership.LeftOut, match="host rank 0 left the job at round 1"):
        a.join()
    for r in (a, b):
        r.close()


def test_a_restart_round_goes_on_without_a_host_that_is_gone_and_names_it(server):
    a, b = _restart(server)
    a.close(leave=False)  # its heartbeats stop: as if killed
    t, box = _join_in_thread(b)
    t.join(timeout=10 + b.detection_bound_s)
    got = box[0]
    assert isinstance(got, Assignment) and got.members == ("b",), got
    assert (got.left, got.lost, got.previous_hosts) == ((), (("a", 0),), 2)
    b.close()


def test_the_rejoin_timeout_is_below_the_join_timeout():
    with pytest.raises(ValueError, match="below the join timeout"):
        Rendezvous("127.0.0.1:1", min_hosts=1, join_timeout_s=5.0, rejoin_timeout_s=5.0)
    assert Rendezvous("127.0.0.1:1", min_hosts=1, join_timeout_s=10.0).rejoin_timeout_s == 5.0


def test_asked_ranks_are_honoured_in_every_round_not_only_the_first(server):
    """--node-rank holds after a restart too, whatever order the launchers rejoin in, and a taken rank is still
    refused in a later round."""
    specs = [{"launcher_id": "x", "rank": 1}, {"launcher_id": "y", "rank": 0}]
    rdzvs, results = _join_all(server.address, specs, min_hosts=2)
    _agree(results)
    assert results[0].members == ("y", "x")
    x, y = rdzvs
    assert x.next_round(0, "a failure") == 1
    t, box = _join_in_thread(x)  # x rejoins first this time: it still gets rank 1, not the free rank 0
    time.sleep(0.3)
    assert not box
    assert y.join().members == ("y", "x")
    t.join(timeout=10)
    assert box[0].host_rank == 1
    assert y.next_round(1, "another failure") == 2
    with Rendezvous(server.address, min_hosts=2, rank=0, launcher_id="intruder", **FAST) as intruder:
        t, box = _join_in_thread(y)
        deadline = time.monotonic() + 5
        while "y" not in [j["id"] for j in y._state()[1]["joined"]] and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RendezvousError, match="host rank 0 is taken by launcher y"):
            intruder.join()
    x.join()
    t.join(timeout=10)
    assert box[0].members == ("y", "x") and box[0].round == 2
    for r in rdzvs:
        r.close()


_launchers = st.lists(
    st.tuples(st.one_of(st.none(), st.integers(0, 5)), st.one_of(st.none(), st.integers(0, 5))),
    min_size=1,
    max_size=6,
)


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(_launchers)
def test_ranks_are_a_permutation_honouring_asked_then_previous_ranks(launchers):
    """membership._ranks over any joined launchers (each with an asked rank or none, a previous rank or none):
    every launcher gets exactly one of 0..n-1; an asked rank below n that no earlier launcher asked for is
    given; a previous rank below n is kept when nobody asked for it and no earlier launcher had it."""
    joined = [{"id": f"l{i}", "rank": asked} for i, (asked, _) in enumerate(launchers)]
    prev = {f"l{i}": p for i, (_, p) in enumerate(launchers) if p is not None}
    ranks = membership._ranks(joined, prev)
    n = len(joined)
    assert sorted(ranks) == sorted(j["id"] for j in joined) and len(ranks) == n
    asked_first = {}
    for j in joined:
        if j["rank"] is not None and j["rank"] < n:
            asked_first.setdefault(j["rank"], j["id"])
    for rank, lid in asked_first.items():
        assert ranks[rank] == lid
    kept_first = {}
    for j in joined:
        p = prev.get(j["id"])
        if p is not None and p < n and p not in asked_first and j["id"] not in asked_first.values():
            kept_first.setdefault(p, j["id"])
    for rank, lid in kept_first.items():
        assert ranks[rank] == lid


def test_a_lost_launcher_is_dropped_from_an_open_round(server):
    ghost = Rendezvous(server.address, min_hosts=1, max_hosts=2, launcher_id="ghost", last_call_s=60, **FAST).start()
    ghost._enter(*ghost._state())
    ghost.close(leave=False)  # its heartbeats stop: as if killed
    time.sleep(ghost.detection_bound_s)
    rdzvs, results = _join_all(server.address, [{"launcher_id": "a"}], min_hosts=1, max_hosts=2)
    assert results[0].members == ("a",)
    rdzvs[0].close()


def test_join_is_bounded_and_names_who_joined(server):
    with Rendezvous(server.address, min_hosts=2, launcher_id="alone", join_timeout_s=0.6, **FAST) as r:
        t0 = time.monotonic()
        with pytest.raises(RendezvousTimeout, match=r"1 of 2\.\.2 hosts joined \(alone\)"):
            r.join()
        assert time.monotonic() - t0 < 2.0


def test_a_host_gone_before_a_fixed_size_restart_ends_the_join(server):
    rdzvs, results = _join_all(server.address, [{"launcher_id": "a"}, {"launcher_id": "b"}], min_hosts=2)
    _agree(results)
    a, b = rdzvs
    rank_b = results[1].host_rank
    b.close(leave=False)
    a.next_round(0, "b's worker failed")
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=f"host rank {rank_b} \\(launcher b\\) of round 0 is gone"):
        a.join()
    assert time.monotonic() - t0 <= a.detection_bound_s + 0.5
    a.close()


# -- real processes ---------------------------------------------------------------------------------------------

_LAUNCHER = """
import json, sys, time
from replicator.launch.membership import Rendezvous
r = Rendezvous(sys.argv[1], min_hosts=2, launcher_id=sys.argv[2], heartbeat_interval_s=0.25, missed_heartbeats=4,
               last_call_s=0.5, join_timeout_s=30).start()
a = r.join()
print(json.dumps(a.__dict__), flush=True)
time.sleep(120)
"""

_STORE = """
import sys, time
from replicator.launch.rendezvous import StoreServer
s = StoreServer().start()
print(s.address, flush=True)
time.sleep(120)
"""


def _python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )


def _wait_gone(r: Rendezvous, launcher: str, within_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s + 2.0:
        if any(g[0] == launcher for g in r.poll().gone):
            return time.monotonic() - t0
        time.sleep(0.05)
    return math.inf


@pytest.mark.multiprocess
def test_a_sigkilled_launcher_process_is_seen_gone_within_the_bound(server):
    child = _python(_LAUNCHER, server.address, "child")
    try:
        with Rendezvous(
            server.address, min_hosts=2, launcher_id="here", last_call_s=0.5, join_timeout_s=30, **FAST
        ) as r:
            mine = r.join()
            theirs = Assignment(**{**json.loads(child.stdout.readline()), "members": (), "addresses": ()})
            assert (theirs.round, theirs.coordinator) == (mine.round, mine.coordinator)
            assert {theirs.host_rank, mine.host_rank} == {0, 1}
            assert r.poll().gone == ()
            child.kill()
            took = _wait_gone(r, "child", r.detection_bound_s)
            assert took <= r.detection_bound_s, f"seen gone after {took:.2f} s, bound {r.detection_bound_s} s"
    finally:
        child.kill()
        child.wait()


@pytest.mark.multiprocess
def test_a_sigkilled_rendezvous_host_ends_the_others_within_the_bound():
    store = _python(_STORE)
    try:
        address = store.stdout.readline().strip()
        r = Rendezvous(address, min_hosts=1, launcher_id="left", last_call_s=0.0, **FAST).start()
        r.join()
        store.kill()
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match=f"rendezvous at {address}"):
            while time.monotonic() - t0 < 2 * r.detection_bound_s + 1.0:
                r.poll()
                time.sleep(0.05)
        assert time.monotonic() - t0 <= r.detection_bound_s
        r.close()
    finally:
        store.kill()
        store.wait()


@pytest.mark.multiprocess
def test_a_frozen_rendezvous_host_ends_the_others_within_the_bound():
    store = _python(_STORE)  # SIGSTOP: its connections stay open but nothing answers (an unreachable host)
    try:
        address = store.stdout.readline().strip()
        r = Rendezvous(address, min_hosts=1, launcher_id="left", last_call_s=0.0, **FAST).start()
        r.join()
        os.kill(store.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match=f"rendezvous at {address}"):
            while time.monotonic() - t0 < 2 * r.detection_bound_s + 1.0:
                r.poll()
                time.sleep(r.heartbeat_interval_s)
        assert time.monotonic() - t0 <= r.detection_bound_s + r.heartbeat_interval_s
        r.close(leave=False)
    finally:
        store.kill()
        store.wait()


def test_serve_if_here():
    s = membership.serve_if_here("127.0.0.1:0", None)
    assert s is not None
    try:
        assert membership.serve_if_here(s.address, None) is None  # taken: another launcher hosts it
        with pytest.raises(ValueError, match="without a shared secret"):
            membership.serve_if_here("0.0.0.0:0", None)
    finally:
        s.close()


# -- hosts: one launcher per host, each a real process (replicator/launch/hosts.py) ---------------------------------

TOY = str(ROOT / "tests" / "multiproc" / "toy_worker.py")

_HOST = """
import os, sys
from replicator.launch import hosts, membership
from replicator.launch.environment import worker_command
endpoint, nnodes, name, serve, max_restarts, *rest = sys.argv[1:]
low, high = membership.parse_nnodes(nnodes)
store = membership.serve_if_here(endpoint, None) if serve == "serve" else None
last_call, kill_grace = float(os.environ.get("LAST_CALL_S", "3")), float(os.environ.get("KILL_GRACE_S", "1"))
r = membership.Rendezvous(endpoint, min_hosts=low, max_hosts=high, launcher_id=name, heartbeat_interval_s=0.25,
                          missed_heartbeats=4, last_call_s=last_call, join_timeout_s=30).start()
code = hosts.run_host(worker_command(rest), r, max_restarts=int(max_restarts), kill_grace_s=kill_grace, store=store)
r.close()
sys.exit(code)
"""
#: The hosts' heartbeats above: a lost host or rendezvous is seen within 1.25 s.
HOST_BOUND_S = 1.25


def _hosts(
    nnodes: str, max_restarts: int, toy_args: list[str], n: int = 2, env: dict[str, str] | None = None
) -> tuple[str, list[subprocess.Popen]]:
    """``n`` host launchers (processes) on one machine; the first hosts the rendezvous. ``env``: more variables
    (``LAST_CALL_S``, ``KILL_GRACE_S``: the launchers' settings, 3 and 1 s by default)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    procs = []
    for i in range(n):
        args = [endpoint, nnodes, f"h{i}", "serve" if i == 0 else "join", str(max_restarts), TOY, *toy_args]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _HOST, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        )
        if i == 0:
            StoreClient(endpoint, connect_timeout_s=30).close()  # host 0 serves before the others come
    return endpoint, procs


def _finish(procs: list[subprocess.Popen], timeout_s: float = 60) -> list[tuple[int, str]]:
    return finish(procs, timeout_s)


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float = 30) -> list[str]:
    lines: list[str] = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        lines.append(line)
        if needle in line or not line:
            return lines
    return lines


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("how", "how_said"),
    [([], "failed with exit code 3"), (["--signal", "KILL"], "was killed by SIGKILL")],
    ids=["exit", "sigkill"],
)
def test_a_worker_failure_on_one_host_restarts_every_host(how, how_said):
    toy = ["--fail-worker", "1", "--fail-starts", "1", "--after", "0.3", "--sleep", "1.5", *how]
    _, procs = _hosts("2", 2, [*toy, "--env", "REPLICATOR_RESTART_COUNT", "REPLICATOR_NUM_WORKERS"])
    (rc0, out0), (rc1, out1) = _finish(procs)
    assert (rc0, rc1) == (0, 0), out0 + out1
    assert "round 1 was started by another host" in out0
    assert f"restart 1 of at most 2, cause: host rank 1: worker 1 {how_said}" in out1
    for out in (out0, out1):
        assert "REPLICATOR_RESTART_COUNT=1" in out and "REPLICATOR_NUM_WORKERS=2" in out
        assert "every host's workers finished (round 1)" in out


@pytest.mark.multiprocess
def test_a_host_slower_to_stop_than_the_last_call_is_waited_for_not_dropped():
    """The issue's reproduction: under 1:2, host 1's worker fails while host 0's ignores SIGTERM, so host 0 takes
    the whole kill grace (8 s) to stop, longer than the last call (6 s: round 0 closes as soon as both hosts
    joined, however loaded the machine). Round 1 waits for host 0: both hosts run it (before: it closed with
    host 1 alone, and host 0 exited 0 saying every host's workers finished)."""
    toy = ["--fail-worker", "1", "--after", "1", "--fail-starts", "1", "--ignore-sigterm", "--sleep", "30"]
    toy += ["--restart-sleep", "0.5"]
    _, procs = _hosts("1:2", 2, toy, env={"LAST_CALL_S": "6", "KILL_GRACE_S": "8"})
    (rc0, out0), (rc1, out1) = _finish(procs)
    assert "round 0: host rank 0 of 2" in out0, out0[-3000:]  # both in round 0
    assert (rc0, rc1) == (0, 0), out0[-3000:] + out1[-3000:]
    assert "round 1: host rank 0 of 2" in out0 and "round 1: host rank 1 of 2" in out1, out0[-3000:] + out1[-3000:]
    assert "left the job" not in out0 + out1


def test_a_failure_after_the_last_restart_ends_every_host_with_its_code():
    _, procs = _hosts("2", 0, ["--fail-worker", "1", "--after", "0.3", "--sleep", "5"])
    (rc0, out0), (rc1, out1) = _finish(procs)
    assert (rc0, rc1) == (3, 3), out0 + out1
    assert "the job ended: host rank 1: worker 1 failed with exit code 3" in out0 and "no restart left" in out0
    assert "round 1" not in out0 + out1  # no restart: --max-restarts 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("nnodes", ["2", "1:2"])
def test_a_sigkilled_host_launcher(nnodes):
    # Round 0 closes as soon as both hosts joined; a long last call keeps a slow-starting host 1 in it under
    # 1:2 (with 3 s it once closed without it on a loaded machine).
    _, procs = _hosts(nnodes, 1, ["--sleep", "3"], env={"LAST_CALL_S": "20"})
    assert "host rank 1 of 2" in _wait_for_line(procs[1], "round 0")[-1]
    time.sleep(0.3)
    os.killpg(procs[1].pid, signal.SIGKILL)  # its launcher and its worker: the host is gone
    t0 = time.monotonic()
    (rc0, out0), _ = _finish(procs)
    took = time.monotonic() - t0
    if nnodes == "2":  # the job ends within the bound, naming the host
        assert rc0 == hosts.HOST_LOST_EXIT_CODE, out0
        assert "host rank 1 (launcher h1" in out0 and "at least 2 hosts needed" in out0
        assert took <= HOST_BOUND_S + 1.0 + 1.0, (took, out0)  # + the kill grace + slack for stopping
    else:  # the job goes on without it and finishes
        assert rc0 == 0, out0
        assert "round 1: host rank 0 of 1" in out0 and "every host's workers finished (round 1)" in out0


@pytest.mark.multiprocess
def test_a_sigkilled_rendezvous_host_ends_the_other_hosts_within_the_bound():
    _, procs = _hosts("2", 1, ["--sleep", "5"])
    _wait_for_line(procs[1], "round 0")
    time.sleep(0.3)
    os.killpg(procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    _, (rc1, out1) = _finish(procs)
    took = time.monotonic() - t0
    assert rc1 == hosts.HOST_LOST_EXIT_CODE, out1
    assert "rendezvous lost: " in out1 and "127.0.0.1:" in out1
    assert took <= HOST_BOUND_S + 1.0 + 1.0, (took, out1)


def test_a_launcher_that_comes_after_the_end_is_told(server):
    with Rendezvous(server.address, min_hosts=1, launcher_id="a", last_call_s=0.0, **FAST) as a:
        a.join()
        assert a.end("finished") == "finished"
        assert a.end("a later reason") == "finished"  # the first reason stands
        with Rendezvous(server.address, min_hosts=1, launcher_id="late", join_timeout_s=2, **FAST) as late:
            with pytest.raises(RendezvousError, match="the job has ended: finished"):
                late.join()


def test_a_join_stops_when_its_launcher_is_interrupted(server):
    stop = threading.Event()
    with Rendezvous(server.address, min_hosts=2, launcher_id="a", join_timeout_s=30, **FAST) as a:
        threading.Timer(0.3, stop.set).start()
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match="stopped while waiting for round 0 to close"):
            a.join(stop=stop)
        assert time.monotonic() - t0 < 2.0


# -- the wire protocol's hello and the client's default bound ----------------------------------------------------


@pytest.mark.parametrize("secret", [None, SECRET])
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


# -- one launcher per host (hosts.py): the end of a round, in this process ---------------------------------------


def _output() -> processes.Output:
    return processes.Output(io.StringIO(), io.StringIO())


def _said(output: processes.Output) -> str:
    assert isinstance(output.stderr, io.StringIO)
    return output.stderr.getvalue()


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
    a = Assignment(1, 0, 2, ("a", "b"), ("h0", "h1"), "h0:1")
    output = _output()
    watch = hosts._Watch(_Polled(Status(2, True, (), (), None)), a, output)  # type: ignore[arg-type]
    outcome = watch(now=10.0)
    assert outcome is not None and outcome.code != 0
    assert watch.event is not None and watch.event[0] == "restart" and watch.event[1] == outcome.code
    assert "round 2 was started by another host: stopping this host's workers" in _said(output)
    assert hosts._Watch(_Polled(Status(1, True, (), (), None)), a, _output())(now=10.0) is None  # its own round
