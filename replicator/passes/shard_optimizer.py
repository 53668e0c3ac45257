"""``shard-optimizer-update``: ZeRO-1 on the per-replica graph.

A data-parallel step usually all-reduces its gradients and then has *every*
replica run the same element-wise optimizer update on the whole model, with a
whole copy of the optimizer state. DeepSpeed's ZeRO stage 1 splits that work:
reduce-scatter the gradients, let replica ``r`` update only the ``r``-th 1/N
chunk of each tensor (with the ``r``-th chunk of the optimizer state, which is
all it stores), then all-gather the new parameters.

This pass finds that pattern on placeholders and rewrites it:

* ``g = all_sum/all_mean(x)`` over all replicas, for a leaf whose leading
  axis divides by N, becomes ``g_r = reduce_scatter(x)`` (the chunk);
* element-wise equations (``add``, ``mul``, ``sqrt``, ``select_n``, ...) that
  read such a chunk are computed on chunks; their other operands are sliced
  to this replica's chunk (a local ``dynamic_slice``) or are scalars;
* a state leaf read *only* by chunked equations and written from a chunk
  (Adam's ``mu``/``nu``) becomes **sharded state**: the step receives and
  returns only this replica's chunk, and between steps it lives sharded along
  its leading axis over the mesh (its global shape is unchanged), so each
  device holds 1/N of it;
* every other use of a chunked value (new parameters, outputs, control flow)
  gets the full value back with ``all_gather``.

Non-element-wise updates (e.g. ``clip_by_global_norm``'s reduction over all
gradients) simply read gathered values: results are unchanged, and the pass
helps less. Only the top-level graph is rewritten (the state lives there).

Example::

    passes = rp.Pipeline([*rp.passes.default_passes()[:2], ShardOptimizerUpdate(),
                          *rp.passes.default_passes()[2:]])
    repl = rp.Replicator(1, 8, passes=passes)   # Adam state: 1/8 per device
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

from replicator.passes.base import Pass, PassResult, StepGraph, inline_function
from replicator.primitives import all_gather_p, all_reduce_p, reduce_scatter_p, replica_id_p

__all__ = ["ELEMENTWISE", "ShardOptimizerUpdate"]

Atom = Any

#: Primitives computed element by element (a chunk of the output needs only
#: the same chunk of each same-shaped input; scalars broadcast).
ELEMENTWISE = frozenset(
    """abs add and atan2 cbrt ceil clamp convert_element_type copy copy_p cos div eq erf exp exp2 expm1 floor ge gt
    integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter not or pow rem round rsqrt select_n
    sign sin sqrt square sub tan tanh xor""".split()
)


def _chunkable(aval: Any, n: int) -> bool:
    shape = getattr(aval, "shape", ())
    return len(shape) >= 1 and shape[0] > 0 and shape[0] % n == 0


def _chunk_shape(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    return (shape[0] // n, *shape[1:])


@dataclasses.dataclass
class _Rewrite:
    """The state of one rewrite of the top-level jaxpr."""

    graph: StepGraph
    n: int
    out: list[JaxprEqn] = dataclasses.field(default_factory=list)
    chunk: dict[Var, Atom] = dataclasses.field(default_factory=dict)  # var -> this replica's chunk
    chunk_only: set[Var] = dataclasses.field(default_factory=set)  # vars with no full value
    gathered: dict[Var, Atom] = dataclasses.field(default_factory=dict)
    full_used: set[Var] = dataclasses.field(default_factory=set)  # state invars read in full
    state_chunk: dict[Var, Var] = dataclasses.field(default_factory=dict)  # state invar -> chunk var
    #: State inputs read only element-wise (optimizer state): reading them is
    #: reason enough to compute on chunks. Parameters, read by the forward
    #: pass too, are not: their element-wise uses there stay whole.
    elementwise_state: set[Var] = dataclasses.field(default_factory=set)
    changed: bool = False
    prologue: list[JaxprEqn] = dataclasses.field(default_factory=list)  # runs before everything
    _rid: Atom | None = None

    def replica_index(self) -> Atom:
        """One ``replica_id()`` for the whole graph, computed at the start."""
        if self._rid is None:
            eqns, (self._rid,) = inline_function(lambda: replica_id_p.bind(group=None), [], context=self.graph.context)
            self.prologue.extend(eqns)
        return self._rid

    def slice_chunk(self, atom: Atom, like: JaxprEqn | None, out: list[JaxprEqn]) -> Atom:
        """Emit into ``out`` this replica's chunk of a full value; return it."""
        rows = atom.aval.shape[0] // self.n
        eqns, (chunk,) = inline_function(
            lambda x, r: lax.dynamic_slice_in_dim(x, r * rows, rows, axis=0),
            [atom, self.replica_index()],
            context=self.graph.context,
            like=like,
        )
        out.extend(eqns)
        return chunk

    def emit(self, fn: Callable[..., Any], atoms: list[Atom], like: JaxprEqn | None) -> list[Atom]:
        eqns, outs = inline_function(fn, atoms, context=self.graph.context, like=like)
        self.out.extend(eqns)
        return outs

    # -- full values and chunks ------------------------------------------------------

    def full(self, atom: Atom, like: JaxprEqn | None = None) -> Atom:
        """The full value of ``atom``; all-gathers a chunk-only value once."""
        if not isinstance(atom, Var):
            return atom
        if atom in self.state_chunk:
            self.full_used.add(atom)
        if atom not in self.chunk_only:
            return atom
        if atom not in self.gathered:
            n = self.n
            (self.gathered[atom],) = self.emit(
                lambda c: all_gather_p.bind(c, axis=0, tiled=True, group=None, group_size=n),
                [self.chunk[atom]],
                like,
            )
        return self.gathered[atom]

    def chunk_of(self, atom: Atom, like: JaxprEqn) -> Atom:
        """This replica's chunk of a full-shaped value (sliced locally if needed)."""
        if atom in self.chunk:
            return self.chunk[atom]
        if atom in self.state_chunk:  # decided at the end: an input or a slice
            return self.state_chunk[atom]
        self.chunk[atom] = self.slice_chunk(atom, like, self.out)
        return self.chunk[atom]

    # -- equations ---------------------------------------------------------------------

    def all_reduce(self, eqn: JaxprEqn) -> bool:
        p = eqn.params
        if p["op"] not in ("sum", "mean") or p["group"] is not None:
            return False
        picks = [k for k, v in enumerate(eqn.invars) if _chunkable(v.aval, self.n) and not isinstance(v, Literal)]
        if not picks:
            return False
        rest = [k for k in range(len(eqn.invars)) if k not in picks]
        if rest:
            self.out.append(
                eqn.replace(
                    invars=[self.full(eqn.invars[k]) for k in rest],
                    outvars=[eqn.outvars[k] for k in rest],
                )
            )
        n, mean = self.n, p["op"] == "mean"

        def scatter(x: Any) -> Any:
            c = reduce_scatter_p.bind(x, axis=0, group=None, group_size=n)
            return c / jnp.asarray(n, c.dtype) if mean else c

        for k in picks:
            outvar = eqn.outvars[k]
            (c,) = self.emit(scatter, [self.full(eqn.invars[k])], eqn)
            if not isinstance(outvar, DropVar):
                self.chunk[outvar] = c
                self.chunk_only.add(outvar)
        return True

    def elementwise(self, eqn: JaxprEqn) -> bool:
        (outvar,) = eqn.outvars if len(eqn.outvars) == 1 else (None,)
        if outvar is None or not _chunkable(outvar.aval, self.n):
            return False
        if not any(isinstance(v, Var) and (v in self.chunk_only or v in self.elementwise_state) for v in eqn.invars):
            return False
        shape = outvar.aval.shape
        if any(not isinstance(v, Literal) and v.aval.shape not in ((), shape) for v in eqn.invars):
            return False
        atoms = [
            v if isinstance(v, Literal) else self.full(v) if v.aval.shape == () else self.chunk_of(v, eqn)
            for v in eqn.invars
        ]
        # Element-wise: the same equation on chunks, built directly (re-tracing
        # thousands of small equations would dominate the pass's time).
        c = Var(outvar.aval.update(shape=_chunk_shape(outvar.aval.shape, self.n)))
        self.out.append(eqn.replace(invars=atoms, outvars=[c]))
        if not isinstance(outvar, DropVar):
            self.chunk[outvar] = c
            self.chunk_only.add(outvar)
        return True

    def keep(self, eqn: JaxprEqn) -> None:
        if any(isinstance(v, Var) and (v in self.chunk_only or v in self.state_chunk) for v in eqn.invars):
            eqn = eqn.replace(invars=[self.full(v, eqn) for v in eqn.invars])
        self.out.append(eqn)


