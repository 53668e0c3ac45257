"""Data-parallel replicas of a pipeline (S stages x D replicas on S * D devices) against one device:
``jax.jit`` of ``jax.value_and_grad`` + ``optax.adam`` on the global batch, 3 steps, through the ``Replicator``
option. And the mesh layout, where each stage's state lives, the trace-time errors and the description."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import replicator as rp
from replicator.stages import StageSplitError
from replicator.stages.replicas import pipeline_mesh
from tests.stages.test_gpipe import VOCAB, four_stages_tied, params, three_stages, two_stages
from tests.stages.test_train import STEPS, _assert_close, _assert_like_one_device

ROWS = 32


def global_batch(rows: int = ROWS):
    rng = np.random.default_rng(2)
    return rng.integers(0, VOCAB, size=(rows,)), rng.normal(size=(rows, VOCAB)).astype(np.float32)


def _params_for(loss):
    p = params()
    if loss is four_stages_tied:
        del p["head"]
    return p


CASES = [
    # (num_workers, cores_per_worker, S, M, loss): D = W * C / S
    pytest.param(1, 4, 2, 2, two_stages, id="S2xD2-M2"),
    pytest.param(2, 4, 2, 4, two_stages, id="S2xD4-M4"),
    pytest.param(1, 8, 4, 4, four_stages_tied, id="S4xD2-M4-tied"),
    pytest.param(4, 2, 4, 2, four_stages_tied, id="S4xD2-across-workers-M2"),
    pytest.param(2, 3, 3, 4, three_stages, id="S3xD2-M4"),
]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "1f1b-fused"])
@pytest.mark.parametrize("workers, cores, stages, m, loss", CASES)
def test_replicated_pipeline_matches_one_device(workers, cores, stages, m, loss, schedule):
    p, (ids, y) = _params_for(loss), global_batch()
    opt = optax.adam(1e-2)
    devices = jax.devices()[: workers * cores]
    repl = rp.Replicator(
        workers, cores, devices=devices, parallelism=rp.Parallelism(stages=stages, microbatches=m, schedule=schedule)
    )
    assert repl.pipelined.replicas == workers * cores // stages
    state, values = (p, opt.init(p)), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if m < stages else "error")  # M >= S: no bubble warning
        for _ in range(STEPS):
            state, value = repl.run_pipelined(loss, opt, (ids, y), state)
            values.append(value)
    _assert_like_one_device(*state, loss, opt, p, ids, y, values=values)


def test_each_replica_runs_its_own_rows():
    # The halves of the batch pull apart: the step equals one device only if each replica takes its own
    # rows and the replicas' gradients are averaged (not summed, not one replica's).
    p, (ids, y) = _params_for(two_stages), global_batch()
    y[ROWS // 2 :] += 3.0
    opt = optax.sgd(0.1)
    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))
    (got, _), value = repl.run_pipelined(two_stages, opt, (ids, y), (p, opt.init(p)))
    want_value, grads = jax.jit(jax.value_and_grad(two_stages))(p, ids, y)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    _assert_close(got, optax.apply_updates(p, opt.update(grads, opt.init(p), p)[0]))


def test_stage_state_lives_on_its_replicas_only():
    p, (ids, y) = _params_for(four_stages_tied), global_batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=4))
    train = repl.pipelined.step_for(four_stages_tied, opt)
    train.built(p, ids, y)
    packed = train.pack(p, opt.init(p))
    # The row (a stage's leaves and their moments); `extra` (kept by every stage), its moments and Adam's count
    # in slots.
    assert list(packed) == ["float32", "slot0", "slot1", "slot2", "slot3"]
    mesh = repl.pipelined.mesh
    assert dict(mesh.shape) == {"stages": 4, "workers": 1, "cores": 2}
    for buffer in packed.values():
        shards = {s.device: np.asarray(s.data) for s in buffer.addressable_shards}
        for stage in range(4):
            devices = list(mesh.devices[stage].flat)
            assert all(shards[d].shape == (1, buffer.shape[1]) for d in devices)
            # The D replicas of a stage hold the same row: stage `stage`'s, and only it.
            np.testing.assert_array_equal(shards[devices[0]], shards[devices[1]])
            np.testing.assert_array_equal(shards[devices[0]][0], np.asarray(buffer[stage]))


def test_pipeline_mesh_layout():
    devices = np.array(jax.devices()[:8])
    within = pipeline_mesh(devices.reshape(2, 4), 2)  # S divides the cores: stages inside each worker
    assert dict(within.shape) == {"stages": 2, "workers": 2, "cores": 2}
    assert [d.id for d in within.devices[0].flat] == [0, 1, 4, 5]
    across = pipeline_mesh(devices.reshape(4, 2), 4)  # S divides the workers only: a stage per worker
    assert dict(across.shape) == {"stages": 4, "workers": 1, "cores": 2}
    assert [d.id for d in across.devices[1].flat] == [2, 3]
    with pytest.raises(
        ValueError, match=r"Parallelism\(stages=3\) divides neither cores_per_worker=4 .* num_workers=2"
    ):
        pipeline_mesh(devices.reshape(2, 4), 3)


def test_batch_not_divisible_names_the_numbers():
    p, (ids, y) = _params_for(two_stages), global_batch(rows=28)
    opt = optax.sgd(0.1)
    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=4))
    with pytest.raises(
        ValueError, match=r"\(28 rows\) does not split into num_microbatches=4 x 2 data-parallel replicas = 8 .*of 8"
    ):
        repl.run_pipelined(two_stages, opt, (ids, y), (p, opt.init(p)))


def test_fewer_microbatches_than_stages_warns():
    p, (ids, y) = _params_for(four_stages_tied), global_batch()
    opt = optax.sgd(0.1)
    repl = rp.Replicator(1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=2))
    with pytest.warns(UserWarning, match=r"microbatches=2 < 4 stages: most of the step is bubble .*0\.60") as got:
        repl.describe_pipeline(four_stages_tied, opt, (ids, y), (p, opt.init(p)))
    assert got[0].filename == __file__  # the user's line, not replicator's


def test_one_stage_is_gradient_accumulation_over_replicas():
    # No marker, Parallelism(stages=1): M micro-batches accumulated on each of the D = 4 replicas.
    p, (ids, y) = _params_for(two_stages), global_batch()
    opt = optax.sgd(0.1)

    def unmarked(p, ids, y):
        return jnp.mean((jnp.tanh(p["emb"][ids] @ p["w1"]) @ p["head"] - y) ** 2)

    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=1, microbatches=4))
    (got, _), value = repl.run_pipelined(unmarked, opt, (ids, y), (p, opt.init(p)))
    want_value, grads = jax.jit(jax.value_and_grad(unmarked))(p, ids, y)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    _assert_close(got, optax.apply_updates(p, opt.update(grads, opt.init(p), p)[0]), tol=1e-5)


def test_stage_count_must_match_the_markers():
    p, (ids, y) = _params_for(two_stages), global_batch()
    opt = optax.sgd(0.1)
    repl = rp.Replicator(1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=4))
    with pytest.raises(StageSplitError, match=r"the step has 2 stages .* but the pipeline has 4"):
        repl.run_pipelined(two_stages, opt, (ids, y), (p, opt.init(p)))


def test_run_of_a_pipelined_replicator_says_what_to_call():
    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2))
    with pytest.raises(ValueError, match="call run_pipelined"):
        repl.run(lambda batch: batch.sum(), np.ones((4, 2), np.float32))


def test_describe_pipeline():
    p, (ids, y) = _params_for(four_stages_tied), global_batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(
        1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=8, schedule="1f1b")
    )
    report = repl.describe_pipeline(four_stages_tied, opt, (ids, y), (p, opt.init(p)))
    assert (report.stages, report.microbatches, report.replicas, report.ticks) == (4, 8, 2, 22)
    assert abs(report.bubble - 3 / 11) < 1e-12
    assert [r.peak_live for r in report.per_stage] == [4, 3, 2, 1] and report.stash_slots == 4
    # Parameters: the embedding (10 x 8) on stages 0 and 3, w1 (8 x 8) on 1 and 2; `extra` (3) everywhere; each
    # with Adam's two moments; Adam's int32 count everywhere.
    assert [r.parameter_bytes for r in report.per_stage] == [3 * 4 * 83 + 4, 3 * 4 * 67 + 4, 3 * 4 * 67 + 4, 1000]
    assert report.row_bytes == 3 * 4 * 83 + 4 and report.optimizer_bytes is None  # the row holds the whole state
    # Compute: stage 0 is a gather; stages 1-2 matrix products of (2, 8) x (8, 8); stage 3 the head's.
    compute = [r.compute_s for r in report.per_stage]
    assert all(c > 0 for c in compute) and compute[0] < min(compute[1:])
    text = str(report)
    assert "4 stages x 2 data-parallel replicas on 8 devices, 8 micro-batches, schedule 1f1b" in text
    assert "22 ticks, bubble 0.273 (= (S-1)/(M+S-1) = 3/11)" in text
    gpipe = rp.Replicator(
        1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=8, schedule="gpipe")
    )
    report = gpipe.describe_pipeline(four_stages_tied, opt, (ids, y), (p, opt.init(p)))
    assert [r.peak_live for r in report.per_stage] == [8] * 4 and report.stash_slots == 8


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-fused"])
def test_describe_pipeline_times_the_step_from_the_table(schedule):
    # The cost model's step: each tick as long as its slowest stage's work there, from the stages' forward and
    # backward costs (set here, uneven: the last stage four times the others), against a loop over the table.
    p, (ids, y) = _params_for(four_stages_tied), global_batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(
        1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=8, schedule=schedule)
    )
    report = repl.describe_pipeline(four_stages_tied, opt, (ids, y), (p, opt.init(p)))
    costs = [(1.0, 2.0), (1.0, 2.0), (1.0, 2.0), (4.0, 8.0)]
    report = dataclasses.replace(
        report,
        per_stage=[
            dataclasses.replace(r, forward_s=f, backward_s=b) for r, (f, b) in zip(report.per_stage, costs, strict=True)
        ],
    )
    table = report.schedule
    want = 0.0
    for t in range(table.num_ticks):
        want += max(
            costs[s][0] * (table.forward_micro[t, s] >= 0) + costs[s][1] * (table.backward_micro[t, s] >= 0)
            for s in range(4)
        )
    assert report.span_s() == want
    if schedule != "1f1b":  # the slowest stage never waits for another: its 8 micro-batches, plus fill and drain
        assert want == 8 * 12 + 3 * 1 + 3 * 2
    assert f"the step about {want * 1e3:.3f} ms ({table.num_ticks} ticks" in str(report)


def bn_loss(all_mean):
    """Batch norm in stage 1, its statistics over the data-parallel replicas (``all_mean``), a per-worker mean
    (``group='cores'``) in stage 0."""

    def loss(p, x, y):
        h = jnp.tanh(x @ p["a"])
        h = h - all_mean(jnp.mean(h, 0), "cores")
        h = rp.stage_boundary(h)
        mu = all_mean(jnp.mean(h, 0), None)
        var = all_mean(jnp.mean((h - mu) ** 2, 0), None)
        h = (h - mu) / jnp.sqrt(var + 1e-3) * p["scale"]
        return jnp.mean((h @ p["b"] - y) ** 2)

    return loss


def _rp_mean(x, group):
    return rp.all_mean(x, group=group)


def _vmap_mean(x, group):
    return lax.pmean(x, ("workers", "cores") if group is None else group)


def _bn_setup(rows):
    rng = np.random.default_rng(3)
    p = {
        "a": rng.normal(size=(3, 5)).astype(np.float32),
        "scale": np.ones((5,), np.float32),
        "b": rng.normal(size=(5, 2)).astype(np.float32),
    }
    return p, rng.normal(size=(rows, 3)).astype(np.float32), rng.normal(size=(rows, 2)).astype(np.float32)


def simulated_bn_steps(p, x, y, grid, m, opt, steps):
    """``steps`` steps of :func:`bn_loss` with ``opt``, the replicas of the ``(workers, cores)`` ``grid`` simulated
    at once on one device (nested ``vmap``, ``lax.pmean`` over the named axes), replica ``r`` on the ``r``-th
    block of rows, each cut into ``m`` micro-batches whose values and gradients are averaged. Returns the
    parameters and each step's loss."""
    lw, lc = grid
    per_replica = jax.value_and_grad(bn_loss(_vmap_mean))
    simulate = jax.vmap(jax.vmap(per_replica, (None, 0, 0), axis_name="cores"), (None, 0, 0), axis_name="workers")

    @jax.jit
    def reference_step(p):
        xs = x.reshape(lw, lc, m, -1, x.shape[-1])  # (workers, cores, micro-batch, rows, features)
        ys = y.reshape(lw, lc, m, -1, y.shape[-1])
        value, grads = 0.0, jax.tree.map(jnp.zeros_like, p)
        for k in range(m):
            v, g = simulate(p, xs[:, :, k], ys[:, :, k])
            value += v.mean() / m
            grads = jax.tree.map(lambda a, b: a + b.mean((0, 1)) / m, grads, g)
        return optax.apply_updates(p, opt.update(grads, opt.init(p), p)[0]), value

    want, values = p, []
    for _ in range(steps):
        want, value = reference_step(want)
        values.append(value)
    return want, values


