"""Run a lowered step graph: ``jit(shard_map(eval_jaxpr))`` over the mesh.

This is how current JAX implements ``pmap`` itself (``jit`` + ``shard_map``);
``pmap`` is in maintenance mode and cannot express our 2-D mesh.

State is replicated (``P()``) and stays on the mesh between calls; batch
leaves are sharded along their leading axis over ``('workers', 'cores')``;
each replica's outputs get a new leading axis and come back stacked in
replica-id order.

With several processes (see :mod:`replicator.runtime.distributed`) the same code runs
in every process on the global mesh: a batch is assembled from each process's
local workers (``jax.make_array_from_process_local_data``), state from a host
value is checked to be identical in every process before it is placed, and
the first call of a step checks that every process compiled the same program
(so that a mismatch is an error, not a collective that waits forever).

Promises:

1. Replica ``r``'s outputs come back as row ``r`` of each output, a new leading axis in replica-id order, for
   0-d outputs and constants too
   (tests/test_run.py::TestSemantics::test_without_state_outputs_are_stacked_in_replica_order,
   tests/test_execution.py::test_a_constant_or_0d_output_comes_back_one_row_per_replica).
2. The state comes back once, replicated, and stays on the mesh between calls
   (tests/test_run.py::TestSemantics::test_state_comes_back_once_and_stays_on_the_mesh). ``place_state`` uses
   a leaf already laid out on the mesh as it is, places a weakly typed one again with a strong dtype, keeps a
   0-d int8, a bool or a bfloat16 leaf's shape and dtype, and splits a ZeRO leaf along its own axis
   (tests/test_execution.py::test_state_on_the_mesh_is_used_as_it_is_and_other_leaves_are_placed_replicated_or_split).
3. ``place_batch`` uses a batch leaf already laid out by replica as it is
   (tests/test_execution.py::test_a_batch_leaf_already_laid_out_by_replica_is_used_as_it_is); two local workers'
   leaves of different dtypes are a ``TypeError`` naming both, not a silent widening
   (tests/test_execution.py::test_two_local_workers_yielding_different_dtypes_is_a_type_error).
4. On CPU devices a batch of ``MEMORY_CHECK_BYTES`` or more that exceeds the free memory is a ``MemoryError``
   naming the sizes and the fix; a smaller one is not checked; with the free memory unknown it is placed
   (tests/test_execution.py::test_a_batch_larger_than_the_free_memory_is_a_memory_error_naming_the_fix,
   tests/test_execution.py::test_a_small_batch_is_not_checked_against_the_free_memory,
   tests/test_execution.py::test_a_large_batch_is_placed_when_the_free_memory_is_unknown).
5. ``spans_processes`` is true only for a mesh with devices of several processes
   (tests/test_execution.py::test_spans_processes_only_with_devices_of_several_processes).
6. On a mesh that spans processes each process's local rows become one global batch in worker order, with
   several replicas per device and for typed PRNG keys too
   (tests/test_execution.py::test_process_local_rows_become_one_global_batch_in_worker_order,
   tests/test_execution.py::test_folded_workers_rows_become_one_global_batch,
   tests/test_execution.py::test_process_local_typed_keys_become_global_typed_keys), and state from the host
   or from one process's devices takes process 0's values
   (tests/test_execution.py::test_state_on_this_process_devices_takes_process_0s_values,
   tests/test_distributed.py::TestTwoProcesses::test_initial_state_is_worker_0s).
7. On a mesh that spans processes the first call checks that every process compiled the same program: a
   different constant or batch size on one worker is a ``ValueError`` before step one, the same program runs
   (tests/test_divergence.py::test_a_different_learning_rate_on_one_worker_is_an_error_before_step_one,
   tests/test_distributed.py::TestTwoProcesses::test_workers_that_disagree_are_an_error,
   tests/test_divergence.py::test_the_same_program_on_every_worker_runs).
8. ``program_fingerprint`` differs for steps that differ in a literal or in the bytes of an array they close
   over, and is equal for equal ones (its doctest, tests/test_docs.py::test_docstring_examples_run;
   tests/test_execution.py::test_steps_closing_over_same_shaped_arrays_of_other_values_get_other_fingerprints,
   tests/test_divergence.py::test_the_cross_worker_fingerprint_tells_apart_what_the_workers_must_agree_on).
9. A step may close over an array on the mesh (an earlier run's output): its value is the constant
   (tests/test_execution.py::test_a_step_may_close_over_an_earlier_runs_output_on_the_mesh).
10. Several replicas per device (a folded step) train as one device does, whether the replicated state comes
    out of the block's ``vmap`` unbatched or batched
    (tests/test_execution.py::test_a_folded_step_trains_like_one_device_in_either_form_of_its_state).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator._jax_compat import stage_as_one_call, with_leading_inputs
from replicator.core.context import REPLICA_AXES
from replicator.core.graph import StepGraph, TensorLayout, shard_axis
from replicator.core.layout import FoldLayout

__all__ = ["StepExecutable", "build_executable", "place_batch", "place_state", "sharded", "spans_processes"]


@functools.lru_cache(maxsize=64)
def sharded(mesh: Mesh) -> NamedSharding:
    """Split along the leading axis over every replica (how batches and outputs are laid out)."""
    return NamedSharding(mesh, P(REPLICA_AXES))


def spans_processes(mesh: Mesh) -> bool:
    """True if the mesh has devices of more than one process (cheap: runs every step)."""
    return jax.process_count() > 1 and _spans_processes(mesh)


@functools.lru_cache(maxsize=64)
def _spans_processes(mesh: Mesh) -> bool:
    return len({d.process_index for d in mesh.devices.flat}) > 1


class StepExecutable:
    """The compiled-on-first-call step ``(state_leaves, batch_leaves) -> (state, outputs)``, as returned by
    :func:`build_executable`.

    It passes the graph's runtime constants (``StepGraph.runtime_constants``,
    placed on the mesh once) to every call. On a mesh that spans processes its
    first call checks that every process compiled a step of the same signature
    and program. Attributes other than the call and ``lower`` (``_cache_size``,
    ...) are the jitted function's.
    """

    def __init__(self, jitted: Callable, graph: StepGraph, mesh: Mesh, constants: Sequence[np.ndarray]):
        self._jitted = jitted
        self._mesh = mesh
        self._host_constants = list(constants)
        self._constants: list[jax.Array] | None = None
        self._checked = not spans_processes(mesh)
        if not self._checked:
            self._signature = _signature(graph)
            self._fingerprint = program_fingerprint(graph)

    def _args(self, state: list, batch: list) -> tuple:
        """The jitted function's arguments: the runtime constants are a third one only if there are any."""
        if not self._host_constants:
            return state, batch
        constants = self._constants
        return state, batch, constants if constants is not None else self._placed_constants()

    def _placed_constants(self) -> list[jax.Array]:
        """The runtime constants, replicated on the mesh (placed on first use; no collective: every process
        has the same values, as its program is the same)."""
        if self._constants is None:
            replicated = NamedSharding(self._mesh, P())
            self._constants = [
                jax.make_array_from_callback(c.shape, replicated, lambda index, c=c: c[index])
                for c in self._host_constants
            ]
        return self._constants

    def __call__(self, state: list, batch: list) -> Any:
        if not self._checked:
            self._check_same_program()
        return self._jitted(*self._args(state, batch))

    def lower(self, state: list, batch: list) -> Any:
        """``jax.jit(...).lower`` of the step on ``state`` and ``batch`` (arrays or ``ShapeDtypeStruct``)."""
        return self._jitted.lower(*self._args(state, batch))

    def trace(self, state: list, batch: list) -> Any:
        """``jax.jit(...).trace`` of the step on ``state`` and ``batch``."""
        return self._jitted.trace(*self._args(state, batch))

    def _check_same_program(self) -> None:
        from replicator.runtime.distributed import check_same_across_workers

        check_same_across_workers(
            [self._signature, self._fingerprint],
            [
                "the step's signature (state, per-replica batch and output shapes and dtypes, operations)",
                "the step's program with its constants (literal values such as a learning rate, and arrays "
                "step_fn closes over)",
            ],
            what="the compiled step",
            fix=(
                "Every worker must run the same step_fn, with state of the same structure, shapes and "
                "dtypes, on batches of the same structure, shapes and dtypes (check that input_fn "
                "yields the same batch size on every worker), in the same order, with the same constants (a "
                "hyper-parameter read from a per-worker config or computed from the worker id differs)."
            ),
        )
        self._checked = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


