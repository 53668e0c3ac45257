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
from replicator.loop.console import Console
from replicator.runtime.inputs import InputContext, check_input_fn
from replicator.training.checkpoint import CheckpointError, CheckpointManager

PyTree = Any
_END = object()
_HOOK_METHODS = ("before_run", "after_step", "after_run", "teardown")
#: What ``keep_batch`` keeps when a checkpoint is resumed on another number of workers.
KEEP_BATCH = ("global", "per-replica")


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
        methods (see :mod:`replicator.loop.hooks`), called in this order.
      resume_from: a checkpoint directory; if it holds a checkpoint, the
        newest one's state, step and input position are restored.
      keep_batch: what stays the same when the checkpoint was trained on
        another number of workers (e.g. the launcher's ``--min-workers``
        left one behind). ``"global"`` (default): every step still trains
        on one global batch, shared by fewer replicas (more rows each):
        ``input_fn(ctx)`` must yield worker ``ctx.worker_id``'s share of
        each global batch for ``ctx.num_workers`` workers, and the training
        goes on as if the worker count had never changed. ``"per-replica"``:
        each replica keeps its rows and the global batch shrinks with the
        replicas (``input_fn`` yields the same rows per worker); a learning
        rate tuned for the old global batch may need scaling.
      per_replica_state: the state leaves kept per replica (a leading axis
        of ``num_replicas``), as for ``Replicator.run``; default none.
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
      keep_batch: what a resume on another number of workers keeps
        (``"global"`` or ``"per-replica"``, the argument).
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
        keep_batch: str = "global",
        per_replica_state: Any = None,
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
        if keep_batch not in KEEP_BATCH:
            raise ValueError(
                f"keep_batch must be 'global' (each step trains on the same global batch on any number of "
                f"workers) or 'per-replica' (each replica keeps its rows), got {keep_batch!r}."
            )
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
        self.keep_batch = keep_batch
        self.per_replica_state = per_replica_state
        self._skip = 0
        self._expected_rows: int | None = None  # rows of the first step after resuming on other workers
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
            if self._expected_rows is not None:
                self._check_rows(self._expected_rows)
                self._expected_rows = None

    # -- checkpoints -----------------------------------------------------------

    def checkpoint_extra(self) -> dict[str, Any]:
        """The metadata saved with a checkpoint for resuming: the input position, and the batch's layout.

        ``num_replicas`` and ``rows_per_step`` (the global batch's rows) let a
        job resumed on another number of workers check and say what changes
        (see ``keep_batch``).
        """
        return {
            "input_position": self.input_position,
            "num_workers": self.replicator.num_workers,
            "num_replicas": self.replicator.num_replicas,
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
        if extra.get("num_workers", self.replicator.num_workers) != self.replicator.num_workers:
            self._expected_rows = self._resize(f"the checkpoint of step {step} in {directory}", position, extra)
        self.state, self.step, self.input_position, self._skip = state, step, position, position
        self.restored_step, self.restored_extra = step, extra
        self.log(f"resumed from {manager.path(step)} at step {step} (skipping {position} batches per worker)")

    def _resize(self, where: str, position: int, extra: dict[str, Any]) -> int | None:
        """Check resuming ``extra``'s checkpoint on this worker count under ``keep_batch``, and say what changes.

        Its input position counts batches per worker, one per step: each new
        worker skips that many of its own batches. Returns the rows the next
        global batch should have (None: the checkpoint does not say).
        """
        workers, now = extra["num_workers"], self.replicator.num_workers
        rows, replicas = extra.get("rows_per_step"), extra.get("num_replicas")
        if not isinstance(replicas, int):  # a checkpoint from before num_replicas was saved: the same cores
            replicas = workers * self.replicator.cores_per_worker
        if not isinstance(rows, int) or rows <= 0:
            if position == 0:
                return None  # nothing trained yet: nothing to keep
            raise CheckpointError(
                f"{where} was trained with {workers} worker(s) and this Replicator has {now}, and it does not "
                f"say its global batch (extra['rows_per_step']), so resuming on another number of workers "
                f"cannot be checked. Resume with num_workers={workers}."
            )
        per_replica, new_replicas = rows // replicas, self.replicator.num_replicas
        shape = f"{now} worker(s) x {self.replicator.cores_per_worker} cores"
        if self.keep_batch == "per-replica":
            new_rows = per_replica * new_replicas
            self.log(
                f"resuming on {shape} from {where}, trained on {workers} worker(s) ({replicas} replicas); "
                f"keep_batch='per-replica': {per_replica} rows per replica, so the global batch goes from {rows} "
                f"to {new_rows} rows per step. Warning: a learning rate tuned for {rows} rows may need scaling "
                f"(e.g. by {new_rows}/{rows}, the linear scaling rule); the optimizer is yours to adjust."
            )
            return new_rows
        if rows % new_replicas:
            raise CheckpointError(
                f"{where} was trained on a global batch of {rows} rows, which the {new_replicas} replicas of "
                f"{shape} cannot share evenly; resume on a number of workers whose replicas divide {rows}, or "
                f"pass keep_batch='per-replica' (each replica keeps its {per_replica} rows)."
            )
        self.log(
            f"resuming on {shape} from {where}, trained on {workers} worker(s) ({replicas} replicas); "
            f"keep_batch='global': the global batch of {rows} rows is kept, {per_replica} -> "
            f"{rows // new_replicas} rows per replica (input_fn(ctx) yields worker ctx.worker_id's share of "
            f"each global batch for ctx.num_workers={now})"
        )
        return rows

    def _check_rows(self, expected: int) -> None:
        """After the first step resumed on another worker count: warn if its global batch is not ``expected``."""
        if self.rows_per_step in (None, expected):
            return
        fix = (
            "input_fn(ctx) yields the same rows per worker: make it yield worker ctx.worker_id's share of the "
            "global batch for ctx.num_workers workers, or pass keep_batch='per-replica'"
            if self.keep_batch == "global"
            else "input_fn(ctx) does not yield the same rows per replica as before the resume"
        )
        self.log(
            f"warning: the first step resumed on {self.replicator.num_workers} worker(s) trained on "
            f"{self.rows_per_step} rows, and keep_batch={self.keep_batch!r} expects {expected}: {fix}."
        )

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
                            self.step_fn,
                            self._feed,
                            self.state,
                            prefetch=0 if last else None,
                            per_replica_state=self.per_replica_state,
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
