"""Tensor parallelism: a model axis beside the data and stage axes, from the one-device step.

:class:`TensorPlan` names the parameters to split (globs over state paths);
:class:`TensorParallel` runs a step with them split over a ``'tensor'`` mesh
axis. The rewrite is one walk over the step's jaxpr
(:mod:`replicator.tensor.interpret`) with a placement rule per primitive
(:mod:`replicator.tensor.rules`); collectives go where a consumer needs a
placement its producer does not give (:mod:`replicator.tensor.placement`).
"""

from replicator.tensor.parallelize import TensorParallel, infer_state_placements
from replicator.tensor.placement import (
    PARTIAL,
    REPLICATED,
    Collective,
    Partial,
    Placement,
    Replicated,
    Shard,
    TensorPlacementError,
)
from replicator.tensor.plan import TensorPlan, leaf_paths

__all__ = [
    "PARTIAL",
    "REPLICATED",
    "Collective",
    "Partial",
    "Placement",
    "Replicated",
    "Shard",
    "TensorParallel",
    "TensorPlacementError",
    "TensorPlan",
    "infer_state_placements",
    "leaf_paths",
]
