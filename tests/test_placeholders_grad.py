"""Gradients through the cross-replica placeholders against single-device JAX.

Convention: the gradient a replica computes of its own loss ``L_r`` through a
collective is the gradient of the *sum over replicas* ``sum_r L_r`` with
respect to its inputs (the transpose of a cross-replica sum is a cross-replica
sum). So the per-replica gradients, stacked, must equal ``jax.grad`` of the
equivalent global function ``G(X) = sum_r L_r(X)`` written with ``jax.numpy``
on the global (concatenated) batch.

Every test here runs with ``jax.enable_checks`` on, so tangents of the wrong
type (e.g. an int32 tangent for an int32 leaf) fail loudly.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.interpreters import ad
from utils import (
    CASES_BY_NAME,
    COLS,
    CONTEXTS,
    assert_matches,
    data,
    per_replica,
    reference,
    run_step,
)

import replicator as rp


@pytest.fixture(autouse=True)
def _checks():
    with jax.enable_checks(True):
        yield


def _ties(n: int, rows: int, seed: int = 0) -> np.ndarray:
    """A ``(n * rows, COLS)`` batch whose elements tie across replicas for the max
    and the min: small random integers, plus (for any n >= 2) an element where
    all n replicas tie, one where exactly two do, and one with a unique winner."""
    assert rows >= 2 and COLS >= 3
    xs = np.random.default_rng(seed).integers(0, 3, size=(n, rows, COLS)).astype(np.float32)
    xs[:, 0, 0], xs[:, 0, 1] = 5.0, -5.0  # all replicas tie (max / min)
    xs[:, 0, 2], xs[:, 1, :] = 0.0, 0.0
    xs[:2, 0, 2], xs[:2, 1, 0] = 7.0, -7.0  # two replicas tie
    xs[-1, 1, 1], xs[-1, 1, 2] = 7.0, -7.0  # a unique winner
    return xs.reshape(n * rows, COLS)


def _assert_close(got, want, atol: float = 1e-5) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)


# ----------------------------------------------------------------------------
# 4. Gradients through each collective, in several contexts
# ----------------------------------------------------------------------------

GRAD_CASES = [
    "all_sum",
    "all_mean",
    "all_max",
    "all_min",
    "all_gather",
    "all_gather_axis1",
    "all_gather_tiled",
    "all_gather_tiled_axis1",
    "broadcast_first",
    "broadcast_last",
    "reduce_scatter",
    "reduce_scatter_axis1",
]
# Transposes inside control flow: one case per primitive (and each transpose rule).
GRAD_CONTEXT_CASES = ["all_mean", "all_max", "all_gather_tiled", "broadcast_last", "reduce_scatter_axis1"]
GRAD_CONTEXTS = ["jit", "cond_true_branch", "cond_false_branch", "scan", "checkpoint"]


def _check_grad(repl: rp.Replicator, case_name: str, x: np.ndarray, context: str = "plain") -> None:
    """Per-replica grads of ``L_r(x) = sum(tanh(f(x)) * base) * (1 + r) + sum(x**2) / 2``
    against ``jax.grad`` of ``G(X) = sum_r L_r`` computed on the global batch."""
    case = CASES_BY_NAME[case_name]
    n = repl.num_replicas
    xs = per_replica(x, n)
    out_shape = reference(repl, case.ref, xs).shape[1:]
    base = data(out_shape, seed=11)
    weights = 1.0 + np.arange(n, dtype=np.float32)
    fn = CONTEXTS[context](lambda v: case.fn(v, None))

    def replica_loss(v):
        weight = 1.0 + rp.replica_id().astype(v.dtype)
        return jnp.sum(jnp.square(fn(v)) * base) * weight + 0.5 * jnp.sum(v**2)

    def step(b):
        loss, g = jax.value_and_grad(replica_loss)(b["x"])
        return {"loss": loss, "grad": g}

    def global_loss(xs):
        outs = reference(repl, case.ref, xs, xp=jnp)  # (n, *out_shape): replica r's value
        per_replica_terms = jnp.sum(jnp.square(outs) * base, axis=tuple(range(1, outs.ndim))) * weights
        return jnp.sum(per_replica_terms) + 0.5 * jnp.sum(xs**2)

    got = run_step(repl, step, {"x": x})
    want_loss, want_grad = jax.jit(jax.value_and_grad(global_loss))(xs)
    _assert_close(got["loss"].sum(), want_loss, atol=1e-4)
    _assert_close(got["grad"], want_grad)


@pytest.mark.parametrize("case_name", GRAD_CASES)
def test_grad_through_collective_matches_single_device(repl, case_name):
    n = repl.num_replicas
    _check_grad(repl, case_name, data((n * n, COLS), seed=3))


@pytest.mark.parametrize("context", GRAD_CONTEXTS)
@pytest.mark.parametrize("case_name", GRAD_CONTEXT_CASES)
def test_grad_through_collective_in_context_matches_single_device(repl, case_name, context):
    n = repl.num_replicas
    _check_grad(repl, case_name, data((n * n, COLS), seed=4), context)


@pytest.mark.parametrize("case_name", ["all_max", "all_min"])
def test_grad_through_max_min_splits_ties_like_jnp(repl, case_name):
    n = repl.num_replicas
    x = _ties(n, n)
    xs = per_replica(x, n)
    # the data really has ties across replicas, of different multiplicities
    extreme = xs.max(0) if case_name == "all_max" else xs.min(0)
    multiplicity = (xs == extreme).sum(0)
    assert {1, 2, n} <= set(np.unique(multiplicity))
    _check_grad(repl, case_name, x)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_jvp_of_all_max_averages_tangents_over_ties(repl, ties):
    n = repl.num_replicas
    x = _ties(n, 2) if ties else data((n * 2, COLS))
    t = data((n * 2, COLS), seed=5)

    def step(b):
        return jax.jvp(rp.all_max, (b["x"],), (b["t"],))

    out, tangent = run_step(repl, step, {"x": x, "t": t})
    want, want_t = jax.jit(lambda v, t: jax.jvp(lambda v: jnp.max(v, axis=0), (v,), (t,)))(
        per_replica(x, n), per_replica(t, n)
    )
    _assert_close(out, np.broadcast_to(want, (n, *want.shape)))
    _assert_close(tangent, np.broadcast_to(want_t, (n, *want_t.shape)))


def test_grad_of_all_sum_of_a_loss_flows_back_to_every_replica(repl):
    """``loss = all_sum(l_r)`` on every replica: d(sum_r loss)/dx_r = n * dl_r/dx_r."""
    n = repl.num_replicas
    x = data((n * 2, COLS), seed=6)

    def step(b):
        return jax.grad(lambda v: rp.all_sum(jnp.sum(jnp.sin(v))))(b["x"])

    got = run_step(repl, step, {"x": x})
    _assert_close(got, n * np.cos(per_replica(x, n)))


def test_grad_through_all_mean_of_loss_is_the_global_mean_gradient(repl):
    """``all_mean`` of the gradient of a local loss == gradient of the global mean loss."""
    n = repl.num_replicas
    x, y = data((n * 4, COLS), seed=7), data((n * 4,), seed=8)
    w0 = jnp.asarray(data((COLS,), seed=9))

    def loss(w, x, y):
        return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

    def step(w, b):
        g = rp.all_mean(jax.grad(loss)(w, b["x"], b["y"]))
        return w - 0.5 * g, {"g": g}

    w, out = run_step(repl, step, {"x": x, "y": y}, state=w0)
    want = jax.jit(jax.grad(loss))(w0, x, y)
    _assert_close(out["g"], np.broadcast_to(want, (n, COLS)))
    _assert_close(w, w0 - 0.5 * want)


def test_batch_norm_gradients_match_single_device(repl):
    """Cross-replica batch norm: stats all_mean'ed, grads all_mean'ed == one device, whole batch."""
    n, rows, eps = repl.num_replicas, 4, 1e-3
    x = 2.0 * data((n * rows, COLS), seed=12) + 1.0
    t = data((n * rows, COLS), seed=13)
    params = {
        "scale": jnp.asarray(1.0 + 0.1 * data((COLS,), seed=14)),
        "offset": jnp.asarray(0.1 * data((COLS,), seed=15)),
    }

    def normalize(p, x, mean, var):
        return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["offset"]

    def replica_loss(p, x, t):
        mean = rp.all_mean(jnp.mean(x, axis=0))
        var = rp.all_mean(jnp.mean((x - mean) ** 2, axis=0))
        return jnp.mean((jnp.tanh(normalize(p, x, mean, var)) - t) ** 2)

    def step(p, b):
        loss, (gp, gx) = jax.value_and_grad(replica_loss, argnums=(0, 1))(p, b["x"], b["t"])
        gp = rp.all_mean(gp)
        new = jax.tree.map(lambda a, g: a - 0.1 * g, p, gp)
        return new, {"loss": rp.all_mean(loss), "gp": gp, "gx": gx}

    def global_loss(p, x, t):
        mean = jnp.mean(x, axis=0)
        var = jnp.mean((x - mean) ** 2, axis=0)
        return jnp.mean((jnp.tanh(normalize(p, x, mean, var)) - t) ** 2)

    new, out = run_step(repl, step, {"x": x, "t": t}, state=params)
    want_loss, (want_gp, want_gx) = jax.jit(jax.value_and_grad(global_loss, argnums=(0, 1)))(params, x, t)
    _assert_close(out["loss"], np.full(n, want_loss))
    for key in ("scale", "offset"):
        _assert_close(out["gp"][key], np.broadcast_to(want_gp[key], (n, COLS)))
        _assert_close(new[key], params[key] - 0.1 * want_gp[key])
    # d(sum_r L_r)/dx_r on replica r; the global loss is the mean of the L_r.
    _assert_close(out["gx"].reshape(n * rows, COLS) / n, want_gx)


# ----------------------------------------------------------------------------
# Gradients through custom_jvp / custom_vjp functions that call collectives
# ----------------------------------------------------------------------------


@jax.custom_vjp
def _share(x):
    """``x / all_sum(sum(x))``: this replica's share of the global total."""
    return x / rp.all_sum(jnp.sum(x))


