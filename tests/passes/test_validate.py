"""Translation validation (Pipeline(validate=True)) and bisect_passes, on a deliberately wrong pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import replicator as rp
from replicator.passes import Pass, Pipeline, bisect_passes, default_passes
from replicator.passes.base import inline_function, rewrite_graph
from replicator.primitives import all_reduce_p


class DoubleFirstAllSum(Pass):
    """A wrong pass: the first all_sum's operand is doubled."""

    name = "double-first-all-sum"

    def run(self, graph):
        done = []

        def rule(eqn):
            if done or eqn.primitive is not all_reduce_p or eqn.params["op"] != "sum":
                return None
            done.append(eqn)
            params = eqn.params
            return inline_function(
                lambda x: all_reduce_p.bind(x * 2, **params), eqn.invars, context=graph.context, like=eqn
            )

        return rewrite_graph(graph, rule)


def _step(state, batch):
    g = rp.all_mean(jax.grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(state["w"]))
    return {"w": state["w"] - 0.1 * g}, {"total": rp.all_sum(jnp.sum(batch["x"])), "rows": rp.all_sum(1)}


def _inputs(n):
    return {"x": np.ones((2 * n, 3), np.float32)}, {"w": np.ones((3, 2), np.float32)}


def _wrong_pipeline(**kwargs):
    passes = default_passes()
    passes.insert(2, DoubleFirstAllSum())
    return Pipeline(passes, **kwargs)


def test_validation_names_the_pass_and_the_leaf(n_devices):
    repl = rp.Replicator(1, n_devices, passes=_wrong_pipeline(validate=True))
    batch, state = _inputs(n_devices)
    with pytest.raises(
        rp.MiscompileError, match=r"pass 'double-first-all-sum' changed outputs\['total'\]: max \|difference\| 5"
    ):
        repl.lower(_step, batch, state)


def test_validation_is_quiet_on_sound_pipelines(n_devices, monkeypatch):
    monkeypatch.setenv("REPLICATOR_VALIDATE", "1")
    for pipe in (
        Pipeline.default(),
        Pipeline.default(shard_optimizer=True, shard_optimizer_min_bytes=0, hierarchical=True),
        Pipeline.default(compress=True, all_reduce_algorithm="ring"),
    ):
        assert pipe.validate
        repl = rp.Replicator(2 if n_devices % 2 == 0 else 1, n_devices // (2 if n_devices % 2 == 0 else 1), passes=pipe)
        batch, state = _inputs(repl.num_replicas)
        batch = {"x": np.ones((2 * repl.cores_per_worker, 3), np.float32)}
        repl.lower(_step, batch, state)


def test_bisect_names_the_first_pass_that_changes_the_result(n_devices):
    repl = rp.Replicator(1, n_devices, passes=_wrong_pipeline())
    batch, state = _inputs(n_devices)
    report = bisect_passes(repl, _step, batch, state)
    assert report.culprit == "double-first-all-sum"
    assert report.passes == ("simplify", "double-first-all-sum", "fuse-allreduce")
    assert "double-first-all-sum" in str(report) and "total" in str(report)
    assert bisect_passes(rp.Replicator(1, n_devices), _step, batch, state).culprit is None


def test_validation_sees_a_wrong_sharded_state_update(n_devices):
    """A pass that stores state sharded is compared with the whole value."""

    class ShardAndBreak(Pass):
        name = "zero-then-break"

        def run(self, graph):
            from replicator.passes.shard_optimizer import ShardOptimizerUpdate

            result = ShardOptimizerUpdate(min_tensor_bytes=0).run(graph)
            assert result.graph.sharded_state  # the test needs sharded state
            # Break it: the new chunk of every sharded leaf is negated.
            jaxpr = result.graph.jaxpr.jaxpr
            outvars = list(jaxpr.outvars)
            eqns = list(jaxpr.eqns)
            for i in sorted(result.graph.sharded_state):
                new_eqns, (neg,) = inline_function(lax.neg, [outvars[i]], context=graph.context)
                eqns += new_eqns
                outvars[i] = neg
            new = jaxpr.replace(eqns=eqns, outvars=outvars)
            return type(result)(
                result.graph.with_jaxpr(jax.extend.core.ClosedJaxpr(new, result.graph.jaxpr.consts)), True
            )

    import optax

    tx = optax.adam(1e-2)
    n = n_devices
    params = {"w": np.ones((2 * n, 2), np.float32)}

    def step(state, batch):
        p, opt = state
        g = rp.all_mean(jax.grad(lambda w: jnp.mean((batch["x"] @ w["w"]) ** 2))(p))
        upd, opt = tx.update(g, opt, p)
        return (jax.tree.map(lambda a, b: a + b, p, upd), opt), {}

    passes = default_passes()
    passes.insert(2, ShardAndBreak())
    repl = rp.Replicator(1, n, passes=Pipeline(passes, validate=True))
    with pytest.raises(rp.MiscompileError, match=r"zero-then-break' changed new state\[1\]"):
        repl.lower(step, {"x": np.ones((2 * n, 2 * n), np.float32)}, (params, tx.init(params)))


def test_a_pass_that_reads_an_undefined_variable_is_named_even_without_verify(n_devices):
    class DropFirstEquation(Pass):
        name = "drop-first-equation"

        def run(self, graph):
            jaxpr = graph.jaxpr.jaxpr
            new = jaxpr.replace(eqns=jaxpr.eqns[1:])
            return type(rewrite_graph(graph, lambda e: None))(
                graph.with_jaxpr(jax.extend.core.ClosedJaxpr(new, graph.jaxpr.consts)), True
            )

    passes = default_passes()
    passes.insert(2, DropFirstEquation())
    repl = rp.Replicator(1, n_devices, passes=Pipeline(passes, verify=False))
    batch, state = _inputs(n_devices)
    with pytest.raises(rp.PassError, match="drop-first-equation.*never defined"):
        repl.lower(_step, batch, state)
