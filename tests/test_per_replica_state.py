"""State kept per replica (``Replicator.run(..., per_replica_state=...)``), as ``jax.pmap`` keeps it.

A batch norm without a cross-replica axis updates its running statistics from
this replica's rows only: each replica keeps its own copy. References: the
running means computed per replica with NumPy, and all replicas simulated at
once with ``jax.vmap(..., axis_name='batch')`` (which runs the same Flax code
with ``lax.pmean`` over the mapped axis).
"""

import io
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import replicator as rp
from replicator.core.context import REPLICA_AXES

THIS_FILE = Path(__file__).name
BN_LINE = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if line.endswith("# the BN line"))
MOMENTUM = 0.9


def _running_mean_step(state, batch):
    stats = MOMENTUM * state["stats"] + (1 - MOMENTUM) * jnp.mean(batch["x"], axis=0)
    return {"w": state["w"], "stats": stats}, {"stats": stats}


def _rows(n_replicas, rows=4, steps=3):
    rng = np.random.default_rng(0)
    return [rng.normal(size=(n_replicas * rows, 3)).astype(np.float32) for _ in range(steps)]


def _input_fn(repl, xs):
    def input_fn(ctx):
        rows = len(xs[0]) // repl.num_workers
        for x in xs:
            yield {"x": x[ctx.worker_id * rows : (ctx.worker_id + 1) * rows]}

    return input_fn


def _numpy_running_means(xs, n_replicas):
    ref = np.zeros((n_replicas, 3))
    for x in xs:  # replica r's rows are the r-th block of the global batch
        ref = MOMENTUM * ref + (1 - MOMENTUM) * x.reshape(n_replicas, -1, 3).mean(axis=1)
    return ref


@pytest.mark.parametrize("workers,per_device", [(2, 1), (1, 2)])
def test_each_replica_keeps_its_own_running_mean(n_devices, workers, per_device):
    cores = n_devices // workers * per_device
    repl = rp.Replicator(workers, cores, parallelism=rp.Parallelism(replicas_per_device=per_device))
    n = repl.num_replicas
    xs = _rows(n)
    input_fn = _input_fn(repl, xs)
    state = {"w": jnp.ones(3), "stats": jnp.zeros((n, 3))}
    for _ in xs:
        state, out = repl.run(_running_mean_step, input_fn, state, per_replica_state={"w": False, "stats": True})
    ref = _numpy_running_means(xs, n)
    assert np.abs(ref - ref[:1]).max() > 1e-2  # the replicas' statistics differ: the check below can fail
    np.testing.assert_allclose(np.asarray(state["stats"]), ref, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out["stats"]), ref, atol=1e-5)  # each replica saw its own row
    assert state["w"].shape == (3,)
    assert repl.trace_count == 1  # the returned state goes back in without compiling again


def test_the_returned_state_has_the_replica_axis_sharded_over_the_replicas(repl2d):
    n = repl2d.num_replicas
    state = {"w": jnp.ones(3), "stats": jnp.zeros((n, 3))}
    state, _ = repl2d.run(
        _running_mean_step, _input_fn(repl2d, _rows(n)), state, per_replica_state=lambda path: "stats" in path
    )
    stats = state["stats"]
    assert stats.shape == (n, 3)
    assert stats.sharding.spec == jax.sharding.PartitionSpec(REPLICA_AXES)
    assert {s.data.shape for s in stats.addressable_shards} == {(1, 3)}  # one row per device
    final = repl2d.lower(
        _running_mean_step,
        {"x": np.zeros((4 * repl2d.cores_per_worker, 3), np.float32)},
        state,
        per_replica_state=lambda path: "stats" in path,
    ).final
    (index,) = final.per_replica_state
    assert final.state_paths[index] == "state['stats']" and final.sharded_state.axis(index) == 0


def test_without_the_declaration_the_same_state_is_rejected(repl):
    """The declaration is part of the compiled step: the same shapes without it are checked again."""
    n = repl.num_replicas
    batch = {"x": np.zeros((4 * n, 3), np.float32)}
    state = {"w": jnp.ones(3), "stats": jnp.zeros((n, 3))}
    repl.lower(_running_mean_step, batch, state, per_replica_state={"w": False, "stats": True})
    with pytest.raises(rp.DivergentStateError, match=r"state\['stats'\]"):
        repl.lower(_running_mean_step, batch, state)


