"""What a pipelined ``Replicator`` does around its pipeline: the global batch from its workers' inputs, the
pass options it takes (ZeRO's level), the cost model it describes stages with, and the check of the packed
rows every ``check_state_every`` steps. The pipeline itself is :class:`~replicator.stages.replicas.PipelinedReplicas`
(one compiled program per step, ``replicator/stages/``); the data-parallel path is the pass manager's.

>>> np.asarray(in_worker_order([{"x": np.zeros((2, 1))}, {"x": np.ones((2, 1))}])["x"]).ravel().tolist()
[0.0, 0.0, 1.0, 1.0]
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from replicator.cost.compute import equation_time
from replicator.cost.report import tensor_lines
from replicator.cost.topology import PRESETS
from replicator.pass_manager.manager import PassManager
from replicator.runtime.consistency import check_copies_agree
from replicator.stages.replicas import PipelinedReplicas

__all__ = ["PipelineFront", "gathered_in_worker_order", "in_worker_order", "zero_of"]

PyTree = Any


def in_worker_order(batches: Sequence[PyTree]) -> PyTree:
    """One batch of every local worker as the global batch of a pipelined step: each leaf concatenated in
    worker order."""
    return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *batches)


def gathered_in_worker_order(local: PyTree, workers: list[int]) -> PyTree:
    """The global batch of a pipelined step in a job of several processes: this process's workers' batch
    (``local``, theirs in order) joined with every other process's, in worker order, on every process. A
    collective: every process calls it once per step."""
    me, count = jax.process_index(), len(workers)
    if workers != list(range(me * count, (me + 1) * count)):
        raise ValueError(
            f"process {me} runs workers {workers}; a pipelined Replicator joins the processes' batches in "
            "process order, which needs each process to run the same number of consecutive workers (one "
            "each: python -m replicator.launch)."
        )
    leaves, treedef = jax.tree.flatten(local)
    shapes = [(*np.shape(x), str(np.asarray(x).dtype)) for x in leaves]
    every = multihost_utils.process_allgather(np.array([zlib.crc32(repr(shapes).encode())], np.int64))
    if len(set(np.ravel(every).tolist())) > 1:
        raise ValueError(
            f"the workers' batches differ in shape or dtype between the processes (process {me}: {shapes}); "
            "every worker's input_fn must yield batches of the same shapes at each step."
        )
    return treedef.unflatten([np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in leaves])


def zero_of(passes: PassManager | None) -> int:
    """The ZeRO level a pipelined Replicator takes from ``passes=``: ``k`` of ``rp.PassManager.default(zero=k)``
    (ZeRO on each pipeline stage's data-parallel replicas, :mod:`~replicator.stages.chunks`).
    Any other pass manager is refused: a pipelined step runs the schedule's loop, not the passes. The threshold
    ``shard_optimizer_min_bytes`` is taken and has nothing to do: a stage's leaves are packed into one row, cut
    in ``D`` chunks whole."""
    if not isinstance(passes, PassManager):
        return 0  # None; anything else is refused by the constructor's TypeError
    zero = [p for p in passes.passes if p.name == "shard-optimizer-update"]
    level = zero[0].stage if zero else 0
    threshold = {"shard_optimizer_min_bytes": zero[0].min_tensor_bytes} if zero else {}
    if passes.key() != PassManager.default(zero=level, **threshold).key():
        raise ValueError(
            "passes= on a pipelined Replicator takes rp.PassManager.default(zero=k) only (k = 0..3: ZeRO on each "
            "pipeline stage's data-parallel replicas): its stages run their own program (the schedule's loop), not "
            "the pass manager, so other options (fusion, compression, hierarchical all-reduce, disabled passes) "
            f"would be ignored; got {passes!r}. Leave them out, or drop parallelism=rp.Parallelism(stages=...) to "
            "run the step data parallel with them."
        )
    return level


def stage_cost(eqns: list) -> float:
    """Seconds of a stage's equations by the cost model (the emulated-CPU figures)."""
    compute = PRESETS["cpu-emulated"].compute
    assert compute is not None
    return sum(equation_time(eqn, compute) for eqn in eqns)


class PipelineFront:
    """A pipelined Replicator's calls, around its :class:`~replicator.stages.replicas.PipelinedReplicas`.

    Args:
      replicas: the pipeline on the Replicator's devices.
      check_state_every: as for ``Replicator``: every this many steps, each stage's replicas are checked to
        hold the same rows.
    """

    def __init__(self, replicas: PipelinedReplicas, check_state_every: int | None) -> None:
        self.replicas, self.check_state_every = replicas, check_state_every
        self.steps_run = 0

    def global_batch(self, data: Any, worker_batches: Callable[[Callable], list], local_workers: list[int]) -> PyTree:
        """The global batch of a step: ``data`` itself, the next of an iterator, or an ``input_fn``'s next batch
        of every worker (``worker_batches(input_fn)``), concatenated in worker order (across processes: every
        process gets it)."""
        if isinstance(data, Iterator):
            return next(data)
        if not callable(data):
            return data
        batches = worker_batches(data)
        if jax.process_count() > 1:
            return gathered_in_worker_order(in_worker_order(batches), local_workers)
        return in_worker_order(batches)

    def ran(self) -> None:
        """Count a step; every ``check_state_every`` steps, check that each stage's replicas hold the same copy
        of its rows."""
        self.steps_run += 1
        if self.check_state_every and self.steps_run % self.check_state_every == 0:
            rows = jax.tree_util.tree_leaves_with_path(self.replicas.last_rows)
            check_copies_agree([x for _, x in rows], [f"the packed state{jax.tree_util.keystr(k)}" for k, _ in rows])

    def run_step(self, step_fn: Callable, batch: PyTree, state: PyTree) -> tuple[Any, int]:
        """The user's step on the global ``batch``; returns ``(new_state, outputs)`` and the steps it compiled."""
        built = self.replicas.user_steps_built
        out = self.replicas.run_step(step_fn, batch, state)
        self.ran()
        return out, self.replicas.user_steps_built - built

    def run(self, loss_fn: Callable, optimizer: Any, batch: PyTree, state: tuple) -> tuple:
        """``run_pipelined``: a loss and an optimizer on the global ``batch``."""
        out = self.replicas.run(loss_fn, optimizer, batch, state)
        self.ran()
        return out

    def explain(self, step_fn: Callable, batch: PyTree, state: PyTree) -> Any:
        """The :class:`~replicator.stages.replicas.PipelineReport` of the step ``run_step`` would run, with the
        collectives over the tensor axis per micro-batch."""
        report = self.replicas.describe_step(step_fn, batch, state, stage_cost=stage_cost, memory=True)
        return dataclasses.replace(report, tensor_lines=tuple(tensor_lines(report.tensor, "micro-batch")))

    def describe(self, loss_fn: Callable, optimizer: Any, batch: PyTree, state: tuple, memory: bool) -> Any:
        """What ``run`` runs, without running it (``Replicator.describe_pipeline``)."""
        return self.replicas.describe(loss_fn, optimizer, batch, state, stage_cost=stage_cost, memory=memory)


def first_batches(input_fn: Callable, contexts: Sequence[Any]) -> PyTree:
    """The first batch of a fresh iterator of each context's worker, in worker order (a step's shapes)."""
    try:
        parts = [next(iter(input_fn(ctx))) for ctx in contexts]
    except StopIteration:
        raise ValueError("explain: input_fn yielded no batch to trace the step with.") from None
    return in_worker_order(parts)
