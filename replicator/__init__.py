"""replicator: an in-graph replication compiler for JAX, after TF-Replicator.

Write a step for one device, call cross-replica placeholders (``all_mean``,
``all_gather``, ...) inside it, and run it on every replica of a
``('workers', 'cores')`` device mesh::

    import replicator as rp
    rp.force_cpu_devices(8)
    repl = rp.Replicator(num_workers=1, cores_per_worker=8)
    state, outputs = repl.run(step_fn, input_fn, state)
"""

import warnings
from typing import Any

from replicator import _jax_compat
from replicator import cost as cost  # rp.cost: topologies, time models, the report, auto
from replicator import tools as tools  # rp.tools: calibrate, bisect_passes, translation validation
from replicator.api import CompiledStep as CompiledStep
from replicator.api import Replicator as Replicator
from replicator.core import primitives as primitives  # rp.primitives.PLACEHOLDERS, the placeholder primitives
from replicator.core.callbacks import invariant_callback as invariant_callback
from replicator.core.context import ReplicaContext as ReplicaContext
from replicator.core.primitives import all_gather as all_gather
from replicator.core.primitives import all_max as all_max
from replicator.core.primitives import all_mean as all_mean
from replicator.core.primitives import all_min as all_min
from replicator.core.primitives import all_sum as all_sum
from replicator.core.primitives import broadcast as broadcast
from replicator.core.primitives import num_replicas as num_replicas
from replicator.core.primitives import reduce_scatter as reduce_scatter
from replicator.core.primitives import replica_id as replica_id
from replicator.core.primitives import stage_boundary as stage_boundary
from replicator.errors import DivergentControlFlowError as DivergentControlFlowError
from replicator.errors import DivergentStateError as DivergentStateError
from replicator.errors import InputExhausted as InputExhausted
from replicator.errors import MiscompileError as MiscompileError
from replicator.errors import PassError as PassError
from replicator.errors import ReplicationError as ReplicationError
from replicator.errors import UnanalyzableStepError as UnanalyzableStepError
from replicator.loop import CheckpointHook as CheckpointHook
from replicator.loop import EvalHook as EvalHook
from replicator.loop import Hook as Hook
from replicator.loop import LoggingHook as LoggingHook
from replicator.loop import Trainer as Trainer
from replicator.parallelism import Parallelism as Parallelism
from replicator.passes import PassManager as PassManager
from replicator.runtime import distributed as distributed
from replicator.runtime.distributed import gather_outputs as gather_outputs
from replicator.runtime.distributed import local_outputs as local_outputs
from replicator.runtime.distributed import replica_invariant as replica_invariant
from replicator.runtime.inputs import InputContext as InputContext
from replicator.runtime.mesh import build_mesh as build_mesh
from replicator.runtime.mesh import force_cpu_devices as force_cpu_devices
from replicator.runtime.state import broadcast_state as broadcast_state
from replicator.stages.scan_split import split_scan as split_scan
from replicator.training.checkpoint import CheckpointError as CheckpointError
from replicator.training.checkpoint import CheckpointManager as CheckpointManager
from replicator.training.checkpoint import export_orbax as export_orbax
from replicator.training.checkpoint import latest_step as latest_step
from replicator.training.checkpoint import restore_checkpoint as restore_checkpoint
from replicator.training.checkpoint import restore_orbax as restore_orbax
from replicator.training.checkpoint import save_checkpoint as save_checkpoint
from replicator.training.nn import cross_replica_batch_norm as cross_replica_batch_norm
from replicator.training.optim import accumulate_gradients as accumulate_gradients
from replicator.training.optim import wrap_optimizer as wrap_optimizer
from replicator.training.precision import DynamicLossScale as DynamicLossScale
from replicator.training.precision import MixedPrecision as MixedPrecision
from replicator.training.precision import all_finite as all_finite
from replicator.training.precision import select_tree as select_tree

__version__ = "0.1.0"

#: Old public names -> their new names (each still works, with a ``DeprecationWarning``).
RENAMED: dict[str, str] = {"Pipeline": "PassManager"}


def __getattr__(name: str) -> Any:
    if name in RENAMED:
        new = RENAMED[name]
        warnings.warn(
            f"rp.{name} is now rp.{new}: 'pipeline' means pipeline parallelism only (Parallelism(stages=...)).",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module 'replicator' has no attribute {name!r}")


# Equations created inside replicator are attributed to the user's line.
_jax_compat.exclude_from_user_frames(__file__)

__all__ = [
    "CheckpointError",
    "CheckpointHook",
    "CheckpointManager",
    "CompiledStep",
    "DivergentControlFlowError",
    "DivergentStateError",
    "DynamicLossScale",
    "EvalHook",
    "Hook",
    "InputContext",
    "InputExhausted",
    "LoggingHook",
    "MiscompileError",
    "MixedPrecision",
    "Parallelism",
    "PassError",
    "PassManager",
    "ReplicaContext",
    "ReplicationError",
    "Replicator",
    "Trainer",
    "UnanalyzableStepError",
    "accumulate_gradients",
    "all_finite",
    "all_gather",
    "all_max",
    "all_mean",
    "all_min",
    "all_sum",
    "broadcast",
    "broadcast_state",
    "build_mesh",
    "cost",
    "cross_replica_batch_norm",
    "distributed",
    "export_orbax",
    "force_cpu_devices",
    "gather_outputs",
    "invariant_callback",
    "latest_step",
    "local_outputs",
    "num_replicas",
    "reduce_scatter",
    "replica_id",
    "replica_invariant",
    "restore_checkpoint",
    "restore_orbax",
    "save_checkpoint",
    "select_tree",
    "split_scan",
    "stage_boundary",
    "tools",
    "wrap_optimizer",
]
