"""lower-collectives on the graph: placeholders in, mesh collectives out."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from utils import check_against_simulation

import replicator as rp
from replicator.core.jaxprs import iter_eqns
from replicator.core.primitives import PLACEHOLDERS
from replicator.passes import LowerCollectives, PassManager, count_primitives, verify_graph

PLACEHOLDER_NAMES = sorted(p.name for p in PLACEHOLDERS)


def _batch(n):
    return {"x": np.zeros((2 * n, 4), np.float32)}


def _eqns(graph, name):
    return [e for e in iter_eqns(graph.jaxpr.jaxpr) if e.primitive.name == name]


@pytest.mark.parametrize(
    "fn, collective, axes_param",
    [
        (lambda b: rp.all_sum(b["x"]), "psum", "axes"),
        (lambda b: rp.all_mean(b["x"], group="cores"), "psum", "axes"),
        (lambda b: rp.all_max(b["x"], group="workers"), "pmax", "axes"),
        (lambda b: rp.all_min(b["x"]), "pmin", "axes"),
        (lambda b: rp.all_gather(b["x"], axis=1), "all_gather", "axis_name"),
        (lambda b: rp.reduce_scatter(b["x"], group="cores"), "reduce_scatter", "axis_name"),
        (lambda b: rp.broadcast(b["x"], source=0, group="workers"), "psum", "axes"),
    ],
)
def test_each_placeholder_becomes_its_collective_over_the_group_axes(repl2d, fn, collective, axes_param):
    # Each replica's rows divisible by the cores (reduce_scatter over 'cores' splits them).
    cores = repl2d.cores_per_worker
    lowered = repl2d.lower(fn, {"x": np.zeros((max(2 * repl2d.num_replicas, cores * cores), 4), np.float32)})
    before, after = lowered.traced, lowered.after("lower-collectives")
    assert sum(count_primitives(before.jaxpr, PLACEHOLDER_NAMES).values()) == 1
    assert count_primitives(after.jaxpr, PLACEHOLDER_NAMES) == {}
    (eqn,) = _eqns(after, collective)
    (placeholder,) = [e for e in iter_eqns(before.jaxpr.jaxpr) if e.primitive in PLACEHOLDERS]
    group = placeholder.params["group"]
    expected = ("workers", "cores") if group is None else (group,)
    axes = eqn.params[axes_param]
    assert tuple(axes if isinstance(axes, tuple) else (axes,)) == expected
    verify_graph(after, lowered=True)


def test_replica_id_becomes_flat_axis_index(repl2d):
    lowered = repl2d.lower(lambda b: rp.replica_id(), _batch(repl2d.num_replicas))
    names = [e.params["axis_name"] for e in _eqns(lowered.final, "axis_index")]
    assert sorted(names) == ["cores", "workers"]
    assert "rp.replica_id" not in count_primitives(lowered.final.jaxpr)


def test_mean_divides_the_sum_by_the_group_size(repl2d):
    lowered = repl2d.lower(lambda b: rp.all_mean(b["x"], group="cores"), _batch(repl2d.num_replicas))
    (div,) = _eqns(lowered.final, "div")
    assert float(div.invars[1].val) == repl2d.cores_per_worker


def _in_jit(b):
    return jax.jit(lambda x: rp.all_sum(x))(b["x"])


def _in_cond(b):
    """A collective in each branch; the predicate is a runtime value identical on every replica."""
    on = rp.all_max(b["x"][0, 0]) > 0
    return lax.cond(on, lambda x: rp.all_sum(x), lambda x: rp.all_mean(x * 2, group="cores"), b["x"])


def _in_scan(b):
    return lax.scan(lambda c, x: (c + rp.all_sum(x), None), jnp.zeros(4), b["x"])[0]


def _in_while(b):
    return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, rp.all_sum(c[1])), (0, b["x"]))[1]


def _in_checkpoint(b):
    return jax.grad(lambda x: jnp.sum(jax.checkpoint(lambda y: jnp.sin(rp.all_sum(y)))(x)))(b["x"])


def _in_custom_jvp(b):
    f = jax.custom_jvp(lambda x: rp.all_sum(x))
    f.defjvp(lambda p, t: (f(p[0]), t[0]))
    return f(b["x"])


def _in_custom_vjp(b):
    f = jax.custom_vjp(lambda x: rp.all_sum(x))
    f.defvjp(lambda x: (rp.all_sum(x), None), lambda _, ct: (ct,))
    return f(b["x"])


@pytest.mark.parametrize(
    "fn, container",
    [
        (_in_jit, "jit"),
        (_in_cond, "cond"),
        (_in_scan, "scan"),
        (_in_while, "while"),
        (_in_checkpoint, "remat2"),
        (_in_custom_jvp, "custom_jvp_call"),
        (_in_custom_vjp, "custom_vjp_call"),
    ],
)
def test_lowering_recurses_into_every_sub_jaxpr(repl, fn, container):
    lowered = repl.lower(fn, _batch(repl.num_replicas))
    assert container in count_primitives(lowered.traced.jaxpr)
    assert count_primitives(lowered.traced.jaxpr, PLACEHOLDER_NAMES)
    assert count_primitives(lowered.final.jaxpr, PLACEHOLDER_NAMES) == {}
    assert count_primitives(lowered.final.jaxpr).get("psum", 0) >= 1
    verify_graph(lowered.final, lowered=True)
    # The lowered collectives compute what the vmap reference computes.
    batch = {"x": np.random.default_rng(0).normal(size=(2 * repl.num_replicas, 4)).astype(np.float32)}
    check_against_simulation(repl, fn, [batch], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("on", [True, False])
def test_each_branch_of_a_cond_runs_its_lowered_collective(repl2d, on):
    """Both predicates: the all_sum branch and the per-worker all_mean branch, against the reference and by hand."""
    n = repl2d.num_replicas
    x = np.random.default_rng(1).normal(size=(2 * n, 4)).astype(np.float32)
    x[:, 0] = 1.0 if on else -1.0  # the predicate reads every replica's x[0, 0]
    (got,) = check_against_simulation(repl2d, _in_cond, [{"x": x}], atol=1e-5, rtol=1e-5)[1]
    rows = x.reshape(repl2d.num_workers, repl2d.cores_per_worker, 2, 4)
    if on:
        want = np.broadcast_to(rows.sum((0, 1), keepdims=True), rows.shape)
    else:
        want = np.broadcast_to(2 * rows.mean(1, keepdims=True), rows.shape)
    np.testing.assert_allclose(got.reshape(rows.shape), want, rtol=1e-5, atol=1e-5)


def test_lowering_is_pure_and_reports_change(repl):
    lowered = repl.lower(lambda b: rp.all_sum(b["x"]), _batch(repl.num_replicas))
    graph = lowered.traced
    text = str(graph.jaxpr)
    result = LowerCollectives().run(graph)
    assert result.changed and str(graph.jaxpr) == text
    again = LowerCollectives().run(result.graph)
    assert not again.changed and again.graph is result.graph


def test_unlowered_placeholder_names_the_pass(repl):
    graph = repl.lower(lambda b: rp.all_sum(b["x"]), _batch(repl.num_replicas)).traced
    fn = jax.extend.core.jaxpr_as_fun(graph.jaxpr)
    with pytest.raises(RuntimeError, match="lower-collectives"):
        jax.jit(fn)(jnp.zeros((2, 4)))


def test_lower_collectives_cannot_be_disabled():
    with pytest.raises(ValueError, match="required"):
        PassManager(disable=["lower-collectives"])


def _solve(b):
    """A collective inside ``custom_linear_solve``, whose sub-jaxprs sit in a named tuple."""
    x = b["x"][0]
    return lax.custom_linear_solve(lambda v: rp.all_sum(v) + v, x, lambda mv, r: mv(r))  # sum(x) + x


@pytest.mark.parametrize("algorithm", ["native", "ring", "reduce_broadcast"])
def test_a_named_tuple_of_sub_jaxprs_keeps_its_type(n_devices, algorithm):
    """Regression: rewriting ``custom_linear_solve``'s ``jaxprs`` rebuilt it as a plain tuple,
    and the step failed when run (``'tuple' object has no attribute 'solve'``)."""
    pipeline = PassManager.default(
        shard_optimizer=False, all_reduce_algorithm=algorithm, disable=["check-replica-invariance"], verify=True
    )
    repl = rp.Replicator(1, n_devices, passes=pipeline)
    batch = {"x": np.random.default_rng(0).normal(size=(2 * n_devices, 4)).astype(np.float32)}
    lowered = repl.lower(_solve, batch)
    (eqn,) = _eqns(lowered.final, "custom_linear_solve")
    assert type(eqn.params["jaxprs"]) is type(_eqns(lowered.traced, "custom_linear_solve")[0].params["jaxprs"])
    assert count_primitives(lowered.final.jaxpr, PLACEHOLDER_NAMES) == {}

    def input_fn(ctx):
        while True:
            yield batch

    rows = batch["x"][::2].astype(np.float64)  # replica r's first row
    np.testing.assert_allclose(np.asarray(repl.run(_solve, input_fn)), rows.sum(0) + rows, rtol=1e-5, atol=1e-6)
