"""Pipelines whose stages have a square data-parallel grid (``'workers'`` and ``'cores'`` of one size), against a
one-device ``jax.jit`` reference that computes every replica's rows and every group's statistics explicitly.

On a square grid a collective over ``'workers'`` taken for one over ``'cores'`` (or the replicas' chunks of a
ZeRO row gathered in the other axis order) keeps every shape: only the numbers tell. The losses here make the two
groups give different numbers (each replica's rows are shifted by its own offset), so such a swap shows.

Replica ``r = w * C + c`` (worker ``w``, core ``c`` of its stage's ``W x C`` grid) takes the ``r``-th contiguous
``1/D`` of the global batch's rows and cuts it into ``M`` micro-batches (``train._micro_batches``); a collective in
the loss runs over the replicas of its group on the micro-batch at hand. The reference reshapes the global batch
as ``(W, C, M, rows, features)`` and takes each group's mean over its axis of that array.

With 8 devices: 2 stages within each worker of a ``2 x 4`` Replicator, a ``2 x 2`` grid per stage. With
``REPLICATOR_TEST_DEVICES=16`` also 4 stages of ``2 x 2``: within each worker of ``2 x 8``, and across the workers
of ``8 x 2``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.stages import StageSplitError
from replicator.stages.replicas import pipeline_mesh
from tests.stages.test_train import _assert_close

STEPS = 3
ROWS = 3  # rows per replica per micro-batch
FEATURES = 3
OUT = 2


def _grid(workers: int, cores: int, stages: int, m: int):
    needed = workers * cores
    marks = pytest.mark.skipif(
        needed > jax.device_count(), reason=f"needs {needed} devices (REPLICATOR_TEST_DEVICES={needed})"
    )
    return pytest.param(workers, cores, stages, m, id=f"{workers}x{cores}-S{stages}-M{m}", marks=marks)


# (num_workers, cores_per_worker, S, M): every one a 2 x 2 data-parallel grid per stage.
SQUARE = [
    _grid(2, 4, 2, 2),  # stages within a worker
    _grid(2, 8, 4, 4),  # stages within a worker, 16 devices
    _grid(8, 2, 4, 4),  # stages across workers, 16 devices
]


def _replicator(workers: int, cores: int, stages: int, m: int, **options) -> rp.Replicator:
    repl = rp.Replicator(
        workers,
        cores,
        devices=jax.devices()[: workers * cores],
        parallelism=rp.Parallelism(stages=stages, microbatches=m),
        **options,
    )
    assert dict(repl.pipelined.mesh.shape) == {"stages": stages, "workers": 2, "cores": 2}
    return repl


def _groups(stage: int) -> tuple[str, str]:
    """The groups of a stage's mean and variance: ``('cores', 'workers')`` on even stages, reversed on odd ones."""
    return ("cores", "workers") if stage % 2 == 0 else ("workers", "cores")


def _stacked_loss(stages: int, after: Callable[[jax.Array, int], jax.Array]) -> Callable:
    """A ``tanh`` layer per stage, ``after(h, stage)`` applied to its output, a boundary between stages, and a
    squared error of a linear head."""

    def loss(p, x, y):
        h = x
        for s in range(stages):
            if s:
                h = rp.stage_boundary(h)
            h = after(jnp.tanh(h @ p[f"w{s}"]), s)
        return jnp.mean((h @ p["head"] - y) ** 2)

    return loss


def _group_norm(h: jax.Array, stage: int) -> jax.Array:
    first, second = _groups(stage)
    mu = rp.all_mean(jnp.mean(h, 0), group=first)
    var = rp.all_mean(jnp.mean((h - mu) ** 2, 0), group=second)
    return (h - mu) / jnp.sqrt(var + 0.5)


def group_norm_loss(stages: int) -> Callable:
    """A layer per stage, each normalised with a mean over one group and a variance over the other."""
    return _stacked_loss(stages, _group_norm)


def _group_mean(stat: jax.Array, group: str) -> jax.Array:
    """``stat`` of shape ``(W, C, M, 1, F)`` (per replica and micro-batch) averaged over the replicas of ``group``."""
    return jnp.mean(stat, axis={"workers": 0, "cores": 1}[group], keepdims=True)


def reference_group_norm_loss(stages: int, m: int, swap: bool = False) -> Callable:
    """:func:`group_norm_loss` on the global batch, all ``2 x 2`` replicas explicit: their mean loss.
    ``swap``: the groups exchanged (what a mix-up of the axes would compute)."""

    def loss(p, x, y):
        h = x.reshape(2, 2, m, -1, x.shape[-1])  # (workers, cores, micro-batch, rows, features)
        for s in range(stages):
            h = jnp.tanh(h @ p[f"w{s}"])
            first, second = _groups(s)[::-1] if swap else _groups(s)
            mu = _group_mean(jnp.mean(h, 3, keepdims=True), first)
            var = _group_mean(jnp.mean((h - mu) ** 2, 3, keepdims=True), second)
            h = (h - mu) / jnp.sqrt(var + 0.5)
        return jnp.mean((h @ p["head"] - y.reshape(2, 2, m, -1, y.shape[-1])) ** 2)

    return loss


