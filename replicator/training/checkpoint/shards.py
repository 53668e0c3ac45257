"""Leaves split over devices, stored as shards: the layout, writing each process's own, reading any region.

A leaf that is a ``jax.Array`` split over several devices (not fully
replicated, e.g. Adam's ``mu`` under ZeRO) is stored as its distinct shards:
each distinct index of the global array (the slice a device holds) is
written once, by its *owner*, the holding device with the lowest
``(process_index, id)``, so a replicated copy is never written twice and a
shard held on process 0 is written by process 0. Every process computes the
same layout (:func:`plan`) from the leaves' shardings, without communication.

Process ``p`` writes its shards' raw bytes (little-endian, C order) one after
another into ``shards-p<p>.bin`` (:func:`write_own`); in a multi-process job
it lists their sha256 in a sidecar ``shards-p<p>.json`` that process 0 reads
(:func:`collect`) and folds into the manifest, which then records, per leaf,
each shard's file, offset, byte count, index (``[start, stop]`` per axis) and
sha256. :class:`LeafReader` assembles any region of a leaf from the records
that overlap it, checking each record's sha256 as it reads it.

Promises:

1. A leaf split over devices is stored as its distinct shards, each once, never gathered; replicated leaves,
   host leaves and PRNG keys are stored whole
   (tests/test_checkpoint_sharded.py::test_each_shard_is_written_once_at_its_size,
   tests/test_checkpoint_sharded.py::test_a_split_leaf_is_never_gathered,
   tests/test_checkpoint.py::TestRoundTrip::test_leaves_sharded_over_the_mesh).
2. Each shard is written by its holder of lowest ``(process_index, id)``, at consecutive offsets of its process's
   file in the order of the records
   (tests/test_checkpoint_sharded.py::test_each_shard_is_written_by_its_holder_of_lowest_process_and_id_at_consecutive_offsets).
3. A record's bytes are its values, little-endian in C order, with the sha256 the manifest records
   (tests/test_checkpoint_sharded.py::test_each_shard_is_written_once_at_its_size).
4. Every dtype (bool, int8, float16, bfloat16, complex64, uint32) comes back from shards with its dtype and values
   (tests/test_checkpoint_sharded.py::test_every_dtype_round_trips_through_shards).
5. A shard with a strided index is refused (tests/test_checkpoint_sharded.py::test_a_strided_shard_is_refused).
6. :class:`LeafReader` reads, for a region, only the records that overlap it, each record read and checked once
   (tests/test_checkpoint_sharded.py::test_a_region_reads_only_the_records_that_overlap_it_each_once,
   tests/test_checkpoint_sharded.py::test_two_processes_restore_their_parts_and_write_their_own_shards).
7. A flipped byte, a truncated or a missing shard file is a DamagedCheckpoint naming the file and the leaf
   (tests/test_checkpoint_sharded.py::test_a_damaged_shard_is_detected_and_skipped_with_fallback).
8. Process 0 takes another process's shards only as the layout expects them (the same records, offsets and
   sizes), and a shard file only of their total size
   (tests/test_checkpoint_sharded.py::test_a_sidecar_whose_offsets_or_sizes_differ_from_the_layout_is_refused,
   tests/test_checkpoint_sharded.py::test_a_shard_file_shorter_than_its_records_is_refused).
9. Process 0 waits for a sidecar at most ``wait_s``, then raises a CheckpointError about a shared file system; a
   failure report ends the wait with that process's error
   (tests/test_checkpoint_sharded.py::test_process_zero_waits_for_a_missing_sidecar_at_most_its_bound,
   tests/test_checkpoint_sharded.py::test_a_failure_report_ends_the_wait_for_a_sidecar_with_that_process_error).
10. A leaf restores onto any layout (another mesh, replica count or ZeRO stage, or the host) bit for bit as saved
    (tests/test_checkpoint_sharded.py::test_restore_onto_another_layout_trains_on,
    tests/test_checkpoint_sharded.py::test_restore_onto_the_host).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from replicator.runtime.distributed import progress
from replicator.training.checkpoint import encoding, files
from replicator.training.checkpoint.encoding import CheckpointError
from replicator.training.checkpoint.manifest import DamagedCheckpoint

__all__ = [
    "SIDECAR_WAIT_S",
    "LeafReader",
    "Record",
    "collect",
    "device_shard",
    "is_split",
    "plan",
    "shard_file",
    "write_failure",
    "write_own",
]

#: How long process 0 waits for another process's sidecar to become visible (a shared file system's delay).
SIDECAR_WAIT_S = 30.0

Bounds = tuple[tuple[int, int], ...]


def shard_file(process: int) -> str:
    """The name of the file that holds process ``process``'s shards."""
    return f"shards-p{process:05d}.bin"


