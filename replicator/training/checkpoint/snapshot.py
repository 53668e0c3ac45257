"""This process's part of a state, taken at a step for an asynchronous save: captured now, fetched later.

:func:`capture` runs at the step, on the training thread, and waits for
nothing: for every shard this process writes (:func:`~.shards.plan`) and, on
process 0, every leaf stored whole, it keeps the one-device array that holds
it (the background thread copies it to the host). With
``copy_on_device=True`` each is first copied on its own device (one more copy
of this process's part in device memory until it is fetched), so that the
next step may donate the state's buffers (``Replicator(donate_state=True)``).
The background thread then fetches them (:meth:`Snapshot.shard`,
:meth:`Snapshot.stored_whole`): nothing is gathered, each array comes from
the device that holds it. PRNG keys split over processes (small) are gathered
at capture, as that is a collective.

Promises:

1. An asynchronous save holds the values of the call: a host (numpy) leaf is copied at capture, so changing it
   in place afterwards does not change the checkpoint
   (tests/test_checkpoint_async.py::test_an_async_save_keeps_host_leaves_as_they_were_when_it_was_called).
2. With ``copy_on_device=True`` the state's buffers may be deleted (donated) before the thread copies them; without
   it a deleted leaf is a CheckpointError naming the leaf and ``copy_on_device=True``
   (tests/test_checkpoint_async.py::test_a_deleted_state_is_reported_and_copy_on_device_keeps_it).
3. A process holds the shards it writes, found by the value of its index, not its identity
   (tests/test_checkpoint.py::test_a_snapshot_holds_this_process_shards_matched_by_value_not_identity).
4. Only the writer (process 0) holds the leaves stored whole; what it holds becomes exactly the arrays a
   synchronous save stores (bfloat16 as uint16, a key as its key data), and :meth:`Snapshot.release` drops all
   (tests/test_checkpoint_async.py::test_only_the_writer_holds_the_leaves_stored_whole_and_they_are_what_a_save_stores).
5. An asynchronous save writes what a synchronous one writes: the same entries, shards and sha256
   (tests/test_checkpoint_async.py::test_an_async_save_writes_what_a_save_writes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from replicator.training.checkpoint import encoding, shards
from replicator.training.checkpoint.encoding import CheckpointError

__all__ = ["Snapshot", "capture"]


def _hold(array: jax.Array, copy_on_device: bool) -> jax.Array:
    """A one-device array kept for a later fetch by the background thread.

    The device-to-host copy is not started here: on a GPU ``copy_to_host_async``
    returns only once the copy is done (measured on an H100: 64 ms for 100 MB,
    benchmarks/results/async-save.md), which would pause the step. The
    background thread's ``np.asarray`` copies instead.
    """
    if copy_on_device:
        array = jax.device_put(array, next(iter(array.devices())), may_alias=False)
    return array


def _fetch(value: Any, entry: Mapping[str, Any]) -> np.ndarray:
    """The host value of a held array (waits for its copy), or the numpy value itself."""
    if not isinstance(value, jax.Array):
        return value
    try:
        return np.asarray(value)
    except RuntimeError:
        if not value.is_deleted():
            raise
        raise CheckpointError(
            f"state{entry['path']} was deleted (donated to a later step?) before the background save copied it "
            f"off its device. Save with copy_on_device=True when the state's buffers are donated "
            f"(Replicator(donate_state=True)); CheckpointHook does so by itself."
        ) from None


@dataclasses.dataclass
class Snapshot:
    """What one process writes of a state, held at a step (see :func:`capture`)."""

    entries: Sequence[Mapping[str, Any]]
    shards: dict[tuple[int, shards.Bounds], Any]  # (leaf, bounds) -> one-device array
    whole: dict[int, Any]  # leaf index -> one-device array, or a numpy copy (process 0)
    ready: dict[int, np.ndarray]  # leaf index -> the stored array, gathered at capture (process 0)

    def shard(self, record: shards.Record) -> np.ndarray:
        """The host values of one of this process's shards (for :func:`~.shards.write_own`)."""
        return _fetch(self.shards[record.leaf, record.bounds], self.entries[record.leaf])

    def stored_whole(self) -> dict[str, np.ndarray]:
        """The arrays file's contents: every leaf stored whole, as :func:`~.encoding.stored` makes them."""
        out = {f"a{i}": array for i, array in self.ready.items()}
        for i, value in self.whole.items():
            host = _fetch(value, self.entries[i])
            out[f"a{i}"] = host if "key_impl" in self.entries[i] else encoding.stored(host, self.entries[i])
        return {name: out[name] for name in sorted(out, key=lambda n: int(n[1:]))}

    def release(self) -> None:
        """Drop the held arrays (their device memory is freed once nothing else holds them)."""
        self.shards, self.whole, self.ready = {}, {}, {}


def capture(
    leaves: Sequence[Any],
    entries: Sequence[Mapping[str, Any]],
    layout: Mapping[int, list[shards.Record]],
    process: int,
    writer: bool,
    copy_on_device: bool,
) -> Snapshot:
    """Hold this process's part of a state (its own shards; process 0 also the leaves stored whole).

    In a multi-process job this is a collective only where a leaf stored
    whole is split over processes (a PRNG key array), as :func:`~.encoding.stored` is.
    """
    held = {
        (r.leaf, r.bounds): _hold(shards.device_shard(leaves[r.leaf], r.device), copy_on_device)
        for records in layout.values()
        for r in records
        if r.process == process
    }
    whole: dict[int, Any] = {}
    ready: dict[int, np.ndarray] = {}
    for i, (leaf, entry) in enumerate(zip(leaves, entries, strict=True)):
        if i in layout:
            continue
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable and not leaf.is_fully_replicated:
            stored = encoding.stored(leaf, entry, writer)  # gathered over processes: a collective (keys)
            if writer:
                assert stored is not None
                ready[i] = stored
            continue
        if "key_impl" in entry:
            leaf = jax.random.key_data(leaf)  # on every process, as a computation on a mesh of several must be
        if not writer:
            continue
        if isinstance(leaf, jax.Array):
            whole[i] = _hold(leaf.addressable_data(0), copy_on_device)
        else:
            whole[i] = np.array(leaf, copy=True)  # the caller may change a host array in place
    return Snapshot(entries, held, whole, ready)
