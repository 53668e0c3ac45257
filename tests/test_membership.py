"""The rounds of the rendezvous (replicator/launch/membership.py): a launcher's settings, and closing it.

The rounds themselves (agreeing on hosts and ranks, restarts, lost hosts) are run in
tests/test_rendezvous.py with the store they use; the tests here kill mutants that
survived those (scripts/mutate.py, launch/ group): the documented join timeout, the
host range a launcher accepts, and a launcher leaving the store when it closes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from replicator.launch.membership import DEFAULT_JOIN_TIMEOUT_S, Rendezvous
from replicator.launch.rendezvous import StoreClient, StoreServer

ROOT = Path(__file__).resolve().parent.parent
#: Heartbeats for the tests: a lost launcher is gone after 1 s.
FAST = {"heartbeat_interval_s": 0.25, "missed_heartbeats": 4}
#: An address nobody is asked to reach: the constructor of a Rendezvous does not connect.
NOWHERE = "127.0.0.1:9"


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer(handshake_timeout_s=0.5, frame_timeout_s=0.5, idle_timeout_s=5.0) as s:
        yield s


# -- settings ----------------------------------------------------------------------------------------------------


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


# -- closing -----------------------------------------------------------------------------------------------------------


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
