"""Mixed precision and dynamic loss scaling on replicas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.training.precision import DynamicLossScale, MixedPrecision, all_finite, cast_floating, select_tree


def _input_fn(batches):
    def input_fn(ctx):
        yield from batches

    return input_fn


# -- bfloat16 compute against float32 ---------------------------------------------------

SIZES = (2, 32, 32, 1)


def init_mlp(seed: int = 0) -> list:
    keys = jax.random.split(jax.random.key(seed), len(SIZES) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for a, b, k in zip(SIZES[:-1], SIZES[1:], keys, strict=True)
    ]


def mlp(params: list, x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def regression_batch(step: int, rows: int) -> dict:
    rng = np.random.default_rng(step)
    x = rng.uniform(-2, 2, size=(rows, 2)).astype(np.float32)
    return {"x": x, "y": (np.sin(x[:, 0]) * np.cos(x[:, 1]))[:, None].astype(np.float32)}


def test_bf16_compute_tracks_float32(repl):
    """The tolerance stated in replicator.training.precision's docstring: 20 SGD steps."""
    steps, lr, rows = 20, 0.1, 8 * repl.num_replicas
    policy = MixedPrecision(compute_dtype=jnp.bfloat16, param_dtype=jnp.float32)
    tx = optax.sgd(lr)

    def scaled_loss(params, batch, loss_scale):
        out = mlp(policy.cast_to_compute(params), policy.cast_to_compute(batch["x"]))
        assert out.dtype == jnp.bfloat16
        loss = jnp.mean((policy.cast_to_output(out) - batch["y"]) ** 2)
        return loss_scale.scale_loss(loss), loss

    def step_fn(state, batch):
        params, opt_state, loss_scale = state
        grads, loss = jax.grad(scaled_loss, has_aux=True)(params, batch, loss_scale)
        grads = loss_scale.unscale_grads(policy.cast_to_param(grads))
        finite = all_finite(grads)
        updates, new_opt_state = tx.update(rp.all_mean(grads), opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = select_tree(finite, (new_params, new_opt_state), (params, opt_state))
        return (params, opt_state, loss_scale.update(finite)), {"loss": rp.all_mean(loss), "finite": finite}

    @jax.jit
    def f32_step(params, batch):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((mlp(p, batch["x"]) - batch["y"]) ** 2))(params)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    batches = [regression_batch(s, rows) for s in range(steps)]
    params0 = init_mlp()
    state = (params0, tx.init(params0), DynamicLossScale.create(2.0**8))
    ref, loss_diffs = params0, []
    input_fn = _input_fn(batches)
    for batch in batches:
        state, out = repl.run(step_fn, input_fn, state)
        ref, ref_loss = f32_step(ref, batch)
        assert bool(np.all(out["finite"]))
        loss_diffs.append(abs(float(out["loss"][0]) - float(ref_loss)))
    param_diff = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(state[0]), jax.tree.leaves(ref), strict=True)
    )
    # Measured: 5e-4 (parameters up to 1.8) and per-step losses within 2.3e-3.
    assert 1e-5 < param_diff < 2e-3, param_diff  # > 1e-5: bfloat16 really was used
    assert max(loss_diffs) < 1e-2, loss_diffs
    assert float(state[2].scale) == 2.0**8 and int(state[2].good_steps) == steps


# -- skipping non-finite steps on every replica --------------------------------------------


def test_inf_gradient_on_one_replica_skips_the_step_on_all(repl):
    n, bad = repl.num_replicas, repl.num_replicas // 2
    tx = optax.adam(0.1)

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

    def step_fn(state, batch):
        params, opt_state, loss_scale = state
        grads = jax.grad(lambda p: loss_scale.scale_loss(loss_fn(p, batch)))(params)
        grads = loss_scale.unscale_grads(grads)
        local = all_finite(grads, cross_replica=False)
        finite = all_finite(grads)  # before the all-reduce: needs the rp.all_min
        updates, new_opt_state = tx.update(rp.all_mean(grads), opt_state, params)
        new = (optax.apply_updates(params, updates), new_opt_state)
        params, opt_state = select_tree(finite, new, (params, opt_state))
        return (params, opt_state, loss_scale.update(finite, period=2)), {"local": local, "finite": finite}

    rng = np.random.default_rng(0)
    good = {"x": rng.normal(size=(2 * n, 3)).astype(np.float32), "y": rng.normal(size=2 * n).astype(np.float32)}
    poisoned = jax.tree.map(np.copy, good)
    poisoned["x"][2 * bad, 1] = np.inf  # one row of one replica
    params = {"w": jnp.ones(3), "b": jnp.float32(0.5)}
    state0 = (params, tx.init(params), DynamicLossScale.create(2.0**10))
    input_fn = _input_fn([poisoned, good, good, good])

    state, out = repl.run(step_fn, input_fn, state0)
    np.testing.assert_array_equal(out["local"], np.arange(n) != bad)  # only one replica saw the inf
    np.testing.assert_array_equal(out["finite"], np.zeros(n, bool))  # every replica skipped
    for got, want in zip(jax.tree.leaves(state[:2]), jax.tree.leaves(state0[:2]), strict=True):
        np.testing.assert_array_equal(got, want)  # params and adam state (count too) unchanged
    assert float(state[2].scale) == 2.0**9 and int(state[2].good_steps) == 0

    state, out = repl.run(step_fn, input_fn, state)  # a normal step: applied, scale kept
    assert bool(np.all(out["finite"])) and int(state[1][0].count) == 1
    assert not np.allclose(state[0]["w"], params["w"])
    assert float(state[2].scale) == 2.0**9 and int(state[2].good_steps) == 1
    state, _ = repl.run(step_fn, input_fn, state)  # the period (2) is reached: the scale grows
    assert float(state[2].scale) == 2.0**10 and int(state[2].good_steps) == 0
    state, _ = repl.run(step_fn, input_fn, state)
    assert float(state[2].scale) == 2.0**10 and int(state[2].good_steps) == 1


