"""The rendezvous store: a small key-value store on one host that every host's launcher reaches over TCP.

torchrun's c10d rendezvous keeps its state in such a store (``TCPStore``), hosted
by one agent; this is the same idea, in the standard library only, with the
security that the c10d store lacks (see ``docs/design/rendezvous.md`` for why not
JAX's coordination service or ``multiprocessing.connection``)::

    server = StoreServer().start()  # 127.0.0.1 at a free port; another host needs a secret
    client = StoreClient(server.address)
    client.set("greeting", "hello")
    client.wait(["greeting"], timeout_s=1.0)  # {'greeting': 'hello'}

The protocol: each message is a 4-byte big-endian length and that many bytes of
UTF-8 JSON holding one object, at most :data:`MAX_MESSAGE_BYTES`. The server
speaks first with a random nonce; with a shared secret each side proves it
knows the secret by an HMAC-SHA256 of both nonces (compared with
:func:`hmac.compare_digest`), and a client that cannot is told so and
dropped. Nothing is ever unpickled. A connection that sends anything
malformed (a length out of range, bytes that are not a JSON object), that
does not finish its handshake within ``handshake_timeout_s``, a message within
``frame_timeout_s`` of its first byte (a slow sender), or says nothing for
``idle_timeout_s``, is closed; the other connections are served meanwhile,
each by its own thread, at most ``max_connections`` at a time. A full store
makes room for a newcomer by closing its oldest connection still in its
handshake (an authenticated one is never closed for room; with none to close,
the newcomer is closed at once), and every drop is recorded in
``StoreServer.dropped`` before any refusal is sent. A client retries a
handshake the server closed without refusing it (backoff 0.1 s doubling to
1 s, within ``connect_timeout_s``); a refusal is final. Every client
call has a timeout. Traffic is authenticated, not encrypted: keys and values
must not be secrets.

Promises:

1. The server speaks first (service, version 1, a nonce); with a secret each
   side proves it by an HMAC of both nonces over the documented text
   (tests/test_rendezvous.py::test_the_server_speaks_first_with_service_version_1_and_a_nonce,
   tests/test_rendezvous.py::test_a_server_that_knows_the_secret_is_trusted_and_the_macs_cover_the_documented_text).
2. A client with a wrong or missing secret is refused, at once and for good,
   and the store goes on; a client with a secret does not trust a server
   without one (tests/test_rendezvous.py::test_wrong_or_missing_secret_is_refused_and_the_store_goes_on).
3. A handshake field missing on either side ends that handshake: the client's
   hello is dropped and the store goes on, the server's hello is refused by
   the client (tests/test_rendezvous.py::test_a_client_hello_with_a_field_missing_is_dropped_and_the_store_goes_on,
   tests/test_rendezvous.py::test_a_server_hello_with_a_field_missing_is_refused); any hello but a valid
   one is dropped, never crashing the store
   (tests/test_rendezvous.py::test_any_hello_but_a_valid_one_is_dropped_never_crashing_the_store).
4. A server answer without the right MAC is refused
   (tests/test_rendezvous.py::test_a_server_answer_without_the_right_mac_is_refused), and both
   sides compare MACs in constant time
   (tests/test_rendezvous.py::test_both_sides_compare_macs_in_constant_time).
5. A store that other machines reach needs a secret
   (tests/test_rendezvous.py::test_non_loopback_bind_needs_a_secret), read from a private file or
   the environment (tests/test_rendezvous.py::test_load_secret).
6. Malformed bytes drop their connection at once, never the store
   (tests/test_rendezvous.py::test_malformed_messages_drop_the_connection_not_the_store); a
   malformed request after the handshake is answered with an error and the
   connection goes on (tests/test_rendezvous.py::test_malformed_requests_after_the_handshake);
   a client that skips the handshake gets nothing
   (tests/test_rendezvous.py::test_a_client_that_skips_the_handshake_gets_nothing).
7. Silent and slow connections are closed within their timeouts while the
   others are served (tests/test_rendezvous.py::test_silent_and_slow_clients_are_dropped_while_others_are_served).
8. A full store closes its oldest unauthenticated connection for a newcomer,
   never an authenticated one (the newcomer is turned away until one leaves),
   so a flood of idle connections does not keep a launcher out
   (tests/test_rendezvous.py::test_a_full_store_evicts_its_oldest_unauthenticated_connection_for_a_new_one,
   tests/test_rendezvous.py::test_a_full_store_of_authenticated_clients_turns_a_newcomer_away_until_one_leaves,
   tests/test_rendezvous.py::test_a_flood_of_idle_connections_does_not_keep_a_launcher_out); a
   connection counts as authenticated before its client is told "ok"
   (tests/test_rendezvous.py::test_a_client_told_ok_is_never_evicted_by_a_newcomer).
9. Every drop is recorded before any refusal is sent
   (tests/test_rendezvous.py::test_a_refusal_is_recorded_before_the_client_reads_it).
10. Nothing hangs: every client call answers within its timeout (10 s by
    default), connecting included
    (tests/test_rendezvous.py::test_every_client_call_is_bounded,
    tests/test_rendezvous.py::test_a_store_client_bounds_each_call_by_10_s_by_default); a wait
    returns once its keys are set, else at its timeout
    (tests/test_rendezvous.py::test_wait_returns_when_another_client_sets_and_times_out_otherwise).
11. ``add`` and ``compare_set`` are atomic across clients
    (tests/test_rendezvous.py::test_counter_is_atomic_across_clients,
    tests/test_rendezvous.py::test_store_operations).
12. The store holds at most ``MAX_STORE_BYTES`` bytes and ``MAX_KEYS``
    keys: a change beyond is answered with an error, and the store goes on
    (tests/test_rendezvous_promises.py::test_the_store_is_bounded_and_a_full_store_answers_and_goes_on).
13. A message over :data:`MAX_MESSAGE_BYTES` is refused before it is sent; the
    connection goes on
    (tests/test_rendezvous_promises.py::test_a_message_over_the_limit_is_refused_before_it_is_sent_and_the_connection_goes_on).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import ipaddress
import json
import math
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ENV_SECRET",
    "MAX_MESSAGE_BYTES",
    "RendezvousError",
    "RendezvousTimeout",
    "StoreClient",
    "StoreServer",
    "is_loopback",
    "load_secret",
]

#: The environment variable that holds the shared secret (a file is safer: ``--rdzv-secret-file``).
ENV_SECRET = "REPLICATOR_RDZV_SECRET"
#: The largest message either side accepts (its JSON text, in bytes).
MAX_MESSAGE_BYTES = 1 << 16
#: The shortest secret accepted, in bytes.
MIN_SECRET_BYTES = 16
#: The longest a ``wait`` is served at once; a client wanting longer waits again.
MAX_WAIT_S = 300.0
#: The most bytes of keys and values the store holds, and the most keys.
MAX_STORE_BYTES = 16 << 20
MAX_KEYS = 100_000

_HEADER = struct.Struct("!I")
_SERVICE = "replicator-rendezvous"
_VERSION = 1
_OPS = frozenset({"set", "get", "delete", "add", "compare_set", "wait", "heartbeat", "leave", "members", "time"})


class RendezvousError(RuntimeError):
    """The rendezvous could not be reached, refused this client, or answered with an error."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """A call to the rendezvous, or a wait in it, took longer than its bound."""


class _Drop(Exception):
    """The peer broke the protocol: close its connection (the server goes on), after sending ``reply`` if any.

    The drop is recorded in :attr:`StoreServer.dropped` before the reply leaves, so a peer that reads the
    reply finds the record already there."""

    def __init__(self, why: str, reply: Mapping[str, Any] | None = None) -> None:
        super().__init__(why)
        self.reply = reply


class _HandshakeDropped(RendezvousError):
    """The server closed the connection during the handshake without refusing it: worth another try."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) means this machine only: every address it resolves to is loopback."""
    if host in ("", "0.0.0.0", "::", "*"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def load_secret(path: str | None = None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret: from the file ``path`` if given, else ``$REPLICATOR_RDZV_SECRET``; None if neither.

    Surrounding whitespace (a trailing newline) is dropped. Raises
    :class:`ValueError`, saying how to fix it, for a file that cannot be read,
    that others than its owner may read (as ssh refuses a key file), or a
    secret shorter than :data:`MIN_SECRET_BYTES` bytes.
    """
    environ = os.environ if environ is None else environ
    if path is not None:
        try:
            mode = os.stat(path).st_mode
            with open(path, "rb") as f:
                secret = f.read(4096).strip()
        except OSError as e:
            raise ValueError(f"cannot read the rendezvous secret file {path!r}: {e.strerror}; check the path.") from e
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(
                f"the rendezvous secret file {path!r} may be read by others (mode {stat.filemode(mode)}); "
                f"run `chmod 600 {path}`."
            )
        where = f"the file {path!r}"
    elif environ.get(ENV_SECRET):
        secret = environ[ENV_SECRET].strip().encode()
        where = f"${ENV_SECRET}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the rendezvous secret in {where} has {len(secret)} bytes; give at least {MIN_SECRET_BYTES} "
            f"(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)."
        )
    return secret


def _mac(secret: bytes, role: str, first: str, second: str) -> str:
    return hmac.new(secret, f"{_SERVICE}|{role}|{first}|{second}".encode(), hashlib.sha256).hexdigest()


def _send(sock: socket.socket, message: Mapping[str, Any], deadline: float) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise RendezvousError(f"a message of {len(body)} bytes is over the limit of {MAX_MESSAGE_BYTES}")
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(min(n - got, 1 << 16))
        if not chunk:
            raise ConnectionResetError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, first_byte_deadline: float, frame_timeout_s: float) -> dict[str, Any]:
    """One message: its first byte by ``first_byte_deadline``, the rest within ``frame_timeout_s`` of it."""
    first = _recv_exact(sock, 1, first_byte_deadline)
    deadline = time.monotonic() + frame_timeout_s
    (size,) = _HEADER.unpack(first + _recv_exact(sock, _HEADER.size - 1, deadline))
    if not 2 <= size <= MAX_MESSAGE_BYTES:
        raise _Drop(f"a message length of {size} bytes (allowed: 2 to {MAX_MESSAGE_BYTES})")
    body = _recv_exact(sock, size, deadline)
    try:
        message = json.loads(body.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _Drop(f"a message that is not JSON ({type(e).__name__})") from None
    if not isinstance(message, dict):
        raise _Drop("a message that is not a JSON object")
    return message


def _field(request: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``request[name]``, checked to be of ``kind`` (never a bool); ValueError otherwise (answered, not dropped)."""
    value = request.get(name)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name!r} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


class StoreServer:
    """The store, served from a thread of this process: :meth:`start`, then :attr:`address`; :meth:`close`.

    Binds to ``host`` (loopback by default; port 0: a free one). Any other
    address needs ``secret`` (see :func:`load_secret`): without one,
    :meth:`start` raises :class:`ValueError` before binding.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes | None = None,
        handshake_timeout_s: float = 5.0,
        frame_timeout_s: float = 5.0,
        idle_timeout_s: float = 120.0,
        max_connections: int = 128,
    ) -> None:
        self.host, self.port, self.secret = host, port, secret
        self.handshake_timeout_s, self.frame_timeout_s = handshake_timeout_s, frame_timeout_s
        self.idle_timeout_s, self.max_connections = idle_timeout_s, max_connections
        self.dropped: collections.deque[str] = collections.deque(maxlen=256)  # why the latest connections were dropped
        self._data: dict[str, str] = {}
        self._size = 0
        self._seen: dict[str, float] = {}
        self._cond = threading.Condition()
        self._conns: set[socket.socket] = set()
        #: The connections still in their handshake (not yet authenticated), by when they came: when the
        #: store is full, the oldest of them makes room for a new one (a flood of idle sockets cannot keep a
        #: launcher out).
        self._unproven: dict[socket.socket, float] = {}
        self._closed = threading.Event()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()

    @property
    def address(self) -> str:
        """``HOST:PORT`` that the server listens on (after :meth:`start`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self) -> StoreServer:
        if self.secret is None and not is_loopback(self.host):
            raise ValueError(
                f"the rendezvous would listen on {self.host!r}, which other machines reach, without a shared secret: "
                f"anyone who reaches it could join the job. Give the same secret to every host's launcher "
                f"(a file: --rdzv-secret-file PATH, chmod 600; or ${ENV_SECRET}), or bind to 127.0.0.1 for a job "
                f"on this machine."
            )
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host.strip("[]"), self.port))
        except OSError as e:
            listener.close()
            raise RendezvousError(f"cannot listen on {self.host}:{self.port} for the rendezvous: {e.strerror}") from e
        listener.listen(64)
        listener.settimeout(0.2)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name=f"rendezvous-{self.port}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving: the listener and every connection are closed; waiting calls end."""
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        with self._cond:
            for conn in list(self._conns):
                _shut(conn)
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def __enter__(self) -> StoreServer:
        return self.start() if self._listener is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            evicted = None
            with self._cond:
                full = len(self._conns) >= self.max_connections
                if full and self._unproven:
                    evicted = min(self._unproven, key=self._unproven.__getitem__)
                    self._unproven.pop(evicted)
                    self._conns.discard(evicted)
                    full = False
                if not full:
                    self._conns.add(conn)
                    self._unproven[conn] = time.monotonic()
            if evicted is not None:  # recorded here, with why; its own thread then ends on the closed socket
                self.dropped.append(f"{_peer_of(evicted)}: evicted unauthenticated (the store was full)")
                _shut(evicted)
            if full:
                self._drop(conn, peer, f"over {self.max_connections} connections")
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _drop(self, conn: socket.socket, peer: object, why: str) -> None:
        self.dropped.append(f"{peer}: {why}")
        _shut(conn)

    def _serve(self, conn: socket.socket, peer: object) -> None:
        try:
            self._handshake(conn)
            while not self._closed.is_set():
                request = _recv(conn, time.monotonic() + self.idle_timeout_s, self.frame_timeout_s)
                answer = self._answer(request)
                _send(conn, answer, time.monotonic() + self.frame_timeout_s)
        except _Drop as e:
            self.dropped.append(f"{peer}: {e}")  # published before the refusal is sent
            if e.reply is not None:
                with contextlib.suppress(OSError, TimeoutError):
                    _send(conn, e.reply, time.monotonic() + self.frame_timeout_s)
            _shut(conn)
        except TimeoutError:
            self._drop(conn, peer, "too slow (a timeout)")
        except Exception as e:  # noqa: BLE001 - a connection's failure never reaches the other connections
            self._drop(conn, peer, f"{type(e).__name__}: {e}")
        finally:
            _shut(conn)
            with self._cond:
                self._conns.discard(conn)
                self._unproven.pop(conn, None)

    def _handshake(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.handshake_timeout_s
        nonce = secrets.token_hex(16)
        _send(
            conn, {"service": _SERVICE, "version": _VERSION, "nonce": nonce, "auth": self.secret is not None}, deadline
        )
        hello = _recv(conn, deadline, self.handshake_timeout_s)
        theirs = hello.get("nonce")
        if hello.get("op") != "hello" or not isinstance(theirs, str) or not 16 <= len(theirs) <= 128:
            raise _Drop("no valid hello")
        if self.secret is not None:
            mac = hello.get("mac")
            if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(self.secret, "client", nonce, theirs)):
                raise _Drop(
                    "wrong or missing secret", {"ok": False, "error": "wrong or missing secret", "refused": True}
                )
            self._prove(conn)
            _send(conn, {"ok": True, "mac": _mac(self.secret, "server", theirs, nonce)}, deadline)
        else:
            self._prove(conn)
            _send(conn, {"ok": True}, deadline)

    def _prove(self, conn: socket.socket) -> None:
        """Count ``conn`` authenticated (never evicted for room) before telling its client so: a client
        told "ok" may act at once, and a newcomer must not evict it in between."""
        with self._cond:
            if self._unproven.pop(conn, None) is None:  # evicted while it finished its handshake
                raise _Drop("evicted unauthenticated (the store was full)")

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _answer(self, request: Mapping[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op not in _OPS:
            return {"ok": False, "error": f"unknown op {op!r}", "now": self._now()}
        try:
            reply = getattr(self, f"_op_{op}")(request)
        except (ValueError, TypeError, OverflowError) as e:
            return {"ok": False, "error": str(e), "now": self._now()}
        return {"ok": True, **reply, "now": self._now()}

    def _put(self, key: str, value: str | None) -> None:
        """Set (None: delete) ``key`` under the store's size bound; the caller holds the lock."""
        old = self._data.get(key)
        grow = (len(key) + len(value) if value is not None else 0) - (len(key) + len(old) if old is not None else 0)
        if self._size + grow > MAX_STORE_BYTES or (old is None and value is not None and len(self._data) >= MAX_KEYS):
            raise ValueError(f"the store is full ({MAX_STORE_BYTES} bytes or {MAX_KEYS} keys)")
        self._size += grow
        if value is None:
            self._data.pop(key, None)
        else:
            self._data[key] = value
        self._cond.notify_all()

    def _op_set(self, r: Mapping[str, Any]) -> dict[str, Any]:
        key, value = _field(r, "key", str), _field(r, "value", str)
        with self._cond:
            self._put(key, value)
        return {}

    def _op_get(self, r: Mapping[str, Any]) -> dict[str, Any]:
        key = _field(r, "key", str)
        with self._cond:
            return {"value": self._data.get(key)}

    def _op_delete(self, r: Mapping[str, Any]) -> dict[str, Any]:
        key = _field(r, "key", str)
        with self._cond:
            self._put(key, None)
        return {}

    def _op_add(self, r: Mapping[str, Any]) -> dict[str, Any]:
        key, amount = _field(r, "key", str), _field(r, "amount", int)
        with self._cond:
            old = self._data.get(key, "0")
            if not old.lstrip("-").isdigit() or len(old) > 40:
                raise ValueError(f"{key!r} holds {old[:40]!r}, not a counter")
            value = int(old) + amount
            self._put(key, str(value))
        return {"value": value}

    def _op_compare_set(self, r: Mapping[str, Any]) -> dict[str, Any]:
        key, desired = _field(r, "key", str), _field(r, "desired", str)
        expected = _field(r, "expected", (str, type(None)))
        with self._cond:
            current = self._data.get(key)
            if current == expected:
                self._put(key, desired)
                return {"swapped": True, "value": desired}
        return {"swapped": False, "value": current}

    def _op_wait(self, r: Mapping[str, Any]) -> dict[str, Any]:
        keys, timeout = _field(r, "keys", list), _field(r, "timeout", (int, float))
        if not keys or not all(isinstance(k, str) for k in keys):
            raise ValueError("'keys' must be a non-empty list of strings")
        if not math.isfinite(timeout) or timeout < 0:
            raise ValueError(f"'timeout' must be a finite number >= 0, got {timeout}")
        end = time.monotonic() + min(timeout, MAX_WAIT_S)
        with self._cond:
            while not all(k in self._data for k in keys):
                left = end - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    return {"values": None}
                self._cond.wait(min(left, 1.0))
            return {"values": {k: self._data[k] for k in keys}}

    def _op_heartbeat(self, r: Mapping[str, Any]) -> dict[str, Any]:
        member = _field(r, "member", str)
        with self._cond:
            if member not in self._seen and len(self._seen) >= 4096:
                raise ValueError("too many members")
            self._seen[member] = time.monotonic()
        return {}

    def _op_leave(self, r: Mapping[str, Any]) -> dict[str, Any]:
        member = _field(r, "member", str)
        with self._cond:
            self._seen.pop(member, None)
        return {}

    def _op_members(self, r: Mapping[str, Any]) -> dict[str, Any]:
        del r
        now = time.monotonic()
        with self._cond:
            return {"members": {m: now - t for m, t in self._seen.items()}}

    def _op_time(self, r: Mapping[str, Any]) -> dict[str, Any]:
        del r
        return {}


def _peer_of(conn: socket.socket) -> object:
    try:
        return conn.getpeername()
    except OSError:
        return "?"


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"the rendezvous address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class StoreClient:
    """A connection to a :class:`StoreServer` at ``address`` (``HOST:PORT``). Safe to share between threads.

    Connecting retries, while the server is not up yet, for ``connect_timeout_s``;
    every call then answers within ``timeout_s`` (a ``wait`` within its own
    timeout plus ``timeout_s``) or raises :class:`RendezvousTimeout`; a lost
    connection raises :class:`RendezvousError` naming the address.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: bytes | None = None,
        timeout_s: float = 10.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.address, self.secret, self.timeout_s = address, secret, timeout_s
        #: The server's clock (seconds since it started) at the last answer: one clock for every host.
        self.server_now = 0.0
        self._lock = threading.Lock()
        self._sock: socket.socket | None = self._connect(connect_timeout_s)

    def _connect(self, connect_timeout_s: float) -> socket.socket:
        """Connect and shake hands, retrying within ``connect_timeout_s``: while nothing listens yet, and when the
        server closes the connection during the handshake (it was full: a flood of idle connections), with a
        backoff of 0.1 s doubling to 1 s. A refusal (another secret, not a rendezvous) is not retried."""
        host, port = _split(self.address)
        deadline = time.monotonic() + connect_timeout_s
        pause, tries = 0.1, 0
        while True:
            tries += 1
            try:
                sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.05))
            except OSError as e:
                if time.monotonic() + 0.1 >= deadline:
                    raise RendezvousTimeout(
                        f"no rendezvous at {self.address} after {connect_timeout_s:g} s ({e.strerror or e}): start the "
                        f"launcher that hosts it, or check the address and that its port is open to this host."
                    ) from None
                time.sleep(0.1)
                continue
            try:
                self._handshake(sock, time.monotonic() + self.timeout_s)
                return sock
            except _HandshakeDropped as e:
                _shut(sock)
                if time.monotonic() + pause >= deadline:
                    raise RendezvousError(
                        f"{e} ({tries} tries in {connect_timeout_s:g} s): the store may be at its connection limit "
                        f"(a flood of connections?) or its host overloaded."
                    ) from None
                time.sleep(pause)
                pause = min(2 * pause, 1.0)
            except BaseException:
                _shut(sock)
                raise

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        try:
            hello = _recv(sock, deadline, self.timeout_s)
            if hello.get("service") != _SERVICE or not isinstance(hello.get("nonce"), str):
                raise RendezvousError(f"{self.address} is not a replicator rendezvous (it sent {str(hello)[:80]})")
            ours = secrets.token_hex(16)
            if hello.get("auth") and self.secret is None:
                raise RendezvousError(
                    f"the rendezvous at {self.address} requires a shared secret: give this launcher the same one "
                    f"(--rdzv-secret-file PATH or ${ENV_SECRET})."
                )
            if not hello.get("auth") and self.secret is not None:
                raise RendezvousError(
                    f"the rendezvous at {self.address} does not check a secret but this launcher has one: it is "
                    f"not the job's rendezvous (or was started without the secret); refusing to trust it."
                )
            hi: dict[str, Any] = {"op": "hello", "nonce": ours}
            if self.secret is not None:
                hi["mac"] = _mac(self.secret, "client", hello["nonce"], ours)
            _send(sock, hi, deadline)
            answer = _recv(sock, deadline, self.timeout_s)
        except (TimeoutError, _Drop) as e:
            raise RendezvousError(
                f"no valid answer from the rendezvous at {self.address}: {e or 'a timeout'}"
            ) from None
        except OSError as e:
            raise _HandshakeDropped(f"the rendezvous at {self.address} closed the connection: {e}") from None
        if not answer.get("ok"):
            raise RendezvousError(
                f"the rendezvous at {self.address} refused this launcher ({answer.get('error')}): give it the "
                f"same secret as the launcher that hosts the rendezvous."
            )
        if self.secret is not None:
            mac = answer.get("mac")
            if not isinstance(mac, str) or not hmac.compare_digest(
                mac, _mac(self.secret, "server", ours, hello["nonce"])
            ):
                raise RendezvousError(
                    f"the rendezvous at {self.address} does not know the secret; refusing to trust it."
                )

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                _shut(self._sock)
                self._sock = None

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, request: dict[str, Any], extra_s: float = 0.0) -> dict[str, Any]:
        with self._lock:
            if self._sock is None:
                raise RendezvousError(f"the connection to the rendezvous at {self.address} is closed")
            deadline = time.monotonic() + self.timeout_s + extra_s
            try:
                _send(self._sock, request, deadline)
                answer = _recv(self._sock, deadline, self.timeout_s)
            except TimeoutError:
                _shut(self._sock)  # its answer may still come: this connection is out of step now
                self._sock = None
                raise RendezvousTimeout(
                    f"the rendezvous at {self.address} did not answer {request['op']!r} within "
                    f"{self.timeout_s + extra_s:g} s (its host unreachable, or overloaded)"
                ) from None
            except (OSError, _Drop) as e:
                _shut(self._sock)
                self._sock = None
                raise RendezvousError(
                    f"lost the rendezvous at {self.address} ({e}): the launcher that hosts it ended, or its host "
                    f"is unreachable."
                ) from None
        if isinstance(answer.get("now"), (int, float)):
            self.server_now = float(answer["now"])
        if not answer.get("ok"):
            raise RendezvousError(f"the rendezvous at {self.address} refused {request['op']!r}: {answer.get('error')}")
        return answer

    def set(self, key: str, value: str) -> None:
        self._call({"op": "set", "key": key, "value": value})

    def get(self, key: str) -> str | None:
        """The value of ``key``, None if it has none."""
        return self._call({"op": "get", "key": key})["value"]

    def delete(self, key: str) -> None:
        self._call({"op": "delete", "key": key})

    def add(self, key: str, amount: int = 1) -> int:
        """Add ``amount`` to the counter ``key`` (0 when unset), atomically; its new value."""
        return int(self._call({"op": "add", "key": key, "amount": amount})["value"])

    def compare_set(self, key: str, expected: str | None, desired: str) -> tuple[bool, str | None]:
        """Set ``key`` to ``desired`` if it holds ``expected`` (None: unset), atomically: (swapped?, its value now)."""
        answer = self._call({"op": "compare_set", "key": key, "expected": expected, "desired": desired})
        return bool(answer["swapped"]), answer["value"]

    def wait(self, keys: Sequence[str], timeout_s: float) -> dict[str, str]:
        """The values of ``keys`` once all are set; :class:`RendezvousTimeout` after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while True:
            left = max(end - time.monotonic(), 0.0)
            chunk = min(left, MAX_WAIT_S)
            values = self._call({"op": "wait", "keys": list(keys), "timeout": chunk}, extra_s=chunk)["values"]
            if values is not None:
                return values
            if time.monotonic() >= end:
                raise RendezvousTimeout(f"keys {list(keys)} not all set at {self.address} within {timeout_s:g} s")

    def heartbeat(self, member: str) -> None:
        """Record that ``member`` is alive now (the server's clock)."""
        self._call({"op": "heartbeat", "member": member})

    def leave(self, member: str) -> None:
        """Forget ``member``'s heartbeats (it left on purpose)."""
        self._call({"op": "leave", "member": member})

    def members(self) -> dict[str, float]:
        """Every member that sent a heartbeat and did not leave: seconds since its last one."""
        return {str(m): float(age) for m, age in self._call({"op": "members"})["members"].items()}

    def time(self) -> float:
        """The server's clock: seconds since it started."""
        self._call({"op": "time"})
        return self.server_now