def test_collectives_in_the_loss_run_across_the_data_parallel_replicas():
    # 2 stages x (2 workers x 2 cores) replicas, M = 2: every replica's micro-batch m normalised with the
    # statistics of micro-batch m over all replicas (group=None) and over its worker's (group='cores').
    # Reference: all replicas simulated with nested vmap on one device, lax.pmean over named axes.
    workers, cores, stages, m = 2, 4, 2, 2
    p, x, y = _bn_setup(32)
    opt = optax.sgd(0.1)
    repl = rp.Replicator(
        workers, cores, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=stages, microbatches=m)
    )
    assert dict(repl.pipelined.mesh.shape) == {"stages": 2, "workers": 2, "cores": 2}
    state, values = (p, opt.init(p)), []
    for _ in range(2):
        state, value = repl.run_pipelined(bn_loss(_rp_mean), opt, (x, y), state)
        values.append(value)

    want, want_values = simulated_bn_steps(p, x, y, (2, 2), m, opt, steps=2)
    _assert_close(state[0], want, tol=1e-5)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


def test_collectives_mean_what_they_mean_in_a_data_parallel_step():
    # M = 1: the pipeline's replicas are the data-parallel replicas of Replicator.run on the same rows.
    p, x, y = _bn_setup(16)
    opt = optax.sgd(0.1)
    piped = rp.Replicator(1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=2, microbatches=1))
    with pytest.warns(UserWarning, match="most of the step is bubble"):
        (got, _), value = piped.run_pipelined(bn_loss(_rp_mean), opt, (x, y), (p, opt.init(p)))

    def step(p, batch):
        value, grads = jax.value_and_grad(bn_loss(_rp_mean))(p, batch["x"], batch["y"])
        grads = rp.all_mean(grads)
        return optax.apply_updates(p, opt.update(grads, opt.init(p), p)[0]), rp.all_mean(value)

    plain = rp.Replicator(1, 4, devices=jax.devices()[:4])  # 4 replicas: cores groups of 4, not 2
    want, want_value = plain.run(step, {"x": x, "y": y}, p)
    # group='cores' spans the 4 replicas of the one worker in both.
    assert dict(piped.pipelined.mesh.shape) == {"stages": 2, "workers": 1, "cores": 4}
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    _assert_close(got, want, tol=1e-5)


