"""Rendezvous rounds: one launcher per host agrees with the others on the hosts, their ranks, the coordinator and restarts.

The state of the current round is one JSON value in the store
(:mod:`~replicator.launch.rendezvous`), changed only by compare-and-set, as
torchrun's c10d rendezvous keeps it: its number (the restart count), whether it
is open or closed, the launchers that joined it and, once closed, their host
ranks. A round closes when ``max_hosts`` launchers joined, or ``min_hosts``
did and ``last_call_s`` passed since; a restart round also waits for every host
of the round before it that still heartbeats (it is stopping its workers), at
most ``rejoin_timeout_s`` after the restart, and then records those it goes on
without (:attr:`Assignment.left`; a gone host is in :attr:`Assignment.lost`). A
launcher of the previous round that finds the restart round closed without it
is told it left the job (:class:`LeftOut`), even once the job has ended: its
workers were dropped, so it never reports success. Host ranks are, in this order: the rank a
launcher asked for (``--node-rank``), the rank it had in the previous round,
the lowest free one in the order they joined. The JAX coordinator is host rank
0's address at a port that launcher chose when it joined. Any launcher ends a
round and opens the next (:meth:`Rendezvous.next_round`: a failure on its
host); the others see the new number when they :meth:`~Rendezvous.poll` and
join it. A launcher that arrives while a round is closed waits for the next.

Every launcher sends a heartbeat every ``heartbeat_interval_s`` on its own
connection; one whose last heartbeat is older than ``missed_heartbeats``
intervals is gone, so a poll at least every interval sees a lost host within
:attr:`Rendezvous.detection_bound_s` = ``heartbeat_interval_s * (missed_heartbeats
+ 1)`` of its last heartbeat; a lost rendezvous host is seen by the
heartbeat thread within the same bound (its calls time out after
``missed_heartbeats`` intervals)::

    server = rendezvous.StoreServer().start()
    with Rendezvous(server.address, min_hosts=1, max_hosts=1, last_call_s=0.0) as rdzv:
        first = rdzv.join()  # Assignment(round=0, host_rank=0, num_hosts=1, ..., coordinator='127.0.0.1:PORT')

Promises:

1. ``--nnodes`` is ``N`` or ``MIN:MAX`` with ``1 <= MIN <= MAX``; anything
   else is refused saying what to pass
   (tests/test_membership_promises.py::test_nnodes_is_n_or_min_max_with_1_le_min_le_max,
   tests/test_rendezvous.py::test_parse_nnodes).
2. The launchers of a round agree on one assignment; the coordinator is host
   rank 0's address at the port it chose
   (tests/test_rendezvous.py::test_fixed_hosts_agree_and_asked_ranks_are_honored).
3. Host ranks are a permutation: the rank asked for, then the previous
   round's, then the free ones in join order
   (tests/test_rendezvous.py::test_ranks_are_a_permutation_honouring_asked_then_previous_ranks);
   ``--node-rank`` holds in every round, whatever order the hosts rejoin in,
   and the others keep their ranks
   (tests/test_rendezvous.py::test_asked_ranks_are_honoured_in_every_round_not_only_the_first,
   tests/test_membership_promises.py::test_every_round_keeps_the_ranks_of_the_round_before_whatever_order_its_hosts_rejoin_in).
4. A rank taken by a live launcher is refused, in a later round too
   (tests/test_rendezvous.py::test_a_taken_rank_is_refused); so is a launcher given another
   ``--nnodes``, or a store holding a state this launcher did not write
   (tests/test_rendezvous.py::test_launchers_given_another_nnodes_or_a_foreign_state_are_refused).
5. Under ``MIN:MAX`` a round closes after the last call; a launcher that
   comes while a round runs waits and joins the next round, and the hosts of
   the round before keep their ranks there
   (tests/test_rendezvous.py::test_min_max_closes_after_last_call_and_a_late_host_joins_the_next_round).
6. A restart round waits for each host of the round before that still
   heartbeats (tests/test_rendezvous.py::test_a_restart_round_waits_for_a_host_that_still_heartbeats),
   at most the rejoin timeout; then it goes on without it, names it, and that
   host is told it left, never success
   (tests/test_rendezvous.py::test_a_host_that_does_not_rejoin_in_time_is_named_and_never_told_success).
   A gone host is named as lost
   (tests/test_rendezvous.py::test_a_restart_round_goes_on_without_a_host_that_is_gone_and_names_it);
   with too few hosts left the join fails
   (tests/test_rendezvous.py::test_a_host_gone_before_a_fixed_size_restart_ends_the_join).
7. A round is restarted once, whoever asks and however late; the first end
   given stands
   (tests/test_membership_promises.py::test_a_restart_of_a_round_already_restarted_opens_no_other_and_the_first_end_stands).
8. Nothing hangs: a join ends within the join timeout, naming who joined
   (tests/test_rendezvous.py::test_join_is_bounded_and_names_who_joined), or once its launcher
   is interrupted (tests/test_rendezvous.py::test_a_join_stops_when_its_launcher_is_interrupted);
   the rejoin timeout is below the join timeout
   (tests/test_rendezvous.py::test_the_rejoin_timeout_is_below_the_join_timeout).
9. A lost launcher is seen within :attr:`Rendezvous.detection_bound_s`
   (tests/test_rendezvous.py::test_a_sigkilled_launcher_process_is_seen_gone_within_the_bound),
   and dropped from an open round
   (tests/test_rendezvous.py::test_a_lost_launcher_is_dropped_from_an_open_round); a lost or
   frozen rendezvous host within the same bound
   (tests/test_rendezvous.py::test_a_sigkilled_rendezvous_host_ends_the_others_within_the_bound,
   tests/test_rendezvous.py::test_a_frozen_rendezvous_host_ends_the_others_within_the_bound); the
   bounds follow from the heartbeat settings, and bad settings are refused
   (tests/test_membership_promises.py::test_the_detection_bounds_follow_from_the_heartbeat_settings).
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from replicator.launch.rendezvous import RendezvousError, RendezvousTimeout, StoreClient, StoreServer

__all__ = ["Assignment", "LeftOut", "Rendezvous", "Status", "parse_nnodes", "serve_if_here"]

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_MISSED_HEARTBEATS = 5
DEFAULT_LAST_CALL_S = 3.0
DEFAULT_JOIN_TIMEOUT_S = 120.0
#: How long a restart round waits for the hosts of the round before it that still heartbeat (they are stopping
#: their workers: up to ``--kill-grace`` and more) before it closes without them.
DEFAULT_REJOIN_TIMEOUT_S = 60.0
#: How often a waiting launcher reads the round's state.
POLL_S = 0.1

_STATE = "rdzv/state"
_END = "rdzv/end"


@dataclass(frozen=True)
class Assignment:
    """A closed round, as one launcher sees it."""

    round: int  # the restart count: 0 for the first start
    host_rank: int  # this launcher's host: its worker's id with one worker per host
    num_hosts: int
    members: tuple[str, ...]  # launcher ids by host rank
    addresses: tuple[str, ...]  # each host's address by host rank
    coordinator: str  # HOST:PORT of JAX's coordinator: host rank 0's address and its chosen port
    #: The previous round's hosts that this one goes on without, as ``(launcher id, previous host rank)``: those
    #: that heartbeat but did not rejoin within the rejoin timeout (``left``), and those gone (``lost``).
    left: tuple[tuple[str, int], ...] = ()
    lost: tuple[tuple[str, int], ...] = ()
    previous_hosts: int = 0  # how many hosts the previous round had (0 in round 0)


class LeftOut(RendezvousError):
    """This launcher was a host of the previous round, and the restart round closed without it: its workers
    are no longer part of the job (it never reports the job's success)."""


@dataclass(frozen=True)
class Status:
    """The rendezvous seen by :meth:`Rendezvous.poll`."""

    round: int  # the newest round: above the caller's when another launcher started a restart
    closed: bool
    gone: tuple[tuple[str, int, float], ...]  # (launcher id, host rank, seconds since its last heartbeat)
    waiting: tuple[str, ...]  # live launchers outside the round: they join the next one
    ended: str | None  # why the job ended, once a launcher said so (:meth:`Rendezvous.end`)


def parse_nnodes(spec: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (torchrun's ``--nnodes``) as (min_hosts, max_hosts); ValueError saying what to pass."""
    parts = spec.split(":")
    if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
        low, high = int(parts[0]), int(parts[-1])
        if 1 <= low <= high:
            return low, high
    raise ValueError(f"--nnodes {spec!r}: give the number of hosts N, or MIN:MAX with 1 <= MIN <= MAX (e.g. 2 or 1:4).")


def serve_if_here(endpoint: str, secret: bytes | None) -> StoreServer | None:
    """Host the store at ``endpoint`` when it is an address of this machine not yet taken; None otherwise.

    As torchrun's c10d backend: the launcher that can bind the endpoint hosts
    it, the others connect. Refuses (ValueError) a non-loopback endpoint
    without ``secret``.
    """
    host, _, port = endpoint.rpartition(":")
    server = StoreServer(host.strip("[]"), int(port), secret=secret)
    try:
        return server.start()
    except RendezvousError as e:
        cause = e.__cause__
        if isinstance(cause, OSError) and cause.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return None
        raise


def _initial(round_: int = 0, prev: dict[str, int] | None = None, *, nnodes: list[int]) -> dict[str, Any]:
    return {
        "round": round_,
        "status": "open",
        "joined": [],
        "min_at": None,
        "ranks": [],
        "prev": prev or {},
        "nnodes": nnodes,
        "opened_at": None,  # the store's clock when a restart opened this round
        "left": {},  # launcher id -> previous host rank: heartbeating, but not rejoined when the round closed
    }


_STATE_KEYS = frozenset(_initial(nnodes=[1, 1]))


def _ranks(joined: list[dict[str, Any]], prev: dict[str, int]) -> list[str]:
    """Launcher ids by host rank: asked-for ranks first, then previous ones, then the free ones in join order."""
    n = len(joined)
    slots: list[str | None] = [None] * n
    placed: set[str] = set()
    for wish in ([j["rank"] for j in joined], [prev.get(j["id"]) for j in joined]):
        for j, rank in zip(joined, wish, strict=True):
            if j["id"] not in placed and rank is not None and rank < n and slots[rank] is None:
                slots[rank] = j["id"]
                placed.add(j["id"])
    free = iter(i for i, s in enumerate(slots) if s is None)
    for j in joined:
        if j["id"] not in placed:
            slots[next(free)] = j["id"]
    return [s for s in slots if s is not None]


class Rendezvous:
    """This launcher's part in the rendezvous at ``endpoint``: :meth:`start`, :meth:`join`, :meth:`poll`, ...

    Args:
      endpoint: ``HOST:PORT`` of the store (:class:`~replicator.launch.rendezvous.StoreServer`).
      min_hosts, max_hosts: the number of hosts (``--nnodes N``: both N; ``MIN:MAX``).
      rank: the host rank asked for (``--node-rank``), None to be given one.
      address: how the other hosts reach this one (for the coordinator when it is host rank 0).
      secret: the shared secret, when the store checks one.
      coordinator_port: the port this host's coordinator would use as host rank 0; None: a free one each round.
      heartbeat_interval_s, missed_heartbeats: a launcher is gone after this many intervals without a heartbeat.
      last_call_s: how long a round that has ``min_hosts`` waits for more before it closes.
      join_timeout_s: the bound on :meth:`join` (and on connecting).
      rejoin_timeout_s: how long a restart round waits for the previous round's hosts that still heartbeat
        (stopping their workers) before it closes without them; below ``join_timeout_s``.
      call_timeout_s: the bound on each call to the store (default: ``missed_heartbeats`` intervals).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        min_hosts: int,
        max_hosts: int | None = None,
        rank: int | None = None,
        address: str = "127.0.0.1",
        secret: bytes | None = None,
        launcher_id: str | None = None,
        coordinator_port: int | None = None,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        missed_heartbeats: int = DEFAULT_MISSED_HEARTBEATS,
        last_call_s: float = DEFAULT_LAST_CALL_S,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
        call_timeout_s: float | None = None,
        rejoin_timeout_s: float | None = None,
    ) -> None:
        max_hosts = min_hosts if max_hosts is None else max_hosts
        if not 1 <= min_hosts <= max_hosts:
            raise ValueError(f"need 1 <= min_hosts <= max_hosts, got {min_hosts}:{max_hosts}")
        if rank is not None and not 0 <= rank < max_hosts:
            raise ValueError(f"host rank {rank} is out of range for at most {max_hosts} hosts: give 0..{max_hosts - 1}")
        self.endpoint, self.secret = endpoint, secret
        self.min_hosts, self.max_hosts, self.rank, self.address = min_hosts, max_hosts, rank, address
        self.id = launcher_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.coordinator_port = coordinator_port
        self.heartbeat_interval_s, self.missed_heartbeats = heartbeat_interval_s, missed_heartbeats
        self.last_call_s, self.join_timeout_s = last_call_s, join_timeout_s
        if rejoin_timeout_s is None:
            rejoin_timeout_s = min(DEFAULT_REJOIN_TIMEOUT_S, join_timeout_s / 2)
        if not 0 <= rejoin_timeout_s < join_timeout_s:
            raise ValueError(
                f"the rejoin timeout ({rejoin_timeout_s:g} s) must be below the join timeout ({join_timeout_s:g} s): "
                "the hosts that rejoined would give up before the round waited out the others."
            )
        self.rejoin_timeout_s = rejoin_timeout_s
        #: A launcher is gone once its last heartbeat is older than this.
        self.gone_after_s = heartbeat_interval_s * missed_heartbeats
        #: A lost launcher (or rendezvous host) is seen within this of its last heartbeat, polling every interval.
        self.detection_bound_s = heartbeat_interval_s * (missed_heartbeats + 1)
        #: Every call to the store answers within this (default: ``gone_after_s``), so a silent store is seen in time.
        self.call_timeout_s = self.gone_after_s if call_timeout_s is None else call_timeout_s
        #: Whether the last :meth:`next_round` opened the round (False: another launcher did first).
        self.restarted_here = False
        self._client: StoreClient | None = None
        self._beat: StoreClient | None = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- connection and heartbeats -------------------------------------------------------------------------------

    def start(self, connect_timeout_s: float | None = None) -> Rendezvous:
        """Connect (retrying for ``connect_timeout_s``, default ``join_timeout_s``) and start the heartbeats."""
        timeout = self.join_timeout_s if connect_timeout_s is None else connect_timeout_s
        self._client = StoreClient(
            self.endpoint, secret=self.secret, timeout_s=self.call_timeout_s, connect_timeout_s=timeout
        )
        self._beat = StoreClient(
            self.endpoint, secret=self.secret, timeout_s=self.gone_after_s, connect_timeout_s=self.call_timeout_s
        )
        self._beat.heartbeat(self.id)
        self._thread = threading.Thread(target=self._heartbeats, name=f"heartbeat-{self.id}", daemon=True)
        self._thread.start()
        return self

    def _heartbeats(self) -> None:
        assert self._beat is not None
        while not self._stop.wait(self.heartbeat_interval_s):
            try:
                self._beat.heartbeat(self.id)
            except RendezvousError as e:
                self._lost = str(e)
                return

    def close(self, leave: bool = True) -> None:
        """Stop the heartbeats (``leave``: say so, so that nobody counts this launcher as lost) and disconnect."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.call_timeout_s)
        for client in (self._client, self._beat):
            if client is None:
                continue
            if leave and client is self._client and self._lost is None:
                try:
                    client.leave(self.id)
                except RendezvousError:
                    pass
            client.close()

    def __enter__(self) -> Rendezvous:
        return self.start() if self._client is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def client(self) -> StoreClient:
        if self._client is None:
            raise RendezvousError("the rendezvous is not started: call start() first")
        if self._lost is not None:
            raise RendezvousError(f"the rendezvous host is gone: {self._lost}")
        return self._client

    # -- rounds --------------------------------------------------------------------------------------------------

    def _state(self) -> tuple[str | None, dict[str, Any]]:
        raw = self.client.get(_STATE)
        if raw is None:
            return raw, _initial(nnodes=[self.min_hosts, self.max_hosts])
        try:
            state = json.loads(raw)
            if not isinstance(state, dict) or not _STATE_KEYS <= state.keys():
                raise ValueError("missing keys")
        except ValueError as e:
            raise RendezvousError(
                f"the rendezvous state at {self.endpoint} is not one this launcher wrote ({e}): is another program "
                f"using the store?"
            ) from None
        return raw, state

    def _alive(self, ages: dict[str, float], launcher: str) -> bool:
        return ages.get(launcher, math.inf) <= self.gone_after_s

    def join(self, stop: threading.Event | None = None) -> Assignment:
        """Join the open round (or, if it is closed without this launcher, the next) and wait until it closes.

        Raises :class:`RendezvousTimeout` after ``join_timeout_s`` (naming who
        joined), and :class:`RendezvousError` when the host rank asked for is
        taken, when hosts of the previous round are gone and too few are left,
        when the job has ended, or once ``stop`` is set (the launcher was interrupted).
        """
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            client = self.client
            raw, state = self._state()
            joined: list[dict[str, Any]] = state["joined"]
            ids = [j["id"] for j in joined]
            if state["status"] == "closed" and self.id in state["ranks"]:
                return self._assignment(state)
            if state["status"] == "closed" and self.id in state["prev"]:  # before the end: never a success
                raise LeftOut(
                    f"host rank {state['prev'][self.id]} left the job at round {state['round']}: the restart round "
                    f"closed without this host ({len(state['ranks'])} host(s) went on), which had not rejoined "
                    f"within the rejoin timeout ({self.rejoin_timeout_s:g} s) while stopping its workers; this "
                    f"host's workers are no longer part of the job."
                )
            ended = client.get(_END)
            if ended is not None:
                raise RendezvousError(f"the job has ended: {ended}")
            if state["status"] == "open" and self.id not in ids and len(joined) < self.max_hosts:
                self._enter(raw, state)
                continue
            if state["status"] == "open" and self.id in ids and self._settle(raw, state):
                continue
            if stop is not None and stop.is_set():
                raise RendezvousError(f"stopped while waiting for round {state['round']} to close")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousTimeout(
                    f"round {state['round']} of the rendezvous at {self.endpoint} did not close within "
                    f"{self.join_timeout_s:g} s: {len(joined)} of {self.min_hosts}..{self.max_hosts} hosts joined "
                    f"({', '.join(ids) or 'none'}); start the other hosts' launchers with the same --rdzv-endpoint "
                    f"and --nnodes."
                )
            time.sleep(min(POLL_S, left))

    def _enter(self, raw: str | None, state: dict[str, Any]) -> None:
        """Add this launcher to the open round (one compare-and-set; the caller reads again either way)."""
        client = self.client
        joined = state["joined"]
        if state["nnodes"] != [self.min_hosts, self.max_hosts]:
            low, high = state["nnodes"]
            raise RendezvousError(
                f"the job at {self.endpoint} runs on {_nnodes(low, high)} hosts but this launcher was given "
                f"--nnodes {_nnodes(self.min_hosts, self.max_hosts)}: give every host's launcher the same --nnodes."
            )
        if self.rank is not None:
            ages = client.members()
            for j in joined:
                if j["rank"] == self.rank and self._alive(ages, j["id"]):
                    raise RendezvousError(
                        f"host rank {self.rank} is taken by launcher {j['id']} ({j['address']}): give every host its "
                        f"own --node-rank, or none."
                    )
        port = self.coordinator_port or _free_port(self.address)  # each round a new one: the old may linger
        entry = {"id": self.id, "rank": self.rank, "address": self.address, "port": port}
        new = dict(state, joined=[*joined, entry])
        if len(new["joined"]) >= self.min_hosts and new["min_at"] is None:
            new["min_at"] = client.server_now
        client.compare_set(_STATE, raw, json.dumps(new))

    def _settle(self, raw: str | None, state: dict[str, Any]) -> bool:
        """Drop lost launchers from the open round, or close it when it may close. Whether it tried a change."""
        client = self.client
        ages = client.members()
        joined = state["joined"]
        alive = [j for j in joined if self._alive(ages, j["id"])]
        if len(alive) < len(joined):
            new = dict(state, joined=alive, min_at=state["min_at"] if len(alive) >= self.min_hosts else None)
            client.compare_set(_STATE, raw, json.dumps(new))
            return True
        ids = {j["id"] for j in joined}
        lost = [(lid, rank) for lid, rank in state["prev"].items() if lid not in ids and not self._alive(ages, lid)]
        if lost and len(state["prev"]) - len(lost) < self.min_hosts:
            names = ", ".join(f"host rank {rank} (launcher {lid})" for lid, rank in sorted(lost, key=lambda x: x[1]))
            raise RendezvousError(
                f"{names} of round {state['round'] - 1} is gone (no heartbeat for over {self.gone_after_s:g} s) "
                f"and fewer than {self.min_hosts} hosts are left; the job cannot go on."
            )
        full = len(joined) >= self.max_hosts
        now = client.server_now
        enough = len(joined) >= self.min_hosts and now >= (state["min_at"] or 0.0) + self.last_call_s
        # A restart waits for every host of the round before that still heartbeats (it is stopping its workers),
        # at most rejoin_timeout_s: otherwise a healthy host slow to stop would be dropped without a word.
        coming = {lid: rank for lid, rank in state["prev"].items() if lid not in ids and self._alive(ages, lid)}
        opened = state.get("opened_at")
        rejoining = bool(coming) and opened is not None and now < opened + self.rejoin_timeout_s
        if not (full or (enough and not rejoining)):
            return False
        new = dict(state, status="closed", ranks=_ranks(joined, state["prev"]), left=coming)
        client.compare_set(_STATE, raw, json.dumps(new))
        return True

    def _assignment(self, state: dict[str, Any]) -> Assignment:
        by_id = {j["id"]: j for j in state["joined"]}
        members = tuple(state["ranks"])
        prev, left = state["prev"], state.get("left", {})
        without = sorted(((lid, rank) for lid, rank in prev.items() if lid not in members), key=lambda x: x[1])
        first = by_id[members[0]]
        host = f"[{first['address']}]" if ":" in first["address"] else first["address"]
        return Assignment(
            round=state["round"],
            host_rank=members.index(self.id),
            num_hosts=len(members),
            members=members,
            addresses=tuple(by_id[m]["address"] for m in members),
            coordinator=f"{host}:{first['port']}",
            left=tuple(x for x in without if x[0] in left),
            lost=tuple(x for x in without if x[0] not in left),
            previous_hosts=len(prev),
        )

    def next_round(self, after: int, reason: str) -> int:
        """End round ``after`` and open the next (a restart), unless another launcher did; the newest round's number.

        :attr:`restarted_here` says whether this launcher opened it.
        """
        while True:
            raw, state = self._state()
            if state["round"] != after:
                self.restarted_here = False
                return state["round"]
            prev = {lid: rank for rank, lid in enumerate(state["ranks"])}
            new = _initial(after + 1, prev, nnodes=state["nnodes"])
            new["reason"], new["opened_at"] = reason, self.client.server_now
            swapped, _ = self.client.compare_set(_STATE, raw, json.dumps(new))
            if swapped:
                self.restarted_here = True
                return after + 1

    def poll(self) -> Status:
        """The newest round, the launchers of it that are gone, those waiting, and the end if any.

        Raises :class:`RendezvousError` when the rendezvous itself is lost.
        """
        client = self.client
        _, state = self._state()
        ages = client.members()
        ended = client.get(_END)
        ranks: list[str] = state["ranks"]
        gone = tuple(
            (lid, rank, ages.get(lid, math.inf))
            for rank, lid in enumerate(ranks)
            if lid != self.id and not self._alive(ages, lid)
        )
        waiting = tuple(m for m in ages if m not in ranks and self._alive(ages, m))
        return Status(state["round"], state["status"] == "closed", gone, waiting, ended)

    def end(self, reason: str) -> str:
        """Say that the job ended and why (the first reason given stays); that reason."""
        _, value = self.client.compare_set(_END, None, reason)
        return value if value is not None else reason


def _nnodes(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}:{high}"


def _free_port(address: str) -> int:
    """A port free now on this host, for the coordinator should this host be rank 0."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(("::" if family == socket.AF_INET6 else "", 0))
        return s.getsockname()[1]
