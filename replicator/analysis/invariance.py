"""Replica-invariance analysis: which values are identical on every replica.

Every value of the per-replica graph gets the set of mesh axes along which it
*may* differ between replicas (empty: identical everywhere). State enters
identical; batch data and ``replica_id()`` vary along both axes; a collective
over a group makes its result identical along the group's axes; everything
else varies wherever one of its inputs does.

The analysis is **conservative**: "invariant" is a proof, "varying" a
possibility. Rules live in one table keyed by primitive (:data:`RULES`), next
to the primitives they handle. A primitive without a rule is a pure function
of its inputs (it varies wherever they do) unless it holds sub-graphs: an
unknown higher-order primitive whose body contains a cross-replica operation
is assumed to vary along every mesh axis, and a collective inside one is
rejected (:class:`UnanalyzableStepError`), since nothing proves the replicas
all reach it. Effectful equations and host callbacks vary along every axis.

The ``check-replica-invariance`` pass uses it to reject, at trace time, the two
bugs that make data-parallel jobs hang or silently diverge:

* a collective inside ``cond``/``while`` whose predicate can differ between
  the replicas that collective talks to (they would wait for each other
  forever, or pair up wrong calls);
* a state leaf that enters identical on all replicas and would leave
  different (the model copies drift apart, e.g. gradients not averaged).

Example: the state is invariant, the batch varies along both mesh axes, and
an all-reduce over ``'cores'`` leaves it varying along ``'workers'`` only:

>>> from replicator.analysis.invariance import analyze
>>> def step(state, batch):
...     return state, (state * 2, batch, rp.all_sum(batch, group="cores"))
>>> graph = rp.Replicator(2, 4).lower(step, np.ones((4, 3), np.float32), np.float32(1)).traced
>>> [sorted(v) for v in analyze(graph).output_variance]
[[], [], ['cores', 'workers'], ['workers']]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax import lax
from jax.extend.core import Jaxpr, JaxprEqn, Literal, Primitive, Var
from jax.extend.core import primitives as jax_primitives

from replicator._jax_compat import (
    UNKNOWN_LOCATION,
    callback_function,
    named_axis_effect_type,
    scan_operand_counts,
    user_source_line,
)
from replicator.core.callbacks import is_invariant_callback
from replicator.core.context import group_axes
from replicator.core.graph import StepGraph
from replicator.core.jaxprs import CALL_PRIMITIVES, iter_eqns, open_jaxpr, sub_jaxprs
from replicator.core.primitives import (
    PLACEHOLDERS,
    all_gather_p,
    all_reduce_p,
    broadcast_p,
    collective_name,
    reduce_scatter_p,
    replica_id_p,
)
from replicator.errors import DivergentControlFlowError, UnanalyzableStepError

__all__ = [
    "INVARIANT",
    "OPAQUE_PRIMITIVES",
    "RULES",
    "InvarianceInfo",
    "Variance",
    "VarianceAnalysis",
    "analyze",
    "rule_for",
    "variance_of",
]

Variance = frozenset  # of mesh axis names
INVARIANT: Variance = frozenset()
Rule = Callable[["VarianceAnalysis", JaxprEqn, list[Variance]], list[Variance]]
#: The variance rule of each primitive; :func:`rule_for` falls back to a
#: conservative default for the others.
RULES: dict[Primitive, Rule] = {}


@dataclasses.dataclass(frozen=True)
class InvarianceInfo:
    """Result of :func:`analyze` on a step graph's top-level jaxpr."""

    variance: dict[Var, Variance]  # top-level vars only
    output_variance: tuple[Variance, ...]

    def is_invariant(self, atom: Any) -> bool:
        return variance_of(self.variance, atom) == INVARIANT


def variance_of(env: dict[Var, Variance], atom: Any) -> Variance:
    """The variance of a literal (invariant) or of a var defined in ``env``."""
    if isinstance(atom, Literal):
        return INVARIANT
    return env[atom]


