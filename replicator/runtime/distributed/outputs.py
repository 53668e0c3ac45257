"""Reading ``Replicator.run`` outputs on the host, in one process or several.

Outputs come back with a leading axis over all replicas; in a multi-process
job each process holds only its own replicas' rows. :func:`local_outputs`
reads those, :func:`replica_invariant` reads one copy of a value that is equal
on every replica (and checks that it is), :func:`gather_outputs` brings every
replica's rows to every worker (a collective).

Promises:

1. ``local_outputs`` is NumPy: in one process every replica's rows
   (tests/test_distributed.py::TestOutputsInOneProcess::test_local_outputs_replica_invariant_gather), with
   several this worker's replicas' rows in replica order
   (tests/test_distributed.py::TestTwoProcesses::test_same_result_as_one_process).
2. ``gather_outputs`` gives every replica's rows, in one process and on every worker of a job
   (tests/test_distributed.py::TestOutputsInOneProcess::test_local_outputs_replica_invariant_gather,
   tests/test_distributed.py::TestTwoProcesses::test_same_result_as_one_process).
3. ``replica_invariant`` returns one row of a leaf whose rows are identical bit for bit; otherwise a
   ``ValueError`` names the leaf and the replicas that differ (the first eight, then ``...``), with their ids in
   the job (tests/test_distributed.py::TestOutputsInOneProcess::test_local_outputs_replica_invariant_gather,
   tests/test_distributed.py::TestTwoProcesses::test_same_result_as_one_process).
4. Bit for bit means equal NaNs pass and ``-0.0`` differs from ``0.0``, in narrow floats too; a row of any dtype
   (bool, int8, float16, bfloat16) comes back with its dtype
   (tests/test_distributed.py::TestOutputsInOneProcess::test_replica_invariant_compares_bits,
   tests/test_distributed.py::test_replica_invariant_of_narrow_floats_tells_minus_zero_apart_and_takes_equal_nans,
   tests/test_distributed.py::test_replica_invariant_compares_narrow_rows_bit_for_bit_and_keeps_the_dtype).
5. A state leaf replicated on every device comes back whole, not as rows
   (tests/test_distributed.py::TestOutputsInOneProcess::test_replica_invariant_returns_a_replicated_state_leaf_whole).
6. A 0-d leaf, or one with no rows, is a ``ValueError``: it has no replica axis to read
   (tests/test_distributed.py::TestOutputsInOneProcess::test_replica_invariant_compares_bits,
   tests/test_distributed.py::test_replica_invariant_refuses_a_leaf_with_no_rows).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["gather_outputs", "local_outputs", "replica_invariant"]

PyTree = Any

_SHOWN = 8  # replica ids listed in an error message


def _rows_and_replicas(x: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """This process's rows of an array stacked by replica, in replica order, and those replicas' ids."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        rows = np.asarray(x)
        return rows, (np.arange(rows.shape[0]) if rows.ndim else None)
    if x.sharding.is_fully_replicated:  # every process holds every row
        rows = np.asarray(x.addressable_data(0))
        return rows, (np.arange(rows.shape[0]) if rows.ndim else None)
    rows_at: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        start = (shard.index[0].start or 0) if shard.index else 0
        rows_at.setdefault(start, np.asarray(shard.data))
    starts = sorted(rows_at)
    ids = np.concatenate([np.arange(s, s + rows_at[s].shape[0]) for s in starts])
    return np.concatenate([rows_at[s] for s in starts], axis=0), ids


def local_outputs(outputs: PyTree) -> PyTree:
    """This worker's replicas' rows of ``Replicator.run`` outputs, as numpy.

    No communication. In a multi-process job the leading size is
    ``len(repl.local_workers) * cores_per_worker`` (this worker's replicas, in
    replica order); in a single process it is ``np.asarray`` of every leaf.

    Args:
      outputs: the outputs of ``Replicator.run`` (a pytree of arrays).

    Returns:
      The same pytree of numpy arrays.
    """
    return jax.tree.map(lambda x: _rows_and_replicas(x)[0], outputs)


def replica_invariant(outputs: PyTree) -> PyTree:
    """The one value of each output leaf that is equal on every replica (e.g. ``rp.all_mean(loss)``).

    No communication: it reads this worker's replicas' rows, checks that they
    are identical bit for bit, and returns the first. (Values equal on this
    worker's replicas but not across workers are not caught; use
    :func:`gather_outputs` to compare every replica's.)

    A leaf replicated on every device of its mesh (a state leaf: ``Replicator.run``'s new state, without
    ZeRO) has no replica axis: it is returned whole, this process's copy, with no check (that is
    ``check_state_every``'s). A state leaf split over the replicas (ZeRO) is not one value per replica: read
    it whole with :func:`gather_outputs`.

    Args:
      outputs: the outputs of ``Replicator.run`` (leaves stacked by replica), or its replicated state.

    Returns:
      The same pytree, each output leaf one replica's row (each state leaf whole), as numpy.

    Raises:
      ValueError: if a leaf's rows differ between this worker's replicas (the
        message names the leaf and the replicas that differ), or if a leaf
        has no leading replica axis.
    """

    def one(path: Any, x: Any) -> np.ndarray:
        if isinstance(x, jax.Array) and x.sharding.is_fully_replicated and len(x.sharding.device_set) > 1:
            return np.asarray(x.addressable_data(0))  # a state leaf: one value on every device, no replica axis
        rows, replicas = _rows_and_replicas(x)
        key = jax.tree_util.keystr(path, simple=True, separator=".")
        name = f"output {key!r}" if key else "the output"
        if replicas is None or rows.shape[0] == 0:
            raise ValueError(
                f"replica_invariant: {name} has no leading replica axis (shape {rows.shape}); pass the outputs "
                f"of Replicator.run, whose leaves are stacked by replica."
            )
        bits = np.ascontiguousarray(rows).view(np.uint8).reshape(rows.shape[0], -1)
        differ = (bits != bits[0]).any(axis=1)
        if differ.any():
            bad = [int(r) for r in replicas[differ]]
            shown = f"{bad[:_SHOWN]}{' ...' if len(bad) > _SHOWN else ''}"
            raise ValueError(
                f"replica_invariant: {name} is not the same on every replica: replica(s) {shown} differ from "
                f"replica {int(replicas[0])} (compared bit for bit). Read per-replica values with "
                f"rp.local_outputs(out) (this worker's replicas) or rp.gather_outputs(out) (every replica's), "
                f"or make the value equal on every replica in step_fn, e.g. with rp.all_mean."
            )
        return rows[0]

    return jax.tree_util.tree_map_with_path(one, outputs)


def gather_outputs(outputs: PyTree) -> PyTree:
    """Every replica's rows of ``Replicator.run`` outputs, on every worker, as numpy.

    A collective in a multi-process job: every worker must call it, with the
    same outputs. In a single process it is ``np.asarray`` of every leaf.

    Args:
      outputs: the outputs of ``Replicator.run``.

    Returns:
      The same pytree of numpy arrays, each with every replica's rows.
    """

    def gather(x: Any) -> np.ndarray:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(gather, outputs)