def _signature(graph: StepGraph) -> str:
    jaxpr = graph.jaxpr.jaxpr
    return " ".join(
        [
            *(str(v.aval) for v in jaxpr.invars),
            "->",
            *(str(v.aval) for v in jaxpr.outvars),
            "|",
            *(e.primitive.name for e in jaxpr.eqns),
        ]
    )


def program_fingerprint(graph: StepGraph) -> str:
    """A digest of the whole lowered program: every equation with its parameters and literal
    values (the printed jaxpr) and the bytes of every constant it closes over.

    Two workers whose steps differ only in a constant (a learning rate of 0.1 on one and 0.2
    on the other) get different fingerprints.

    >>> repl = rp.Replicator(1, 8)
    >>> batch = {"x": np.ones((8, 2), np.float32)}
    >>> a = program_fingerprint(repl.lower(lambda b: {"y": b["x"] * 0.1}, batch).final)
    >>> b = program_fingerprint(repl.lower(lambda b: {"y": b["x"] * 0.2}, batch).final)
    >>> a == b
    False
    """
    text = re.sub(r" at 0x[0-9a-f]+", "", str(graph.jaxpr.jaxpr))  # host callbacks print their address
    h = hashlib.sha256(text.encode())
    for c in graph.jaxpr.consts:
        value = np.asarray(_host_constant(c))
        h.update(f"{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def build_executable(
    graph: StepGraph, mesh: Mesh, *, donate_state: bool = False, fold: FoldLayout | None = None
) -> Callable:
    """The compiled-on-first-call function ``(state_leaves, batch_leaves) -> (state, outputs)``.

    With ``fold`` (several replicas per device), ``graph`` is the output of
    :class:`~replicator.passes.fold.FoldReplicas` for it: each device runs it
    under ``jax.vmap`` over the folded axes, on its block of consecutive
    replicas' batch rows.

    On a mesh that spans processes, the first call first checks (one small
    collective) that every process compiled a step of the same signature.
    """
    jaxpr = graph.jaxpr.jaxpr
    consts = [_host_constant(c) for c in graph.jaxpr.consts]
    # Runtime constants are inputs of the compiled step (the same values on every call, invisible to XLA).
    runtime = [i for i, v in enumerate(jaxpr.constvars) if v in graph.runtime_constants]
    embedded = [i for i, v in enumerate(jaxpr.constvars) if v not in graph.runtime_constants]
    # Every constant becomes an input of one equation in JAX's trace of the step (no second trace of the
    # graph's equations): the runtime ones are the step's arguments, the others constants of that trace.
    inner = with_leading_inputs(jaxpr, [jaxpr.constvars[i] for i in [*runtime, *embedded]])
    call = stage_as_one_call(inner, name="replicated_step")
    embedded_values = [consts[i] for i in embedded]

    def fn(constants: list, *args: Any) -> list:
        return call(*constants, *embedded_values, *args)

    n_state = graph.num_state
    state_specs = [state_spec(i, graph.sharded_state, graph.tensor) for i in range(n_state)]

    def per_replica(state: list, batch: list, constants: Sequence[Any] = ()) -> tuple[list, list]:
        # A rewrite may leave a constant (a literal) as an output: make it an array.
        outs = [jnp.asarray(o) for o in fn(constants, *state, *batch)]
        return outs[:n_state], [o[None] for o in outs[n_state:]]

    per_device = (
        per_replica if fold is None or fold.replicas_per_device == 1 else _folded(per_replica, graph, fold, mesh)
    )
    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(state_specs, P(REPLICA_AXES), *([P()] if runtime else [])),
        out_specs=(state_specs, P(REPLICA_AXES)),
        check_vma=False,
    )
    jitted = jax.jit(mapped, donate_argnums=(0,) if donate_state else ())
    if not runtime and not spans_processes(mesh):
        return jitted  # nothing to add to a call: the jitted function itself (the fastest path)
    return StepExecutable(jitted, graph, mesh, [np.asarray(consts[i]) for i in runtime])


