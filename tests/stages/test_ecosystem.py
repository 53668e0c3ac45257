"""Pipelines with the ecosystem a user trains with: Equinox, ``jax.checkpoint``, bfloat16 mixed precision,
``optax.MultiSteps`` gradient accumulation, Flax ``nn.scan`` stacks, and ZeRO options. Each runs the user's own
data-parallel step (``value_and_grad``, ``rp.all_mean(grads)``, an optax update) with ``Replicator.run`` on 8
emulated devices, against one device's ``jax.jit`` of the same step on the global batch (``rp.all_mean`` and
the markers are the identity there)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.stages import StageSplitError
from tests.stages.test_user_step import make_step

STEPS = 3
TOLERANCE = 5e-5
# Both schedules where it is cheap; the other tests take one each (both covered across the file), as each
# pipelined step compiles for seconds on the emulated devices.
SCHEDULES = pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])


def train(
    loss: Callable,
    opt: optax.GradientTransformation,
    params: Any,
    batch: tuple,
    *,
    stages: int,
    microbatches: int,
    schedule: str,
    steps: int = STEPS,
) -> tuple[Any, Any, list, list]:
    """``steps`` steps on ``stages`` x ``8 / stages`` replicas and on one device: (state, one device's, losses)."""
    repl = rp.Replicator(
        1,
        8,
        devices=jax.devices()[:8],
        parallelism=rp.Parallelism(stages=stages, microbatches=microbatches, schedule=schedule),
    )
    state, values = (params, opt.init(params)), []
    for _ in range(steps):
        state, out = repl.run(make_step(loss, opt), batch, state)
        values.append(float(out["loss"][0]))
    one_device = jax.jit(make_step(loss, opt, mean=False))
    want, want_values = (params, opt.init(params)), []
    for _ in range(steps):
        want, out = one_device(want, batch)
        want_values.append(float(out["loss"]))
    return state, want, values, want_values


def assert_close(got: Any, want: Any, tol: float = TOLERANCE) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


def regression_batch(rows: int = 32, features: int = 4, out: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets whose first half pulls apart from the second: each replica must take its own rows."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    y = rng.normal(size=(rows, out)).astype(np.float32)
    y[: rows // 2] += 2.0
    return x, y


def dense_params(sizes: list[int], seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"w{i}": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
    }


# 1. Equinox: a list of eqx.nn.Linear layers, a marker between each two, the arrays partitioned from the statics.


def _equinox_model() -> tuple[Any, Any]:
    keys = jax.random.split(jax.random.key(0), 4)
    sizes = [4, 8, 8, 8, 2]
    layers = [eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys, strict=True)]
    return eqx.partition(layers, eqx.is_array)


def test_an_equinox_model_in_4_stages_matches_one_device():
    params, static = _equinox_model()

    def loss(params, x, y):
        layers = eqx.combine(params, static)
        h = x
        for layer in layers[:-1]:
            h = rp.stage_boundary(jnp.tanh(jax.vmap(layer)(h)))
        return jnp.mean((jax.vmap(layers[-1])(h) - y) ** 2)

    state, want, values, want_values = train(
        loss, optax.adam(1e-2), params, regression_batch(), stages=4, microbatches=4, schedule="1f1b"
    )
    assert_close(state, want)  # the Linear layers' weights and biases, Adam's moments
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


# 2. jax.checkpoint around a layer inside a stage.


@SCHEDULES
def test_a_checkpointed_layer_inside_a_stage_matches_one_device(schedule):
    @jax.checkpoint
    def layer(w, h):
        return jnp.tanh(h @ w)

    def loss(p, x, y):
        h = layer(p["w0"], x)
        h = rp.stage_boundary(layer(p["w1"], h))  # stage 0: two layers, each recomputed in the backward
        h = layer(p["w2"], h)  # stage 1
        return jnp.mean((h @ p["w3"] - y) ** 2)

    params = dense_params([4, 8, 8, 8, 2])
    state, want, values, want_values = train(
        loss, optax.adam(1e-2), params, regression_batch(), stages=2, microbatches=2, schedule=schedule
    )
    assert_close(state, want)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


# 3. Mixed precision: float32 master parameters, the forward in bfloat16, the loss in float32.

# bfloat16 rounds to 2**-8 = 4e-3 relative; the micro-batches' products round differently from the global batch's
# (measured: 2e-4 apart after 3 steps, as far as a float32 forward is from the bfloat16 one). Half a bfloat16 unit
# on these O(1) parameters: a step more or less (3e-2 apart) or a replica on the wrong rows fails it.
BF16_TOLERANCE = 2e-3


def _bf16_loss(p, x, y):
    half = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p)
    h = jnp.tanh(x.astype(jnp.bfloat16) @ half["w0"])
    h = rp.stage_boundary(h)  # a bfloat16 activation crosses the boundary (and its bfloat16 gradient back)
    assert h.dtype == jnp.bfloat16
    h = jnp.tanh(h @ half["w1"])
    out = (h @ half["w2"]).astype(jnp.float32)
    return jnp.mean((out - y) ** 2)


def test_a_bfloat16_forward_on_float32_parameters_matches_one_device():
    params = dense_params([4, 8, 8, 2])
    opt = optax.sgd(0.1)
    state, want, values, want_values = train(
        _bf16_loss, opt, params, regression_batch(), stages=2, microbatches=2, schedule="gpipe"
    )
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state[0]))  # the master copy stays float32
    assert_close(state, want, tol=BF16_TOLERANCE)
    np.testing.assert_allclose(values, want_values, rtol=BF16_TOLERANCE)
    moved = max(float(np.max(np.abs(state[0][k] - params[k]))) for k in params)
    assert moved > 20 * BF16_TOLERANCE  # the steps move the parameters well past the tolerance


