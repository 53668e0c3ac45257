"""Lists of arrays of different avals, one list per stage, as values every stage's devices hold alike.

A pipeline runs one SPMD program: every device holds arrays of the same types, whatever its stage, and a
``lax.switch`` over the stages passes them in and out of each stage's branch. Two ways to make one stage's
list fit:

* :class:`Packing`: one flat buffer per dtype, padded to the largest stage's (a stage's *row*). Any lists
  fit, but a branch that reads a leaf slices it out of the row (a copy of it), and one that writes a leaf
  concatenates it into the row (another).
* :class:`Slots`: leaves that line up across the stages (the ``k``-th leaf of one aval in every stage's list)
  share a slot, an array of that aval. A slot crosses the switch as it is: a stack of identical layers cut
  into balanced stages is all slots, read and accumulated with no copy per tick.

>>> f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
>>> slots = Slots([[f32(4, 4), f32(3)], [f32(2), f32(4, 4)]])
>>> [a.shape for a in slots.avals], slots.of
([(4, 4)], [{0: 0}, {1: 0}])
>>> Packing([[f32(4, 4), f32(3)], [f32(2), f32(4, 4)]]).offsets(1)
[0, 2]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["Packing", "RowReader", "Slots"]


def _size(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


class Packing:
    """Lists of arrays of different avals, one per stage, as one flat buffer per dtype (padded to the largest,
    and up to a multiple of ``multiple``: a row split in that many equal chunks, as ZeRO splits it)."""

    def __init__(self, layouts: Sequence[Sequence[Any]], multiple: int = 1):
        self.layouts = [list(layout) for layout in layouts]
        sizes: dict[Any, int] = {}
        for layout in self.layouts:
            per: dict[Any, int] = {}
            for aval in layout:
                per[aval.dtype] = per.get(aval.dtype, 0) + _size(aval)
            for dtype, n in per.items():
                sizes[dtype] = max(sizes.get(dtype, 0), n)
        sizes = {dtype: -(-n // multiple) * multiple for dtype, n in sizes.items()}
        self.sizes = dict(sorted(sizes.items(), key=lambda kv: str(kv[0])))

    def zeros(self, lead: tuple[int, ...] = ()) -> dict:
        return {str(d): jnp.zeros((*lead, n), d) for d, n in self.sizes.items()}

    def offsets(self, stage: int) -> list[int]:
        """Where each of ``stage``'s leaves starts in the buffer of its dtype."""
        ends = dict.fromkeys(self.sizes, 0)
        out = []
        for aval in self.layouts[stage]:
            out.append(ends[aval.dtype])
            ends[aval.dtype] += _size(aval)
        return out

    def pack(self, stage: int, values: Sequence[Any]) -> dict:
        parts: dict[Any, list] = {d: [] for d in self.sizes}
        for aval, value in zip(self.layouts[stage], values, strict=True):
            parts[aval.dtype].append(jnp.ravel(value).astype(aval.dtype))
        out = {}
        for dtype, n in self.sizes.items():
            flat = jnp.concatenate(parts[dtype]) if parts[dtype] else jnp.zeros((0,), dtype)
            out[str(dtype)] = jnp.pad(flat, (0, n - flat.shape[0]))
        return out

    def unpack(self, stage: int, buffers: dict) -> list:
        return [
            buffers[str(aval.dtype)][start : start + _size(aval)].reshape(aval.shape)
            for aval, start in zip(self.layouts[stage], self.offsets(stage), strict=True)
        ]


