"""A small MLP training step shared by the pass tests (odd sizes that need padding)."""

import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp


def input_fn_from(make_batch, seed: int = 0):
    """An ``input_fn`` whose every worker yields its own stream ``make_batch(rng)``."""

    def input_fn(ctx):
        rng = np.random.default_rng((seed, ctx.worker_id))
        while True:
            yield make_batch(rng)

    return input_fn


def mlp_params(rng: np.random.Generator) -> dict:
    """Odd sizes (the fused buffer needs padding to a multiple of the cores)."""
    return {
        "w1": jnp.asarray(rng.normal(0, 0.5, (3, 5)), jnp.float32),
        "b1": jnp.asarray(rng.normal(0, 0.1, (5,)), jnp.float32),
        "w2": jnp.asarray(rng.normal(0, 0.5, (5, 7)), jnp.float32),
        "b2": jnp.asarray(rng.normal(0, 0.1, (7,)), jnp.float32),
        "steps": jnp.int32(0),
    }


def mlp_step(state: dict, batch: dict) -> tuple:
    def loss_fn(p):
        h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - batch["y"]) ** 2)

    params = {k: v for k, v in state.items() if k != "steps"}
    loss, grads = jax.value_and_grad(loss_fn)(params)
    grads = rp.all_mean(grads)
    new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    new["steps"] = state["steps"] + rp.all_sum(jnp.int32(1)) // rp.num_replicas()
    return new, {
        "loss": rp.all_mean(loss),
        "big": rp.all_max(loss > 1.0),
        "rows": rp.all_sum(jnp.sum(batch["x"] > 0).astype(jnp.int32)),  # int32, varies
    }


def mlp_batch(cores: int):
    """``make_batch`` for :func:`input_fn_from`: a worker batch for :func:`mlp_step`."""
    return lambda rng: {
        "x": rng.normal(size=(2 * cores, 3)).astype(np.float32),
        "y": rng.normal(size=(2 * cores, 7)).astype(np.float32),
    }


def train_mlp(repl, state: dict, steps: int = 2) -> tuple:
    """``steps`` of :func:`mlp_step` on ``repl``; the final state and outputs."""
    input_fn = input_fn_from(mlp_batch(repl.cores_per_worker), seed=7)
    for _ in range(steps):
        state, out = repl.run(mlp_step, input_fn, state)
    return state, out
