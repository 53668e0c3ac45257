"""ZeRO on each pipeline stage's data-parallel replicas (``zero_stage=1..3``) against one device: ``jax.jit`` of
``jax.value_and_grad`` + ``optax.adam`` on the global batch, 3 steps. And what each device stores: its ``1/D``
of the stage's optimizer state (and, at stage 3, of its parameters), the rows padded to a multiple of ``D``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.core.jaxprs import iter_eqns
from replicator.stages.programs import DATA_AXES
from replicator.stages.replicas import PipelinedReplicas, describe
from replicator.stages.train import pipeline_train_step
from tests.stages.test_gpipe import four_stages_tied, two_stages
from tests.stages.test_replicas import _params_for, global_batch
from tests.stages.test_train import STEPS, _assert_close, _reference
from tests.stages.test_user_step import make_step

# (num_workers, cores_per_worker) for S = 2 stages: D = 2 on 'cores', D = 4 on both data axes (2 x 2).
GRIDS = {2: (1, 4), 4: (2, 4)}


def _replicas(replicas: int, zero_stage: int, schedule: str = "1f1b", stages: int = 2, m: int = 2):
    workers, cores = GRIDS[replicas] if stages == 2 else (1, 8)
    grid = np.array(jax.devices()[: workers * cores]).reshape(workers, cores)
    return PipelinedReplicas(grid, stages, m, schedule, zero_stage=zero_stage)


def _batch():
    ids, y = global_batch()
    y[len(y) // 2 :] += 3.0  # the halves pull apart: each replica must take its own rows
    return ids, y


def _run(pipelined, loss, opt, p, batch):
    state, values = (p, opt.init(p)), []
    for _ in range(STEPS):  # global shapes in and out, every step
        state, value = pipelined.run(loss, opt, batch, state)
        values.append(value)
    return state, values


@pytest.mark.parametrize("replicas", [2, 4], ids=["D2", "D4"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_matches_one_device(zero_stage, schedule, replicas):
    p, batch, opt = _params_for(two_stages), _batch(), optax.adam(1e-2)
    pipelined = _replicas(replicas, zero_stage, schedule)
    assert pipelined.replicas == replicas
    (got_p, got_state), values = _run(pipelined, two_stages, opt, p, batch)
    want_p, want_state, want_values = _reference(two_stages, opt, p, *batch)
    _assert_close(got_p, want_p)
    _assert_close(got_state, want_state)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_with_a_tied_embedding_over_four_stages(zero_stage):
    # The embedding's gradient is summed over stages 0 and 3 before it is reduce-scattered over the replicas.
    p, batch, opt = _params_for(four_stages_tied), _batch(), optax.adam(1e-2)
    pipelined = _replicas(2, zero_stage, "1f1b", stages=4, m=4)
    (got_p, got_state), _ = _run(pipelined, four_stages_tied, opt, p, batch)
    want_p, want_state, _ = _reference(four_stages_tied, opt, p, *batch)
    _assert_close(got_p, want_p)
    _assert_close(got_state, want_state)


def _chunks(array: jax.Array, mesh) -> dict:
    """Per device of the mesh: (stage, its columns of the row) and its shard's shape."""
    shards = {s.device: s for s in array.addressable_shards}
    return {
        d: (shards[d].index[0].start, (shards[d].index[1].start or 0, shards[d].index[1].stop), shards[d].data.shape)
        for d in mesh.devices.flat
    }


@pytest.mark.parametrize("replicas", [2, 4], ids=["D2", "D4"])
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_each_device_stores_its_chunk_of_the_row(zero_stage, replicas):
    p, batch, opt = _params_for(two_stages), _batch(), optax.adam(1e-2)
    pipelined = _replicas(replicas, zero_stage)
    train = pipelined.step_for(two_stages, opt)
    built = train.built(p, *batch)
    # The row (emb, w1 and head) and a slot (`extra`, kept by both stages), each a multiple of D long.
    sizes = {k: n for k, (_, n) in built.packing.buffers().items()}
    assert sizes == {"float32": 144, "slot0": 4}
    mesh = pipelined.mesh

    def split(n):
        chunk = n // replicas
        return [(s, (r * chunk, (r + 1) * chunk), (1, chunk)) for s in range(2) for r in range(replicas)]

    def whole(n):
        return [(s, (0, None), (1, n)) for s in range(2) for _ in range(replicas)]

    def check(packed, packed_state):
        for key, n in sizes.items():
            for moment in (packed_state[0].mu, packed_state[0].nu):
                assert moment[key].shape == (2, n)
                assert list(_chunks(moment[key], mesh).values()) == split(n)  # device r of a stage: chunk r
            assert packed[key].shape == (2, n)
            assert list(_chunks(packed[key], mesh).values()) == (split(n) if zero_stage == 3 else whole(n))
        count = packed_state[0].count  # Adam's step count: a scalar, whole on every device
        assert all(s.data.shape == () for s in count.addressable_shards) and len(count.addressable_shards) == mesh.size

    packed, packed_state = train.pack(p, opt.init(p))
    check(packed, packed_state)
    for _ in range(STEPS):  # what the step returns is stored the same way
        packed, packed_state, _ = train.step(p, packed, packed_state, *batch)
    check(packed, packed_state)
    got_p, got_state = train.unpack(p, packed, packed_state)
    want_p, want_state, _ = _reference(two_stages, opt, p, *batch)
    _assert_close(got_p, want_p)
    _assert_close(got_state, want_state)


