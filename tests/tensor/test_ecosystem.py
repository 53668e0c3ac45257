"""Tensor parallelism of models people already have: a Flax linen transformer block, unchanged.

The plan names Flax's own parameter paths; the block's code is Flax's
(``nn.MultiHeadDotProductAttention``, ``nn.Dense``, ``nn.LayerNorm``). The new
parameters and Adam's state after 2 steps equal ``jax.jit`` of the same step on
one device within 1e-5 relative, at T = 2 and 4, with nothing gathered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from replicator.tensor import Shard, TensorParallel

nn = pytest.importorskip("flax.linen")


def _two_steps_equal_one_device(tp, step, state, batch):
    """Two steps of ``tp`` and of ``jax.jit(step)``: every leaf within 1e-5 of its largest value, the loss too."""
    got, want = tp.shard(state, batch), state
    for _ in range(2):
        got, got_loss = tp(got, batch)
        want, want_loss = jax.jit(step)(want, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(jnp.max(jnp.abs(b)))))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)


class Block(nn.Module):
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        h = x.shape[-1]
        y = nn.LayerNorm(name="ln1")(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(y, y, mask=mask)
        y = nn.LayerNorm(name="ln2")(x)
        y = nn.Dense(4 * h, name="fc1")(y)
        return x + nn.Dense(h, name="fc2")(nn.gelu(y))


PLAN = {
    "0/params/attn/query/kernel": 1,  # (hidden, heads, head_dim): the heads split
    "0/params/attn/key/kernel": 1,
    "0/params/attn/value/kernel": 1,
    "0/params/attn/out/kernel": 0,  # (heads, head_dim, hidden)
    "0/params/fc1/kernel": "column",
    "0/params/fc2/kernel": "row",
}


@pytest.mark.parametrize("size", [2, 4])
def test_a_flax_transformer_block_split_over_heads_and_hidden_equals_one_device(size):
    model = Block()
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16))
    y = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 16))
    params = model.init(jax.random.PRNGKey(2), x)
    # eps well above rounding: the key bias's gradient is zero in exact arithmetic (softmax does not
    # see a shift of the keys), and Adam's default eps would turn its rounding noise into steps of lr.
    opt = optax.adam(1e-2, eps=1e-4)
    state = (params, opt.init(params))

    def step(state, batch):
        params, opt_state = state
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    tp = TensorParallel(step, PLAN, size=size)
    _two_steps_equal_one_device(tp, step, state, (x, y))
    pl = tp.placements(state, (x, y))
    assert pl["0/params/attn/query/bias"] == Shard(0)  # (heads, head_dim): follows its kernel
    assert pl["0/params/fc1/bias"] == Shard(0)
    events = tp.collectives(state, (x, y))
    assert "all-gather" not in {e.kind for e in events}
    # Forward: one all-reduce after the attention's output projection and one after fc2. Backward:
    # Megatron's two, the MLP's input gradient and the attention's, less the attention's, since the
    # block's input is the batch, whose gradient nobody reads. The query, key and value
    # projections' three partial input gradients are added before their one all-reduce.
    activations = [e for e in events if e.shape == (2, 8, 16)]
    assert len(activations) == 3, events


def test_an_equinox_mlp_split_by_its_own_paths_equals_one_device():
    eqx = pytest.importorskip("equinox")
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    model = eqx.nn.MLP(16, 16, width_size=64, depth=2, activation=jax.nn.gelu, key=keys[0])
    params, static = eqx.partition(model, eqx.is_array)
    opt = optax.adamw(1e-2, eps=1e-4)
    state = (params, opt.init(params))
    x = jax.random.normal(keys[1], (8, 16))
    y = jax.random.normal(keys[2], (8, 16))

    def step(state, batch):
        params, opt_state = state
        x, y = batch

        def loss(p):
            return jnp.mean((jax.vmap(eqx.combine(p, static))(x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    # Equinox's Linear keeps its weight as (out, in): splitting the outputs is dimension 0.
    plan = {"0/layers/0/weight": 0, "0/layers/1/weight": 1}
    tp = TensorParallel(step, plan, size=2)
    _two_steps_equal_one_device(tp, step, state, (x, y))
    assert tp.placements(state, (x, y))["0/layers/0/bias"] == Shard(0)
    assert "all-gather" not in {e.kind for e in tp.collectives(state, (x, y))}