def _share_fwd(x):
    total = rp.all_sum(jnp.sum(x))
    return x / total, (x, total)


def _share_bwd(res, g):
    x, total = res
    return (g / total - rp.all_sum(jnp.sum(g * x)) / total**2,)


_share.defvjp(_share_fwd, _share_bwd)


@jax.custom_jvp
def _tanh_of_sum(x):
    return jnp.tanh(rp.all_sum(x))


@_tanh_of_sum.defjvp
def _tanh_of_sum_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = _tanh_of_sum(x)
    return y, (1.0 - y**2) * rp.all_sum(t)


def _weighted(fn: Callable) -> Callable:
    return lambda v, w: jnp.sum(fn(v) * w)


@pytest.mark.parametrize(
    "fn, global_fn",
    [
        (_share, lambda xs: xs / jnp.sum(xs)),
        (lambda v: v / rp.all_sum(jnp.sum(v)), lambda xs: xs / jnp.sum(xs)),
        (_tanh_of_sum, lambda xs: jnp.broadcast_to(jnp.tanh(jnp.sum(xs, axis=0)), xs.shape)),
        (jax.checkpoint(_share), lambda xs: xs / jnp.sum(xs)),
    ],
    ids=["custom_vjp", "same_without_custom_vjp", "custom_jvp", "checkpointed_custom_vjp"],
)
def test_grad_of_custom_derivative_with_collectives(repl, fn, global_fn):
    n = repl.num_replicas
    x = np.abs(data((n * 2, COLS), seed=16)) + 0.5
    w = data((n * 2, COLS), seed=17)

    def step(b):
        value, g = jax.value_and_grad(_weighted(fn))(b["x"], b["w"])
        return {"out": fn(b["x"]), "loss": value, "grad": g}

    got = run_step(repl, step, {"x": x, "w": w})
    xs, ws = per_replica(x, n), per_replica(w, n)
    want_out = jax.jit(global_fn)(xs)
    want_grad = jax.jit(jax.grad(lambda xs: jnp.sum(global_fn(xs) * ws)))(xs)
    _assert_close(got["out"], want_out)
    _assert_close(got["loss"], jnp.sum(want_out * ws, axis=(1, 2)))
    _assert_close(got["grad"], want_grad)


