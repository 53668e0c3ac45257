"""The graph invariant checks (replicator/pass_manager/verify.py) on hand-made broken and sound graphs.

Each broken graph is a small jaxpr traced with ``jax.make_jaxpr`` and then damaged (a
result or an operand swapped for a variable nothing defines, a let-binder retyped, a
variable bound twice), or one with a collective the verifier must refuse (over a user
axis name after lowering, a placeholder left after lowering). Each sound graph must pass.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

import replicator as rp
from replicator.core.context import ReplicaContext
from replicator.core.graph import StepGraph
from replicator.pass_manager.verify import GraphInvariantError, check_defined, verify_graph

#: Two workers of four cores, with the user's axis name 'batch' bound to all replicas.
CONTEXT = ReplicaContext(2, 4, (("batch", None),))
X = np.arange(3, dtype=np.float32)


def _graph(fn, *args: np.ndarray, context: ReplicaContext = CONTEXT) -> StepGraph:
    """``fn`` traced under ``context``'s axes, as a graph with one output per result."""
    closed = jax.make_jaxpr(fn, axis_env=context.axis_env)(*args)
    return StepGraph(closed, context, (), tuple(f"outputs[{i}]" for i in range(len(closed.jaxpr.outvars))))


def _with(graph: StepGraph, jaxpr: Jaxpr) -> StepGraph:
    return graph.with_jaxpr(ClosedJaxpr(jaxpr, graph.jaxpr.consts))


def _undefined_like(v: Var) -> Var:
    return Var(v.aval)


# --- variables defined before they are read ----------------------------------------------------


def test_a_result_that_nothing_defines_is_rejected():
    graph = _graph(lambda x: (jnp.sin(x), x * 2), X)
    jaxpr = graph.jaxpr.jaxpr
    ghost = _undefined_like(jaxpr.outvars[1])
    broken = _with(graph, jaxpr.replace(outvars=[jaxpr.outvars[0], ghost]))
    for check in (check_defined, lambda g: verify_graph(g, lowered=False)):
        with pytest.raises(GraphInvariantError, match=rf"^the result {re.escape(str(ghost))} is never defined$"):
            check(broken)


def test_a_result_that_nothing_defines_inside_a_sub_graph_is_rejected():
    graph = _graph(lambda x: jax.jit(lambda y: jnp.sin(y) + 1)(x), X)
    jaxpr = graph.jaxpr.jaxpr
    (call,) = jaxpr.eqns
    inner = call.params["jaxpr"]
    ghost = _undefined_like(inner.jaxpr.outvars[0])
    broken_inner = ClosedJaxpr(inner.jaxpr.replace(outvars=[ghost]), inner.consts)
    broken = _with(graph, jaxpr.replace(eqns=[call.replace(params={**call.params, "jaxpr": broken_inner})]))
    with pytest.raises(
        GraphInvariantError,
        match=rf"^a sub-graph of equation 0 \(jit\): the result {re.escape(str(ghost))} is never defined$",
    ):
        check_defined(broken)


def test_an_operand_that_nothing_defines_is_rejected_naming_the_equation():
    graph = _graph(lambda x: jnp.cos(jnp.sin(x)), X)
    jaxpr = graph.jaxpr.jaxpr
    ghost = _undefined_like(jaxpr.eqns[1].invars[0])
    broken = _with(graph, jaxpr.replace(eqns=[jaxpr.eqns[0], jaxpr.eqns[1].replace(invars=[ghost])]))
    with pytest.raises(
        GraphInvariantError, match=rf"^equation 1 \(cos\) reads {re.escape(str(ghost))}, which is never defined before"
    ):
        verify_graph(broken, lowered=False)


def test_literal_results_inputs_and_constants_count_as_defined():
    """A result may be a literal (never in any set of defined variables), an input or a constant."""
    w = np.ones(3, np.float32)
    graph = _graph(lambda x: (x, 1.0, jnp.sin(x) * w), X)
    jaxpr = graph.jaxpr.jaxpr
    assert isinstance(jaxpr.outvars[1], jax.extend.core.Literal) and jaxpr.constvars
    graph = _with(graph, jaxpr.replace(outvars=[*jaxpr.outvars, jaxpr.constvars[0]]))
    check_defined(graph)
    verify_graph(graph, lowered=False)
    verify_graph(graph, lowered=True)


