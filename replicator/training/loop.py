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

**Hooks.** A hook is any object with some of these methods, each called with
the trainer (missing ones are skipped; subclass :class:`Hook` to get no-op
defaults):

* ``before_run(trainer)``: at the start of every ``run()``;
* ``after_step(trainer)``: after each step; ``trainer.step``,
  ``trainer.state`` and ``trainer.outputs`` (every leaf with a leading
  replica axis) are the new ones;
* ``after_run(trainer)``: when ``run()`` ends normally (the step count is
  reached, the input is exhausted, or a hook set ``trainer.should_stop``).

Hooks run in the order given. Do something every ``N`` steps with
``trainer.step % N == 0``; the built-in hooks also act once in ``after_run``
for the last step if it was not a multiple of ``every``. Print with
``trainer.log(message)``: it goes to ``logger=`` if given, else to stdout,
above the progress bar.

**Output.** :class:`LoggingHook` writes one line every ``every`` steps. When
stdout is a terminal (``sys.stdout.isatty()``) and no ``logger=`` is given, a
progress bar on the last line shows the step, the speed and the time left
between them; otherwise (a file, a pipe, a CI log) there are only the plain
lines::

    step 50/200  loss 0.4413  accuracy 0.8125  23.1 ms/step  11083 samples/s
    [##########....................]  50/200  25%  43.3 steps/s  eta 3s  loss 0.4413
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TextIO

import jax
import numpy as np

from replicator.api import Replicator
from replicator.errors import InputExhausted
from replicator.runtime.inputs import InputContext, check_input_fn
from replicator.training.checkpoint import CheckpointError, CheckpointManager

__all__ = ["CheckpointHook", "EvalHook", "Hook", "LoggingHook", "Trainer", "replica_means"]

PyTree = Any
_END = object()


class Hook:
    """A base class for hooks whose methods do nothing; override the ones you need."""

    def before_run(self, trainer: Trainer) -> None:
        """Called at the start of every :meth:`Trainer.run`."""

    def after_step(self, trainer: Trainer) -> None:
        """Called after every step, with ``trainer.step/state/outputs`` updated."""

    def after_run(self, trainer: Trainer) -> None:
        """Called when :meth:`Trainer.run` ends normally."""


def replica_means(outputs: PyTree) -> dict[str, float]:
    """The mean over replicas of every output that has one number per replica.

    Args:
      outputs: outputs of ``Replicator.run`` (leaves with a leading replica axis).

    Returns:
      ``{name: mean}``, names joined from the tree path (``"loss"``,
      ``"metrics/accuracy"``, ``"0"``; ``"output"`` for a single array), for
      leaves of shape ``(num_replicas,)``; other leaves are left out. With
      several processes, each averages the replicas it holds.
    """
    means = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(outputs)[0]:
        if np.ndim(leaf) != 1:
            continue
        name = "/".join(_key_name(k) for k in keys) or "output"
        means[name] = float(np.mean(_local_values(leaf)))
    return means


def _local_values(leaf: Any) -> np.ndarray:
    """A leaf's values as float64 on the host; with several processes, this process's replicas."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.concatenate([np.asarray(s.data, np.float64).ravel() for s in leaf.addressable_shards])
    return np.asarray(leaf, np.float64)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _format_metrics(metrics: Mapping[str, float]) -> str:
    return "  ".join(f"{name} {value:.4g}" for name, value in metrics.items())


def _format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class _Console:
    """Lines and, on a terminal, one status line (the progress bar) below them."""

    def __init__(self, stream: TextIO | None):
        self._stream = stream
        self._status = ""

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout  # looked up late: tests swap it

    @property
    def interactive(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def line(self, text: str) -> None:
        status = self._status
        self._clear()
        self.stream.write(text + "\n")
        if status:
            self.status(status)
        else:
            self.stream.flush()

    def status(self, text: str) -> None:
        if not self.interactive:
            return
        pad = max(0, len(self._status) - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._status = text

    def _clear(self) -> None:
        if self._status:
            self.stream.write("\r" + " " * len(self._status) + "\r")
            self._status = ""

    def close(self) -> None:
        """End the status line, leaving the last bar on screen."""
        if self._status:
            self.stream.write("\n")
            self.stream.flush()
            self._status = ""


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
      hooks: objects with ``before_run``/``after_step``/``after_run``
        methods (see the module docstring), called in this order.
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
        including those skipped on resume.
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
            if not any(callable(getattr(hook, m, None)) for m in ("before_run", "after_step", "after_run")):
                raise TypeError(
                    f"hook {hook!r} has none of the methods before_run, after_step, after_run; "
                    f"subclass replicator.Hook and override them."
                )
        self.replicator = replicator
        self.step_fn = step_fn
        self.input_fn = input_fn
        self.state = state
        self.hooks = list(hooks)
        self.logger = logger
        self.console = _Console(stream)
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
                    self.rows_per_step = int(rows) * self.replicator.num_workers
                    self.input_position += 1
                yield batch

        return feed

    # -- checkpoints -----------------------------------------------------------

    def checkpoint_extra(self) -> dict[str, Any]:
        """The metadata saved with a checkpoint for resuming: the input position."""
        return {
            "input_position": self.input_position,
            "num_workers": self.replicator.num_workers,
            "rows_per_step": self.rows_per_step,
        }

    def save_checkpoint(self, manager: CheckpointManager) -> str:
        """Save ``state`` at ``step`` with :meth:`checkpoint_extra`; returns its directory."""
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
        hooks' ``after_run`` is called.

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
                    self.state, self.outputs = self.replicator.run(self.step_fn, self._feed, self.state)
                except InputExhausted:
                    self.log(f"input_fn exhausted after {self.input_position} batches: stopping at step {self.step}")
                    break
                self.step += 1
                self.samples += self.rows_per_step or 0
                self._call("after_step")
            self._call("after_run")
        finally:
            self.console.close()
        return self.state


# -- hooks ----------------------------------------------------------------------


def _check_every(every: int) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every= must be a positive int (a number of steps), got {every!r}.")
    return every


class _Periodic(Hook):
    """Calls ``self.act(trainer)`` every ``every`` steps and after the last step of a run."""

    def __init__(self, every: int):
        self.every = _check_every(every)
        self._done_at: int | None = None
        self._start: int | None = None

    def act(self, trainer: Trainer) -> None:
        raise NotImplementedError

    def _act(self, trainer: Trainer) -> None:
        self._done_at = trainer.step
        self.act(trainer)

    def before_run(self, trainer: Trainer) -> None:
        self._start = trainer.step

    def after_step(self, trainer: Trainer) -> None:
        if trainer.step % self.every == 0:
            self._act(trainer)

    def after_run(self, trainer: Trainer) -> None:
        if trainer.step != self._start and self._done_at != trainer.step:
            self._act(trainer)


class LoggingHook(_Periodic):
    """Logs the replica-averaged scalar outputs, step time and samples/s every ``every`` steps.

    Each line (``trainer.log``) reads::

        step 50/200  loss 0.4413  accuracy 0.8125  23.1 ms/step  11083 samples/s

    where the metrics are :func:`replica_means` of the last step's outputs,
    and the times are measured over the steps since the previous line (the
    first line includes compilation, and every line the time other hooks took,
    such as evaluations). The hook waits for the step's outputs,
    so only logged steps synchronize with the devices. Between lines, on a
    terminal, a progress bar shows the step, steps/s and the time left.

    Args:
      every: log every this many steps (and after the last step of a run).
      progress: show the progress bar; default: when the trainer writes to a
        terminal and has no ``logger``.
      bar_width: characters between the brackets of the bar.

    Attributes:
      history: a dict per line: ``step``, ``metrics``, ``step_time`` (s),
        ``samples_per_sec``.
    """

    def __init__(self, every: int = 10, *, progress: bool | None = None, bar_width: int = 30):
        super().__init__(every)
        self.progress = progress
        self.bar_width = bar_width
        self.history: list[dict[str, Any]] = []
        self._show_bar = False
        self._last: tuple[float, int, int] = (0.0, 0, 0)
        self._run_start: tuple[float, int] = (0.0, 0)
        self._last_draw = 0.0
        self._metrics: dict[str, float] = {}

    def before_run(self, trainer: Trainer) -> None:
        super().before_run(trainer)
        now = time.perf_counter()
        self._last = (now, trainer.step, trainer.samples)
        self._run_start = (now, trainer.step)
        self._show_bar = (
            self.progress if self.progress is not None else (trainer.logger is None and trainer.console.interactive)
        )

    def after_step(self, trainer: Trainer) -> None:
        super().after_step(trainer)
        if self._show_bar:
            now = time.perf_counter()
            if now - self._last_draw >= 0.1 or trainer.step in (trainer.num_steps, self._done_at):
                self._last_draw = now
                trainer.console.status(self.bar(trainer, now))

    def act(self, trainer: Trainer) -> None:
        metrics = replica_means(trainer.outputs)  # waits for the step to finish
        now = time.perf_counter()
        then, step, samples = self._last
        elapsed = max(now - then, 1e-9)
        steps = max(trainer.step - step, 1)
        record = {
            "step": trainer.step,
            "metrics": metrics,
            "step_time": elapsed / steps,
            "samples_per_sec": (trainer.samples - samples) / elapsed,
        }
        self.history.append(record)
        self._last = (now, trainer.step, trainer.samples)
        self._metrics = metrics
        total = f"/{trainer.num_steps}" if trainer.num_steps is not None else ""
        parts = [f"step {trainer.step}{total}"]
        if metrics:
            parts.append(_format_metrics(metrics))
        parts.append(f"{1e3 * record['step_time']:.1f} ms/step")
        parts.append(f"{record['samples_per_sec']:.0f} samples/s")
        trainer.log("  ".join(parts))

    def bar(self, trainer: Trainer, now: float | None = None) -> str:
        """The progress bar line for the trainer's current step."""
        now = time.perf_counter() if now is None else now
        total = trainer.num_steps or 0
        start_time, start_step = self._run_start
        done = trainer.step - start_step
        rate = done / max(now - start_time, 1e-9)
        frac = min(trainer.step / total, 1.0) if total else 1.0
        filled = int(round(frac * self.bar_width))
        eta = (total - trainer.step) / rate if rate > 0 else math.inf
        text = (
            f"[{'#' * filled}{'.' * (self.bar_width - filled)}] {trainer.step:>{len(str(total))}}/{total} "
            f"{100 * frac:3.0f}%  {rate:.1f} steps/s  eta {_format_seconds(eta)}"
        )
        if self._metrics:
            text += "  " + _format_metrics(self._metrics)
        return text


class EvalHook(_Periodic):
    """Runs an evaluation step over an evaluation input every ``every`` steps.

    Each evaluation starts ``input_fn`` over (calling it again per worker),
    runs ``eval_fn(state, batch) -> outputs`` on the replicas for
    ``num_batches`` batches or until the input ends, averages
    :func:`replica_means` of the outputs over the batches, and logs::

        eval step 500  loss 0.3012  accuracy 0.9102  (20 batches)

    Args:
      eval_fn: ``eval_fn(state, batch) -> outputs`` for one replica; it may
        use cross-replica calls (e.g. ``rp.all_mean(accuracy)``). It does not
        change the state.
      input_fn: ``input_fn(ctx)`` of evaluation batches, as for the Trainer.
      every: evaluate every this many steps (and after the last step of a run).
      num_batches: batches per evaluation; None means until ``input_fn``
        ends (then it must end).
      name: the prefix of the log line.

    Attributes:
      history: a dict per evaluation: ``step``, ``metrics``, ``batches``.
    """

    def __init__(
        self,
        eval_fn: Callable[[PyTree, PyTree], PyTree],
        input_fn: Callable[[InputContext], Any],
        every: int,
        *,
        num_batches: int | None = None,
        name: str = "eval",
    ):
        super().__init__(every)
        if not callable(eval_fn):
            raise TypeError(f"eval_fn must be a function eval_fn(state, batch) -> outputs, got {eval_fn!r}.")
        check_input_fn(input_fn)
        if num_batches is not None and (not isinstance(num_batches, int) or num_batches < 1):
            raise ValueError(f"num_batches= must be a positive int or None (until input_fn ends), got {num_batches!r}.")
        self.eval_fn = eval_fn
        self.input_fn = input_fn
        self.num_batches = num_batches
        self.name = name
        self.history: list[dict[str, Any]] = []
        self._pass = 0
        # One step function and one input function for every evaluation: compiled once, and the
        # Replicator keeps one set of iterators, which start input_fn over when _pass changes.
        self._step = self._make_step()
        self._feed = functools.partial(_RestartingInput, self)

    def _make_step(self) -> Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]:
        eval_fn = self.eval_fn

        def eval_step(state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree]:
            return state, eval_fn(state, batch)

        return eval_step

    def evaluate(self, trainer: Trainer) -> dict[str, float]:
        """Run one evaluation now; returns the averaged metrics."""
        self._pass += 1
        totals: dict[str, float] = {}
        count = 0
        while self.num_batches is None or count < self.num_batches:
            try:
                # The state comes back unchanged; take it, as a donating Replicator invalidates the old one.
                trainer.state, outputs = trainer.replicator.run(self._step, self._feed, trainer.state)
            except InputExhausted:
                break
            for k, v in replica_means(outputs).items():
                totals[k] = totals.get(k, 0.0) + v
            count += 1
        if count == 0:
            raise ValueError(f"{self.name}: the evaluation input_fn yielded no batches; give it some data.")
        metrics = {k: v / count for k, v in totals.items()}
        self.history.append({"step": trainer.step, "metrics": metrics, "batches": count})
        parts = [
            f"{self.name} step {trainer.step}",
            _format_metrics(metrics),
            f"({count} batch{'es' if count != 1 else ''})",
        ]
        trainer.log("  ".join(p for p in parts if p))
        return metrics

    def act(self, trainer: Trainer) -> None:
        self.evaluate(trainer)


