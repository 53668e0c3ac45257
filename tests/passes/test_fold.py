"""fold-replicas: several logical replicas per device, against NumPy and the vmap simulation.

The logical mesh is 2 workers x 4 cores (and 4 x 4 on 8 devices); folded onto
2 x 2, 2 x 1 and 1 x 1 devices. Every collective, group and context is compared
with the NumPy references of the placeholder tests, training steps with
``tests/utils.simulate`` (every replica vmapped on one device, no library code).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from utils import (
    CASES,
    COLS,
    CONTEXTS,
    assert_matches,
    check_against_simulation,
    data,
    per_replica,
    reference,
    run_step,
)

import replicator as rp
from replicator.core.layout import FoldError, FoldLayout, fold_layout
from replicator.passes import count_primitives

# (workers, cores, replicas_per_device): cores folded on a 2 x 2 device mesh, whole
# workers folded (2 x 1 devices: 4 each; 1 x 1: all 8), and 16 replicas on 8 devices.
LAYOUTS = [(2, 4, 2), (2, 4, 4), (2, 4, 8), (4, 4, 2)]
LAYOUT_IDS = [f"{w}x{c}-per-device-{f}" for w, c, f in LAYOUTS]


@pytest.fixture(params=LAYOUTS, ids=LAYOUT_IDS, scope="module")
def folded(request) -> rp.Replicator:
    w, c, f = request.param
    return rp.Replicator(w, c, parallelism=rp.Parallelism(replicas_per_device=f))


def test_layouts():
    assert fold_layout(2, 4, replicas_per_device=2) == FoldLayout(2, 4, 1, 2)
    assert fold_layout(2, 4, replicas_per_device=8) == FoldLayout(2, 4, 2, 4)
    assert fold_layout(64, 8, replicas_per_device=256).device_mesh == (2, 1)
    assert fold_layout(2, 4, replicas_per_device=2).expand(("workers", "cores")) == ("workers", "cores", "cores_fold")
    with pytest.raises(ValueError, match=r"replicas_per_device=3 .* Choose one of \[1, 2, 4, 8\]"):
        fold_layout(2, 4, replicas_per_device=3)
    with pytest.raises(ValueError, match=r"Choose one of \[1, 2, 4, 8, 12, 24\]"):
        fold_layout(6, 4, replicas_per_device=16)  # 16 / 4 = 4 workers per device does not divide 6


def test_a_replicator_with_too_few_devices_names_replicas_per_device(n_devices):
    with pytest.raises(ValueError, match=r"replicas_per_device=2"):
        rp.Replicator(2, n_devices)
    repl = rp.Replicator(2, n_devices, parallelism=rp.Parallelism(replicas_per_device=2))
    assert repl.num_replicas == 2 * n_devices and repl.mesh.devices.size == n_devices
    assert "replicas_per_device=2" in repr(repl)


def test_axis_index_primitive_over_a_device_and_a_vmapped_axis_is_the_vmapped_index_alone():
    """Why fold.py never binds ``axis_index`` over several axes: lowered graphs hold the primitive
    with a tuple of names (``lax.axis_index`` splits a tuple itself, the primitive does not)."""
    from jax.extend.core.primitives import axis_index_p

    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("workers", "cores"))

    def per_device(x):
        index = jax.vmap(lambda _: axis_index_p.bind(axis_name=("cores", "cores_fold")), axis_name="cores_fold")(x)
        return index.astype(jnp.float32)

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("cores"), out_specs=P("cores"), check_vma=False))
    assert np.asarray(fn(jnp.zeros(4))).tolist() == [0, 1, 0, 1]  # device-major would be [0, 1, 2, 3]


@pytest.mark.parametrize("group", [None, "cores", "workers"])
def test_every_collective_over_every_group_matches_numpy(folded, group):
    n = folded.num_replicas
    x = data((n * n, COLS), seed=3)
    got = run_step(folded, lambda b: {c.name: c.fn(b["x"], group) for c in CASES}, {"x": x})
    for case in CASES:
        assert_matches(got[case.name], reference(folded, case.ref, per_replica(x, n), group))


@pytest.mark.parametrize("context", list(CONTEXTS))
def test_collectives_in_every_context_match_numpy(context):
    repl = rp.Replicator(2, 4, parallelism=rp.Parallelism(replicas_per_device=2))
    n = repl.num_replicas
    x = data((n * n, COLS), seed=4)
    names = ["all_sum", "all_max", "all_gather_tiled", "reduce_scatter", "broadcast_last", "replica_id"]
    cases = [c for c in CASES if c.name in names]
    wrapped = {c.name: CONTEXTS[context](lambda v, c=c: c.fn(v, "cores")) for c in cases}
    got = run_step(repl, lambda b: {k: f(b["x"]) for k, f in wrapped.items()}, {"x": x})
    for case in cases:
        assert_matches(got[case.name], reference(repl, case.ref, per_replica(x, n), "cores"))


@pytest.mark.parametrize("algorithm", ["ring", "reduce_broadcast"])
@pytest.mark.parametrize("per_device", [2, 8])
def test_ppermute_lowerings_fold(algorithm, per_device):
    repl = rp.Replicator(
        2,
        4,
        parallelism=rp.Parallelism(replicas_per_device=per_device),
        passes=rp.PassManager.default(all_reduce_algorithm=algorithm),
    )
    assert (
        count_primitives(repl.lower(lambda b: rp.all_sum(b), np.ones((8, 5), np.float32)).final.jaxpr).get(
            "ppermute", 0
        )
        == 0
    )  # every ppermute became a gather and a select
    n = repl.num_replicas
    x = data((n * n, COLS), seed=5)
    for group in (None, "cores", "workers"):
        got = run_step(repl, lambda b, g=group: rp.all_sum(b["x"], group=g), {"x": x})
        assert_matches(got, reference(repl, lambda xp, xg, i: xg.sum(0), per_replica(x, n), group))


def _adam_step(tx):
    def step(state, batch):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w1"])
            return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        grads = rp.all_mean(grads)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": rp.all_mean(loss)}

    return step


def _adam_problem(global_rows: int, steps: int = 3):
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
    }
    tx = optax.adam(1e-2)
    batches = [
        {
            "x": rng.normal(size=(global_rows, 16)).astype(np.float32),
            "y": rng.normal(size=(global_rows, 4)).astype(np.float32),
        }
        for _ in range(steps)
    ]
    return _adam_step(tx), {"params": params, "opt": tx.init(params)}, batches


@pytest.mark.parametrize("shard_optimizer", [False, True], ids=["replicated", "zero"])
def test_adam_training_matches_the_simulation(folded, shard_optimizer):
    w, c, f = folded.num_workers, folded.cores_per_worker, folded.fold.replicas_per_device
    options = {"shard_optimizer": True, "shard_optimizer_min_bytes": 0} if shard_optimizer else {}
    repl = rp.Replicator(
        w, c, parallelism=rp.Parallelism(replicas_per_device=f), passes=rp.PassManager.default(**options)
    )
    step, state, batches = _adam_problem(4 * repl.num_replicas)
    check_against_simulation(repl, step, batches, state)
    if shard_optimizer:
        assert repl.lower(step, jax.tree.map(lambda a: a[: 4 * c], batches[0]), state).final.sharded_state


def test_batch_norm_statistics_per_group_match_the_simulation():
    def step(state, batch):
        # Batch norm over each worker's replicas (the statistics pattern of Flax's examples).
        x = batch["x"]
        mean = rp.all_mean(x.mean(0), group="cores")
        var = rp.all_mean(((x - mean) ** 2).mean(0), group="cores")
        y = (x - mean) / jnp.sqrt(var + 1e-5) * state["scale"] + state["offset"]
        return {**state, "mean": 0.9 * state["mean"] + 0.1 * rp.all_mean(mean)}, {"y": y}

    rng = np.random.default_rng(1)
    state = {"scale": jnp.ones(8), "offset": jnp.zeros(8), "mean": jnp.zeros(8)}
    batches = [{"x": rng.normal(size=(32, 8)).astype(np.float32)} for _ in range(2)]
    check_against_simulation(
        rp.Replicator(2, 4, parallelism=rp.Parallelism(replicas_per_device=2)), step, batches, state
    )


def test_replica_invariant_work_runs_once_per_device():
    """The update after the all-mean is computed on (3,) arrays, not (4, 3): vmap leaves it unbatched."""
    repl = rp.Replicator(1, 8, parallelism=rp.Parallelism(replicas_per_device=4))

    def step(w, batch):
        g = rp.all_mean(jax.grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w))
        return jnp.tanh(w - 0.1 * g), {}

    batch = {"x": np.ones((8 * 4, 3), np.float32)}
    compiled = repl._compile(step, jnp.zeros(3), batch)
    from replicator.runtime.execution import place_batch, place_state

    state = place_state([jnp.zeros(3)], repl.mesh)
    traced = compiled.executable.trace(state, place_batch([[batch["x"]]], repl.mesh))
    shapes = {
        tuple(v.aval.shape)
        for eqn in _all_eqns(traced.jaxpr.jaxpr)
        if eqn.primitive.name == "tanh"
        for v in eqn.outvars
    }
    assert shapes == {(3,)}, shapes


def _all_eqns(jaxpr):
    from replicator.core.jaxprs import iter_eqns

    return iter_eqns(jaxpr)


def test_explain_reports_the_logical_collectives():
    step, state, batches = _adam_problem(64)
    batch = jax.tree.map(lambda a: a[:32], batches[0])
    plain = rp.Replicator(2, 4).explain(step, batch, state)
    folded = rp.Replicator(2, 4, parallelism=rp.Parallelism(replicas_per_device=4)).explain(step, batch, state)
    assert folded.rows == plain.rows and folded.num_replicas == plain.num_replicas == 8
    assert folded.passes == (*plain.passes, "fold-replicas")


def test_a_collective_with_no_folded_form_is_an_error():
    repl = rp.Replicator(1, 8, parallelism=rp.Parallelism(replicas_per_device=2), axis_name="batch")

    def step(b):
        return {"y": lax.all_to_all(b["x"], "batch", 0, 0, tiled=True)}

    with pytest.raises(FoldError, match="all_to_all.*replicas_per_device=1"):
        repl.lower(step, {"x": np.ones((64, 2), np.float32)})


def test_a_fused_bucket_is_summed_over_the_fold_before_it_is_packed():
    """psum(concatenate(g1, g2, l)) becomes psum_devices(concatenate(sum_fold(g1), sum_fold(g2), psum_fold(l))),
    with each weight gradient's sum over the fold one contraction of the fold's rows."""
    step, state, batches = _adam_problem(64)
    batch = jax.tree.map(lambda a: a[:16], batches[0])
    final = (
        rp.Replicator(2, 4, parallelism=rp.Parallelism(replicas_per_device=2))
        .lower(step, batch, state)
        .final.jaxpr.jaxpr
    )
    psums = [e for e in final.eqns if e.primitive.name == "psum"]
    size = 16 * 8 + 8 * 4 + 1  # w1's and w2's gradients and the loss, in one bucket
    packed = [e for e in psums if e.invars[0].aval.shape == (size,)]
    assert [e.params["axes"] for e in packed] == [("workers", "cores")]  # over the devices only
    per_tensor = sorted(e.invars[0].aval.shape for e in psums if e.params["axes"] == ("cores_fold",))
    assert per_tensor == [(1,)]  # the loss over the fold, before packing
    # The weight gradients x^T dy: one contraction of the 2 folded replicas' rows (each gathered).
    gathers = [e for e in final.eqns if e.primitive.name == "all_gather" and e.params["axis_name"] == ("cores_fold",)]
    assert len(gathers) == 4 and all(e.params["tiled"] for e in gathers)
    contracted = {e.outvars[0].aval.shape[e.params["all_gather_dimension"]] for e in gathers}
    assert contracted == {2 * 4}  # 2 folded replicas x 4 rows each (a worker batch of 16 over 4 cores)


def test_translation_validation_runs_folded(monkeypatch):
    """validate=True runs each pass's graph folded too, on the folded device mesh."""
    from replicator.tools import validate

    meshes = []

    class Spy(validate.FoldReplicas):
        def run(self, graph):
            meshes.append(self.layout.device_mesh)
            return super().run(graph)

    monkeypatch.setattr(validate, "FoldReplicas", Spy)
    step, state, batches = _adam_problem(64)
    repl = rp.Replicator(
        2, 4, parallelism=rp.Parallelism(replicas_per_device=4), passes=rp.PassManager.default(validate=True)
    )
    check_against_simulation(repl, step, batches[:1], state)
    assert meshes and set(meshes) == {(2, 1)}  # every validated graph ran on 2 devices