def _sidecar(process: int) -> str:
    return f"shards-p{process:05d}.json"


def _failure(process: int) -> str:
    return f"shards-p{process:05d}.failed"


def write_failure(directory: str, process: int, error: BaseException) -> None:
    """Tell process 0, through a file, that this process failed to write its shards (an asynchronous save,
    whose process 0 waits for the sidecars with no collective to learn it from). Best effort."""
    try:
        files.write_text(os.path.join(directory, _failure(process)), f"{type(error).__name__}: {error}")
    except OSError:
        pass  # process 0 then gives up waiting for the sidecar after its bound


def is_split(leaf: Any) -> bool:
    """Whether a state leaf is stored as shards: a ``jax.Array`` split over devices (PRNG keys never are)."""
    return (
        isinstance(leaf, jax.Array)
        and leaf.ndim > 0
        and not encoding.is_key(leaf.dtype)
        and not leaf.sharding.is_fully_replicated
    )


def _bounds(index: Sequence[slice], shape: Sequence[int]) -> Bounds:
    """``[start, stop)`` per axis of a device's index (a tuple of slices, possibly open)."""
    out = []
    for axis, dim in enumerate(shape):
        s = index[axis] if axis < len(index) else slice(None)
        start, stop, stride = s.indices(dim)
        if stride != 1:
            raise CheckpointError(f"a shard with a strided index {index} cannot be saved; use a NamedSharding.")
        out.append((start, max(start, stop)))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Record:
    """One stored shard of leaf ``leaf``: where it is in the global array and in its process's file."""

    leaf: int
    bounds: Bounds
    process: int
    device: Any
    offset: int
    nbytes: int

    @property
    def index(self) -> list[list[int]]:
        return [[a, b] for a, b in self.bounds]


def plan(leaves: Sequence[Any], entries: Sequence[Mapping[str, Any]]) -> dict[int, list[Record]]:
    """The shards of every split leaf (leaf index -> records), with each process's file offsets.

    The same on every process: it reads only the leaves' shardings.
    """
    offsets: dict[int, int] = {}
    layout: dict[int, list[Record]] = {}
    for i, (leaf, entry) in enumerate(zip(leaves, entries, strict=True)):
        if not is_split(leaf):
            continue
        shape = tuple(leaf.shape)
        itemsize = np.dtype(encoding.stored_dtype(entry)).itemsize
        owners: dict[Bounds, Any] = {}
        for device, index in leaf.sharding.devices_indices_map(shape).items():
            bounds = _bounds(index, shape)
            best = owners.get(bounds)
            if best is None or (device.process_index, device.id) < (best.process_index, best.id):
                owners[bounds] = device
        records = []
        for bounds in sorted(owners):
            device = owners[bounds]
            process = device.process_index
            nbytes = math.prod(b - a for a, b in bounds) * itemsize
            records.append(Record(i, bounds, process, device, offsets.get(process, 0), nbytes))
            offsets[process] = offsets.get(process, 0) + nbytes
        layout[i] = records
    return layout


def device_shard(leaf: jax.Array, device: Any) -> jax.Array:
    """``leaf``'s shard on ``device``, a one-device array (no copy)."""
    return next(s.data for s in leaf.addressable_shards if s.device == device)


def _shard_bytes(data: Any, entry: Mapping[str, Any]) -> np.ndarray:
    """The stored form (little-endian, C order) of one shard: one device-to-host copy of a one-device array."""
    host = np.asarray(data).astype(jnp.dtype(entry["dtype"]), copy=False)
    if "stored_as" in entry:
        host = host.view(np.dtype(entry["stored_as"]))
    return np.ascontiguousarray(host.astype(host.dtype.newbyteorder("<"), copy=False))