def _union(vs: Sequence[Variance]) -> Variance:
    out: set = set()
    for v in vs:
        out |= v
    return frozenset(out)


#: Primitives whose results may differ between replicas whatever their inputs.
# Primitives whose result may differ per device even from identical inputs:
# host callbacks, per-device random bits (``lax.rng_uniform``) and foreign
# function calls, whose semantics the analysis cannot see.
OPAQUE_PRIMITIVES = frozenset(["pure_callback", "io_callback", "rng_uniform", "ffi_call"])


class VarianceAnalysis:
    """Forward data-flow over one jaxpr and its sub-jaxprs.

    ``run(jaxpr, in_variance)`` returns the variance of the outputs and of
    every var of ``jaxpr`` (not of its sub-jaxprs).
    """

    def __init__(self, axis_sizes: dict[str, int]):
        # Axes of size 1 cannot make values differ.
        self.live_axes = frozenset(a for a, n in axis_sizes.items() if n > 1)

    def axes(self, group: str | None) -> Variance:
        return frozenset(group_axes(group)) & self.live_axes

    def named_axes(self, names: Any) -> Variance:
        """The live mesh axes among a raw collective's ``axis_name``/``axes``."""
        names = names if isinstance(names, tuple) else (names,)
        return frozenset(names) & self.live_axes

    def run(self, jaxpr: Jaxpr, in_variance: Sequence[Variance]) -> tuple[list[Variance], dict[Var, Variance]]:
        env: dict[Var, Variance] = dict(zip(jaxpr.invars, in_variance, strict=True))
        for v in jaxpr.constvars:
            env[v] = INVARIANT
        for eqn in jaxpr.eqns:
            ins = [variance_of(env, a) for a in eqn.invars]
            outs = rule_for(eqn.primitive)(self, eqn, ins)
            # A NamedAxisEffect only says the equation talks over a mesh axis (a collective over the
            # tensor axis, replicator.tensor.split_graph): its rule above says what that does.
            effects = [e for e in eqn.effects if not isinstance(e, _NAMED_AXIS_EFFECT)]
            if effects or eqn.primitive.name in OPAQUE_PRIMITIVES:
                # Host callbacks and effectful code may return per-replica data, unless the user
                # declared a pure callback a function of its inputs (rp.invariant_callback).
                declared = not effects and eqn.primitive.name == "pure_callback"
                declared = declared and is_invariant_callback(callback_function(eqn.params))
                outs = [_union(ins) if declared else self.live_axes] * len(eqn.outvars)
            for var, v in zip(eqn.outvars, outs, strict=True):
                env[var] = v
        return [variance_of(env, a) for a in jaxpr.outvars], env


_NAMED_AXIS_EFFECT = named_axis_effect_type()


def _placeholders_in(jaxprs: Sequence[Jaxpr]) -> list[JaxprEqn]:
    return [e for j in jaxprs for e in iter_eqns(j) if e.primitive in PLACEHOLDERS]


def _default_rule(analysis: VarianceAnalysis, eqn: JaxprEqn, ins: list[Variance]) -> list[Variance]:
    """A primitive without a rule: its inputs' variance, or worse.

    A first-order primitive is a function of its inputs. A higher-order one
    (it holds sub-graphs) that we cannot look into is assumed to vary along
    every mesh axis if its body uses a cross-replica operation, and a
    collective in it is rejected: nothing proves every replica reaches it.
    """
    v = _union(ins)
    inner = _placeholders_in(list(sub_jaxprs(eqn.params)))
    if inner:
        collectives = [e for e in inner if e.primitive is not replica_id_p]
        if collectives:
            name = collective_name(collectives[0].primitive, collectives[0].params)
            raise UnanalyzableStepError(
                f"{name} at {user_source_line(collectives[0].source_info)} is inside a "
                f"'{eqn.primitive.name}' at {user_source_line(eqn.source_info)}, a JAX primitive whose "
                f"sub-graph replicator's replica-invariance analysis has no rule for, so it cannot prove "
                f"that every replica runs this collective.\n"
                f"Fix: call the collective outside that transformation (before or after it), or disable "
                f"the check with PassManager(disable=['check-replica-invariance']) if you are sure; please "
                f"report the primitive so a rule can be added."
            )
        v = analysis.live_axes
    return [v] * len(eqn.outvars)


