"""The issue's goal: a ViT (examples/vit_pipeline.py's, Flax linen) trained by the user's own step on a
pipelined ``Replicator`` (4 stages x 2 data-parallel replicas, 8 devices), 3 Adam steps, against one device's
``jax.jit`` of the same step on the global batch (``rp.all_mean`` the identity there, the stage markers too).

The model is imported from the example by path, so the test and the example train the same network.

The second test is the bug the first found: a loss whose backward runs through an inlined ``jax.jit``
(``jax.nn.log_softmax`` in optax's cross-entropy, ``jax.nn.softmax`` in attention) lost its "under the
transpose" mark when ``PipelinedStep`` split the flattened forward-backward a second time, and was refused
as "an update phase" (``split._inline`` now keeps the call's name stack).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vit_pipeline.py"
STEPS = 3
TOLERANCE = 5e-5


def vit_module() -> ModuleType:
    """examples/vit_pipeline.py as a module (registered first: Flax's dataclasses look their module up)."""
    name = "vit_pipeline_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _assert_close(got, want, tol: float = TOLERANCE) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_vit_on_4_stages_x_2_replicas_matches_one_device(schedule):
    vit = vit_module()
    model = vit.ViT(stages=4, depth=4)  # stages: embedding + block 0, block 1, block 2, block 3 + head
    opt = optax.adam(1e-3)
    state0 = vit.init_state(model, opt)
    batches = [vit.synthetic_batch(step, size=32) for step in range(STEPS)]  # 4 micro-batches of 4 rows a replica
    repl = rp.Replicator(
        1, 8, devices=jax.devices()[:8], parallelism=rp.Parallelism(stages=4, microbatches=4, schedule=schedule)
    )
    step = vit.make_step(model, opt)
    state = state0
    for batch in batches:
        state, out = repl.run(step, batch, state)
    one_device = jax.jit(vit.make_step(model, opt, average=lambda x: x))
    want = state0
    for batch in batches:
        want, want_out = one_device(want, batch)
    _assert_close(state, want)  # the parameters and Adam's moments
    np.testing.assert_allclose(out["loss"], [want_out["loss"]] * 2, rtol=1e-5)


def _tanh_then_cross_entropy(p, x, y):
    h = rp.stage_boundary(jnp.tanh(x @ p["a"]))
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["b"], y).mean()


def test_a_cross_entropy_loss_in_the_users_step_matches_one_device():
    """The minimal form of the ViT's failure: two stages, the head's loss optax's cross-entropy."""
    rng = np.random.default_rng(0)
    p = {"a": rng.normal(size=(5, 4)).astype(np.float32), "b": rng.normal(size=(4, 3)).astype(np.float32)}
    batch = rng.normal(size=(8, 5)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)
    opt = optax.sgd(0.1)

    def step(state, batch, average=rp.all_mean):
        params, opt_state = state
        value, grads = jax.value_and_grad(_tanh_then_cross_entropy)(params, *batch)
        updates, opt_state = opt.update(average(grads), opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), average(value)

    repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))
    (got, _), _ = repl.run(step, batch, (p, opt.init(p)))
    (want, _), _ = jax.jit(lambda s, b: step(s, b, average=lambda x: x))((p, opt.init(p)), batch)
    _assert_close(got, want, tol=1e-6)