def _folded(per_replica: Callable, graph: StepGraph, fold: FoldLayout, mesh: Mesh) -> Callable:
    """One device's block of replicas: ``per_replica`` under ``vmap`` over each folded axis.

    Batch leaves and sharded (ZeRO) state hold the block's replicas' rows (a
    sharded leaf: slices along its axis) in replica order and are split into
    ``(Fw, Fc, rows, ...)`` at that axis. Replicated state
    goes in once (``in_axes=None``) and comes out once (``out_axes=None``)
    where ``vmap`` left it unbatched (work on it ran once per device); should
    some replicated leaf come out batched, every one is taken from the block's
    first replica instead (the variance analysis checked they are identical).
    """
    sizes = [size for _, size in fold.folded_axes]
    n_state = graph.num_state
    axes = [shard_axis(graph.sharded_state, i) for i in range(n_state)]

    def split(x: Any, axis: int = 0) -> Any:
        return x.reshape(*x.shape[:axis], *sizes, x.shape[axis] // math.prod(sizes), *x.shape[axis + 1 :])

    def merge(x: Any, axis: int = 0) -> Any:
        end = axis + len(sizes)
        return x.reshape(*x.shape[:axis], math.prod(sizes) * x.shape[end], *x.shape[end + 1 :])

    def block(unbatched_state: bool) -> Callable:
        def per_device(state: list, batch: list, constants: Sequence[Any] = ()) -> tuple[list, list]:
            out_state_axes = [0 if a is None and not unbatched_state else a for a in axes]

            def fn(s: list, b: list) -> tuple[list, list]:  # the runtime constants: the same on every replica
                return per_replica(s, b, constants)

            for name, _ in reversed(fold.folded_axes):  # the innermost vmap is the last folded axis
                fn = jax.vmap(fn, in_axes=(axes, 0), out_axes=(out_state_axes, 0), axis_name=name)
            state_in = [s if a is None else split(s, a) for s, a in zip(state, axes, strict=True)]
            new_state, outputs = fn(state_in, [split(b) for b in batch])
            first = (0,) * len(sizes)
            new_state = [
                (s if unbatched_state else s[first]) if a is None else merge(s, a)
                for s, a in zip(new_state, axes, strict=True)
            ]
            return new_state, [merge(o) for o in outputs]

        return per_device

    # Which form applies is known from one trace on the block's shapes (not executed).
    invars = graph.jaxpr.jaxpr.invars
    F = fold.replicas_per_device
    state_specs = []
    for v, a in zip(invars[:n_state], axes, strict=True):
        shape = v.aval.shape if a is None else (*v.aval.shape[:a], F * v.aval.shape[a], *v.aval.shape[a + 1 :])
        state_specs.append(jax.ShapeDtypeStruct(shape, v.aval.dtype))
    batch_specs = [
        jax.ShapeDtypeStruct((F * v.aval.shape[0], *v.aval.shape[1:]), v.aval.dtype) for v in invars[n_state:]
    ]
    constant_specs = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
        for v in graph.jaxpr.jaxpr.constvars
        if v in graph.runtime_constants
    ]
    device_axes = list(mesh.shape.items())  # the data axes' devices, and a tensor axis where there is one
    try:
        jax.make_jaxpr(block(True), axis_env=device_axes)(state_specs, batch_specs, constant_specs)
    except ValueError as e:
        if "out_axes" not in str(e):
            raise
        return block(False)
    return block(True)


