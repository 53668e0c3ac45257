"""Checking at run time that every replica still holds the same state.

The compile-time checks prove that a step keeps replicated state identical on
every replica; what they cannot see (a non-deterministic kernel, a device that
computed differently, state placed by hand) can still make replicas drift.
``Replicator(check_state_every=K)`` calls :func:`check_replicas_agree` on the
new state every ``K`` steps: every device checksums its own copy of each
replicated leaf (one small jitted program; 4 bytes per leaf and device come
back), the checksums are compared within the process and across processes
with one small all-gather. The first leaf whose copies differ is named with
the devices that disagree.

>>> repl = rp.Replicator(1, 8, check_state_every=1)
>>> w, _ = repl.run(lambda w, b: (w + rp.all_mean(b["x"][0]), {}), lambda ctx: iter([{"x": np.ones((8, 2))}]), np.zeros(2))

Promises:

1. ``check_state_every=K`` checks the new state after every ``K``-th step; replicas that agree pass every
   step, with float32, int32, bool and bfloat16 leaves
   (tests/test_consistency.py::test_identical_replicas_pass_every_step,
   tests/test_consistency.py::test_a_drifted_leaf_is_named_with_the_devices).
2. ``check_state_every`` that is not a positive int is a ``ValueError``
   (tests/test_consistency.py::test_bad_values_are_rejected).
3. A replicated leaf whose copies differ is a ``DivergentStateError`` naming the leaf's path and the devices
   on each side, the majority first (tests/test_consistency.py::test_a_drifted_leaf_is_named_with_the_devices,
   tests/test_consistency.py::test_the_majority_is_named_first_and_skipped_leaves_stop_nothing).
4. Any change of bits is seen: one ulp, two elements swapped, a sign flip, in float32, bfloat16 and bool leaves
   (tests/test_consistency.py::test_the_checksum_sees_a_one_ulp_change_and_a_swap,
   tests/test_consistency.py::test_a_sign_flip_and_narrow_dtypes_are_seen); the checksum is the documented
   position-weighted sum of the bits modulo 2**32, for float32, int8, bfloat16 and bool
   (tests/test_consistency.py::test_the_checksum_is_the_documented_sum).
5. A 0-d leaf (a loss scale, a step count, a flag, a float16) is checked by both checks and stops a checked
   run (tests/test_consistency.py::test_a_0d_leaf_that_drifted_is_named_by_both_checks,
   tests/test_consistency.py::test_a_0d_leaf_drifted_by_hand_stops_a_checked_run).
6. A leaf that is not a device array, or of an 8-byte dtype (complex64), is skipped, and the leaves after it
   are still checked (tests/test_consistency.py::test_the_majority_is_named_first_and_skipped_leaves_stop_nothing,
   tests/test_consistency.py::test_an_8_byte_leaf_is_skipped_and_the_leaves_after_it_are_still_checked).
7. ``check_replicas_agree`` skips leaves split over the replicas (ZeRO); ``check_copies_agree`` compares only
   the devices that hold the same part of a leaf
   (tests/test_consistency.py::test_a_sharded_leaf_is_not_a_replicated_one,
   tests/test_consistency.py::test_copies_of_a_stage_row_are_compared_within_the_stage).
8. A drifted replica of a pipeline stage is named, under ``run`` and ``run_pipelined``
   (tests/test_consistency.py::test_a_pipeline_stage_whose_replica_drifted_is_named).
9. ``check_copies_agree`` compares the copies on every process, each process naming the same devices
   (tests/test_consistency.py::test_copies_on_two_processes_are_compared), and a leaf on another mesh than
   the first on its own devices (tests/test_consistency.py::test_a_leaf_on_another_mesh_is_compared_on_its_own_devices).
10. ``check_replicas_agree`` in a job of several processes compares each process's copy with worker 0's (one
    all-gather); a worker whose copy differs is a ``ValueError`` naming the leaf and the worker
    (tests/test_consistency.py::test_each_process_is_compared_with_worker_0s_copy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.errors import DivergentStateError
from replicator.runtime.distributed.agreement import check_same_across_workers

__all__ = ["check_copies_agree", "check_replicas_agree"]


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _checksum(x: jax.Array) -> jax.Array:
    """A position-dependent 32-bit checksum of ``x``'s bits (wrapping integer arithmetic: exact)."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        bits = lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    bits = bits.reshape(-1)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32) ^ jnp.uint32(bits.size)


_checksum_on_device = jax.jit(_checksum)