def test_summands_that_are_results_of_other_collectives_fold_too():
    """A bucket holding an all_gather's result, and a contraction of gathered rows (contrastive-style)."""

    def step(state, batch):
        x = batch["x"]
        every = rp.all_gather(x, tiled=True)  # (all rows, 3)
        summed = rp.all_sum(x, group="cores")  # a psum's result, read by the contraction below
        grad = jax.grad(lambda w: jnp.sum(jnp.tanh(summed @ w)))(state)  # summed^T dy
        total = rp.all_sum({"gathered": every.sum(0), "grad": grad, "x": x.sum(0)})
        return state - 0.1 * rp.all_mean(grad), total

    rng = np.random.default_rng(2)
    batches = [{"x": rng.normal(size=(16, 3)).astype(np.float32)} for _ in range(2)]
    state = jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)
    for per_device in (2, 8):
        check_against_simulation(
            rp.Replicator(2, 4, parallelism=rp.Parallelism(replicas_per_device=per_device)), step, batches, state
        )


def test_checkpoints_move_between_folded_and_unfolded_runs(tmp_path):
    """ZeRO state saved from 8 replicas on 2 devices, restored on 8 devices, trains on like the uninterrupted run."""
    step, state0, batches = _adam_problem(64, steps=4)
    zero = rp.PassManager.default(shard_optimizer=True, shard_optimizer_min_bytes=0)
    rows = [jax.tree.map(lambda a: a.reshape(2, -1, *a.shape[1:]), b) for b in batches]

    def input_fn_from(k):
        def input_fn(ctx):
            for b in rows[k:]:
                yield jax.tree.map(lambda a: a[ctx.worker_id], b)

        return input_fn

    def train(repl, state, first, last):
        feed = input_fn_from(first)
        for _ in range(first, last):
            state, _ = repl.run(step, feed, state)
        return state

    uninterrupted = train(rp.Replicator(2, 4, passes=zero), state0, 0, 4)
    folded = rp.Replicator(2, 4, parallelism=rp.Parallelism(replicas_per_device=4), passes=zero)
    half = train(folded, state0, 0, 2)
    assert folded.lower(step, jax.tree.map(lambda a: a[0], rows[0]), state0).final.sharded_state
    rp.save_checkpoint(tmp_path, 2, half)
    _, restored, _ = rp.restore_checkpoint(tmp_path, state0)
    resumed = train(rp.Replicator(2, 4, passes=zero), restored, 2, 4)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(resumed), jax.tree.leaves(uninterrupted), strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.parametrize("per_device", [2, 8])
def test_folded_ppermute_gives_zeros_to_a_replica_no_one_sends_to(per_device):
    """``lax.ppermute`` over a folded axis, a shift without wrap-around: replica 0 receives zeros, as in JAX."""
    repl = rp.Replicator(1, 8, parallelism=rp.Parallelism(replicas_per_device=per_device), axis_name="batch")
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3) + 1  # no zero rows: a row sent by mistake shows
    perm = [(i, i + 1) for i in range(7)]
    got = run_step(repl, lambda b: {"y": lax.ppermute(b["x"], "batch", perm)}, {"x": x})
    rows = x.reshape(8, 2, 3)  # replica r's rows
    want = np.zeros_like(rows)
    for src, dst in perm:
        want[dst] = rows[src]
    np.testing.assert_array_equal(np.asarray(rp.local_outputs(got)["y"]), want)
