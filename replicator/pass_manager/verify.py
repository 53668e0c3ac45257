"""Invariant checks run between passes.

Always, after every pass (cheap, linear): :func:`check_defined`, every
variable is defined before it is read, in every sub-jaxpr.

When a pass manager is asked to verify (``verify=True``, or ``REPLICATOR_VERIFY=1``
as the test suite sets; off by default because the type-check costs about as
much as tracing and all the passes together: ``benchmarks/bench_verify.py``
measures it):

* the jaxpr type-checks (``jax.extend.core.check_jaxpr``) under the mesh axes;
* after lowering, no placeholder is left anywhere (sub-jaxprs included);
* every real collective talks only over the mesh axes ``('workers', 'cores')``.

A pass manager re-raises a broken invariant as :class:`GraphInvariantError` naming
the pass that produced the graph. Example (a graph whose result is a variable
nothing defines):

>>> from jax.extend.core import ClosedJaxpr, Var
>>> from replicator.pass_manager.verify import GraphInvariantError, verify_graph
>>> graph = rp.Replicator(1, 8).lower(lambda b: rp.all_sum(b), np.ones((8, 3), np.float32)).traced
>>> jaxpr = graph.jaxpr.jaxpr
>>> broken = jaxpr.replace(outvars=[Var(jaxpr.outvars[0].aval), *jaxpr.outvars[1:]])
>>> try:
...     verify_graph(graph.with_jaxpr(ClosedJaxpr(broken, graph.jaxpr.consts)), lowered=False)
... except GraphInvariantError as e:
...     print(str(e).endswith("is never defined"))
True
"""

from __future__ import annotations

from jax.extend.core import Jaxpr, Var, check_jaxpr

from replicator._jax_compat import extend_axis_env
from replicator.core.context import REPLICA_AXES
from replicator.core.graph import StepGraph
from replicator.core.jaxprs import iter_eqns, sub_jaxprs
from replicator.core.primitives import PLACEHOLDERS
from replicator.errors import PassError

__all__ = ["GraphInvariantError", "check_defined", "verify_graph"]

_AXIS_PARAMS = ("axes", "axis_name")
#: Real collectives whose named axes must be mesh axes.
MESH_COLLECTIVES = frozenset(
    ["psum", "pmax", "pmin", "all_gather", "reduce_scatter", "all_to_all", "ppermute", "axis_index", "pbroadcast"]
)


class GraphInvariantError(PassError, AssertionError):
    """A pass produced a graph that breaks an invariant (a bug in that pass).

    A :class:`~replicator.errors.PassError` (and, as before, an ``AssertionError``).
    """


def _axes_of(eqn) -> tuple:
    for key in _AXIS_PARAMS:
        if key in eqn.params:
            value = eqn.params[key]
            return value if isinstance(value, tuple) else (value,)
    return ()


def _check_defined(jaxpr: Jaxpr, where: str) -> None:
    defined = set(jaxpr.invars) | set(jaxpr.constvars)
    for index, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, Var) and v not in defined:
                raise GraphInvariantError(
                    f"{where}equation {index} ({eqn.primitive.name}) reads {v}, which is never defined before it"
                )
        for sub in sub_jaxprs(eqn.params):
            _check_defined(sub, f"{where}a sub-graph of equation {index} ({eqn.primitive.name}): ")
        defined.update(v for v in eqn.outvars if isinstance(v, Var))
    for v in jaxpr.outvars:
        if isinstance(v, Var) and v not in defined:
            raise GraphInvariantError(f"{where}the result {v} is never defined")


def check_defined(graph: StepGraph) -> None:
    """Raise :class:`GraphInvariantError` if some equation reads a variable not defined before it."""
    _check_defined(graph.jaxpr.jaxpr, "")


def verify_graph(graph: StepGraph, *, lowered: bool) -> None:
    """Raise :class:`GraphInvariantError` if ``graph`` breaks an invariant."""
    check_defined(graph)
    jaxpr = graph.jaxpr.jaxpr
    tensor = [(graph.tensor.axis, graph.tensor.size)] if graph.tensor is not None else []
    try:
        with extend_axis_env([*graph.context.axis_env, *tensor]):
            check_jaxpr(jaxpr)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise GraphInvariantError(f"the jaxpr does not type-check: {e}") from e
    # Before capture-collectives, raw collectives may use the user's axis names.
    allowed = set(REPLICA_AXES) | ({name for name, _ in graph.context.axis_names} if not lowered else set())
    allowed |= {name for name, _ in tensor}
    for eqn in iter_eqns(jaxpr):
        if lowered and eqn.primitive in PLACEHOLDERS:
            raise GraphInvariantError(f"placeholder '{eqn.primitive.name}' left after lowering")
        if eqn.primitive.name not in MESH_COLLECTIVES:
            continue
        bad = [a for a in _axes_of(eqn) if isinstance(a, str) and a not in allowed]  # ints: local (vmap) axes
        if bad:
            raise GraphInvariantError(f"'{eqn.primitive.name}' uses axes {bad}, not mesh axes {REPLICA_AXES}")
