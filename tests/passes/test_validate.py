"""Translation validation (PassManager(validate=True)) and the graph invariant checks, on deliberately wrong passes.

The wrong pass, ``DoubleFirstAllSum``, lives in tests/utils.py, shared with test_bisect.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from utils import DoubleFirstAllSum

import replicator as rp
from replicator.core.graph import StepGraph
from replicator.core.jaxprs import inline_function
from replicator.pass_manager.contract import rewrite_graph
from replicator.pass_manager.verify import GraphInvariantError, verify_graph
from replicator.passes import Pass, PassManager, PassResult, default_passes
from replicator.tools.validate import GraphRunner, compare_results


def _step(state, batch):
    g = rp.all_mean(jax.grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(state["w"]))
    return {"w": state["w"] - 0.1 * g}, {"total": rp.all_sum(jnp.sum(batch["x"])), "rows": rp.all_sum(1)}


def _inputs(n):
    return {"x": np.ones((2 * n, 3), np.float32)}, {"w": np.ones((3, 2), np.float32)}


def _cli_batch():  # for test_bisect's command-line test: a batch for all local devices
    return _inputs(jax.device_count())[0]


def _cli_state():
    return _inputs(jax.device_count())[1]


def _wrong_pipeline(**kwargs):
    passes = default_passes()
    passes.insert(3, DoubleFirstAllSum())
    return PassManager(passes, **kwargs)


def test_validation_names_the_pass_and_the_leaf(n_devices):
    repl = rp.Replicator(1, n_devices, passes=_wrong_pipeline(validate=True))
    batch, state = _inputs(n_devices)
    # Doubling a sum moves it by its own size: relative difference 1 (on any number of devices).
    with pytest.raises(
        rp.MiscompileError,
        match=r"pass 'double-first-all-sum' changed outputs\['total'\]: max \|difference\| [0-9.e+]+ \(relative 1,",
    ):
        repl.lower(_step, batch, state)


class _ScaleFirstAllSum(DoubleFirstAllSum):
    """Moves the first all_sum by 1%: a bf16-sized change (bf16's unit roundoff is 0.4%)."""

    name = "scale-first-all-sum"
    factor = 1.01


class _InexactDoubleFirstAllSum(DoubleFirstAllSum):
    """Declares that it changes precision on purpose (as compress-communication does)."""

    name = "inexact-double-first-all-sum"
    exact = False
    factor = 1.0  # rewrites the graph, changes no value


@pytest.mark.parametrize(
    "inserted, raises",
    [
        ([_ScaleFirstAllSum()], "scale-first-all-sum"),  # a float32 step held to float32 rounding
        ([_InexactDoubleFirstAllSum(), _ScaleFirstAllSum()], None),  # after bf16 on purpose: bf16 rounding
        ([_InexactDoubleFirstAllSum(), DoubleFirstAllSum()], "double-first-all-sum"),  # beyond it: still caught
    ],
)
def test_after_a_pass_that_lowers_precision_later_passes_get_its_tolerance(n_devices, inserted, raises):
    """Regression (16 devices): after compress-communication, a ring all-reduce reorders a bf16 sum and moves
    it by bf16 rounding; lower-collectives was held to float32 rounding and reported a miscompile."""
    passes = default_passes()
    passes[3:3] = inserted
    repl = rp.Replicator(1, n_devices, passes=PassManager(passes, validate=True))
    batch, state = _inputs(n_devices)
    if raises is None:
        repl.lower(_step, batch, state)
    else:
        with pytest.raises(rp.MiscompileError, match=f"pass '{raises}' changed"):
            repl.lower(_step, batch, state)


def test_validation_is_quiet_on_sound_pipelines(n_devices, monkeypatch):
    monkeypatch.setenv("REPLICATOR_VALIDATE", "1")
    for pipe in (
        PassManager.default(),
        PassManager.default(shard_optimizer=True, shard_optimizer_min_bytes=0, hierarchical=True),
        PassManager.default(compress=True, all_reduce_algorithm="ring"),
    ):
        assert pipe.validate
        repl = rp.Replicator(2 if n_devices % 2 == 0 else 1, n_devices // (2 if n_devices % 2 == 0 else 1), passes=pipe)
        batch, state = _inputs(repl.num_replicas)
        batch = {"x": np.ones((2 * repl.cores_per_worker, 3), np.float32)}
        repl.lower(_step, batch, state)


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
    repl = rp.Replicator(1, n, passes=PassManager(passes, validate=True))
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
    repl = rp.Replicator(1, n_devices, passes=PassManager(passes, verify=False))
    batch, state = _inputs(n_devices)
    with pytest.raises(rp.PassError, match="drop-first-equation.*never defined"):
        repl.lower(_step, batch, state)


# --- graph invariants: a graph that reads a variable nothing defines ----------------------------


class ReadUndefined(Pass):
    """A wrong pass: the first equation (at the top, or inside the first sub-graph) reads a fresh Var."""

    name = "read-undefined"

    def __init__(self, nested: bool = False):
        self.nested = nested

    def run(self, graph: StepGraph) -> PassResult:
        return PassResult(graph.with_jaxpr(_break(graph.jaxpr, self.nested)), True)


def _break(closed: jax.extend.core.ClosedJaxpr, nested: bool) -> jax.extend.core.ClosedJaxpr:
    jaxpr = closed.jaxpr
    eqns = list(jaxpr.eqns)
    if nested:
        i = next(i for i, e in enumerate(eqns) if "jaxpr" in e.params)
        inner = eqns[i].params["jaxpr"]
        eqns[i] = eqns[i].replace(params={**eqns[i].params, "jaxpr": _break(inner, nested=False)})
    else:
        i = next(i for i, e in enumerate(eqns) if any(isinstance(v, jax.extend.core.Var) for v in e.invars))
        invars = [jax.extend.core.Var(v.aval) if isinstance(v, jax.extend.core.Var) else v for v in eqns[i].invars]
        eqns[i] = eqns[i].replace(invars=invars)
    return jax.extend.core.ClosedJaxpr(jaxpr.replace(eqns=eqns), closed.consts)


def _jit_step(state, batch):
    h = jax.jit(lambda w, x: jnp.tanh(x @ w))(state["w"], batch["x"])
    return {"w": state["w"] - rp.all_mean(jnp.mean(h))}, {}


@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "inside-jit"])
@pytest.mark.parametrize("verify", [False, True], ids=["always", "verify"])
def test_a_graph_that_reads_an_undefined_variable_raises_naming_the_pass(n_devices, nested, verify):
    passes = default_passes()
    passes.insert(2, ReadUndefined(nested))
    repl = rp.Replicator(1, n_devices, passes=PassManager(passes, verify=verify))
    batch, state = _inputs(n_devices)
    with pytest.raises(
        GraphInvariantError,
        match=r"pass 'read-undefined' \(after \['capture-collectives', 'check-replica-invariance'\]\).*never",
    ):
        repl.lower(_jit_step, batch, state)
    # A GraphInvariantError is a PassError (and an AssertionError).
    assert issubclass(GraphInvariantError, rp.PassError) and issubclass(GraphInvariantError, AssertionError)


