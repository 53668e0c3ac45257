"""``check-replica-invariance``: reject what would make replicas hang or drift apart.

The variance analysis (:mod:`replicator.analysis.invariance`) says which values
may differ between replicas. This pass changes nothing; it raises
:class:`~replicator.errors.DivergentControlFlowError` for a collective under a
condition or loop bound that may differ between replicas, and
:class:`~replicator.errors.DivergentStateError` for a state leaf that enters
identical and would leave different, naming the user's line and the fix.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Jaxpr, Var

from replicator._jax_compat import _is_library, user_code_line  # noqa: F401 - _is_library: tests reach it here
from replicator.analysis.invariance import OPAQUE_PRIMITIVES, analyze
from replicator.core.context import ReplicaContext, group_axes
from replicator.core.graph import StepGraph
from replicator.core.jaxprs import DefUse, iter_eqns, sub_jaxprs
from replicator.errors import DivergentStateError
from replicator.pass_manager.contract import Pass, PassResult

__all__ = ["CheckReplicaInvariance"]


def _from_gradients(jaxpr: Jaxpr, var: Var, variance: dict) -> bool:
    """Whether the per-replica values ``var`` is computed from include a gradient.

    Walks back from ``var`` through the equations whose results may differ
    between replicas; a gradient is a backward-pass equation among them (JAX
    names them ``transpose(jvp(...))``), or one inside their sub-graphs.
    """
    facts = DefUse(jaxpr)
    seen: set[int] = set()
    stack = [var]
    while stack:
        index = facts.producer(stack.pop())
        if index is None or index in seen:
            continue
        seen.add(index)
        eqn = jaxpr.eqns[index]
        inner = [e for sub in sub_jaxprs(eqn.params) for e in iter_eqns(sub)]
        if any("transpose" in str(e.source_info.name_stack) for e in [eqn, *inner]):
            return True
        stack.extend(a for a in eqn.invars if isinstance(a, Var) and variance.get(a))
    return False


def _axes_named(context: ReplicaContext, axes: frozenset) -> str:
    """The user's axis names for mesh ``axes`` (``Replicator(axis_name=...)``), or the mesh axes."""
    live = frozenset(a for a, n in context.axis_sizes.items() if n > 1)
    names = [n for n, group in context.axis_names if frozenset(group_axes(group)) & live == axes]
    mesh = f"mesh axes {tuple(sorted(axes))}"
    return f"axis {' / '.join(repr(n) for n in names)} ({mesh})" if names else mesh


class CheckReplicaInvariance(Pass):
    """Reject divergent control flow around collectives and divergent state.

    Changes nothing; raises :class:`DivergentControlFlowError` or
    :class:`DivergentStateError` with the user's source line and a fix.
    State leaves the step keeps per replica (``sharded_state``: ZeRO's chunks,
    ``Replicator.run(..., per_replica_state=...)``) may differ and are not checked.
    """

    name = "check-replica-invariance"

    def run(self, graph: StepGraph) -> PassResult:
        info = analyze(graph)
        jaxpr = graph.jaxpr.jaxpr
        for index, (path, var, variance) in enumerate(
            zip(
                graph.state_paths,
                jaxpr.outvars[: graph.num_state],
                info.output_variance[: graph.num_state],
                strict=True,
            )
        ):
            if variance and index not in graph.sharded_state:
                raise DivergentStateError(_divergent_state_message(graph, info, path, var, variance))
        return PassResult(graph, False)


def _divergent_state_message(graph: StepGraph, info: Any, path: str, var: Any, variance: frozenset) -> str:
    jaxpr = graph.jaxpr.jaxpr
    producer = DefUse(jaxpr).producer_eqn(var)
    where = f" (last computed at {user_code_line(producer.source_info)})" if producer else ""
    opaque = sorted({e.primitive.name for e in iter_eqns(jaxpr) if e.primitive.name in OPAQUE_PRIMITIVES})
    sources = "batch data, replica_id()" + (f", or the results of {', '.join(opaque)}" if opaque else "")
    callback_fix = (
        " If a jax.pure_callback in the step is a pure function of its inputs, declare it with "
        "rp.invariant_callback(fn): its result then varies only as its inputs do."
        if "pure_callback" in opaque
        else ""
    )
    head = (
        f"{path} enters the step identical on every replica but would leave it "
        f"different between replicas{where}: it depends on per-replica values "
        f"({sources}) along {_axes_named(graph.context, frozenset(variance))}. "
        f"The replicas' copies would silently drift apart.\n"
    )
    if isinstance(var, Var) and not _from_gradients(jaxpr, var, info.variance):
        axis = next((n for n, group in graph.context.axis_names if group is None), None)
        mean = f"lax.pmean(stats, {axis!r}) or nn.BatchNorm(axis_name={axis!r})" if axis else "rp.all_mean(stats)"
        return head + (
            f"It is computed from per-replica statistics of the batch (not from gradients), as a batch "
            f"norm's running mean and variance are.\n"
            f"Fix: all_mean the statistics across replicas before they update the state (cross-replica "
            f"batch norm: {mean}), or, if every replica is meant to keep its own copy (as jax.pmap keeps "
            f"per-device batch statistics), declare the leaf per-replica: "
            f"repl.run(step_fn, input_fn, state, per_replica_state=...) marking {path} True; it then "
            f"carries a leading axis of size num_replicas, one row per replica.{callback_fix}"
        )
    return head + (
        f"Fix: average what updates it across replicas, e.g. "
        f"grads = rp.all_mean(grads) before the update (or wrap the optimizer), "
        f"or return the per-replica value as an output instead of state.{callback_fix}"
    )
