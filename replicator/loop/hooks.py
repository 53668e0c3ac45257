"""Hooks: what the :class:`~replicator.loop.Trainer` calls around its steps.

A hook is any object with some of these methods, each called with the trainer
(missing ones are skipped; subclass :class:`Hook` to get no-op defaults):

* ``before_run(trainer)``: at the start of every ``run()``;
* ``after_step(trainer)``: after each step; ``trainer.step``,
  ``trainer.state`` and ``trainer.outputs`` (every leaf with a leading
  replica axis) are the new ones;
* ``after_run(trainer)``: when ``run()`` ends normally (the step count is
  reached, the input is exhausted, or a hook set ``trainer.should_stop``);
* ``teardown(trainer)``: when ``run()`` ends by any path, after ``after_run``
  or after an exception (e.g. to wait for work still running in a thread).

Hooks run in the order given. Do something every ``N`` steps with
``trainer.step % N == 0``; the built-in hooks also act once in ``after_run``
for the last step if it was not a multiple of ``every``. Print with
``trainer.log(message)``: it goes to ``logger=`` if given, else to stdout,
above the progress bar.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax

from replicator.errors import InputExhausted
from replicator.loop.console import format_metrics, format_seconds
from replicator.loop.metrics import replica_means
from replicator.runtime.inputs import InputContext, check_input_fn
from replicator.training.checkpoint import CheckpointError, CheckpointManager

if TYPE_CHECKING:
    from replicator.loop.trainer import Trainer

PyTree = Any


class Hook:
    """A base class for hooks whose methods do nothing; override the ones you need."""

    def before_run(self, trainer: Trainer) -> None:
        """Called at the start of every :meth:`Trainer.run`."""

    def after_step(self, trainer: Trainer) -> None:
        """Called after every step, with ``trainer.step/state/outputs`` updated."""

    def after_run(self, trainer: Trainer) -> None:
        """Called when :meth:`Trainer.run` ends normally."""

    def teardown(self, trainer: Trainer) -> None:
        """Called when :meth:`Trainer.run` ends, normally or by an exception."""


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
    and the times are measured over the steps since the previous line (every
    line includes the time other hooks took, such as evaluations). The first
    step of a ``run()`` that had to trace and compile the step (the first run
    of a process: after a restart too) is left out of the times and gets a
    line of its own::

        step 1: compiled in 0.79 s (tracing, compiling and running the first step; not in ms/step)

    The hook waits for the outputs of logged steps and of that first step,
    so only those synchronize with the devices. Between lines, on a
    terminal, a progress bar shows the step, steps/s and the time left.

    Args:
      every: log every this many steps (and after the last step of a run).
      progress: show the progress bar; default: when the trainer writes to a
        terminal and has no ``logger``.
      bar_width: characters between the brackets of the bar.

    Attributes:
      history: a dict per line: ``step``, ``metrics``, ``step_time`` (s),
        ``samples_per_sec`` (both None for a line whose only step was the
        compiling one, e.g. with ``every=1``).
      compiles: ``(step, seconds)`` for each first step of a run that
        compiled, as its line says.
    """

    def __init__(self, every: int = 10, *, progress: bool | None = None, bar_width: int = 30):
        super().__init__(every)
        self.progress = progress
        self.bar_width = bar_width
        self.history: list[dict[str, Any]] = []
        self.compiles: list[tuple[int, float]] = []
        self._traces: int | None = None  # the Replicator's trace count before this run's first step (None: done)
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
        self._traces = getattr(trainer.replicator, "trace_count", None)
        self._show_bar = (
            self.progress if self.progress is not None else (trainer.logger is None and trainer.console.interactive)
        )

    def after_step(self, trainer: Trainer) -> None:
        if self._traces is not None:
            self._first_step(trainer, self._traces)
        super().after_step(trainer)
        if self._show_bar:
            now = time.perf_counter()
            if now - self._last_draw >= 0.1 or trainer.step in (trainer.num_steps, self._done_at):
                self._last_draw = now
                trainer.console.status(self.bar(trainer, now))

    def _first_step(self, trainer: Trainer, traces_before: int) -> None:
        """After a run's first step: if it traced (and so compiled) the step, log that time and leave it out."""
        self._traces = None
        if getattr(trainer.replicator, "trace_count", traces_before) == traces_before:
            return  # compiled by an earlier run: an ordinary step
        jax.block_until_ready(trainer.outputs)  # its run too, not only its dispatch
        now = time.perf_counter()
        seconds = now - self._run_start[0]
        self.compiles.append((trainer.step, seconds))
        trainer.log(
            f"step {trainer.step}: compiled in {seconds:.2f} s (tracing, compiling and running the first step; "
            f"not in ms/step)"
        )
        self._last = (now, trainer.step, trainer.samples)
        self._run_start = (now, trainer.step)

    def act(self, trainer: Trainer) -> None:
        metrics = replica_means(trainer.outputs)  # waits for the step to finish
        now = time.perf_counter()
        then, step, samples = self._last
        elapsed = max(now - then, 1e-9)
        steps = trainer.step - step
        timed = steps > 0  # not when the window held only the compiling step
        record = {
            "step": trainer.step,
            "metrics": metrics,
            "step_time": elapsed / steps if timed else None,
            "samples_per_sec": (trainer.samples - samples) / elapsed if timed else None,
        }
        self.history.append(record)
        self._last = (now, trainer.step, trainer.samples)
        self._metrics = metrics
        total = f"/{trainer.num_steps}" if trainer.num_steps is not None else ""
        parts = [f"step {trainer.step}{total}"]
        if metrics:
            parts.append(format_metrics(metrics))
        if timed:
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
            f"{100 * frac:3.0f}%  {rate:.1f} steps/s  eta {format_seconds(eta)}"
        )
        if self._metrics:
            text += "  " + format_metrics(self._metrics)
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
                # prefetch=0: a batch drawn ahead would belong to this pass, not to the next evaluation.
                trainer.state, outputs = trainer.replicator.run(self._step, self._feed, trainer.state, prefetch=0)
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
            format_metrics(metrics),
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

    With ``async_save=True`` the step only holds the state (its
    device-to-host copies started) and a background thread writes and
    commits it while training goes on (:meth:`CheckpointManager.save_async`;
    with a donating Replicator the state is first copied on its devices). At
    most one save is in flight: a save that finds the previous one still
    writing waits for it, logs how long, and counts it in ``waits``. A
    failed background save is raised by the next save or at the end of the
    run; ``Trainer.run`` returns only once the save in flight is committed,
    and waits for it on an exception too (then logging, not raising, its
    failure).

    Args:
      directory: the checkpoint directory.
      every: save every this many steps.
      keep: how many checkpoints to keep (None: all).
      async_save: write and commit in a background thread (default: off, so
        that a save returns with its checkpoint committed and no memory is
        held past the step; see ``docs/guide/checkpoints.md``).
      writer_nice: the niceness added to the background save's thread
        (:class:`CheckpointManager`).

    Attributes:
      saved: the steps saved (for an asynchronous save: started).
      waits: ``(step, seconds)`` for each save that waited for the one before.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        every: int,
        *,
        keep: int | None = 3,
        async_save: bool = False,
        writer_nice: int = 0,
    ):
        super().__init__(every)
        self.manager = CheckpointManager(directory, keep=keep, writer_nice=writer_nice)
        self.async_save = bool(async_save)
        self.saved: list[int] = []
        self.waits: list[tuple[int, float]] = []

    def act(self, trainer: Trainer) -> None:
        busy = self.manager.in_flight
        start = time.perf_counter()
        trainer.save_checkpoint(self.manager, asynchronous=self.async_save)
        if busy is not None:
            waited = time.perf_counter() - start
            self.waits.append((trainer.step, waited))
            trainer.log(f"checkpoint: step {trainer.step} waited {waited:.2f} s for the save of step {busy} to finish")
        self.saved.append(trainer.step)

    def after_run(self, trainer: Trainer) -> None:
        super().after_run(trainer)
        self.manager.wait()  # the run's last checkpoint is committed (or its failure raised) when run() returns

    def teardown(self, trainer: Trainer) -> None:
        """After a failed run: wait for the save in flight (this process's part only), logging a failure."""
        try:
            self.manager.wait(collective=False)
        except CheckpointError as e:
            trainer.log(f"checkpoint: {e}")
