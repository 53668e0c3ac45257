"""Make state identical on every replica: replica 0's copy wins.

Data-parallel training assumes every replica starts from the same parameters
and optimizer state. If they were initialized independently (a different seed
per process, a checkpoint restored by each host, per-replica values computed
in a step), :func:`broadcast_state` makes them equal with *rank-0 semantics*,
as Horovod's ``broadcast_parameters`` and the PyTorch DDP constructor do:
every replica gets the copy of replica 0 (process 0 in multi-process runs).

* **Inside a step** (run or traced by a ``Replicator``) it is ``rp.broadcast(state,
  source=0)``: a placeholder, so ``check-replica-invariance`` knows the result
  is identical on every replica.
* **On the host** it returns the state as arrays replicated on the
  replicator's mesh, holding replica 0's values: for an array that is
  replicated on the mesh but holds different data on different devices (e.g.
  assembled with ``jax.make_array_from_single_device_arrays``), the copy on
  replica 0's device; for host values (NumPy, Python numbers), this process's
  copy. With several processes (``jax.process_count() > 1``), each process
  may hold a different copy, and process 0's is sent to all with
  ``jax.experimental.multihost_utils.broadcast_one_to_all`` first. The result
  is what ``Replicator.run`` expects as state, so it is not copied again.

Example::

    import replicator as rp
    from replicator.runtime.state import broadcast_state

    repl = rp.Replicator(num_workers=1, cores_per_worker=8)
    params = init_params(jax.random.key(jax.process_index()))   # differs per process
    state = broadcast_state((params, tx.init(params)), repl)    # process 0's everywhere

    def step_fn(state, batch):
        ...
        stats = broadcast_state(per_replica_stats)               # replica 0's, in a step
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.core import primitives
from replicator.core.context import current_context

__all__ = ["broadcast_state"]

PyTree = Any


def _mesh_of(replicator: Any, leaves: list[Any]) -> Mesh:
    if replicator is not None:
        mesh = replicator if isinstance(replicator, Mesh) else getattr(replicator, "mesh", None)
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"broadcast_state(state, replicator): replicator must be a replicator.Replicator "
                f"(or a jax.sharding.Mesh), got {type(replicator).__name__}."
            )
        return mesh
    meshes = {
        leaf.sharding.mesh
        for leaf in leaves
        if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
    }
    if len(meshes) == 1 and all(isinstance(leaf, jax.Array) for leaf in leaves):
        return meshes.pop()
    raise ValueError(
        "broadcast_state(state) was called outside a step, and the state does not live on one "
        "device mesh, so there is no telling which devices should hold it. Pass the Replicator: "
        "broadcast_state(state, repl)."
    )


def _host_copy(leaf: Any) -> np.ndarray:
    """A NumPy value with a canonical (x64-aware), non-weak dtype."""
    x = np.asarray(leaf)
    return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)


def _replica0_copy(leaf: Any, device0: Any) -> tuple[Any, bool]:
    """This process's copy of ``leaf`` as replica 0 holds it.

    Returns the value and whether it may differ between processes (and so
    needs the cross-process broadcast).
    """
    if not isinstance(leaf, jax.Array):
        return _host_copy(leaf), True
    if not leaf.is_fully_replicated:
        # One global value split across devices: no copy to choose, only to gather.
        return leaf, False
    shards = leaf.addressable_shards
    mine = next((s for s in shards if s.device == device0), shards[0])
    data = mine.data
    return (_host_copy(data) if data.weak_type else data), True


def broadcast_state(state: PyTree, replicator: Any = None) -> PyTree:
    """``state`` with replica 0's values on every replica (rank-0 semantics).

    Args:
      state: a pytree of arrays (or numbers).
      replicator: the ``Replicator`` (or its ``jax.sharding.Mesh``) whose
        devices should hold the state; used on the host only. May be omitted
        when every leaf is already a ``jax.Array`` on one mesh. Ignored inside
        a step.

    Returns:
      Inside a step: ``rp.broadcast(state, source=0)``. On the host: the state
      as ``jax.Array``s replicated on the mesh (``NamedSharding(mesh, P())``),
      every device holding replica 0's (process 0's) values, with the same
      shapes and dtypes.

    Raises:
      ValueError: on the host, if no mesh is given and the state is not on one.
    """
    if current_context() is not None:
        return primitives.broadcast(state, source=0)
    leaves, treedef = jax.tree.flatten(state)
    mesh = _mesh_of(replicator, leaves)
    target = NamedSharding(mesh, P())
    copies = [_replica0_copy(leaf, mesh.devices.flat[0]) for leaf in leaves]
    if jax.process_count() > 1:
        # Each process may hold a different copy: process 0's wins.
        chosen = [i for i, (_, per_process) in enumerate(copies) if per_process]
        sent = multihost_utils.broadcast_one_to_all([np.asarray(copies[i][0]) for i in chosen])
        for i, value in zip(chosen, sent, strict=True):
            copies[i] = (_host_copy(value), False)
    return treedef.unflatten([jax.device_put(value, target) for value, _ in copies])
