"""The placement rules on graphs: what each primitive gives, and that the local program computes it.

The analysis (``interpret.analyze``) is checked on small functions; the reshape
rule also on numbers, over shape pairs that split and merge dimensions, under
``shard_map`` against one device.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from replicator.tensor import PARTIAL, REPLICATED, Shard, TensorParallel
from replicator.tensor.interpret import analyze

R, P = REPLICATED, PARTIAL


def _analyze(fn, shapes, placements, size=2):
    closed = jax.make_jaxpr(fn)(*[jnp.ones(s) for s in shapes])
    return analyze(closed.jaxpr, placements, size=size)


def test_column_then_row_is_one_partial_sum():
    got = _analyze(lambda x, a, b: jnp.tanh(x @ a) @ b, [(4, 8), (8, 16), (16, 8)], [R, Shard(1), Shard(0)])
    assert got == [P]


@pytest.mark.parametrize(
    ("lhs", "rhs", "want"),
    [
        (R, Shard(0), P),  # contracting split on one side: the other is sliced, the result partial
        (Shard(1), Shard(0), P),
        (Shard(0), R, Shard(0)),  # a free dimension: the result split there
        (R, Shard(1), Shard(1)),
        (P, R, P),  # bilinear: a partial operand against a whole one stays partial
        (P, Shard(1), Shard(1)),  # ... against a split one is summed first
    ],
)
def test_dot_general(lhs, rhs, want):
    assert _analyze(jnp.matmul, [(4, 8), (8, 6)], [lhs, rhs]) == [want]


def test_a_batch_dimension_split_on_both_sides_stays_split():
    fn = lambda a, b: jnp.einsum("hqd,hkd->hqk", a, b)  # noqa: E731
    assert _analyze(fn, [(4, 3, 2), (4, 5, 2)], [Shard(0), R]) == [Shard(0)]


def test_reductions_over_a_split_dimension():
    assert _analyze(lambda x: x.sum(1), [(4, 8)], [Shard(1)]) == [P]
    assert _analyze(lambda x: x.sum(0), [(4, 8)], [Shard(1)]) == [Shard(0)]
    assert _analyze(lambda x: x.max(1), [(4, 8)], [Shard(1)]) == [R]  # a pmax after the local max
    assert _analyze(lambda x: jnp.exp(x).sum(), [(4, 8)], [P]) == [R]  # exp of a partial sum: summed first


def test_a_partial_sum_is_summed_before_a_max_and_kept_through_a_sum_or_a_cumulative_sum():
    assert _analyze(lambda x: x.max(1), [(4, 8)], [P]) == [R]
    assert _analyze(lambda x: x.sum(1), [(4, 8)], [P]) == [P]
    assert _analyze(lambda x: jnp.cumsum(x, 1), [(4, 8)], [P]) == [P]
    assert _analyze(lambda x: jnp.cumprod(x, 1), [(4, 8)], [P]) == [R]
    assert _analyze(lambda x: x[::-1, ::-1], [(4, 8)], [P]) == [P]  # a reversal: a permutation, linear


def test_a_partial_sum_reversed_is_summed_once_after_the_reduction():
    """``rev`` keeps a partial sum (it permutes elements): a row-parallel matmul's output, reversed and
    summed over its rows, is all-reduced once at the (8,) sum, not at the (4, 8) reversal."""

    def step(p, x):
        return p, (x @ p["w"])[::-1].sum(0) * jnp.arange(8.0)

    p = {"w": jnp.cos(jnp.arange(128, dtype=jnp.float32).reshape(16, 8))}
    x = jnp.sin(jnp.arange(64, dtype=jnp.float32).reshape(4, 16))
    tp = TensorParallel(step, {"w": "row"}, size=2)
    np.testing.assert_allclose(tp(tp.shard(p, x), x)[1], jax.jit(step)(p, x)[1], rtol=1e-5)
    assert [(e.kind, e.shape) for e in tp.collectives(p, x)] == [("all-reduce", (8,))]


def test_cotangents_of_a_replicated_value_stay_replicated():
    # jax.grad of a value read twice accumulates two cotangents with add_any.
    assert _analyze(jax.grad(lambda x: jnp.sum(x * x)), [(4,)], [R]) == [R]


def test_a_while_carry_that_enters_whole_and_comes_out_split_is_carried_split():
    def fn(w):  # a traced condition: a while loop (static bounds make fori_loop a scan)
        return lax.while_loop(lambda c: c[0] < w[0] + 2, lambda c: (c[0] + 1, c[1] + w), (0.0, jnp.zeros(8)))[1]

    assert _analyze(fn, [(8,)], [Shard(0)]) == [Shard(0)]


def test_linear_primitives_keep_a_partial_sum_and_others_sum_it():
    assert _analyze(lambda x, y: -(x + y) * 3.0, [(4,), (4,)], [P, P]) == [P]
    assert _analyze(lambda x, y: x + y, [(4,), (4,)], [P, R]) == [R]
    assert _analyze(lambda x: jnp.tanh(x), [(4,)], [P]) == [R]
    assert _analyze(lambda x: x.astype(jnp.int32), [(4,)], [P]) == [R]  # truncation is not linear


def test_shape_primitives_move_the_split_dimension():
    assert _analyze(lambda x: x.T, [(4, 8)], [Shard(1)]) == [Shard(0)]
    assert _analyze(lambda x: x.reshape(2, 3, 4, 2), [(2, 3, 8)], [Shard(2)]) == [Shard(2)]
    assert _analyze(lambda x: x.reshape(2, 24), [(2, 3, 8)], [Shard(1)]) == [Shard(1)]
    assert _analyze(lambda x: x.reshape(2, 1, 8), [(2, 8)], [Shard(1)]) == [Shard(2)]  # not the new 1
    assert _analyze(lambda x: x.reshape(2, 24), [(2, 4, 6)], [Shard(2)]) == [R]  # not the leading factor
    assert _analyze(lambda x: x.reshape(2, 2, 2), [(8,)], [Shard(0)], size=4) == [R]  # 2 blocks of 4 devices
    assert _analyze(lambda x: jnp.broadcast_to(x, (3, 8)), [(8,)], [Shard(0)]) == [Shard(1)]
    assert _analyze(lambda x: x[:, :4], [(4, 8)], [Shard(1)]) == [R]
    assert _analyze(lambda x: x[:2], [(4, 8)], [Shard(1)]) == [Shard(1)]


def test_an_update_of_a_partial_sum_by_a_whole_value_is_summed_first():
    def fn(x, u):
        return lax.dynamic_update_slice_in_dim(x, u, 1, 0)

    assert _analyze(fn, [(4, 8), (1, 8)], [P, R]) == [R]
    assert _analyze(fn, [(4, 8), (1, 8)], [P, P]) == [P]
    assert _analyze(fn, [(4, 8), (4, 4)], [R, Shard(1)]) == [R]  # the update spans part of the dimension
    assert _analyze(fn, [(4, 8), (1, 8)], [R, Shard(1)]) == [Shard(1)]


def test_the_left_operands_split_decides_and_the_right_one_follows():
    assert _analyze(jnp.matmul, [(4, 8), (8, 6)], [Shard(1), Shard(1)]) == [P]  # right re-split on 0
    assert _analyze(jnp.matmul, [(4, 8), (8, 6)], [Shard(0), Shard(0)]) == [Shard(0)]  # right whole


def test_a_primitive_without_a_rule_gets_the_worst_case():
    assert _analyze(lambda x: jnp.sort(x, axis=0), [(4, 8)], [Shard(1)]) == [R]
    assert _analyze(lambda x: jnp.cumsum(x, axis=1), [(4, 8)], [Shard(1)]) == [R]
    assert _analyze(lambda x: jnp.cumsum(x, axis=0), [(4, 8)], [Shard(1)]) == [Shard(1)]


def test_a_scan_carry_that_comes_out_split_is_carried_split():
    def fn(x, w):
        return lax.scan(lambda c, wi: (c + wi, None), jnp.zeros_like(x), w)[0]

    assert _analyze(fn, [(4, 8), (3, 4, 8)], [R, Shard(2)]) == [Shard(1)]
    # A scan over the split dimension itself would need each step's slice whole: held whole.
    assert _analyze(fn, [(4, 8), (4, 4, 8)], [R, Shard(0)]) == [R]


def _settled(fn, *args, seconds=60.0):
    """``fn(*args)``, failing (instead of hanging the run) when it does not return within ``seconds``:
    a fixed point over a loop's carries that never settles."""
    out: list = []

    def target():
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # raised again in the test's thread
            out.append((False, e))

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"no result after {seconds:.0f} s: the carries' fixed point did not settle"
    ok, value = out[0]
    if not ok:
        raise value
    return value


