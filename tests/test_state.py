"""broadcast_state: replica 0's copy on every replica, in a step and from the host."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import replicator as rp
from replicator.runtime import state as state_module
from replicator.runtime.state import PerReplicaSignature, broadcast_state


def _forever(batch):
    def input_fn(ctx):
        while True:
            yield batch

    return input_fn


def per_device(mesh, values: list[np.ndarray]) -> jax.Array:
    """A 'replicated' array whose devices hold different data: values[r] on replica r's device."""
    sharding = NamedSharding(mesh, P())
    arrays = [jax.device_put(v, d) for v, d in zip(values, mesh.devices.flat, strict=True)]
    return jax.make_array_from_single_device_arrays(values[0].shape, sharding, arrays)


def device_values(x: jax.Array, mesh) -> list[np.ndarray]:
    by_device = {s.device: np.asarray(s.data) for s in x.addressable_shards}
    return [by_device[d] for d in mesh.devices.flat]


class TestInsideAStep:
    def test_per_replica_values_become_replica_0s(self, repl2d):
        n = repl2d.num_replicas
        x = np.arange(n * 2, dtype=np.float32).reshape(n, 2) + 10.0  # row r on replica r

        def input_fn(ctx):
            rows = n // ctx.num_workers
            while True:
                yield {"x": x[ctx.worker_id * rows : (ctx.worker_id + 1) * rows]}

        def step_fn(batch):
            mine = {"x": batch["x"][0], "rid": rp.replica_id()}
            return {"mine": mine, "bcast": broadcast_state(mine, repl2d)}

        out = repl2d.run(step_fn, input_fn)
        np.testing.assert_array_equal(out["mine"]["rid"], np.arange(n))
        np.testing.assert_array_equal(out["bcast"]["x"], np.broadcast_to(x[0], (n, 2)))
        np.testing.assert_array_equal(out["bcast"]["rid"], np.zeros(n))

    def test_broadcast_state_is_replica_invariant_state(self, repl):
        def step_fn(state, batch):
            new = state + batch["x"][0]  # differs per replica
            return broadcast_state(new), {}

        batch = {"x": np.arange(repl.num_replicas, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)}
        lowered = repl.lower(step_fn, batch, jnp.zeros(3))
        assert rp.passes.count_primitives(lowered.traced.jaxpr, ["rp.broadcast"]) == {"rp.broadcast": 1}
        state, _ = repl.run(step_fn, _forever(batch), jnp.ones(3))
        np.testing.assert_array_equal(state, np.ones(3))  # 1 + replica 0's 0

        def without(state, batch):
            return state + batch["x"][0], {}

        if repl.num_replicas > 1:
            with pytest.raises(rp.DivergentStateError):
                repl.lower(without, batch, jnp.zeros(3))