class ShardOptimizerUpdate(Pass):
    """Reduce-scatter gradients, update 1/N chunks, shard element-wise optimizer state.

    Args:
      shard_state: store state leaves that only the chunked update reads
        sharded over the replicas (ZeRO-1's memory saving). With ``False``
        they stay replicated and only the update work is split.
    """

    name = "shard-optimizer-update"

    def __init__(self, *, shard_state: bool = True):
        self.shard_state = bool(shard_state)

    def __repr__(self) -> str:
        return f"ShardOptimizerUpdate(shard_state={self.shard_state})"

    def run(self, graph: StepGraph) -> PassResult:
        n = graph.context.num_replicas
        if n == 1:
            return PassResult(graph, False)
        jaxpr = graph.jaxpr.jaxpr
        rw = _Rewrite(graph, n)
        state_in = list(jaxpr.invars[: graph.num_state])
        for i, v in enumerate(state_in):
            if i not in graph.sharded_state and _chunkable(v.aval, n):
                rw.state_chunk[v] = Var(v.aval.update(shape=_chunk_shape(v.aval.shape, n)))
        readers: dict[Var, list[JaxprEqn]] = {v: [] for v in rw.state_chunk}
        for eqn in jaxpr.eqns:
            for v in eqn.invars:
                if isinstance(v, Var) and v in readers:
                    readers[v].append(eqn)
        rw.elementwise_state = {
            v
            for v, eqns in readers.items()
            if eqns and v not in jaxpr.outvars and all(e.primitive.name in ELEMENTWISE for e in eqns)
        }
        for eqn in jaxpr.eqns:
            if eqn.primitive is all_reduce_p and rw.all_reduce(eqn):
                rw.changed = True
            elif eqn.primitive.name in ELEMENTWISE and rw.elementwise(eqn):
                pass
            else:
                rw.keep(eqn)
        state_out = jaxpr.outvars[: graph.num_state]
        if not (rw.changed and any(isinstance(v, Var) and v in rw.chunk_only for v in state_out)):
            # No state update is computed on chunks: splitting would only add collectives.
            return PassResult(graph, False)
        return PassResult(self._finish(graph, jaxpr, rw, state_in), True)

    def _finish(self, graph: StepGraph, jaxpr: Jaxpr, rw: _Rewrite, state_in: list[Var]) -> StepGraph:
        """Decide sharded state leaves; route outputs; prepend the state slices needed."""
        outvars = list(jaxpr.outvars)
        sharded = set(graph.sharded_state)
        new_invars = list(jaxpr.invars)
        prologue: list[JaxprEqn] = []
        for i, v in enumerate(state_in):
            if v not in rw.state_chunk:
                continue
            chunk_var, out = rw.state_chunk[v], outvars[i]
            used = any(chunk_var in e.invars for e in rw.out)
            written_as_chunk = isinstance(out, Var) and out in rw.chunk_only
            if self.shard_state and written_as_chunk and v not in rw.full_used and out not in rw.gathered:
                new_invars[i] = chunk_var  # this replica's chunk comes in ...
                outvars[i] = rw.chunk[out]  # ... and goes out
                sharded.add(i)
            elif used:
                sliced: list[JaxprEqn] = []
                c = rw.slice_chunk(v, None, sliced)
                assert sliced and sliced[-1].outvars == [c]
                sliced[-1] = sliced[-1].replace(outvars=[chunk_var])
                prologue.extend(sliced)
        outvars = [rw.full(a) if i not in sharded else a for i, a in enumerate(outvars)]
        eqns = rw.prologue + prologue + rw.out
        effects: set = set()
        for e in eqns:
            effects |= set(e.effects)
        new = jaxpr.replace(invars=new_invars, eqns=eqns, outvars=outvars, effects=frozenset(effects))
        return dataclasses.replace(graph, jaxpr=ClosedJaxpr(new, graph.jaxpr.consts), sharded_state=frozenset(sharded))
