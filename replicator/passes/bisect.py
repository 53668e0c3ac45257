"""Name the first optional pass that changes a step's result (after LLVM's opt-bisect).

Given a step that computes something different with a pipeline than without
its optimizations, :func:`bisect_passes` traces it once, runs it with no
optional pass as the reference (only ``lower-collectives``), then with the
first 1, 2, ... optional passes of the pipeline switched on, on the same
random inputs, and reports the first pass whose addition changes a new-state
or output leaf, with the leaf and the size of the difference.

Example::

    report = rp.passes.bisect_passes(repl, step_fn, batch, state)
    print(report)          # "first pass that changes the result: 'shard-optimizer-update' (...)"
    report.culprit         # the pass name, or None if every prefix agrees
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from replicator.errors import MiscompileError
from replicator.passes.invariance import CheckReplicaInvariance
from replicator.passes.validate import GraphRunner, compare_results

__all__ = ["BisectReport", "bisect_passes"]


@dataclasses.dataclass(frozen=True)
class BisectReport:
    """What :func:`bisect_passes` found."""

    passes: tuple[str, ...]  # the optional passes tried, in pipeline order
    culprit: str | None  # the first one whose addition changed the result
    detail: str = ""  # the leaf and the difference

    def __str__(self) -> str:
        tried = ", ".join(self.passes) or "none"
        if self.culprit is None:
            return f"every prefix of the optional passes ({tried}) gives the reference result"
        return (
            f"first pass that changes the result: '{self.culprit}' (optional passes in order: {tried})\n{self.detail}"
        )


def bisect_passes(repl: Any, step_fn: Any, batch: Any, state: Any = None, *, seed: int = 0) -> BisectReport:
    """Find the first optional pass of ``repl``'s pipeline that changes ``step_fn``'s result.

    Args:
      repl: the :class:`~replicator.Replicator` whose pipeline to bisect.
      step_fn: the step, as for ``Replicator.run``.
      batch: one worker's batch (arrays or ``jax.ShapeDtypeStruct``).
      state: the state (arrays or specs), or None.
      seed: the seed of the random inputs the graphs run on.

    Returns:
      A :class:`BisectReport`; ``print()`` it.
    """
    from replicator.passes.pipeline import Pipeline

    pipeline = repl.pipeline
    traced = _trace(repl, step_fn, batch, state)
    active = [p for p in pipeline.passes if p.name not in pipeline.disabled]
    required = [p for p in active if p.required]
    optional = [p for p in active if not p.required and not isinstance(p, CheckReplicaInvariance)]
    runner = GraphRunner(traced, seed=seed)
    reference = runner.run(Pipeline(required, validate=False).run(traced).final)
    for k in range(1, len(optional) + 1):
        chosen = {id(p) for p in optional[:k]} | {id(p) for p in required}
        prefix = Pipeline([p for p in active if id(p) in chosen], validate=False)
        got = runner.run(prefix.run(traced).final)
        try:
            compare_results(reference, got, traced, optional[k - 1].name, exact=all(p.exact for p in optional[:k]))
        except MiscompileError as e:
            return BisectReport(tuple(p.name for p in optional), optional[k - 1].name, str(e).split("\n")[0])
    return BisectReport(tuple(p.name for p in optional), None)


def _trace(repl: Any, step_fn: Any, batch: Any, state: Any) -> Any:
    """The traced per-replica graph, before any pass (no pass runs)."""
    from replicator.tracing import trace_step

    c = repl.cores_per_worker
    batch_specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // c, *a.shape[1:]), a.dtype), batch)
    state_specs = None if state is None else jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    return trace_step(step_fn, state_specs, batch_specs, repl.context).graph
