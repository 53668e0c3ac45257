"""A pipeline with several data-parallel replicas per device (``Parallelism(replicas_per_device=k,
stages=S)``): ``S`` stages x ``D = W * C / S`` logical replicas on ``S x D / k`` devices, each device
running ``k`` consecutive replicas vmapped. Against independent references: one device's ``jax.jit`` of the same
loss or step on the global batch, and the logical replicas simulated with ``jax.vmap`` over named axes (a
user's collective, per-replica outputs)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from tests.stages.test_gpipe import four_stages_tied, two_stages
from tests.stages.test_replicas import _bn_setup, _params_for, _rp_mean, bn_loss, global_batch, simulated_bn_steps
from tests.stages.test_train import STEPS, _assert_close, _reference
from tests.stages.test_user_step import _one_device, make_step

TOL = 2e-5

CASES = [
    # (num_workers, cores_per_worker, k, S, M, loss): D = W * C / S logical replicas, D / k devices per stage
    pytest.param(1, 8, 2, 2, 4, two_stages, id="S2xD4-k2-M4"),
    pytest.param(1, 8, 2, 4, 4, four_stages_tied, id="S4xD2-k2-M4-tied"),
    pytest.param(2, 4, 2, 2, 2, two_stages, id="S2xD4-k2-square-M2"),
    pytest.param(4, 2, 4, 2, 2, two_stages, id="S2xD4-k4-workers-fold-M2"),
]


def _replicator(workers, cores, k, stages, m, schedule=None, **options):
    devices = jax.devices()[: workers * cores // k]
    return rp.Replicator(
        workers,
        cores,
        devices=devices,
        parallelism=rp.Parallelism(replicas_per_device=k, stages=stages, microbatches=m, schedule=schedule),
        **options,
    )


def _skewed_batch():
    """The global batch with its halves pulled apart: a replica that reads another's rows changes the step."""
    ids, y = global_batch()
    y[: len(y) // 2] += 2.0
    return ids, y


@pytest.mark.parametrize(
    "workers, cores, k, stages, mesh, device_ids",
    [
        (1, 8, 2, 2, {"stages": 2, "workers": 1, "cores": 2}, [2, 3]),
        (1, 8, 2, 4, {"stages": 4, "workers": 1, "cores": 1}, [1]),
        (2, 4, 2, 2, {"stages": 2, "workers": 2, "cores": 1}, [1, 3]),
        (4, 2, 4, 2, {"stages": 2, "workers": 1, "cores": 1}, [1]),
    ],
)
def test_stages_cut_the_device_grid(workers, cores, k, stages, mesh, device_ids):
    repl = _replicator(workers, cores, k, stages, stages)
    assert dict(repl.pipelined.mesh.shape) == mesh
    assert [d.id for d in repl.pipelined.mesh.devices[1].flat] == device_ids  # stage 1's devices
    assert repl.pipelined.replicas == workers * cores // stages  # D logical replicas
    assert repl.pipelined.replicas_per_device == k


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("workers, cores, k, stages, m, loss", CASES)
def test_run_pipelined_with_folded_replicas_matches_one_device(workers, cores, k, stages, m, loss, schedule):
    p, (ids, y) = _params_for(loss), _skewed_batch()
    opt = optax.adam(1e-2)
    repl = _replicator(workers, cores, k, stages, m, schedule=schedule)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # M >= S: no bubble warning
        _assert_run_pipelined_like_one_device(repl, loss, opt, p, (ids, y))


def _assert_run_pipelined_like_one_device(repl, loss, opt, p, batch):
    """``STEPS`` steps of ``run_pipelined``: parameters, Adam's state and losses equal one device's."""
    state, values = (p, opt.init(p)), []
    for _ in range(STEPS):
        state, value = repl.run_pipelined(loss, opt, batch, state)
        values.append(value)
    want_p, want_state, want_values = _reference(loss, opt, p, *batch)
    _assert_close(state[0], want_p, tol=TOL)
    _assert_close(state[1], want_state, tol=TOL)
    np.testing.assert_allclose(values, want_values, rtol=TOL)


def _per_replica_loss(loss, p, batch, replicas, m):
    """Each logical replica's loss on its contiguous share, averaged over its ``m`` micro-batches (vmap)."""
    p = jax.tree.map(jnp.asarray, p)
    shares = [jnp.reshape(x, (replicas, m, -1, *x.shape[1:])) for x in batch]
    return jax.vmap(lambda *share: jnp.mean(jax.vmap(lambda *mb: loss(p, *mb))(*share)))(*shares)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("workers, cores, k, stages, m, loss", CASES)
def test_run_of_the_users_step_with_folded_replicas_matches_one_device(workers, cores, k, stages, m, loss, schedule):
    p, batch = _params_for(loss), _skewed_batch()
    opt = optax.adam(1e-2)
    data_parallel = make_step(loss, opt)

    def step(state, batch):  # also each replica's own loss, not averaged
        new_state, out = data_parallel(state, batch)
        return new_state, {**out, "own": jax.value_and_grad(loss)(state[0], *batch)[0]}

    repl = _replicator(workers, cores, k, stages, m, schedule=schedule)
    replicas = workers * cores // stages
    state, values = (p, opt.init(p)), []
    for i in range(STEPS):
        state, out = repl.run(step, batch, state)
        assert out["loss"].shape == out["own"].shape == (replicas,)  # a row per logical replica
        if i == 0:
            want_own = _per_replica_loss(loss, p, batch, replicas, m)
            np.testing.assert_allclose(out["own"], want_own, rtol=TOL)
        values.append(out["loss"][0])
    want_state, want_values = _one_device(make_step(loss, opt, mean=False), (p, opt.init(p)), batch)
    _assert_close(state, want_state, tol=TOL)
    np.testing.assert_allclose(values, want_values, rtol=TOL)
    # The state's update once per device, on the loop's outputs averaged over its k replicas.
    assert repl.pipelined.user_step(step, batch, state).update_once


def test_an_update_with_a_sum_over_replicas_runs_per_replica():
    # rp.all_sum(1) / rp.num_replicas() is 1 on every logical replica; run once per device it would count
    # devices, not replicas: such an update runs vmapped over a device's replicas instead.
    p, batch = _params_for(two_stages), _skewed_batch()
    opt = optax.adam(1e-2)
    data_parallel = make_step(two_stages, opt)

    def step(state, batch):
        new_state, out = data_parallel(state, batch)
        count = rp.all_sum(jnp.ones((), jnp.float32)) / rp.num_replicas()
        return jax.tree.map(lambda x: x * count.astype(x.dtype), new_state), out

    repl = _replicator(1, 8, 2, 2, 2)
    state = (p, opt.init(p))
    for _ in range(STEPS):
        state, _ = repl.run(step, batch, state)
    assert not repl.pipelined.user_step(step, batch, state).update_once
    want_state, _ = _one_device(make_step(two_stages, opt, mean=False), (p, opt.init(p)), batch)
    _assert_close(state, want_state, tol=TOL)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_of_the_users_step_with_folded_replicas_matches_one_device(zero_stage):
    # 2 stages x 4 logical replicas, 2 per device: each leaf's chunks split over a stage's 2 devices, the
    # update once per device on the loop's outputs averaged over its 2 replicas.
    p, batch = _params_for(two_stages), _skewed_batch()
    opt = optax.adam(1e-2)
    repl = _replicator(1, 8, 2, 2, 4, passes=rp.PassManager.default(zero=zero_stage))
    step, state, values = make_step(two_stages, opt), (p, opt.init(p)), []
    for _ in range(STEPS):
        state, out = repl.run(step, batch, state)
        assert out["loss"].shape == (4,)
        values.append(out["loss"][0])
    want_state, want_values = _one_device(make_step(two_stages, opt, mean=False), (p, opt.init(p)), batch)
    _assert_close(state, want_state, tol=TOL)
    np.testing.assert_allclose(values, want_values, rtol=TOL)


@pytest.mark.parametrize(
    "workers, cores, k, logical",
    [
        pytest.param(1, 8, 2, (1, 4), id="k2-cores-fold"),
        pytest.param(2, 4, 2, (2, 2), id="k2-square"),
        pytest.param(4, 2, 4, (2, 2), id="k4-workers-fold"),
    ],
)
def test_user_collectives_span_every_logical_replica(workers, cores, k, logical):
    # Batch norm with its statistics over all D logical replicas (group=None) and over each logical worker's
    # (group='cores'), 2 stages, M = 2. Reference: the D replicas simulated on one device with nested vmap
    # over ('workers', 'cores') of the logical grid, lax.pmean over the named axes.
    stages, m = 2, 2
    p, x, y = _bn_setup(32)
    opt = optax.sgd(0.1)
    repl = _replicator(workers, cores, k, stages, m)
    state, values = (p, opt.init(p)), []
    for _ in range(2):
        state, value = repl.run_pipelined(bn_loss(_rp_mean), opt, (x, y), state)
        values.append(value)

    want, want_values = simulated_bn_steps(p, x, y, logical, m, opt, steps=2)
    _assert_close(state[0], want, tol=TOL)
    np.testing.assert_allclose(values, want_values, rtol=TOL)


@pytest.mark.parametrize(
    "workers, cores, k, logical",
    [pytest.param(1, 8, 2, (1, 4), id="k2-cores-fold"), pytest.param(4, 2, 4, (2, 2), id="k4-workers-fold")],
)
def test_replica_id_and_num_replicas_count_logical_replicas(workers, cores, k, logical):
    p, batch = _params_for(two_stages), global_batch()
    opt = optax.sgd(0.1)
    data_parallel = make_step(two_stages, opt)

    def step(state, batch):
        new_state, out = data_parallel(state, batch)
        ids = {g: rp.replica_id(group=g).astype(jnp.float32) for g in (None, "workers", "cores")}
        counts = jnp.array([rp.num_replicas(group=g) for g in (None, "workers", "cores")], jnp.float32)
        return new_state, {"all": ids[None], "worker": ids["workers"], "core": ids["cores"], "counts": counts}

    repl = _replicator(workers, cores, k, 2, 2)
    _, out = repl.run(step, batch, (p, opt.init(p)))
    r = np.arange(logical[0] * logical[1])
    np.testing.assert_array_equal(out["all"], r)
    np.testing.assert_array_equal(out["worker"], r // logical[1])
    np.testing.assert_array_equal(out["core"], r % logical[1])
    # Traced in the logical replicas' context: rp.num_replicas counts them, per group.
    np.testing.assert_array_equal(out["counts"][0], [len(r), logical[0], logical[1]])


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_splits_rows_over_a_stages_devices(zero_stage):
    # 2 stages x 4 logical replicas, 2 devices per stage: each row in 2 chunks, one per device.
    p, (ids, y) = _params_for(two_stages), _skewed_batch()
    opt = optax.adam(1e-2)
    repl = _replicator(1, 8, 2, 2, 4, passes=rp.PassManager.default(zero=zero_stage))
    _assert_run_pipelined_like_one_device(repl, two_stages, opt, p, (ids, y))
    report = repl.describe_pipeline(two_stages, opt, (ids, y), (p, opt.init(p)))
    assert f"ZeRO-{zero_stage} over each stage's 2 devices" in str(report)


def test_describe_counts_logical_replicas_and_devices():
    p, (ids, y) = _params_for(two_stages), global_batch()
    opt = optax.adam(1e-2)
    repl = _replicator(1, 8, 2, 2, 4)
    report = repl.describe_pipeline(two_stages, opt, (ids, y), (p, opt.init(p)))
    assert (report.replicas, report.replicas_per_device) == (4, 2)
    assert "2 stages x 4 data-parallel replicas (2 per device) on 4 devices" in str(report)
    explained = repl.explain(make_step(two_stages, opt), (ids, y), (p, opt.init(p)))
    assert (explained.replicas, explained.replicas_per_device) == (4, 2)
    assert "(2 per device) on 4 devices" in str(explained)
    assert "replicas_per_device=2" in repr(repl.pipelined)


def test_stages_that_do_not_cut_the_device_grid_are_refused():
    # 8 replicas, 4 per device: 2 devices, which do not form 4 stages.
    with pytest.raises(
        ValueError, match=r"Parallelism\(stages=4\) does not cut the 1 x 2 device grid.*replicas_per_device=4"
    ):
        rp.Replicator(1, 8, devices=jax.devices()[:2], parallelism=rp.Parallelism(replicas_per_device=4, stages=4))


@pytest.mark.parametrize(
    "fold_axes, error",
    [
        ((("tensor_fold", 2),), r"fold_axes must name \['workers_fold', 'cores_fold'\].*got \['tensor_fold'\]"),
        ((("cores_fold", 2), ("workers_fold", 2)), r"in that order.*got \['cores_fold', 'workers_fold'\]"),
        ((("cores_fold", 2), ("cores_fold", 2)), r"each at most once\), got \['cores_fold', 'cores_fold'\]"),
        ((("workers_fold", 2), ("cores_fold", 1)), r"sizes must be above 1 \(leave a size-1 fold out\)"),
    ],
    ids=["an unknown name", "out of order", "named twice", "a size of 1"],
)
def test_fold_axes_are_checked_each_fault_alone(fold_axes, error):
    """Each fault of ``fold_axes`` is refused when it is the only one (a check that needs them all would pass
    each), with what was wrong; good folds come back as ``(str, int)`` pairs, and any fold needs a mesh."""
    from replicator.stages.data_replicas import check_fold_axes

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("stages", "cores"))
    with pytest.raises(ValueError, match=error):
        check_fold_axes(fold_axes, mesh)
    assert check_fold_axes([["workers_fold", np.int64(2)], ("cores_fold", 4)], mesh) == (
        ("workers_fold", 2),
        ("cores_fold", 4),
    )
    assert check_fold_axes((), None) == ()
    with pytest.raises(ValueError, match=r"fold_axes \(several replicas per device\) needs mesh="):
        check_fold_axes((("cores_fold", 2),), None)