def check_copies_agree(leaves: Sequence[Any], paths: Sequence[str]) -> None:
    """Raise :class:`~replicator.DivergentStateError` if two devices that hold the same part of a leaf (the same
    shard index: a pipeline stage's row on each of that stage's replicas) hold different bits.

    For state laid out over a mesh with other axes than the replicas' (``('stages', 'workers', 'cores')``):
    one small jitted program checksums each device's own shard of every leaf and all-gathers the checksums
    (4 bytes per leaf and device), so every process compares every device's copy, its own and the other
    processes' (a stage whose replicas sit on two hosts). Every process must call it at the same point, as
    it calls the step. A leaf on another mesh or placement than the first is compared on this process's
    devices only.

    Args:
      leaves: ``jax.Array``s (other leaves, and 8-byte dtypes, are skipped); paths: a name per leaf.
    """
    picked = [
        (path, leaf)
        for path, leaf in zip(paths, leaves, strict=True)
        if isinstance(leaf, jax.Array) and leaf.dtype.itemsize <= 4
    ]
    mesh = next((leaf.sharding.mesh for _, leaf in picked if isinstance(leaf.sharding, NamedSharding)), None)
    on_mesh = [(path, leaf) for path, leaf in picked if _on(mesh, leaf)]
    elsewhere = [(path, leaf) for path, leaf in picked if not _on(mesh, leaf)]
    if on_mesh:
        specs = tuple(leaf.sharding.spec for _, leaf in on_mesh)
        sums = _gathered_checksums(mesh, specs)(*(leaf for _, leaf in on_mesh))
        table = np.asarray(sums.addressable_shards[0].data)  # (devices, leaves), every device's, on every process
        row_of = {device.id: r for r, device in enumerate(mesh.devices.flat)}
        for i, (path, leaf) in enumerate(on_mesh):
            groups: dict[tuple, dict[int, list[int]]] = {}
            for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
                digest = int(table[row_of[device.id], i])
                groups.setdefault(_index_key(index), {}).setdefault(digest, []).append(device.id)
            _check_groups(path, groups)
    for path, leaf in elsewhere:
        groups = {}
        for shard in leaf.addressable_shards:
            digest = int(_checksum_on_device(shard.data))
            groups.setdefault(_index_key(shard.index), {}).setdefault(digest, []).append(shard.device.id)
        _check_groups(path, groups)


def _on(mesh: Mesh | None, leaf: jax.Array) -> bool:
    return isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh


def _index_key(index: tuple) -> tuple:
    """An array's shard index (slices) as a hashable key."""
    return tuple((i.start, i.stop, i.step) for i in index)


def _check_groups(path: str, groups: dict[tuple, dict[int, list[int]]]) -> None:
    for index, digests in groups.items():
        _check_one_value(f"{path}: the copies of its part {_index_text(index)} are no longer identical", digests)


@functools.lru_cache(maxsize=32)
def _gathered_checksums(mesh: Mesh, specs: tuple) -> Callable:
    """``(leaves) -> (devices, n)``, the same on every device: each device's checksum of its own shard of each
    leaf, all-gathered over the whole mesh (rows in ``mesh.devices.flat`` order)."""

    def local(*shards: jax.Array) -> jax.Array:
        return lax.all_gather(jnp.stack([_checksum(x) for x in shards]), tuple(mesh.axis_names))

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False))


def _check_one_value(subject: str, groups: dict[int, list[int]], hint: str = "") -> None:
    """Raise :class:`~replicator.DivergentStateError` naming the devices if ``groups`` (checksum -> the devices
    that computed it) holds more than one value."""
    if len(groups) > 1:
        ordered = sorted(groups.values(), key=len, reverse=True)
        raise DivergentStateError(
            f"{subject}: devices {ordered[0]} hold one value, {[d for g in ordered[1:] for d in g]} another. The "
            "step keeps it identical when every replica computes it from all-reduced values; look for "
            f"non-deterministic operations or state placed by hand with different values per device{hint}."
        )


def _index_text(index: tuple) -> str:
    return "[" + ", ".join(f"{'' if a is None else a}:{'' if b is None else b}" for a, b, _ in index) + "]"


def check_replicas_agree(leaves: Sequence[Any], paths: Sequence[str]) -> None:
    """Raise :class:`~replicator.DivergentStateError` if a replicated leaf differs between devices.

    One small jitted program (the one :func:`check_copies_agree` uses) computes, on every device, a checksum
    of that device's copy of each leaf; 4 bytes per leaf and device come back. This process's devices are
    compared with each other, then each process's value with worker 0's.

    Args:
      leaves: the state's array leaves (``jax.Array``s on one mesh); leaves
        stored sharded (ZeRO) differ between devices by design and are skipped.
      paths: a name per leaf, e.g. ``state['w']``.
    """
    picked = [
        (path, leaf)
        for path, leaf in zip(paths, leaves, strict=True)
        if isinstance(leaf, jax.Array)
        and isinstance(leaf.sharding, NamedSharding)  # on a mesh: one device's array has no copies to compare
        and leaf.sharding.is_fully_replicated
        and leaf.dtype.itemsize <= 4
    ]
    if not picked:
        return
    mesh = picked[0][1].sharding.mesh
    picked = [(path, leaf) for path, leaf in picked if leaf.sharding.mesh == mesh]
    sums = _gathered_checksums(mesh, tuple(P() for _ in picked))(*(leaf for _, leaf in picked))
    table = np.asarray(sums.addressable_shards[0].data)  # (devices, leaves), every device's, on every process
    here = jax.process_index()
    rows = {d.id: table[r] for r, d in enumerate(mesh.devices.flat) if d.process_index == here}  # device -> (n,)
    local = []
    for i, (path, _) in enumerate(picked):
        groups: dict[int, list[int]] = {}
        for device, row in rows.items():
            groups.setdefault(int(row[i]), []).append(device)
        _check_one_value(f"{path} is no longer identical on every replica", groups, " (use rp.broadcast_state)")
        local.append(np.asarray(next(iter(groups)), np.int64))
    check_same_across_workers(
        local,
        [path for path, _ in picked],
        what="the replicated state",
        fix="A worker's replicas drifted from worker 0's; look for non-deterministic operations or a "
        "per-worker value that entered the state.",
    )