def _host_constant(c: Any) -> Any:
    """An array ``step_fn`` closed over, as a host constant of the compiled step.

    Arrays placed on a mesh (the outputs of an earlier ``run``) cannot enter
    ``shard_map`` as they are; their value can.
    """
    if not isinstance(c, jax.Array):
        return c
    if c.is_fully_addressable:
        return np.asarray(c)
    if c.is_fully_replicated:
        return np.asarray(c.addressable_data(0))
    raise ValueError(
        f"step_fn closes over an array of shape {c.shape} that is split over the devices of several processes, "
        "so no process has its value. Pass it to the step as part of the state instead of capturing it."
    )


def _strong(x: Any) -> Any:
    """Host copy without weak types (a Python float must not retrace later)."""
    if isinstance(x, jax.Array):
        return np.asarray(x) if getattr(x, "weak_type", False) else x
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


def state_spec(index: int, sharded_state: frozenset[int], tensor: TensorLayout | None = None) -> P:
    """Replicated, or (ZeRO state) split along its axis (:func:`~replicator.core.graph.shard_axis`) over every
    replica; with ``tensor``, a split leaf's dimension also over the tensor axis (its blocks outermost: ZeRO
    splits a device's tensor block).

    >>> from replicator.core.graph import ShardedState, TensorLayout
    >>> tuple(state_spec(0, ShardedState({0: 0}), TensorLayout("tensor", 2, (0,))))
    (('tensor', 'workers', 'cores'),)
    >>> tuple(state_spec(0, ShardedState({0: 0}), TensorLayout("tensor", 2, (1,))))
    (('workers', 'cores'), 'tensor')
    """
    axis = shard_axis(sharded_state, index)
    dim = tensor.state_dims[index] if tensor is not None else None
    entries: list[Any] = [None] * (max(-1 if axis is None else axis, -1 if dim is None else dim) + 1)
    if axis is not None:
        entries[axis] = REPLICA_AXES
    if dim is not None:
        entries[dim] = (tensor.axis, *REPLICA_AXES) if dim == axis else tensor.axis
    return P(*entries)


