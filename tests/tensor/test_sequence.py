"""Sequence parallelism: a transformer's activations split on the sequence between tensor-parallel regions.

Two pre-norm transformer blocks (separate q, k, v projections split by columns, heads split by a
reshape, the output projection and the MLP's second matrix by rows) trained one SGD step, against
``jax.jit`` of the same step on one device (1e-5 relative), at T = 2 and 4; and what the rewrite
inserted: with sequence parallelism, reduce-scatters and all-gathers of activations on the sequence
where the plain rewrite all-reduces them, and never a weight gathered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replicator as rp
from replicator.tensor import TensorParallel, TensorPlacementError

B, S, H, HEADS, F = 2, 8, 16, 4, 32
PLAN = {"*/wq": "column", "*/wk": "column", "*/wv": "column", "*/wo": "row", "*/fc1": "column", "*/fc2": "row"}


def _norm(x, g):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g


def _block(p, x):
    h = _norm(x, p["ln1"])
    q, k, v = (jnp.reshape(h @ p[n], (*h.shape[:2], HEADS, H // HEADS)) for n in ("wq", "wk", "wv"))
    a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 2.0, axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(x.shape) @ p["wo"]
    return x + jax.nn.gelu(_norm(x, p["ln2"]) @ p["fc1"]) @ p["fc2"]


def _loss(params, x):
    for p in params:
        x = _block(p, x)
    return jnp.mean(x**2)


def _step(params, x):
    loss, g = jax.value_and_grad(_loss)(params, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss


def _params(blocks=2):
    out = []
    for i in range(blocks):
        k = jax.random.split(jax.random.key(i), 6)
        out.append(
            {
                "ln1": jnp.linspace(0.5, 1.5, H),
                "ln2": jnp.ones(H),
                **{n: jax.random.normal(k[j], (H, H)) / 4 for j, n in enumerate(("wq", "wk", "wv", "wo"))},
                "fc1": jax.random.normal(k[4], (H, F)) / 4,
                "fc2": jax.random.normal(k[5], (F, H)) / 4,
            }
        )
    return out


X = jax.random.normal(jax.random.key(9), (B, S, H))


def _close(got, want, tol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = max(1.0, float(np.max(np.abs(b))))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=tol * scale)


@pytest.mark.parametrize("size", [2, 4])
def test_sequence_parallel_blocks_equal_one_device_and_move_activations_by_reduce_scatter_and_all_gather(size):
    params = _params()
    want = jax.jit(_step)(params, X)
    plain = TensorParallel(_step, PLAN, size=size)
    sp = TensorParallel(_step, PLAN, size=size, sequence_parallel=1)
    for tp in (plain, sp):
        _close(tp(tp.shard(params, X), X), want)
    activation = (B, S, H)
    plain_kinds = [c.kind for c in plain.collectives(params, X) if c.shape == activation]
    sp_kinds = [c.kind for c in sp.collectives(params, X) if c.shape == activation]
    # Plain: the all-reduces of Megatron's g (each block's two row-parallel outputs, forward) and f
    # (the input gradients of the column-parallel projections, backward; the first block's input is the
    # batch, whose gradient nobody reads): 2 + 2 forward, 2 + 1 backward.
    assert plain_kinds == ["all-reduce"] * 7
    # Sequence parallel: no activation is all-reduced. Forward (the first 7, in program order): each
    # row-parallel output reduce-scattered on the sequence, each column-parallel region's input gathered
    # (the first block's input is the whole batch: nothing to gather). Backward: each row-parallel
    # layer's output gradient gathered (the transpose of the forward's reduce-scatter, as in Megatron:
    # 2 per block), and the input gradient of each layer norm whose input is not the batch (3)
    # reduce-scattered once, where it is first read (as Megatron does, before the norm's backward): in
    # all Megatron's 4 reduce-scatters and 4 all-gathers per block, less the first block's input's.
    assert "all-reduce" not in sp_kinds
    assert sp_kinds[:7] == ["reduce-scatter", "all-gather"] * 3 + ["reduce-scatter"], sp_kinds
    assert sp_kinds.count("reduce-scatter") == 4 + 3 and sp_kinds.count("all-gather") == 3 + 4, sp_kinds
    weights = {(H, H), (H, F), (F, H)}
    assert not [c for c in sp.collectives(params, X) if c.kind == "all-gather" and c.shape in weights]


def test_a_sequence_split_activation_facing_a_split_weight_gathers_the_activation_not_the_weight():
    def step(p, x):
        h = _norm(x, p["g"]) @ p["w1"]  # x arrives whole; after a row-parallel sum it is split on the sequence
        y = x + h @ p["w2"]
        z = y @ p["w3"]  # y: split on the sequence; w3: split on its columns
        loss = jnp.mean(z**2)
        return p, loss

    p = {"g": jnp.ones(H), "w1": jnp.ones((H, F)) / H, "w2": jnp.ones((F, H)) / F, "w3": jnp.ones((H, F)) / H}
    plan = {"w1": "column", "w2": "row", "w3": "column"}
    tp = TensorParallel(step, plan, size=2, sequence_parallel=1)
    np.testing.assert_allclose(tp(tp.shard(p, X), X)[1], jax.jit(step)(p, X)[1], rtol=1e-5)
    gathers = [c.shape for c in tp.collectives(p, X) if c.kind == "all-gather"]
    assert gathers == [(B, S, H)]  # y, before w3; never w3 itself


def test_a_weight_is_never_gathered_under_sequence_parallelism():
    def step(p, x):
        return p, jnp.sum(jnp.sort(x @ p["w"], axis=-1))  # a sort over the split columns of a weight product

    p = {"w": jnp.ones((H, F))}
    tp = TensorParallel(step, {"w": "column"}, size=2, sequence_parallel=1)
    # The product is an activation: gathered (allowed under sequence parallelism), its weight never.
    np.testing.assert_allclose(tp(tp.shard(p, X), X)[1], jax.jit(step)(p, X)[1], rtol=1e-5)

    def weight_only(p, x):
        return p, jnp.sum(jnp.sort(p["w"], axis=-1)) + jnp.sum(x)

    with pytest.raises(TensorPlacementError, match="'sort'"):
        TensorParallel(weight_only, {"w": "column"}, size=2, sequence_parallel=1)(tp.shard(p, X), X)


def test_sequence_parallelism_inside_a_replicator_equals_one_device():
    def step(params, x):
        new, loss = _step(params, x)
        old = params
        g = jax.tree.map(lambda a, b: (a - b) / 0.1, old, new)  # the step's gradient back out
        return jax.tree.map(lambda a, b: a - 0.1 * b, old, rp.all_mean(g)), rp.all_mean(loss)

    repl = rp.Replicator(1, 8, parallelism=rp.Parallelism(tensor=2, tensor_plan=PLAN, sequence_parallel=1))
    xs = jax.random.normal(jax.random.key(3), (4 * B, S, H))  # 4 data replicas of B rows
    got, loss = repl.run(step, xs, _params())
    want, want_loss = jax.jit(_step)(_params(), xs)
    _close(got, want)
    np.testing.assert_allclose(np.asarray(loss), float(want_loss), rtol=1e-5)
    kinds = {c.kind for c in repl.lower(step, xs, _params()).final.tensor.collectives if c.shape == (B, S, H)}
    assert kinds == {"reduce-scatter", "all-gather"}
    with pytest.raises(ValueError, match="give tensor=T"):
        rp.Parallelism(sequence_parallel=1)
    with pytest.raises(ValueError, match="sequence dimension"):
        rp.Parallelism(tensor=2, tensor_plan=PLAN, sequence_parallel=True)


def test_an_output_computed_from_a_split_weight_alone_is_not_gathered_under_sequence_parallelism():
    """Sequence parallelism lets activations be gathered, not weights: returning a split weight's column
    sums whole would gather the weight (a mutation sample: the conversion of the step's outputs taken as
    an activation's)."""

    def step(p, x):
        return p, jnp.sum(p["w"], 0) + jnp.sum(x)

    p = {"w": jnp.ones((H, F))}
    with pytest.raises(TensorPlacementError, match="the step's outputs"):
        TensorParallel(step, {"w": "column"}, size=2, sequence_parallel=1)(
            TensorParallel(step, {"w": "column"}, size=2).shard(p), X
        )
