"""The promises of replicator/launch/rendezvous.py that no other test checks (its docstring lists them all).

The store runs in a thread of this process; every call to it is bounded by its client's timeout.
"""

from __future__ import annotations

import pytest

from replicator.launch import rendezvous
from replicator.launch.rendezvous import RendezvousError, StoreClient, StoreServer


@pytest.fixture
def server():
    with StoreServer(handshake_timeout_s=5.0, frame_timeout_s=5.0, idle_timeout_s=60.0) as s:
        yield s


def test_the_store_is_bounded_and_a_full_store_answers_and_goes_on(server, monkeypatch):
    monkeypatch.setattr(rendezvous, "MAX_STORE_BYTES", 100)
    monkeypatch.setattr(rendezvous, "MAX_KEYS", 3)
    with StoreClient(server.address, timeout_s=30.0) as c:
        c.set("a", "x" * 60)
        with pytest.raises(RendezvousError, match="the store is full"):
            c.set("b", "x" * 60)  # over the bytes
        assert c.get("b") is None and c.get("a") == "x" * 60
        c.set("a", "x" * 90)  # replacing a value counts its growth only
        c.delete("a")
        c.set("b", "x" * 60)  # deleting made room
        c.set("c", "1")
        c.set("d", "2")
        with pytest.raises(RendezvousError, match="the store is full"):
            c.set("e", "3")  # over the keys
        with pytest.raises(RendezvousError, match="the store is full"):
            c.add("counter")
        assert c.get("e") is None and c.add("c") == 2  # the keys there still change
        assert sorted(k for k in "abcde" if c.get(k) is not None) == ["b", "c", "d"]


def test_a_message_over_the_limit_is_refused_before_it_is_sent_and_the_connection_goes_on(server):
    with StoreClient(server.address, timeout_s=30.0) as c:
        with pytest.raises(RendezvousError, match=f"over the limit of {rendezvous.MAX_MESSAGE_BYTES}"):
            c.set("big", "x" * rendezvous.MAX_MESSAGE_BYTES)
        c.set("small", "fine")  # the same connection: nothing was sent
        assert c.get("small") == "fine" and c.get("big") is None
        assert not server.dropped  # while the client is connected (its closing may be recorded)