def rule_for(prim: Primitive) -> Rule:
    """The variance rule of ``prim`` (the conservative default if none)."""
    return RULES.get(prim, _default_rule)


# -- placeholders ----------------------------------------------------------------


def _reducing_rule(analysis: VarianceAnalysis, eqn: JaxprEqn, ins: list[Variance]) -> list[Variance]:
    axes = analysis.axes(eqn.params["group"])
    return [v - axes for v in ins]


for _p in (all_reduce_p, all_gather_p, broadcast_p):
    RULES[_p] = _reducing_rule

RULES[reduce_scatter_p] = lambda a, eqn, ins: [ins[0] | a.axes(eqn.params["group"])]
RULES[replica_id_p] = lambda a, eqn, ins: [a.axes(eqn.params["group"])]


# -- raw mesh collectives (in lowered graphs) -------------------------------------


def _raw_reducing_rule(param: str) -> Rule:
    def rule(analysis: VarianceAnalysis, eqn: JaxprEqn, ins: list[Variance]) -> list[Variance]:
        axes = analysis.named_axes(eqn.params[param])
        return [v - axes for v in ins]

    return rule


def _raw_spreading_rule(analysis: VarianceAnalysis, eqn: JaxprEqn, ins: list[Variance]) -> list[Variance]:
    axes = analysis.named_axes(eqn.params["axis_name"])
    return [_union(ins) | axes] * len(eqn.outvars)


for _p in (jax_primitives.psum_p, jax_primitives.pmax_p, jax_primitives.pmin_p):
    RULES[_p] = _raw_reducing_rule("axes")
RULES[jax_primitives.all_gather_p] = _raw_reducing_rule("axis_name")
# A permutation leaves zeros on replicas nobody sends to; chunks differ per replica.
for _p in (jax_primitives.axis_index_p, jax_primitives.ppermute_p, jax_primitives.all_to_all_p):
    RULES[_p] = _raw_spreading_rule


# -- control flow --------------------------------------------------------------


def _collectives_in(jaxprs: Sequence[Jaxpr]) -> list[JaxprEqn]:
    return [e for e in _placeholders_in(jaxprs) if e.primitive is not replica_id_p]


def _check_uniform_predicate(
    analysis: VarianceAnalysis, eqn: JaxprEqn, predicate: Variance, bodies: Sequence[Jaxpr], what: str
) -> None:
    if not predicate:
        return
    for inner in _collectives_in(bodies):
        axes = analysis.axes(inner.params["group"])
        if axes & predicate:
            name = collective_name(inner.primitive, inner.params)
            where = user_source_line(eqn.source_info)
            inner_where = user_source_line(inner.source_info)
            if inner_where == UNKNOWN_LOCATION:  # e.g. rp.all_mean passed directly as a branch
                inner_where = f"a branch or body of the {what}"
            raise DivergentControlFlowError(
                f"{name} at {inner_where} is inside a {what} at "
                f"{where} whose predicate can differ between "
                f"replicas (it depends on values that vary along mesh axes "
                f"{tuple(sorted(predicate))}, e.g. batch data or replica_id()). Replicas that "
                f"take different paths would wait forever for each other in this collective "
                f"or silently pair it with a different one.\n"
                f"Fix: make the predicate identical on every replica (compute it from state, "
                f"or reduce it first, e.g. pred = rp.all_max(pred) or a decision on "
                f"rp.all_mean(x)), or move {name} out of the {what} and select its result "
                f"with jnp.where."
            )


