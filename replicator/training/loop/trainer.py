"""The :class:`Trainer`: ``Replicator.run`` step after step, with hooks, resumable."""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

import jax
import numpy as np

from replicator.api import Replicator
from replicator.errors import InputExhausted
from replicator.runtime.inputs import InputContext, check_input_fn
from replicator.training.checkpoint import CheckpointError, CheckpointManager
from replicator.training.loop.console import Console

PyTree = Any
_END = object()
_HOOK_METHODS = ("before_run", "after_step", "after_run", "teardown")


class Trainer:
    """Runs ``replicator.run(step_fn, input_fn, state)`` step after step, with hooks.

    Args:
      replicator: the :class:`~replicator.Replicator` to run on.
      step_fn: ``step_fn(state, batch) -> (new_state, outputs)`` for one
        replica, as for ``Replicator.run``. Outputs of one number per replica
        (e.g. ``{"loss": rp.all_mean(loss)}``) are what hooks log.
      input_fn: ``input_fn(ctx) -> iterable`` of a worker's batches, as for
        ``Replicator.run``. It is called once per worker when training starts.
      state: the initial state (a pytree of arrays). With ``resume_from`` it
        is also the template that a checkpoint must match.
      hooks: objects with ``before_run``/``after_step``/``after_run``/``teardown``
        methods (see :mod:`replicator.training.loop.hooks`), called in this order.
      resume_from: a checkpoint directory; if it holds a checkpoint, the
        newest one's state, step and input position are restored.
      logger: where :meth:`log` writes (``logger.info``); default: stdout.
      stream: the text stream for lines and the progress bar when no
        ``logger`` is given; default: ``sys.stdout``.

    Attributes:
      step: steps done, including those restored by ``resume_from``.
      state: the current state.
      outputs: the last step's outputs (None before the first step).
      input_position: batches taken from each worker's ``input_fn`` so far,
        including those skipped on resume (not counting batches the
        Replicator drew ahead, ``prefetch``: what a checkpoint saves to resume
        exactly).
      rows_per_step: rows of the last global batch (leading size of the first
        batch leaf times the number of workers).
      samples: rows trained on by this Trainer (not counting restored steps).
      num_steps: the target of the current or last ``run()``.
      restored_step: the step restored by ``resume_from``, or None.
      should_stop: set it to True in a hook to end ``run()`` after this step.
      console: where lines and the progress bar go when there is no
        ``logger``: ``console.line(text)``, ``console.status(text)`` (a
        status line redrawn in place, on terminals only).
    """

    def __init__(
        self,
        replicator: Replicator,
        step_fn: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
        input_fn: Callable[[InputContext], Any],
        state: PyTree,
        *,
        hooks: Sequence[object] = (),
        resume_from: str | os.PathLike | None = None,
        logger: logging.Logger | None = None,
        stream: TextIO | None = None,
    ):
        if not isinstance(replicator, Replicator):
            raise TypeError(f"replicator must be a replicator.Replicator, got {type(replicator).__name__}.")
        if not callable(step_fn):
            raise TypeError(
                f"step_fn must be a function step_fn(state, batch) -> (new_state, outputs), got {step_fn!r}."
            )
        check_input_fn(input_fn)
        if state is None:
            raise TypeError(
                "Trainer trains a state: pass the initial state (a pytree of arrays), and write "
                "step_fn(state, batch) -> (new_state, outputs). For a step without state call Replicator.run."
            )
        for hook in hooks:
            if not any(callable(getattr(hook, m, None)) for m in _HOOK_METHODS):
                raise TypeError(
                    f"hook {hook!r} has none of the methods {', '.join(_HOOK_METHODS)}; "
                    f"subclass replicator.Hook and override them."
                )
        self.replicator = replicator
        self.step_fn = step_fn
        self.input_fn = input_fn
        self.state = state
        self.hooks = list(hooks)
        self.logger = logger
        self.console = Console(stream)
        self.step = 0
        self.outputs: PyTree = None
        self.input_position = 0
        self.rows_per_step: int | None = None
        self.samples = 0
        self.num_steps: int | None = None
        self.restored_step: int | None = None
        self.restored_extra: dict[str, Any] = {}
        self.should_stop = False
        self._skip = 0
        self._rows: collections.deque[int] = collections.deque()  # rows of each batch drawn, not yet taken
        self._taken = 0  # batches of _feed that steps took, as counted by the Replicator
        self._feed = self._make_feed()  # one function object: Replicator keeps its iterators by identity
        if resume_from is not None:
            self._resume(resume_from)

    def __repr__(self) -> str:
        return f"Trainer(step={self.step}, input_position={self.input_position}, hooks={self.hooks!r})"

    # -- input ---------------------------------------------------------------

    def _make_feed(self) -> Callable[[InputContext], Iterator[PyTree]]:
        def feed(ctx: InputContext) -> Iterator[PyTree]:
            """``input_fn(ctx)``'s batches, after skipping the consumed ones; counts them."""
            counting = ctx.worker_id == self.replicator.local_workers[0]
            iterator = iter(self.input_fn(ctx))
            for skipped in range(self._skip):
                if next(iterator, _END) is _END:
                    raise CheckpointError(
                        f"input_fn of worker {ctx.worker_id} ended after {skipped} batches, while skipping to "
                        f"input position {self._skip} restored from the checkpoint of step {self.restored_step}; "
                        f"resume with the input_fn the checkpoint was trained with."
                    )
            for batch in iterator:
                if counting:
                    leaves = jax.tree.leaves(batch)
                    rows = np.shape(leaves[0])[0] if leaves and np.ndim(leaves[0]) else 0
                    self._rows.append(int(rows) * self.replicator.num_workers)
                yield batch

        return feed

    def _count_taken(self) -> None:
        """Advance ``input_position`` and ``rows_per_step`` by the batches steps took (not those drawn ahead)."""
        taken = self.replicator.input_position(self._feed)
        while self._taken < taken:
            self._taken += 1
            self.input_position += 1
            self.rows_per_step = self._rows.popleft() if self._rows else self.rows_per_step

    # -- checkpoints -----------------------------------------------------------

    def checkpoint_extra(self) -> dict[str, Any]:
        """The metadata saved with a checkpoint for resuming: the input position."""
        return {
            "input_position": self.input_position,
            "num_workers": self.replicator.num_workers,
            "rows_per_step": self.rows_per_step,
        }

    def save_checkpoint(self, manager: CheckpointManager, *, asynchronous: bool = False) -> str:
        """Save ``state`` at ``step`` with :meth:`checkpoint_extra`; returns its directory.

        ``asynchronous=True``: :meth:`CheckpointManager.save_async` (copied on
        the devices first if the Replicator donates the state).
        """
        if asynchronous:
            return manager.save_async(
                self.step, self.state, extra=self.checkpoint_extra(), copy_on_device=self.replicator.donate_state
            )
        return manager.save(self.step, self.state, extra=self.checkpoint_extra())

    def _resume(self, directory: str | os.PathLike) -> None:
        manager = CheckpointManager(directory, keep=None)
        if manager.latest_step() is None:
            self.log(f"no checkpoint in {directory}: starting from step 0")
            return
        step, state, extra = manager.restore(self.state)
        position = extra.get("input_position")
        if not isinstance(position, int) or position < 0:
            raise CheckpointError(
                f"the checkpoint of step {step} in {directory} has no input position (extra['input_position']); "
                f"it was not written by a Trainer. Restore it with replicator.restore_checkpoint and start "
                f"a Trainer from that state."
            )
        workers = extra.get("num_workers", self.replicator.num_workers)
        if workers != self.replicator.num_workers:
            raise CheckpointError(
                f"the checkpoint of step {step} in {directory} was trained with {workers} worker(s) and this "
                f"Replicator has {self.replicator.num_workers}; its input position counts batches per worker. "
                f"Resume with num_workers={workers}, or restore the state with replicator.restore_checkpoint "
                f"and give the Trainer an input_fn that starts at the right place."
            )
        self.state, self.step, self.input_position, self._skip = state, step, position, position
        self.restored_step, self.restored_extra = step, extra
        self.log(f"resumed from {manager.path(step)} at step {step} (skipping {position} batches per worker)")

    # -- running -----------------------------------------------------------------

    def log(self, message: str) -> None:
        """Write a line to ``logger`` (``info``) or the stream, above the progress bar."""
        if self.logger is not None:
            self.logger.info(message)
        else:
            self.console.line(message)

    def _call(self, method: str) -> None:
        for hook in self.hooks:
            fn = getattr(hook, method, None)
            if fn is not None:
                fn(self)

    def run(self, num_steps: int) -> PyTree:
        """Train until ``step == num_steps``; returns the state.

        Stops earlier, after ``after_step``, if a hook sets ``should_stop``,
        and when ``input_fn`` is exhausted (logging it). Either way the
        hooks' ``after_run`` is called. The hooks' ``teardown`` is called
        last, also when a step or a hook raised (a ``CheckpointHook`` waits
        there for its save in flight).

        Args:
          num_steps: the total number of steps, counting restored ones.
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or num_steps < 0:
            raise ValueError(f"num_steps must be a non-negative int (the total step count), got {num_steps!r}.")
        self.num_steps = int(num_steps)
        self.should_stop = False
        try:
            self._call("before_run")
            while self.step < self.num_steps and not self.should_stop:
                try:
                    try:
                        # Nothing is drawn ahead for a step after this run's last (prefetch=0 there).
                        last = self.step + 1 >= self.num_steps
                        self.state, self.outputs = self.replicator.run(
                            self.step_fn, self._feed, self.state, prefetch=0 if last else None
                        )
                    finally:
                        self._count_taken()
                except InputExhausted:
                    self.log(f"input_fn exhausted after {self.input_position} batches: stopping at step {self.step}")
                    break
                self.step += 1
                self.samples += self.rows_per_step or 0
                self._call("after_step")
            self._call("after_run")
        finally:
            try:
                self._call("teardown")
            finally:
                self.console.close()
        return self.state
