"""``simplify``: remove collectives that cannot change anything.

Runs on the placeholder graph, before ``lower-collectives``, and works region
by region: the top-level jaxpr and every sub-jaxpr (``jit``, ``cond``
branches, ``scan``/``while`` bodies, ``remat``, custom-derivative calls) are
simplified separately; nothing moves across a control-flow boundary. Three
rewrites, each switchable in the constructor:

* ``dedup``: the same collective (primitive, params and operand atoms)
  computed twice in one region is computed once; the second's results are
  the first's.
* ``invariant``: a collective of a value that is already identical on every
  replica of its group (see :mod:`replicator.analysis.invariance`) becomes
  local code: ``all_sum(x) -> x * N``; ``all_mean/all_max/all_min(x) -> x``;
  ``broadcast(x) -> x``; ``all_gather(x)`` -> ``N`` copies stacked (or, tiled,
  concatenated) along ``axis``; ``reduce_scatter(x)`` -> ``N *`` this replica's
  chunk (a ``replica_id`` and a slice, no communication). An ``all_reduce`` of
  several operands keeps only its varying ones.
* ``dead``: equations without effects whose results are never used (dropped
  collectives, and the code that only fed them) are removed.

**Preconditions (soundness).** Each rewrite fires only where it is proven:

* ``dedup``: two placeholder equations in the *same* region (one jaxpr, not
  its sub-jaxprs: never across a ``cond``/``while``/``scan``/call boundary)
  with the same primitive, equal hashable parameters and the same operand
  *atoms* (the same variables; literals only if they are the same object).
  Placeholders are pure and deterministic, and a variable has one value in a
  region, so both compute the same value whatever lies between them (effects
  cannot change a variable).
* ``invariant``: the operand is proven identical along every live axis of the
  collective's group by :class:`~replicator.analysis.invariance.VarianceAnalysis`,
  run on the whole step (replicated state invariant, sharded state and batch
  varying). Inside a sub-jaxpr only when the analysis has a rule for its
  container (``cond``, ``while``, ``scan``, the calls of ``CALL_PARAMS``),
  entered with the variances the analysis used (the loop fixpoints); inside
  any other primitive, and in the whole step when the analysis rejects it
  (divergent control flow, or a collective in a primitive it cannot look into),
  nothing is made local. The local code equals the collective in exact
  arithmetic; in floating point ``N * x`` and ``x`` are at least as accurate
  as the sum of ``N`` copies (and a mean of huge identical values no longer
  overflows); integer ``N * x`` wraps exactly as the sum does.
* ``dead``: the equation has no effects (``eqn.effects`` includes those of
  its sub-jaxprs) and none of its results is used. Dropping a collective is
  safe because every replica runs the same program and drops it too.

Tests just outside each (``tests/passes/test_simplify.py``): collectives of
batch data, of values varying along the group's axis (identical within a
worker only), of host-callback results; the same collective inside and
outside a ``cond`` or ``while`` body; divergent control flow; a collective
inside ``custom_linear_solve`` (a primitive the analysis has no rule for);
effects. Known gap, in the analysis: ``lax.rng_uniform`` is treated as a
pure function of its inputs though each device draws its own numbers
(``TestOutsideThePreconditions::test_per_device_random_numbers_are_not_assumed_identical``,
an expected failure until ``invariance.OPAQUE_PRIMITIVES`` lists it).

Example (the pass is in the default pass manager; ``PassManager.default(disable=["simplify"])``
turns it off):

>>> def step(state, batch):
...     g = rp.all_mean(batch)            # kept: batch data varies
...     g2 = rp.all_mean(batch)           # the same collective again: reuses g
...     n = rp.all_sum(state["count"])    # state is invariant: count * 8, no collective
...     rp.all_max(batch)                 # result unused: removed
...     return {"count": n}, g + g2
>>> state, batch = {"count": np.float32(1)}, np.ones((8, 4), np.float32)
>>> on = rp.Replicator(1, 8).lower(step, batch, state).final
>>> off = rp.Replicator(1, 8, passes=rp.PassManager.default(disable=["simplify"])).lower(step, batch, state).final
>>> [r.kind for r in on.collectives], sorted(r.kind for r in off.collectives)
(['all_mean'], ['all_max', 'all_mean', 'all_sum'])
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from jax import lax
from jax.extend.core import DropVar, Jaxpr, JaxprEqn, Var

from replicator._jax_compat import scan_operand_counts
from replicator.analysis.invariance import INVARIANT, Variance, VarianceAnalysis, variance_of
from replicator.core.context import ReplicaContext
from replicator.core.graph import StepGraph
from replicator.core.jaxprs import CALL_PARAMS, DefUse, inline_function, map_subjaxprs, merge_effects, open_jaxpr
from replicator.core.primitives import (
    PLACEHOLDERS,
    all_gather_p,
    all_reduce_p,
    broadcast_p,
    reduce_scatter_p,
    replica_id_p,
)
from replicator.errors import DivergentControlFlowError, UnanalyzableStepError
from replicator.pass_manager.contract import Pass, PassResult

__all__ = ["Simplify"]

Atom = Any  # Var | Literal


def _sub_variances(eqn: JaxprEqn, ins: list[Variance], outs: list[Variance]) -> dict[int, list[Variance]]:
    """Input variances of ``eqn``'s sub-jaxprs, keyed by ``id(jaxpr)``.

    Sub-jaxprs of primitives the invariance analysis has no rule for are left
    out: no invariant rewrite happens inside them.
    """
    name, p = eqn.primitive.name, eqn.params
    if name == "cond":
        return {id(open_jaxpr(b)): list(ins[1:]) for b in p["branches"]}
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        # The results of a while are its fixpoint carry.
        return {
            id(open_jaxpr(p["cond_jaxpr"])): list(ins[:nc]) + outs,
            id(open_jaxpr(p["body_jaxpr"])): list(ins[nc : nc + nb]) + outs,
        }
    if name == "scan":
        n_consts, n_carry = scan_operand_counts(p)
        # The first results of a scan are its fixpoint carry.
        body_ins = list(ins[:n_consts]) + outs[:n_carry] + list(ins[n_consts + n_carry :])
        return {id(open_jaxpr(p["jaxpr"])): body_ins}
    param = CALL_PARAMS.get(name)
    if param is not None and param in p:
        inner = open_jaxpr(p[param])
        return {id(inner): list(ins[len(ins) - len(inner.invars) :])}
    return {}


def _atom_key(atom: Atom) -> Hashable:
    # Literals are unhashable: identical means the same object.
    return atom if isinstance(atom, Var) else ("literal", id(atom))


def _dedup_key(eqn: JaxprEqn) -> Hashable | None:
    try:
        params = tuple(sorted(eqn.params.items()))
        hash(params)
    except TypeError:
        return None
    return (eqn.primitive, params, tuple(_atom_key(a) for a in eqn.invars))


def _times(x: Any, n: int) -> Any:
    """``x * n`` in ``x``'s dtype (and weak type)."""
    return x if n == 1 else x * lax.full_like(x, n, shape=())


