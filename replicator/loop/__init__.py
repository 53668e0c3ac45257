"""A small training loop over :meth:`Replicator.run`, with hooks.

``Trainer`` calls ``replicator.run(step_fn, input_fn, state)`` until a number of
steps is reached, and calls hooks around it: logging, evaluation,
checkpoints, early stopping. It hides neither ``step_fn`` nor ``input_fn``:
they are exactly what you would pass to ``Replicator.run`` yourself, in the
spirit of MMCV's ``Runner`` and Keras' ``fit``::

    import replicator as rp

    rp.force_cpu_devices(8)
    import jax
    import jax.numpy as jnp
    import numpy as np

    repl = rp.Replicator(num_workers=1, cores_per_worker=8)


    def input_fn(ctx):  # one worker's batches, as for Replicator.run
        rng = np.random.default_rng(ctx.worker_id)
        while True:
            x = rng.normal(size=(64, 3)).astype(np.float32)
            yield {"x": x, "y": x @ np.array([1.0, -2.0, 3.0], np.float32)}


    def step_fn(w, batch):  # one replica, as for Replicator.run
        loss, grads = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(w)
        return w - 0.1 * rp.all_mean(grads), {"loss": loss}


    trainer = rp.Trainer(
        repl,
        step_fn,
        input_fn,
        jnp.zeros(3),
        hooks=[
            rp.LoggingHook(every=50),  # loss, ms/step, samples/s; a progress bar on a terminal
            rp.CheckpointHook("/tmp/run1/ckpt", every=100, keep=3),
            # rp.EvalHook(eval_fn, eval_input_fn, every=100, num_batches=20),
        ],
        resume_from="/tmp/run1/ckpt",  # continue where a killed run stopped
    )
    w = trainer.run(300)  # train until step 300

**Steps and resuming.** ``trainer.step`` counts the steps done, including
those restored from a checkpoint, and ``run(num_steps)`` trains until
``trainer.step == num_steps``, so the same script starts a run or, after a
crash, finishes it. ``resume_from=directory`` restores the newest checkpoint
there (the state, the step and the *input position*: how many batches each
worker had taken from ``input_fn``) and skips that many batches of the fresh
``input_fn`` iterators by drawing and discarding them, so the resumed run sees
the batches it would have seen and, for a deterministic ``input_fn``, ends
with bit-identical parameters. With no checkpoint there it starts from
``state``. To count batches and rows, the Trainer passes ``Replicator.run`` a
thin generator around ``input_fn`` that forwards every batch unchanged.

Modules: :mod:`~.trainer` (:class:`Trainer`), :mod:`~.hooks` (the hook
protocol, :class:`Hook`, :class:`LoggingHook`, :class:`EvalHook`,
:class:`CheckpointHook`), :mod:`~.console` (lines and the progress bar),
:mod:`~.metrics` (:func:`replica_means`).
"""

from __future__ import annotations

from replicator.loop.hooks import CheckpointHook, EvalHook, Hook, LoggingHook
from replicator.loop.metrics import replica_means
from replicator.loop.trainer import Trainer

__all__ = ["CheckpointHook", "EvalHook", "Hook", "LoggingHook", "Trainer", "replica_means"]