def write_own(
    directory: str,
    data: Callable[[Record], Any],
    entries: Sequence[Mapping[str, Any]],
    layout: Mapping[int, list[Record]],
    process: int,
    sidecar: bool,
    report: bool = True,
) -> dict[tuple[int, Bounds], str]:
    """Write this process's shards into ``directory``; returns their sha256 by ``(leaf, bounds)``.

    ``data(record)`` is the shard's values: a one-device array (e.g.
    :func:`device_shard`) or a numpy array. Nothing is written if this
    process owns no shard. ``sidecar=True`` (a process other than 0 in a
    multi-process job) also writes the list of its records and their sha256
    for process 0 to read. ``report``: each shard written counts as progress
    for the launcher's watchdog (off in a background thread, whose progress
    is not the training loop's).
    """
    mine = [r for records in layout.values() for r in records if r.process == process]
    if not mine:
        return {}
    digests: dict[tuple[int, Bounds], str] = {}
    path = os.path.join(directory, shard_file(process))
    with open(path, "xb") as f:
        for record in mine:
            array = _shard_bytes(data(record), entries[record.leaf])
            raw = array.reshape(-1).view(np.uint8)
            if len(raw) != record.nbytes or f.tell() != record.offset:
                raise CheckpointError(
                    f"the shard of state{entries[record.leaf]['path']} at {record.index} has {len(raw)} bytes at "
                    f"offset {f.tell()}, its layout says {record.nbytes} at {record.offset}; this is a bug."
                )
            f.write(raw)
            if report:
                progress.touch()
            digests[(record.leaf, record.bounds)] = hashlib.sha256(raw).hexdigest()
        f.flush()
        os.fsync(f.fileno())
    if sidecar:
        listing = [
            {
                "leaf": r.leaf,
                "index": r.index,
                "offset": r.offset,
                "bytes": r.nbytes,
                "sha256": digests[r.leaf, r.bounds],
            }
            for r in mine
        ]
        text = json.dumps({"process": process, "file": shard_file(process), "records": listing})
        files.write_text(os.path.join(directory, _sidecar(process)), text)
    return digests


def _read_sidecar(directory: str, process: int, wait_s: float) -> dict[str, Any]:
    """Process ``process``'s sidecar, waiting up to ``wait_s`` for it to become visible."""
    path = os.path.join(directory, _sidecar(process))
    failure = os.path.join(directory, _failure(process))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                listing = json.load(f)
            break
        except FileNotFoundError:
            if os.path.exists(failure):
                with open(failure, encoding="utf-8", errors="replace") as f:
                    raise CheckpointError(
                        f"process {process} failed to write its part of the checkpoint: {f.read(2048)}"
                    ) from None
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"process 0 cannot see {path}, the list of the shards process {process} wrote, after "
                    f"{wait_s:g} s. Every process writes its shards into the checkpoint directory: keep it on a "
                    f"file system that every process shares (e.g. NFS)."
                ) from None
            time.sleep(0.05)
    if not isinstance(listing, dict) or not isinstance(listing.get("records"), list):
        raise CheckpointError(f"{path} is not a list of shards; the save was disturbed. Save again.")
    return listing


def _take_sidecar(
    directory: str, process: int, expected: list[Record], digests: dict[tuple[int, Bounds], str], wait_s: float
) -> None:
    """Read process ``process``'s sidecar into ``digests``, check it lists ``expected``, and remove it."""
    listing = _read_sidecar(directory, process, wait_s)
    got = [(e.get("leaf"), e.get("index"), e.get("offset"), e.get("bytes")) for e in listing["records"]]
    want = [(r.leaf, r.index, r.offset, r.nbytes) for r in expected]
    if got != want:
        raise CheckpointError(
            f"process {process} wrote other shards than process 0 expects ({len(got)} records, {len(want)} "
            f"expected); the processes saved differently sharded states. Call save with the same state on "
            f"every process."
        )
    for e, r in zip(listing["records"], expected, strict=True):
        if not isinstance(e.get("sha256"), str) or not re.match(r"^[0-9a-f]{64}$", e["sha256"]):
            raise CheckpointError(f"process {process} listed a shard without its sha256; save again.")
        digests[(r.leaf, r.bounds)] = e["sha256"]
    os.remove(os.path.join(directory, _sidecar(process)))


