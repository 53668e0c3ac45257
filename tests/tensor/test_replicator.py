"""The tensor axis inside a Replicator: data x tensor (and ZeRO over each device's tensor block).

Each test runs the user's per-replica step (its gradients averaged with ``rp.all_mean``) on a mesh
``('workers', 'cores', 'tensor')`` and compares the whole new state (parameters and Adam's moments)
and the loss with ``jax.jit`` of the same update on one device on the global batch, within 1e-5
relative to each leaf's largest value. Mesh shapes: (workers, cores, tensor) = (2, 4, 2), (1, 4, 2),
(2, 2, 2) (square) and (1, 8, 4).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.tensor import Shard, TensorPlacementError
from replicator.tensor.split_graph import split_step_graph

PLAN = {"*/fc1": "column", "*/b1": 0, "*/fc2": "row"}
TX = optax.adam(1e-2)


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["fc0"]) @ p["fc1"] + p["b1"]  # fc0 replicated: its input gradient is summed
    return jnp.mean((jnp.tanh(h) @ p["fc2"] - b["y"]) ** 2)


def _step(state, b):
    p, o = state
    loss, g = jax.value_and_grad(_loss)(p, b)
    u, o = TX.update(rp.all_mean(g), o, p)
    return (optax.apply_updates(p, u), o), rp.all_mean(loss)


def _one_device(state, b):
    p, o = state
    loss, g = jax.value_and_grad(_loss)(p, b)
    u, o = TX.update(g, o, p)
    return (optax.apply_updates(p, u), o), loss


def _state(seed=0, h=16):
    k = jax.random.split(jax.random.key(seed), 3)
    p = {
        "fc0": jax.random.normal(k[0], (6, 8)) / 3,
        "fc1": jax.random.normal(k[1], (8, h)) / 3,
        "b1": jnp.linspace(-0.5, 0.5, h),
        "fc2": jax.random.normal(k[2], (h, 3)) / 4,
    }
    return p, TX.init(p)


def _batches(rows, n=2, seed=1):
    k = jax.random.split(jax.random.key(seed), 2 * n)
    return [
        {"x": jax.random.normal(k[2 * i], (rows, 6)), "y": jax.random.normal(k[2 * i + 1], (rows, 3))} for i in range(n)
    ]


def _close(got, want, tol=1e-5):
    for path, a, b in zip(
        [p for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]],
        jax.tree.leaves(got),
        jax.tree.leaves(want),
        strict=True,
    ):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, jax.tree_util.keystr(path)
        scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
        assert float(np.max(np.abs(a - b))) <= tol * scale, jax.tree_util.keystr(path)


def _run(repl, batches, state):
    for b in batches:
        state, loss = repl.run(_step, b, state)
    return state, loss


def _reference(batches, state):
    for b in batches:
        state, loss = jax.jit(_one_device)(state, b)
    return state, loss


@pytest.mark.parametrize("workers,cores,tensor", [(2, 4, 2), (1, 4, 2), (2, 2, 2), (1, 8, 4)])
def test_data_by_tensor_equals_one_device_on_the_global_batch(workers, cores, tensor):
    repl = rp.Replicator(workers, cores, parallelism=rp.Parallelism(tensor=tensor, tensor_plan=PLAN))
    assert dict(repl.mesh.shape) == {"workers": workers, "cores": cores // tensor, "tensor": tensor}
    assert repl.num_replicas == workers * cores // tensor
    batches = _batches(2 * repl.num_replicas)
    got, loss = _run(repl, batches, _state())
    want, want_loss = _reference(batches, _state())
    _close(got, want)
    np.testing.assert_allclose(np.asarray(loss), float(want_loss), rtol=1e-5)
    assert np.shape(loss) == (repl.num_replicas,)
    # The planned leaves and their Adam moments are held 1/T per device; the others whole.
    params, (adam, _) = got
    for leaf, dim in ((params["fc1"], 1), (adam.mu["fc1"], 1), (adam.nu["fc2"], 0), (params["b1"], 0)):
        shard = leaf.addressable_shards[0].data
        assert shard.shape[dim] == leaf.shape[dim] // tensor
    assert params["fc0"].addressable_shards[0].data.shape == params["fc0"].shape


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_splits_each_devices_tensor_block_over_the_data_replicas(zero):
    passes = rp.PassManager.default(zero=zero, shard_optimizer_min_bytes=0)
    repl = rp.Replicator(2, 4, passes=passes, parallelism=rp.Parallelism(tensor=2, tensor_plan=PLAN))
    batches = _batches(2 * repl.num_replicas)
    got, _ = _run(repl, batches, _state())
    _close(got, _reference(batches, _state())[0])
    params, (adam, _) = got
    # Adam's moments of fc1 (8, 16): 1/T of the columns, then 1/D of those rows (D = 4 replicas).
    assert adam.mu["fc1"].addressable_shards[0].data.shape == (2, 8)
    whole = (8, 16) if zero < 3 else (2, 8)
    assert params["fc1"].addressable_shards[0].data.shape == (whole[0], 8) if zero < 3 else whole


def test_the_split_graph_is_one_devices_program_with_the_forwards_partial_sums_summed():
    repl = rp.Replicator(1, 4)
    batch = _batches(4, n=1)[0]
    graph = repl.lower(_step, batch, _state()).traced
    paths = graph.state_paths
    named = [Shard(1) if "fc1" in p else Shard(0) if ("fc2" in p or "b1" in p) else None for p in paths]
    named = [None if "mu" in p or "nu" in p else n for n, p in zip(named, paths, strict=True)]
    split = split_step_graph(graph, named, size=2)
    shapes = dict(zip(paths, (tuple(v.aval.shape) for v in split.jaxpr.jaxpr.invars), strict=False))
    fc1 = next(p for p in paths if p.endswith("['fc1']") and "mu" not in p and "nu" not in p)
    assert shapes[fc1] == (8, 8)
    # The moments follow their parameter (no plan entry needed).
    mu_fc1 = next(p for p in paths if "mu" in p and p.endswith("['fc1']"))
    assert split.tensor.state_dims[paths.index(mu_fc1)] == 1
    # Forward: the row-parallel fc2's partial sum, summed before the loss. Backward: the input
    # gradient of the column-parallel fc1 (a partial sum over its split columns), summed before fc0's.
    kinds = [c.kind for c in split.tensor.collectives]
    assert kinds == ["all-reduce", "all-reduce"]
    lowered = [e for e in split.jaxpr.jaxpr.eqns if e.primitive.name == "psum"]
    assert len(lowered) == 2 and all(e.params["axes"] == ("tensor",) for e in lowered)
    # The user's all_mean placeholders go through, on local shapes.
    placeholders = [e for e in split.jaxpr.jaxpr.eqns if e.primitive in rp.primitives.PLACEHOLDERS]
    assert placeholders and (8, 8) in [tuple(v.aval.shape) for e in placeholders for v in e.invars]


def test_a_gather_the_plan_needs_is_refused_naming_the_line_and_leaf():
    def step(state, b):
        h = b["x"] @ state["fc0"] @ state["fc1"]
        return state, jnp.sort(h, axis=-1)  # a sort over the split columns: no rule, the worst case

    state = {"fc0": jnp.ones((6, 8)), "fc1": jnp.ones((8, 16))}
    repl = rp.Replicator(1, 4, parallelism=rp.Parallelism(tensor=2, tensor_plan={"fc1": "column"}))
    with pytest.raises(TensorPlacementError) as e:
        repl.run(step, _batches(2)[0], state)
    text = str(e.value)
    assert "test_replicator.py" in text and "'sort'" in text and "fc1" in text and "allow_gather" in text
    allowed = rp.Replicator(
        1, 4, parallelism=rp.Parallelism(tensor=2, tensor_plan={"fc1": "column"}, allow_gather=True)
    )
    _, out = allowed.run(step, _batches(2)[0], state)  # one row per replica
    want = np.sort(np.asarray(_batches(2)[0]["x"]) @ np.ones((6, 8)) @ np.ones((8, 16)))
    np.testing.assert_allclose(np.asarray(out).reshape(want.shape), want, rtol=1e-5)


def test_a_plan_that_does_not_fit_the_state_is_refused_before_anything_runs():
    state = _state()
    batch = _batches(4)[0]
    no_leaf = rp.Replicator(1, 4, parallelism=rp.Parallelism(tensor=2, tensor_plan={"*/fc9": "column"}))
    with pytest.raises(TensorPlacementError, match=r"fc9.*match no leaf"):
        no_leaf.run(_step, batch, state)
    odd = rp.Replicator(1, 8, parallelism=rp.Parallelism(tensor=4, tensor_plan={"*/fc2": "column"}))
    with pytest.raises(TensorPlacementError, match="fc2"):  # 3 output columns over 4 devices
        odd.run(_step, batch, state)


def test_a_parallelism_value_is_checked_when_made():
    for bad in (dict(tensor=0), dict(tensor=2.0), dict(stages=0), dict(replicas_per_device=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            rp.Parallelism(**bad, **({"tensor_plan": PLAN} if bad.get("tensor", 1) != 1 else {}))
    with pytest.raises(ValueError, match="needs a tensor_plan"):
        rp.Parallelism(tensor=2)
    with pytest.raises(ValueError, match="without tensor=T"):
        rp.Parallelism(tensor_plan=PLAN)
    with pytest.raises(ValueError, match="schedule"):
        rp.Parallelism(stages=2, schedule="zigzag")
    with pytest.raises(ValueError, match="cores_per_worker=3"):
        rp.Replicator(1, 3, parallelism=rp.Parallelism(tensor=2, tensor_plan=PLAN))
    with pytest.raises(ValueError, match="does not combine with collective_matmul with stages=2"):
        rp.Replicator(1, 8, parallelism=rp.Parallelism(tensor=2, tensor_plan=PLAN, stages=2, collective_matmul=True))


def test_the_old_keywords_and_parallelism_are_one_setting():
    new = rp.Replicator(1, 8, parallelism=rp.Parallelism(stages=2, microbatches=4, schedule="gpipe"))
    said = r"write parallelism=rp\.Parallelism\(stages=2, microbatches=4, schedule='gpipe'\)"
    with pytest.warns(DeprecationWarning, match=said) as caught:  # the older keywords: deprecated, the same
        old = rp.Replicator(1, 8, pipeline_stages=2, microbatches=4, schedule="gpipe")
    assert caught[0].filename == __file__  # the user's line
    assert repr(new.pipelined) == repr(old.pipelined)
    folded = rp.Replicator(1, 8, parallelism=rp.Parallelism(replicas_per_device=2))
    assert folded.fold.replicas_per_device == 2 and folded.num_replicas == 8
    with pytest.raises(ValueError, match="pipeline_stages and parallelism= both"):
        rp.Replicator(1, 8, pipeline_stages=2, parallelism=rp.Parallelism(stages=2))
    with pytest.raises(TypeError, match="replicator.Parallelism"):
        rp.Replicator(1, 8, parallelism={"tensor": 2})


def test_a_checkpoint_saved_at_one_tensor_degree_trains_on_at_another_and_on_plain_data_parallelism(tmp_path):
    """Saved at T = 2 (split leaves written as their blocks), restored at T = 4 and at T = 1 with
    ZeRO-3: the next steps equal an uninterrupted run on one device."""
    batches = _batches(8, n=4)
    manager = rp.CheckpointManager(tmp_path)
    at2 = rp.Replicator(1, 8, parallelism=rp.Parallelism(tensor=2, tensor_plan=PLAN))
    state, _ = _run(at2, batches[:2], _state())
    manager.save(2, state)
    want, _ = _reference(batches, _state())
    for later in (
        rp.Replicator(1, 8, parallelism=rp.Parallelism(tensor=4, tensor_plan=PLAN)),
        rp.Replicator(2, 4, passes=rp.PassManager.default(zero=3, shard_optimizer_min_bytes=0)),
    ):
        step, restored, _ = manager.restore(_state())
        assert step == 2
        got, _ = _run(later, batches[2:], restored)
        _close(got, want)


def test_the_trainer_runs_a_tensor_parallel_replicator():
    batches = _batches(8, n=3)

    def input_fn(ctx):
        rows = 8 // ctx.num_workers
        return iter([{k: v[ctx.worker_id * rows : (ctx.worker_id + 1) * rows] for k, v in b.items()} for b in batches])

    repl = rp.Replicator(2, 4, parallelism=rp.Parallelism(tensor=2, tensor_plan=PLAN))
    trainer = rp.Trainer(repl, _step, input_fn, _state(), stream=open(os.devnull, "w"))  # noqa: SIM115
    got = trainer.run(3)
    _close(got, _reference(batches, _state())[0])


def test_explain_lists_the_collectives_over_the_tensor_axis_with_the_users_lines():
    repl = rp.Replicator(2, 4, parallelism=rp.Parallelism(tensor=2, tensor_plan=PLAN))
    report = repl.explain(_step, _batches(4)[0], _state())
    text = str(report)
    assert "over the tensor axis 'tensor' (T = 2)" in text
    rows = report.tensor.collectives
    # The row-parallel fc2's partial sum (2 rows x 3 outputs per replica), summed before the loss's
    # subtraction; fc1's input gradient (a partial sum over its split columns), summed before Adam.
    assert [(c.kind, c.shape) for c in rows] == [("all-reduce", (2, 3)), ("all-reduce", (6, 8))]
    assert all("test_replicator.py" in c.line for c in rows), [c.line for c in rows]
    # Each all-reduce sends 2 (T - 1) / T of its bytes: (24 + 192) B at T = 2.
    assert "216 B sent per device per step" in text
    # The data axes' collectives still name the user's lines after the split.
    assert "<unknown location>" not in text
    # Predicted time: each over the link inside a worker (alpha-beta, the preset's numbers, by hand).
    for preset in ("cpu-emulated", "gpu-nvlink-8"):
        prediction = report.predict(preset)
        link, one = prediction.topology.cores, prediction.topology.native_latency == "one"
        by_hand = [(1 if one else 2) * link.alpha_s + 2 * (2 - 1) / 2 * c.nbytes * link.beta_s_per_byte for c in rows]
        np.testing.assert_allclose(prediction.tensor_seconds, by_hand, rtol=1e-12)
        assert prediction.total_s == pytest.approx(sum(prediction.seconds) + sum(by_hand))
        assert str(prediction).count(" tensor ") == 2


def test_per_replica_state_and_the_state_check_run_beside_the_tensor_axis():
    """A per-replica leaf (a running mean of each replica's batch) stays per replica; the state check
    compares the leaves stored whole on every device (split ones differ between devices by design)."""

    def step(state, b):
        inner, stats = state
        inner, loss = _step(inner, b)
        return (inner, 0.9 * stats + 0.1 * jnp.mean(b["x"], 0)), loss

    plan = {"0/0/fc1": "column", "0/0/b1": 0, "0/0/fc2": "row"}
    repl = rp.Replicator(2, 4, check_state_every=1, parallelism=rp.Parallelism(tensor=2, tensor_plan=plan))
    b = _batches(8)[0]
    (inner, stats), _ = repl.run(step, b, (_state(), jnp.zeros((4, 6))), per_replica_state=(False, True))
    np.testing.assert_allclose(stats, 0.1 * np.asarray(b["x"]).reshape(4, 2, 6).mean(1), rtol=1e-6)
    _close(inner, _reference([b], _state())[0])
