"""The one way a data-parallel (and tensor-parallel) step is built: trace, split, rewrite, wrap.

``build_step`` takes the user's per-replica ``step_fn`` and the signatures of its state and batch and
returns a :class:`CompiledStep`: the step traced with placeholders (``core/tracing.py``), split for one
device of a tensor group where the Replicator has a tensor axis (``tensor/split_graph.py``), rewritten by
the pass manager (``passes/``), folded where a device hosts several replicas (``passes/fold.py``), and
wrapped as ``jit(shard_map(...))`` over the mesh (``runtime/execution.py``). A pipelined Replicator builds
its steps in ``stages/`` instead (the same split first, then the stage cut). :class:`StepCache` keeps the
built steps, least recently used dropped first.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from replicator.core.context import ReplicaContext
from replicator.core.layout import FoldLayout
from replicator.core.tracing import TracedStep, signature_spec, trace_step
from replicator.pass_manager.manager import Lowered, PassManager
from replicator.passes.fold import fold_lowered
from replicator.runtime.execution import build_executable
from replicator.runtime.inputs import BatchSignature
from replicator.runtime.memory import compiled_memory
from replicator.runtime.state import PerReplicaSignature, per_replica_graph, per_replica_specs, per_replica_step
from replicator.runtime.state_key import StateKey, state_spec

__all__ = ["MAX_COMPILED_STEPS", "CompiledStep", "StepCache", "build_step"]

#: Compiled steps kept per Replicator (least recently used dropped first).
MAX_COMPILED_STEPS = 64


@dataclasses.dataclass(eq=False)
class CompiledStep:
    """A step traced, rewritten and wrapped for one input signature."""

    traced: TracedStep
    lowered: Lowered
    executable: Callable
    runs: int = 0  # the first run compiles it (XLA), as part of the call
    #: Whether the new state it returns is laid out as ``place_state`` would place it (checked on the
    #: first run), so that the next call may pass those arrays back as they are.
    state_reusable: bool = False


class StepCache(collections.OrderedDict):
    """Built steps by ``(step_fn, state key, batch key, passes key)``, at most :data:`MAX_COMPILED_STEPS`."""

    def lookup(self, key: tuple) -> CompiledStep | None:
        compiled = self.get(key)
        if compiled is not None:
            self.move_to_end(key)
        return compiled

    def add(self, key: tuple, compiled: CompiledStep) -> None:
        self[key] = compiled
        while len(self) > MAX_COMPILED_STEPS:
            self.popitem(last=False)  # the least recently used


def build_step(
    step_fn: Callable,
    state_key: StateKey,
    batch_key: BatchSignature,
    *,
    context: ReplicaContext,
    passes: PassManager,
    mesh: Mesh,
    fold: FoldLayout,
    tensor: Any = None,
    donate_state: bool = False,
) -> CompiledStep:
    """``step_fn`` built for a state and a batch of these signatures (see the module docstring).

    ``tensor``: the Replicator's :class:`~replicator.tensor.axis.TensorAxis`, or None.
    """
    has_state, state_def, state_sigs = state_key.value
    state_specs = state_def.unflatten([state_spec(s) for s in state_sigs]) if has_state else None
    batch_specs = batch_key.treedef.unflatten([signature_spec(s) for s in batch_key.replica_leaves])
    flags = tuple(type(s) is PerReplicaSignature for s in state_sigs)
    if any(flags):  # traced with one row of each per-replica leaf, stored one row per replica
        state_specs = per_replica_specs(state_specs, flags)
    traced = trace_step(per_replica_step(step_fn, flags) if any(flags) else step_fn, state_specs, batch_specs, context)
    if any(flags):
        traced = dataclasses.replace(traced, graph=per_replica_graph(traced.graph, flags, traced.static_state))
    graph = traced.graph if tensor is None else tensor.split(traced.graph, state_specs)
    lowered = passes.run(graph, fold=fold)
    if fold.replicas_per_device > 1:
        lowered = fold_lowered(lowered, fold)
    executable = build_executable(lowered.final, mesh, donate_state=donate_state, fold=fold)
    memory = functools.cache(functools.partial(compiled_memory, executable, traced.graph, lowered.final, mesh))
    return CompiledStep(traced, dataclasses.replace(lowered, memory_fn=memory), executable)
