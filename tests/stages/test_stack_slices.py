"""A scanned stack of layers cut by ``split_scan`` is *partitioned*: each stage keeps only its ``L/S`` slice of
the stacked parameters (and of the optimizer's moments), and the slice's gradient is its own, never summed
across stages. On the graph: ``split_stages`` records the partition of a ``lax.scan`` and an ``nn.scan`` stack,
and not of a user's overlapping or non-leading-axis slices (those stay tied). Against one device (``jax.jit``
of the unsplit loss and ``optax.adam`` on the global batch, 3 steps): ``pipeline_train_step`` and
``Replicator.run_pipelined`` (with ZeRO too). And per device: each stage's packed row holds its slice only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.stages import split_scan, split_stages
from replicator.stages.packing import Packing
from replicator.stages.rows import RowPacker, RowUnpacker
from replicator.stages.train import pipeline_train_step
from tests.stages.test_scan_split import DIM, LAYERS, MODELS, batch, plain_loss, plain_params
from tests.stages.test_train import STEPS, _assert_close, _assert_like_one_device, _reference, _train

FLOAT = 4  # bytes


def _paths(tree) -> list[str]:
    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _split(loss, p, x, y, stages):
    jaxpr = jax.make_jaxpr(jax.value_and_grad(split_scan(loss, stages)))(p, x, y)
    return split_stages(jaxpr, first_batch=len(jax.tree.leaves(p)))


def _pieces(stages: int) -> tuple[tuple[int, int, int], ...]:
    chunk = LAYERS // stages
    return tuple((s, s * chunk, (s + 1) * chunk) for s in range(stages))


def _sliced_parameters(built, p) -> list[int]:
    """The parameter leaves each stage keeps only its slice of (their moments follow them)."""
    return sorted(i for i in built.slices.leaves if i < len(jax.tree.leaves(p)))


def stack_loss(p, x, y):
    """Only the stack (balanced stages): every parameter is a slice of it."""
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["stack"])
    return jnp.mean((h - y) ** 2)


# ----------------------------------------------------------------------------
# The split: which leaves are partitioned
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_the_split_records_the_partition_of_a_scanned_stack(model, stages):
    loss, make = MODELS[model]
    p, (x, y) = make(), batch()
    split = _split(loss, p, x, y, stages)
    paths = _paths(p)
    stacked = {paths[i] for i, leaf in enumerate(jax.tree.leaves(p)) if np.shape(leaf)[:1] == (LAYERS,)}
    assert len(stacked) == (1 if model == "lax.scan" else 2)  # the kernels (and the biases) of the layers
    partitioned = split.partitioned(len(paths))
    assert {paths[i] for i in partitioned} == stacked
    assert all(part.pieces == _pieces(stages) for part in partitioned.values())
    assert all(split.output_partitions[1 + i].pieces == _pieces(stages) for i in partitioned)


def _tied_slices(p, x, y):
    """The user's own overlapping slices of a leaf on two stages: layers 0-4, then 3-7."""
    h = x
    for w in p["stack"][:5]:
        h = jnp.tanh(h @ w)
    h = rp.stage_boundary(h)
    for w in p["stack"][3:]:
        h = jnp.tanh(h @ w)
    return jnp.mean((h @ p["head"] - y) ** 2)


def _column_slices(p, x, y):
    """Consecutive ranges of the leading axis, one per stage, but each also a slice of the second axis."""
    w, half = p["stack"], DIM // 2
    h = jnp.tanh(x[:, :half] @ jnp.sum(w[:4, :half], 0))
    h = rp.stage_boundary(h)
    h = jnp.tanh(h[:, half:] @ jnp.sum(w[4:, half:], 0))
    return jnp.mean((h @ p["head"] - y) ** 2)


def _disjoint_slices(p, x, y):
    """The user's own consecutive slices of the leading axis, one per stage: a partition like split_scan's."""
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["stack"][:3])
    h = rp.stage_boundary(h)
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["stack"][3:])
    return jnp.mean((h @ p["head"] - y) ** 2)


@pytest.mark.parametrize("loss", [_tied_slices, _column_slices], ids=["overlapping", "second-axis"])
def test_overlapping_or_non_leading_axis_slices_stay_tied(loss):
    p, (x, y) = plain_params(), batch()
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(p, x, y)
    split = split_stages(jaxpr, first_batch=2)
    assert split.num_stages == 2
    assert split.partitioned(2) == {} and 1 not in split.input_partitions  # leaves: head, stack
    assert 2 in split.tied(3)  # outputs: the loss, head's gradient, stack's: a sum across the stages
    opt = optax.adam(1e-2)
    train = pipeline_train_step(loss, opt, num_microbatches=2, devices=jax.devices()[:2])
    got_p, state, _ = _train(train, opt, p, x, y)
    assert train.held(p)["stack"] == (0, 1)
    assert train.built(p, x, y).slices.leaves == {}  # each stage keeps the whole leaf
    _assert_like_one_device(got_p, state, loss, opt, p, x, y)