# ----------------------------------------------------------------------------
# Gradients of pytrees with non-float leaves, and symbolic zeros
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["all_sum", "all_mean", "all_max", "all_min"])
def test_grad_through_pytree_with_int_and_bool_leaves(repl, op):
    n = repl.num_replicas
    x = data((n * 2, COLS), seed=18)
    collective = getattr(rp, op)
    global_op = {"all_sum": jnp.sum, "all_mean": jnp.mean, "all_max": jnp.max, "all_min": jnp.min}[op]

    def replica_loss(v):
        tree = {"f": v, "h": jnp.sum(v**2)}
        if op != "all_mean":
            tree.update(i=(v * 10).astype(jnp.int32))
        if op in ("all_max", "all_min"):
            tree.update(b=v > 0)
        out = collective(tree)
        extra = jnp.sum(out["i"]).astype(v.dtype) * 0.0 if "i" in out else 0.0
        return jnp.sum(jnp.sin(out["f"])) + out["h"] + extra

    def step(b):
        return jax.grad(replica_loss)(b["x"])

    def global_loss(xs):
        f = global_op(xs, axis=0)
        h = global_op(jnp.sum(xs**2, axis=(1, 2)))
        return n * (jnp.sum(jnp.sin(f)) + h)

    got = run_step(repl, step, {"x": x})
    _assert_close(got, jax.jit(jax.grad(global_loss))(per_replica(x, n)), atol=1e-4)


