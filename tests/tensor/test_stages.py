"""PassManager stages x tensor parallelism (x data): the user's step cut at its ``rp.stage_boundary`` markers and
split over the tensor axis, on the mesh ``('stages', 'workers', 'cores', 'tensor')``.

Each test compares the whole new state (parameters and Adam's moments) and the loss after two steps with
``jax.jit`` of the same update on one device on the global batch, within 1e-5 relative to each leaf's largest
value. Mesh shapes (stages, workers, cores, tensor): (2, 1, 2, 2), (2, 2, 1, 2) (stages across workers),
(2, 1, 1, 4) and (2, 1, 1, 2) (square: one replica).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.stages.tensor_rows import TensorRows, with_tensor
from replicator.tensor.placement import Shard
from tests.tensor.test_replicator import _batches, _close

PLAN = {"*/fc1": "column", "*/b1": 0, "*/fc2": "row", "*/fc3": "column", "*/fc4": "row"}
TX = optax.adam(1e-2)


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["fc0"])
    h = h + jnp.tanh(h @ p["fc1"] + p["b1"]) @ p["fc2"]  # stage 0: a Megatron MLP
    h = rp.stage_boundary(h)
    h = h + jnp.tanh(h @ p["fc3"]) @ p["fc4"]  # stage 1: another
    return jnp.mean((h @ p["out"] - b["y"]) ** 2)


def _step(state, b):
    p, o = state
    loss, g = jax.value_and_grad(_loss)(p, b)
    u, o = TX.update(rp.all_mean(g), o, p)
    return (optax.apply_updates(p, u), o), rp.all_mean(loss)


def _one_device(state, b):
    p, o = state
    loss, g = jax.value_and_grad(_loss)(p, b)
    u, o = TX.update(g, o, p)
    return (optax.apply_updates(p, u), o), loss


def _state(seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    p = {
        "fc0": jax.random.normal(k[0], (6, 8)) / 3,
        "fc1": jax.random.normal(k[1], (8, 16)) / 3,
        "b1": jnp.linspace(-0.5, 0.5, 16),
        "fc2": jax.random.normal(k[2], (16, 8)) / 4,
        "fc3": jax.random.normal(k[3], (8, 16)) / 3,
        "fc4": jax.random.normal(k[4], (16, 8)) / 4,
        "out": jax.random.normal(k[5], (8, 3)) / 3,
    }
    return p, TX.init(p)


def _train(repl, batches, state):
    for b in batches:
        state, loss = repl.run(_step, b, state)
    return state, loss


def _reference(batches, state):
    for b in batches:
        state, loss = jax.jit(_one_device)(state, b)
    return state, loss


def _repl(workers, cores, tensor, schedule="1f1b", zero=0, microbatches=4, plan=PLAN, **options):
    passes = rp.PassManager.default(zero=zero, shard_optimizer_min_bytes=0) if zero else None
    parallelism = rp.Parallelism(
        tensor=tensor, tensor_plan=plan, stages=2, microbatches=microbatches, schedule=schedule, **options
    )
    return rp.Replicator(workers, cores, passes=passes, parallelism=parallelism)


@pytest.mark.parametrize(
    "workers,cores,tensor,schedule,zero",
    [
        (1, 8, 2, "1f1b", 0),
        (1, 8, 2, "gpipe", 3),
        (1, 8, 2, "1f1b-fused", 1),
        (2, 4, 2, "1f1b", 2),  # stages within each worker: 2 workers x 1 core x 2 stages
        (1, 8, 4, "1f1b-fused", 3),
        (1, 4, 2, "gpipe", 0),  # square: 2 stages x 2 tensor, one replica
    ],
)
def test_stages_by_tensor_equal_one_device_on_the_global_batch(workers, cores, tensor, schedule, zero):
    repl = _repl(workers, cores, tensor, schedule, zero)
    mesh = repl.pipelined.mesh
    assert mesh.axis_names == ("stages", "workers", "cores", "tensor") and mesh.shape["tensor"] == tensor
    replicas = repl.pipelined.replicas
    assert replicas == workers * cores // (2 * tensor)
    batches = _batches(4 * replicas)
    got, loss = _train(repl, batches, _state())
    want, want_loss = _reference(batches, _state())
    _close(got, want)
    np.testing.assert_allclose(np.asarray(loss), float(want_loss), rtol=1e-5)
    assert np.shape(loss) == (replicas,)


@pytest.mark.parametrize("workers,cores,tensor,schedule,zero", [(1, 8, 2, "1f1b", 0), (1, 8, 4, "gpipe", 3)])
def test_run_pipelined_of_a_loss_and_an_optimizer_splits_over_the_tensor_axis(workers, cores, tensor, schedule, zero):
    # run_pipelined writes the step a data-parallel user would from its loss and optimizer and builds it as the
    # user's own step: the tensor axis comes with it.
    repl = _repl(workers, cores, tensor, schedule, zero)
    batches = _batches(4 * repl.pipelined.replicas)
    state = _state()
    for b in batches:
        state, loss = repl.run_pipelined(_loss, TX, b, state)
    want, want_loss = _reference(batches, _state())
    _close(state, want)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    built = repl.pipelined.step_for(_loss, TX).built(state[0], batches[0])
    # Every row lies P('stages', 'tensor'), or P('stages', ('tensor', *data axes)) with ZeRO's chunks.
    specs = {(spec[0], spec[1] if isinstance(spec[1], str) else spec[1][0]) for spec in built.row_spec.values()}
    assert built.tensor_split is not None and specs == {("stages", "tensor")}


def test_each_device_holds_its_tensor_block_of_its_stage_row():
    """The rows ``(S, T * n)`` lie ``P('stages', 'tensor')``: a device's row is its stage's leaves with the
    planned ones at 1/T, so a stage's row is smaller than the same leaves whole by what the plan splits."""
    repl = _repl(1, 8, 2)
    state = _state()
    batch = _batches(8, n=1)[0]
    repl.run(_step, batch, state)
    rows = repl.pipelined.last_rows
    built = repl.pipelined.user_step(_step, batch, state)
    leaves = jax.tree.leaves(state)
    for stage in (0, 1):
        mine = [i for i in range(len(leaves)) if stage in built.held[i]]
        want = sum(leaves[i].size // (2 if isinstance(built.tensor_split.placements[i], Shard) else 1) for i in mine)
        held = 0
        for key, buffer in rows.items():  # the float32 row and the slots of larger leaves
            shards = [s for s in buffer.addressable_shards if s.index[0].start == stage]
            assert len(shards) == 4 and {s.data.shape for s in shards} == {(1, buffer.shape[1] // 2)}, key
            assert tuple(buffer.sharding.spec) == ("stages", "tensor")
            held += shards[0].data.size
        # The device's rows hold exactly its stage's local blocks (the padding to a slot's boundary aside).
        assert want <= held < want + 64 * len(rows)
        assert held < sum(leaves[i].size for i in mine) * 0.75
    # fc1 (8, 16) is split by columns over the tensor axis, fc0 is whole; both are read back whole.
    assert built.tensor_split.placements[sorted(state[0]).index("fc1")] == Shard(1)
    got, _ = repl.run(_step, batch, state)
    assert got[0]["fc1"].shape == (8, 16)


def test_the_two_devices_of_a_tensor_group_hold_different_blocks():
    repl = _repl(1, 4, 2)  # 2 stages x tensor 2, one replica
    state = _state()
    rows = repl.pipelined.user_step(_step, _batches(4, n=1)[0], state).pack(state)
    by_device: dict = {}
    for key in sorted(rows):  # the float32 row of the small leaves (whole: equal) and the slots (split: not)
        for s in rows[key].addressable_shards:
            by_device.setdefault(s.device, []).append(np.asarray(s.data).ravel())
    for stage in range(2):
        pair = [np.concatenate(by_device[d]) for d in repl.pipelined.mesh.devices[stage].flat]
        assert len(pair) == 2 and pair[0].shape == pair[1].shape and not np.array_equal(pair[0], pair[1])


def test_pack_then_unpack_gives_the_state_back():
    repl = _repl(1, 8, 4, zero=3)
    state = _state()
    built = repl.pipelined.user_step(_step, _batches(4, n=1)[0], state)
    back = built.unpack(built.pack(state))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_with_tensor_puts_the_axis_outermost_on_the_row():
    P = jax.sharding.PartitionSpec
    assert with_tensor(P("stages")) == P("stages", "tensor")
    assert with_tensor(P("stages", ("workers", "cores"))) == P("stages", ("tensor", "workers", "cores"))
    assert with_tensor(P("stages", "cores")) == P("stages", ("tensor", "cores"))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(2, 1, 1), ("stages", "workers", "cores"))
    with pytest.raises(ValueError, match="last axis is 'tensor'"):
        TensorRows([], mesh, [], [])


def test_explain_lists_the_tensor_collectives_per_micro_batch():
    repl = _repl(1, 8, 2)
    report = repl.explain(_step, _batches(8, n=1)[0], _state())
    kinds = [c.kind for c in report.tensor.collectives]
    # Per micro-batch: one all-reduce forward per MLP (2), one backward per MLP but the first (its input is
    # computed from the batch by a replicated layer, whose own input gradient is not needed: fc0's weight
    # gradient needs the backward all-reduce) and the loss; exactly what the rules insert.
    assert kinds.count("all-reduce") >= 4, kinds
    text = str(report)
    assert "over the tensor axis 'tensor' (T = 2)" in text and "per micro-batch" in text
    assert "test_stages.py" in text  # each collective names the user's line


def test_a_sequence_parallel_pipeline_equals_one_device():
    def loss(p, b):
        x = b["x"]  # (batch, sequence, hidden)
        h = x + jnp.tanh(x @ p["fc1"]) @ p["fc2"]
        h = rp.stage_boundary(h)
        h = h + jnp.tanh(h @ p["fc3"]) @ p["fc4"]
        return jnp.mean((h - b["y"]) ** 2)

    def step(state, b):
        p, o = state
        value, g = jax.value_and_grad(loss)(p, b)
        u, o = TX.update(rp.all_mean(g), o, p)
        return (optax.apply_updates(p, u), o), rp.all_mean(value)

    def one(state, b):
        p, o = state
        value, g = jax.value_and_grad(loss)(p, b)
        u, o = TX.update(g, o, p)
        return (optax.apply_updates(p, u), o), value

    k = jax.random.split(jax.random.key(3), 6)
    p = {
        n: jax.random.normal(k[i], s) / 3
        for i, (n, s) in enumerate([("fc1", (8, 16)), ("fc2", (16, 8)), ("fc3", (8, 16)), ("fc4", (16, 8))])
    }
    state = (p, TX.init(p))
    batch = {"x": jax.random.normal(k[4], (8, 4, 8)), "y": jax.random.normal(k[5], (8, 4, 8))}
    plan = {k: v for k, v in PLAN.items() if k != "*/b1"}
    repl = _repl(1, 8, 2, plan=plan, sequence_parallel=1)
    got, value = repl.run(step, batch, state)
    want, want_value = jax.jit(one)(state, batch)
    _close(got, want)
    np.testing.assert_allclose(np.asarray(value), float(want_value), rtol=1e-5)
    kinds = {c.kind for c in repl.explain(step, batch, state).tensor.collectives}
    assert "reduce-scatter" in kinds and "all-gather" in kinds


def test_a_checkpoint_saved_on_stages_by_tensor_restores_at_another_layout_and_trains_on(tmp_path):
    """Saved at stages 2 x tensor 2 (the state comes back whole), restored at tensor 4 without stages, on plain
    data parallelism with ZeRO-3 and on a pipeline without the tensor axis; and saved on plain data parallelism,
    restored onto stages x tensor: the next steps equal an uninterrupted run on one device."""
    batches = _batches(8, n=4)
    want, _ = _reference(batches, _state())
    manager = rp.CheckpointManager(tmp_path / "a")
    state, _ = _train(_repl(1, 8, 2), batches[:2], _state())
    manager.save(2, state)
    for later in (
        rp.Replicator(1, 8, parallelism=rp.Parallelism(tensor=4, tensor_plan=PLAN)),
        rp.Replicator(2, 4, passes=rp.PassManager.default(zero=3, shard_optimizer_min_bytes=0)),
        rp.Replicator(1, 8, parallelism=rp.Parallelism(stages=2, microbatches=2)),
    ):
        step, restored, _ = manager.restore(_state())
        assert step == 2
        got, _ = _train(later, batches[2:], restored)
        _close(got, want)
    plain = rp.CheckpointManager(tmp_path / "b")
    state, _ = _train(rp.Replicator(1, 8), batches[:2], _state())
    plain.save(2, state)
    _, restored, _ = plain.restore(_state())
    got, _ = _train(_repl(1, 8, 2, zero=3, schedule="gpipe"), batches[2:], restored)
    _close(got, want)


@pytest.mark.parametrize("zero", [0, 3])
def test_no_weight_is_gathered_over_the_tensor_axis_in_the_compiled_step(zero):
    """The compiled pipelined program's all-gathers: none without ZeRO-3; with it, only ZeRO's gathers of each
    device's chunks over the data axes (replica groups that never join two devices of a tensor group)."""
    import re

    repl = _repl(1, 8, 2, zero=zero)
    state, batch = _state(), _batches(8, n=1)[0]
    built = repl.pipelined.user_step(_step, batch, state)
    text = built.step.lower(built.pack(state), built.micro_leaves(batch)).compile().as_text()
    lines = [line for line in text.splitlines() if re.search(r"all-gather(-start)?\(", line)]
    if zero == 0:
        assert not lines, lines
        return
    assert lines, "ZeRO-3 gathers its chunks"
    mesh = repl.pipelined.mesh
    position = {d: i for i, d in enumerate(mesh.devices.flat)}  # the HLO's device numbers: the mesh's order
    groups = mesh.devices.reshape(-1, 2)  # each row: the two devices of a tensor group (the axis innermost)
    pairs = [frozenset(position[d] for d in row) for row in groups]
    for line in lines:
        named = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line)
        if named:  # newer XLA names the mesh axes a collective spans
            assert "tensor" not in named[1], line
            continue
        explicit = re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line)
        assert explicit, line
        for group in re.findall(r"\{([\d,]+)\}", explicit[1]):
            ids = {int(i) for i in group.split(",")}
            assert not any(len(ids & pair) > 1 for pair in pairs), (line, pairs)


def test_plan_auto_on_a_pipeline_chooses_on_the_traced_step_and_equals_one_device():
    """``tensor_plan="auto"`` with stages: the plan is chosen on the per-replica step (before the stage cut);
    under a budget below the whole state it splits the MLPs' matrices, and the pipeline equals one device."""
    state = _state()
    whole = sum(x.nbytes for x in jax.tree.leaves(state))
    parallelism = rp.Parallelism(
        tensor=2, tensor_plan="auto", memory_budget=whole * 3 // 4, stages=2, microbatches=4, schedule="1f1b"
    )
    repl = rp.Replicator(1, 8, parallelism=parallelism)
    batches = _batches(8)
    got, _ = _train(repl, batches, state)
    _close(got, _reference(batches, _state())[0])
    built = repl.pipelined.user_step(_step, batches[0], _state())
    split = [p for p in built.tensor_split.placements if isinstance(p, Shard)]
    assert split, "a budget below the whole state needs some leaf split"
    # No ring of collective matmul inside a stage (its ppermute would wait for every device): not tried.
    assert not repl.tensor.rings_allowed and "not allowed here" in str(repl.tensor.plan.chosen)
