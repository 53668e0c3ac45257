"""The full training step (value and gradient over the stages, then each stage's Adam update on its own
parameters) against one device: ``jax.jit`` of ``jax.value_and_grad`` + ``optax.adam`` on the whole batch,
3 steps. And where the parameters and the optimizer state live: each stage's on its device only."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from replicator.stages.train import pipeline_train_step
from tests.stages.test_gpipe import batch, four_stages_tied, params, three_stages, two_stages

STEPS = 3


def _reference(loss, optimizer, p, ids, y, steps=STEPS):
    @jax.jit
    def step(p, state):
        value, grads = jax.value_and_grad(loss)(p, ids, y)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, value

    state, values = optimizer.init(p), []
    for _ in range(steps):
        p, state, value = step(p, state)
        values.append(value)
    return p, state, values


def _train(train, optimizer, p, *batch):
    """``STEPS`` steps of ``train`` from ``p`` (global shapes in and out, every step): params, state, losses."""
    got_p, state, values = p, optimizer.init(p), []
    for _ in range(STEPS):
        got_p, state, value = train(got_p, state, *batch)
        values.append(value)
    return got_p, state, values


def _assert_like_one_device(got_p, got_state, loss, optimizer, p, *batch, values=None):
    """Parameters and optimizer state (and the losses, if given) equal one device's ``STEPS`` steps."""
    want_p, want_state, want_values = _reference(loss, optimizer, p, *batch)
    _assert_close(got_p, want_p)
    _assert_close(got_state, want_state)
    if values is not None:
        np.testing.assert_allclose(values, want_values, rtol=1e-5)


def _assert_close(got, want, tol=5e-5):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-fused"])
@pytest.mark.parametrize(
    "loss, stages, m",
    [(two_stages, 2, 4), (four_stages_tied, 4, 4), (three_stages, 3, 6)],
    ids=["S2-M4", "S4-M4-tied", "S3-M6"],
)
def test_three_adam_steps_match_one_device(loss, stages, m, schedule):
    p = params()
    if loss is four_stages_tied:
        del p["head"]
    ids, y = batch()
    opt = optax.adam(1e-2)
    train = pipeline_train_step(loss, opt, num_microbatches=m, schedule=schedule, devices=jax.devices()[:stages])
    got_p, state, values = _train(train, opt, p, ids, y)
    _assert_like_one_device(got_p, state, loss, opt, p, ids, y, values=values)


def test_state_lives_on_its_stage():
    p = params()
    del p["head"]
    ids, y = batch()
    opt = optax.adam(1e-2)
    devices = jax.devices()[:4]
    train = pipeline_train_step(four_stages_tied, opt, num_microbatches=4, schedule="1f1b", devices=devices)
    train.built(p, ids, y)
    # The embedding (read by stage 0 and, as the head, stage 3) on both; w1 on the two middle stages.
    assert train.held(p) == {"emb": (0, 3), "w1": (1, 2), "extra": (0, 1, 2, 3)}
    rows, values = train.pack(p, opt.init(p)), []
    for _ in range(STEPS):  # kept packed across steps
        rows, value = train.step(p, rows, ids, y)
        values.append(value)
    # One row per stage holds its leaves and their Adam moments; `extra`, kept by every stage, and its moments
    # have buffers of their own (slots), as does Adam's count.
    assert {k: v.shape for k, v in rows.items()} == {
        "float32": (4, 3 * 10 * 8),  # the largest stage's: the embedding and its two moments
        "slot0": (4, 3),
        "slot1": (4, 3),
        "slot2": (4, 3),
        "slot3": (4, 1),
    }
    buffer = rows["float32"]
    assert buffer.sharding.spec == jax.sharding.PartitionSpec("stages")
    shards = {s.device: s.data for s in buffer.addressable_shards}
    assert all(shards[d].shape == (1, 3 * 10 * 8) for d in devices)
    # Device 1's row holds w1 and its moments only, then padding; its slot holds `extra`.
    want_p, want_state, want_values = _reference(four_stages_tied, opt, p, ids, y)
    assert np.shape(values[0]) == ()
    np.testing.assert_allclose(values, want_values, rtol=1e-5)
    row = np.asarray(shards[devices[1]])[0]
    np.testing.assert_allclose(row[:64].reshape(8, 8), want_p["w1"], rtol=5e-5, atol=5e-5)
    assert row[64:192].any() and not row[192:].any()
    for shard in rows["slot0"].addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data)[0], want_p["extra"], rtol=5e-5, atol=5e-5)
    # The tied embedding: the same on its two stages (both updated with the summed gradient).
    np.testing.assert_array_equal(np.asarray(shards[devices[0]]), np.asarray(shards[devices[3]]))
    got_p, got_state = train.unpack(p, rows)
    _assert_close(got_p, want_p)
    _assert_close(got_state, want_state)