def _gather_copies(x: Any, *, axis: int, tiled: bool, group_size: int) -> Any:
    """What ``all_gather`` returns when every replica holds ``x``."""
    n, shape = group_size, tuple(x.shape)
    stacked_shape = shape[:axis] + (n,) + shape[axis:]
    dims = tuple(d for d in range(len(stacked_shape)) if d != axis)
    stacked = lax.broadcast_in_dim(x, stacked_shape, dims)
    if not tiled:
        return stacked
    if n == 1:
        return x
    # Replica i's copy is block i along ``axis``, as in the concatenation.
    return lax.reshape(stacked, shape[:axis] + (n * shape[axis],) + shape[axis + 1 :])


def _my_scaled_chunk(x: Any, *, axis: int, group: str | None, group_size: int) -> Any:
    """What ``reduce_scatter`` returns when every replica holds ``x``."""
    if group_size == 1:
        return x
    size = x.shape[axis] // group_size
    index = replica_id_p.bind(group=group)
    chunk = lax.dynamic_slice_in_dim(x, index * size, size, axis)
    return _times(chunk, group_size)


class _Region:
    """Simplifies one jaxpr, recursing into its sub-jaxprs."""

    def __init__(self, config: Simplify, context: ReplicaContext, analysis: VarianceAnalysis | None):
        self.config = config
        self.context = context
        self.analysis = analysis

    def run(self, jaxpr: Jaxpr, in_variance: Sequence[Variance] | None) -> tuple[Jaxpr, bool]:
        env: dict[Var, Variance] | None = None
        if in_variance is not None and self.analysis is not None:
            _, env = self.analysis.run(jaxpr, in_variance)
        subst: dict[Var, Atom] = {}
        # dedup key -> (atoms standing for the outputs, index in new_eqns of the
        # equation whose outvars may be among them, or None)
        seen: dict[Hashable, tuple[list[Atom], int | None]] = {}
        new_eqns: list[JaxprEqn] = []
        changed = False

        def read(atom: Atom) -> Atom:
            return subst.get(atom, atom) if isinstance(atom, Var) else atom

        for orig in jaxpr.eqns:
            eqn = orig
            if any(isinstance(v, Var) and v in subst for v in eqn.invars):
                eqn = eqn.replace(invars=[read(v) for v in eqn.invars])
            ins = outs = None
            if env is not None:
                ins = [variance_of(env, a) for a in orig.invars]
                outs = [variance_of(env, v) for v in orig.outvars]
            eqn, sub_changed = self._recurse(eqn, ins, outs)
            changed |= sub_changed
            if eqn.primitive not in PLACEHOLDERS:
                new_eqns.append(eqn)
                continue

            key = _dedup_key(eqn) if self.config.dedup else None
            if key is not None and key in seen:
                # Computed before in this region: reuse those results.
                changed = True
                atoms, index = seen[key]
                for i, var in enumerate(eqn.outvars):
                    if isinstance(var, DropVar):
                        continue
                    if isinstance(atoms[i], DropVar):  # the first one's result was unused
                        assert index is not None
                        fresh, dropped = Var(var.aval), atoms[i]
                        first = new_eqns[index]
                        new_eqns[index] = first.replace(outvars=[fresh if o is dropped else o for o in first.outvars])
                        atoms[i] = fresh
                    subst[var] = atoms[i]
                continue

            atoms: list[Atom] = list(eqn.outvars)
            rewritten = self._invariant(eqn, ins) if ins is not None and self.config.invariant else None
            if rewritten is not None:
                changed = True
                local_eqns, atoms, residual = rewritten
                new_eqns.extend(local_eqns)
                for var, atom in zip(eqn.outvars, atoms, strict=True):
                    if not isinstance(var, DropVar) and atom is not var:
                        subst[var] = atom
                eqn = residual
            index = None
            if eqn is not None:
                index = len(new_eqns)
                new_eqns.append(eqn)
            if key is not None:
                seen[key] = (atoms, index)

        outvars = [read(v) for v in jaxpr.outvars]
        if self.config.dead:
            dead = DefUse(jaxpr.replace(eqns=new_eqns, outvars=outvars)).dead_eqns()
            if dead:
                new_eqns = [eqn for i, eqn in enumerate(new_eqns) if i not in dead]
                changed = True
        if not changed:
            return jaxpr, False
        return jaxpr.replace(eqns=new_eqns, outvars=outvars, effects=merge_effects(new_eqns, base=jaxpr.effects)), True

    def _recurse(self, eqn: JaxprEqn, ins: list[Variance] | None, outs: list[Variance] | None) -> tuple[JaxprEqn, bool]:
        sub_in = _sub_variances(eqn, ins, outs) if ins is not None and outs is not None else {}
        changed = False

        def fn(sub: Jaxpr) -> Jaxpr:
            nonlocal changed
            new, sub_changed = self.run(sub, sub_in.get(id(sub)))
            changed |= sub_changed
            return new

        return map_subjaxprs(eqn, fn), changed

    def _invariant(
        self, eqn: JaxprEqn, ins: list[Variance]
    ) -> tuple[list[JaxprEqn], list[Atom], JaxprEqn | None] | None:
        """Local code for the operands of ``eqn`` that are invariant over its group.

        Returns ``None`` to keep ``eqn`` as is, else ``(new_eqns, out_atoms,
        residual)``: ``out_atoms[i]`` stands for ``eqn.outvars[i]`` and
        ``residual`` is a smaller collective still needed (or ``None``).
        """
        prim, params = eqn.primitive, eqn.params
        if prim is replica_id_p:
            return None
        assert self.analysis is not None
        axes = self.analysis.axes(params["group"])
        invariant = [not (v & axes) for v in ins]
        if not any(invariant):
            return None
        n = params["group_size"]
        if prim is all_reduce_p:
            op = params["op"]
            new_eqns: list[JaxprEqn] = []
            atoms: list[Atom] = list(eqn.outvars)
            for i, (x, inv) in enumerate(zip(eqn.invars, invariant, strict=True)):
                if not inv:
                    continue
                if op == "sum" and n != 1:
                    eqns, out = self._inline(lambda v: _times(v, n), x, eqn.outvars[i], eqn)
                    new_eqns.extend(eqns)
                    atoms[i] = out
                else:  # mean, max, min of identical values (or a sum over one)
                    atoms[i] = x
            keep = [i for i, inv in enumerate(invariant) if not inv]
            residual = None
            if keep:
                residual = eqn.replace(invars=[eqn.invars[i] for i in keep], outvars=[eqn.outvars[i] for i in keep])
            return new_eqns, atoms, residual
        (x,) = eqn.invars
        if prim is broadcast_p:
            return [], [x], None
        if prim is all_gather_p:
            axis, tiled = params["axis"], params["tiled"]
            eqns, out = self._inline(
                lambda v: _gather_copies(v, axis=axis, tiled=tiled, group_size=n), x, eqn.outvars[0], eqn
            )
            return eqns, [out], None
        if prim is reduce_scatter_p:
            axis, group = params["axis"], params["group"]
            eqns, out = self._inline(
                lambda v: _my_scaled_chunk(v, axis=axis, group=group, group_size=n), x, eqn.outvars[0], eqn
            )
            return eqns, [out], None
        return None

    def _inline(self, fn: Any, x: Atom, replaces: Var, like: JaxprEqn) -> tuple[list[JaxprEqn], Atom]:
        """``fn(x)`` as equations, checked to have the type of ``replaces``."""
        eqns, (out,) = inline_function(fn, [x], context=self.context, like=like)
        if (out.aval.shape, out.aval.dtype) != (replaces.aval.shape, replaces.aval.dtype):
            raise AssertionError(
                f"simplify: the rewrite of {like.primitive.name} produced {out.aval.str_short()} "
                f"for {replaces.aval.str_short()}"
            )
        return eqns, out