def test_verify_graph_and_jax_check_jaxpr_both_reject_an_undefined_read(n_devices):
    graph = rp.Replicator(1, n_devices).lower(_jit_step, *_inputs(n_devices)).traced
    verify_graph(graph, lowered=False)
    broken = graph.with_jaxpr(_break(graph.jaxpr, nested=False))
    with pytest.raises(GraphInvariantError, match="never defined before it"):
        verify_graph(broken, lowered=False)
    with pytest.raises(Exception, match="not defined|undefined"):  # the type-check alone sees it too
        jax.extend.core.check_jaxpr(broken.jaxpr.jaxpr)


# --- the comparison itself ----------------------------------------------------------------------


def _graph_with(n_outputs: int, graph: StepGraph) -> StepGraph:
    import dataclasses

    return dataclasses.replace(graph, state_paths=(), output_paths=tuple(f"outputs[{i}]" for i in range(n_outputs)))


def test_compare_is_dtype_aware(n_devices):
    import ml_dtypes

    graph = _graph_with(1, rp.Replicator(1, n_devices).lower(_jit_step, *_inputs(n_devices)).traced)

    def compare(before, after, exact=True):
        compare_results([np.asarray(before)], [np.asarray(after)], graph, "p", exact=exact)

    x = np.linspace(-3, 3, 10, dtype=np.float32)
    compare(x, x * (1 + 1e-6))  # float rounding
    bf = x.astype(ml_dtypes.bfloat16)
    compare(bf, (x * (1 + 2**-8)).astype(ml_dtypes.bfloat16))  # one bf16 ulp: not an exact int compare
    compare([np.inf, -np.inf, np.nan, 1.0], [np.inf, -np.inf, np.nan, 1.0])  # same infinities and NaN
    compare(x * 1000, x * 1000 + 1.0, exact=False)  # bf16-sized difference, allowed for an inexact pass
    with pytest.raises(rp.MiscompileError, match=r"max \|difference\| 1 \(relative 0.000333, tolerance 0.6\)"):
        compare(x * 1000, x * 1000 + 1.0)  # the same, for an exact pass
    with pytest.raises(rp.MiscompileError, match=r"pass 'p' changed outputs\[0\]: max \|difference\| nan"):
        compare([1.0, 2.0], [1.0, np.nan])
    with pytest.raises(rp.MiscompileError, match=r"1 of 3 elements differ \(e.g. element 2: 4 instead of 3\)"):
        compare(np.int32([1, 2, 3]), np.int32([1, 2, 4]))
    with pytest.raises(rp.MiscompileError, match=r"from float32\[10\] to float16\[10\]"):
        compare(x, x.astype(np.float16))