def place_state(
    leaves: Sequence[Any],
    mesh: Mesh,
    sharded_state: frozenset[int] = frozenset(),
    tensor: TensorLayout | None = None,
) -> list[jax.Array]:
    """Put state leaves on the mesh, replicated or sharded (no copy if already there).

    On a mesh that spans processes, leaves that come from the host (or from
    one process's devices) are first made identical: every process takes
    process 0's values (one collective for all of them), then each process
    fills its own devices.
    """
    targets = [NamedSharding(mesh, state_spec(i, sharded_state, tensor)) for i in range(len(leaves))]
    out: list[Any] = [None] * len(leaves)
    from_host: list[int] = []
    multi = spans_processes(mesh)
    for i, leaf in enumerate(leaves):
        target = targets[i]
        if isinstance(leaf, jax.Array) and not getattr(leaf, "weak_type", False) and _is_laid_out(leaf, target):
            out[i] = leaf
        elif not multi:
            out[i] = jax.device_put(_strong(leaf), target)
        elif isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            out[i] = jax.device_put(leaf, target)  # a global array laid out otherwise: reshard on device
        else:
            from_host.append(i)
    if from_host:
        # Rank-0 semantics (Horovod's broadcast_parameters, DDP's constructor):
        # every worker takes worker 0's copy, whatever it built itself.
        from jax.experimental import multihost_utils

        hosts = [np.asarray(h) for h in multihost_utils.broadcast_one_to_all([_strong(leaves[i]) for i in from_host])]
        for i, host in zip(from_host, hosts, strict=True):
            out[i] = jax.make_array_from_callback(host.shape, targets[i], lambda index, host=host: host[index])
    return out


#: Batches below this many bytes are not checked against the free memory (the check reads /proc/meminfo).
MEMORY_CHECK_BYTES = 1 << 30
#: A set of leaf types with nothing but NumPy arrays (subclasses left out: they go through ``np.asarray``).
_NUMPY_ONLY = frozenset({np.ndarray})


def available_host_memory() -> int | None:
    """Bytes of memory the kernel says are available (Linux ``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_host_memory(worker_leaves: list[list[Any]], mesh: Mesh) -> None:
    """On CPU devices, a batch larger than the free memory is an error here, not the OOM killer later."""
    if mesh.devices.flat[0].platform != "cpu":
        return
    sizes = [sum(int(getattr(leaf, "nbytes", 0)) for leaf in leaves) for leaves in zip(*worker_leaves, strict=True)]
    total = sum(sizes)
    if total < MEMORY_CHECK_BYTES:
        return
    free = available_host_memory()
    if free is not None and total > free:
        largest = max(range(len(sizes)), key=sizes.__getitem__)
        raise MemoryError(
            f"the batch needs {total / 2**30:.1f} GiB on the CPU devices (leaf {largest} of the batch, in "
            f"tree order, is {sizes[largest] / 2**30:.1f} GiB) but only {free / 2**30:.1f} GiB of memory is "
            "available. Yield smaller batches from input_fn (more steps, or gradient accumulation with "
            "rp.accumulate_gradients)."
        )


def _is_key(x: Any) -> bool:
    """Whether ``x`` is an array of typed PRNG keys (``jax.random.key``), which NumPy cannot hold."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _one_local_array(per_worker: Sequence[Any]) -> Any:
    """The leaves of every local worker as one array of this process's rows (NumPy, or JAX for typed keys)."""
    if len(per_worker) == 1:
        return per_worker[0]
    if any(map(_is_key, per_worker)):
        if not all(map(_is_key, per_worker)) or len({x.dtype for x in per_worker}) > 1:
            raise TypeError(
                f"workers yielded batch leaves of different dtypes {sorted({str(x.dtype) for x in per_worker})}."
            )
        return jnp.concatenate(per_worker, axis=0)
    host = [np.asarray(x) for x in per_worker]
    dtypes = {x.dtype for x in host}
    if len(dtypes) > 1:
        raise TypeError(f"workers yielded batch leaves of different dtypes {sorted(map(str, dtypes))}.")
    return np.concatenate(host, axis=0)


