"""Tensor parallelism from the one-device step, against ``jax.jit`` of that step on one device.

Each test splits some parameters over a tensor axis of T = 2 and 4 emulated
devices and checks the whole new state (parameters and optimizer moments) and
the loss against the same step on one device, within 1e-5 relative to each
leaf's largest value; and what the rewrite inserted: the all-reduces of
Megatron's conjugate operators, no gather, split leaves held 1/T per device.
"""

from __future__ import annotations

import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from replicator.tensor import REPLICATED, Shard, TensorParallel, TensorPlacementError, TensorPlan
from replicator.tensor.parallelize import sent_bytes

DEGREES = [2, 4]


def _close(got, want, tol=1e-5):
    for path, (a, b) in zip(
        jax.tree_util.tree_flatten_with_path(want)[0],
        zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True),
        strict=True,
    ):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, path[0]
        scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
        err = float(np.max(np.abs(a - b))) if b.size else 0.0
        assert err <= tol * scale, (path[0], err)


def _mlp_params(key, h=16, f=64, blocks=2):
    ks = jax.random.split(key, 2 * blocks)
    return [
        {
            "fc1": {"kernel": jax.random.normal(ks[2 * i], (h, f)) / 4, "bias": jnp.full((f,), 0.1)},
            "fc2": {"kernel": jax.random.normal(ks[2 * i + 1], (f, h)) / 8, "bias": jnp.zeros((h,))},
            "scale": jnp.ones((h,)),
        }
        for i in range(blocks)
    ]


def _mlp_loss(params, x, y):
    for p in params:
        z = x * p["scale"]
        hidden = jax.nn.gelu(z @ p["fc1"]["kernel"] + p["fc1"]["bias"])
        x = x + hidden @ p["fc2"]["kernel"] + p["fc2"]["bias"]
    return jnp.mean((x - y) ** 2)


def _train_step(loss_fn, opt):
    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


MLP_PLAN = {"0/*/fc1/kernel": "column", "0/*/fc2/kernel": "row"}


@pytest.mark.parametrize("size", DEGREES)
def test_a_two_block_mlp_with_adamw_and_clipping_equals_one_device(size):
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    params = _mlp_params(jax.random.PRNGKey(0))
    state = (params, opt.init(params))
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    batch = (jax.random.normal(k1, (8, 16)), jax.random.normal(k2, (8, 16)))
    step = _train_step(_mlp_loss, opt)
    tp = TensorParallel(step, MLP_PLAN, size=size)
    want_state, want_loss = state, None
    got_state = tp.shard(state, batch)
    for _ in range(3):
        want_state, want_loss = jax.jit(step)(want_state, batch)
        got_state, got_loss = tp(got_state, batch)
    _close(got_state, want_state)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)

    # The plan's leaves, and the unnamed ones whose update comes out split (biases, Adam's moments).
    pl = tp.placements(state, batch)
    assert pl["0/0/fc1/kernel"] == Shard(1) and pl["0/1/fc2/kernel"] == Shard(0)
    assert pl["0/0/fc1/bias"] == Shard(0)
    assert pl["1/1/0/mu/0/fc1/kernel"] == Shard(1) and pl["1/1/0/nu/1/fc2/kernel"] == Shard(0)
    assert pl["0/0/fc2/bias"] == REPLICATED and pl["0/0/scale"] == REPLICATED
    # Held 1/T per device, in and out.
    kernel = got_state[0][0]["fc1"]["kernel"]
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 64 // size)}


