"""The pass contract: a named, pure ``StepGraph -> StepGraph`` rewrite and its result.

A pass takes a :class:`~replicator.core.graph.StepGraph` (the per-replica jaxpr
of one step plus what its inputs and outputs mean) and returns a
:class:`PassResult`: a new graph and whether anything changed. Passes never
mutate their input. Ordering attributes (``first``, ``needs_placeholders``,
``lowers``, ``run_after``) are checked when a :class:`~replicator.pass_manager.manager.PassManager`
is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var

from replicator.analysis.records import origin_of, pass_on_origin
from replicator.core.graph import Origin, StepGraph
from replicator.core.jaxprs import EqnRule, inline_function, recompute_named_axis_effects, rewrite_jaxpr

__all__ = ["Pass", "PassResult", "replace_placeholders", "rewrite_graph"]


@dataclasses.dataclass(frozen=True)
class PassResult:
    graph: StepGraph
    changed: bool
    #: What the pass wants the user to know (``explain`` prints it), e.g. why it left something alone.
    notes: tuple[str, ...] = ()

    @classmethod
    def rewritten(
        cls,
        graph: StepGraph,
        jaxpr: Jaxpr,
        changed: bool,
        *,
        origins: Mapping[Var, Origin] | None = None,
        recompute_effects: bool = False,
    ) -> PassResult:
        """The tail of every rewrite pass: ``graph`` with its top-level ``jaxpr`` rewritten.

        Args:
          graph: the graph the pass was given (not modified).
          jaxpr: the rewritten top-level jaxpr (``graph``'s constants are kept).
          changed: whether the rewrite replaced anything; if not, the result is
            ``PassResult(graph, False)`` and the other arguments are ignored.
          origins: the new graph's ``collective_origins`` (what each placeholder
            carries, the new ones included).
          recompute_effects: recompute the named-axis effects of calls and control
            flow from their rewritten bodies (a pass that renames or removes raw
            collectives).
        """
        if not changed:
            return cls(graph, False)
        if recompute_effects:
            jaxpr = recompute_named_axis_effects(jaxpr)
        result = graph.with_jaxpr(ClosedJaxpr(jaxpr, graph.jaxpr.consts))
        if origins is not None:
            result = dataclasses.replace(result, collective_origins=dict(origins))
        return cls(result, True)


class Pass:
    """A named, pure graph-to-graph rewrite. Subclasses set ``name`` and ``run``.

    Configuration goes in the constructor; ``run`` must not mutate its input.
    """

    name: ClassVar[str] = "unnamed-pass"
    #: A pass that must run for the step to execute (cannot be disabled).
    required: ClassVar[bool] = False
    #: False for a pass that changes precision on purpose (translation
    #: validation then allows a bf16-sized difference, here and after it).
    exact: ClassVar[bool] = True
    #: The pass works on placeholders: it must come before the pass that
    #: lowers them (a pass manager that puts it after raises when it is built).
    needs_placeholders: ClassVar[bool] = True
    #: The pass replaces the placeholders by mesh collectives.
    lowers: ClassVar[bool] = False
    #: The pass must come before the library's passes (``capture-collectives``).
    first: ClassVar[bool] = False
    #: Names of passes that, when in the same pass manager, must run before this one.
    run_after: ClassVar[tuple[str, ...]] = ()

    def run(self, graph: StepGraph) -> PassResult:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def rewrite_graph(graph: StepGraph, rule: EqnRule, **options: Any) -> PassResult:
    """:func:`~replicator.core.jaxprs.rewrite_jaxpr` on a step graph's top-level jaxpr, then :meth:`PassResult.rewritten`.

    Args:
      graph: the graph to rewrite (not modified).
      rule: called on each equation, callees first (see ``rewrite_jaxpr``).
      options: ``origins`` and ``recompute_effects``, as for :meth:`PassResult.rewritten`
        (``rule`` may fill ``origins`` in as it goes: they are read after the rewrite).

    Returns:
      ``PassResult(graph, False)`` if ``rule`` replaced nothing, else the new graph.
    """
    new, changed = rewrite_jaxpr(graph.jaxpr.jaxpr, rule)
    return PassResult.rewritten(graph, new, changed, **options)


def replace_placeholders(
    graph: StepGraph, is_candidate: Callable[[JaxprEqn], bool], lowering: Callable[[JaxprEqn], Callable[..., Any]]
) -> PassResult:
    """Replace each equation that ``is_candidate`` accepts by the equations of ``lowering(eqn)(*operands)``.

    ``lowering(eqn)`` returns plain ``lax`` code (it may bind placeholders); each
    placeholder it emits carries what the replaced one carried (its
    :class:`~replicator.core.graph.Origin`), so the communication report still
    names the user's tensors and lines.
    """
    origins = dict(graph.collective_origins)

    def rule(eqn: JaxprEqn) -> tuple[list[JaxprEqn], list[Any]] | None:
        if not is_candidate(eqn):
            return None
        eqns, outs = inline_function(lowering(eqn), eqn.invars, context=graph.context, like=eqn)
        origins.update(pass_on_origin(origin_of(eqn, graph.collective_origins), eqns))
        return eqns, outs

    return rewrite_graph(graph, rule, origins=origins)
