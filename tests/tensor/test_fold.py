"""The tensor axis with several data-parallel replicas per device (``replicas_per_device=k``).

``Replicator(W, C, parallelism=rp.Parallelism(tensor=T, replicas_per_device=k))`` has ``W x C / T`` data-parallel
replicas (as without folding), each a tensor group of ``T`` devices, ``k`` replicas per group: ``W x C / k``
devices. Each test compares the new state (parameters and Adam's moments) and the loss after two steps with
``jax.jit`` of the same update on one device on the global batch (1e-5 relative to each leaf's largest
value), on the data path (the fold pass and ``vmap`` over the folded axes around the split step) and with
pipeline stages (the tick loop vmapped over the fold), ZeRO 1-3 included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from tests.tensor.test_replicator import PLAN, TX, _batches, _close, _reference, _run, _state
from tests.tensor.test_stages import PLAN as STAGE_PLAN
from tests.tensor.test_stages import _reference as _stage_reference
from tests.tensor.test_stages import _state as _stage_state
from tests.tensor.test_stages import _train as _stage_train


def _repl(workers, cores, k, zero=0, **options):
    passes = rp.PassManager.default(zero=zero, shard_optimizer_min_bytes=0) if zero else None
    return rp.Replicator(workers, cores, passes=passes, parallelism=rp.Parallelism(replicas_per_device=k, **options))


@pytest.mark.parametrize(
    "workers,cores,k,zero",
    [(1, 8, 2, 0), (1, 8, 2, 3), (2, 8, 4, 1), (1, 16, 4, 2), (1, 4, 2, 0)],
    ids=["1x8-k2", "1x8-k2-zero3", "2x8-k4-zero1 (whole workers)", "1x16-k4-zero2", "1x4-k2 (one group)"],
)
def test_folded_data_by_tensor_equals_one_device(workers, cores, k, zero):
    repl = _repl(workers, cores, k, zero, tensor=2, tensor_plan=PLAN)
    replicas = workers * cores // 2
    assert repl.num_replicas == replicas and repl.mesh.devices.size == workers * cores // k
    assert repl.mesh.shape["tensor"] == 2
    batches = _batches(2 * replicas)
    got, loss = _run(repl, batches, _state())
    want, want_loss = _reference(batches, _state())
    _close(got, want)
    np.testing.assert_allclose(np.asarray(loss), float(want_loss), rtol=1e-5)
    assert np.shape(loss) == (replicas,)
    params, (adam, _) = got  # the planned leaves 1/T per device, as without folding
    assert params["fc1"].addressable_shards[0].data.shape[1] == 8 and adam.mu["fc2"].shape == (16, 3)


def test_a_users_collective_spans_the_folded_replicas():
    # A batch norm over every replica's rows (rp.all_mean of each replica's mean): equal to the global batch's
    # statistics on one device only if the folded replicas of a device are counted one by one.
    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["fc0"])
        h = h - rp.all_mean(jnp.mean(h, axis=0))
        return jnp.mean((jnp.tanh(h @ p["fc1"] + p["b1"]) @ p["fc2"] - b["y"]) ** 2)

    def one(p, b):
        h = jnp.tanh(b["x"] @ p["fc0"])
        h = h - jnp.mean(h, axis=0)
        return jnp.mean((jnp.tanh(h @ p["fc1"] + p["b1"]) @ p["fc2"] - b["y"]) ** 2)

    def step(state, b):
        value, g = jax.value_and_grad(loss)(state[0], b)
        u, o = TX.update(rp.all_mean(g), state[1], state[0])
        return (optax.apply_updates(state[0], u), o), rp.all_mean(value)

    repl = _repl(1, 8, 2, tensor=2, tensor_plan=PLAN)
    batches = _batches(8)
    state, want = _state(), _state()
    for b in batches:
        state, _ = repl.run(step, b, state)
        value, g = jax.jit(jax.value_and_grad(one))(want[0], b)
        u, o = TX.update(g, want[1], want[0])
        want = (optax.apply_updates(want[0], u), o)
    _close(state, want)


@pytest.mark.parametrize(
    "workers,cores,k,schedule,zero", [(1, 8, 2, "1f1b", 0), (1, 16, 2, "gpipe", 3), (2, 8, 4, "1f1b-fused", 1)]
)
def test_folded_stages_by_tensor_equal_one_device(workers, cores, k, schedule, zero):
    repl = _repl(workers, cores, k, zero, tensor=2, tensor_plan=STAGE_PLAN, stages=2, microbatches=4, schedule=schedule)
    pipelined = repl.pipelined
    assert pipelined.replicas == workers * cores // 4 and pipelined.replicas_per_device == k
    assert pipelined.mesh.devices.size == workers * cores // k and pipelined.mesh.shape["tensor"] == 2
    batches = _batches(4 * pipelined.replicas)
    got, loss = _stage_train(repl, batches, _stage_state())
    want, want_loss = _stage_reference(batches, _stage_state())
    _close(got, want)
    np.testing.assert_allclose(np.asarray(loss), float(want_loss), rtol=1e-5)


def test_a_fold_that_does_not_fit_the_tensor_groups_is_refused():
    with pytest.raises(
        ValueError, match=r"replicas_per_device=2 with tensor=4 needs cores_per_worker, a multiple of 4"
    ):
        _repl(1, 6, 2, tensor=4, tensor_plan=PLAN)
    with pytest.raises(ValueError, match=r"replicas_per_device=3 does not split"):
        _repl(1, 8, 3, tensor=2, tensor_plan=PLAN)
