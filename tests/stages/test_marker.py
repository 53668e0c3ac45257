"""``rp.stage_boundary``: the identity on one device, a marker in the forward and, transposed, in the backward.

Numbers are checked against the same function without the marker (plain JAX: an independent
reference, since the marker's only job is to be the identity); graphs by counting markers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import replicator as rp
from replicator.core.jaxprs import iter_eqns
from replicator.core.primitives import stage_boundary_p


@pytest.fixture(autouse=True)
def _checks():
    with jax.enable_checks(True):
        yield


def markers(fn, *args) -> list[bool]:
    """The ``transposed`` flag of every marker in ``fn``'s jaxpr, sub-jaxprs included, in order."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [e.params["transposed"] for e in iter_eqns(jaxpr) if e.primitive is stage_boundary_p]


def mlp(params, x, mark=True):
    sb = rp.stage_boundary if mark else (lambda t: t)
    h = jnp.tanh(x @ params[0])
    h = sb(h)
    h = jnp.tanh(h @ params[1])
    h, x2 = sb((h, 2 * x))  # a pytree: one marker for both leaves
    return jnp.mean((h @ params[2]) ** 2) + 0.1 * jnp.mean(x2)


PARAMS = [
    np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    np.linspace(-0.5, 0.7, 16, dtype=np.float32).reshape(4, 4),
    np.linspace(0.3, -0.4, 8, dtype=np.float32).reshape(4, 2),
]
X = np.linspace(-2, 2, 15, dtype=np.float32).reshape(5, 3)


def reference_grad(params, x):
    return jax.grad(lambda p, x: mlp(p, x, mark=False))(params, x)


def assert_trees_close(got, want, tol=1e-6):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


class TestGraph:
    def test_forward_then_transposed_in_backward(self):
        # Two forward markers, and one transposed marker per boundary the gradient crosses back.
        assert markers(jax.grad(mlp), PARAMS, X) == [False, False, True, True]

    def test_pytree_is_one_marker(self):
        jaxpr = jax.make_jaxpr(lambda a, b: rp.stage_boundary({"a": a, "b": (b, b)}))(1.0, 2.0).jaxpr
        (eqn,) = jaxpr.eqns
        assert eqn.primitive is stage_boundary_p and len(eqn.invars) == 3

    def test_no_leaves_no_marker(self):
        assert rp.stage_boundary(()) == () and rp.stage_boundary(None) is None

    def test_transpose_flips_the_flag(self):
        x = jnp.ones(3)
        once = jax.linear_transpose(rp.stage_boundary, x)
        twice = jax.linear_transpose(lambda c: once(c)[0], x)
        assert markers(once, x) == [True]
        assert markers(twice, x) == [False]

    def test_under_jit_and_checkpoint(self):
        assert markers(jax.grad(jax.jit(mlp)), PARAMS, X).count(True) == 2
        flags = markers(jax.grad(jax.checkpoint(mlp)), PARAMS, X)
        assert flags.count(True) == 2 and flags.count(False) >= 2  # the forward, and its recomputation


class TestNumbers:
    def test_eager_and_jit_identity(self):
        tree = {"a": jnp.arange(3.0), "b": jnp.int32(7)}
        for fn in (rp.stage_boundary, jax.jit(rp.stage_boundary)):
            out = fn(tree)
            assert out["b"].dtype == jnp.int32
            assert_trees_close(out, tree, tol=0)

    @pytest.mark.parametrize(
        "transform",
        [
            lambda f: f,
            jax.jit,
            jax.checkpoint,
            lambda f: jax.jit(jax.checkpoint(f)),
        ],
        ids=["plain", "jit", "checkpoint", "jit-checkpoint"],
    )
    def test_grad_equals_unmarked(self, transform):
        got = jax.grad(transform(mlp))(PARAMS, X)
        assert_trees_close(got, reference_grad(PARAMS, X))

    def test_vmap_of_grad(self):
        xs = np.stack([X, 2 * X, -X])
        got = jax.vmap(jax.grad(mlp), in_axes=(None, 0))(PARAMS, xs)
        want = [reference_grad(PARAMS, x) for x in xs]
        for i in range(3):
            assert_trees_close([g[i] for g in got], want[i])

    def test_vmap_unbatched_leaf(self):
        a, b = jax.vmap(lambda x, y: rp.stage_boundary((x, y)), in_axes=(0, None))(jnp.ones((4, 2)), jnp.arange(2.0))
        assert a.shape == (4, 2) and b.shape == (4, 2)

    def test_inside_scan(self):
        def scanned(params, x, mark=True):
            def body(h, w):
                h = jnp.tanh(h @ w)
                return (rp.stage_boundary(h) if mark else h), None

            h, _ = lax.scan(body, x @ params[0], jnp.stack([params[1], params[1]]))
            return jnp.mean(h**2)

        got = jax.grad(scanned)(PARAMS, X)
        assert_trees_close(got, jax.grad(lambda p, x: scanned(p, x, mark=False))(PARAMS, X))

    def test_second_order(self):
        f = lambda x: jnp.sum(jnp.sin(rp.stage_boundary(jnp.sin(x))) ** 2)  # noqa: E731
        g = lambda x: jnp.sum(jnp.sin(jnp.sin(x)) ** 2)  # noqa: E731
        x = jnp.linspace(-1, 1, 4)
        np.testing.assert_allclose(jax.hessian(f)(x), jax.hessian(g)(x), rtol=1e-6, atol=1e-6)

    def test_integer_leaf_under_grad(self):
        def f(w, ids):
            h, ids = rp.stage_boundary((w * 2.0, ids))
            return jnp.sum(h[ids])

        np.testing.assert_allclose(jax.grad(f)(jnp.ones(4), jnp.array([0, 0, 3])), [4.0, 0, 0, 2.0])

    def test_integer_leaf_with_float0_tangent(self):
        ids = jnp.array([0, 2])
        tangent_ids = np.zeros(ids.shape, jax.dtypes.float0)
        (h, out_ids), (th, t_ids) = jax.jvp(
            rp.stage_boundary, ((jnp.ones(2), ids),), ((jnp.full(2, 3.0), tangent_ids),)
        )
        np.testing.assert_array_equal(out_ids, ids)
        np.testing.assert_allclose(th, [3.0, 3.0])
        assert t_ids.dtype == jax.dtypes.float0

    def test_data_parallel_run_ignores_it(self, repl):
        # A marked step runs unsplit under Replicator.run: the marker is the identity there too.
        n = repl.num_replicas

        def step_fn(w, batch):
            loss = lambda w: mlp(w, batch["x"])  # noqa: E731
            g = rp.all_mean(jax.grad(loss)(w))
            return [a - 0.1 * b for a, b in zip(w, g, strict=True)], {}

        x = np.concatenate([X * (1 + r / n) for r in range(n)])
        w, _ = repl.run(step_fn, lambda ctx: iter([{"x": x}]), PARAMS)
        # Reference: one device on the global batch (mean of the per-replica mean losses).
        g = jax.grad(lambda p: jnp.mean(jnp.stack([mlp(p, xr, mark=False) for xr in np.split(x, n)])))(PARAMS)
        assert_trees_close(w, [a - 0.1 * b for a, b in zip(PARAMS, g, strict=True)], tol=1e-5)