def test_runner_checks_given_inputs(n_devices):
    graph = rp.Replicator(1, n_devices).lower(_jit_step, *_inputs(n_devices)).traced
    with pytest.raises(ValueError, match=r"given batch leaves are \['float32\[2, 3\]'\].*takes \['float32\["):
        GraphRunner(graph, batch=[np.ones((2, 3), np.float32)])


# --- sound pipelines validate quietly on realistic steps -----------------------------------------


def test_validation_is_quiet_on_the_mlp_and_adam_steps(n_devices):
    import optax

    from .workloads import mlp_params, mlp_step

    state = mlp_params(np.random.default_rng(0))
    batch = {"x": np.ones((2 * n_devices, 3), np.float32), "y": np.ones((2 * n_devices, 7), np.float32)}
    rp.Replicator(1, n_devices, passes=PassManager.default(validate=True)).lower(mlp_step, batch, state)

    tx = optax.adam(1e-2)
    params = {"w": np.ones((8 * n_devices, 3), np.float32), "b": np.zeros(3, np.float32)}

    def adam_step(state, batch):
        p, opt, key = state
        key, sub = jax.random.split(key)
        noise = jax.random.normal(sub, batch["x"].shape)
        g = rp.all_mean(jax.grad(lambda q: jnp.mean(((batch["x"] + noise) @ q["w"] + q["b"]) ** 2))(p))
        upd, opt = tx.update(g, opt, p)
        return (optax.apply_updates(p, upd), opt, key), {"gnorm": optax.tree.norm(g)}

    pipe = PassManager.default(shard_optimizer=True, shard_optimizer_min_bytes=0, validate=True)
    state = (params, tx.init(params), jax.random.key(0))  # a typed PRNG key in the state too
    lowered = rp.Replicator(1, n_devices, passes=pipe).lower(
        adam_step, {"x": np.ones((2 * n_devices, 8 * n_devices), np.float32)}, state
    )
    assert lowered.final.sharded_state  # the ZeRO rewrite ran and was checked
