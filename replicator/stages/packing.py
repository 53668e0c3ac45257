"""Lists of arrays of different avals, one list per stage, as values every stage's devices hold alike.

A pipeline runs one SPMD program: every device holds arrays of the same types, whatever its stage, and a
``lax.switch`` over the stages passes them in and out of each stage's branch. Two ways to make one stage's
list fit, both in :class:`Packing`:

* a *row*: one flat buffer per dtype, padded to the largest stage's. Any lists fit, but a branch that reads
  a leaf slices it out of the row (a copy of it), and one that writes a leaf concatenates it into the row
  (another).
* :class:`Slots` (``Packing(..., slots=True)``): leaves that line up across the stages (the ``k``-th leaf of
  one aval in every stage's list) share a slot, a buffer of its own (``"slot<j>"``, flat, the leaf's size).
  Reading a slotted leaf is a reshape of its buffer, writing it a reshape back: no copy. A stack of identical
  layers cut into balanced stages is all slots.

>>> f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
>>> slots = Slots([[f32(4, 4), f32(3)], [f32(2), f32(4, 4)]])
>>> [a.shape for a in slots.avals], slots.of
([(4, 4)], [{0: 0}, {1: 0}])
>>> Packing([[f32(4, 4), f32(3)], [f32(2), f32(4, 4)]]).offsets(1)
[0, 2]
>>> {k: n for k, (_, n) in Packing([[f32(4, 4), f32(3)], [f32(2), f32(4, 4)]], slots=True).buffers().items()}
{'float32': 3, 'slot0': 16}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Packing", "RowReader", "Slots"]


def _size(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


class Packing:
    """Lists of arrays of different avals, one per stage, as one flat buffer per dtype (padded to the largest,
    and up to a multiple of ``multiple``: a row split in that many equal chunks, as ZeRO splits it); with
    ``slots``, the leaves that line up across the stages (:class:`Slots`) each in a buffer of its own instead
    (``"slot<j>"``, its length padded up to a multiple of ``multiple`` too).

    Attributes:
      sizes: the row's length per dtype (the leaves in no slot); slots: the slots (none without ``slots``).
    """

    def __init__(self, layouts: Sequence[Sequence[Any]], multiple: int = 1, slots: bool = False):
        self.layouts = [list(layout) for layout in layouts]
        self.multiple = multiple
        self.slots = Slots(self.layouts if slots else [[] for _ in self.layouts])
        sizes: dict[Any, int] = {}
        for stage, layout in enumerate(self.layouts):
            per: dict[Any, int] = {}
            for position, aval in enumerate(layout):
                if position not in self.slots.of[stage]:
                    per[aval.dtype] = per.get(aval.dtype, 0) + _size(aval)
            for dtype, n in per.items():
                sizes[dtype] = max(sizes.get(dtype, 0), n)
        self.sizes = dict(sorted(((d, self._padded(n)) for d, n in sizes.items()), key=lambda kv: str(kv[0])))

    def _padded(self, n: int) -> int:
        return -(-n // self.multiple) * self.multiple

    def buffers(self) -> dict[str, tuple[Any, int]]:
        """Every buffer a stage's list packs into: its name, dtype and length."""
        out = {str(d): (jnp.dtype(d), n) for d, n in self.sizes.items()}
        for j, aval in enumerate(self.slots.avals):
            out[f"slot{j}"] = (jnp.dtype(aval.dtype), self._padded(_size(aval)))
        return out

    @property
    def nbytes(self) -> int:
        """The bytes of one stage's buffers."""
        return sum(n * d.itemsize for d, n in self.buffers().values())

    def zeros(self, lead: tuple[int, ...] = ()) -> dict:
        return {k: jnp.zeros((*lead, n), d) for k, (d, n) in self.buffers().items()}

    def offsets(self, stage: int) -> list[int | None]:
        """Where each of ``stage``'s leaves starts in the row of its dtype (``None``: a slotted leaf)."""
        ends = dict.fromkeys(self.sizes, 0)
        out: list[int | None] = []
        for position, aval in enumerate(self.layouts[stage]):
            if position in self.slots.of[stage]:
                out.append(None)
                continue
            out.append(ends[aval.dtype])
            ends[aval.dtype] += _size(aval)
        return out

    def pack(self, stage: int, values: Sequence[Any]) -> dict:
        parts: dict[Any, list] = {d: [] for d in self.sizes}
        out = {}
        for position, (aval, value) in enumerate(zip(self.layouts[stage], values, strict=True)):
            flat = jnp.ravel(value).astype(aval.dtype)
            if position in self.slots.of[stage]:
                out[f"slot{self.slots.of[stage][position]}"] = jnp.pad(
                    flat, (0, self._padded(flat.shape[0]) - flat.shape[0])
                )
            else:
                parts[aval.dtype].append(flat)
        for dtype, n in self.sizes.items():
            flat = jnp.concatenate(parts[dtype]) if parts[dtype] else jnp.zeros((0,), dtype)
            out[str(dtype)] = jnp.pad(flat, (0, n - flat.shape[0]))
        return dict(sorted(out.items()))

    def unpack(self, stage: int, buffers: dict) -> list:
        out = []
        for position, (aval, start) in enumerate(zip(self.layouts[stage], self.offsets(stage), strict=True)):
            if start is None:
                flat, start = buffers[f"slot{self.slots.of[stage][position]}"], 0
            else:
                flat = buffers[str(aval.dtype)]
            out.append(flat[start : start + _size(aval)].reshape(aval.shape))
        return out


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


class RowReader:
    """Every leaf as one stage's programs read it from its row, its slots read once per step.

    ``prepare(rows, stage)`` runs before the tick loop, outside the stages' switch: it reads each slot out of
    its buffer (a reshape; a slice where ZeRO padded the buffer). ``leaves(stage, view)`` runs inside stage
    ``stage``'s branches: the slots as they are, the rest sliced out of the row, zeros for the leaves the stage
    does not keep (it does not read them).

    Args:
      packing: the rows' layout (per stage, the avals of the leaves it keeps, in order; made with ``slots=True``
        for the leaves that line up to cross the switch with no copy);
      layout: per stage, the indices of those leaves; avals: every leaf's aval.
    """

    def __init__(self, packing: Packing, layout: Sequence[Sequence[int]], avals: Sequence[Any]):
        self.packing, self.layout, self.avals = packing, [list(x) for x in layout], list(avals)
        self.slots = packing.slots

    def prepare(self, rows: dict, stage: jax.Array | None = None) -> tuple[dict, list]:
        """``rows``: the device's buffers, ``(1, n)`` each; ``stage`` (traced) is not needed: a slot is the same
        buffer on every stage."""
        flat = {k: v[0] for k, v in rows.items()}
        slots = [flat[f"slot{j}"][: _size(a)].reshape(a.shape) for j, a in enumerate(self.slots.avals)]
        return flat, slots

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
