"""What a step sends and how long it takes, computed from a lowered graph's records
without running anything: topologies and presets, the collective and compute time
models, the communication report, and ``auto`` (the options the models predict
fastest). Measuring hardware (``calibrate``) runs JAX and lives in :mod:`replicator.tools`.
``AutoPipeline`` is now ``AutoPassManager`` (the old name warns ``DeprecationWarning``)."""

import warnings
from typing import Any

from replicator.cost.auto import AutoPassManager as AutoPassManager
from replicator.cost.collectives import Prediction as Prediction
from replicator.cost.collectives import collective_time as collective_time
from replicator.cost.collectives import predict as predict
from replicator.cost.compute import Compute as Compute
from replicator.cost.report import CommunicationReport as CommunicationReport
from replicator.cost.topology import PRESETS as PRESETS
from replicator.cost.topology import Link as Link
from replicator.cost.topology import Topology as Topology
from replicator.cost.topology import get_topology as get_topology


def __getattr__(name: str) -> Any:
    if name == "AutoPipeline":  # the old name ("pipeline" means pipeline parallelism only)
        warnings.warn("rp.cost.AutoPipeline is now rp.cost.AutoPassManager.", DeprecationWarning, stacklevel=2)
        return AutoPassManager
    raise AttributeError(f"module 'replicator.cost' has no attribute {name!r}")


__all__ = [
    "PRESETS",
    "AutoPassManager",
    "CommunicationReport",
    "Compute",
    "Link",
    "Prediction",
    "Topology",
    "collective_time",
    "get_topology",
    "predict",
]