@pytest.mark.parametrize("order", ["ABA", "AAB", "BAA"])
def test_branches_that_disagree_on_the_split_dimension_give_a_whole_value_in_any_order(order):
    """A ``switch`` whose branches return a value split on its columns (A) or, transposed, on its rows (B):
    two branches disagree, so the result is whole, whichever branch comes last (a branch that agrees with
    one of them does not split it again)."""
    branches = {"A": lambda w: w * 2.0, "B": lambda w: w.T}

    def fn(i, w):
        return lax.switch(i, [branches[c] for c in order], w)

    closed = jax.make_jaxpr(fn)(jnp.int32(0), jnp.ones((8, 8)))
    assert analyze(closed.jaxpr, [R, Shard(1)], size=2) == [R]

    def step(p, i):
        return p, fn(i, p["w"])

    p = {"w": jnp.sin(jnp.arange(64, dtype=jnp.float32).reshape(8, 8))}
    tp = TensorParallel(step, {"w": 1}, size=2, allow_gather=True)
    for i in range(3):
        got = tp(tp.shard(p, jnp.int32(i)), jnp.int32(i))[1]
        np.testing.assert_allclose(got, jax.jit(step)(p, jnp.int32(i))[1], rtol=1e-6)


def test_a_carry_held_whole_stays_whole_when_an_iteration_on_it_whole_would_split_it():
    """``c -> tanh(c @ w).T`` with ``w`` split on its columns: a whole carry comes out split on its rows,
    one split on its rows comes out split on its columns (the matmul keeps its left operand's split
    rather than gather the weight). The iterations disagree, so the carry is held whole; the next
    iteration, given it whole, splits it on its rows again, which must not undo that: the fixed point
    then cycles forever (rows, disagreement, rows, ...)."""

    def fn(w):
        return lax.scan(lambda c, _: (jnp.tanh(c @ w).T, None), jnp.zeros((8, 8)), None, length=3)[0]

    closed = jax.make_jaxpr(fn)(jnp.ones((8, 8)))
    assert _settled(lambda: analyze(closed.jaxpr, [Shard(1)], size=2)) == [R]

    def step(p, x):  # the carry does not come from the batch: an activation would be gathered instead
        return p, fn(p["w"] + 1.0) * x

    p = {"w": jnp.cos(jnp.arange(64, dtype=jnp.float32).reshape(8, 8)) / 4}
    tp = TensorParallel(step, {"w": 1}, size=2, allow_gather=True)
    got = _settled(tp, tp.shard(p, jnp.float32(1.5)), jnp.float32(1.5))[1]
    np.testing.assert_allclose(got, jax.jit(step)(p, jnp.float32(1.5))[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("shape", "split", "new"),
    [((2, 8, 3), 1, (2, 4, 2, 3)), ((2, 4, 2, 3), 1, (2, 8, 3)), ((4, 6), 0, (24,)), ((16,), 0, (4, 2, 2))],
)
@pytest.mark.parametrize("size", [2, 4])
def test_a_reshape_of_a_split_value_computes_one_devices_numbers(shape, split, new, size):
    if shape[split] % size:
        pytest.skip("the degree does not divide the dimension")

    def step(p, x):
        w = p["w"]
        moved = jnp.sin(w.reshape(new)) * x
        return {"w": moved.reshape(shape) + w}, jnp.sum(moved)

    p = {"w": jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) / 10}
    tp = TensorParallel(step, {"w": split}, size=size)
    got = tp(tp.shard(p, jnp.float32(2)), jnp.float32(2))
    want = jax.jit(step)(p, jnp.float32(2))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert "all-gather" not in [e.kind for e in tp.collectives(p, jnp.float32(2))]


