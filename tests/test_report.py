"""Replicator.explain: the communication report of a step."""

import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp


def _params(layers=4, width=8):
    return {f"w{i}": jnp.ones((width, width)) for i in range(layers)} | {
        f"b{i}": jnp.ones(width) for i in range(layers)
    }


def _loss(p, x):
    for i in range(len(p) // 2):
        x = jnp.tanh(x @ p[f"w{i}"] + p[f"b{i}"])
    return jnp.mean(x**2)


def _step(p, b):
    loss, g = jax.value_and_grad(_loss)(p, b["x"])
    g = rp.all_mean(g)
    feats = rp.all_gather(b["x"][:, :2], tiled=True)
    return jax.tree.map(lambda a, d: a - 0.1 * d, p, g), {"loss": rp.all_mean(loss), "f": feats.sum()}


def _batch(n, width=8):
    return {"x": np.ones((2 * n, width), np.float32)}


def test_fused_gradients_are_one_row_carrying_every_tensor(n_devices):
    n = n_devices
    repl = rp.Replicator(1, n, passes=rp.Pipeline.default(shard_optimizer=False))
    report = repl.explain(_step, _batch(n), _params())
    kinds = [r.kind for r in report.rows]
    assert kinds == ["all_mean", "all_gather"]
    grads = report.rows[0]
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(_params()))
    assert grads.tensors == len(_params()) + 1  # every gradient and the loss
    assert grads.nbytes == param_bytes + 4
    assert np.isclose(grads.sent_bytes, 2 * (n - 1) / n * grads.nbytes)
    gather = report.rows[1]
    assert gather.nbytes == 2 * 2 * 4 and np.isclose(gather.sent_bytes, (n - 1) * gather.nbytes)
    assert np.isclose(report.total_sent_bytes, grads.sent_bytes + gather.sent_bytes)
    text = str(report)
    assert "all_mean" in text and "test_report.py" in text and f"on {n} replicas" in text


def test_zero_rows_reduce_scatter_gradients_and_gather_parameters(n_devices):
    n = n_devices
    # Plain SGD has no optimizer state to shard: ZeRO's update splitting alone (shard_state=False).
    passes = rp.passes.default_passes()
    passes.insert(2, rp.passes.ShardOptimizerUpdate(shard_state=False, min_tensor_bytes=0))
    zero = rp.Pipeline(passes)
    report = rp.Replicator(1, n, passes=zero).explain(_step, _batch(n, width=n), _params(width=n))
    rows = {r.kind: r for r in report.rows if r.kind in ("reduce_scatter", "all_mean")}
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(_params(width=n)))
    scatter = rows["reduce_scatter"]
    assert scatter.nbytes == param_bytes and scatter.tensors == len(_params())
    assert np.isclose(scatter.sent_bytes, (n - 1) / n * param_bytes)
    gathers = [r for r in report.rows if r.kind == "all_gather" and r.tensors == len(_params())]
    assert len(gathers) == 1 and gathers[0].nbytes * n == param_bytes
    assert rows["all_mean"].nbytes == 4  # only the loss is still all-reduced


def test_without_fusion_each_user_collective_is_a_row(n_devices):
    repl = rp.Replicator(1, n_devices, passes=rp.Pipeline.default(disable=["fuse-allreduce"], shard_optimizer=False))
    report = repl.explain(_step, _batch(n_devices), _params())
    assert [r.kind for r in report.rows] == ["all_mean", "all_gather", "all_mean"]
    assert report.rows[0].tensors == len(_params())
    assert "fuse-allreduce" not in report.passes


def test_explain_draws_from_a_fresh_input_iterator(repl):
    n = repl.num_replicas
    drawn = []

    def input_fn(ctx):
        for i in range(3):
            drawn.append(i)
            yield _batch(n)

    repl.explain(_step, input_fn, _params())
    assert drawn == [0]
    # run() still starts from the first batch of its own iterator.
    repl.run(_step, input_fn, _params())
    assert drawn == [0, 0]


def test_groups_use_their_own_size(repl2d):
    def step(b):
        return rp.all_sum(b["x"], group="cores"), rp.replica_id()

    report = repl2d.explain(step, _batch(repl2d.num_replicas))
    row = report.rows[0]
    c = repl2d.cores_per_worker
    assert row.group == "cores" and np.isclose(row.sent_bytes, 2 * (c - 1) / c * row.nbytes)
    assert report.rows[1].kind == "replica_id" and report.rows[1].sent_bytes == 0
    assert report.num_collectives == 1
