"""Per-device memory: XLA's compiled memory analysis (Lowered.memory) against the bytes the graph says it holds."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.cost.memory import state_bytes_per_device
from replicator.pass_manager.manager import Lowered

LAYERS, WIDTH, BATCH = 4, 256, 128


def _mlp_problem():
    params = {f"w{i}": jnp.zeros((WIDTH, WIDTH)) for i in range(LAYERS)}
    tx = optax.adam(1e-3)

    def step(s, b):
        def loss(p):
            h = b["x"]
            for i in range(LAYERS):
                h = jnp.tanh(h @ p[f"w{i}"])
            return jnp.mean(h**2)

        g = rp.all_mean(jax.grad(loss)(s["p"]))
        updates, opt = tx.update(g, s["o"], s["p"])
        return {"p": optax.apply_updates(s["p"], updates), "o": opt}, {}

    return step, {"p": params, "o": tx.init(params)}, {"x": np.ones((BATCH, WIDTH), np.float32)}


@pytest.mark.parametrize("zero", [False, True])
def test_xla_counts_the_arguments_the_graph_says_a_device_holds(repl, zero):
    step, state, batch = _mlp_problem()
    passes = rp.PassManager.default(shard_optimizer=zero)
    lowered = rp.Replicator(1, repl.num_replicas, passes=passes).lower(step, batch, state)
    usage = lowered.memory()
    n = repl.num_replicas
    batch_bytes = BATCH // n * WIDTH * 4  # one replica's rows
    weights = LAYERS * WIDTH * WIDTH * 4
    predicted = state_bytes_per_device(lowered.final)
    # Adam: parameters + two moments (+ a count); ZeRO-1 keeps the moments 1/N per device.
    assert predicted == weights + 2 * weights // (n if zero else 1) + 4
    # share-slice-kernels: the offsets into the fused gradient buffer are int32 arguments too
    offsets = 4 * len(lowered.final.runtime_constants)
    assert usage.arguments == predicted + batch_bytes + offsets  # XLA's figure, independently
    assert usage.peak == usage.arguments + usage.outputs - usage.aliased + usage.temporaries
    assert usage.outputs >= predicted  # the new state comes back


def test_zero_divides_the_state_and_the_peak(repl):
    step, state, batch = _mlp_problem()
    whole, zero = (
        rp.Replicator(1, repl.num_replicas, passes=rp.PassManager.default(shard_optimizer=z)).lower(step, batch, state)
        for z in (False, True)
    )
    assert zero.memory().peak < whole.memory().peak
    assert state_bytes_per_device(zero.final) < state_bytes_per_device(whole.final)


def test_explain_prints_the_predicted_state_and_the_measured_memory(repl):
    step, state, batch = _mlp_problem()
    text = str(repl.explain(step, batch, state))
    assert "state per device (predicted from the graph): 3.0 MiB" in text, text
    assert "per-device memory (XLA's compiled memory analysis): peak" in text, text


def test_a_lowered_that_does_not_know_its_devices_says_so(repl):
    lowered = repl.lower(lambda b: rp.all_sum(b), np.ones((repl.num_replicas, 2), np.float32))
    with pytest.raises(ValueError, match="does not know its devices"):
        Lowered(lowered.snapshots).memory()


def _two_leaf_step(s, b):
    return {"stats": s["stats"] + rp.all_mean(b["x"]).sum(), "w": s["w"]}, {}


def _two_leaf_state(n):
    return {"stats": jnp.zeros((n, 256)), "w": jnp.zeros(512, jnp.bfloat16)}


def test_a_per_replica_leaf_counts_one_row_per_device_and_a_bfloat16_one_two_bytes_an_element(n_devices):
    repl = rp.Replicator(1, n_devices)
    batch = {"x": np.ones((n_devices, 4), np.float32)}  # one row of 4 float32s per replica
    state = _two_leaf_state(n_devices)
    per_replica = repl.lower(_two_leaf_step, batch, state, per_replica_state={"stats": True, "w": False}).memory()
    assert per_replica.arguments == 256 * 4 + 512 * 2 + 4 * 4  # one row of stats, all of w, one batch row
    replicated = repl.lower(_two_leaf_step, batch, state).memory()
    assert replicated.arguments == n_devices * 256 * 4 + 512 * 2 + 4 * 4  # every row of stats on every device


def test_donated_state_is_counted_as_aliased(n_devices):
    batch = {"x": np.ones((n_devices, 4), np.float32)}
    kept, donated = (
        rp.Replicator(1, n_devices, donate_state=d).lower(_two_leaf_step, batch, _two_leaf_state(n_devices)).memory()
        for d in (False, True)
    )
    assert kept.aliased == 0 and donated.aliased == n_devices * 256 * 4 + 512 * 2  # the new state reuses it all
    assert donated.arguments == kept.arguments and donated.outputs == kept.outputs