def test_megatrons_all_reduces_fall_out_of_the_rules():
    """Per block, one all-reduce of the activations forward (g) and one backward (f's transpose).

    The first block's input is the batch, whose gradient nobody reads: its backward all-reduce is
    not made. A block's ``scale`` gradient is a partial sum reduced once, on its own. Nothing is
    gathered.
    """

    def step(params, batch):
        loss, grads = jax.value_and_grad(_mlp_loss)(params, *batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    params = _mlp_params(jax.random.PRNGKey(0))
    batch = (jnp.ones((8, 16)), jnp.zeros((8, 16)))
    tp = TensorParallel(step, {"*/fc1/kernel": "column", "*/fc2/kernel": "row"}, size=2)
    events = tp.collectives(params, batch)
    activations = [e for e in events if e.shape == (8, 16)]
    assert [e.kind for e in activations] == ["all-reduce"] * 3, events
    # Megatron's count: 2(T-1)/T of b x h elements per all-reduce, 4 bytes each.
    assert sum(sent_bytes(e, 2) for e in activations) == 3 * (2 * 1 / 2) * 8 * 16 * 4
    report = tp.explain(params, batch)
    assert report.count("all-reduce") == len(events) and "0/fc1/kernel S(1)" in report
    assert "test_parallelize.py" in report and "temporaries" in report
    assert not [e for e in events if e.kind == "all-gather"]
    assert all(e.kind == "all-reduce" for e in events)
    _close(tp(tp.shard(params, batch), batch), jax.jit(step)(params, batch))
    # The compiled program has exactly these all-reduces over the tensor axis.
    text = tp.lower(params, batch).as_text()
    assert text.count("stablehlo.all_reduce") == len(events)
    assert "all_gather" not in text


def _attention_loss(params, x, y, heads=4):
    b, s, h = x.shape
    q = (x @ params["wq"]).reshape(b, s, heads, h // heads)
    k = (x @ params["wk"]).reshape(b, s, heads, h // heads)
    v = (x @ params["wv"]).reshape(b, s, heads, h // heads)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(h // heads)
    mask = jnp.tril(jnp.ones((s, s), bool))
    weights = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, h)
    x = x + out @ params["wo"]
    mean = x.mean(-1, keepdims=True)
    x = (x - mean) * lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
    return jnp.mean((x - y) ** 2)


@pytest.mark.parametrize("size", DEGREES)
def test_attention_heads_split_by_a_reshape_of_a_column_split(size):
    ks = jax.random.split(jax.random.PRNGKey(2), 6)
    h = 16
    params = {n: jax.random.normal(k, (h, h)) / 4 for n, k in zip(["wq", "wk", "wv", "wo"], ks, strict=False)}
    batch = (jax.random.normal(ks[4], (2, 6, h)), jax.random.normal(ks[5], (2, 6, h)))
    opt = optax.adam(1e-2)
    step = _train_step(_attention_loss, opt)
    state = (params, opt.init(params))
    plan = {"0/wq": "column", "0/wk": "column", "0/wv": "column", "0/wo": "row"}
    tp = TensorParallel(step, plan, size=size)
    _close(tp(tp.shard(state, batch), batch), jax.jit(step)(state, batch))
    assert not [e for e in tp.collectives(state, batch) if e.kind == "all-gather"]


@pytest.mark.parametrize("size", DEGREES)
def test_a_stack_of_layers_under_lax_scan(size):
    layers, h, f = 3, 8, 32
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    params = {"w1": jax.random.normal(ks[0], (layers, h, f)) / 3, "w2": jax.random.normal(ks[1], (layers, f, h)) / 6}

    def loss_fn(p, x, y):
        def layer(x, w):
            return x + jnp.tanh(x @ w[0]) @ w[1], None

        x, _ = lax.scan(layer, x, (p["w1"], p["w2"]))
        return jnp.mean((x - y) ** 2)

    opt = optax.sgd(0.1, momentum=0.9)
    step = _train_step(loss_fn, opt)
    state = (params, opt.init(params))
    batch = (jax.random.normal(ks[2], (4, h)), jax.random.normal(ks[3], (4, h)))
    tp = TensorParallel(step, {"0/w1": "column", "0/w2": "row"}, size=size)
    _close(tp(tp.shard(state, batch), batch), jax.jit(step)(state, batch))
    assert tp.placements(state, batch)["1/0/trace/w1"] == Shard(2)


def test_a_sharded_carry_of_a_while_loop_and_a_cond():
    def step(p, x):
        w = p["w"]

        def body(i, h):
            return jnp.tanh(h * w + i)

        h = lax.fori_loop(0, 3, body, x @ jnp.ones((4, 8)) + w)
        h = lax.cond(x.sum() > 0, lambda h: h * 2, lambda h: h - 1, h)
        return {"w": w - 0.1 * h.sum(0)}, jnp.sum(h)

    p = {"w": jnp.linspace(-1, 1, 8)}
    x = jnp.ones((3, 4))
    tp = TensorParallel(step, TensorPlan({"w": 0}), size=2)
    _close(tp(tp.shard(p, x), x), jax.jit(step)(p, x))
    assert not [e for e in tp.collectives(p, x) if e.kind == "all-gather"]


def test_a_value_that_would_be_gathered_is_refused_naming_the_line_unless_allowed():
    def step(p, x):
        hidden = x @ p["w"]  # split on its last dimension: returning it whole needs a gather
        return p, hidden

    p = {"w": jnp.ones((4, 8))}
    x = jnp.ones((2, 4))
    tp = TensorParallel(step, {"w": "column"}, size=2)
    with pytest.raises(TensorPlacementError, match="allow_gather"):
        tp(tp.shard(p, x), x)
    allowed = TensorParallel(step, {"w": "column"}, size=2, allow_gather=True)
    _close(allowed(allowed.shard(p, x), x), jax.jit(step)(p, x))
    assert [e.kind for e in allowed.collectives(p, x)] == ["all-gather"]


def test_a_softmax_over_a_split_dimension_is_a_max_and_a_sum_over_the_tensor_axis():
    """A vocabulary-split head: log-softmax over the split logits is exact with a pmax and a psum."""

    def step(p, batch):
        x, labels = batch

        def loss_fn(p):
            logits = x @ p["head"]
            return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(labels, 16), -1))

        loss, g = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, b: a - 0.5 * b, p, g), loss

    p = {"head": jax.random.normal(jax.random.PRNGKey(4), (8, 16))}
    batch = (jax.random.normal(jax.random.PRNGKey(5), (4, 8)), jnp.array([0, 5, 9, 15]))
    tp = TensorParallel(step, {"head": "column"}, size=4)
    _close(tp(tp.shard(p, batch), batch), jax.jit(step)(p, batch))
    kinds = {e.kind for e in tp.collectives(p, batch)}
    assert "all-reduce-max" in kinds and "all-gather" not in kinds