def test_a_users_own_consecutive_slices_are_a_partition():
    p, (x, y) = plain_params(), batch()
    split = split_stages(jax.make_jaxpr(jax.value_and_grad(_disjoint_slices))(p, x, y), first_batch=2)
    assert {i: part.pieces for i, part in split.partitioned(2).items()} == {1: ((0, 0, 3), (1, 3, LAYERS))}
    opt = optax.adam(1e-2)
    train = pipeline_train_step(_disjoint_slices, opt, num_microbatches=2, devices=jax.devices()[:2])
    got_p, state, _ = _train(train, opt, p, x, y)
    _assert_like_one_device(got_p, state, _disjoint_slices, opt, p, x, y)


# ----------------------------------------------------------------------------
# Training against one device
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(
    "model, stages, recompute",
    [("lax.scan", 4, False), ("nn.scan", 2, False), ("lax.scan", 2, True)],
    ids=["lax.scan-S4", "nn.scan-S2", "lax.scan-S2-recompute"],
)
def test_pipeline_train_step_of_a_partitioned_stack_matches_one_device(model, stages, recompute, schedule):
    loss, make = MODELS[model]
    p, (x, y) = make(), batch()
    opt = optax.adam(1e-2)
    train = pipeline_train_step(
        split_scan(loss, stages),
        opt,
        num_microbatches=4,
        schedule=schedule,
        devices=jax.devices()[:stages],
        recompute=recompute,
    )
    got_p, state, values = _train(train, opt, p, x, y)
    assert len(_sliced_parameters(train.built(p, x, y), p)) == (1 if model == "lax.scan" else 2)
    assert jax.tree.map(np.shape, got_p) == jax.tree.map(np.shape, p)  # the whole stack, joined back
    _assert_like_one_device(got_p, state, loss, opt, p, x, y, values=values)


@pytest.mark.parametrize(
    "model, stages, schedule, zero_stage",
    [("lax.scan", 2, "gpipe", 0), ("lax.scan", 4, "1f1b", 2), ("nn.scan", 2, "1f1b", 0), ("nn.scan", 4, "gpipe", 3)],
)
def test_run_pipelined_of_an_unmarked_stack_matches_one_device(model, stages, schedule, zero_stage):
    loss, make = MODELS[model]
    p, (x, y) = make(), batch()
    opt = optax.adam(1e-2)
    passes = rp.PassManager.default(zero=zero_stage) if zero_stage else None
    parallelism = rp.Parallelism(stages=stages, microbatches=4, schedule=schedule)
    repl = rp.Replicator(1, 8, parallelism=parallelism, passes=passes)
    state, values = (p, opt.init(p)), []
    for _ in range(STEPS):
        state, value = repl.run_pipelined(loss, opt, (x, y), state)
        values.append(value)
    built = repl.pipelined.step_for(loss, opt).built(p, x, y)
    assert len(_sliced_parameters(built, p)) == (1 if model == "lax.scan" else 2)
    _assert_like_one_device(*state, loss, opt, p, x, y, values=values)


# ----------------------------------------------------------------------------
# What each device keeps
# ----------------------------------------------------------------------------


def _shard_shapes(rows: dict) -> set:
    """Each buffer's shard shape (the same on every device)."""
    shapes = {k: {s.data.shape for s in v.addressable_shards} for k, v in rows.items()}
    assert all(len(s) == 1 for s in shapes.values()), shapes
    return {k: s.pop() for k, s in shapes.items()}