def test_unsupported_collective_in_the_loss_names_the_line():
    def loss(p, x):
        h = rp.stage_boundary(jnp.tanh(x @ p["a"]))
        h = rp.all_gather(h, tiled=True)  # the line named
        return jnp.mean(h @ p["b"])

    p = {"a": np.ones((3, 4), np.float32), "b": np.ones((4, 2), np.float32)}
    opt = optax.sgd(0.1)
    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))
    line = loss.__code__.co_firstlineno + 2
    with pytest.raises(StageSplitError, match=rf"rp.all_gather at .*test_replicas.py:{line}.*not supported"):
        repl.run_pipelined(loss, opt, np.ones((8, 3), np.float32), (p, opt.init(p)))


def test_describe_pipeline_measures_the_compiled_steps_memory():
    p, (ids, y) = _params_for(four_stages_tied), global_batch()
    opt = optax.adam(1e-2)
    memory = {}
    for schedule in ("1f1b", "gpipe"):
        repl = rp.Replicator(
            1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=8, schedule=schedule)
        )
        report = repl.describe_pipeline(four_stages_tied, opt, (ids, y), (p, opt.init(p)), memory=True)
        memory[schedule] = mem = report.device_memory
        # Arguments per device: the packed parameter row, Adam's two rows and count, this replica's batch share.
        rows = 3 * 4 * 83 + 4
        assert rows <= mem.arguments <= rows + ids.nbytes // 2 + y.nbytes // 2 + 64
        assert mem.total == mem.peak == mem.arguments + mem.outputs + mem.temporaries - mem.aliased
        assert "compiled, per device (XLA's memory analysis)" in str(report)
    assert memory["gpipe"].temporaries > memory["1f1b"].temporaries  # 8 residual slots against 4
    assert repl.describe_pipeline(four_stages_tied, opt, (ids, y), (p, opt.init(p))).device_memory is None


