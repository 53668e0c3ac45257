"""Rewrite passes over the per-replica step graph, and the pipeline that runs them."""

from replicator.passes.base import Pass as Pass
from replicator.passes.base import PassResult as PassResult
from replicator.passes.base import StepGraph as StepGraph
from replicator.passes.base import count_primitives as count_primitives
from replicator.passes.base import rewrite_graph as rewrite_graph
from replicator.passes.bisect import BisectReport as BisectReport
from replicator.passes.bisect import bisect_passes as bisect_passes
from replicator.passes.capture import CaptureCollectives as CaptureCollectives
from replicator.passes.capture import CaptureError as CaptureError
from replicator.passes.compress import CompressCommunication as CompressCommunication
from replicator.passes.costmodel import PRESETS as PRESETS
from replicator.passes.costmodel import Link as Link
from replicator.passes.costmodel import Prediction as Prediction
from replicator.passes.costmodel import Topology as Topology
from replicator.passes.costmodel import calibrate as calibrate
from replicator.passes.costmodel import predict as predict
from replicator.passes.fuse_allreduce import FuseAllReduce as FuseAllReduce
from replicator.passes.hierarchical import HierarchicalAllReduce as HierarchicalAllReduce
from replicator.passes.invariance import CheckReplicaInvariance as CheckReplicaInvariance
from replicator.passes.invariance import analyze as analyze_invariance
from replicator.passes.lower_collectives import LowerCollectives as LowerCollectives
from replicator.passes.pipeline import Lowered as Lowered
from replicator.passes.pipeline import Pipeline as Pipeline
from replicator.passes.pipeline import Stage as Stage
from replicator.passes.pipeline import default_passes as default_passes
from replicator.passes.shard_optimizer import ShardOptimizerUpdate as ShardOptimizerUpdate
from replicator.passes.simplify import Simplify as Simplify
from replicator.passes.verify import GraphInvariantError as GraphInvariantError
from replicator.passes.verify import verify_graph as verify_graph

__all__ = [
    "PRESETS",
    "BisectReport",
    "CaptureCollectives",
    "CaptureError",
    "CheckReplicaInvariance",
    "CompressCommunication",
    "FuseAllReduce",
    "GraphInvariantError",
    "HierarchicalAllReduce",
    "Link",
    "LowerCollectives",
    "Lowered",
    "Pass",
    "PassResult",
    "Pipeline",
    "Prediction",
    "ShardOptimizerUpdate",
    "Simplify",
    "Stage",
    "StepGraph",
    "Topology",
    "analyze_invariance",
    "bisect_passes",
    "calibrate",
    "count_primitives",
    "default_passes",
    "predict",
    "rewrite_graph",
    "verify_graph",
]
