"""The promises of replicator/launch/membership.py that no other test checks (its docstring lists them all).

Launchers are :class:`~replicator.launch.membership.Rendezvous` objects of this process on a store in a thread;
the rank rules are checked as properties of ``membership._ranks`` over rounds.
"""

from __future__ import annotations

import random
import re

import hypothesis
import hypothesis.strategies as st
import pytest

from replicator.launch import membership
from replicator.launch.membership import Rendezvous, parse_nnodes
from replicator.launch.rendezvous import StoreServer


@pytest.fixture
def server():
    with StoreServer(handshake_timeout_s=5.0, frame_timeout_s=5.0, idle_timeout_s=60.0) as s:
        yield s


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.one_of(st.text(alphabet="0123456789: -a", max_size=7), st.integers(0, 9).map(str)))
def test_nnodes_is_n_or_min_max_with_1_le_min_le_max(spec):
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", spec)
    low, high = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
    if match and 1 <= low <= high:
        assert parse_nnodes(spec) == (low, high)
    else:
        with pytest.raises(ValueError, match="MIN:MAX with 1 <= MIN <= MAX"):
            parse_nnodes(spec)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    n=st.integers(1, 6),
    asked=st.lists(st.one_of(st.none(), st.integers(0, 7)), min_size=6, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_round_keeps_the_ranks_of_the_round_before_whatever_order_its_hosts_rejoin_in(n, asked, seed):
    """The same hosts rejoining a restart round in any order keep their ranks: ``--node-rank`` ones the rank
    asked for (when it is below the round's size and nobody asked for it first), the others their previous one."""
    rng = random.Random(seed)
    taken: set[int] = set()  # a rank asked for twice is refused at join (test_a_taken_rank_is_refused)
    hosts = []
    for i in range(n):
        rank = asked[i] if asked[i] not in taken else None
        taken.add(rank)
        hosts.append({"id": f"h{i}", "rank": rank})
    ranks = membership._ranks(hosts, {})
    for _ in range(4):
        rng.shuffle(hosts)
        again = membership._ranks(hosts, {lid: rank for rank, lid in enumerate(ranks)})
        assert again == ranks
        for h in hosts:
            if h["rank"] is not None and h["rank"] < n:
                assert again[h["rank"]] == h["id"]
        ranks = again


def test_the_detection_bounds_follow_from_the_heartbeat_settings():
    r = Rendezvous("127.0.0.1:1", min_hosts=1, heartbeat_interval_s=0.5, missed_heartbeats=4, join_timeout_s=30.0)
    assert r.gone_after_s == 2.0 and r.detection_bound_s == 2.5 and r.call_timeout_s == 2.0
    assert r.rejoin_timeout_s == 15.0  # min(60, join / 2)
    with pytest.raises(ValueError, match=r"host rank 2 is out of range for at most 2 hosts: give 0..1"):
        Rendezvous("127.0.0.1:1", min_hosts=1, max_hosts=2, rank=2)
    with pytest.raises(ValueError, match="need 1 <= min_hosts <= max_hosts"):
        Rendezvous("127.0.0.1:1", min_hosts=3, max_hosts=2)


def test_a_restart_of_a_round_already_restarted_opens_no_other_and_the_first_end_stands(server):
    with Rendezvous(server.address, min_hosts=1, launcher_id="a", last_call_s=0.0, join_timeout_s=60.0) as a:
        assert a.join().round == 0
        assert a.next_round(0, "a failure") == 1 and a.restarted_here
        assert a.next_round(0, "the same failure, seen again") == 1 and not a.restarted_here
        assert a.join().round == 1
        assert a.next_round(0, "a stale failure of round 0") == 1 and not a.restarted_here
        assert a.poll().round == 1
        assert a.end("first reason") == "first reason"
        assert a.end("second reason") == "first reason"
        assert a.poll().ended == "first reason"