class Slots:
    """The leaves of every stage's list that line up: the ``k``-th leaf of an aval (shape and dtype) in each
    stage's list is in slot ``(aval, k)``, where every stage has a ``k``-th leaf of that aval. The others (an
    embedding only the first stage keeps) have no slot.

    Attributes:
      avals: each slot's aval.
      of: per stage, ``{position in its list: slot}``.
    """

    def __init__(self, layouts: Sequence[Sequence[Any]]):
        keyed = [[(tuple(a.shape), jnp.dtype(a.dtype)) for a in layout] for layout in layouts]
        common: dict[Any, int] = {}
        for key in dict.fromkeys(keyed[0] if keyed else []):
            common[key] = min(keys.count(key) for keys in keyed)
        self.avals: list[Any] = []
        first = {}  # the first slot of each aval
        for key, n in common.items():
            first[key] = len(self.avals)
            self.avals += [jax.ShapeDtypeStruct(*key)] * n
        self.of: list[dict[int, int]] = []
        for keys in keyed:
            seen: dict[Any, int] = {}
            mine = {}
            for position, key in enumerate(keys):
                k = seen[key] = seen.get(key, -1) + 1
                if k < common.get(key, 0):
                    mine[position] = first[key] + k
            self.of.append(mine)

    def zeros(self) -> list:
        return [jnp.zeros(a.shape, a.dtype) for a in self.avals]

    def take(self, stage: int, values: Sequence[Any]) -> list:
        """``stage``'s values (its whole list) in slot order."""
        where = {slot: position for position, slot in self.of[stage].items()}
        return [values[where[j]] for j in range(len(self.avals))]

    def read(self, packing: Packing, buffers: dict, stage: jax.Array) -> list:
        """Every slot read out of a row of ``packing`` (whose layouts these slots were made from), for the
        stage ``stage`` (traced: each device its own): one dynamic slice per slot, no switch."""
        table = np.zeros((len(packing.layouts), len(self.avals)), np.int32)
        for s, mine in enumerate(self.of):
            starts = packing.offsets(s)
            for position, slot in mine.items():
                table[s, slot] = starts[position]
        out = []
        for j, aval in enumerate(self.avals):
            flat = buffers[str(jnp.dtype(aval.dtype))]
            out.append(lax.dynamic_slice_in_dim(flat, jnp.asarray(table)[stage, j], _size(aval)).reshape(aval.shape))
        return out


class RowReader:
    """Every leaf as one stage's programs read it from its row, its slots read once per step.

    ``prepare(rows, stage)`` runs before the tick loop, outside the stages' switch: it reads each slot out of
    the device's row with one dynamic slice. ``leaves(stage, view)`` runs inside stage ``stage``'s branches: the
    slots as they are, the rest sliced out of the row, zeros for the leaves the stage does not keep (it does
    not read them).

    Args:
      packing: the rows' layout (per stage, the avals of the leaves it keeps, in order);
      layout: per stage, the indices of those leaves; avals: every leaf's aval.
    """

    def __init__(self, packing: Packing, layout: Sequence[Sequence[int]], avals: Sequence[Any]):
        self.packing, self.layout, self.avals = packing, [list(x) for x in layout], list(avals)
        self.slots = Slots(packing.layouts)

    def prepare(self, rows: dict, stage: jax.Array) -> tuple[dict, list]:
        """``rows``: the device's row, ``(1, n)`` per dtype; ``stage``: its stage, traced."""
        flat = {k: v[0] for k, v in rows.items()}
        return flat, self.slots.read(self.packing, flat, stage)

    def leaves(self, stage: int, view: tuple[dict, list]) -> list:
        flat, slots = view
        mine = self.packing.unpack(stage, flat)  # the slices of slotted leaves are dead code, dropped
        for position, slot in self.slots.of[stage].items():
            mine[position] = slots[slot]
        return self._every_leaf(stage, mine)

    def from_row(self, stage: int, rows: dict) -> list:
        """Every leaf read straight out of ``stage``'s row (``(1, n)`` per dtype), without slots: for code
        that reads them once per step (an update), not on every tick."""
        return self._every_leaf(stage, self.packing.unpack(stage, {k: v[0] for k, v in rows.items()}))

    def _every_leaf(self, stage: int, mine: list) -> list:
        """``stage``'s leaves at their indices, zeros for the leaves it does not keep."""
        leaves = [jnp.zeros(a.shape, a.dtype) for a in self.avals]
        for i, value in zip(self.layout[stage], mine, strict=True):
            leaves[i] = value
        return leaves