def test_grad_with_symbolic_zero_cotangents_and_unused_outputs(repl):
    """Only one leaf of a gathered/broadcast/scattered pytree reaches the loss."""
    n = repl.num_replicas
    x = data((n * n, COLS), seed=19)

    def replica_loss(v):
        a, _ = rp.all_gather((v, 2.0 * v), tiled=True)
        _, b = rp.broadcast((v, 3.0 * v), source=n - 1)
        c, _ = rp.reduce_scatter((v, v))
        _ = rp.all_sum(v)
        return jnp.sum(a**2) + jnp.sum(b) + jnp.sum(c)

    got = run_step(repl, lambda b: jax.grad(replica_loss)(b["x"]), {"x": x})

    def global_loss(xs):
        a = jnp.concatenate(list(xs), axis=0)
        return n * jnp.sum(a**2) + n * jnp.sum(3.0 * xs[-1]) + jnp.sum(xs)

    _assert_close(got, jax.jit(jax.grad(global_loss))(per_replica(x, n)), atol=1e-4)


def test_grad_wrt_replica_id_dependent_weights(repl):
    """replica_id has no tangent; it may still scale a differentiated value."""
    n = repl.num_replicas
    x = data((n * 2, COLS), seed=20)

    def replica_loss(v):
        return jnp.sum(rp.all_sum(v * rp.replica_id().astype(v.dtype)) ** 2)

    got = run_step(repl, lambda b: jax.grad(replica_loss)(b["x"]), {"x": x})
    xs = per_replica(x, n)
    r = np.arange(n, dtype=np.float32)[:, None, None]
    total = (xs * r).sum(0)
    _assert_close(got, n * 2.0 * total[None] * r)


def test_replica_id_jvp_rule_gives_a_symbolic_zero(repl):
    """JAX skips the rule when no input has a tangent; the rule must still be well-formed."""
    from replicator.core.primitives import replica_id_p

    jvp_rule = ad.primitive_jvps[replica_id_p]  # the rule as registered with JAX, not a private name
    seen = []

    def step(b):
        out, tangent = jvp_rule([], [], group=None)
        seen.append(tangent)
        return out

    got = run_step(repl, step, {"x": np.zeros((repl.num_replicas, 1), np.float32)})
    assert_matches(got, np.arange(repl.num_replicas, dtype=np.int32))
    (tangent,) = seen
    assert type(tangent) is ad.Zero and tangent.aval.dtype == jax.dtypes.float0
