"""A pipeline's packed rows when each stage's devices are also cut over a tensor axis.

With ``Parallelism(stages=S, tensor=T)`` the mesh is ``('stages', 'workers', 'cores', 'tensor')`` and each
device runs the step split for one device of its tensor group (:mod:`replicator.tensor.split_graph`): a
planned leaf enters as its ``1/T`` block. A stage's row is then packed from the device's blocks, so the
rows of the ``T`` devices of a group differ: the global buffer is ``(S, T * n)``, the ``T`` rows side by
side, laid out ``P('stages', 'tensor')`` (or ``P('stages', ('tensor', 'workers', 'cores'))`` for ZeRO's
chunks: each tensor block's chunks over the data axes). Each device still holds a ``(1, n)`` row (or its
chunk), so the step's code does not change.

Packing and unpacking reuse :class:`~replicator.stages.rows.RowPacker` and
:class:`~replicator.stages.rows.RowUnpacker` on the ``T`` sub-meshes ``('stages', 'workers', 'cores')`` of
one tensor index each: block ``t`` of every leaf is packed on the devices of tensor index ``t``, and those
device arrays are the global rows' shards as they are.

>>> from replicator.tensor.placement import Shard
>>> mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 1, 1, 2), ("stages", "workers", "cores", "tensor"))
>>> packing = Packing([[jax.ShapeDtypeStruct((2, 1), jnp.float32)], [jax.ShapeDtypeStruct((1,), jnp.float32)]])
>>> rows = TensorRows([(packing, [[0], [1]], P("stages"))], mesh, [Shard(0), None], owners=[0, 1])
>>> packed = rows.pack([np.array([[1.0], [2], [3], [4]], np.float32), np.array([5.0], np.float32)])
>>> packed["float32"].shape, tuple(packed["float32"].sharding.spec)
((2, 4), ('stages', 'tensor'))
>>> [np.asarray(x).ravel().tolist() for x in rows.unpack(packed)]
[[1.0, 2.0, 3.0, 4.0], [5.0]]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np  # noqa: F401 - the docstring's example
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.stages.packing import Packing
from replicator.stages.rows import RowPacker, RowUnpacker

__all__ = ["TensorRows", "with_tensor"]

TENSOR_AXIS = "tensor"


def with_tensor(spec: P, axis: str = TENSOR_AXIS) -> P:
    """A row buffer's spec with the tensor axis outermost on its second dimension: ``P('stages')`` becomes
    ``P('stages', 'tensor')``, ``P('stages', data_axes)`` becomes ``P('stages', ('tensor', *data_axes))``."""
    parts = tuple(spec)
    if len(parts) < 2 or parts[1] is None:
        return P(parts[0], axis)
    inner = parts[1] if isinstance(parts[1], tuple) else (parts[1],)
    return P(parts[0], (axis, *inner))


def _dim(placement: Any) -> int | None:
    """The dimension a state leaf is split on over the tensor axis (a placement with ``dim``), or None."""
    return getattr(placement, "dim", None)


class TensorRows:
    """``pack(leaves) -> rows`` and ``unpack(rows) -> leaves`` for a pipeline with a tensor axis.

    Args:
      stores: ``(packing, layout, spec)`` per kind of buffer, ``spec`` over ``('stages', data axes)`` as
        without a tensor axis (each packing built from the leaves' local avals).
      mesh: the ``('stages', 'workers', 'cores', 'tensor')`` mesh.
      placements: per state leaf, its placement over the tensor axis (``.dim``: split there), or None.
      owners: per leaf, the stage it is read back from.
      pieces: per store's layout, the sliced leaves (``{leaf: [(stage, start, stop), ...]}``).
    """

    def __init__(
        self,
        stores: Sequence[tuple[Packing, Sequence[Sequence[int]], P]],
        mesh: Mesh,
        placements: Sequence[Any],
        owners: Sequence[int],
        pieces: Callable[[Sequence[Sequence[int]]], Mapping[int, Any]] = lambda layout: {},
    ) -> None:
        names = mesh.axis_names
        if names[-1] != TENSOR_AXIS:
            raise ValueError(f"TensorRows needs a mesh whose last axis is {TENSOR_AXIS!r}, got {names}.")
        self.mesh, self.size = mesh, mesh.shape[TENSOR_AXIS]
        self.dims = [_dim(p) for p in placements]
        self.subs = [Mesh(mesh.devices[..., t], names[:-1]) for t in range(self.size)]
        self._sub_devices = [set(sub.devices.flat) for sub in self.subs]
        self.stores = []
        for packing, layout, spec in stores:
            packers = [RowPacker(packing, layout, sub, spec, pieces=pieces(layout)) for sub in self.subs]
            unpacker = RowUnpacker(packing, layout, owners, pieces(layout))
            self.stores.append((packing, spec, packers, unpacker))
        #: How each buffer ``(S, T * n)`` lies on the mesh.
        self.specs = {k: with_tensor(spec) for packing, spec, _, _ in self.stores for k in packing.buffers()}

    def block(self, leaf: Any, i: int, t: int) -> Any:
        """Leaf ``i``'s block on tensor index ``t``: its ``1/T`` on its split dimension, or the leaf."""
        dim = self.dims[i]
        if dim is None:
            return leaf
        n = np.shape(leaf)[dim] // self.size
        return jax.lax.slice_in_dim(jnp.asarray(leaf), t * n, (t + 1) * n, axis=dim)

    def pack(self, leaves: Sequence[Any]) -> dict:
        """The global rows of ``leaves`` (global shapes), each device's block packed on that device."""
        blocks = [[self.block(x, i, t) for i, x in enumerate(leaves)] for t in range(self.size)]
        out = {}
        for packing, _, packers, _ in self.stores:
            per_t = [packer(blocks[t]) for t, packer in enumerate(packers)]
            for key in packing.buffers():
                stages, n = per_t[0][key].shape
                shards = [s.data for rows in per_t for s in rows[key].addressable_shards]
                sharding = NamedSharding(self.mesh, self.specs[key])
                out[key] = jax.make_array_from_single_device_arrays((stages, self.size * n), sharding, shards)
        return out

    def _sub_rows(self, rows: jax.Array, t: int, spec: P) -> jax.Array:
        """Tensor index ``t``'s rows ``(S, n)``: the shards of its devices, on its sub-mesh."""
        shards = [s.data for s in rows.addressable_shards if s.device in self._sub_devices[t]]
        shape = (rows.shape[0], rows.shape[1] // self.size)
        return jax.make_array_from_single_device_arrays(shape, NamedSharding(self.subs[t], spec), shards)

    def unpack(self, rows: Mapping[str, jax.Array]) -> list:
        """Every leaf whole (global shape), its tensor blocks joined on the device of the first."""
        n = len(self.dims)
        per_t: list[list[Any]] = [[None] * n for _ in range(self.size)]
        for packing, spec, _, unpacker in self.stores:
            keys = list(packing.buffers())
            for t in range(self.size):
                values = unpacker({k: self._sub_rows(rows[k], t, spec) for k in keys})
                for i, value in enumerate(values):
                    if value is not None:
                        per_t[t][i] = value
        leaves: list[Any] = []
        for i in range(n):
            if self.dims[i] is None or per_t[0][i] is None:
                leaves.append(per_t[0][i])
                continue
            device = next(iter(per_t[0][i].devices()))
            parts = [jax.device_put(per_t[t][i], device) for t in range(self.size)]
            leaves.append(jnp.concatenate(parts, axis=self.dims[i]))
        return leaves

    def zeros(self) -> dict:
        """The buffers, zeros, global shapes ``(S, T * n)``."""
        return {
            k: jnp.zeros((len(packers[0].layout), self.size * n), d)
            for packing, _, packers, _ in self.stores
            for k, (d, n) in packing.buffers().items()
        }
