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

Promises:

1. Inside a step ``broadcast_state(x)`` is replica 0's value on every replica
   (tests/test_state.py::TestInsideAStep::test_per_replica_values_become_replica_0s), and state made from it
   passes the replica-invariance check that the value itself fails
   (tests/test_state.py::TestInsideAStep::test_broadcast_state_is_replica_invariant_state).
2. On the host, a replicated leaf whose devices hold different copies (a 0-d int32 leaf too) comes back with
   replica 0's copy on every device, as ``NamedSharding(mesh, P())``, with its shape and dtype; ``run`` takes
   it as it is; without a Replicator the state's own mesh is used
   (tests/test_state.py::TestFromTheHost::test_devices_holding_different_copies_get_replica_0s,
   tests/test_state.py::test_replicator_method).
3. Host values (NumPy arrays, Python numbers) are placed replicated with canonical, non-weak dtypes; a
   bfloat16 leaf stays bfloat16 (tests/test_state.py::TestFromTheHost::test_host_values_are_placed_replicated).
4. A leaf split over the devices is one global value: gathered whole, not replaced by replica 0's part nor
   sent from process 0 (tests/test_state.py::TestFromTheHost::test_host_values_are_placed_replicated,
   tests/test_state.py::test_broadcast_state_in_a_job_of_processes_gathers_a_split_leaf_and_takes_process_0s_copies).
5. With several processes every process gets process 0's copies, in one collective for all the leaves
   (tests/test_state.py::TestFromTheHost::test_several_processes_take_process_0s_copy).
6. On the host without a mesh, state not on one mesh is a ``ValueError`` that asks for the Replicator; a
   ``replicator`` that is neither a Replicator nor a Mesh is a ``TypeError``
   (tests/test_state.py::TestFromTheHost::test_without_a_mesh_it_asks_for_the_replicator).
7. ``per_replica_state`` may be a bool, a function of a leaf's path, or a pytree prefix of the state with a bool
   per subtree (the ``per_replica_flags`` doctest, tests/test_docs.py::test_docstring_examples_run;
   tests/test_per_replica_state.py::test_the_returned_state_has_the_replica_axis_sharded_over_the_replicas);
   a prefix that does not match the state, or holds a leaf that is not a bool, is a ``ValueError``
   (tests/test_state.py::test_a_per_replica_prefix_that_does_not_match_the_state_or_holds_a_non_bool_is_refused,
   tests/test_per_replica_state.py::test_a_per_replica_leaf_without_the_replica_axis_is_an_error).
8. A leaf marked per replica must have a leading axis of ``num_replicas`` rows: a 0-d leaf or another size is
   a ``ValueError`` that names the leaf and the fix
   (tests/test_state.py::test_a_0d_leaf_marked_per_replica_is_refused,
   tests/test_per_replica_state.py::test_a_per_replica_leaf_without_the_replica_axis_is_an_error).
9. Each replica's step sees its own row of a per-replica leaf, without the axis, and its new row is stored
   split over the replicas, one row per device
   (tests/test_per_replica_state.py::test_each_replica_keeps_its_own_running_mean,
   tests/test_per_replica_state.py::test_the_returned_state_has_the_replica_axis_sharded_over_the_replicas); a
   per-replica step that does not return a pair gets the tracer's error
   (tests/test_state.py::test_a_per_replica_step_returning_three_values_gets_the_tracers_error).
10. A per-replica leaf's cache-key signature never equals a replicated leaf's of the same shape and dtype
    (tests/test_state.py::test_a_per_replica_signature_never_equals_the_replicated_one), and
    ``with_per_replica`` marks exactly the flagged signatures, unmarking any other, shapes and dtypes kept
    (tests/test_state.py::test_with_per_replica_marks_exactly_the_flagged_signatures).
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
from replicator.core.graph import ShardedState

__all__ = [
    "PerReplicaSignature",
    "broadcast_state",
    "per_replica_flags",
    "per_replica_graph",
    "per_replica_specs",
    "per_replica_step",
    "with_per_replica",
]

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


# -- state kept per replica ------------------------------------------------------------------------


class PerReplicaSignature(tuple):
    """The ``(shape, dtype)`` cache-key entry of a state leaf kept per replica (its shape has the replica axis).

    Never equal to the plain ``(shape, dtype)`` of a replicated leaf: the two compile to different steps.
    """

    def __eq__(self, other: object) -> bool:
        return type(other) is PerReplicaSignature and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(("per-replica", *self))


def with_per_replica(signatures: tuple, flags: tuple[bool, ...]) -> tuple:
    """The state's cache-key signatures with those of the per-replica leaves (``flags``) marked."""
    return tuple(
        PerReplicaSignature(s) if flag else (tuple(s) if type(s) is PerReplicaSignature else s)
        for s, flag in zip(signatures, flags, strict=True)
    )


