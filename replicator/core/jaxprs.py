"""What a pass is, what it works on, and the helpers every pass shares.

A pass takes a :class:`StepGraph` (the per-replica jaxpr of one step plus what
its inputs and outputs mean) and returns a :class:`PassResult`: a new graph and
whether anything changed. Passes never mutate their input.

The helpers here do the bookkeeping of rewriting jaxprs:

* :func:`rewrite_jaxpr` walks the equations of a jaxpr (and, callees first,
  every sub-jaxpr of ``jit``/``cond``/``scan``/``while``/``remat``/custom
  derivative calls) and lets a rule replace single equations;
* :func:`inline_function` traces a plain JAX function on the avals of some
  atoms and returns its equations, renamed, ready to splice into a graph. A
  rewrite rule is therefore written as ordinary ``lax`` code;
* :class:`DefUse` holds the def-use facts of one region (which equation
  defines a variable, which equations read it, what the region returns, what
  crosses a cut between two equations), for a rewrite that spans several
  equations: plan on the facts, then rewrite with :func:`rewrite_jaxpr`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Primitive, Var
from jax.extend.core import primitives as jax_primitives

from replicator._jax_compat import custom_vmap_call_primitive, extra_call_params
from replicator.core.context import ReplicaContext
from replicator.core.graph import StepGraph

__all__ = [
    "CALL_PARAMS",
    "CALL_PRIMITIVES",
    "DefUse",
    "StepGraph",
    "count_primitives",
    "inline_function",
    "iter_eqns",
    "iter_regions",
    "map_subjaxprs",
    "merge_effects",
    "open_jaxpr",
    "region_name",
    "recompute_named_axis_effects",
    "rewrite_jaxpr",
    "sub_jaxprs",
]

Atom = Any  # Var | Literal

#: Call-like primitives and the param holding the callee, whose inputs are the
#: trailing operands of the equation.
CALL_PRIMITIVES: dict[Primitive, str] = {
    p: param
    for p, param in (
        (jax_primitives.jit_p, "jaxpr"),
        (jax_primitives.closed_call_p, "call_jaxpr"),
        (jax_primitives.call_p, "call_jaxpr"),
        (jax_primitives.remat_p, "jaxpr"),
        (jax_primitives.custom_jvp_call_p, "call_jaxpr"),
        (jax_primitives.custom_vjp_call_p, "call_jaxpr"),
        (custom_vmap_call_primitive(), "call"),
    )
    if p is not None
}
#: :data:`CALL_PRIMITIVES` by primitive name (and the names that differ between JAX versions).
CALL_PARAMS: dict[str, str] = {**{p.name: param for p, param in CALL_PRIMITIVES.items()}, **extra_call_params()}
EqnRule = Callable[[JaxprEqn], "tuple[list[JaxprEqn], list[Atom]] | None"]


# ----------------------------------------------------------------------------
# Walking and rewriting jaxprs
# ----------------------------------------------------------------------------


def _map_param(value: Any, fn: Callable[[Jaxpr], Jaxpr]) -> Any:
    if isinstance(value, ClosedJaxpr):
        new = fn(value.jaxpr)
        return value if new is value.jaxpr else ClosedJaxpr(new, value.consts)
    if isinstance(value, Jaxpr):
        return fn(value)
    if isinstance(value, tuple) and any(isinstance(v, (Jaxpr, ClosedJaxpr)) for v in value):
        items = [_map_param(v, fn) for v in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        # A named tuple (``custom_linear_solve``'s jaxprs) keeps its type: the
        # primitive reads its fields by name.
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def open_jaxpr(x: Jaxpr | ClosedJaxpr) -> Jaxpr:
    """The ``Jaxpr`` of a param that may hold a closed or an open one (``remat``)."""
    return x.jaxpr if isinstance(x, ClosedJaxpr) else x


def sub_jaxprs(params: dict) -> Iterator[Jaxpr]:
    """The (open) sub-jaxprs held in an equation's params, in params order."""
    for value in params.values():
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, Jaxpr):
                yield item


def map_subjaxprs(eqn: JaxprEqn, fn: Callable[[Jaxpr], Jaxpr]) -> JaxprEqn:
    """Apply ``fn`` to every sub-jaxpr in ``eqn``'s params (not recursively).

    The equation's effects are widened by the new bodies' effects (a lowered
    collective carries a named-axis effect that its enclosing ``cond`` must
    declare too).
    """
    params = {k: _map_param(v, fn) for k, v in eqn.params.items()}
    if all(params[k] is eqn.params[k] for k in params):
        return eqn
    return eqn.replace(params=params, effects=merge_effects(sub_jaxprs(params), base=eqn.effects))


