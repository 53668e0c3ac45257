"""The step graph: the per-replica jaxpr of one step and what its slots mean.

:func:`~replicator.core.tracing.trace_step` builds it, every pass in
:mod:`replicator.passes` maps one to another, and
:mod:`replicator.runtime.execution` runs the last one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from jax.extend.core import ClosedJaxpr, Var

from replicator.core.context import ReplicaContext

if TYPE_CHECKING:
    from replicator.passes.records import CollectiveRecord, Origin

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
      collectives: what ``lower-collectives`` emitted (see the field).
      collective_origins: the user's tensors each placeholder carries (see the field).
    """

    jaxpr: ClosedJaxpr
    context: ReplicaContext
    state_paths: tuple[str, ...]
    output_paths: tuple[str, ...]
    #: State leaves stored sharded along axis 0 over all replicas (ZeRO-1):
    #: their jaxpr input and output are this replica's 1/N chunk. The others
    #: are replicated.
    sharded_state: frozenset[int] = frozenset()
    #: One record per placeholder that ``lower-collectives`` lowered: kind,
    #: group, algorithm, wire dtype, payload and emitted bytes
    #: (:class:`~replicator.passes.records.CollectiveRecord`); empty before
    #: lowering. The communication report counts from it.
    collectives: tuple[CollectiveRecord, ...] = ()
    #: For placeholders that a pass made out of others (fused buckets,
    #: compressed or hierarchical all-reduces), keyed by the new placeholder's
    #: first result: how many of the user's tensors it carries, and their
    #: source lines (:class:`~replicator.passes.records.Origin`).
    collective_origins: Mapping[Var, Origin] = dataclasses.field(default_factory=dict, compare=False, hash=False)

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
