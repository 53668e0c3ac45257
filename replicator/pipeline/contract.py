"""The pass contract: a named, pure ``StepGraph -> StepGraph`` rewrite and its result.

A pass takes a :class:`~replicator.core.graph.StepGraph` (the per-replica jaxpr
of one step plus what its inputs and outputs mean) and returns a
:class:`PassResult`: a new graph and whether anything changed. Passes never
mutate their input. Ordering attributes (``first``, ``needs_placeholders``,
``lowers``, ``run_after``) are checked when a :class:`~replicator.pipeline.pipeline.Pipeline`
is built.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jax.extend.core import ClosedJaxpr

from replicator.core.graph import StepGraph
from replicator.core.jaxprs import EqnRule, rewrite_jaxpr

__all__ = ["Pass", "PassResult", "rewrite_graph"]


@dataclasses.dataclass(frozen=True)
class PassResult:
    graph: StepGraph
    changed: bool


class Pass:
    """A named, pure graph-to-graph rewrite. Subclasses set ``name`` and ``run``.

    Configuration goes in the constructor; ``run`` must not mutate its input.
    """

    name: ClassVar[str] = "unnamed-pass"
    #: A pass that must run for the step to execute (cannot be disabled).
    required: ClassVar[bool] = False
    #: False for a pass that changes precision on purpose (translation
    #: validation then allows a bf16-sized difference).
    exact: ClassVar[bool] = True
    #: The pass works on placeholders: it must come before the pass that
    #: lowers them (a pipeline that puts it after raises when it is built).
    needs_placeholders: ClassVar[bool] = True
    #: The pass replaces the placeholders by mesh collectives.
    lowers: ClassVar[bool] = False
    #: The pass must come before the library's passes (``capture-collectives``).
    first: ClassVar[bool] = False
    #: Names of passes that, when in the same pipeline, must run before this one.
    run_after: ClassVar[tuple[str, ...]] = ()

    def run(self, graph: StepGraph) -> PassResult:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def rewrite_graph(graph: StepGraph, rule: EqnRule) -> PassResult:
    """:func:`rewrite_jaxpr` on a step graph's top-level jaxpr."""
    closed = graph.jaxpr
    new, changed = rewrite_jaxpr(closed.jaxpr, rule)
    if not changed:
        return PassResult(graph, False)
    return PassResult(graph.with_jaxpr(ClosedJaxpr(new, closed.consts)), True)