def per_replica_flags(state: PyTree, per_replica_state: Any, num_replicas: int) -> tuple[bool, ...]:
    """Which leaves of ``state`` (``jax.tree.leaves`` order) are kept per replica, checked.

    Args:
      state: the state passed to ``Replicator.run``.
      per_replica_state: a pytree prefix of ``state`` with a bool per subtree
        (``{'params': False, 'batch_stats': True}``, as ``jax.vmap``'s
        ``in_axes``), a bool for the whole state, or a function of the leaf's
        path (``"state['batch_stats']['mean']"``) returning a bool.
      num_replicas: the size the leading axis of a per-replica leaf must have.

    Raises:
      ValueError: ``per_replica_state`` is not a prefix of the state, or marks a leaf
        that is not an array with a leading axis of size ``num_replicas``.

    >>> state = {"params": {"w": np.zeros(3)}, "stats": {"mean": np.zeros((8, 3)), "var": np.ones((8, 3))}}
    >>> per_replica_flags(state, {"params": False, "stats": True}, 8)
    (False, True, True)
    >>> per_replica_flags(state, lambda path: "mean" in path, 8)
    (False, True, False)
    """
    from replicator.core.tracing import is_array_leaf, leaf_paths  # the layer below: a function-level import

    leaves = jax.tree.leaves(state)
    paths = leaf_paths(state, "state")
    if callable(per_replica_state):
        flags = [bool(per_replica_state(path)) for path in paths]
    else:
        try:
            prefix = jax.tree.map(_Flag, per_replica_state)
            flags = [f.value for sub, f in _prefix_pairs(prefix, state) for _ in jax.tree.leaves(sub)]
            if len(flags) != len(leaves):
                raise ValueError(f"it gives flags for {len(flags)} of the {len(leaves)} leaves")
        except ValueError as e:
            raise ValueError(
                f"per_replica_state must be a bool, a function of a leaf's path, or a pytree prefix of the state "
                f"with a bool per subtree (e.g. {{'params': False, 'batch_stats': True}}); it does not match the "
                f"state's structure: {e}"
            ) from None
    for path, leaf, flag in zip(paths, leaves, flags, strict=True):
        if not flag:
            continue
        shape = tuple(getattr(leaf, "shape", np.shape(leaf))) if is_array_leaf(leaf) else None
        if shape is None or not shape or shape[0] != num_replicas:
            got = f"shape {shape}" if shape is not None else f"a {type(leaf).__name__}"
            raise ValueError(
                f"per_replica_state marks {path} as kept per replica, so it must be an array with a leading axis "
                f"of size num_replicas ({num_replicas}), one row per replica (as jax.pmap's state has one per "
                f"device); it is {got}. Give it that axis, e.g. jnp.broadcast_to(x, (repl.num_replicas, *x.shape)) "
                f"to start every replica from the same value, or leave it out of per_replica_state."
            )
    return tuple(flags)


class _Flag:
    """A leaf of a ``per_replica_state`` prefix (kept a leaf while the state's subtree is matched to it)."""

    def __init__(self, value: Any):
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"its leaves must be bools, got {value!r}")
        self.value = bool(value)


def _prefix_pairs(prefix: PyTree, state: PyTree) -> list[tuple[PyTree, _Flag]]:
    """``(subtree of state, flag)`` pairs, in the state's leaf order."""
    pairs: list[tuple[PyTree, _Flag]] = []
    jax.tree.map(lambda flag, sub: pairs.append((sub, flag)), prefix, state, is_leaf=lambda x: isinstance(x, _Flag))
    return pairs


def per_replica_step(step_fn: Any, flags: tuple[bool, ...]) -> Any:
    """``step_fn`` for tracing with per-replica leaves of shape ``(1, ...)``: it sees and returns them without
    the axis (this replica's copy)."""

    def step(state: PyTree, batch: PyTree) -> Any:
        leaves, treedef = jax.tree.flatten(state)
        state = treedef.unflatten([x[0] if flag else x for x, flag in zip(leaves, flags, strict=True)])
        result = step_fn(state, batch)
        if not (isinstance(result, tuple) and len(result) == 2):
            return result  # the tracer says what is wrong
        new_state, outputs = result
        new_leaves, new_def = jax.tree.flatten(new_state)
        if new_def != treedef:
            return result  # the tracer names the structures
        new_leaves = [jax.numpy.asarray(x)[None] if flag else x for x, flag in zip(new_leaves, flags, strict=True)]
        return treedef.unflatten(new_leaves), outputs

    return step


def per_replica_specs(state_specs: PyTree, flags: tuple[bool, ...]) -> PyTree:
    """The specs a step with per-replica leaves is traced with: each such leaf is one row, ``(1, ...)``."""
    leaves, treedef = jax.tree.flatten(state_specs)
    return treedef.unflatten(
        [jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype) if flag else x for x, flag in zip(leaves, flags, strict=True)]
    )


def per_replica_graph(graph: Any, flags: tuple[bool, ...], static: tuple[tuple[int, Any], ...]) -> Any:
    """``graph`` with its per-replica leaves stored split along axis 0 over the replicas, one row each.

    ``flags``: one per state leaf; ``static``: the state's non-array leaves (not in the graph).
    """
    import dataclasses

    statics = dict(static)
    arrays = [flag for i, flag in enumerate(flags) if i not in statics]
    indices = {i for i, flag in enumerate(arrays) if flag}
    sharded = ShardedState() | graph.sharded_state | dict.fromkeys(indices, 0)
    return dataclasses.replace(graph, sharded_state=sharded, per_replica_state=frozenset(indices))
