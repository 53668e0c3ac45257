"""The rewrite passes (``StepGraph -> StepGraph``) and, re-exported for convenience,
the pass manager that runs them (:class:`PassManager`, formerly ``Pipeline``) and the analyses
they use.

``rp.passes.calibrate``, ``PRESETS``, ``Topology``, ``Link``, ``Prediction``,
``predict``, ``bisect_passes`` and ``BisectReport`` moved to :mod:`replicator.cost`
and :mod:`replicator.tools`; the old names still work, with a ``DeprecationWarning``
(``Pipeline`` too, now ``PassManager``, and ``Stage``, now ``PassSnapshot``).
"""

import importlib
import warnings
from typing import Any

from replicator.analysis.invariance import analyze as analyze_invariance
from replicator.core.graph import StepGraph as StepGraph
from replicator.core.jaxprs import count_primitives as count_primitives
from replicator.pass_manager.contract import Pass as Pass
from replicator.pass_manager.contract import PassResult as PassResult
from replicator.pass_manager.contract import rewrite_graph as rewrite_graph
from replicator.pass_manager.manager import Lowered as Lowered
from replicator.pass_manager.manager import PassManager as PassManager
from replicator.pass_manager.manager import PassSnapshot as PassSnapshot
from replicator.pass_manager.manager import warn_renamed
from replicator.pass_manager.verify import GraphInvariantError as GraphInvariantError
from replicator.pass_manager.verify import verify_graph as verify_graph
from replicator.passes.capture import CaptureCollectives as CaptureCollectives
from replicator.passes.capture import CaptureError as CaptureError
from replicator.passes.check_invariance import CheckReplicaInvariance as CheckReplicaInvariance
from replicator.passes.compress import CompressCommunication as CompressCommunication
from replicator.passes.defaults import default_passes as default_passes
from replicator.passes.fold import FoldReplicas as FoldReplicas
from replicator.passes.fuse_collectives import FuseAllReduce as FuseAllReduce
from replicator.passes.fuse_collectives import FuseCollectives as FuseCollectives
from replicator.passes.hierarchical import HierarchicalAllReduce as HierarchicalAllReduce
from replicator.passes.lower_collectives import LowerCollectives as LowerCollectives
from replicator.passes.shard_optimizer import ShardOptimizerUpdate as ShardOptimizerUpdate
from replicator.passes.share_slice_kernels import ShareSliceKernels as ShareSliceKernels
from replicator.passes.simplify import Simplify as Simplify

#: Names that moved out of ``rp.passes`` (resolved on first use, with a warning):
#: the cost models and the tools sit above the passes.
MOVED: dict[str, str] = {
    "PRESETS": "replicator.cost.topology",
    "Link": "replicator.cost.topology",
    "Topology": "replicator.cost.topology",
    "Prediction": "replicator.cost.collectives",
    "predict": "replicator.cost.collectives",
    "calibrate": "replicator.tools.calibrate",
    "BisectReport": "replicator.tools.bisect",
    "bisect_passes": "replicator.tools.bisect",
}


def __getattr__(name: str) -> Any:
    if name == "Pipeline":  # renamed: "pipeline" means pipeline parallelism only
        warnings.warn(
            "replicator.passes.Pipeline is now replicator.passes.PassManager (rp.PassManager).",
            DeprecationWarning,
            stacklevel=2,
        )
        return PassManager
    if name == "Stage":  # renamed: a stage is a pipeline stage only
        warn_renamed(
            "replicator.passes.Stage is now replicator.passes.PassSnapshot (Lowered.snapshots): a stage is a "
            "pipeline stage only."
        )
        return PassSnapshot
    if name not in MOVED:
        raise AttributeError(f"module 'replicator.passes' has no attribute {name!r}")
    home = MOVED[name]
    public = home.rsplit(".", 1)[0]  # rp.cost / rp.tools
    warnings.warn(
        f"replicator.passes.{name} moved: use {public.replace('replicator', 'rp')}.{name} ({home}).",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(home), name)


__all__ = [
    "CaptureCollectives",
    "CaptureError",
    "CheckReplicaInvariance",
    "CompressCommunication",
    "FoldReplicas",
    "FuseAllReduce",
    "FuseCollectives",
    "GraphInvariantError",
    "HierarchicalAllReduce",
    "LowerCollectives",
    "Lowered",
    "Pass",
    "PassResult",
    "PassManager",
    "PassSnapshot",
    "ShardOptimizerUpdate",
    "ShareSliceKernels",
    "Simplify",
    "StepGraph",
    "analyze_invariance",
    "count_primitives",
    "default_passes",
    "rewrite_graph",
    "verify_graph",
]