def test_a_partial_sum_carried_into_a_split_carry_is_reduce_scattered():
    """A scan whose carry enters split (column) and comes out of each layer a partial sum (row)."""

    def step(p, x):
        def layer(c, _):
            return jnp.tanh(c) @ p["w2"], None

        c, _ = lax.scan(layer, x @ p["w1"], None, length=3)
        return p, jnp.sum(jnp.tanh(c))

    ks = jax.random.split(jax.random.PRNGKey(6), 3)
    p = {"w1": jax.random.normal(ks[0], (4, 8)), "w2": jax.random.normal(ks[1], (8, 8)) / 3}
    x = jax.random.normal(ks[2], (2, 4))
    for size in DEGREES:
        tp = TensorParallel(step, {"w1": "column", "w2": "row"}, size=size)
        _close(tp(tp.shard(p, x), x), jax.jit(step)(p, x))
        assert "reduce-scatter" in [e.kind for e in tp.collectives(p, x)]


def test_shard_without_a_batch_places_the_plans_leaves_and_replicates_the_rest():
    tp = TensorParallel(lambda p, x: (p, x), {"w": "column"}, size=2)
    placed = tp.shard({"w": jnp.ones((4, 8)), "b": jnp.ones(8)})
    assert {s.data.shape for s in placed["w"].addressable_shards} == {(4, 4)}
    assert {s.data.shape for s in placed["b"].addressable_shards} == {(8,)}