def _process_local_to_global(local: Any, target: NamedSharding, global_rows: int) -> jax.Array:
    """One global array from this process's rows (``make_array_from_process_local_data``); typed keys go as
    their key data and are wrapped again on the devices."""
    if not _is_key(local):
        local = np.asarray(local)
        return jax.make_array_from_process_local_data(target, local, (global_rows, *local.shape[1:]))
    data = np.asarray(jax.random.key_data(local))
    placed = jax.make_array_from_process_local_data(target, data, (global_rows, *data.shape[1:]))
    return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(local))


def place_batch(
    worker_leaves: list[list[Any]],
    mesh: Mesh,
    num_workers: int | None = None,
    *,
    nbytes: int | None = None,
    host: bool = False,
) -> list[Any]:
    """Global batch arrays from each local worker's leaves, sharded by replica.

    Host leaves go to the devices in one ``jax.device_put`` call for all of them. JAX arrays already laid out
    by replica are used as they are; other JAX arrays (typed PRNG keys among them) are put there on the
    devices.

    Args:
      worker_leaves: for each worker of this process, in worker order, its
        batch leaves.
      mesh: the mesh; on one that spans processes, each process passes its
        own workers' leaves and gets the global arrays.
      num_workers: workers in the job (default: the mesh's rows; more when
        several replicas share a device).
      nbytes: the bytes of all the leaves, if known (the free-memory check is
        skipped below :data:`MEMORY_CHECK_BYTES` without adding them up).
      host: on a mesh of one process, return host (NumPy) leaves as they are,
        for the compiled step's own dispatch to place by its input sharding (a
        jitted function given NumPy arrays places them faster than a
        ``jax.device_put`` call before it).
    """
    if nbytes is None or nbytes >= MEMORY_CHECK_BYTES:
        _check_host_memory(worker_leaves, mesh)
    elif host and len(worker_leaves) == 1 and set(map(type, worker_leaves[0])) <= _NUMPY_ONLY:
        # The usual step without prefetch: one worker's NumPy leaves go to the compiled step as they are.
        if not spans_processes(mesh):
            return list(worker_leaves[0])
    target = sharded(mesh)
    multi = spans_processes(mesh)
    out: list[Any] = []
    to_put: list[int] = []
    for per_worker in zip(*worker_leaves, strict=True):
        local = _one_local_array(per_worker)
        if isinstance(local, jax.Array):
            if local.sharding == target:
                out.append(local)
                continue
            if not multi:
                to_put.append(len(out))
                out.append(local)
                continue
        elif type(local) is not np.ndarray:
            local = np.asarray(local)
        if not multi:
            if not host:
                to_put.append(len(out))
            out.append(local)
        else:
            # Every process holds the same number of workers (build_mesh checks it).
            global_rows = local.shape[0] // len(worker_leaves) * (num_workers or mesh.devices.shape[0])
            out.append(_process_local_to_global(local, target, global_rows))
    if len(to_put) == 1:
        out[to_put[0]] = jax.device_put(out[to_put[0]], target)
    elif to_put:
        for i, placed in zip(to_put, jax.device_put([out[i] for i in to_put], target), strict=True):
            out[i] = placed
    return out