def _cond_rule(analysis: VarianceAnalysis, eqn: JaxprEqn, ins: list[Variance]) -> list[Variance]:
    predicate, operands = ins[0], ins[1:]
    branches = [open_jaxpr(b) for b in eqn.params["branches"]]
    _check_uniform_predicate(analysis, eqn, predicate, branches, "lax.cond/switch")
    outs = [analysis.run(b, operands)[0] for b in branches]
    return [_union(vs) | predicate for vs in zip(*outs, strict=True)]


# An optimization barrier passes each operand through unchanged (it only orders work).
RULES[lax.optimization_barrier_p] = lambda a, eqn, ins: list(ins)

RULES[jax_primitives.cond_p] = _cond_rule


def _fixpoint(step: Callable[[list[Variance]], list[Variance]], carry: list[Variance]) -> list[Variance]:
    while True:
        new = [c | n for c, n in zip(carry, step(carry), strict=True)]
        if new == carry:
            return carry
        carry = new


def _while_rule(analysis: VarianceAnalysis, eqn: JaxprEqn, ins: list[Variance]) -> list[Variance]:
    p = eqn.params
    cond_consts = ins[: p["cond_nconsts"]]
    body_consts = ins[p["cond_nconsts"] : p["cond_nconsts"] + p["body_nconsts"]]
    carry = list(ins[p["cond_nconsts"] + p["body_nconsts"] :])
    cond_j, body_j = open_jaxpr(p["cond_jaxpr"]), open_jaxpr(p["body_jaxpr"])

    def step(c: list[Variance]) -> list[Variance]:
        (predicate,), _ = analysis.run(cond_j, cond_consts + c)
        body_out, _ = analysis.run(body_j, body_consts + c)
        # A trip count that differs between replicas makes every carry differ.
        return [v | predicate for v in body_out]

    carry = _fixpoint(step, carry)
    (predicate,), _ = analysis.run(cond_j, cond_consts + carry)
    _check_uniform_predicate(analysis, eqn, predicate, [cond_j, body_j], "lax.while_loop")
    return carry


RULES[jax_primitives.while_p] = _while_rule


def _scan_rule(analysis: VarianceAnalysis, eqn: JaxprEqn, ins: list[Variance]) -> list[Variance]:
    p = eqn.params
    n_consts, n_carry = scan_operand_counts(p)
    consts, carry, xs = ins[:n_consts], list(ins[n_consts : n_consts + n_carry]), ins[n_consts + n_carry :]
    body = open_jaxpr(p["jaxpr"])

    def step(c: list[Variance]) -> list[Variance]:
        return analysis.run(body, consts + c + xs)[0][:n_carry]

    carry = _fixpoint(step, carry)
    outs, _ = analysis.run(body, consts + carry + xs)
    return carry + outs[n_carry:]


RULES[jax_primitives.scan_p] = _scan_rule


def _call_rule(param: str) -> Rule:
    """A call: the callee runs once on the trailing operands (unconditionally)."""

    def rule(analysis: VarianceAnalysis, eqn: JaxprEqn, ins: list[Variance]) -> list[Variance]:
        inner = open_jaxpr(eqn.params[param])
        return analysis.run(inner, ins[len(ins) - len(inner.invars) :])[0]

    return rule


for _p, _param in CALL_PRIMITIVES.items():
    RULES[_p] = _call_rule(_param)


# -- the analysis and the pass -------------------------------------------------


def analyze(graph: StepGraph) -> InvarianceInfo:
    """Variance of every top-level value of ``graph`` (replicated state in: invariant)."""
    analysis = VarianceAnalysis(graph.context.axis_sizes)
    both = analysis.live_axes
    # A sharded state leaf enters as this replica's own chunk: it varies.
    state = [both if i in graph.sharded_state else INVARIANT for i in range(graph.num_state)]
    ins = state + [both] * graph.num_batch
    outs, env = analysis.run(graph.jaxpr.jaxpr, ins)
    return InvarianceInfo(variance=env, output_variance=tuple(outs))
