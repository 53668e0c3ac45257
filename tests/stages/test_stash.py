"""What a stage stashes per micro-batch: its activations, never a copy of its weights (issue #41, item 1).

A stacked ``lax.scan`` cut into stages reads its weights through a slice of the stack, a value of the
parameters alone: before, every stage stashed that slice for every micro-batch (GPipe held ``M`` copies of the
stage's weights), and a scan's stacked carry-in beside its carry-out (the same activations twice). The
reference is the same network written with one leaf per layer, whose stash is its activations; the stacked
form must stash the same bytes (JAX 0.10's scan keeps its stacked carry-in and carry-out, 0.12's the carry-in
alone: both are rebuilt from the scan's initial carry), under ``run_pipelined`` and the user's own step, on both schedules, and
``describe_pipeline``/``explain`` report it as activations. The backward's rebuild of the carry-in (a reversed
scan, a carry initialised from the parameters) is checked against ``jax.value_and_grad`` on one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.stages import split_scan, split_stages
from replicator.stages.lower import pipeline_value_and_grad
from replicator.stages.stash import stash_plan

LAYERS, WIDTH, ROWS, M, S = 4, 16, 4, 4, 2
TX = optax.sgd(0.1)


def _params(stacked: bool) -> dict | list:
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
    b = (0.1 * rng.normal(size=(LAYERS, WIDTH))).astype(np.float32)
    return {"w": w, "b": b} if stacked else [{"w": w[i], "b": b[i]} for i in range(LAYERS)]


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return tuple(rng.normal(size=(ROWS * M, WIDTH)).astype(np.float32) for _ in range(2))


def stacked_loss(p, x, y):
    h, _ = jax.lax.scan(lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None), x, (p["w"], p["b"]))
    return jnp.mean((h - y) ** 2)


def leaves_loss(p, x, y):
    h = x
    for i, layer in enumerate(p):
        h = jnp.tanh(h @ layer["w"] + layer["b"])
        if i == LAYERS // S - 1:
            h = rp.stage_boundary(h)
    return jnp.mean((h - y) ** 2)


def _replicator(schedule: str) -> rp.Replicator:
    return rp.Replicator(
        1, S, devices=jax.devices()[:S], parallelism=rp.Parallelism(stages=S, microbatches=M, schedule=schedule)
    )


def _user_step(loss):
    def step(state, batch):
        (params, opt), (x, y) = state, batch
        value, grads = jax.value_and_grad(loss)(params, x, y)
        grads = rp.all_mean(grads)
        updates, opt = TX.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), value

    return step


def _report(entry: str, schedule: str, loss, params):
    repl, batch, state = _replicator(schedule), _batch(), (params, TX.init(params))
    if entry == "run_pipelined":
        report = repl.describe_pipeline(loss, TX, batch, state)
        _, value = repl.run_pipelined(loss, TX, batch, state)
    else:
        report = repl.explain(_user_step(loss), batch, state)
        _, value = repl.run(_user_step(loss), batch, state)
    assert np.isfinite(float(np.asarray(value).reshape(-1)[0]))  # the stash it reports runs
    return report


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("entry", ["run_pipelined", "user step"])
def test_a_stacked_stage_stashes_what_one_leaf_per_layer_stashes(entry, schedule):
    stacked = _report(entry, schedule, stacked_loss, _params(True))
    leaves = _report(entry, schedule, leaves_loss, _params(False))
    per_layer = ROWS * WIDTH * 4  # one layer's activation, float32
    weights = (LAYERS // S) * WIDTH * WIDTH * 4  # a stage's slice of the stack
    for mine, reference in zip(stacked.per_stage, leaves.per_stage, strict=True):
        assert reference.residual_bytes >= 2 * (LAYERS // S) * per_layer - per_layer  # activations, not nothing
        assert mine.residual_bytes == reference.residual_bytes, (mine, reference)
        assert mine.stash_activation_bytes == mine.residual_bytes and mine.stash_other_bytes == 0
        assert mine.residual_bytes < weights  # no copy of the weights (it was weights + 3 stacks of activations)
        assert mine.recomputed_bytes >= weights  # the slice is read again in the backward, and reported so
        assert reference.recomputed_bytes == 0
    assert "stash/micro-batch: activations" in str(stacked) and "read again from the parameters" in str(stacked)


def _split(loss, params, x, y):
    closed = jax.make_jaxpr(jax.value_and_grad(split_scan(loss, S)))(params, x, y)
    return split_stages(closed, first_batch=len(jax.tree.leaves(params)))


def test_no_stashed_value_has_the_shape_of_a_weight():
    params, (x, y) = _params(True), _batch()
    split = _split(stacked_loss, params, x[:ROWS], y[:ROWS])
    plans = [stash_plan(split, stage) for stage in range(S)]
    for plan in plans:
        shapes = {tuple(v.aval.shape) for v in plan.kept}
        assert (LAYERS // S, WIDTH, WIDTH) not in shapes and (WIDTH, WIDTH) not in shapes, shapes
        assert {tuple(v.aval.shape) for v in plan.recomputed} >= {(LAYERS // S, WIDTH, WIDTH)}
    assert plans[0].rebuilt  # the scan's stacked carry-in, rebuilt from the micro-batch (and its carry-out)


def reversed_loss(p, x, y):
    """A reversed scan whose carry starts from the parameters (a bias) plus the micro-batch, and a second carry
    that starts from the parameters alone; the backward reads both carries as they came in and went out."""

    def layer(carry, wb):
        h, acc = carry
        h = jnp.tanh(h @ wb[0] + wb[1])
        return (h, jnp.tanh(acc * h)), None

    init = (x + p["b"][0], jnp.broadcast_to(p["b"][1], x.shape))
    (h, acc), _ = jax.lax.scan(layer, init, (p["w"], p["b"]), reverse=True)
    return jnp.mean((h - y) ** 2) + jnp.mean(acc**2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b-fused"])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_rebuilt_carries_give_one_devices_gradients(schedule, recompute):
    params, (x, y) = {k: jnp.asarray(v) for k, v in _params(True).items()}, _batch()
    split = _split(reversed_loss, params, x[:ROWS], y[:ROWS])
    assert any(stash_plan(split, s).rebuilt for s in range(S))  # the case is the one it means to check
    f = pipeline_value_and_grad(
        split_scan(reversed_loss, S),
        num_microbatches=M,
        schedule=schedule,
        devices=jax.devices()[:S],
        recompute=recompute,
    )
    value, grads = f(params, x, y)
    want_value, want = jax.value_and_grad(reversed_loss)(params, x, y)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for k in want:
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-4, atol=1e-6)


def test_the_issues_figure_a_stacked_8x512_stage_stashes_its_activations():
    # Issue #41's reproduction, traced and split only (nothing compiled): 8 tanh layers of 512, one stacked
    # scan, 2 stages, M = 8, 16 rows per micro-batch. Each stage stashed 4.4 MiB per micro-batch (its 4 MiB
    # slice of the weights and its activations); one leaf per layer stashes 0.25-0.31 MiB.
    layers, width, rows, m = 8, 512, 16, 8
    stacked = {"w": np.zeros((layers, width, width), np.float32), "b": np.zeros((layers, width), np.float32)}
    x = np.zeros((rows * m, width), np.float32)

    def loss_by_layer(p, x, y):
        h = x
        for i, layer in enumerate(p):
            h = jnp.tanh(h @ layer["w"] + layer["b"])
            h = rp.stage_boundary(h) if i == layers // 2 - 1 else h
        return jnp.mean((h - y) ** 2)

    by_layer = [{"w": stacked["w"][i], "b": stacked["b"][i]} for i in range(layers)]
    for schedule in ("gpipe", "1f1b"):
        repl = rp.Replicator(
            1, S, devices=jax.devices()[:S], parallelism=rp.Parallelism(stages=S, microbatches=m, schedule=schedule)
        )
        got = repl.describe_pipeline(stacked_loss, TX, (x, x), (stacked, TX.init(stacked)))
        want = repl.describe_pipeline(loss_by_layer, TX, (x, x), (by_layer, TX.init(by_layer)))
        assert [r.residual_bytes for r in got.per_stage] == [r.residual_bytes for r in want.per_stage]
        assert max(r.residual_bytes for r in got.per_stage) <= 0.32 * 2**20