# -- DynamicLossScale on its own --------------------------------------------------------------


def test_loss_scale_update_rules():
    update = jax.jit(lambda ls, finite: ls.update(finite, period=3, factor=4.0, min_scale=2.0))
    ls = DynamicLossScale.create(64.0)
    history = []
    for finite in [True, True, True, True, False, False, False, False]:
        ls = update(ls, jnp.bool_(finite))
        history.append((float(ls.scale), int(ls.good_steps)))
    assert history == [(64, 1), (64, 2), (256, 0), (256, 1), (64, 0), (16, 0), (4, 0), (2, 0)]
    assert ls.scale.dtype == jnp.float32 and ls.good_steps.dtype == jnp.int32
    huge = DynamicLossScale(jnp.float32(3e38), jnp.int32(0)).update(jnp.bool_(True), period=1)
    assert float(huge.scale) == np.float32(3e38)  # growing would overflow float32: kept


def test_loss_scale_scales_and_unscales():
    ls = DynamicLossScale.create(8.0)
    assert float(ls.scale_loss(jnp.float32(0.5))) == 4.0
    assert ls.scale_loss(jnp.ones((), jnp.bfloat16)).dtype == jnp.bfloat16
    grads = {"w": jnp.full(2, 8.0, jnp.bfloat16), "step": jnp.int32(3)}
    out = ls.unscale_grads(grads)
    assert out["w"].dtype == jnp.bfloat16 and float(out["w"][0]) == 1.0 and int(out["step"]) == 3


def test_check_raises_when_stuck_at_the_minimum_scale():
    at_min = DynamicLossScale.create(1.0)
    at_min.check(np.ones(4, bool))  # finite: fine
    DynamicLossScale.create(4.0).check(np.array([True, False]))  # skipped, but can still shrink
    with pytest.raises(FloatingPointError, match=r"minimum 1: lowering it cannot make them finite.*learning rate"):
        at_min.check(np.array([True, False]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="initial_scale must be positive"):
        DynamicLossScale.create(0.0)
    ls = DynamicLossScale.create()
    with pytest.raises(ValueError, match="factor > 1"):
        ls.update(jnp.bool_(True), factor=1.0)
    with pytest.raises(TypeError, match="grads_finite must be a bool scalar.*all_finite"):
        ls.update(jnp.ones(3, bool))
    with pytest.raises(TypeError, match="pred must be a bool scalar"):
        select_tree(jnp.float32(1), 1.0, 2.0)
    with pytest.raises(ValueError, match="different structures"):
        select_tree(jnp.bool_(True), (1.0,), [1.0])
    with pytest.raises(ValueError, match=r"leaves differ \(float32\[3\] vs int32\[3\]\)"):
        select_tree(jnp.bool_(True), jnp.zeros(3), jnp.zeros(3, jnp.int32))
    with pytest.raises(RuntimeError, match="Replicator.run"):
        all_finite(jnp.ones(2))


# -- the dtype policy ----------------------------------------------------------------------------


def test_mixed_precision_casts_only_floats():
    policy = MixedPrecision(compute_dtype=jnp.float16)
    tree = {"w": jnp.ones(2), "n": jnp.int32(1), "mask": jnp.array([True]), "h": np.ones(2, np.float64)}
    compute = policy.cast_to_compute(tree)
    assert compute["w"].dtype == jnp.float16 and compute["h"].dtype == jnp.float16
    assert compute["n"].dtype == jnp.int32 and compute["mask"].dtype == jnp.bool_
    assert policy.cast_to_param(compute)["w"].dtype == jnp.float32
    assert policy.cast_to_output(compute)["w"].dtype == jnp.float32
    assert MixedPrecision(output_dtype=jnp.bfloat16).cast_to_output(tree)["w"].dtype == jnp.bfloat16
    assert cast_floating(1.5, jnp.bfloat16).dtype == jnp.bfloat16
    assert bool(all_finite({"a": jnp.ones(2), "b": jnp.int32(1)}, cross_replica=False))
    assert not bool(all_finite([jnp.array([1.0, jnp.nan])], cross_replica=False))
    with pytest.raises(TypeError, match="floating-point dtype"):
        MixedPrecision(compute_dtype=jnp.int8)
