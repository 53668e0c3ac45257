"""Regression tests for miscompiles found in the default pipeline.

Every numeric check compares a replicated run with an independent reference:
NumPy, or single-device JAX on the global batch. Each runs under every
pipeline variant that can rewrite the step (the ZeRO pass on and off).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import custom_batching
from utils import custom_vmap_call_primitive

import replicator as rp
from replicator.passes import PassManager, count_primitives

# The test tensors are small: ZeRO on every tensor, whatever its size.
ZERO = {"zero": dict(shard_optimizer=True, shard_optimizer_min_bytes=0), "no-zero": dict(shard_optimizer=False)}


def _replicator(n_devices: int, workers: int, variant: str) -> rp.Replicator:
    return rp.Replicator(workers, n_devices // workers, passes=PassManager.default(verify=True, **ZERO[variant]))


def _run(repl: rp.Replicator, step, state, batches):
    def input_fn(ctx):
        per_worker = len(batches[0]["x"]) // repl.num_workers
        for b in batches:
            yield jax.tree.map(lambda a: a[ctx.worker_id * per_worker : (ctx.worker_id + 1) * per_worker], b)

    out = None
    for _ in batches:
        state, out = repl.run(step, input_fn, state)
    return state, out


MESHES = pytest.mark.parametrize("workers", [1, 2])
VARIANTS = pytest.mark.parametrize("variant", sorted(ZERO))


# -- the batch-statistics update of Flax's examples -------------------------------------


def _stats_step(s, batch):
    local_mean = jnp.mean(batch["x"], axis=0)  # differs per replica
    return rp.all_mean(0.9 * s + 0.1 * local_mean), {}


@MESHES
@VARIANTS
@pytest.mark.parametrize("features", [4, 8, 16, 64])
def test_running_mean_of_batch_statistics(n_devices, workers, variant, features):
    rng = np.random.default_rng(features)
    batches = [{"x": rng.normal(size=(8 * n_devices, features)).astype(np.float32)} for _ in range(3)]
    state, _ = _run(_replicator(n_devices, workers, variant), _stats_step, jnp.zeros(features), batches)
    expected = np.zeros(features)
    for b in batches:  # replicas have equal row counts: the mean of means is the global mean
        expected = 0.9 * expected + 0.1 * b["x"].astype(np.float64).mean(0)
    np.testing.assert_allclose(np.asarray(state), expected, rtol=1e-5, atol=1e-6)


def test_statistics_update_from_varying_values_is_not_chunked(n_devices):
    repl = _replicator(n_devices, 1, "zero")
    lowered = repl.lower(_stats_step, {"x": np.zeros((8 * n_devices, 8), np.float32)}, jnp.zeros(8))
    after = lowered.after("shard-optimizer-update")
    assert after.sharded_state == frozenset()
    counts = count_primitives(after.jaxpr, ["rp.reduce_scatter", "rp.all_gather"])
    assert counts == {}, counts  # the pass left the step as it was


# -- a dense layer into cross-replica batch norm, SGD ----------------------------------


def _bn_loss(params, x, y, bn):
    h = x @ params["w"]
    h, mean, var = bn(h, params["scale"], params["offset"])
    return jnp.mean((jnp.tanh(h) @ params["v"] - y) ** 2), (mean, var)


def _global_bn(h, scale, offset, eps=1e-5):
    mean = jnp.mean(h, axis=0)
    var = jnp.mean(jnp.square(h - mean), axis=0)
    return (h - mean) * jax.lax.rsqrt(var + eps) * scale + offset, mean, var


def _bn_params(features: int, rng) -> dict:
    return {
        "w": (rng.normal(size=(5, features)) * 0.5).astype(np.float32),
        "scale": np.ones(features, np.float32),
        "offset": np.zeros(features, np.float32),
        "v": (rng.normal(size=(features, 3)) * 0.5).astype(np.float32),
    }


def _bn_step(state, batch):
    params, stats = state["params"], state["stats"]
    (loss, (mean, var)), g = jax.value_and_grad(_bn_loss, has_aux=True)(
        params, batch["x"], batch["y"], rp.cross_replica_batch_norm
    )
    g = rp.all_mean(g)
    params = jax.tree.map(lambda p, d: p - 0.1 * d, params, g)
    stats = {"mean": 0.9 * stats["mean"] + 0.1 * mean, "var": 0.9 * stats["var"] + 0.1 * var}
    return {"params": params, "stats": stats}, {"loss": rp.all_mean(loss), "grad_w": g["w"]}


@jax.jit
def _bn_reference_step(state, batch):
    params, stats = state["params"], state["stats"]
    (loss, (mean, var)), g = jax.value_and_grad(_bn_loss, has_aux=True)(params, batch["x"], batch["y"], _global_bn)
    params = jax.tree.map(lambda p, d: p - 0.1 * d, params, g)
    stats = {"mean": 0.9 * stats["mean"] + 0.1 * mean, "var": 0.9 * stats["var"] + 0.1 * var}
    return {"params": params, "stats": stats}, {"loss": loss, "grad_w": g["w"]}


@MESHES
@VARIANTS
@pytest.mark.parametrize("features", [4, 8, 16, 64])
def test_dense_into_cross_replica_batch_norm_matches_one_device(n_devices, workers, variant, features):
    rng = np.random.default_rng(features)
    params = _bn_params(features, rng)
    state = {"params": params, "stats": {"mean": np.zeros(features, np.float32), "var": np.ones(features, np.float32)}}
    batches = [
        {
            "x": rng.normal(size=(4 * n_devices, 5)).astype(np.float32),
            "y": rng.normal(size=(4 * n_devices, 3)).astype(np.float32),
        }
        for _ in range(3)
    ]
    got, out = _run(_replicator(n_devices, workers, variant), _bn_step, state, batches)
    ref = state
    for b in batches:
        ref, ref_out = _bn_reference_step(ref, b)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # Outputs come back per replica (a leading replica axis); every copy is the global one.
    for r in range(n_devices):
        np.testing.assert_allclose(np.asarray(out["grad_w"][r]), np.asarray(ref_out["grad_w"]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(out["loss"][r]), float(ref_out["loss"]), rtol=1e-5)


# -- Adam stays sharded where it is sound -------------------------------------------------


def _adam_step(tx):
    def step(state, batch):
        params, opt = state
        g = rp.all_mean(jax.grad(lambda p: jnp.mean((batch["x"] @ p["w"] + p["b"]) ** 2))(params))
        upd, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, upd), opt), {}

    return step


def test_adam_moments_are_still_sharded_and_correct(n_devices):
    tx = optax.adam(1e-2)
    rng = np.random.default_rng(0)
    params = {
        "w": rng.normal(size=(2 * n_devices, 2 * n_devices)).astype(np.float32),
        "b": np.zeros(2 * n_devices, np.float32),
    }
    state = (params, tx.init(params))
    batches = [{"x": rng.normal(size=(2 * n_devices, 2 * n_devices)).astype(np.float32)} for _ in range(3)]
    repl = _replicator(n_devices, 1, "zero")
    lowered = repl.lower(_adam_step(tx), batches[0], state)
    after = lowered.after("shard-optimizer-update")
    sharded = sorted(after.state_paths[i] for i in after.sharded_state)
    assert len(sharded) == 4 and all(".mu" in p or ".nu" in p for p in sharded), sharded
    got, _ = _run(repl, _adam_step(tx), state, batches)

    @jax.jit
    def reference(state, batch):
        params, opt = state
        g = jax.grad(lambda p: jnp.mean((batch["x"] @ p["w"] + p["b"]) ** 2))(params)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt

    ref = state
    for b in batches:
        ref = reference(ref, b)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# -- a state leaf that is updated on chunks and also returned as an output ----------------


@VARIANTS
def test_state_read_whole_elsewhere_is_not_sharded(n_devices, variant):
    """Used to read an undefined variable: ``mu`` was sharded although the outputs read it whole."""
    n = n_devices

    def step(state, batch):
        w, mu = state
        g = rp.all_mean(batch["x"].sum(0) * w)
        mu = 0.9 * mu + g
        return (w - 0.1 * mu, mu), {"old_mu": state[1]}

    rng = np.random.default_rng(3)
    w, mu = rng.normal(size=2 * n).astype(np.float32), rng.normal(size=2 * n).astype(np.float32)
    batches = [{"x": rng.normal(size=(2 * n, 2 * n)).astype(np.float32)}]
    (w1, mu1), out = _run(_replicator(n, 1, variant), step, (w, mu), batches)
    g = batches[0]["x"].reshape(n, 2, 2 * n).sum(1).mean(0) * w
    np.testing.assert_allclose(np.asarray(mu1), 0.9 * mu + g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(w1), w - 0.1 * (0.9 * mu + g), rtol=1e-5, atol=1e-6)
    for r in range(n):
        np.testing.assert_allclose(np.asarray(out["old_mu"][r]), mu)


# -- the variance analysis is conservative ----------------------------------------------------


@custom_batching.custom_vmap
def _plus_replica_id(x):
    return x + rp.replica_id()


@_plus_replica_id.def_vmap
def _plus_replica_id_vmap(axis_size, in_batched, x):
    del axis_size
    return x + rp.replica_id(), in_batched[0]


def test_replica_id_inside_custom_vmap_makes_state_divergent(repl):
    def step(w, batch):
        del batch
        return _plus_replica_id(w), {}

    with pytest.raises(rp.DivergentStateError, match="state"):
        repl.lower(step, {"x": np.zeros((repl.num_replicas, 1), np.float32)}, jnp.int32(0))


def test_unknown_higher_order_primitive_is_assumed_to_vary(repl, monkeypatch):
    """Without a rule for ``custom_vmap_call``, the default still sees the replica_id inside."""
    from replicator.analysis.invariance import RULES

    monkeypatch.delitem(RULES, custom_vmap_call_primitive())

    def step(w, batch):
        del batch
        return _plus_replica_id(w), {}

    with pytest.raises(rp.DivergentStateError):
        repl.lower(step, {"x": np.zeros((repl.num_replicas, 1), np.float32)}, jnp.int32(0))


@custom_batching.custom_vmap
def _mean_inside(x):
    return rp.all_mean(x)


@_mean_inside.def_vmap
def _mean_inside_vmap(axis_size, in_batched, x):
    del axis_size
    return rp.all_mean(x), in_batched[0]


def test_collective_inside_unknown_higher_order_primitive_is_rejected(repl, monkeypatch):
    from replicator.analysis.invariance import RULES

    def step(w, batch):
        return w + _mean_inside(batch["x"].sum()), {}

    batch = {"x": np.ones((repl.num_replicas, 1), np.float32)}
    repl.lower(step, batch, jnp.float32(0))  # with its rule: a call, analysed inside
    monkeypatch.delitem(RULES, custom_vmap_call_primitive())
    with pytest.raises(rp.UnanalyzableStepError, match="custom_vmap_call.*no rule"):
        repl.lower(lambda w, b: step(w, b), batch, jnp.float32(0))


# -- where the ZeRO pass fires, and what fusion makes of it ------------------------------------


def test_zero_without_any_state_to_shard_leaves_all_reduces_alone(n_devices):
    """50 all-sums added to state read whole: no optimizer state, so one fused psum, not RS + AG."""

    def step(state, batch):
        k = jnp.mean(batch["x"])
        return [s + rp.all_sum(s * k) for s in state], {}

    repl = _replicator(n_devices, 1, "zero")
    lowered = repl.lower(step, {"x": np.ones((n_devices, 1), np.float32)}, [jnp.ones(1000)] * 50)
    assert not lowered.after("shard-optimizer-update").sharded_state
    assert count_primitives(lowered.after("shard-optimizer-update").jaxpr, ["rp.all_reduce"]) == {"rp.all_reduce": 50}
    assert count_primitives(lowered.final.jaxpr, ["psum", "reduce_scatter", "all_gather"]) == {"psum": 1}


def test_zero_reduce_scatters_and_all_gathers_are_fused(n_devices):
    tx = optax.adam(1e-2)
    width = 2 * n_devices
    params = [{"w": np.ones((width, width), np.float32), "b": np.zeros(width, np.float32)} for _ in range(6)]

    def step(state, batch):
        params, opt = state

        def loss(ps):
            h = batch["x"]
            for p in ps:
                h = jnp.tanh(h @ p["w"] + p["b"])
            return jnp.mean(h**2)

        g = rp.all_mean(jax.grad(loss)(params))
        upd, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, upd), opt), {}

    repl = _replicator(n_devices, 1, "zero")
    lowered = repl.lower(step, {"x": np.ones((2 * n_devices, width), np.float32)}, (params, tx.init(params)))
    zero = lowered.after("shard-optimizer-update")
    assert len(zero.sharded_state) == 24  # mu and nu of 12 tensors
    names = ["rp.all_reduce", "rp.reduce_scatter", "rp.all_gather"]
    assert count_primitives(zero.jaxpr, names) == {"rp.reduce_scatter": 12, "rp.all_gather": 12}
    assert count_primitives(lowered.after("fuse-collectives").jaxpr, names) == {
        "rp.reduce_scatter": 1,
        "rp.all_gather": 1,
    }


def test_zero_leaves_small_tensors_whole_by_default(n_devices):
    tx = optax.adam(1e-2)
    small = {"w": np.ones((2 * n_devices, 4), np.float32)}  # far below 64 KiB
    big = {"w": np.ones((128 * n_devices, 32), np.float32)}  # 128 KiB and more
    for params, sharded in ((small, 0), (big, 2)):
        repl = rp.Replicator(1, n_devices, passes=PassManager.default(shard_optimizer=True))
        step = _adam_step_no_bias(tx)
        batch = {"x": np.ones((n_devices, params["w"].shape[0]), np.float32)}
        after = repl.lower(step, batch, (params, tx.init(params))).after("shard-optimizer-update")
        assert len(after.sharded_state) == sharded


def _adam_step_no_bias(tx):
    def step(state, batch):
        params, opt = state
        g = rp.all_mean(jax.grad(lambda p: jnp.mean((batch["x"] @ p["w"]) ** 2))(params))
        upd, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, upd), opt), {}

    return step
