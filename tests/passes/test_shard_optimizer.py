"""shard-optimizer-update (ZeRO-1): graph rewrite, numbers, memory.

Numbers are checked against two independent references: ``tests.utils.simulate``
(every replica at once under ``jax.vmap`` with ``jax.lax`` collectives, each step's
per-replica outputs and the final state) and one-device ``jax.jit`` of the same step
on the global batch (``rp.all_mean`` the identity there). Every worker, and every
replica, gets rows of its own: a mix-up along ``'workers'`` shows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from utils import check_against_simulation

import replicator as rp
from replicator.passes import PassManager, count_primitives, default_passes, verify_graph
from replicator.passes.shard_optimizer import ShardOptimizerUpdate

PLACEHOLDERS = ["rp.all_reduce", "rp.reduce_scatter", "rp.all_gather"]


def _with_zero(**kwargs) -> PassManager:
    kwargs.setdefault("min_tensor_bytes", 0)  # the test tensors are small
    passes = default_passes()
    names = [p.name for p in passes]
    if "shard-optimizer-update" in names:
        passes[names.index("shard-optimizer-update")] = ShardOptimizerUpdate(**kwargs)
    else:
        passes.insert(names.index("fuse-collectives"), ShardOptimizerUpdate(**kwargs))
    return PassManager(passes, verify=True)


def _without_zero() -> PassManager:
    names = PassManager().names
    return PassManager(disable=["shard-optimizer-update"]) if "shard-optimizer-update" in names else PassManager()


def _loss(params, x):
    for layer in params:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean(x**2)


def _make_step(tx, mean=None):
    def step(state, batch):
        average = mean or rp.all_mean  # looked up when called: the vmap simulation swaps it
        params, opt = state
        loss, g = jax.value_and_grad(_loss)(params, batch["x"])
        g = average(g)
        upd, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, upd), opt), {"loss": average(loss), "local": loss}

    return step


def _batches(n, width=8, steps=4):
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(2 * n, width)).astype(np.float32)} for _ in range(steps)]


def _train(repl, step, state, batches):
    def input_fn(ctx):
        yield from batches

    for _ in batches:
        state, out = repl.run(step, input_fn, state)
    return state, out


def _check_against_reference(repl, step, state, batches):
    """Train ``step`` with ``repl`` on ``batches`` (global batches: worker ``w`` gets the ``w``-th slice of
    the rows, each of its replicas its own rows) and compare every step's outputs and the final state with
    ``tests.utils.simulate``: every replica at once under ``jax.vmap`` with ``jax.lax`` collectives, no pass
    or lowering of the library. Tolerance ``1e-6 + 1e-5 |want|``.
    """
    return check_against_simulation(repl, step, batches, state, atol=1e-6, rtol=1e-5)


def _one_device(tx, state, batches):
    """The state after ``batches`` of :func:`_make_step` under ``jax.jit`` on one device, on the global batch."""
    step = jax.jit(_make_step(tx, mean=lambda x: x))
    for b in batches:
        state, _ = step(state, b)
    return state


def _width(n):
    return 2 * n  # leading axes divisible by the replica count


def _setup(n, tx):
    w = _width(n)
    rng = np.random.default_rng(0)
    params = [{"w": (rng.normal(size=(w, w)) * 0.3).astype(np.float32), "b": np.zeros(w, np.float32)} for _ in range(3)]
    return params, (params, tx.init(params))


def test_graph_reduce_scatters_gradients_and_gathers_parameters(n_devices):
    tx = optax.adam(1e-2)
    params, state = _setup(n_devices, tx)
    repl = rp.Replicator(1, n_devices, passes=_with_zero())
    lowered = repl.lower(_make_step(tx), _batches(n_devices, _width(n_devices))[0], state)
    before = lowered.snapshots[[s.name for s in lowered.snapshots].index("shard-optimizer-update") - 1].graph
    after = lowered.after("shard-optimizer-update")
    n_tensors = len(jax.tree.leaves(params))
    assert count_primitives(before.jaxpr, PLACEHOLDERS) == {"rp.all_reduce": 2}  # grads, loss
    assert count_primitives(after.jaxpr, PLACEHOLDERS) == {
        "rp.all_reduce": 1,  # the loss (a scalar) is still all-reduced
        "rp.reduce_scatter": n_tensors,
        "rp.all_gather": n_tensors,  # the new parameters
    }
    mu_nu = [i for i, p in enumerate(after.state_paths) if ".mu" in p or ".nu" in p]
    assert sorted(after.sharded_state) == mu_nu and len(mu_nu) == 2 * n_tensors
    verify_graph(after, lowered=False)
    fused = lowered.after("fuse-collectives")
    assert count_primitives(fused.jaxpr, PLACEHOLDERS) == {
        "rp.all_reduce": 1,
        "rp.reduce_scatter": 1,
        "rp.all_gather": 1,
    }
    verify_graph(lowered.final, lowered=True)


@pytest.mark.parametrize(
    "tx",
    [
        optax.adam(1e-2),
        optax.sgd(0.1, momentum=0.9),
        optax.adamw(1e-2, weight_decay=0.1),
        optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
    ],
    ids=["adam", "momentum", "adamw", "clip+adam"],
)
def test_same_training_result_as_the_reference(n_devices, tx):
    _, state = _setup(n_devices, tx)
    batches = _batches(n_devices, _width(n_devices))
    step = _make_step(tx)
    final, _ = _check_against_reference(rp.Replicator(1, n_devices, passes=_with_zero()), step, state, batches)
    assert not np.allclose(final[0][0]["w"], state[0][0]["w"])  # training moved the parameters


@pytest.mark.parametrize("shard_state", [True, False])
def test_two_workers(mesh2d, shard_state):
    """On ``2 x n/2`` and on square meshes, with the state stored sharded and kept replicated (only the
    update work split): each worker's rows of the global batch, against both references."""
    workers, cores = mesh2d
    tx = optax.adam(1e-2)
    n = workers * cores
    _, state = _setup(n, tx)
    batches = _batches(n, _width(n), steps=2)  # 2 rows per replica
    repl = rp.Replicator(workers, cores, passes=_with_zero(shard_state=shard_state))
    lowered = repl.lower(_make_step(tx), jax.tree.map(lambda a: a[: len(a) // workers], batches[0]), state)
    assert lowered.snapshots[[s.name for s in lowered.snapshots].index("shard-optimizer-update")].changed
    assert bool(lowered.final.sharded_state) == shard_state
    final, _ = _check_against_reference(repl, _make_step(tx), state, batches)
    ref = _one_device(tx, state, batches)
    assert not np.allclose(ref[0][0]["w"], state[0][0]["w"])  # training moved the parameters
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), final, ref)


def _bytes_per_device(tree) -> int:
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def test_optimizer_state_memory_is_divided_by_the_replica_count(n_devices):
    tx = optax.adam(1e-2)
    _, state = _setup(n_devices, tx)
    batches = _batches(n_devices, _width(n_devices), steps=1)
    step = _make_step(tx)
    (_, opt_sharded), _ = _train(rp.Replicator(1, n_devices, passes=_with_zero()), step, state, batches)
    (_, opt_plain), _ = _train(rp.Replicator(1, n_devices, passes=_without_zero()), step, state, batches)
    count_bytes = 4  # Adam's step count stays replicated
    moments_plain = _bytes_per_device(opt_plain) - count_bytes
    moments_sharded = _bytes_per_device(opt_sharded) - count_bytes
    assert moments_sharded * n_devices == moments_plain


def test_leaves_that_do_not_divide_stay_replicated_and_correct(n_devices):
    if n_devices == 1:
        pytest.skip("needs several replicas")
    tx = optax.adam(1e-2)
    w = _width(n_devices)
    params = {"w": np.ones((w, 3), np.float32) * 0.1, "odd": np.ones((n_devices + 1,), np.float32)}

    def loss(p, x):
        return jnp.mean((x @ p["w"]) ** 2) + jnp.sum(p["odd"] ** 2) * jnp.mean(x)

    def step(state, batch):
        p, opt = state
        g = rp.all_mean(jax.grad(loss)(p, batch["x"]))
        upd, opt = tx.update(g, opt, p)
        return (optax.apply_updates(p, upd), opt), {}

    state = (params, tx.init(params))
    batches = _batches(n_devices, w)
    repl = rp.Replicator(1, n_devices, passes=_with_zero())
    after = repl.lower(step, batches[0], state).after("shard-optimizer-update")
    sharded_paths = {after.state_paths[i] for i in after.sharded_state}
    assert sharded_paths == {"state[1][0].mu['w']", "state[1][0].nu['w']"}
    _check_against_reference(repl, step, state, batches)


def test_shard_state_off_keeps_state_replicated(n_devices):
    tx = optax.adam(1e-2)
    _, state = _setup(n_devices, tx)
    repl = rp.Replicator(1, n_devices, passes=_with_zero(shard_state=False))
    lowered = repl.lower(_make_step(tx), _batches(n_devices, _width(n_devices))[0], state)
    after = lowered.after("shard-optimizer-update")
    assert after.sharded_state == frozenset()
    assert count_primitives(after.jaxpr, ["rp.reduce_scatter"])


def test_all_reduces_that_feed_no_state_update_are_left_alone(repl):
    n = repl.num_replicas

    def step(s, b):
        return s + 1.0, {"sum": rp.all_sum(b["x"]), "mean": rp.all_mean(b["x"]) * 2}

    graph = repl.lower(step, {"x": np.ones((n, n))}, jnp.zeros(4)).traced
    result = ShardOptimizerUpdate(min_tensor_bytes=0).run(graph)
    assert not result.changed and result.graph is graph


def test_nothing_to_do_without_gradient_all_reduce(repl):
    graph = repl.lower(lambda s, b: (s + 1.0, {}), {"x": np.ones(repl.num_replicas)}, jnp.zeros(4)).traced
    result = ShardOptimizerUpdate(min_tensor_bytes=0).run(graph)
    assert not result.changed and result.graph is graph
    assert repr(ShardOptimizerUpdate()) == "ShardOptimizerUpdate(shard_state=True, min_tensor_bytes=65536, stage=1)"


def test_momentum_also_returned_as_an_output_stays_replicated(n_devices):
    """ZeRO stores a leaf sharded only if its new value is returned once (as the new state).

    Momentum ``m`` (read only element-wise, updated from the reduce-scattered gradient) is
    sharded; ``k``, updated the same way but also returned as an output, stays whole.
    """
    if n_devices == 1:
        pytest.skip("needs several replicas")
    w = 2 * n_devices

    def step(state, batch):
        p, m, k = state
        g = rp.all_mean(batch["x"].T @ (batch["x"] @ p))  # a gradient-like all-reduce of a (w, 3) value
        m, k = 0.9 * m + g, 0.5 * k + g
        return (p - 0.1 * m - 0.1 * k, m, k), {"k": k}

    rng = np.random.default_rng(0)
    state = tuple((rng.normal(size=(w, 3)) * 0.1).astype(np.float32) for _ in range(3))
    batches = [{"x": rng.normal(size=(2 * n_devices, w)).astype(np.float32)} for _ in range(3)]
    repl = rp.Replicator(1, n_devices, passes=_with_zero())
    after = repl.lower(step, batches[0], state).after("shard-optimizer-update")
    assert {after.state_paths[i] for i in after.sharded_state} == {"state[1]"}
    check_against_simulation(repl, step, batches, state, atol=1e-6, rtol=1e-5)


def test_stage2_reduces_on_chunks_only_over_the_chunk_axis(n_devices):
    """Stage 2: a sum over the chunk axis of the reduce-scattered gradient is partial sums and an all-reduce;
    a sum over another axis (each row's sum) is not made of chunks: it reads the gradient whole."""
    if n_devices == 1:
        pytest.skip("needs several replicas")
    w = 2 * n_devices

    def step(state, batch):
        p, m = state
        g = rp.all_mean(batch["x"].T @ (batch["x"] @ p))
        m = 0.9 * m + g
        return (p - 0.1 * m, m), {"total": jnp.sum(g, axis=0), "rows": jnp.sum(g, axis=1)}

    rng = np.random.default_rng(0)
    state = tuple((rng.normal(size=(w, 3)) * 0.1).astype(np.float32) for _ in range(2))
    batches = [{"x": rng.normal(size=(2 * n_devices, w)).astype(np.float32)} for _ in range(3)]
    repl = rp.Replicator(1, n_devices, passes=_with_zero(stage=2))
    after = repl.lower(step, batches[0], state).after("shard-optimizer-update")
    assert count_primitives(after.jaxpr, ["rp.reduce_scatter", "rp.all_reduce"]) == {
        "rp.reduce_scatter": 1,  # the gradient
        "rp.all_reduce": 1,  # the partial sums over the chunk axis
    }
    check_against_simulation(repl, step, batches, state, atol=1e-6, rtol=1e-5)
