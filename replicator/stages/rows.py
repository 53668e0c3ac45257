"""The state of a pipelined step as one packed row per stage, and back, without repacking what a step returned.

A pipelined step keeps each stage's leaves in one flat buffer per dtype (its *row*, ``Packing``), the rows
stacked on a ``'stages'``-sharded array. ``run`` takes and returns the state with its global shapes, so every
call would unpack the new rows into leaves and pack them again on the next call: eager slicing of sharded
arrays, many small dispatches (for an 8-layer MLP in 4 stages, about 10x the step itself). Here:

* :class:`RowUnpacker` reads each leaf from the first stage that keeps it with one compiled call per stage,
  on a device of that stage (its shard of the rows), instead of one eager slice per leaf;
* a partitioned leaf (a stack of layers ``(L, ...)``, each stage keeping its slice of the leading axis) is
  packed as ``leaf[start:stop]`` into each stage's row and joined back in order;
* :class:`LastRows` remembers the rows a step returned with the leaves unpacked from them (weakly), so a call
  given exactly those leaves (``state = repl.run(step, batch, state)`` in a loop) reuses the rows as they are.

>>> packing = Packing([[jax.ShapeDtypeStruct((2,), jnp.float32)], [jax.ShapeDtypeStruct((3,), jnp.float32)]])
>>> mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1, 1), ("stages", "workers", "cores"))
>>> rows = jax.device_put({"float32": jnp.array([[1.0, 2, 0], [3, 4, 5]])}, NamedSharding(mesh, P("stages")))
>>> a, b = RowUnpacker(packing, layout=[[0], [1]], owners=[0, 1])(rows)
>>> a.tolist(), b.tolist(), b.devices() == {jax.devices()[1]}
([1.0, 2.0], [3.0, 4.0, 5.0], True)
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np  # noqa: F401 - the docstring's example
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.stages.packing import Packing

__all__ = ["LastRows", "RowPacker", "RowUnpacker"]


class RowPacker:
    """``packer(leaves) -> rows``: each stage's leaves packed into its row on a device of that stage (one
    compiled call per stage), then placed on all of that stage's devices as one ``'stages'``-sharded array
    per dtype. The leaves may live anywhere (host, one device, other stages' devices).

    Args:
      packing, layout, pieces: as for :class:`RowUnpacker`; mesh: the ``('stages', ...)`` mesh the rows live on.
      spec: how the rows ``(S, n)`` lie on the mesh: ``P('stages')`` (default: each device of a stage holds its
        whole row), or ``P('stages', data_axes)`` (ZeRO: each device of a stage holds its ``1/D`` of the row,
        the row's length a multiple of ``D``).
    """

    def __init__(
        self,
        packing: Packing,
        layout: Sequence[Sequence[int]],
        mesh: Mesh,
        spec: P | None = None,
        pieces: Mapping[int, Sequence[tuple[int, int, int]]] | None = None,
    ):
        self.packing, self.layout, self.mesh = packing, [list(x) for x in layout], mesh
        self.pieces = {i: {s: (a, b) for s, a, b in parts} for i, parts in (pieces or {}).items()}
        self.sharding = NamedSharding(mesh, P(mesh.axis_names[0]) if spec is None else spec)
        self.devices = [list(mesh.devices[s].flat) for s in range(len(self.layout))]
        self._pack = [jax.jit(self._one_stage(s)) for s in range(len(self.layout))]

    def _one_stage(self, stage: int) -> Any:
        def pack(values: list) -> dict:
            return {str(k): v[None] for k, v in self.packing.pack(stage, values).items()}

        return pack

    def _leaf(self, leaves: Sequence[Any], i: int, stage: int) -> Any:
        """Leaf ``i`` as ``stage`` keeps it: whole, or its slice of a partitioned leaf."""
        if i not in self.pieces:
            return leaves[i]
        start, stop = self.pieces[i][stage]
        return leaves[i][start:stop]

    def __call__(self, leaves: Sequence[Any]) -> dict:
        if not self.sharding.is_fully_addressable:  # stages across processes: every process packs it all
            rows = [self.packing.pack(s, [self._leaf(leaves, i, s) for i in lay]) for s, lay in enumerate(self.layout)]
            return jax.device_put({k: jnp.stack([row[k] for row in rows]) for k in rows[0]}, self.sharding)
        shapes = {k: (len(self.layout), n) for k, (_, n) in self.packing.buffers().items()}
        where = {key: self.sharding.devices_indices_map(shape) for key, shape in shapes.items()}
        pieces: dict[str, list[jax.Array]] = {}
        for stage, (lay, devices) in enumerate(zip(self.layout, self.devices, strict=True)):
            row = self._pack[stage]([jax.device_put(self._leaf(leaves, i, stage), devices[0]) for i in lay])
            for key, value in row.items():  # each device its part of the row: all of it, or its chunk
                pieces.setdefault(key, []).extend(jax.device_put(value[:, where[key][d][1]], d) for d in devices)
        return {
            key: jax.make_array_from_single_device_arrays(shapes[key], self.sharding, parts)
            for key, parts in pieces.items()
        }


class RowUnpacker:
    """``unpacker(rows) -> leaves``: every leaf from its owner stage's row, one compiled call per stage. A row
    split over the stage's devices (ZeRO) is first brought together on one of them.

    Args:
      packing: the rows' layout; layout: per stage, the leaves (indices) its row holds, in packing order;
      owners: per leaf, the stage it is read from (a tied leaf is equal on every stage that keeps it).
      pieces: the partitioned leaves: leaf -> ``(stage, start, stop)`` per slice of its leading axis, each stage
        keeping its slice ``leaf[start:stop]`` alone; the leaf is the slices joined in order.
    """

    def __init__(
        self,
        packing: Packing,
        layout: Sequence[Sequence[int]],
        owners: Sequence[int],
        pieces: Mapping[int, Sequence[tuple[int, int, int]]] | None = None,
    ):
        self.packing, self.layout, self.owners = packing, [list(x) for x in layout], list(owners)
        self.pieces = {i: sorted(parts, key=lambda p: p[1]) for i, parts in (pieces or {}).items()}
        stages = {o for i, o in enumerate(self.owners) if i not in self.pieces}
        stages |= {s for parts in self.pieces.values() for s, _, _ in parts}
        self._unpack = {s: jax.jit(self._one_stage(s)) for s in sorted(stages)}

    def _one_stage(self, stage: int) -> Any:
        def unpack(rows: dict) -> list:
            return self.packing.unpack(stage, {k: jnp.concatenate(v, axis=1)[0] for k, v in rows.items()})

        return unpack

    def __call__(self, rows: dict) -> list:
        if not all(v.is_fully_addressable for v in rows.values()):
            # Stages across processes: another process's stage is not readable here (slicing its part of the
            # global array gave wrong values, silently). Every process reads the whole rows (a collective:
            # every process unpacks, in the same order) and returns every leaf whole, on its own devices.
            rows = {k: jnp.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in rows.items()}
        leaves: list[Any] = [None] * len(self.owners)
        slices: dict[int, dict[int, Any]] = {}
        for stage, unpack in self._unpack.items():
            values = unpack({k: _stage_shard(v, stage) for k, v in rows.items()})
            for i, value in zip(self.layout[stage], values, strict=True):
                if i in self.pieces:
                    slices.setdefault(i, {})[stage] = value
                elif self.owners[i] == stage:
                    leaves[i] = value
        for i, parts in self.pieces.items():  # a partitioned leaf: its slices joined, on its first slice's device
            ordered = [slices[i][s] for s, _, _ in parts]
            device = next(iter(ordered[0].devices()))
            leaves[i] = jnp.concatenate([jax.device_put(x, device) for x in ordered])
        return leaves


def _stage_shard(rows: jax.Array, stage: int) -> list[jax.Array]:
    """Stage ``stage``'s row ``(1, n)`` as the pieces that make it, in order, on one of its devices (this
    process's): the row itself, or its chunks where the row is split over the stage's devices; the row sliced
    from the whole array where that is not laid out by stage (the rows gathered from every process).
    ``rows`` is fully addressable (:class:`RowUnpacker` gathers them first), so a stage's chunks are all here."""
    chunks: dict[int, jax.Array] = {}
    for shard in rows.addressable_shards:
        if shard.index[0].start == stage:
            chunks.setdefault(shard.index[1].start or 0, shard.data)
    parts = [chunks[k] for k in sorted(chunks)]
    if not parts:
        return [rows[stage : stage + 1]]
    return [jax.device_put(p, parts[0].devices().pop()) for p in parts]


class LastRows:
    """The rows one step returned, with (weak references to) the leaves unpacked from them."""

    def __init__(self) -> None:
        self._leaves: list[weakref.ref] = []
        self._rows: Any = None

    def remember(self, leaves: Sequence[Any], rows: Any) -> None:
        try:
            self._leaves = [weakref.ref(x) for x in leaves]
        except TypeError:  # a leaf that cannot be referenced weakly: never reuse
            self._leaves, rows = [], None
        self._rows = rows

    @property
    def rows(self) -> Any:
        """The rows the last step returned (``None`` before the first)."""
        return self._rows

    def rows_for(self, leaves: Sequence[Any]) -> Any:
        """The remembered rows if ``leaves`` are exactly the leaves unpacked from them, else ``None``."""
        if self._rows is None or len(leaves) != len(self._leaves):
            return None
        if all(ref() is leaf for ref, leaf in zip(self._leaves, leaves, strict=True)):
            return self._rows
        return None
