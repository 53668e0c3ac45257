"""PassManager.default(auto=True): options chosen per graph by the cost model, results unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from utils import check_against_simulation

import replicator as rp
from replicator.cost.auto import AutoPassManager
from replicator.cost.topology import Link, Topology

# Two made-up machines: messages cost a lot and bytes nothing, or the reverse.
LATENCY_BOUND = Topology("latency-bound", cores=Link(1e-3, 1e-15), workers=Link(1e-3, 1e-15), source="test")
BANDWIDTH_BOUND = Topology("bandwidth-bound", cores=Link(1e-12, 1e-6), workers=Link(1e-12, 1e-6), source="test")


def many_small_sums(batch):
    return rp.all_sum([batch * i for i in range(12)])


def test_the_choice_is_the_fastest_setting_tried_and_is_stated():
    pipeline = rp.PassManager.default(auto=True, topology=LATENCY_BOUND)
    assert isinstance(pipeline, AutoPassManager) and "latency-bound" in repr(pipeline)
    lowered = rp.Replicator(1, 8, passes=pipeline).lower(many_small_sums, np.ones((8, 4), np.float32))
    (note,) = lowered.notes
    assert note.startswith("auto (latency-bound): chose ")
    chosen = pipeline.predicted_seconds(lowered.final)
    default = pipeline._passes({}).run(lowered.traced)
    assert chosen <= pipeline.predicted_seconds(default.final)
    # Latency-bound, 8 replicas: a tree of 2 log2(8) = 6 messages beats a ring of 14.
    assert "all_reduce_algorithm='reduce_broadcast'" in note, note


def test_bandwidth_bound_keeps_the_ring_formula_default():
    lowered = rp.Replicator(1, 8, passes=rp.PassManager.default(auto=True, topology=BANDWIDTH_BOUND)).lower(
        many_small_sums, np.ones((8, 4), np.float32)
    )
    assert "chose the defaults" in lowered.notes[0], lowered.notes


@pytest.mark.parametrize("topology", [LATENCY_BOUND, BANDWIDTH_BOUND, "gpu-hosts-100gbe"], ids=str)
def test_auto_training_matches_the_simulation(topology):
    tx = optax.adam(1e-2)

    def step(state, batch):
        grads = jax.grad(lambda p: jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2))(state["params"])
        updates, opt = tx.update(rp.all_mean(grads), state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {}

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}
    batches = [
        {"x": rng.normal(size=(64, 16)).astype(np.float32), "y": rng.normal(size=(64, 8)).astype(np.float32)}
        for _ in range(2)
    ]
    repl = rp.Replicator(2, 4, passes=rp.PassManager.default(auto=True, topology=topology))
    check_against_simulation(repl, step, batches, {"params": params, "opt": tx.init(params)})


def test_searched_options_cannot_also_be_fixed():
    with pytest.raises(ValueError, match=r"chooses \['all_reduce_algorithm'\] itself"):
        rp.PassManager.default(auto=True, all_reduce_algorithm="ring")


def test_the_compile_cache_tells_topologies_apart():
    a = rp.PassManager.default(auto=True, topology=LATENCY_BOUND).key()
    b = rp.PassManager.default(auto=True, topology=BANDWIDTH_BOUND).key()
    assert a != b and a != rp.PassManager.default().key()


def test_auto_names_every_pass_it_may_choose_and_lowered_names_those_that_ran(n_devices):
    pipe = rp.PassManager.default(auto=True)
    assert "hierarchical-allreduce" in pipe.names and "shard-optimizer-update" in pipe.names
    assert repr(pipe).startswith("PassManager(auto")
    # A candidate can be disabled even where the chosen setting leaves it out.
    repl = rp.Replicator(1, n_devices, passes=rp.PassManager.default(auto=True, disable=["hierarchical-allreduce"]))
    lowered = repl.lower(lambda b: rp.all_mean(b), np.ones((n_devices, 2), np.float32))
    ran = [s.name for s in lowered.snapshots[1:]]
    assert "hierarchical-allreduce" not in ran and ran[-1] == "lower-collectives"
    assert any(note.startswith("auto (") for note in lowered.notes)