class _RestartingInput:
    """``iter(hook.input_fn(ctx))``, started over whenever ``hook._pass`` changes."""

    def __init__(self, hook: EvalHook, ctx: InputContext):
        self.hook, self.ctx = hook, ctx
        self.pass_: int | None = None
        self.iterator: Iterator[PyTree] = iter(())

    def __iter__(self) -> _RestartingInput:
        return self

    def __next__(self) -> PyTree:
        if self.pass_ != self.hook._pass:
            self.pass_, self.iterator = self.hook._pass, iter(self.hook.input_fn(self.ctx))
        return next(self.iterator)


class CheckpointHook(_Periodic):
    """Saves a checkpoint every ``every`` steps and after the last step of a run.

    The checkpoint holds the state, the step and, in ``extra``,
    :meth:`Trainer.checkpoint_extra` (the input position), which is what
    ``Trainer(..., resume_from=directory)`` restores. Saves are atomic (see
    :mod:`replicator.training.checkpoint`); only the ``keep`` newest are kept.

    Args:
      directory: the checkpoint directory.
      every: save every this many steps.
      keep: how many checkpoints to keep (None: all).
    """

    def __init__(self, directory: str | os.PathLike, every: int, *, keep: int | None = 3):
        super().__init__(every)
        self.manager = CheckpointManager(directory, keep=keep)
        self.saved: list[int] = []

    def act(self, trainer: Trainer) -> None:
        trainer.save_checkpoint(self.manager)
        self.saved.append(trainer.step)
