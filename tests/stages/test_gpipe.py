"""The GPipe prototype against one device: ``jax.jit(jax.value_and_grad(loss))`` on the whole batch.

Each case runs S stages on S emulated devices with M micro-batches; the loss is a mean over rows, so
the mean over micro-batches of their value and gradient is the value and gradient on the whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.stages.gpipe import gpipe_value_and_grad

VOCAB, DIM, ROWS = 10, 8, 12


def two_stages(p, ids, y):
    h = rp.stage_boundary(jnp.tanh(p["emb"][ids] @ p["w1"]))
    return jnp.mean((h @ p["head"] - y) ** 2)


def three_stages(p, ids, y):
    """An embedding, a layer, a head; token ids cross a boundary beside the activations."""
    h = rp.stage_boundary(p["emb"][ids])
    h, ids = rp.stage_boundary((jnp.tanh(h @ p["w1"]), ids))
    decay = 0.1 * jnp.sum(p["extra"] ** 2)  # free: computed from a parameter alone, its gradient too
    return jnp.mean((h @ p["head"] - y) ** 2) + 0.01 * jnp.mean(jnp.sin(ids.astype(jnp.float32))) + decay


def four_stages_tied(p, ids, y):
    """The head is the embedding, transposed: its gradient is summed across stages 0 and 3."""
    h = rp.stage_boundary(p["emb"][ids])
    h = rp.stage_boundary(jnp.tanh(h @ p["w1"]))
    h = rp.stage_boundary(jnp.tanh(h @ p["w1"].T) + h)
    return jnp.mean((h @ p["emb"].T - y) ** 2)


def params():
    rng = np.random.default_rng(0)
    return {
        "emb": rng.normal(size=(VOCAB, DIM)).astype(np.float32),
        "w1": (0.3 * rng.normal(size=(DIM, DIM))).astype(np.float32),
        "head": rng.normal(size=(DIM, VOCAB)).astype(np.float32),
        "extra": rng.normal(size=(3,)).astype(np.float32),
    }


def batch():
    rng = np.random.default_rng(1)
    return rng.integers(0, VOCAB, size=(ROWS,)), rng.normal(size=(ROWS, VOCAB)).astype(np.float32)


@pytest.mark.parametrize(
    "loss, stages, m",
    [
        (two_stages, 2, 1),
        (two_stages, 2, 4),
        (three_stages, 3, 3),
        (jax.checkpoint(three_stages), 3, 2),
        (four_stages_tied, 4, 2),  # M < S: mostly bubble, still exact
        (four_stages_tied, 4, 6),
    ],
    ids=["S2-M1", "S2-M4", "S3-M3", "S3-M2-checkpoint", "S4-M2-tied", "S4-M6-tied"],
)
def test_matches_one_device(loss, stages, m):
    p = params()
    if loss is four_stages_tied:
        del p["head"]  # the embedding is the head
    ids, y = batch()
    value, grads = gpipe_value_and_grad(loss, num_microbatches=m, devices=jax.devices()[:stages])(p, ids, y)
    want_value, want = jax.jit(jax.value_and_grad(loss))(p, ids, y)
    np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_product_of_parameters_read_by_two_stages():
    # Computed from parameters alone, each stage computes it again: no error, and its gradient sums.
    def loss(p, ids, y):
        w = p["w1"] @ p["w1"]
        h = rp.stage_boundary(jnp.tanh(p["emb"][ids] @ w))
        return jnp.mean((jnp.tanh(h @ w) @ p["head"] - y) ** 2)

    p, (ids, y) = params(), batch()
    value, grads = gpipe_value_and_grad(loss, num_microbatches=2, devices=jax.devices()[:2])(p, ids, y)
    want_value, want = jax.jit(jax.value_and_grad(loss))(p, ids, y)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_batch_not_divisible():
    with pytest.raises(ValueError, match="num_microbatches=5"):
        gpipe_value_and_grad(two_stages, num_microbatches=5, devices=jax.devices()[:2])(params(), *batch())


def test_wrong_device_count():
    with pytest.raises(rp.ReplicationError, match="2 stages; pass 2 devices"):
        gpipe_value_and_grad(two_stages, num_microbatches=2, devices=jax.devices()[:3])(params(), *batch())