def _params(stages: int) -> dict:
    rng = np.random.default_rng(5)
    p = {f"w{s}": rng.normal(size=(FEATURES, FEATURES)).astype(np.float32) for s in range(stages)}
    p["head"] = rng.normal(size=(FEATURES, OUT)).astype(np.float32)
    return p


def _batch(m: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch, replica ``r``'s rows shifted by ``r``: the workers' groups and the cores' differ."""
    rng = np.random.default_rng(6)
    rows = 4 * m * ROWS
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    x += np.repeat(np.arange(4, dtype=np.float32), m * ROWS)[:, None] * np.array([1.0, -0.5, 0.25], np.float32)
    return x, rng.normal(size=(rows, OUT)).astype(np.float32)


def make_step(loss: Callable, opt: optax.GradientTransformation) -> Callable:
    """The user's data-parallel step; ``rp.all_mean`` of the gradients and of the loss."""

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, *batch)
        grads = rp.all_mean(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": rp.all_mean(value)}

    return step


def one_device(loss: Callable, opt: optax.GradientTransformation, p: dict, batch: tuple) -> tuple:
    """``STEPS`` steps of ``jax.jit`` of value_and_grad + the update on one device: state and losses."""

    @jax.jit
    def step(state):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    state, values = (p, opt.init(p)), []
    for _ in range(STEPS):
        state, value = step(state)
        values.append(value)
    return state, values


def _assert_far(got, want, tol: float = 1e-3) -> None:
    """Some leaf differs by more than ``tol``: the data tells the two computations apart."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    gaps = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs]
    assert max(gaps) > tol, gaps


def test_two_stages_of_a_two_by_four_replicator_have_a_square_grid():
    grid = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = pipeline_mesh(grid, 2)
    assert dict(mesh.shape) == {"stages": 2, "workers": 2, "cores": 2}
    # Stage 0 is cores 0-1 of each worker: its 'workers' axis runs over devices 0 and 4, its 'cores' over 0 and 1.
    assert [[d.id for d in row] for row in mesh.devices[0]] == [[0, 1], [4, 5]]
    assert [[d.id for d in row] for row in mesh.devices[1]] == [[2, 3], [6, 7]]


@pytest.mark.parametrize("workers, cores, stages, m", SQUARE)
def test_users_step_with_group_statistics_matches_explicit_groups(workers, cores, stages, m):
    """``Replicator.run(step_fn, ...)``: means over ``'cores'`` and variances over ``'workers'`` (and the other way
    round on the next stage) in the loss, 3 Adam steps, against the groups computed on one device."""
    p, batch, opt = _params(stages), _batch(m), optax.adam(3e-2)
    repl = _replicator(workers, cores, stages, m)
    step, state, values = make_step(group_norm_loss(stages), opt), (p, opt.init(p)), []
    for _ in range(STEPS):  # one step function: built once
        state, out = repl.run(step, batch, state)
        assert out["loss"].shape == (4,)
        np.testing.assert_allclose(out["loss"], out["loss"][0], rtol=1e-6)  # all_mean: every replica's is one
        values.append(out["loss"][0])
    want, want_values = one_device(reference_group_norm_loss(stages, m), opt, p, batch)
    _assert_close(state, want, tol=1e-4)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)
    swapped, _ = one_device(reference_group_norm_loss(stages, m, swap=True), opt, p, batch)
    _assert_far(want, swapped)  # the groups exchanged would not pass


@pytest.mark.parametrize("workers, cores, stages, m", SQUARE[:1])
def test_run_pipelined_with_group_statistics_matches_explicit_groups(workers, cores, stages, m):
    """The same loss through ``run_pipelined(loss, optimizer, ...)``: SGD with momentum, 3 steps."""
    p, batch, opt = _params(stages), _batch(m), optax.sgd(0.1, momentum=0.9)
    repl = _replicator(workers, cores, stages, m)
    loss, state, values = group_norm_loss(stages), (p, opt.init(p)), []
    for _ in range(STEPS):  # one loss function: its step built once
        state, value = repl.run_pipelined(loss, opt, batch, state)
        values.append(value)
    want, want_values = one_device(reference_group_norm_loss(stages, m), opt, p, batch)
    _assert_close(state, want, tol=1e-4)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


def replica_weighted_loss(stages: int) -> Callable:
    """Each stage scales its activations by this replica's index in one group: ``1 + worker`` on even stages,
    ``1 + 2 * core`` on odd ones; the last also by ``1 + replica_id()`` (``group=None``) over 4."""

    def loss(p, x, y):
        h = x
        for s in range(stages):
            if s:
                h = rp.stage_boundary(h)
            scale = 1.0 + rp.replica_id(group="workers") if s % 2 == 0 else 1.0 + 2 * rp.replica_id(group="cores")
            h = jnp.tanh(h @ p[f"w{s}"]) * scale.astype(jnp.float32)
        h = h * (1.0 + rp.replica_id().astype(jnp.float32) / 4)
        return jnp.mean((h @ p["head"] - y) ** 2)

    return loss


def reference_replica_weighted_loss(stages: int, m: int) -> Callable:
    """:func:`replica_weighted_loss` on the global batch with every replica's indices written out."""
    worker = jnp.arange(2, dtype=jnp.float32).reshape(2, 1, 1, 1, 1)
    core = jnp.arange(2, dtype=jnp.float32).reshape(1, 2, 1, 1, 1)

    def loss(p, x, y):
        h = x.reshape(2, 2, m, -1, x.shape[-1])
        for s in range(stages):
            h = jnp.tanh(h @ p[f"w{s}"]) * (1.0 + worker if s % 2 == 0 else 1.0 + 2 * core)
        h = h * (1.0 + (2 * worker + core) / 4)
        return jnp.mean((h @ p["head"] - y.reshape(2, 2, m, -1, y.shape[-1])) ** 2)

    return loss


@pytest.mark.parametrize("workers, cores, stages, m", SQUARE)
def test_replica_id_in_a_pipelined_loss_is_the_replicas_own(workers, cores, stages, m):
    """``rp.replica_id(group='workers' | 'cores' | None)`` in the loss, ``run_pipelined`` with Adam, 3 steps."""
    p, batch, opt = _params(stages), _batch(m), optax.adam(3e-2)
    repl = _replicator(workers, cores, stages, m)
    loss, state, values = replica_weighted_loss(stages), (p, opt.init(p)), []
    for _ in range(STEPS):  # one loss function: its step built once
        state, value = repl.run_pipelined(loss, opt, batch, state)
        values.append(value)
    want, want_values = one_device(reference_replica_weighted_loss(stages, m), opt, p, batch)
    _assert_close(state, want, tol=1e-4)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


def test_all_gather_over_a_group_in_a_pipelined_loss_is_refused():
    """Not supported in a pipeline (``programs.check_collectives``): refused at trace time, whatever the group."""

    def loss(p, x, y):
        h = rp.stage_boundary(jnp.tanh(x @ p["w0"]))
        h = rp.all_gather(h, tiled=True, group="cores")
        return jnp.mean((h @ p["head"]) ** 2)

    p, batch, opt = _params(2), _batch(2), optax.sgd(0.1)
    repl = _replicator(2, 4, 2, 2)
    with pytest.raises(StageSplitError, match=r"all_gather.*not supported in a pipeline"):
        repl.run_pipelined(loss, opt, batch, (p, opt.init(p)))


def plain_loss(stages: int) -> Callable:
    """Per-row layers, a mean over rows: one device's loss on the global batch is the replicas' mean."""
    return _stacked_loss(stages, lambda h, stage: h)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.parametrize("workers, cores, stages, m", SQUARE)
def test_zero_on_a_square_grid_matches_one_device(workers, cores, stages, m, zero_stage):
    """``passes=PassManager.default(zero=k)``: each stage's rows cut in 4 chunks over ``('workers', 'cores')``;
    chunks taken or gathered in the other axis order land in the wrong place. Adam, 3 steps, against one device."""
    p, batch, opt = _params(stages), _batch(m), optax.adam(3e-2)
    repl = _replicator(workers, cores, stages, m, passes=rp.PassManager.default(zero=zero_stage))
    assert repl.pipelined.zero_stage == zero_stage
    loss, state, values = plain_loss(stages), (p, opt.init(p)), []
    for _ in range(STEPS):  # one loss function: its step built once
        state, value = repl.run_pipelined(loss, opt, batch, state)
        values.append(value)
    want, want_values = one_device(plain_loss(stages), opt, p, batch)  # markers are the identity off a pipeline
    _assert_close(state, want, tol=1e-4)
    np.testing.assert_allclose(values, want_values, rtol=1e-5)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_with_group_statistics_on_a_square_grid(zero_stage):
    """ZeRO and the loss's own group collectives together, 2 stages of ``2 x 2``."""
    stages, m = 2, 2
    p, batch, opt = _params(stages), _batch(m), optax.adam(3e-2)
    repl = _replicator(2, 4, stages, m, passes=rp.PassManager.default(zero=zero_stage))
    loss, state = group_norm_loss(stages), (p, opt.init(p))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(STEPS):
            state, _ = repl.run_pipelined(loss, opt, batch, state)
    want, _ = one_device(reference_group_norm_loss(stages, m), opt, p, batch)
    _assert_close(state, want, tol=1e-4)


def test_the_fuzzers_two_stage_meshes_include_a_square_grid():
    """``tests/fuzz/pipelines.py`` runs S = 2 on ``(2, 4)``: a ``2 x 2`` grid per stage, where ZeRO's chunk order
    shows. (Its S = 4 meshes of 8 devices have 2 replicas per stage, none square.)"""
    from tests.fuzz.pipelines import PIPE_MESHES

    grids = {
        (w, c): tuple(
            pipeline_mesh(np.array(jax.devices()[: w * c]).reshape(w, c), 2).shape[a] for a in ("workers", "cores")
        )
        for w, c in PIPE_MESHES[2]
    }
    assert grids[(2, 4)] == (2, 2), grids