def test_on_one_device_nothing_is_inserted():
    opt = optax.adamw(1e-2)
    params = _mlp_params(jax.random.PRNGKey(0), blocks=1)
    state = (params, opt.init(params))
    batch = (jnp.ones((8, 16)), jnp.zeros((8, 16)))
    step = _train_step(_mlp_loss, opt)
    tp = TensorParallel(step, MLP_PLAN, size=1)
    _close(tp(state, batch), jax.jit(step)(state, batch))
    assert tp.collectives(state, batch) == []


def test_bfloat16_parameters_keep_their_dtype_and_match_one_device_within_bfloat16s_precision():
    def step(p, batch):
        x, y = batch
        loss, g = jax.value_and_grad(lambda p: _mlp_loss(p, x, y))(p)
        return jax.tree.map(lambda a, b: (a - 0.1 * b).astype(a.dtype), p, g), loss

    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _mlp_params(jax.random.PRNGKey(7), blocks=1))
    batch = (jnp.ones((8, 16), jnp.bfloat16), jnp.zeros((8, 16), jnp.bfloat16))
    tp = TensorParallel(step, {"*/fc1/kernel": "column", "*/fc2/kernel": "row"}, size=2)
    got, want = tp(tp.shard(params, batch), batch), jax.jit(step)(params, batch)
    assert {a.dtype for a in jax.tree.leaves(got[0])} == {jnp.dtype(jnp.bfloat16)}
    _close(got, want, tol=2e-2)  # a partial sum of bfloat16 rounds each summand: 2^-7 relative


def test_the_step_and_the_machine_are_checked_with_clear_errors():
    with pytest.raises(TensorPlacementError, match="needs 64 devices; there are"):
        TensorParallel(lambda p, x: (p, x), {}, size=64)
    tp = TensorParallel(lambda p, x: ({"other": p["w"]}, x), {"w": 0}, size=2)
    with pytest.raises(TensorPlacementError, match="new_state of the state's structure"):
        tp({"w": jnp.ones(4)}, jnp.ones(2))


def _tied_lm_loss(p, ids, labels):
    """A tiny language model with tied embeddings: lookup, one MLP block, logits by the table's transpose."""
    x = p["embed"][ids] + p["pos"]
    x = x + jax.nn.gelu(x @ p["fc1"]) @ p["fc2"]
    logits = x @ p["embed"].T
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))


@pytest.mark.parametrize("size", DEGREES)
@pytest.mark.parametrize("split", ["vocab", "hidden"])
def test_a_tied_embedding_split_over_the_vocabulary_or_the_hidden_dimension(size, split):
    ks = jax.random.split(jax.random.PRNGKey(8), 6)
    v, h, s = 32, 16, 6
    params = {
        "embed": jax.random.normal(ks[0], (v, h)) / 4,
        "pos": jax.random.normal(ks[1], (s, h)) / 4,
        "fc1": jax.random.normal(ks[2], (h, 4 * h)) / 4,
        "fc2": jax.random.normal(ks[3], (4 * h, h)) / 8,
    }
    ids = jax.random.randint(ks[4], (2, s), 0, v)
    labels = jax.random.randint(ks[5], (2, s), 0, v)
    opt = optax.sgd(0.1, momentum=0.9)
    step = _train_step(_tied_lm_loss, opt)
    state = (params, opt.init(params))
    embed = 0 if split == "vocab" else 1
    # A hidden-split table gives hidden-split activations, which a column-split fc1 cannot take
    # without gathering them (refused: see the next test); the MLP stays whole then.
    plan = {"0/embed": embed, "0/fc1": "column", "0/fc2": "row"} if split == "vocab" else {"0/embed": 1}
    tp = TensorParallel(step, plan, size=size)
    got, want = tp.shard(state, (ids, labels)), state
    for _ in range(2):
        got, got_loss = tp(got, (ids, labels))
        want, want_loss = jax.jit(step)(want, (ids, labels))
    _close(got, want)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert tp.placements(state, (ids, labels))["0/embed"] == Shard(embed)
    assert "all-gather" not in {e.kind for e in tp.collectives(state, (ids, labels))}


