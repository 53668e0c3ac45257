"""The tensor axis of a :class:`~replicator.Replicator`'s mesh: where it goes and what it does to a step.

The mesh becomes ``('workers', 'cores', 'tensor')``: each worker's devices are cut into groups of
``T`` consecutive devices (the tensor axis innermost, so a group shares a host), and the data-parallel
replicas are the groups. The per-replica graph the Replicator traced is split for one device of a
group (:func:`~replicator.tensor.split_graph.split_step_graph`) before the passes run.

>>> axis = TensorAxis(2, TensorPlan({"w": "column"}))
>>> dict(axis.mesh(rp.build_mesh(1, 4)).shape)
{'workers': 1, 'cores': 2, 'tensor': 2}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr
from jax.sharding import Mesh

from replicator.core.context import REPLICA_AXES
from replicator.core.graph import StepGraph
from replicator.tensor.auto import Auto, resolve_plan
from replicator.tensor.interpret import BATCH
from replicator.tensor.plan import TensorPlan, leaf_paths
from replicator.tensor.split_graph import SplitJaxpr, split_jaxpr, split_step_graph

__all__ = ["TensorAxis"]


@dataclasses.dataclass(frozen=True)
class TensorAxis:
    """``T`` devices per replica, the plan of what is split over them, and the axis's name."""

    size: int
    plan: TensorPlan | Auto
    allow_gather: bool = False
    sequence_parallel: int | None = None
    name: str = "tensor"
    collective_matmul: bool = False
    #: Whether collective matmul may be used at all (not inside pipeline stages, where a ring's ``ppermute``
    #: in one stage's branch would wait for every device); ``plan="auto"`` chooses it by the cost model.
    rings_allowed: bool = True

    def mesh(self, replicas: Mesh) -> Mesh:
        """``replicas``' ``('workers', 'cores')`` devices with each worker's cut into groups of ``size``."""
        workers, cores = replicas.devices.shape
        if cores % self.size:
            raise ValueError(
                f"Parallelism(tensor={self.size}) cuts each worker's devices into groups of {self.size}, and a "
                f"worker has {cores} (cores_per_worker={cores}), not a multiple of {self.size}.\n"
                f"Fix: a tensor degree that divides cores_per_worker (the tensor axis stays within a worker)."
            )
        devices = replicas.devices.reshape(workers, cores // self.size, self.size)
        return Mesh(devices, (*REPLICA_AXES, self.name))

    def split_jaxpr(self, closed: ClosedJaxpr, state: Any, names: Sequence[str]) -> SplitJaxpr:
        """``closed(state..., batch...)`` as one device of a tensor group runs it (a pipeline's step, before
        its stage split); ``state``: the state's pytree (the plan's paths); ``names``: each input's name."""
        num_state = len(jax.tree.leaves(state))
        plan, sequence_parallel, collective_matmul = self.resolve(closed, state)
        return split_jaxpr(
            closed,
            plan.placements(state, self.size),
            names,
            num_state=num_state,
            size=self.size,
            axis=self.name,
            allow_gather=self.allow_gather,
            sequence_parallel=sequence_parallel,
            collective_matmul=collective_matmul,
        )

    def split(self, graph: StepGraph, state: Any) -> StepGraph:
        """``graph`` (per replica) as one device of a tensor group runs it; ``state``: the state's
        pytree of arrays or shapes (the plan's paths), or None."""
        plan, sequence_parallel, collective_matmul = self.plan, self.sequence_parallel, self.collective_matmul
        if state is not None:
            plan, sequence_parallel, collective_matmul = self.resolve(graph.jaxpr, state)
        named = plan.placements(state, self.size) if state is not None else []
        return split_step_graph(
            graph,
            named,
            size=self.size,
            axis=self.name,
            allow_gather=self.allow_gather,
            sequence_parallel=sequence_parallel,
            collective_matmul=collective_matmul,
        )

    def resolve(self, closed: ClosedJaxpr, state: Any) -> tuple[Any, int | None, bool]:
        """The plan for ``closed(state..., batch...)``, its sequence parallelism and collective matmul: as
        given, or ``plan='auto'``'s choice (:mod:`replicator.tensor.auto`), over ``state``'s paths."""
        paths = leaf_paths(state)
        return resolve_plan(
            self.plan,
            closed,
            paths + [BATCH] * (len(closed.jaxpr.invars) - len(paths)),
            num_state=len(paths),
            size=self.size,
            sequence_parallel=self.sequence_parallel,
            allow_gather=self.allow_gather,
            collective_matmul=self.collective_matmul,
            rings_allowed=self.rings_allowed,
        )