def test_only_shared_outputs_cross_stages():
    """Gradients of leaves one stage keeps accumulate on that stage: the only psum over 'stages' after the tick
    loop is of the loss and the gradients two stages share, not of the whole model's gradient. Here only the
    loss: `extra`, which every stage keeps and the loss does not read, has a zero gradient each stage's update
    computes itself."""
    from replicator.core.jaxprs import iter_eqns

    p, (ids, y) = _params_for(two_stages), global_batch()
    opt = optax.adam(1e-2)
    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))
    step = repl.pipelined.step_for(two_stages, opt)
    built = step.built(p, ids, y)
    assert len(built.outputs_layout.shared) == 1  # of the step's cut values: the loss (`extra`'s gradient is 0)
    jaxpr = jax.make_jaxpr(built.step)(step.pack(p, opt.init(p)), built.micro_leaves((ids, y)))
    crossing = [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive.name == "psum" and "stages" in e.params["axes"]]
    sizes = sorted(int(np.prod(v.aval.shape)) for e in crossing for v in e.invars)
    assert sizes == [1], sizes  # the loss; was every gradient (emb, w1, head, extra), then the loss and `extra`


def test_run_counts_each_pipelined_compilation_in_trace_count():
    p, (ids, y), opt = _params_for(two_stages), global_batch(), optax.sgd(0.1)
    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))

    def step(state, batch):
        value, grads = jax.value_and_grad(two_stages)(state[0], *batch)
        updates, opt_state = opt.update(rp.all_mean(grads), state[1], state[0])
        return (optax.apply_updates(state[0], updates), opt_state), rp.all_mean(value)

    state = (p, opt.init(p))
    for _ in range(2):  # the same shapes: compiled once
        state, _ = repl.run(step, (ids, y), state)
    assert repl.trace_count == 1 and repl.pipelined.user_steps_built == 1
    repl.run(step, (ids[:8], y[:8]), state)  # another batch shape: once more
    assert repl.trace_count == 2 and repl.pipelined.user_steps_built == 2
