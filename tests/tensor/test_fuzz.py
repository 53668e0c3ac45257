"""Random programs over split parameters, against one device (a property, Hypothesis).

Each example draws a chain of operations on an activation (matmuls by two
parameters, element-wise functions, reductions that broadcast back, reshapes
that split and merge a dimension, a softmax, a cumulative sum, a roll by
slices and a concatenation, a ``scan``), splits each parameter on a drawn
dimension (or not) over T = 2 or 4 devices, and checks one SGD step's new
parameters and loss against ``jax.jit`` of the same step on one device. Gathers
are allowed, so every conversion the rules ask for is exercised; the numbers
must hold whatever they are.

``REPLICATOR_TENSOR_FUZZ=N`` runs N examples per degree (default 12; the
examples are derandomized, so CI always runs the same ones);
``REPLICATOR_TENSOR_FUZZ_RANDOM=1`` draws new ones on every run.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

from replicator.tensor import TensorParallel

N, K = 4, 8
EXAMPLES = int(os.environ.get("REPLICATOR_TENSOR_FUZZ", "12"))
RANDOM = os.environ.get("REPLICATOR_TENSOR_FUZZ_RANDOM") == "1"


def _heads(v):
    return jnp.repeat(v.reshape(N, 2, K // 2).sum(2), K // 2, axis=1) / K


OPS = {
    "mm1": lambda v, p: v @ p["w1"],
    "mm2": lambda v, p: v @ p["w2"].T,
    "tanh": lambda v, p: jnp.tanh(v),
    "square": lambda v, p: v * v * 0.5,
    "affine": lambda v, p: v * 0.5 + 0.25,
    "center": lambda v, p: v - v.mean(1, keepdims=True),
    "softmax": lambda v, p: jax.nn.softmax(v, axis=1),
    "heads": lambda v, p: _heads(v),
    "transpose": lambda v, p: (v.T * 1.5).T,
    "cumsum": lambda v, p: jnp.cumsum(v, 0) / N,
    "colmax": lambda v, p: v - v.max(0, keepdims=True),
    "roll": lambda v, p: jnp.concatenate([v[:, K // 2 :], v[:, : K // 2]], 1),
    "scan": lambda v, p: lax.scan(lambda c, _: (jnp.tanh(c @ p["w1"]), None), v, None, length=2)[0],
    "split_merge": lambda v, p: (v.reshape(N, 2, K // 2) * jnp.arange(1.0, 3.0)[None, :, None]).reshape(N, K),
}


def _program(ops):
    def loss_fn(p, x):
        v = x
        for name in ops:
            v = OPS[name](v, p)
        return jnp.sum(v * v)

    def step(p, x):
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), loss

    return step


@pytest.mark.parametrize("size", [2, 4])
def test_random_programs_over_split_parameters_equal_one_device(size):
    params = {
        "w1": jax.random.normal(jax.random.PRNGKey(0), (K, K)) / 3,
        "w2": jax.random.normal(jax.random.PRNGKey(1), (K, K)) / 3,
    }
    x = jax.random.normal(jax.random.PRNGKey(2), (N, K))

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        ops=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=6),
        d1=st.sampled_from([None, 0, 1]),
        d2=st.sampled_from([None, 0, 1]),
    )
    def check(ops, d1, d2):
        plan = {name: d for name, d in (("w1", d1), ("w2", d2)) if d is not None}
        if not plan:
            plan = {"w1": "replicated"}
        step = _program(ops)
        tp = TensorParallel(step, plan, size=size, allow_gather=True)
        got = tp(tp.shard(params, x), x)
        want = jax.jit(step)(params, x)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            scale = max(1.0, float(np.max(np.abs(b))))
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * scale, err_msg=f"{ops} {plan}")

    check()


def test_two_scans_over_the_same_split_parameter():
    """Found by the random programs: a conversion made inside the first scan's body was reused by the
    second (a tracer of the first body's trace, leaked)."""
    step = _program(["scan", "scan"])
    params = {"w1": jax.random.normal(jax.random.PRNGKey(0), (K, K)) / 3, "w2": jnp.eye(K)}
    x = jax.random.normal(jax.random.PRNGKey(2), (N, K))
    tp = TensorParallel(step, {"w1": 0}, size=2, allow_gather=True)
    for a, b in zip(
        jax.tree.leaves(tp(tp.shard(params, x), x)), jax.tree.leaves(jax.jit(step)(params, x)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * max(1.0, float(np.max(np.abs(b)))))