def merge_effects(items: Iterable[Any], *, base: Iterable[Any] = ()) -> frozenset:
    """The union of ``base`` and the ``effects`` of every item (equations or jaxprs).

    What a rewritten jaxpr declares (the effects of its new equations), or an
    equation whose sub-jaxprs changed (its own and its bodies').
    """
    effects = set(base)
    for item in items:
        effects |= set(item.effects)
    return frozenset(effects)


def iter_eqns(jaxpr: Jaxpr) -> Iterator[JaxprEqn]:
    """Every equation of ``jaxpr`` and of its sub-jaxprs, recursively."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn.params):
            yield from iter_eqns(sub)


def region_name(region: str, eqn: JaxprEqn, index: int, sub_index: int) -> str:
    """The name of sub-jaxpr ``sub_index`` of equation ``index`` of ``region``, e.g. ``'step/scan@7.0'``."""
    return f"{region}/{eqn.primitive.name}@{index}.{sub_index}"


def iter_regions(jaxpr: Jaxpr, region: str = "step") -> Iterator[tuple[str, JaxprEqn]]:
    """Like :func:`iter_eqns`, callees first, with each equation's region (:func:`region_name`)."""
    for index, eqn in enumerate(jaxpr.eqns):
        for k, sub in enumerate(sub_jaxprs(eqn.params)):
            yield from iter_regions(sub, region_name(region, eqn, index, k))
        yield region, eqn