# 4. Gradient accumulation with optax.MultiSteps: an Adam step every 2 calls.


def test_optax_multisteps_gradient_accumulation_matches_one_device():
    def loss(p, x, y):
        h = rp.stage_boundary(jnp.tanh(x @ p["w0"]))
        return jnp.mean((jnp.tanh(h @ p["w1"]) @ p["w2"] - y) ** 2)

    opt = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    params = dense_params([4, 8, 8, 2])
    state, want, values, want_values = train(
        loss, opt, params, regression_batch(), stages=2, microbatches=4, schedule="gpipe", steps=4
    )
    assert_close(state, want)  # parameters, the accumulated gradients, the counters, Adam's moments
    np.testing.assert_allclose(values, want_values, rtol=1e-5)
    assert int(state[1].gradient_step) == 2


# 5. Flax linen with nn.scan stacks of identical layers: markers go between the stacks, never inside one.


class _Layer(nn.Module):
    marked: bool = False

    @nn.compact
    def __call__(self, h, _):
        h = jnp.tanh(nn.Dense(h.shape[-1])(h))
        if self.marked:
            h = rp.stage_boundary(h)  # <- inside the scanned body
        return h, None


class _Stack(nn.Module):
    """``layers`` identical layers under ``lax.scan`` (``nn.scan``), their parameters stacked."""

    layers: int
    marked: bool = False

    @nn.compact
    def __call__(self, h):
        scanned = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
        h, _ = scanned(marked=self.marked, name="scan")(h, None)  # <- the loop
        return h


class _TwoStacks(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x)
        h = rp.stage_boundary(_Stack(2)(h))  # the boundary between the two stacks
        return nn.Dense(2)(_Stack(2)(h))


def test_a_marker_between_two_flax_scan_stacks_matches_one_device():
    model = _TwoStacks()
    x, y = regression_batch()
    params = model.init(jax.random.key(0), x[:1])

    def loss(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    state, want, values, want_values = train(
        loss, optax.adam(1e-2), params, (x, y), stages=2, microbatches=2, schedule="1f1b"
    )
    assert_close(state, want)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


def _marked_lines(*objects: Any) -> list[int]:
    """The line numbers in this file of the lines of ``objects`` tagged ``# <-``."""
    lines = []
    for obj in objects:
        source, start = inspect.getsourcelines(obj)
        lines += [start + i for i, text in enumerate(source) if text.rstrip().endswith("# <-") or "# <- " in text]
    return lines


def _refusal_of_a_marker_in_a_scan_body() -> str:
    model = _Stack(2, marked=True)
    x, y = regression_batch(features=8, out=8)
    params = model.init(jax.random.key(0), x[:1])

    def loss(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    opt = optax.sgd(0.1)
    repl = rp.Replicator(1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=2, microbatches=2))
    with pytest.raises(StageSplitError) as info:
        repl.run(make_step(loss, opt), (x, y), (params, opt.init(params)))
    return str(info.value)


def test_a_marker_inside_a_flax_scan_body_is_refused_naming_its_line():
    message = _refusal_of_a_marker_in_a_scan_body()
    (marker,) = _marked_lines(_Layer.__call__)
    assert f"rp.stage_boundary at {__file__}:{marker} " in message, message
    assert "is inside the loop (lax.fori_loop / lax.scan / lax.map) at" in message
    assert "mark the boundaries between layers outside the scan" in message


def test_the_refusal_names_the_users_nn_scan_call_as_the_loop():
    message = _refusal_of_a_marker_in_a_scan_body()
    (loop,) = _marked_lines(_Stack.__call__)
    assert f"is inside the loop (lax.fori_loop / lax.scan / lax.map) at {__file__}:{loop} " in message, message


# 6. ZeRO on each stage's data-parallel replicas: passes=rp.PassManager.default(zero=k), through run_pipelined.


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_zero_passes_on_a_pipelined_replicator_shard_each_stages_rows(zero_stage):
    passes = rp.PassManager.default(zero=zero_stage)
    repl = rp.Replicator(
        1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=2, microbatches=2), passes=passes
    )
    assert repl.pipelined.zero_stage == zero_stage
    assert f"zero={zero_stage}" in repr(repl.pipelined)
