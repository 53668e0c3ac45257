"""What a step sends and how long it takes, computed from a lowered graph's records
without running anything: topologies and presets, the collective and compute time
models, the communication report, and ``auto`` (the options the models predict
fastest). Measuring hardware (``calibrate``) runs JAX and lives in :mod:`replicator.tools`."""

from replicator.cost.auto import AutoPipeline as AutoPipeline
from replicator.cost.collectives import Prediction as Prediction
from replicator.cost.collectives import collective_time as collective_time
from replicator.cost.collectives import predict as predict
from replicator.cost.compute import Compute as Compute
from replicator.cost.report import CommunicationReport as CommunicationReport
from replicator.cost.topology import PRESETS as PRESETS
from replicator.cost.topology import Link as Link
from replicator.cost.topology import Topology as Topology
from replicator.cost.topology import get_topology as get_topology

__all__ = [
    "PRESETS",
    "AutoPipeline",
    "CommunicationReport",
    "Compute",
    "Link",
    "Prediction",
    "Topology",
    "collective_time",
    "get_topology",
    "predict",
]
