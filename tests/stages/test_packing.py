"""Packing a stage's list of arrays: flat rows, and slots for the leaves that line up across the stages.

Checked against the lists themselves (NumPy), not against another packing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from replicator.stages.packing import Packing, RowReader, Slots


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


# Three stages: an embedding (int table) in the first, a head in the last, two (4, 4) layers and a bias each.
LAYOUTS = [
    [i32(7, 2), f32(4, 4), f32(4), f32(4, 4)],
    [f32(4, 4), f32(4, 4), f32(4)],
    [f32(4), f32(4, 4), f32(4, 3), f32(4, 4)],
]


def values(layouts, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.integers(-9, 9, a.shape).astype(a.dtype) for a in layout] for layout in layouts]


def test_slots_hold_the_kth_leaf_of_each_aval_every_stage_has():
    slots = Slots(LAYOUTS)
    assert [(a.shape, a.dtype) for a in slots.avals] == [((4, 4), jnp.float32)] * 2 + [((4,), jnp.float32)]
    # The k-th (4, 4) of each stage in slot k; the bias in slot 2; the embedding and the head in none.
    assert slots.of == [{1: 0, 3: 1, 2: 2}, {0: 0, 1: 1, 2: 2}, {1: 0, 3: 1, 0: 2}]


def test_an_aval_one_stage_lacks_has_no_slot():
    slots = Slots([[f32(2), f32(3)], [f32(3)]])
    assert [a.shape for a in slots.avals] == [(3,)]
    assert slots.of == [{1: 0}, {0: 0}]
    assert Slots([[f32(2)], [f32(3)]]).avals == []


def test_offsets_are_where_pack_puts_each_leaf():
    packing = Packing(LAYOUTS)
    for stage, vals in enumerate(values(LAYOUTS)):
        row = packing.pack(stage, vals)
        for aval, value, start in zip(LAYOUTS[stage], vals, packing.offsets(stage), strict=True):
            got = np.asarray(row[str(jnp.dtype(aval.dtype))][start : start + value.size])
            np.testing.assert_array_equal(got, value.ravel())


def test_a_slotted_packing_keeps_each_slot_in_a_buffer_of_its_own():
    packing = Packing(LAYOUTS, slots=True)
    sizes = {k: n for k, (_, n) in packing.buffers().items()}
    # The rows keep what has no slot: the embedding (14 ints), the head (12 floats, stage 2's largest rest).
    assert sizes == {"float32": 12, "int32": 14, "slot0": 16, "slot1": 16, "slot2": 4}
    assert packing.nbytes == 4 * (12 + 14 + 16 + 16 + 4)
    assert packing.offsets(2) == [None, None, 0, None]
    for stage, vals in enumerate(values(LAYOUTS)):
        buffers = packing.pack(stage, vals)
        for position, slot in packing.slots.of[stage].items():  # the leaf itself, flat
            np.testing.assert_array_equal(buffers[f"slot{slot}"], vals[position].ravel())
        for got, want in zip(packing.unpack(stage, buffers), vals, strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_slotted_packing_pads_each_buffer_to_the_multiple():
    packing = Packing(LAYOUTS, multiple=3, slots=True)
    assert {k: n for k, (_, n) in packing.buffers().items()} == {
        "float32": 12,
        "int32": 15,
        "slot0": 18,
        "slot1": 18,
        "slot2": 6,
    }
    vals = values(LAYOUTS, seed=2)
    buffers = packing.pack(1, vals[1])
    assert not np.asarray(buffers["slot2"])[4:].any()  # the padding is zeros
    for got, want in zip(packing.unpack(1, buffers), vals[1], strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_row_reader_gives_every_leaf_on_each_stages_devices():
    """Under shard_map over the stages, each device reads its own stage's leaves (its slots read once before a
    switch, the rest in the branch), and zeros for the leaves its stage does not keep."""
    layout = [[0, 1, 2, 3], [1, 4, 5], [6, 1, 7, 8]]  # leaf indices; leaf 1 is kept by every stage (tied)
    n = 9
    avals: list = [None] * n
    for stage, lay in enumerate(layout):
        for i, aval in zip(lay, LAYOUTS[stage], strict=True):
            avals[i] = aval
    avals[1] = f32(4, 4)
    packing = Packing([[avals[i] for i in lay] for lay in layout], slots=True)
    reader = RowReader(packing, layout, avals)
    vals = values([[avals[i] for i in lay] for lay in layout], seed=1)
    rows = [packing.pack(s, vals[s]) for s in range(3)]
    stacked = {k: jnp.stack([r[k] for r in rows]) for k in rows[0]}
    mesh = Mesh(np.array(jax.devices()[:3]), ("stages",))

    def per_device(rows):
        s = lax.axis_index("stages")
        view = reader.prepare(rows, s)
        leaves = lax.switch(s, [lambda v, stage=stage: reader.leaves(stage, v) for stage in range(3)], view)
        return [x[None] for x in leaves]

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=P("stages"), out_specs=P("stages"), check_vma=False)
    got = jax.jit(mapped)(stacked)
    for stage, lay in enumerate(layout):
        for i in range(n):
            want = vals[stage][lay.index(i)] if i in lay else np.zeros(avals[i].shape, avals[i].dtype)
            np.testing.assert_array_equal(got[i][stage], want)
