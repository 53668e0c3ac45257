"""cross_replica_batch_norm against single-device batch norm on the concatenated batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.training.nn import cross_replica_batch_norm

ROWS, C = 3, 4  # per replica; x is (ROWS, 2, C): statistics over two axes


def batch_norm(x, scale, offset, eps=1e-5):
    """The single-device reference."""
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(x, axis=axes)
    var = jnp.var(x, axis=axes)
    return (x - mean) / jnp.sqrt(var + eps) * scale + offset, mean, var


def data(n_replicas: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shape = (n_replicas * ROWS, 2, C)
    # An offset and a spread per feature, so that the normalization matters.
    x = rng.normal(loc=np.arange(C) - 1.0, scale=1.0 + np.arange(C), size=shape).astype(np.float32)
    return {"x": x, "t": rng.normal(size=shape).astype(np.float32)}


PARAMS = {"scale": jnp.linspace(0.5, 2.0, C), "offset": jnp.linspace(-1.0, 1.0, C)}


def _input_fn(batch):
    def input_fn(ctx):
        rows = batch["x"].shape[0] // ctx.num_workers
        while True:
            yield jax.tree.map(lambda a: a[ctx.worker_id * rows : (ctx.worker_id + 1) * rows], batch)

    return input_fn


def local_loss(params, x, t, group=None):
    y, mean, var = cross_replica_batch_norm(x, params["scale"], params["offset"], group=group)
    return jnp.mean(jnp.sin(y) * t), (y, mean, var)


def bn_step(group=None):
    def step_fn(params, batch):
        grad_fn = jax.value_and_grad(local_loss, argnums=(0, 1), has_aux=True)
        (loss, (y, mean, var)), (g_params, g_x) = grad_fn(params, batch["x"], batch["t"], group)
        outputs = {"y": y, "mean": mean, "var": var, "g_x": g_x, "g_params": rp.all_mean(g_params, group=group)}
        return params, outputs

    return step_fn


def reference(x, t):
    def loss(params, x):
        y, mean, var = batch_norm(x, params["scale"], params["offset"])
        return jnp.mean(jnp.sin(y) * t), (y, mean, var)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(PARAMS, x)


def close(got, want, atol=1e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=1e-5)


def test_forward_and_gradients_match_the_global_batch(repl):
    n = repl.num_replicas
    batch = data(n)
    params, out = repl.run(bn_step(), _input_fn(batch), PARAMS)
    (_, (y, mean, var)), (g_params, g_x) = reference(batch["x"], batch["t"])
    close(out["y"].reshape(y.shape), y)
    close(out["mean"], np.broadcast_to(mean, (n, C)))
    close(out["var"], np.broadcast_to(var, (n, C)))
    # Each replica's gradient of its own loss is that of the sum of all replicas'
    # losses; the reference loss is their mean.
    close(out["g_x"].reshape(g_x.shape), n * g_x)
    for name in ("scale", "offset"):
        close(out["g_params"][name], np.broadcast_to(g_params[name], (n, C)))
    for name in ("scale", "offset"):  # the state passes through unchanged
        np.testing.assert_array_equal(params[name], PARAMS[name])


def test_group_cores_normalizes_each_worker_separately(repl2d):
    if repl2d.num_workers < 2:
        pytest.skip("needs an even device count for two workers")
    n, workers = repl2d.num_replicas, repl2d.num_workers
    batch = data(n, seed=1)
    _, out = repl2d.run(bn_step(group="cores"), _input_fn(batch), PARAMS)
    rows = batch["x"].shape[0] // workers
    for w in range(workers):
        x, t = (batch[k][w * rows : (w + 1) * rows] for k in ("x", "t"))
        (_, (y, mean, var)), (g_params, g_x) = reference(x, t)
        mine = slice(w * repl2d.cores_per_worker, (w + 1) * repl2d.cores_per_worker)
        close(out["y"][mine].reshape(y.shape), y)
        close(out["mean"][mine], np.broadcast_to(mean, (repl2d.cores_per_worker, C)))
        close(out["var"][mine], np.broadcast_to(var, (repl2d.cores_per_worker, C)))
        close(out["g_x"][mine].reshape(g_x.shape), repl2d.cores_per_worker * g_x)
        for name in ("scale", "offset"):
            close(out["g_params"][name][mine], np.broadcast_to(g_params[name], (repl2d.cores_per_worker, C)))


def test_bfloat16_input_is_normalized_in_float32(repl):
    # Cast in the step: numpy bfloat16 batches are rejected by input validation (dtype kind 'V').
    batch = {"x": data(repl.num_replicas, seed=2)["x"].astype(jnp.bfloat16).astype(np.float32)}

    def step_fn(batch):
        x = batch["x"].astype(jnp.bfloat16)
        y, mean, var = cross_replica_batch_norm(x, PARAMS["scale"], PARAMS["offset"])
        return {"y": y, "mean": mean, "var": var}

    out = repl.run(step_fn, _input_fn(batch))
    assert out["y"].dtype == jnp.bfloat16 and out["mean"].dtype == jnp.float32
    y, mean, var = batch_norm(batch["x"], PARAMS["scale"], PARAMS["offset"])
    close(out["mean"][0], mean)
    close(out["var"][0], var)
    close(out["y"].astype(jnp.float32).reshape(y.shape), y, atol=2e-2)  # one bf16 rounding of y


def test_bad_arguments(repl):
    batch = data(repl.num_replicas)

    def lower(fn):
        return repl.lower(lambda b: fn(b["x"])[0], batch)

    with pytest.raises(ValueError, match=r"scale has shape \(3,\), but x has 4 features.*shape \(4,\)"):
        lower(lambda x: cross_replica_batch_norm(x, jnp.ones(3), jnp.zeros(C)))
    with pytest.raises(ValueError, match=r"needs a batch axis and a feature axis"):
        lower(lambda x: cross_replica_batch_norm(x[:, 0, 0], jnp.ones(()), jnp.zeros(())))
    with pytest.raises(TypeError, match="must be floating point"):
        lower(lambda x: cross_replica_batch_norm(x.astype(jnp.int32), jnp.ones(C), jnp.zeros(C)))
    with pytest.raises(ValueError, match="group must be None"):
        lower(lambda x: cross_replica_batch_norm(x, jnp.ones(C), jnp.zeros(C), group="rows"))
    with pytest.raises(RuntimeError, match="Replicator.run"):
        cross_replica_batch_norm(batch["x"], jnp.ones(C), jnp.zeros(C))