def count_primitives(jaxpr: Jaxpr | ClosedJaxpr, names: Sequence[str] | None = None) -> dict[str, int]:
    """How many equations of each primitive, recursively (for tests and reports)."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    counts: dict[str, int] = {}
    for eqn in iter_eqns(jaxpr):
        name = eqn.primitive.name
        if names is None or name in names:
            counts[name] = counts.get(name, 0) + 1
    return counts


# ----------------------------------------------------------------------------
# Def-use facts of one region
# ----------------------------------------------------------------------------


def _is_var(atom: Atom) -> bool:
    """A variable that can be read: not a literal, not a dropped result."""
    return isinstance(atom, Var) and not isinstance(atom, DropVar)


class DefUse:
    """Def-use facts of one region: who defines each variable, who reads it, what the region returns.

    A region is one jaxpr's own equations, numbered by their index in
    ``jaxpr.eqns``. Its sub-jaxprs (the bodies of ``jit``, ``cond``, ``scan``,
    ``while``, ``remat``, custom-derivative calls) are regions of their own with
    their own variables: the equation that holds a sub-jaxpr reads the operands
    it passes in, and nothing here says what happens inside (build a ``DefUse``
    of the sub-jaxpr for that; a rewrite that keeps to one region never moves
    code across a control-flow boundary). Literals and dropped results
    (``DropVar``) are not variables: they have no producer and no readers, and
    asking about them answers ``None`` or nothing.

    The facts are those of ``jaxpr`` when it was built (build a new one after a
    rewrite). :func:`rewrite_jaxpr` keeps the result variables of the equations
    its rule is shown, so a plan keyed by result variables (``eqn.outvars``)
    still finds them there; their operands may have been renamed. A pass that
    rewrites across several equations (docs/design/architecture.md, "A rewrite
    across several equations") plans on these facts, then rewrites.

    Example (``a`` is read twice by equation 1, once by 2, and returned;
    ``y`` is never read):

    >>> from replicator.core.jaxprs import DefUse
    >>> def f(x, y):
    ...     a = jnp.sin(x)  # equation 0
    ...     b = a * a  # 1
    ...     return b + a, a  # 2
    >>> jaxpr = jax.make_jaxpr(f)(1.0, 2.0).jaxpr
    >>> facts = DefUse(jaxpr)
    >>> x, y = jaxpr.invars
    >>> (a,), (b,) = jaxpr.eqns[0].outvars, jaxpr.eqns[1].outvars
    >>> facts.producer(a), facts.readers(a), facts.output_positions(a)
    (0, (1, 2), (1,))
    >>> facts.producer(x), facts.is_input(x), facts.is_used(y)
    (None, True, False)
    >>> facts.live_after(1) == (a, b)  # what a cut after equation 1 must carry over
    True
    """

    def __init__(self, jaxpr: Jaxpr):
        self.jaxpr = jaxpr
        self._inputs: dict[Var, None] = dict.fromkeys(v for v in (*jaxpr.constvars, *jaxpr.invars) if _is_var(v))
        self._producer: dict[Var, int] = {}
        self._readers: dict[Var, list[int]] = {}
        self._outputs: dict[Var, list[int]] = {}
        for index, eqn in enumerate(jaxpr.eqns):
            for atom in eqn.invars:
                if _is_var(atom):
                    readers = self._readers.setdefault(atom, [])
                    if not readers or readers[-1] != index:  # an equation reading it twice is one reader
                        readers.append(index)
            for atom in eqn.outvars:
                if _is_var(atom):
                    self._producer[atom] = index
        for position, atom in enumerate(jaxpr.outvars):
            if _is_var(atom):
                self._outputs.setdefault(atom, []).append(position)

    def producer(self, atom: Atom) -> int | None:
        """The index of the equation that defines ``atom``; ``None`` for an input, a literal or another region's."""
        return self._producer.get(atom) if _is_var(atom) else None

    def producer_eqn(self, atom: Atom) -> JaxprEqn | None:
        """The equation that defines ``atom`` (see :meth:`producer`), or ``None``."""
        index = self.producer(atom)
        return None if index is None else self.jaxpr.eqns[index]

    def readers(self, atom: Atom) -> tuple[int, ...]:
        """The indices of the equations that read ``atom``, ascending, each once (an output is not a reader)."""
        return tuple(self._readers.get(atom, ())) if _is_var(atom) else ()

    def output_positions(self, atom: Atom) -> tuple[int, ...]:
        """Where ``atom`` appears in ``jaxpr.outvars`` (a variable may be returned several times)."""
        return tuple(self._outputs.get(atom, ())) if _is_var(atom) else ()

    def is_output(self, atom: Atom) -> bool:
        """Whether the region returns ``atom``."""
        return _is_var(atom) and atom in self._outputs

    def is_input(self, atom: Atom) -> bool:
        """Whether ``atom`` is one of the region's inputs (``invars`` or ``constvars``)."""
        return _is_var(atom) and atom in self._inputs

    def is_used(self, atom: Atom) -> bool:
        """Whether an equation reads ``atom`` or the region returns it."""
        return _is_var(atom) and (atom in self._readers or atom in self._outputs)

    def live_after(self, index: int) -> tuple[Var, ...]:
        """The variables a cut after equation ``index`` must carry over, in definition order.

        Those defined by the region's inputs or by ``eqns[: index + 1]`` that
        ``eqns[index + 1 :]`` read or that the region returns. ``index = -1``
        cuts before the first equation (the inputs that are used);
        ``index = len(eqns) - 1`` after the last (the variables returned).
        """
        n = len(self.jaxpr.eqns)
        if not -1 <= index < n:
            raise IndexError(f"DefUse.live_after({index}): the region has {n} equations; pass -1 to {n - 1}.")

        def crosses(var: Var) -> bool:
            return var in self._outputs or any(r > index for r in self._readers.get(var, ()))

        defined = [*self._inputs, *(v for eqn in self.jaxpr.eqns[: index + 1] for v in eqn.outvars if _is_var(v))]
        return tuple(v for v in defined if crosses(v))

    def dead_eqns(self) -> frozenset[int]:
        """The equations a dead-code sweep removes: without effects, and no result read by a kept one or returned.

        ``eqn.effects`` includes the effects of its sub-jaxprs; an equation
        with effects is always kept, and so is all it reads.
        """
        live = set(self._outputs)
        dead: set[int] = set()
        for index in range(len(self.jaxpr.eqns) - 1, -1, -1):
            eqn = self.jaxpr.eqns[index]
            if eqn.effects or any(_is_var(v) and v in live for v in eqn.outvars):
                live.update(v for v in eqn.invars if _is_var(v))
            else:
                dead.add(index)
        return frozenset(dead)


# ----------------------------------------------------------------------------
# Rewriting
# ----------------------------------------------------------------------------


def rewrite_jaxpr(jaxpr: Jaxpr, rule: EqnRule) -> tuple[Jaxpr, bool]:
    """Rewrite ``jaxpr`` equation by equation, callees before callers.

    Args:
      jaxpr: the graph to rewrite (not modified).
      rule: called on each equation (after its sub-jaxprs were rewritten);
        returns ``None`` to keep it, or ``(new_eqns, out_atoms)`` to replace it
        by ``new_eqns`` whose results ``out_atoms`` stand for its outputs. The
        equation it is shown has its original results (``eqn.outvars``) and its
        operands as rewritten so far. ``new_eqns`` and ``out_atoms`` may read
        any variable of the region as it was before the rewrite (one that a
        plan found with :class:`DefUse`, say): a variable that an earlier
        replacement stood in for is read as its stand-in.

    Returns:
      The new jaxpr and whether any equation was replaced.
    """
    env: dict[Var, Atom] = {}
    changed = False

    def read(atom: Atom) -> Atom:
        return env.get(atom, atom) if isinstance(atom, Var) else atom

    def renamed(atom: Atom) -> bool:
        return isinstance(atom, Var) and atom in env

    def rewrite_sub(sub: Jaxpr) -> Jaxpr:
        nonlocal changed
        new, sub_changed = rewrite_jaxpr(sub, rule)
        changed |= sub_changed
        return new if sub_changed else sub

    new_eqns: list[JaxprEqn] = []
    for eqn in jaxpr.eqns:
        if any(renamed(v) for v in eqn.invars):
            eqn = eqn.replace(invars=[read(v) for v in eqn.invars])
        eqn = map_subjaxprs(eqn, rewrite_sub)
        replacement = rule(eqn)
        if replacement is None:
            new_eqns.append(eqn)
            continue
        changed = True
        eqns, outs = replacement
        if env:  # the new equations may read what an earlier replacement renamed
            eqns = [
                e.replace(invars=[read(v) for v in e.invars]) if any(renamed(v) for v in e.invars) else e for e in eqns
            ]
            outs = [read(a) for a in outs]
        new_eqns.extend(eqns)
        for var, atom in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, DropVar):
                env[var] = atom
    if not changed:
        return jaxpr, False
    return jaxpr.replace(
        eqns=new_eqns,
        outvars=[read(v) for v in jaxpr.outvars],
        effects=merge_effects(new_eqns),
    ), True