class Simplify(Pass):
    """Deduplicate collectives, make collectives of invariant values local, drop dead ones.

    Runs on placeholders (put it before ``lower-collectives``). Each rewrite
    works within one region (a jaxpr or a sub-jaxpr), never across a
    control-flow boundary.

    Args:
      dedup: compute a collective repeated on the same operands in one region once.
      invariant: replace a collective of values already identical over its
        group (per the invariance analysis) by local code. Skipped in the
        whole step when the analysis finds divergent control flow or a
        collective it cannot analyse (the ``check-replica-invariance`` pass
        reports both; with that pass disabled, simplify still runs its other
        rewrites).
      dead: remove equations without effects whose results are unused.
    """

    name = "simplify"

    def __init__(self, *, dedup: bool = True, invariant: bool = True, dead: bool = True):
        self.dedup = bool(dedup)
        self.invariant = bool(invariant)
        self.dead = bool(dead)

    def __repr__(self) -> str:
        return f"Simplify(dedup={self.dedup}, invariant={self.invariant}, dead={self.dead})"

    def run(self, graph: StepGraph) -> PassResult:
        analysis: VarianceAnalysis | None = None
        in_variance: list[Variance] | None = None
        if self.invariant:
            analysis = VarianceAnalysis(graph.context.axis_sizes)
            live = analysis.live_axes
            state = [live if i in graph.sharded_state else INVARIANT for i in range(graph.num_state)]
            in_variance = state + [live] * graph.num_batch
            try:
                analysis.run(graph.jaxpr.jaxpr, in_variance)
            except (DivergentControlFlowError, UnanalyzableStepError):
                # Variances are meaningless where replicas may take different paths,
                # and unknown where the analysis cannot look into a sub-graph.
                analysis, in_variance = None, None
        new, changed = _Region(self, graph.context, analysis).run(graph.jaxpr.jaxpr, in_variance)
        return PassResult.rewritten(graph, new, changed)