def test_a_variable_bound_both_as_constant_and_input_is_a_type_error_not_an_undefined_read():
    """Both kinds of binder define a variable: one bound as both is defined (twice), which only the type-check refuses."""
    graph = _graph(lambda x: x * 2, X)
    jaxpr = graph.jaxpr.jaxpr
    twice = ClosedJaxpr(jaxpr.replace(constvars=[jaxpr.invars[0]]), [X])
    graph = graph.with_jaxpr(twice)
    check_defined(graph)
    with pytest.raises(GraphInvariantError, match="^the jaxpr does not type-check: Variable 'a' already bound"):
        verify_graph(graph, lowered=False)


# --- the type-check --------------------------------------------------------------------------


def test_a_graph_that_does_not_type_check_is_rejected():
    graph = _graph(lambda x: jnp.sin(x), X)
    jaxpr = graph.jaxpr.jaxpr
    wrong = Var(jax.core.ShapedArray((4,), np.float32))  # sin of an f32[3] bound as an f32[4]
    broken = _with(graph, jaxpr.replace(eqns=[jaxpr.eqns[0].replace(outvars=[wrong])], outvars=[wrong]))
    check_defined(broken)  # every variable is defined: only the types are wrong
    with pytest.raises(GraphInvariantError, match="^the jaxpr does not type-check: .*inconsistently typed") as info:
        verify_graph(broken, lowered=False)
    assert info.value.__cause__ is not None


# --- collectives over the mesh axes ----------------------------------------------------------


def test_a_collective_over_a_user_axis_passes_before_lowering_and_is_rejected_after():
    graph = _graph(lambda x: lax.psum(jnp.sin(x), "batch"), X)  # a non-collective equation first
    verify_graph(graph, lowered=False)
    with pytest.raises(
        GraphInvariantError, match=r"^'psum' uses axes \['batch'\], not mesh axes \('workers', 'cores'\)$"
    ):
        verify_graph(graph, lowered=True)


@pytest.mark.parametrize(
    ("fn", "name"),
    [
        (lambda x: lax.all_gather(x, "batch"), "all_gather"),  # axis_name=('batch',)
        (lambda x: x + lax.axis_index("batch"), "axis_index"),  # axis_name='batch', not a tuple
        (lambda x: lax.pmax(x, ("workers", "batch")), "pmax"),
    ],
    ids=["all_gather", "axis_index", "pmax"],
)
def test_every_kind_of_collective_is_checked_after_lowering(fn, name):
    graph = _graph(fn, X)
    verify_graph(graph, lowered=False)
    with pytest.raises(GraphInvariantError, match=rf"^'{name}' uses axes \['batch'\]"):
        verify_graph(graph, lowered=True)


def test_a_collective_over_a_user_axis_inside_a_sub_graph_is_rejected_after_lowering():
    graph = _graph(lambda x: jax.jit(lambda y: lax.psum(y, "batch"))(jnp.cos(x)), X)
    with pytest.raises(GraphInvariantError, match=r"'psum' uses axes \['batch'\]"):
        verify_graph(graph, lowered=True)


def test_collectives_over_mesh_axes_and_local_vmap_axes_pass_after_lowering():
    def fn(x):
        y = lax.psum(x, ("workers", "cores")) + lax.pmean(x, "cores")
        return jax.vmap(lambda r: lax.psum(r, "v"), axis_name="v")(jnp.stack([y, y]))  # psum over axes=(0,)

    graph = _graph(fn, X)
    assert any(e.params.get("axes") == (0,) for e in graph.jaxpr.jaxpr.eqns)
    verify_graph(graph, lowered=True)


# --- placeholders --------------------------------------------------------------------------


def test_a_placeholder_passes_before_lowering_and_is_rejected_after(n_devices):
    def step(b):
        return jax.jit(lambda y: rp.all_sum(y))(b)  # the placeholder inside a sub-graph

    compiled = rp.Replicator(1, n_devices).lower(step, np.ones((n_devices, 3), np.float32))
    verify_graph(compiled.traced, lowered=False)
    with pytest.raises(GraphInvariantError, match=r"^placeholder 'rp\.all_reduce' left after lowering$"):
        verify_graph(compiled.traced, lowered=True)
    verify_graph(compiled.final, lowered=True)  # after lower-collectives: real psums over the mesh axes
