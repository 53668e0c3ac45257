"""``add_any`` of a partial sum and a replicated term (a value's cotangents accumulated, as in every
residual block's backward): the rewrite sums the partial part and adds the replicated term after it
(GSPMD's order), with no ``select`` on the device index; where the sum is used as a partial sum (a
linear consumer, a ``scan``, an output) the replicated term is folded in on one device instead.

Reference: ``jax.jit`` of the same step on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.ad_util import add_jaxvals as add_any  # the primitive JAX accumulates cotangents with

from replicator.tensor import TensorParallel

PLAN = {"w1": 1, "w2": 0}  # Megatron's MLP: fc1 column-split, fc2 row-split


def _params(h: int = 8, dtype=jnp.float32) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    return {
        "w1": (jax.random.normal(k1, (h, 4 * h)) / np.sqrt(h)).astype(dtype),
        "w2": (jax.random.normal(k2, (4 * h, h)) / np.sqrt(4 * h)).astype(dtype),
    }


def _input_grad(p: dict, x: jax.Array) -> jax.Array:
    """The gradient of a residual MLP block's loss with respect to its input: the residual's cotangent
    (replicated) plus fc1's transpose (a partial sum over the split hidden dimension)."""

    def loss(x):
        h = x + jnp.tanh(x @ p["w1"]) @ p["w2"]
        return jnp.sum(jnp.sin(h))

    return jax.grad(loss)(x)


USES = {
    # summed at once by a non-linear consumer: all-reduce, then the replicated term added
    "summed": lambda p, g: jnp.tanh(g),
    # kept partial through a linear consumer, then summed
    "scaled then summed": lambda p, g: jnp.tanh(3.0 * g - g),
    # returned as it is (a partial sum leaving the step)
    "returned": lambda p, g: g,
    # summed by one consumer, then accumulated with another partial sum and summed again
    "summed, then added to": lambda p, g: jnp.tanh(g) + jnp.cos(_input_grad(p, g) + g),
    # summed by one consumer, then accumulated with a replicated term (nothing left to sum) ...
    "summed, then add_any of a replicated term": lambda p, g: jnp.tanh(g) + jnp.tanh(add_any(g, jnp.cos(g))),
    # ... or with a partial sum (the summed value enters whole, only the new term is summed)
    "summed, then add_any of a partial sum": lambda p, g: (
        jnp.tanh(g) + jnp.tanh(add_any(g, jnp.tanh(g) @ p["w1"] @ p["w2"]))
    ),
    # carried through a scan
    "scanned": lambda p, g: lax.scan(lambda c, _: (jnp.tanh(c) + c, None), g, None, length=2)[0],
    # read by a matmul against a split weight (the matmul needs it whole)
    "matmul": lambda p, g: jnp.tanh(g @ p["w1"]) @ p["w2"],
}


def _step(use):
    def step(p, x):
        y = USES[use](p, _input_grad(p, x))
        return p, (y, jnp.tanh(y @ p["w1"]) @ p["w2"])  # each device's columns from its own copy of y

    return step


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("use", sorted(USES))
def test_a_cotangent_sum_equals_one_device(use, size):
    p = _params()
    x = jnp.cos(jnp.arange(6 * 8, dtype=jnp.float32).reshape(6, 8))
    step = _step(use)
    tp = TensorParallel(step, PLAN, size=size)
    got = tp(tp.shard(p, x), x)[1]
    for a, b in zip(got, jax.jit(step)(p, x)[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("size", [2, 4])
def test_a_cotangent_sum_that_is_summed_selects_nothing_on_the_device_index(size):
    p = _params()
    x = jnp.ones((6, 8), jnp.float32)
    tp = TensorParallel(_step("summed"), PLAN, size=size)
    text = tp.lower(p, x).as_text()
    assert "partition_id" not in text  # no device keeps the replicated term alone
    # one all-reduce for the forward's fc2 output, one for the input's cotangent, one for the step's
    # second output
    assert text.count('"stablehlo.all_reduce"') == 3


def test_a_residual_stack_sums_each_input_cotangent_once_and_never_selects():
    def loss(p, x):
        for w in p:
            x = x + jnp.tanh(x @ w["w1"]) @ w["w2"]
        return jnp.sum(x**2)

    def step(p, x):
        g = jax.grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss(p, x)

    p = [_params(), jax.tree.map(lambda a: a * 0.5, _params()), jax.tree.map(lambda a: -a, _params())]
    x = jnp.cos(jnp.arange(6 * 8, dtype=jnp.float32).reshape(6, 8))
    tp = TensorParallel(step, {"*/w1": 1, "*/w2": 0}, size=2)
    got = tp(tp.shard(p, x), x)
    want = jax.jit(step)(p, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    text = tp.lower(p, x).as_text()
    assert "partition_id" not in text
    # forward: 3 blocks' fc2 for the step's loss (its value) and 3 for the loss under grad; backward:
    # the input cotangents of the second and third blocks (the first block's input is not a parameter's).
    assert text.count('"stablehlo.all_reduce"') == 8


def test_a_0d_cotangent_sum():
    def step(p, x):
        def loss(x):
            return jnp.sin(x) + jnp.sum(jnp.tanh(x * p["w"]))

        return p, jnp.tanh(jax.grad(loss)(x))

    p = {"w": jnp.linspace(-1.0, 1.0, 8)}
    x = jnp.float32(0.3)
    tp = TensorParallel(step, {"w": 0}, size=2)
    got = tp(tp.shard(p, x), x)[1]
    assert got.shape == ()
    np.testing.assert_allclose(got, jax.jit(step)(p, x)[1], rtol=1e-6)


def test_a_bfloat16_cotangent_sum():
    p = _params(dtype=jnp.bfloat16)
    x = jnp.cos(jnp.arange(6 * 8, dtype=jnp.float32).reshape(6, 8)).astype(jnp.bfloat16)
    step = _step("summed")
    tp = TensorParallel(step, PLAN, size=2)
    got = tp(tp.shard(p, x), x)[1]
    for a, b in zip(got, jax.jit(step)(p, x)[1], strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=0, atol=3e-2)
