"""ZeRO on each pipeline stage's data-parallel replicas (``zero=1..3``) for a loss and an optimizer
(``run_pipelined``) against one device: ``jax.jit`` of ``jax.value_and_grad`` + ``optax.adam`` on the global batch,
3 steps. Its step is the user step of that loss and optimizer (:func:`~replicator.stages.train.optimizer_step`):
what each device stores, leaf by leaf, and the collectives are tested on the user's step in
tests/stages/test_user_step_zero.py; here each ZeRO level and schedule once, D = 2 and 4, and the report."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.stages.replicas import PipelinedReplicas, describe
from replicator.stages.train import PipelineTrainStep, pipeline_train_step
from replicator.stages.user_step import PipelinedStep
from tests.stages.test_gpipe import four_stages_tied, two_stages
from tests.stages.test_replicas import _params_for, global_batch
from tests.stages.test_train import STEPS, _assert_close, _reference
from tests.stages.test_user_step import make_step

# (num_workers, cores_per_worker) for S = 2 stages: D = 2 on 'cores', D = 4 on both data axes (2 x 2).
GRIDS = {2: (1, 4), 4: (2, 4)}


def _replicas(replicas: int, zero: int, schedule: str = "1f1b", stages: int = 2, m: int = 2):
    workers, cores = GRIDS[replicas] if stages == 2 else (1, 8)
    grid = np.array(jax.devices()[: workers * cores]).reshape(workers, cores)
    return PipelinedReplicas(grid, stages, m, schedule, zero=zero)


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


@pytest.mark.parametrize(
    ("zero", "schedule", "replicas"),
    [(1, "gpipe", 2), (1, "1f1b", 4), (2, "1f1b", 2), (2, "gpipe", 4), (3, "1f1b", 2), (3, "gpipe", 4)],
)
def test_zero_matches_one_device(zero, schedule, replicas):
    p, batch, opt = _params_for(two_stages), _batch(), optax.adam(1e-2)
    pipelined = _replicas(replicas, zero, schedule)
    assert pipelined.replicas == replicas
    (got_p, got_state), values = _run(pipelined, two_stages, opt, p, batch)
    want_p, want_state, want_values = _reference(two_stages, opt, p, *batch)
    _assert_close(got_p, want_p)
    _assert_close(got_state, want_state)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_with_a_tied_embedding_over_four_stages(zero):
    # The embedding's gradient is summed over stages 0 and 3 before it is reduce-scattered over the replicas.
    p, batch, opt = _params_for(four_stages_tied), _batch(), optax.adam(1e-2)
    pipelined = _replicas(2, zero, "1f1b", stages=4, m=4)
    (got_p, got_state), _ = _run(pipelined, four_stages_tied, opt, p, batch)
    want_p, want_state, _ = _reference(four_stages_tied, opt, p, *batch)
    _assert_close(got_p, want_p)
    _assert_close(got_state, want_state)


def test_describe_of_a_loss_and_an_optimizer_counts_a_devices_share():
    # run_pipelined's step is the user step of its loss and optimizer: the same report, per device, as
    # tests/stages/test_user_step_zero.py checks leaf by leaf; here its shares fall with the ZeRO level.
    p, batch, opt = _params_for(two_stages), _batch(), optax.adam(1e-2)
    reports = {z: describe(_replicas(4, z).step_for(two_stages, opt), p, *batch, memory=True) for z in (0, 1, 3)}
    assert reports[0].row_bytes == 3 * 147 * 4 + 4  # stage 0: parameters, mu, nu (147 floats each), the count
    assert reports[3].row_bytes < reports[1].row_bytes < reports[0].row_bytes
    assert "ZeRO-3 over each stage's 4 replicas" in str(reports[3])
    arguments = {z: r.device_memory.arguments for z, r in reports.items()}
    assert arguments[3] < arguments[1] < arguments[0]


@pytest.mark.parametrize("replicas", [2, 4], ids=["D2", "D4"])
def test_a_leaf_not_divisible_by_the_replicas_is_padded(replicas):
    p, batch, opt = _params_for(two_stages), _batch(), optax.adam(1e-2)
    p["extra"] = np.linspace(-1, 1, 5).astype(np.float32)  # kept by both stages, 5 floats: chunks padded
    (got_p, got_state), _ = _run(_replicas(replicas, 3), two_stages, opt, p, batch)
    assert got_p["extra"].shape == (5,) and got_state[0].mu["extra"].shape == (5,)
    want_p, want_state, _ = _reference(two_stages, opt, p, *batch)
    _assert_close(got_p, want_p)
    _assert_close(got_state, want_state)


@pytest.mark.parametrize("zero", [-1, 4, True, 1.0, "1"])
def test_zero_out_of_range_is_refused(zero):
    grid = np.array(jax.devices()[:4]).reshape(1, 4)
    with pytest.raises(ValueError, match=r"zero must be 0, 1, 2 or 3, got .*1/D per device"):
        PipelinedReplicas(grid, 2, 2, "1f1b", zero=zero)
    with pytest.raises(ValueError, match=r"zero must be 0, 1, 2 or 3"):
        pipeline_train_step(two_stages, optax.adam(1e-2), num_microbatches=2, zero=zero)


def test_zero_stage_is_the_old_name_of_zero():
    """``zero=`` is the ZeRO keyword of the pipeline's entry points; ``zero_stage=``, its old name, warns
    ``DeprecationWarning`` (attributed to the caller) and does the same; both at once: a ``TypeError``."""
    grid = np.array(jax.devices()[:4]).reshape(1, 4)
    opt = optax.adam(1e-2)
    make = {
        "PipelinedReplicas": lambda **zero: PipelinedReplicas(grid, 2, 2, "1f1b", **zero),
        "pipeline_train_step": lambda **zero: pipeline_train_step(two_stages, opt, num_microbatches=2, **zero),
        "PipelineTrainStep": lambda **zero: PipelineTrainStep(
            two_stages, opt, num_microbatches=2, schedule="1f1b", devices=None, **zero
        ),
    }
    for name, made in make.items():
        with pytest.warns(
            DeprecationWarning, match=rf"{name}\(zero_stage=\.\.\.\) is now {name}\(zero=\.\.\.\)"
        ) as caught:
            old = made(zero_stage=3)
        assert caught[0].filename == __file__
        assert old.zero_stage == made(zero=3).zero_stage == 3
        with pytest.raises(TypeError, match=rf"{name}\(\): zero_stage= is the old name of zero=; give zero= only"):
            made(zero=1, zero_stage=1)
    with pytest.warns(DeprecationWarning):
        assert repr(make["PipelinedReplicas"](zero_stage=2)) == repr(make["PipelinedReplicas"](zero=2))

    # The same result: one step of each, on the same batch.
    p, batch = _params_for(two_stages), _batch()
    with pytest.warns(DeprecationWarning, match=r"PipelinedReplicas\(zero_stage="):
        old = _run(make["PipelinedReplicas"](zero_stage=1), two_stages, opt, p, batch)
    new = _run(make["PipelinedReplicas"](zero=1), two_stages, opt, p, batch)
    jax.tree.map(np.testing.assert_array_equal, old, new)

    # PipelinedStep (the user's own step, built by PipelinedReplicas.user_step) takes them the same way.
    pipelined, step = _replicas(2, 0), make_step(two_stages, opt)
    args = (step, (p, opt.init(p)), batch, pipelined.mesh, 2, "1f1b")
    with pytest.warns(DeprecationWarning, match=r"PipelinedStep\(zero_stage=\.\.\.\) is now PipelinedStep\(zero="):
        assert PipelinedStep(*args, zero_stage=1).zero_stage == 1
    with pytest.raises(TypeError, match=r"PipelinedStep\(\): zero_stage= is the old name of zero="):
        PipelinedStep(*args, zero=1, zero_stage=1)


def test_the_entry_points_taking_zero_stage_keep_their_names_signatures_and_docs():
    """The wrapper that takes ``zero_stage=`` is invisible to ``help()`` and ``inspect``: each entry point keeps
    its name, its docstring and its signature (with ``zero=``, not ``**kwargs``)."""
    for entry in (PipelinedReplicas.__init__, PipelineTrainStep.__init__, PipelinedStep.__init__, pipeline_train_step):
        assert entry.__name__ in ("__init__", "pipeline_train_step")
        assert "zero" in inspect.signature(entry).parameters, entry.__qualname__
        assert "kwargs" not in inspect.signature(entry).parameters, entry.__qualname__
    assert pipeline_train_step.__doc__ and "zero_stage=" in pipeline_train_step.__doc__


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
    pipelined = PipelinedReplicas(grid, 2, 2, "1f1b", zero=1, fold_axes=(("cores_fold", 2),))
    with pytest.raises(ValueError, match=r"zero=1 with replicas_per_device > 1: .*rp.all_sum.*run_pipelined"):
        pipelined.run_step(step, batch, (p, opt.init(p)))
