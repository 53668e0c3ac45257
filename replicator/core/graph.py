"""The step graph: the per-replica jaxpr of one step and what its slots mean.

:func:`~replicator.core.tracing.trace_step` builds it, every pass in
:mod:`replicator.passes` maps one to another, and
:mod:`replicator.runtime.execution` runs the last one.
"""

from __future__ import annotations

import dataclasses

from jax.extend.core import ClosedJaxpr

from replicator.core.context import ReplicaContext

__all__ = ["StepGraph"]


@dataclasses.dataclass(frozen=True)
class StepGraph:
    """The per-replica program of one step and the meaning of its slots.

    Attributes:
      jaxpr: ``(*state_leaves, *batch_leaves) -> (*new_state_leaves, *output_leaves)``
        for one replica, traced with per-replica shapes.
      context: the mesh shape the step was traced for.
      state_paths: a readable path per state leaf, e.g. ``state['w']``.
      output_paths: a readable path per output leaf.
      sharded_state: indices of state leaves stored sharded (see the field).
    """

    jaxpr: ClosedJaxpr
    context: ReplicaContext
    state_paths: tuple[str, ...]
    output_paths: tuple[str, ...]
    #: State leaves stored sharded along axis 0 over all replicas (ZeRO-1):
    #: their jaxpr input and output are this replica's 1/N chunk. The others
    #: are replicated.
    sharded_state: frozenset[int] = frozenset()

    @property
    def num_state(self) -> int:
        return len(self.state_paths)

    @property
    def num_batch(self) -> int:
        return len(self.jaxpr.jaxpr.invars) - self.num_state

    def with_jaxpr(self, jaxpr: ClosedJaxpr) -> StepGraph:
        return dataclasses.replace(self, jaxpr=jaxpr)

    def __str__(self) -> str:
        return str(self.jaxpr)