class TestFromTheHost:
    def test_devices_holding_different_copies_get_replica_0s(self, repl2d):
        mesh, n = repl2d.mesh, repl2d.num_replicas
        values = [np.full((2, 3), 100.0 + r, np.float32) for r in range(n)]
        state = {"w": per_device(mesh, values), "step": per_device(mesh, [np.int32(r) for r in range(n)])}
        assert [float(v[0, 0]) for v in device_values(state["w"], mesh)] == [100.0 + r for r in range(n)]

        out = broadcast_state(state, repl2d)
        for name, want in (("w", values[0]), ("step", np.int32(0))):
            assert out[name].sharding == NamedSharding(mesh, P())
            assert out[name].dtype == state[name].dtype and out[name].shape == state[name].shape
            for got in device_values(out[name], mesh):
                np.testing.assert_array_equal(got, want)

        # Run uses it as is: every replica sees replica 0's copy.
        def step_fn(s, batch):
            return s, {"w": s["w"][0, 0] + 0 * batch["x"][0]}

        _, o = repl2d.run(step_fn, _forever({"x": np.zeros(n, np.float32)}), out)
        np.testing.assert_array_equal(o["w"], np.full(n, 100.0))
        assert broadcast_state(state)["w"].sharding == NamedSharding(mesh, P())  # mesh taken from the state

    def test_host_values_are_placed_replicated(self, repl):
        state = {"a": np.arange(3.0), "n": 7, "lr": 0.5, "w": jnp.ones(2, jnp.bfloat16), "weak": jnp.asarray(2.0)}
        out = broadcast_state(state, repl)
        assert out["a"].dtype == jnp.float32 and out["n"].dtype == jnp.int32 and out["lr"].dtype == jnp.float32
        assert out["w"].dtype == jnp.bfloat16 and not out["weak"].weak_type
        for leaf in jax.tree.leaves(out):
            assert leaf.sharding == NamedSharding(repl.mesh, P())
        np.testing.assert_array_equal(out["a"], np.arange(3.0))
        assert int(out["n"]) == 7
        sharded = jax.device_put(np.arange(repl.num_replicas * 2.0), NamedSharding(repl.mesh, P(("workers", "cores"))))
        gathered = broadcast_state(sharded, repl)  # one global value: gathered, not replaced
        assert gathered.sharding == NamedSharding(repl.mesh, P())
        np.testing.assert_array_equal(gathered, np.arange(repl.num_replicas * 2.0))

    def test_several_processes_take_process_0s_copy(self, repl, monkeypatch):
        sent = []

        def fake_broadcast(tree):
            sent.append(tree)
            return [np.full_like(x, -1) for x in tree]  # "process 0's" values

        monkeypatch.setattr(jax, "process_count", lambda: 2)
        monkeypatch.setattr(state_module.multihost_utils, "broadcast_one_to_all", fake_broadcast)
        out = broadcast_state({"w": np.ones(3, np.float32), "k": 3}, repl)
        assert len(sent) == 1 and len(sent[0]) == 2
        np.testing.assert_array_equal(out["w"], -np.ones(3))
        assert int(out["k"]) == -1 and out["k"].dtype == jnp.int32

    def test_without_a_mesh_it_asks_for_the_replicator(self):
        with pytest.raises(ValueError, match=r"Pass the Replicator: broadcast_state\(state, repl\)"):
            broadcast_state({"w": np.ones(3)})
        with pytest.raises(TypeError, match="must be a replicator.Replicator"):
            broadcast_state({"w": np.ones(3)}, "repl")


def test_replicator_method(repl):
    state = {"w": np.arange(3, dtype=np.float32)}
    placed = repl.broadcast_state(state)
    np.testing.assert_array_equal(placed["w"], state["w"])
    assert placed["w"].sharding.is_fully_replicated and placed["w"].sharding.mesh == repl.mesh


# Found by mutation testing (scripts/mutate.py): a per-replica signature, broadcast_state across processes.


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


@pytest.mark.parametrize("scalar", [np.float32(0), np.zeros((), np.float32), jnp.float32(0)])
def test_a_0d_leaf_marked_per_replica_is_refused(scalar) -> None:
    """A scalar has no leading axis to hold one row per replica."""
    with pytest.raises(ValueError, match=r"leading axis of size num_replicas \(8\).*shape \(\)"):
        state_module.per_replica_flags({"s": scalar}, True, 8)
    assert state_module.per_replica_flags({"s": np.zeros((8,), np.float32)}, True, 8) == (True,)


def test_a_per_replica_prefix_that_does_not_match_the_state_or_holds_a_non_bool_is_refused() -> None:
    state = {"params": np.zeros(3), "stats": np.zeros((8, 3))}
    assert state_module.per_replica_flags(state, {"params": False, "stats": True}, 8) == (False, True)
    for prefix, why in (
        ({"params": False}, "does not match the state's structure"),  # a key missing
        ({"params": False, "stats": True, "extra": False}, "does not match the state's structure"),
        ({"params": 0, "stats": 1}, "its leaves must be bools, got 0"),  # ints are not flags
        ({"params": False, "stats": "yes"}, "its leaves must be bools"),
    ):
        with pytest.raises(ValueError, match=rf"per_replica_state must be a bool.*{why}"):
            state_module.per_replica_flags(state, prefix, 8)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=6))
def test_with_per_replica_marks_exactly_the_flagged_signatures(marks) -> None:
    """Whatever the signatures were marked before (a cache key reused), exactly the flagged ones are marked."""
    signatures = tuple(
        PerReplicaSignature(((8, i), np.dtype(np.float32))) if before else ((8, i), np.dtype(np.float32))
        for i, (before, _) in enumerate(marks)
    )
    flags = tuple(flag for _, flag in marks)
    got = state_module.with_per_replica(signatures, flags)
    assert [type(s) is PerReplicaSignature for s in got] == list(flags)
    assert [tuple(s) for s in got] == [tuple(s) for s in signatures]  # the shapes and dtypes kept
