"""The table-driven lowering against one device: ``jax.jit(jax.value_and_grad(loss))`` on the whole batch,
under GPipe and 1F1B, S = 2 and 4, M = S and 2S (the models of test_gpipe.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.stages.lower import pipeline_value_and_grad, ring_slots
from replicator.stages.schedule import BACKWARD, FORWARD, Schedule, fused_one_f_one_b, gpipe, one_f_one_b
from tests.stages.test_gpipe import batch, four_stages_tied, params, three_stages, two_stages

ROWS = 16  # divisible by every M below


def _batch():
    ids, y = batch()
    return np.concatenate([ids, ids[:4]]), np.concatenate([y, y[:4] * 0.5])


def _compare(loss, stages, m, schedule, p=None, recompute=False):
    p = params() if p is None else p
    ids, y = _batch()
    assert len(ids) == ROWS
    f = pipeline_value_and_grad(
        loss, num_microbatches=m, schedule=schedule, devices=jax.devices()[:stages], recompute=recompute
    )
    value, grads = f(p, ids, y)
    want_value, want = jax.jit(jax.value_and_grad(loss))(p, ids, y)
    np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-fused"])
@pytest.mark.parametrize(
    "loss, stages, m",
    [(two_stages, 2, 2), (two_stages, 2, 4), (four_stages_tied, 4, 4), (four_stages_tied, 4, 8)],
    ids=["S2-M2", "S2-M4", "S4-M4-tied", "S4-M8-tied"],
)
def test_matches_one_device(loss, stages, m, schedule):
    p = params()
    if loss is four_stages_tied:
        del p["head"]  # the embedding is the head
    _compare(loss, stages, m, schedule, p)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-fused"])
def test_three_stages_recomputed_and_m_below_s(schedule):
    # Token ids crossing a boundary, a free gradient, jax.checkpoint (recomputation from the boundaries), M < S.
    _compare(jax.checkpoint(three_stages), 3, 2, schedule)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-fused"])
def test_a_constant_gradient_is_added_once(schedule):
    # A scalar parameter that enters the loss linearly has a constant gradient (a literal in the traced
    # program, not a computed value): the stage that owns it adds it once per micro-batch, with the backward.
    def loss(p, ids, y):
        return two_stages(p, ids, y) + p["scale"]

    p = params()
    p["scale"] = jnp.float32(2.0)
    _compare(loss, 2, 4, schedule, p)


def test_a_schedule_object():
    _compare(two_stages, 2, 4, one_f_one_b(2, 4))
    with pytest.raises(ValueError, match=r"make_schedule\(name, 2, 2\)"):
        pipeline_value_and_grad(two_stages, num_microbatches=2, schedule=gpipe(2, 4))(params(), *_batch())


def test_ring_slots():
    # 1F1B keeps S micro-batches' residuals, GPipe M; the inboxes hold what waits between neighbours' ticks.
    for s, m in [(2, 2), (2, 8), (4, 4), (4, 16), (3, 2)]:
        assert ring_slots(gpipe(s, m)) == {"stash": m, "inbox": 1, "inbox_ct": 1}
        assert ring_slots(one_f_one_b(s, m)) == {"stash": min(s, m), "inbox": 1, "inbox_ct": 1}
        # Fused: the first stage keeps 2S - 1 (a forward every tick while its first cotangent travels back).
        assert ring_slots(fused_one_f_one_b(s, m)) == {"stash": min(2 * s - 1, m), "inbox": 1, "inbox_ct": 1}


def test_backwards_out_of_order():
    # Stage 0 keeps at most two micro-batches, but 0 and 2 at once: slot m % 2 would collide, so 3 slots.
    rows = ["F0 .", "F1 F0", ". F1", ". B1", "B1 B0", "F2 .", "B0 F2", ". B2", "B2 ."]
    cells = [
        [(0, 0) if c == "." else ({"F": FORWARD, "B": BACKWARD}[c[0]], int(c[1])) for c in r.split()] for r in rows
    ]
    table = np.array(cells, np.int32)
    schedule = Schedule("out-of-order", 2, 3, table[..., 0], table[..., 1])
    assert ring_slots(schedule) == {"stash": 3, "inbox": 1, "inbox_ct": 1}
    p, (ids, y) = params(), batch()
    value, grads = pipeline_value_and_grad(two_stages, num_microbatches=3, schedule=schedule)(p, ids[:9], y[:9])
    want_value, want = jax.jit(jax.value_and_grad(two_stages))(p, ids[:9], y[:9])
    np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-6)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_arguments_placed_on_a_mesh():
    # Traced on shapes alone: parameters that live on a mesh (the previous step's results) do not carry it in.
    devices = jax.devices()[:2]
    mesh = jax.sharding.Mesh(np.array(devices), ("stages",))
    p = jax.device_put(params(), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    ids, y = _batch()
    value, grads = pipeline_value_and_grad(two_stages, num_microbatches=2, schedule="1f1b", devices=devices)(p, ids, y)
    want_value, want = jax.jit(jax.value_and_grad(two_stages))(params(), ids, y)
    np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-6)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_1f1b_memory_does_not_grow_with_m():
    # XLA's memory analysis of the compiled loop: GPipe's stash grows with M, 1F1B's ring stays at S slots.
    def loss(p, x):
        h = rp.stage_boundary(jnp.tanh(x @ p["a"]))
        return jnp.mean(jnp.tanh(h @ p["b"]))

    p = {"a": jnp.full((64, 64), 0.01), "b": jnp.full((64, 64), 0.01)}
    rows = 32  # per micro-batch: a (32, 64) float32 residual is 8 KiB

    def temp(schedule, m):
        f = pipeline_value_and_grad(loss, num_microbatches=m, schedule=schedule, devices=jax.devices()[:2])
        return f.lower(p, jnp.ones((rows * m, 64))).compile().memory_analysis().temp_size_in_bytes

    assert temp("1f1b", 8) == temp("1f1b", 2)
    assert temp("1f1b-fused", 16) == temp("1f1b-fused", 3)  # 3 = 2S - 1 slots from M = 3 on
    assert temp("1f1b-fused", 3) - temp("1f1b", 3) >= rows * 64 * 4  # one more micro-batch's residuals
    assert temp("gpipe", 8) - temp("gpipe", 2) >= 6 * rows * 64 * 4  # 6 more micro-batches' residuals at least


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-fused"])
@pytest.mark.parametrize(
    "loss, stages, m",
    [(two_stages, 2, 4), (four_stages_tied, 4, 8), (jax.checkpoint(three_stages), 3, 4)],
    ids=["S2-M4", "S4-M8-tied", "S3-M4-checkpoint"],
)
def test_recomputation_from_the_boundaries_matches_one_device(loss, stages, m, schedule):
    p = params()
    if loss is four_stages_tied:
        del p["head"]
    _compare(loss, stages, m, schedule, p, recompute=True)


def test_recomputation_stashes_only_the_boundary_inputs():
    # XLA's memory analysis of the compiled GPipe loop (CPU): each stage's three tanh layers keep their
    # activations for the backward; recomputing from the boundaries keeps only what stage 1 received.
    def loss(p, x):
        h = rp.stage_boundary(jnp.tanh(jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"]) @ p["c"]))
        return jnp.mean(jnp.tanh(jnp.tanh(jnp.tanh(h @ p["a"]) @ p["b"]) @ p["c"]))

    p = {k: jnp.full((64, 64), 0.01) for k in "abc"}
    rows = 32
    boundary = rows * 64 * 4  # one micro-batch's (32, 64) float32 boundary value: 8 KiB

    def temp(m, recompute):
        f = pipeline_value_and_grad(
            loss, num_microbatches=m, schedule="gpipe", devices=jax.devices()[:2], recompute=recompute
        )
        return f.lower(p, jnp.ones((rows * m, 64))).compile().memory_analysis().temp_size_in_bytes

    plain = {m: temp(m, False) for m in (4, 8)}
    again = {m: temp(m, True) for m in (4, 8)}
    for m in (4, 8):
        assert again[m] < 0.5 * plain[m], (m, again[m], plain[m])
    assert again[8] - again[4] <= 4 * boundary  # the stash grows by one boundary value per micro-batch
    assert plain[8] - plain[4] >= 4 * 3 * boundary  # against at least three activations without recomputation


@pytest.mark.parametrize(
    "ids, message",
    [(np.zeros((6,), np.int32), r"shape \(6,\) does not split into num_microbatches=4"), (np.int32(3), r"shape \(\)")],
    ids=["rows-not-a-multiple-of-m", "a-scalar"],
)
def test_a_batch_that_does_not_split_into_m_says_so(ids, message):
    f = pipeline_value_and_grad(two_stages, num_microbatches=4, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=message + r".*make the batch a multiple of 4"):
        f(params(), ids, np.zeros((8, 2), np.float32))