# -- Flax batch norm, as under jax.pmap ----------------------------------------------------------


class _Net(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=MOMENTUM, axis_name=self.axis_name)(x)  # the BN line
        return jnp.mean(x**2)


def _flax_step(model):
    def step(state, batch):
        params, stats = state

        def loss(p):
            return model.apply({"params": p, "batch_stats": stats}, batch["x"], mutable=["batch_stats"])

        (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(params)
        grads = lax.pmean(grads, "batch")
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return (params, updates["batch_stats"]), {"loss": value}

    return step


def test_flax_batch_norm_with_per_device_statistics_trains_as_simulated_replicas(repl2d):
    n = repl2d.num_replicas
    repl = rp.Replicator(repl2d.num_workers, repl2d.cores_per_worker, axis_name="batch")
    model = _Net()
    xs = [x * 3 + np.arange(3, dtype=np.float32) for x in _rows(n, rows=4, steps=3)]
    variables = model.init(jax.random.key(0), xs[0][:4])
    params, stats = variables["params"], variables["batch_stats"]
    per_replica = jax.tree.map(lambda s: jnp.broadcast_to(s, (n, *s.shape)), stats)
    step = _flax_step(model)
    state, input_fn = (params, per_replica), _input_fn(repl, xs)
    for _ in xs:
        state, _ = repl.run(step, input_fn, state, per_replica_state=(False, True))

    # All replicas at once on one device: vmap binds 'batch', so lax.pmean averages over the replicas.
    simulated = jax.jit(jax.vmap(step, in_axes=((None, 0), 0), out_axes=((None, 0), 0), axis_name="batch"))
    ref = (params, per_replica)
    for x in xs:
        ref, _ = simulated(ref, {"x": x.reshape(n, -1, 3)})
    mean = np.asarray(ref[1]["BatchNorm_0"]["mean"])
    assert np.abs(mean - mean[:1]).max() > 1e-3  # the replicas' statistics differ
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_batch_norm_statistics_error_names_the_fix_the_line_and_the_axis(n_devices):
    repl = rp.Replicator(
        2 if n_devices % 2 == 0 else 1, n_devices // (2 if n_devices % 2 == 0 else 1), axis_name="batch"
    )
    model = _Net()
    x = np.ones((4 * repl.cores_per_worker, 3), np.float32)
    variables = model.init(jax.random.key(0), x[:4])
    with pytest.raises(rp.DivergentStateError) as err:
        repl.lower(_flax_step(model), {"x": x}, (variables["params"], variables["batch_stats"]))
    msg = str(err.value)
    assert "state[1]['BatchNorm_0']" in msg, msg
    assert "all_mean the statistics" in msg and "per_replica_state" in msg, msg
    assert "grads = rp.all_mean(grads)" not in msg, msg
    assert f"{THIS_FILE}:{BN_LINE} " in msg, msg  # the user's line that called the batch norm, not flax's
    assert "flax" not in msg.split("Fix:")[0], msg
    assert "axis 'batch'" in msg, msg
    assert "nn.BatchNorm(axis_name='batch')" in msg, msg


def test_an_unaveraged_gradient_still_names_the_gradient_fix(repl):
    def step(s, b):
        g = jax.grad(lambda w: jnp.sum(b["x"] @ w))(s["w"])
        return {"w": s["w"] - g}, {}

    with pytest.raises(rp.DivergentStateError) as err:
        repl.lower(step, {"x": np.ones((2 * repl.num_replicas, 3), np.float32)}, {"w": jnp.zeros(3)})
    msg = str(err.value)
    assert "grads = rp.all_mean(grads)" in msg and "per-replica statistics" not in msg, msg
    assert "mesh axes ('cores',)" in msg or "mesh axes ('cores', 'workers')" in msg, msg


# -- errors --------------------------------------------------------------------------------------


def test_a_per_replica_leaf_without_the_replica_axis_is_an_error(repl):
    batch = {"x": np.zeros((4 * repl.num_replicas, 3), np.float32)}
    with pytest.raises(
        ValueError, match=rf"state\['stats'\].*leading axis of size num_replicas \({repl.num_replicas}\)"
    ):
        repl.lower(_running_mean_step, batch, {"w": jnp.ones(3), "stats": jnp.zeros(3)}, per_replica_state=True)
    with pytest.raises(ValueError, match="per_replica_state must be a bool"):
        repl.lower(_running_mean_step, batch, {"w": jnp.ones(3), "stats": jnp.zeros(3)}, per_replica_state=[True])


# -- checkpoints ---------------------------------------------------------------------------------


def test_a_checkpoint_keeps_the_replica_axis_and_restores_on_the_same_replica_count(repl2d, tmp_path):
    n = repl2d.num_replicas
    flags = {"w": False, "stats": True}
    xs = _rows(n)
    input_fn = _input_fn(repl2d, xs)
    state = {"w": jnp.ones(3), "stats": jnp.zeros((n, 3))}
    state, _ = repl2d.run(_running_mean_step, input_fn, state, per_replica_state=flags)
    rp.save_checkpoint(tmp_path, 1, state)
    _, restored, _ = rp.restore_checkpoint(tmp_path, state)
    np.testing.assert_array_equal(np.asarray(restored["stats"]), np.asarray(state["stats"]))
    assert restored["stats"].sharding.is_equivalent_to(state["stats"].sharding, 2)
    state, _ = repl2d.run(_running_mean_step, input_fn, restored, per_replica_state=flags)  # training goes on
    np.testing.assert_allclose(np.asarray(state["stats"]), _numpy_running_means(xs[:2], n), atol=1e-5)
    # Onto another replica count the leaf's shape differs: a clear error, not a silent reshape.
    other = {"w": jnp.ones(3), "stats": jnp.zeros((n // 2, 3))}
    with pytest.raises(rp.CheckpointError, match=r"stats.*shape"):
        rp.restore_checkpoint(tmp_path, other)


def test_zero_shards_the_optimizer_state_next_to_per_replica_statistics(repl2d):
    """ZeRO stage 1 splits Adam's moments; the per-replica leaf keeps one row per replica; numbers as references."""
    import optax

    n = repl2d.num_replicas
    repl = rp.Replicator(
        repl2d.num_workers,
        repl2d.cores_per_worker,
        passes=rp.PassManager.default(zero=1, shard_optimizer_min_bytes=0),
    )
    tx = optax.adam(1e-2)

    def step(state, batch, mean=rp.all_mean):
        w, opt, stats = state
        g = mean(jax.grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w))
        upd, opt = tx.update(g, opt, w)
        stats = MOMENTUM * stats + (1 - MOMENTUM) * jnp.mean(batch["x"], axis=0)
        return (optax.apply_updates(w, upd), opt, stats), {}

    w = np.random.default_rng(2).normal(size=(3, 2 * n)).astype(np.float32)
    state = (jnp.asarray(w), tx.init(jnp.asarray(w)), jnp.zeros((n, 3)))
    flags = (False, False, True)
    xs = _rows(n)
    final = repl.lower(step, {"x": xs[0][: len(xs[0]) // repl.num_workers]}, state, per_replica_state=flags).final
    paths = {final.state_paths[i] for i in final.sharded_state}
    assert {"state[1][0].mu", "state[1][0].nu", "state[2]"} <= paths, paths
    assert [final.state_paths[i] for i in final.per_replica_state] == ["state[2]"]
    input_fn = _input_fn(repl, xs)
    for _ in xs:
        state, _ = repl.run(step, input_fn, state, per_replica_state=flags)
    reference = jax.jit(lambda s, b: step(s, b, mean=lambda g: g))  # one device, the global batch
    ref = (jnp.asarray(w), tx.init(jnp.asarray(w)), jnp.zeros(3))
    for x in xs:
        ref, _ = reference(ref, {"x": x})
    assert np.abs(np.asarray(ref[0]) - w).max() > 1e-3  # training moved the weights: the check below can fail
    np.testing.assert_allclose(np.asarray(state[0]), np.asarray(ref[0]), atol=2e-5)
    np.testing.assert_allclose(np.asarray(state[2]), _numpy_running_means(xs, n), atol=1e-5)


def test_the_trainer_passes_the_declaration_on(repl2d):
    n = repl2d.num_replicas
    xs = _rows(n)
    trainer = rp.Trainer(
        repl2d,
        _running_mean_step,
        _input_fn(repl2d, xs),
        {"w": jnp.ones(3), "stats": jnp.zeros((n, 3))},
        per_replica_state={"w": False, "stats": True},
        stream=io.StringIO(),
    )
    state = trainer.run(len(xs))
    np.testing.assert_allclose(np.asarray(state["stats"]), _numpy_running_means(xs, n), atol=1e-5)