def test_an_optimizer_that_reads_across_parameters_equals_one_device():
    # A global-norm clip reads every stage's gradients: each stage's update reads them all (the user step's
    # update phase), so the clip is by the global norm, as on one device. A clip threshold below the gradients'
    # norm makes the clip act (SGD after it: Adam would undo the scale).
    opt = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(0.5))
    p, (ids, y) = params(), batch()
    train = pipeline_train_step(two_stages, opt, num_microbatches=2, devices=jax.devices()[:2])
    got_p, got_state, values = _train(train, opt, p, ids, y)
    _assert_like_one_device(got_p, got_state, two_stages, opt, p, ids, y, values=values)


def test_without_devices_the_loss_takes_as_many_devices_as_it_has_stages():
    # No devices= nor mesh=: the first devices, one per stage the markers cut (4 here, the embedding tied).
    p, (ids, y) = params(), batch()
    del p["head"]
    opt = optax.sgd(0.1)
    train = pipeline_train_step(four_stages_tied, opt, num_microbatches=4)
    got_p, got_state, values = _train(train, opt, p, ids, y)
    assert np.shape(values[0]) == ()  # the loss, once (the same on every data-parallel replica)
    assert train.built(p, ids, y).mesh.devices.flat[:].tolist() == jax.devices()[:4]
    assert train.held(p) == {"emb": (0, 3), "w1": (1, 2), "extra": (0, 1, 2, 3)}
    _assert_like_one_device(got_p, got_state, four_stages_tied, opt, p, ids, y, values=values)


def test_only_the_state_a_step_returned_reuses_its_rows():
    """The rows a step returned are reused only for exactly the leaves it returned: a step given the first
    state again (a restart from it) starts from that state, not from where the last step left off."""
    p, (ids, y) = params(), batch()
    opt = optax.adam(1e-2)
    train = pipeline_train_step(two_stages, opt, num_microbatches=4, devices=jax.devices()[:2])
    first = train(p, opt.init(p), ids, y)
    second = train(*first[:2], ids, y)  # the returned leaves: their rows as they are
    again = train(p, opt.init(p), ids, y)  # the first state again
    want_p, want_state, _ = _reference(two_stages, opt, p, ids, y, steps=2)
    _assert_close(second[0], want_p)
    _assert_close(second[1], want_state)
    _assert_close(again[0], first[0])
    _assert_close(again[1], first[1])


def test_stages_on_devices_in_any_order():
    """Stage 0 on the second device and stage 1 on the first: each stage's row is read from its own devices
    (a device's place in the list, not its id), so the state returned equals one device's."""
    p, (ids, y) = params(), batch()
    opt = optax.adam(1e-2)
    train = pipeline_train_step(two_stages, opt, num_microbatches=4, devices=jax.devices()[:2][::-1])
    got_p, got_state, values = _train(train, opt, p, ids, y)
    assert train.held(p)["head"] == (1,) and next(iter(got_p["head"].devices())) == jax.devices()[0]
    _assert_like_one_device(got_p, got_state, two_stages, opt, p, ids, y, values=values)


def test_a_step_given_the_leaves_it_returned_does_not_pack_them_again():
    """With many leaves (300 biases beside the model's, more than Python keeps one int object for), the
    returned leaves' rows are reused as they are; another state is packed."""
    p, (ids, y) = params(), batch()
    p = {**p, **{f"unused{i:03d}": np.zeros((1,), np.float32) for i in range(300)}}
    opt = optax.sgd(0.1)
    train = pipeline_train_step(two_stages, opt, num_microbatches=4, devices=jax.devices()[:2])
    built = train.built(p, ids, y)
    packed = []
    pack = built.pack
    built.pack = lambda tree: packed.append(1) or pack(tree)
    state = train(p, opt.init(p), ids, y)
    train(*state[:2], ids, y)
    assert len(packed) == 1  # the first state only
    train(p, opt.init(p), ids, y)
    assert len(packed) == 2
