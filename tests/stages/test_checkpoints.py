"""Checkpoints of a pipelined run.

``run`` takes and returns the state with its global shapes, so a checkpoint saved by a pipelined ``Trainer``
is the same checkpoint a data-parallel one saves: it restores onto another number of stages, onto plain
data parallelism, and back. Each resumed run is compared with one device (``jax.jit`` of the same step on
each step's global batch), not with another pipelined run.
"""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from tests.stages.test_train import _assert_close
from tests.stages.test_user_step import make_step

WORKERS, CORES, MICROBATCHES = 2, 4, 4
ROWS, WIDTH, STEPS, SAVED_AT = 32, 8, 4, 2
CUTS = {1: (), 2: (2,), 4: (1, 2, 3)}  # the layers that start a new stage, per number of stages


def layered_loss(stages: int):
    """Four tanh layers and a head; ``rp.stage_boundary`` before the layers in ``CUTS[stages]``."""

    def loss(p, x, y):
        h = x
        for i in range(4):
            if i in CUTS[stages]:
                h = rp.stage_boundary(h)
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean((h @ p["head"] - y) ** 2)

    return loss


def init_params():
    rng = np.random.default_rng(0)
    p = {f"w{i}": (0.5 * rng.normal(size=(WIDTH, WIDTH))).astype(np.float32) for i in range(4)}
    p["head"] = rng.normal(size=(WIDTH, 2)).astype(np.float32)
    return p


def global_batch(i: int):
    """Step ``i``'s global batch: different every step, so resuming at the wrong batch shows."""
    rng = np.random.default_rng(100 + i)
    return rng.normal(size=(ROWS, WIDTH)).astype(np.float32), rng.normal(size=(ROWS, 2)).astype(np.float32)


def input_fn(ctx):
    rows = ROWS // ctx.num_workers
    mine = slice(ctx.worker_id * rows, (ctx.worker_id + 1) * rows)
    for i in range(STEPS):
        x, y = global_batch(i)
        yield x[mine], y[mine]


def replicator_for(stages: int) -> rp.Replicator:
    devices = jax.devices()[: WORKERS * CORES]
    if stages == 1:
        return rp.Replicator(WORKERS, CORES, devices=devices)
    return rp.Replicator(
        WORKERS, CORES, devices=devices, parallelism=rp.Parallelism(stages=stages, microbatches=MICROBATCHES)
    )


def one_device(opt):
    step = jax.jit(make_step(layered_loss(1), opt, mean=False))
    p = init_params()
    state = (p, opt.init(p))
    for i in range(STEPS):
        state, _ = step(state, global_batch(i))
    return state


@pytest.mark.parametrize("saved, restored", [(4, 2), (4, 1), (1, 4), (2, 4)], ids=lambda s: f"S{s}")
def test_a_checkpoint_restores_onto_another_number_of_stages(tmp_path, saved, restored):
    opt = optax.adam(1e-2)
    p = init_params()
    first = rp.Trainer(
        replicator_for(saved),
        make_step(layered_loss(saved), opt),
        input_fn,
        (p, opt.init(p)),
        hooks=[rp.CheckpointHook(tmp_path, every=SAVED_AT)],
        stream=io.StringIO(),
    )
    first.run(SAVED_AT)
    resumed = rp.Trainer(
        replicator_for(restored),
        make_step(layered_loss(restored), opt),
        input_fn,
        (p, opt.init(p)),  # replaced by the checkpoint's state
        resume_from=tmp_path,
        stream=io.StringIO(),
    )
    assert resumed.restored_step == SAVED_AT
    state = resumed.run(STEPS)
    assert (resumed.step, resumed.input_position) == (STEPS, STEPS)
    _assert_close(state, one_device(opt))