@pytest.mark.parametrize("stages", [2, 4])
def test_each_stage_row_holds_its_slice_of_the_stack(stages):
    p, (x, y) = plain_params(), batch()
    opt = optax.adam(1e-2)
    train = pipeline_train_step(split_scan(plain_loss, stages), opt, num_microbatches=4, devices=jax.devices()[:stages])
    built = train.built(p, x, y)
    layer, piece = DIM * DIM, (LAYERS // stages) * DIM * DIM
    # Each stage keeps its slice of the stack and of its two Adam moments, and Adam's count; the last stage also
    # the head and its moments.
    per_stage = [3 * piece + 1 + (3 * layer if s == stages - 1 else 0) for s in range(stages)]
    assert [sum(int(np.prod(a.shape)) for a in lay) for lay in built.packing.layouts] == per_stage
    # Each stage's slice of the stack lines up with the others' (a slot, a buffer of its own; one for each
    # moment's slice too); the head and its moments are in the last stage's row, the others' rows padding.
    buffers = {"float32": 3 * layer, "slot0": piece, "slot1": piece, "slot2": piece, "slot3": 1}
    assert {k: n for k, (_, n) in built.packing.buffers().items()} == buffers
    assert sum(buffers.values()) == max(per_stage)
    rows = train.pack(p, opt.init(p))
    for _ in range(STEPS):  # what the step returns is stored the same way
        rows, _ = train.step(p, rows, x, y)
    assert _shard_shapes(rows) == {k: (1, n) for k, n in buffers.items()}
    got_p, got_state = train.unpack(p, rows)
    assert got_p["stack"].shape == (LAYERS, DIM, DIM)
    want_p, want_state, _ = _reference(plain_loss, opt, p, x, y)
    _assert_close(got_p, want_p)
    _assert_close(got_state, want_state)


@pytest.mark.parametrize("stages", [2, 4])
def test_a_partitioned_gradient_is_each_stages_own_never_summed_across_stages(stages):
    p, (x, y) = plain_params(), batch()
    train = pipeline_train_step(
        split_scan(stack_loss, stages), optax.sgd(0.1), num_microbatches=4, devices=jax.devices()[:stages]
    )
    built = train.built({"stack": p["stack"]}, x, y)
    chunk = (LAYERS // stages, DIM, DIM)
    outputs = built.outputs_layout  # of the cut values: the stack's gradient and the loss
    (loss,) = outputs.shared  # only the loss is summed over the stages
    (grad,) = outputs.own[0]
    assert outputs.own == [[grad]] * stages and grad != loss  # the stack's gradient: each stage's slice, its own
    assert [prog.sliced[grad].shape for prog in built.programs] == [chunk] * stages
    # It accumulates with the slice's aval: in one slot (every stage has one such gradient), not the whole stack.
    assert [a.shape for a in outputs.slots.avals] == [chunk]
    assert outputs.slots.of == [{grad: 0}] * stages


@pytest.mark.parametrize("stages, zero_stage", [(2, 0), (4, 0), (2, 1), (4, 3)])
def test_balanced_stages_keep_one_over_s_of_the_parameters_and_optimizer_state(stages, zero_stage):
    """The issue's goal: per device parameter and optimizer bytes <= 1.1 / S of the replicated figure (and,
    under ZeRO on the stage's D replicas, 1/D of that): the row holds both (the step's whole state)."""
    p, (x, y) = {"stack": plain_params()["stack"]}, batch()
    opt = optax.adam(1e-2)
    passes = rp.PassManager.default(zero=zero_stage) if zero_stage else None
    repl = rp.Replicator(1, 8, parallelism=rp.Parallelism(stages=stages, microbatches=4), passes=passes)
    report = repl.describe_pipeline(stack_loss, opt, (x, y), (p, opt.init(p)))
    replicas = 8 // stages
    whole = LAYERS * DIM * DIM * FLOAT
    params_split = stages * (replicas if zero_stage >= 3 else 1)
    state_split = stages * (replicas if zero_stage >= 1 else 1)
    assert report.row_bytes <= 1.1 * (whole / params_split + 2 * whole / state_split) + FLOAT  # mu, nu; the count
    # Each stage's leaves: its slice of the stack and of its two moments, and the count.
    assert [r.parameter_bytes for r in report.per_stage] == [3 * whole // stages + FLOAT] * stages


def test_rows_pack_each_stages_slice_and_unpack_the_joined_leaf():
    from jax.sharding import Mesh

    stack = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    other = np.array([7.0, 8.0], np.float32)
    pieces = {0: ((0, 0, 1), (1, 1, 4))}  # stage 0: row 0; stage 1: rows 1-3
    packing = Packing([[jax.ShapeDtypeStruct((1, 3), jnp.float32)], [jax.ShapeDtypeStruct((3, 3), jnp.float32), other]])
    layout = [[0], [0, 1]]
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1, 1), ("stages", "workers", "cores"))
    rows = RowPacker(packing, layout, mesh, pieces=pieces)([stack, other])
    row = np.asarray(rows["float32"])
    np.testing.assert_array_equal(row[0], [0, 1, 2] + [0] * 8)
    np.testing.assert_array_equal(row[1], [*range(3, 12), 7, 8])
    got = RowUnpacker(packing, layout, owners=[0, 1], pieces=pieces)(rows)
    np.testing.assert_array_equal(got[0], stack)
    np.testing.assert_array_equal(got[1], other)
