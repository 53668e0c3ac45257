"""Broadcast and per-replica state: what mutation testing found untested (scripts/mutate.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.runtime.state import PerReplicaSignature


def test_a_per_replica_signature_never_equals_the_replicated_one() -> None:
    plain = ((8, 3), np.dtype(np.float32))
    per_replica = PerReplicaSignature(plain)
    assert per_replica != plain and plain != per_replica
    assert per_replica == PerReplicaSignature(plain)


def test_broadcast_state_in_a_job_of_processes_gathers_a_split_leaf_and_takes_process_0s_copies(
    repl: rp.Replicator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As process 1 of two: a replicated leaf (each process holds its own copy) takes process 0's value; a
    leaf split over the devices is one global value, gathered as it is, not sent from process 0."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    sent: list[list[np.ndarray]] = []

    def from_process_0(leaves: list[np.ndarray]) -> list[np.ndarray]:
        sent.append(leaves)
        return [np.full_like(x, 7) for x in leaves]

    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", from_process_0)
    split = jax.device_put(
        np.arange(repl.num_replicas, dtype=np.float32), NamedSharding(repl.mesh, P(("workers", "cores")))
    )
    out = rp.broadcast_state({"mine": np.zeros((2,), np.float32), "split": split}, repl)
    np.testing.assert_array_equal(np.asarray(out["mine"]), np.full((2,), 7, np.float32))
    np.testing.assert_array_equal(np.asarray(out["split"]), np.arange(repl.num_replicas, dtype=np.float32))
    assert out["split"].sharding.is_fully_replicated
    assert [x.shape for x in sent[0]] == [(2,)]


def test_a_per_replica_step_returning_three_values_gets_the_tracers_error(repl: rp.Replicator) -> None:
    state = {"stats": jnp.zeros((repl.num_replicas, 2))}
    batch = {"x": np.ones((repl.num_replicas, 2), np.float32)}
    with pytest.raises((TypeError, ValueError), match=r"must return a pair \(new_state, outputs\); it returned tuple"):
        repl.run(lambda s, b: (s, {"y": b["x"]}, 0), batch, state, per_replica_state=True)