def test_describe_counts_a_devices_chunk():
    p, batch, opt = _params_for(two_stages), _batch(), optax.adam(1e-2)
    reports = {z: describe(_replicas(4, z).step_for(two_stages, opt), p, *batch, memory=True) for z in (0, 1, 3)}
    assert reports[0].optimizer_bytes == 2 * 147 * 4 + 4  # mu and nu: the largest row (147 floats), the count
    assert reports[1].optimizer_bytes == 2 * 37 * 4 + 4  # 1/4 of the row padded to 148
    assert reports[1].row_bytes == 148 * 4 and reports[3].row_bytes == 37 * 4
    text = str(reports[3])
    assert "ZeRO-3 over each stage's 4 replicas" in text and "parameters 148 B (1/4 of the packed row)" in text
    arguments = {z: r.device_memory.arguments for z, r in reports.items()}
    assert arguments[3] < arguments[1] < arguments[0]


@pytest.mark.parametrize("replicas", [2, 4], ids=["D2", "D4"])
def test_a_row_not_divisible_by_the_replicas_is_padded(replicas):
    p, batch, opt = _params_for(two_stages), _batch(), optax.adam(1e-2)
    p["extra"] = np.linspace(-1, 1, 5).astype(np.float32)  # kept by both stages: a slot of 5 floats
    pipelined = _replicas(replicas, 3)
    built = pipelined.step_for(two_stages, opt).built(p, *batch)
    assert {k: n for k, (_, n) in built.packing.buffers().items()} == {
        "float32": 144,
        "slot0": 6 if replicas == 2 else 8,
    }
    (got_p, got_state), _ = _run(pipelined, two_stages, opt, p, batch)
    assert got_p["extra"].shape == (5,)
    want_p, want_state, _ = _reference(two_stages, opt, p, *batch)
    _assert_close(got_p, want_p)
    _assert_close(got_state, want_state)


def _data_collectives(zero_stage):
    """The step's collectives over the data axes: (primitive, operand shape)."""
    p, batch, opt = _params_for(two_stages), _batch(), optax.adam(1e-2)
    train = _replicas(2, zero_stage).step_for(two_stages, opt)
    built = train.built(p, *batch)
    packed, packed_state = train.pack(p, opt.init(p))
    micro = [np.reshape(x, (2, 2, -1, *x.shape[1:])) for x in batch]
    jaxpr = built.step.trace(packed, packed_state, micro).jaxpr
    return [
        (eqn.primitive.name, eqn.invars[0].aval.shape)
        for eqn in iter_eqns(jaxpr.jaxpr)
        if tuple(eqn.params.get("axes", eqn.params.get("axis_name", ()))) == DATA_AXES
    ]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_stage_two_reduce_scatters_the_gradient_row(zero_stage):
    # No device holds the whole averaged gradients: the row is reduce-scattered, only the loss all-reduced.
    collectives = _data_collectives(zero_stage)
    assert ("reduce_scatter", (1, 144)) in collectives and ("reduce_scatter", (1, 4)) in collectives  # row, slot
    assert all(shape == () for name, shape in collectives if name == "psum")
    assert any(name == "psum" and shape != () for name, shape in _data_collectives(1))  # stage 1 all-reduces


@pytest.mark.parametrize("zero_stage", [-1, 4, True, 1.0, "1"])
def test_zero_stage_out_of_range_is_refused(zero_stage):
    grid = np.array(jax.devices()[:4]).reshape(1, 4)
    with pytest.raises(ValueError, match=r"zero_stage must be 0, 1, 2 or 3, got .*1/D per device"):
        PipelinedReplicas(grid, 2, 2, "1f1b", zero_stage=zero_stage)
    with pytest.raises(ValueError, match=r"zero_stage must be 0, 1, 2 or 3"):
        pipeline_train_step(two_stages, optax.adam(1e-2), num_microbatches=2, zero_stage=zero_stage)


def test_the_users_own_step_refuses_zero_where_its_update_runs_per_replica():
    # ZeRO on the user's own step splits its leaves over a stage's devices. With several replicas per device
    # the state's update runs once per device, unless it holds a collective that differs between a device's
    # replicas (an rp.all_sum): then it runs vmapped over them, and ZeRO is refused, pointing to run_pipelined.
    p, batch, opt = _params_for(two_stages), _batch(), optax.adam(1e-2)
    data_parallel = make_step(two_stages, opt)

    def step(state, batch):
        new_state, out = data_parallel(state, batch)
        count = rp.all_sum(jnp.ones((), jnp.float32)) / rp.num_replicas()  # 1 on every replica
        return jax.tree.map(lambda x: x * count.astype(x.dtype), new_state), out

    grid = np.array(jax.devices()[:4]).reshape(1, 4)
    pipelined = PipelinedReplicas(grid, 2, 2, "1f1b", zero_stage=1, fold_axes=(("cores_fold", 2),))
    with pytest.raises(ValueError, match=r"zero_stage=1 with replicas_per_device > 1: .*rp.all_sum.*run_pipelined"):
        pipelined.run_step(step, batch, (p, opt.init(p)))