# Each: a function of a (4, 8) value split on dimension 1, and the placement of its result.
ZOO = {
    "concatenate other dim": (lambda w: jnp.concatenate([w, w * 2], axis=0), Shard(1)),
    "concatenate split dim": (lambda w: jnp.concatenate([w, w], axis=1), R),
    "pad other dim": (lambda w: jnp.pad(w, ((1, 2), (0, 0))), Shard(1)),
    "pad split dim": (lambda w: jnp.pad(w, ((0, 0), (1, 0))), R),
    "dynamic_slice other dim": (lambda w: lax.dynamic_slice_in_dim(w, 1, 2, 0), Shard(1)),
    "dynamic_slice split dim": (lambda w: lax.dynamic_slice_in_dim(w, 2, 4, 1), R),
    "dynamic_slice traced start": (
        lambda w: lax.dynamic_slice_in_dim(w, jnp.sum(w > 100).astype(jnp.int32) + 1, 2, 0),
        Shard(1),
    ),
    "gather part of the split dim": (
        lambda w: lax.gather(
            w,
            jnp.array([[0], [2]]),
            lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)),
            slice_sizes=(1, 4),
        ),
        R,
    ),
    "gather whole rows": (lambda w: w[jnp.array([0, 2])], Shard(1)),
    # Collapses the split dimension without indexing it (each lookup takes its element 0): not a
    # vocabulary lookup, whose masked local form needs the indices to address the split dimension.
    "gather collapsing the split dim it does not index": (
        lambda w: lax.gather(
            w,
            jnp.array([[1], [3]]),
            lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0, 1), start_index_map=(0,)),
            slice_sizes=(1, 1),
        ),
        R,
    ),
    # A window of one element of the split dimension, neither indexed nor collapsed.
    "gather a size-1 window of the split dim": (
        lambda w: lax.gather(
            w,
            jnp.array([[1], [3]]),
            lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)),
            slice_sizes=(1, 1),
        ),
        R,
    ),
    "dynamic_update_slice": (lambda w: lax.dynamic_update_slice_in_dim(w, w[:1] * 3, 2, 0), Shard(1)),
    "dynamic_update_slice split dim": (lambda w: lax.dynamic_update_slice_in_dim(w, w[:, :2], 2, 1), R),
    "argmax other dim": (lambda w: jnp.argmax(w, axis=0), Shard(0)),
    "argmax split dim": (lambda w: jnp.argmax(w, axis=1), R),
    "cumsum other dim": (lambda w: jnp.cumsum(w, axis=0), Shard(1)),
    "cumsum split dim": (lambda w: jnp.cumsum(w, axis=1), R),
    "cumprod other dim": (lambda w: jnp.cumprod(w, axis=0), Shard(1)),
    "rev": (lambda w: w[::-1], Shard(1)),
    "squeeze": (lambda w: w[None][0], Shard(1)),
    "squeeze before the split dim": (lambda w: w.reshape(1, 4, 8).squeeze(0) + 1, Shard(1)),
    "select_n": (lambda w: jnp.where(w > 0.5, w, -w), Shard(1)),
    "clamp": (lambda w: jnp.clip(w, 0.2, 0.7), Shard(1)),
    "broadcast size-1 operand": (lambda w: w - w.mean(1, keepdims=True), Shard(1)),
    "min over split dim": (lambda w: w.min(1), R),
    "max over other dim": (lambda w: w.max(0), Shard(0)),
    "integer_pow": (lambda w: w**3, Shard(1)),
    "convert to int": (lambda w: (w * 10).astype(jnp.int32), Shard(1)),
    "sum then broadcast": (lambda w: w.sum(1, keepdims=True) * jnp.ones((4, 8)), P),
}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_primitive_zoo_placements_and_numbers(name):
    fn, want = ZOO[name]
    assert _analyze(fn, [(4, 8)], [Shard(1)]) == [want]

    def step(p, x):
        out = fn(p["w"] * x)
        return p, jnp.asarray(out, jnp.float32)

    p = {"w": jnp.sin(jnp.arange(32, dtype=jnp.float32).reshape(4, 8))}
    tp = TensorParallel(step, {"w": 1}, size=2, allow_gather=True)
    got = tp(tp.shard(p, jnp.float32(1.5)), jnp.float32(1.5))
    np.testing.assert_allclose(got[1], jax.jit(step)(p, jnp.float32(1.5))[1], rtol=1e-6, atol=1e-6)
    # What comes out whole was gathered once, at the end, or summed: nothing more.
    gathers = [e for e in tp.collectives(p, jnp.float32(1.5)) if e.kind == "all-gather"]
    assert len(gathers) <= 1
    assert (len(gathers) == 1) == (isinstance(want, Shard) or name in ZOO_GATHERED_INSIDE)