def collect(
    directory: str,
    layout: Mapping[int, list[Record]],
    own: Mapping[tuple[int, Bounds], str],
    wait_s: float = SIDECAR_WAIT_S,
) -> dict[int, list[dict[str, Any]]]:
    """Process 0: the manifest's shard records of every split leaf, with every process's sha256.

    Reads (and removes) the other processes' sidecars and checks that they
    wrote the shards the layout expects, and that each file has its size.
    """
    digests = dict(own)
    processes = sorted({r.process for records in layout.values() for r in records})
    for process in processes:
        expected = [r for records in layout.values() for r in records if r.process == process]
        if process != 0:
            _take_sidecar(directory, process, expected, digests, wait_s)  # after it, the shard file is complete
        size = os.path.getsize(os.path.join(directory, shard_file(process)))
        if size != sum(r.nbytes for r in expected):
            raise CheckpointError(
                f"{shard_file(process)} has {size} bytes, {sum(r.nbytes for r in expected)} expected; process "
                f"{process} did not write all its shards. Save again."
            )
    return {
        i: [
            {
                "file": shard_file(r.process),
                "offset": r.offset,
                "bytes": r.nbytes,
                "index": r.index,
                "sha256": digests[r.leaf, r.bounds],
            }
            for r in records
        ]
        for i, records in layout.items()
    }


class LeafReader:
    """Reads regions of one stored leaf from its shard records, checking each record's sha256 once.

    Args:
      path: the checkpoint directory.
      entry: the leaf's manifest entry (with ``shards``, checked by ``parse_manifest``).
      damaged: makes the message for a damaged record (it adds how to restore another step).
    """

    def __init__(self, path: str, entry: Mapping[str, Any], damaged: Callable[[str], DamagedCheckpoint]):
        self.path, self.entry, self._damaged = path, entry, damaged
        self.shape = tuple(entry["shape"])
        self._stored = np.dtype(encoding.stored_dtype(entry))
        self._records = [
            (tuple((int(a), int(b)) for a, b in r["index"]), r) for r in entry["shards"]
        ]  # (bounds, record)
        self._data: dict[int, np.ndarray] = {}
        self._regions: dict[Bounds, Any] = {}

    def _record(self, k: int) -> np.ndarray:
        if k in self._data:
            return self._data[k]
        bounds, r = self._records[k]
        where = f"{r['file']} (the shard of state{self.entry['path']} at {[list(b) for b in bounds]})"
        try:
            with open(os.path.join(self.path, r["file"]), "rb") as f:
                f.seek(r["offset"])
                raw = f.read(r["bytes"])
        except FileNotFoundError:
            raise self._damaged(f"lacks {r['file']}") from None
        except OSError as e:
            raise self._damaged(f"cannot read {where} ({e})") from None
        if len(raw) != r["bytes"]:
            raise self._damaged(f"{where} is truncated ({len(raw)} of {r['bytes']} bytes)")
        if hashlib.sha256(raw).hexdigest() != r["sha256"]:
            raise self._damaged(f"{where} is corrupt (its sha256 differs from the manifest)")
        data = np.frombuffer(raw, self._stored.newbyteorder("<")).reshape([b - a for a, b in bounds])
        self._data[k] = data
        return data

    def region(self, index: Sequence[slice] | None = None) -> Any:
        """The leaf's values in ``index`` (a tuple of slices; None: the whole leaf), decoded."""
        bounds = _bounds(index or (), self.shape)
        if bounds in self._regions:
            return self._regions[bounds]
        out = np.empty([b - a for a, b in bounds], self._stored)
        for k, (have, _) in enumerate(self._records if out.size else ()):
            lo = [max(a, c) for (a, _), (c, _) in zip(have, bounds, strict=True)]
            hi = [min(b, d) for (_, b), (_, d) in zip(have, bounds, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue  # the records tile the leaf (parse_manifest checks it), so every element is filled
            src = tuple(slice(a - s, b - s) for a, b, (s, _) in zip(lo, hi, have, strict=True))
            dst = tuple(slice(a - s, b - s) for a, b, (s, _) in zip(lo, hi, bounds, strict=True))
            out[dst] = self._record(k)[src]
        result = encoding.decode(out, self.entry)
        self._regions[bounds] = result
        return result

    def place(self, sharding: Any) -> Any:
        """The leaf as numpy (``sharding=None``) or on ``sharding``, each device's part read from its records."""
        if sharding is None:
            return self.region()
        return jax.make_array_from_callback(self.shape, sharding, self.region)
