"""Name the first optional pass that changes a step's result (after LLVM's opt-bisect).

Given a step that computes something different with its passes than without
its optimizations, :func:`bisect_passes` traces it once, runs it with no
optional pass as the reference (only the required ``lower-collectives``),
then with the first 1, 2, ... optional passes of its pass manager switched on
(``check-replica-invariance`` never: it changes nothing), all on the same
inputs, and reports the first pass whose addition changes a new-state or
output leaf, with the leaf and the size of the difference. Each try compiles
the step once.

The inputs are the ``state`` and batch you give (the first batch of every
worker if you give an ``input_fn``; a single batch is used for every worker),
or random ones of the same shapes where you give ``jax.ShapeDtypeStruct``
specs or ask for ``random_inputs=True``. One process only.

Example::

    report = rp.tools.bisect_passes(repl, step_fn, input_fn, state)
    print(report)          # "first pass that changes the result: 'shard-optimizer-update' (...)"
    report.culprit         # the pass name, or None if every prefix agrees

From a shell (exit status 1 when a pass changes the result), with
``my_train.py`` defining ``step_fn``, ``input_fn`` and ``init_state``
(``python -m replicator.bisect --help`` lists every flag)::

    python -m replicator.bisect my_train.py:step_fn --batch my_train.py:input_fn \\
        --state my_train.py:init_state --workers 1 --cores 8 --cpu-devices 8 --zero 1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from replicator.errors import MiscompileError
from replicator.passes.check_invariance import CheckReplicaInvariance
from replicator.tools.validate import GraphRunner, compare_results

__all__ = ["BisectReport", "bisect_passes"]


@dataclasses.dataclass(frozen=True)
class BisectReport:
    """What :func:`bisect_passes` found."""

    passes: tuple[str, ...]  # the optional passes tried, in the pass manager's order
    culprit: str | None  # the first one whose addition changed the result
    detail: str = ""  # the leaf and the difference

    def __str__(self) -> str:
        tried = ", ".join(self.passes) or "none"
        if self.culprit is None:
            return f"every prefix of the optional passes ({tried}) gives the reference result"
        return (
            f"first pass that changes the result: '{self.culprit}' (optional passes in order: {tried})\n"
            f"{self.detail}\n"
            f"Work around it with PassManager(disable=['{self.culprit}']); please report the step with this "
            f"report and the graphs around the pass (REPLICATOR_DUMP_DIR=dir)."
        )


def bisect_passes(
    repl: Any,
    step_fn: Callable,
    batch: Any,
    state: Any = None,
    *,
    seed: int = 0,
    random_inputs: bool = False,
) -> BisectReport:
    """Find the first optional pass of ``repl``'s pass manager that changes ``step_fn``'s result.

    Args:
      repl: the :class:`~replicator.Replicator` whose passes to bisect.
      step_fn: the step, as for ``Replicator.run``.
      batch: an ``input_fn`` (the first batch of each worker is used) or one
        worker's batch (arrays, used for every worker, or ``jax.ShapeDtypeStruct``).
      state: the state (arrays or specs), or None.
      seed: the seed of the random inputs (for leaves given as specs).
      random_inputs: run on random inputs even where arrays are given.

    Returns:
      A :class:`BisectReport`; ``print()`` it.
    """
    from replicator.pass_manager.manager import PassManager

    manager = repl.passes
    worker_batches = _worker_batches(repl, batch)
    traced = _trace(repl, step_fn, worker_batches[0], state)
    active = [p for p in manager.passes if p.name not in manager.disabled]
    required = [p for p in active if p.required]
    optional = [p for p in active if not p.required and not isinstance(p, CheckReplicaInvariance)]
    state_leaves = [] if state is None else jax.tree.leaves(state)
    worker_leaves = [jax.tree.leaves(b) for b in worker_batches]
    runner = GraphRunner(
        traced,
        seed=seed,
        state=None if random_inputs or not _concrete(state_leaves) else state_leaves,
        batch=None
        if random_inputs or not all(map(_concrete, worker_leaves))
        else [np.concatenate([np.asarray(x) for x in rows], axis=0) for rows in zip(*worker_leaves, strict=True)],
        mesh=repl.mesh,
    )
    reference = runner.run(PassManager(required, validate=False).run(traced).final)
    for k in range(1, len(optional) + 1):
        chosen = {id(p) for p in optional[:k]} | {id(p) for p in required}
        prefix = PassManager([p for p in active if id(p) in chosen], validate=False)
        got = runner.run(prefix.run(traced).final)
        try:
            compare_results(reference, got, traced, optional[k - 1].name, exact=all(p.exact for p in optional[:k]))
        except MiscompileError as e:
            return BisectReport(tuple(p.name for p in optional), optional[k - 1].name, str(e).split("\n")[0])
    return BisectReport(tuple(p.name for p in optional), None)


def _concrete(leaves: Sequence[Any]) -> bool:
    return not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def _worker_batches(repl: Any, batch: Any) -> list[Any]:
    """One batch per worker: the first of each worker's ``input_fn`` stream, or ``batch`` for all."""
    if not callable(batch):
        return [batch] * repl.num_workers
    if len(repl.local_workers) != repl.num_workers:
        raise ValueError("bisect_passes runs in one process: use a Replicator whose workers are all local.")
    batches = []
    for worker in range(repl.num_workers):
        try:
            batches.append(next(iter(batch(repl.input_context(worker)))))
        except StopIteration:
            raise ValueError(f"bisect_passes: input_fn yielded no batch for worker {worker}.") from None
    return batches


def _trace(repl: Any, step_fn: Callable, batch: Any, state: Any) -> Any:
    """The traced per-replica graph, before any pass (no pass runs)."""
    from replicator.core.tracing import leaf_signature, signature_spec, trace_step
    from replicator.runtime.inputs import check_worker_batch

    c = repl.cores_per_worker
    check_worker_batch(batch, c, 0)

    def per_replica(a: Any) -> jax.ShapeDtypeStruct:
        shape, dtype = leaf_signature(a)
        return signature_spec(((shape[0] // c, *shape[1:]), dtype))

    batch_specs = jax.tree.map(per_replica, batch)
    state_specs = None if state is None else jax.tree.map(lambda a: signature_spec(leaf_signature(a)), state)
    return trace_step(step_fn, state_specs, batch_specs, repl.context).graph


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------