# Results that are whole because their input was gathered whole first (the split dimension is used).
ZOO_GATHERED_INSIDE = {
    "concatenate split dim",
    "pad split dim",
    "dynamic_slice split dim",
    "dynamic_update_slice split dim",
    "argmax split dim",
    "gather part of the split dim",
    "gather collapsing the split dim it does not index",
    "gather a size-1 window of the split dim",
    "cumsum split dim",
}


def test_a_jit_with_captured_constants_and_a_checkpoint_inside_the_step():
    # jit's body is a closed jaxpr holding the captured array as a constant; checkpoint's body is open.
    scale = jnp.linspace(0.5, 1.5, 16)

    def step(p, x):
        h = jax.jit(lambda a: jnp.tanh(a @ p["w1"]) * scale)(x)
        y = jax.checkpoint(lambda a: jnp.sin(a) * scale @ p["w2"])(h)
        return p, y

    p = {"w1": jnp.cos(jnp.arange(8 * 16, dtype=jnp.float32)).reshape(8, 16), "w2": jnp.ones((16, 8)) / 16}
    x = jnp.sin(jnp.arange(4 * 8, dtype=jnp.float32)).reshape(4, 8)
    tp = TensorParallel(step, {"w1": 1, "w2": 0}, size=2)
    np.testing.assert_allclose(tp(tp.shard(p, x), x)[1], jax.jit(step)(p, x)[1], rtol=1e-5, atol=1e-6)
