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

from jax.extend.core import Jaxpr, JaxprEqn

from replicator._jax_compat import (
    user_source_line,
)
from replicator.analysis.invariance import OPAQUE_PRIMITIVES, analyze
from replicator.core.graph import StepGraph
from replicator.core.jaxprs import iter_eqns
from replicator.errors import DivergentStateError
from replicator.pipeline.contract import Pass, PassResult

__all__ = ["CheckReplicaInvariance"]


def _producer(jaxpr: Jaxpr, var: Any) -> JaxprEqn | None:
    for eqn in jaxpr.eqns:
        if any(o is var for o in eqn.outvars):
            return eqn
    return None


class CheckReplicaInvariance(Pass):
    """Reject divergent control flow around collectives and divergent state.

    Changes nothing; raises :class:`DivergentControlFlowError` or
    :class:`DivergentStateError` with the user's source line and a fix.
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
                producer = _producer(jaxpr, var)
                where = f" (last computed at {user_source_line(producer.source_info)})" if producer else ""
                opaque = sorted({e.primitive.name for e in iter_eqns(jaxpr) if e.primitive.name in OPAQUE_PRIMITIVES})
                sources = "batch data, replica_id()" + (f", or the results of {', '.join(opaque)}" if opaque else "")
                callback_fix = (
                    " If a jax.pure_callback in the step is a pure function of its inputs, declare it with "
                    "rp.invariant_callback(fn): its result then varies only as its inputs do."
                    if "pure_callback" in opaque
                    else ""
                )
                raise DivergentStateError(
                    f"{path} enters the step identical on every replica but would leave it "
                    f"different between replicas{where}: it depends on per-replica values "
                    f"({sources}) along mesh axes {tuple(sorted(variance))}. "
                    f"The replicas' copies would silently drift apart.\n"
                    f"Fix: average what updates it across replicas, e.g. "
                    f"grads = rp.all_mean(grads) before the update (or wrap the optimizer), "
                    f"or return the per-replica value as an output instead of state.{callback_fix}"
                )
        return PassResult(graph, False)