def test_a_plan_whose_splits_disagree_is_refused_at_trace_time_naming_the_line():
    """Activations split on the hidden dimension (by the table) meet a matrix split on its output."""
    params = {
        "embed": jnp.ones((32, 16)),
        "pos": jnp.ones((6, 16)),
        "fc1": jnp.ones((16, 64)),
        "fc2": jnp.ones((64, 16)),
    }
    ids = jnp.zeros((2, 6), jnp.int32)

    def step(p, batch):
        return p, _tied_lm_loss(p, *batch)

    tp = TensorParallel(step, {"embed": 1, "fc1": "column"}, size=2)
    with pytest.raises(TensorPlacementError, match=r"test_parallelize.py:\d+ \(_tied_lm_loss\): 'dot_general'") as e:
        tp(params, (ids, ids))
    assert "Its operands are computed from: embed, fc1, pos, the batch." in str(e.value)


def test_heads_the_degree_does_not_divide_are_refused_saying_so():
    h = 12  # 6 heads of 2: a column split over 4 devices splits the hidden dimension, not whole heads

    def step(p, x):
        q = (x @ p["wq"]).reshape(2, 3, 6, 2)
        return p, jnp.sum(jnp.tanh(q))

    tp = TensorParallel(step, {"wq": "column"}, size=4)
    with pytest.raises(TensorPlacementError, match=r"\(2, 3, 12\) -> \(2, 3, 6, 2\).*degree 4 does not divide") as e:
        tp({"wq": jnp.ones((h, h))}, jnp.ones((2, 3, h)))
    assert "computed from: the batch, wq." in str(e.value)


def test_a_scan_carry_split_on_another_dimension_by_each_iteration_is_carried_whole():
    """The carry enters split on its columns and each iteration transposes it (split on its rows): the
    iterations disagree, so it is carried whole (a fixed point that must settle; a mutation sample showed
    no test had one)."""
    k = 8

    def step(p, x):
        c = x @ p["w"]  # (k, k), split on its columns

        def body(c, _):
            return jnp.tanh(c.T) * 0.9, None

        out, _ = jax.lax.scan(body, c, None, length=3)
        return p, jnp.sum(out * jnp.arange(k * k, dtype=out.dtype).reshape(k, k))

    p = {"w": jax.random.normal(jax.random.PRNGKey(3), (k, k)) / 3}
    x = jax.random.normal(jax.random.PRNGKey(4), (k, k))
    for size in DEGREES:
        tp = TensorParallel(step, {"w": "column"}, size=size, allow_gather=True)
        np.testing.assert_allclose(tp(tp.shard(p, x), x)[1], jax.jit(step)(p, x)[1], rtol=1e-5)


def _python_calls(fn) -> int:
    """How many Python functions ``fn()`` enters (C functions and the jitted call's C++ path not counted)."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls


def test_a_call_of_a_built_step_reads_each_leafs_shape_and_dtype_and_calls_nothing_else_per_leaf():
    # The step runs every iteration: its cache key is each leaf's shape and dtype read as they are (two
    # property reads of a jax Array), not computed by Python calls per leaf (np.shape and str(dtype) made
    # 12 calls per leaf, 105 us per call at 27 leaves: 1-4% of bench_tensor.py's step on 2 cores).
    def step(state, x):
        return jax.tree.map(lambda w: w * 0.5, state), jnp.sum(x @ state["w0"])

    counts = {}
    for n in (2, 40):
        state = {f"w{i}": jnp.ones((4, 8)) for i in range(n)}
        tp = TensorParallel(step, {"w0": "column"}, size=2)
        placed = tp.shard(state, jnp.ones((3, 4)))
        x = jax.device_put(jnp.ones((3, 4)), NamedSharding(tp.mesh, PartitionSpec()))
        for _ in range(2):  # built, then on the jitted call's C++ path
            jax.block_until_ready(tp(placed, x))
        counts[n] = _python_calls(lambda tp=tp, placed=placed, x=x: tp(placed, x))
    assert counts[40] - counts[2] <= 2 * 38, counts