def inline_function(
    fn: Callable[..., Any],
    in_atoms: Sequence[Atom],
    *,
    context: ReplicaContext,
    like: JaxprEqn | None = None,
    axis_env: Sequence[tuple[str, int]] | None = None,
) -> tuple[list[JaxprEqn], list[Atom]]:
    """Trace ``fn(*in_atoms)`` and return its equations, ready to splice.

    Args:
      fn: plain JAX code taking arrays and returning an array or a list of
        arrays; it may use mesh collectives over ``('workers', 'cores')``.
      in_atoms: the graph's vars/literals to feed it.
      context: the mesh shape (bound as ``axis_env`` while tracing).
      like: an equation whose source location the new equations inherit, so
        that errors and dumps still point at the user's line.
      axis_env: named axes to bind instead of ``context.axis_env`` (the
        folding pass binds the device mesh and the folded replica axes).

    Returns:
      ``(eqns, out_atoms)``: fresh equations and the atoms holding the results.
    """
    specs = [jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype, weak_type=a.aval.weak_type) for a in in_atoms]
    closed = jax.make_jaxpr(fn, axis_env=list(context.axis_env if axis_env is None else axis_env))(*specs)
    inner = closed.jaxpr
    env: dict[Var, Atom] = dict(zip(inner.invars, in_atoms, strict=True))
    for var, value in zip(inner.constvars, closed.consts, strict=True):
        if getattr(value, "shape", ()) != ():
            raise ValueError(f"inline_function: {fn} captured a non-scalar constant; pass it as an input.")
        env[var] = Literal(value, var.aval)

    def read(atom: Atom) -> Atom:
        return env.get(atom, atom) if isinstance(atom, Var) else atom

    eqns = []
    for eqn in inner.eqns:
        outvars = []
        for v in eqn.outvars:
            if isinstance(v, Var) and not isinstance(v, DropVar):
                fresh = Var(v.aval)
                env[v] = fresh
                outvars.append(fresh)
            else:
                outvars.append(v)
        eqns.append(
            eqn.replace(
                invars=[read(v) for v in eqn.invars],
                outvars=outvars,
                source_info=like.source_info if like is not None else eqn.source_info,
            )
        )
    return eqns, [read(v) for v in inner.outvars]


def recompute_named_axis_effects(jaxpr: Jaxpr) -> Jaxpr:
    """Recompute the named-axis effects of calls and control flow from their (rewritten) bodies.

    JAX records ``NamedAxisEffect('batch')`` on every equation that encloses a
    ``psum`` over ``'batch'``; once a rewrite renamed or removed that ``psum``
    the effect is stale and the jaxpr would no longer type-check.
    """
    from replicator._jax_compat import named_axis_effect_type

    effect_type = named_axis_effect_type()
    eqns = []
    for eqn in jaxpr.eqns:
        if any(True for _ in sub_jaxprs(eqn.params)):
            eqn = map_subjaxprs(eqn, recompute_named_axis_effects)
            own = [e for e in eqn.effects if not isinstance(e, effect_type)]
            eqn = eqn.replace(effects=merge_effects(sub_jaxprs(eqn.params), base=own))
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns, effects=merge_effects(eqns))
