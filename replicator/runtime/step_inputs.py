"""Where a ``Replicator``'s steps get their batches: an ``input_fn``'s iterators (one per local worker,
continued from call to call, drawn ahead with ``prefetch``), an iterator of batches, or the batch itself;
each checked and placed on the mesh before its step.

``Replicator(prefetch=n)`` draws ``n`` batches from ``input_fn`` and places them on the devices right after
a step is dispatched, while it runs. The default (``None``) is 1 on accelerators (GPU, TPU) in one process
and 0 on CPU devices (they are the host's own cores: there is no separate device to overlap with; drawing
ahead was slower or within noise in ``benchmarks/host_overhead.py``) and on a mesh that spans processes
(the launcher's watchdog expects each process to draw its step's batch within that step). Turn it off (for
the Replicator, or for one ``input_fn`` with ``run(..., prefetch=0)``) when ``input_fn``'s batches depend on
what happens after a step returns (on its outputs, or on a variable the loop sets between steps): a
prefetched batch was drawn before that. A prefetched batch takes device memory for one more batch. Errors of
``input_fn`` are raised by the step whose batch it was drawing, and ``Replicator.input_position`` counts only
batches steps have taken.

>>> inputs = StepInputs(rp.Replicator(1, 2))
>>> batch = inputs.given({"x": np.ones((4, 3), np.float32)})  # this process's batch, split over its replicas
>>> [np.shape(leaf) for leaf in batch.batches[0].values()]
[(4, 3)]
>>> check_prefetch(-1)
Traceback (most recent call last):
...
ValueError: prefetch must be a non-negative int (0: off), got -1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from replicator.errors import InputExhausted
from replicator.runtime.distributed import progress
from replicator.runtime.execution import place_batch, spans_processes
from replicator.runtime.inputs import (
    Batch,
    BatchChecker,
    InputContext,
    InputRegistry,
    WorkerInputs,
    check_input_fn,
    split_process_batch,
)
from replicator.runtime.retrace import NEW_INPUT_WARNING_AFTER, warn_new_input_fn

__all__ = ["StepInputs", "check_max_in_flight", "check_prefetch"]


class StepInputs:
    """The batches of one Replicator's steps (``repl``: its mesh, workers and ``input_context``)."""

    def __init__(self, repl: Any, warned: set[str] | None = None) -> None:
        self.repl = repl
        #: The input functions' iterators, by function (held weakly).
        self.registry = InputRegistry()
        self.checker = BatchChecker(repl.cores_per_worker)
        self.warned = set() if warned is None else warned
        self._contexts: list[InputContext] | None = None

    @property
    def contexts(self) -> list[InputContext]:
        """The local workers' contexts, in order."""
        if self._contexts is None:
            self._contexts = [self.repl.input_context(w) for w in self.repl.local_workers]
        return self._contexts

    def worker_inputs(self, input_fn: Callable) -> WorkerInputs:
        """``input_fn``'s iterators, started at its first use (a warning where every call brings a new one)."""
        inputs = self.registry.get(input_fn)
        if inputs is None:
            check_input_fn(input_fn)
            inputs, in_a_row = self.registry.start(input_fn, self.contexts)
            if in_a_row >= NEW_INPUT_WARNING_AFTER:
                warn_new_input_fn(input_fn, in_a_row + 1, self.warned)
        return inputs

    def given(self, data: Any) -> Batch:
        """The batch of a ``run`` given a batch or an iterator of batches instead of an ``input_fn``."""
        if type(data) not in (dict, list, tuple) and not isinstance(data, (np.ndarray, jax.Array)):
            if data is None:
                raise TypeError(
                    "Replicator.run takes an input_fn (a callable taking an InputContext and returning an iterable "
                    "of batches), an iterator of batches, or one batch (a pytree of arrays); got None."
                )
            if isinstance(data, Iterator):
                try:
                    data = next(data)
                except StopIteration:
                    raise InputExhausted(
                        "the iterator of batches given to run is exhausted. Stop the loop there (catch "
                        "replicator.InputExhausted) or give it more batches (e.g. loop over epochs)."
                    ) from None
            elif isinstance(data, Iterable) and not hasattr(data, "__array__") and jax.tree_util.all_leaves([data]):
                raise TypeError(
                    f"Replicator.run was given a {type(data).__name__}, an iterable that is not an iterator: pass "
                    f"iter(it) once, outside the loop (run then draws one batch from it per call), a batch, or an "
                    f"input_fn."
                )
        return Batch(split_process_batch(data, self.contexts))

    def check(self, batch: Batch) -> None:
        """Check ``batch`` (its signature and leaves, once)."""
        if batch.signature is None:
            batch.signature, batch.leaves = self.checker.check(batch.batches, self.contexts)

    def prefetch(self, inputs: WorkerInputs, depth: int) -> None:
        """Draw, check and place batches of ``inputs`` until ``depth`` wait for their steps.

        A draw that fails is kept, and raised by the step that takes it; a batch that fails its checks or
        its placement is checked and placed again by its step (which raises the error there, in order).
        """
        step = progress.current_step()
        drew = False
        while len(inputs.pending) < depth and not (inputs.pending and inputs.pending[-1].error is not None):
            progress.set_phase("input", step + 1)
            drew = True
            batch = inputs.draw_ahead()
            if batch.error is None:
                self._prepare(batch, inputs)
        if drew:
            progress.set_phase("step", step)

    def _prepare(self, batch: Batch, inputs: WorkerInputs) -> None:
        try:
            batch.signature, batch.leaves = self.checker.check(batch.batches, inputs.contexts)
            batch.placed = place_batch(
                batch.leaves, self.repl.mesh, self.repl.num_workers, nbytes=batch.signature.nbytes
            )
        except Exception:  # noqa: BLE001 - done again when the batch's step takes it, which raises it there
            batch.signature = batch.leaves = batch.placed = None


def check_prefetch(prefetch: Any, mesh: Mesh | None = None) -> int:
    """``prefetch`` if it is a non-negative int, else a ``ValueError``; ``None`` (with the ``mesh``): the
    default (module docstring)."""
    if prefetch is None and mesh is not None:
        prefetch = 0 if spans_processes(mesh) or mesh.devices.flat[0].platform == "cpu" else 1
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative int (0: off), got {prefetch!r}.")
    return prefetch


def check_max_in_flight(max_in_flight: Any, mesh: Mesh) -> int:
    """``Replicator(max_in_flight=...)``: the steps dispatched ahead of the host, ``None``: 2 on CPU (XLA's CPU
    backend deadlocks with many queued executions with collectives over emulated devices), else unbounded."""
    if max_in_flight is None:
        max_in_flight = 2 if mesh.devices.flat[0].platform == "cpu" else 0
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 0:
        raise ValueError(f"max_in_flight must be a non-negative int (0: unbounded), got {max_in_flight!r}.")
    return max_in_flight
