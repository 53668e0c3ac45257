"""Run a lowered step graph: ``jit(shard_map(eval_jaxpr))`` over the mesh.

This is how current JAX implements ``pmap`` itself (``jit`` + ``shard_map``);
``pmap`` is in maintenance mode and cannot express our 2-D mesh.

State is replicated (``P()``) and stays on the mesh between calls; batch
leaves are sharded along their leading axis over ``('workers', 'cores')``;
each replica's outputs get a new leading axis and come back stacked in
replica-id order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.context import REPLICA_AXES
from replicator.passes.base import StepGraph

__all__ = ["build_executable", "place_batch", "place_state", "replicated", "sharded"]


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def sharded(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(REPLICA_AXES))


def build_executable(graph: StepGraph, mesh: Mesh, *, donate_state: bool = False) -> Callable:
    """The compiled-on-first-call function ``(state_leaves, batch_leaves) -> (state, outputs)``."""
    fn = jaxpr_as_fun(graph.jaxpr)
    n_state = graph.num_state
    state_specs = [state_spec(i, graph.sharded_state) for i in range(n_state)]

    def per_replica(state: list, batch: list) -> tuple[list, list]:
        # A rewrite may leave a constant (a literal) as an output: make it an array.
        outs = [jnp.asarray(o) for o in fn(*state, *batch)]
        return outs[:n_state], [o[None] for o in outs[n_state:]]

    mapped = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(state_specs, P(REPLICA_AXES)),
        out_specs=(state_specs, P(REPLICA_AXES)),
        check_vma=False,
    )
    return jax.jit(mapped, donate_argnums=(0,) if donate_state else ())


def _strong(x: Any) -> Any:
    """Host copy without weak types (a Python float must not retrace later)."""
    if isinstance(x, jax.Array):
        return np.asarray(x) if x.weak_type else x
    return np.asarray(x)


def _is_laid_out(leaf: jax.Array, target: NamedSharding) -> bool:
    """Fast check (it runs for every state leaf on every step)."""
    sharding = leaf.sharding
    if type(sharding) is not NamedSharding:
        return False
    if sharding.mesh is not target.mesh and sharding.mesh != target.mesh:
        return False
    if sharding.spec == target.spec:
        return True
    # JAX may return P('cores') for P(('workers', 'cores')) when 'workers' has size 1.
    return sharding.is_equivalent_to(target, leaf.ndim)


def state_spec(index: int, sharded_state: frozenset[int]) -> P:
    """Replicated, or (ZeRO-1 state) split along axis 0 over every replica."""
    return P(REPLICA_AXES) if index in sharded_state else P()


def place_state(leaves: Sequence[Any], mesh: Mesh, sharded_state: frozenset[int] = frozenset()) -> list[jax.Array]:
    """Put state leaves on the mesh, replicated or sharded (no copy if already there)."""
    out = []
    for i, leaf in enumerate(leaves):
        target = NamedSharding(mesh, state_spec(i, sharded_state))
        if isinstance(leaf, jax.Array) and not leaf.weak_type and _is_laid_out(leaf, target):
            out.append(leaf)
        else:
            out.append(jax.device_put(_strong(leaf), target))
    return out


def place_batch(worker_leaves: list[list[Any]], mesh: Mesh) -> list[jax.Array]:
    """Global batch arrays from each local worker's leaves, sharded by replica.

    Args:
      worker_leaves: for each worker of this process, in worker order, its
        batch leaves.
    """
    target = sharded(mesh)
    out = []
    for per_worker in zip(*worker_leaves, strict=True):
        if len(per_worker) == 1 and isinstance(per_worker[0], jax.Array) and per_worker[0].sharding == target:
            out.append(per_worker[0])
            continue
        host = [np.asarray(x) for x in per_worker]
        dtypes = {x.dtype for x in host}
        if len(dtypes) > 1:
            raise TypeError(f"workers yielded batch leaves of different dtypes {sorted(map(str, dtypes))}.")
        local = host[0] if len(host) == 1 else np.concatenate(host, axis=0)
        if jax.process_count() == 1:
            out.append(jax.device_put(local, target))
        else:
            out.append(jax.make_array_from_process_local_data(target, local))
    return out
