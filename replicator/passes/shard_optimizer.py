"""``shard-optimizer-update``: ZeRO-1, -2 and -3 on the per-replica graph.

A data-parallel step usually all-reduces its gradients and then has *every*
replica run the same element-wise optimizer update on the whole model, with a
whole copy of the optimizer state. DeepSpeed's ZeRO stage 1 splits that work:
reduce-scatter the gradients, let replica ``r`` update only the ``r``-th 1/N
chunk of each tensor (with the ``r``-th chunk of the optimizer state, which is
all it stores), then all-gather the new parameters.

**Precondition.** Replica ``r`` may compute only the ``r``-th chunk of a value
``v``, and others later rebuild ``v`` by all-gathering every replica's chunk,
*only if* ``v`` is identical on every replica (so that the chunks of
different replicas are chunks of one value). The pass proves this with the
replica-variance analysis (:mod:`replicator.analysis.invariance`, state enters
identical, batch data and ``replica_id()`` vary):

* ``g = all_sum/all_mean(x)`` over *all* replicas, for a floating-point leaf
  with an axis that divides by N (and of at least ``min_tensor_bytes``), is
  identical everywhere whatever ``x`` is:
  it becomes ``g_r = reduce_scatter(x)`` (``/ N`` for a mean);
* an element-wise equation (``add``, ``mul``, ``sqrt``, ``select_n``, ...) is
  computed on chunks only if **every operand is proven invariant**; its
  same-shaped operands are then this replica's chunks (a reduce-scatter's
  result, a chunked equation's result, or a local ``dynamic_slice`` of a full
  invariant value) and its scalar operands are used whole. A ``broadcast_in_dim``
  of a scalar proven invariant counts as element-wise (each chunk is the scalar
  broadcast to the chunk's shape), and top-level ``jit`` calls whose bodies are
  only such equations (``jnp.where(is_finite, new, old)``'s ``_where``) are
  inlined first, so that they chunk as ``lax.select`` does;
* a state leaf read *only* by chunked equations and written from a chunk
  (Adam's ``mu``/``nu``) becomes **sharded state**: the step receives and
  returns only this replica's chunk, and between steps it lives sharded along
  that axis over the mesh (its global shape is unchanged), so each device
  holds 1/N of it;
* every other use of a chunked value (new parameters, outputs, control flow,
  a non-element-wise equation) reads the full value back from one
  ``all_gather``.

Anything outside this (a value that may differ between replicas, a group
collective, an integer leaf, a shape that does not divide, sub-graphs of
control flow) is left as it was. Chunking that would not pay is not done: an
element-wise equation with no chunked operand whose result nobody reads as a
chunk, and a reduce-scatter whose chunk nobody reads, stay whole. The graph is
returned unchanged if no state leaf ends up stored sharded (with
``shard_state=False``: if no state update ends up computed on chunks).

Non-element-wise updates (e.g. ``clip_by_global_norm``'s reduction over all
gradients) simply read gathered values at stage 1. Only the top-level graph is
rewritten (the state lives there).

**Stage 2** also computes reductions over the chunk axis (``reduce_sum``, ``reduce_max``,
``reduce_min``) of a chunk of an invariant value on the chunk, and combines the
partial results with an all-reduce: a global gradient norm then never rebuilds
a whole reduced gradient. Precondition: the reduced value is proven invariant
(so the chunks are chunks of one value and the partial results add up to it).

**Stage 3** also stores *parameters* sharded: a floating-point state leaf of
at least ``min_tensor_bytes`` with an axis that divides by N, and whose new
value is its old value or a chunk computed as above (so it is identical on
every replica). Each equation that reads a parameter whole (the forward pass's
matmul, the backward pass's) gets its own ``all_gather``, ordered after the
equation's other operands, so that no whole copy lives from the forward pass
to the backward pass (DeepSpeed's re-gather). An element-wise cast of the
parameter (``w.astype(bfloat16)``) runs on the chunk, so the gather moves bf16.
Leaves that stay replicated are listed, with the reason, in the pass manager's
notes (``explain`` prints them).

**The chunk axis.** Every value of one shape is cut along the same axis: the
first whose size divides by N (a ``(3, 3, C, F)`` conv kernel along ``C``
or ``F``); a value with no such axis stays whole. Element-wise equations
combine values of one shape only, so their chunks line up; the state
``Replicator.run`` returns carries each leaf's axis in its sharding
(:class:`~replicator.core.graph.ShardedState`).

**Stage 3 and ``lax.scan``.** A ``(L, ...)`` stack of layers that a top-level
``scan`` reads as ``xs`` is cut along the first axis *after* the scanned axis 0
that divides by N (the shape goes into ``_Cut.not_leading``; with no such axis it
is cut as any other value, and a stack cut along axis 0 is gathered whole before
the loop). Precondition of the rewrite, per ``xs`` operand: the value is held
only as chunks (chunks of one value proven identical on every replica), cut along
an axis ``a >= 1``; then slice ``i`` of the chunk is the chunk of slice ``i``
along ``a - 1``. The scan gets the chunks as ``xs``, and its body all-gathers,
for each equation that reads the slice, only that layer's slice (ordered after
that equation's other operands), in the forward and the backward (transposed)
scan alike. A stacked output of the scan read only by an all-reduce over every
replica that becomes a reduce-scatter (the stacked gradient) is reduce-scattered
slice by slice in the body instead (a sum of stacks is the stack of the sums),
so neither the stack nor its gradient is ever whole on a device.
``slice_scans=False`` gathers stacks whole before the loop; the notes list the
stacks gathered whole, and why. Scans inside other control flow (e.g. under
``jax.checkpoint``), and ``scan`` bodies' own sub-graphs, are not rewritten (a
nested equation reading a slice gets the whole slice).

Example: SGD with momentum; the momentum ``m`` is stored 1/8 per device, the
weights ``w`` stay replicated (``shard_optimizer_min_bytes=0`` lets these
small leaves be sharded):

>>> def step(state, batch):
...     g = rp.all_mean(jax.grad(lambda w: jnp.sum((batch @ w) ** 2))(state["w"]))
...     m = 0.9 * state["m"] + g
...     return {"m": m, "w": state["w"] - 0.1 * m}, None
>>> state = {"m": np.zeros((8, 2), np.float32), "w": np.ones((8, 2), np.float32)}
>>> pipe = rp.PassManager.default(shard_optimizer=True, shard_optimizer_min_bytes=0)
>>> graph = rp.Replicator(1, 8, passes=pipe).lower(step, np.ones((8, 8), np.float32), state).final
>>> [graph.state_paths[i] for i in sorted(graph.sharded_state)]
["state['m']"]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

from replicator._jax_compat import scan_operand_counts, user_source_line
from replicator.analysis.invariance import InvarianceInfo, analyze
from replicator.core.buffers import is_floating, nbytes
from replicator.core.graph import ShardedState, StepGraph
from replicator.core.jaxprs import inline_function, merge_effects
from replicator.core.primitives import all_gather_p, all_reduce_p, reduce_scatter_p, replica_id_p
from replicator.errors import ReplicationError
from replicator.pass_manager.contract import Pass, PassResult

__all__ = ["DEFAULT_MIN_TENSOR_BYTES", "ELEMENTWISE", "ShardOptimizerUpdate"]

#: Smaller gradients and state leaves stay whole: sharding them saves little
#: memory and costs a reduce-scatter and an all-gather where one all-reduce
#: did (measured in BENCHMARKS.md).
DEFAULT_MIN_TENSOR_BYTES = 64 * 2**10

Atom = Any

#: Reductions stage 2 computes on chunks, and the all-reduce that combines the partial results.
REDUCTIONS: dict[str, str] = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}

#: Primitives computed element by element (a chunk of the output needs only
#: the same chunk of each same-shaped input; scalars broadcast).
ELEMENTWISE = frozenset(
    """abs add and atan2 cbrt ceil clamp convert_element_type copy copy_p cos div eq erf exp exp2 expm1 floor ge gt
    integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter not or pow rem round rsqrt select_n
    sign sin sqrt square sub tan tanh xor""".split()
)


@dataclasses.dataclass(frozen=True)
class _Cut:
    """How values are cut into N chunks: along one axis per shape, the same for every value of that shape.

    The axis is the first whose size divides by N (all sizes positive); for the
    shapes in ``not_leading`` (stacks of layers a ``scan`` slices along axis 0)
    the first such axis after axis 0. Element-wise equations only combine
    values of one shape, so their chunks always line up.
    """

    n: int
    not_leading: frozenset[tuple[int, ...]] = frozenset()

    def axis(self, aval: Any) -> int | None:
        shape = tuple(getattr(aval, "shape", ()))
        if not shape or 0 in shape:
            return None
        first = 1 if shape in self.not_leading else 0
        return next((k for k in range(first, len(shape)) if shape[k] % self.n == 0), None)

    def chunkable(self, aval: Any) -> bool:
        return self.axis(aval) is not None

    def chunk_aval(self, aval: Any) -> Any:
        return _cut_along(aval, self.axis(aval), self.n)


def _cut_along(aval: Any, axis: int, n: int) -> Any:
    return aval.update(shape=(*aval.shape[:axis], aval.shape[axis] // n, *aval.shape[axis + 1 :]))


def _reduce_scatter(n: int, axis: int, mean: bool) -> Callable[[Any], Any]:
    """``x -> reduce_scatter(x)`` along ``axis`` over all ``n`` replicas (``/ n`` for a mean)."""

    def reduce_scatter(x: Any) -> Any:
        c = reduce_scatter_p.bind(x, axis=axis, group=None, group_size=n)
        return c / jnp.asarray(n, c.dtype) if mean else c

    return reduce_scatter


def _scanned_stacks(jaxpr: Jaxpr, n: int) -> frozenset[tuple[int, ...]]:
    """Shapes of the ``xs`` operands of top-level scans with an axis after the scanned one that divides by ``n``."""
    shapes = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            consts, carry = scan_operand_counts(eqn.params)
            for v in eqn.invars[consts + carry :]:
                shape = tuple(getattr(v.aval, "shape", ()))
                if 0 not in shape and any(d % n == 0 for d in shape[1:]):
                    shapes.add(shape)
    return frozenset(shapes)


def _vars(atoms: Any) -> list[Var]:
    return [a for a in atoms if isinstance(a, Var) and not isinstance(a, DropVar)]


def _after(c: Any, dep: Any) -> Any:
    """``c`` itself, computed so that it depends on ``dep`` (CPU's XLA drops optimization barriers).

    One row of ``c`` is read and written back at a row index made from ``dep``'s first
    element (clamped into range, so any value is fine): an identity XLA does not fold.
    """
    flat = jnp.ravel(dep)
    index = lax.bitcast_convert_type(flat[0], jnp.int32) if flat.dtype.itemsize == 4 else flat[0].astype(jnp.int32)
    row = lax.dynamic_slice_in_dim(c, index, 1, axis=0)
    return lax.dynamic_update_slice_in_dim(c, row, index, axis=0)


# -- the plan: which equations run on chunks ------------------------------------------


@dataclasses.dataclass
class _Plan:
    """What to chunk, decided on the original graph before anything is emitted.

    Attributes:
      scatter: all-reduce equation index -> operand positions that become
        reduce-scatters.
      chunked: indices of element-wise equations computed on chunks.
      sharded: state indices stored sharded.
    """

    scatter: dict[int, list[int]]
    chunked: set[int]
    sharded: set[int]
    #: Stage 2: reductions over axis 0 of a chunk, computed as a partial
    #: reduction of the chunk and an all-reduce of the partial results.
    reduced: set[int] = dataclasses.field(default_factory=set)
    #: Stage 3: parameters (state read by more than the chunked update) stored sharded.
    params: set[int] = dataclasses.field(default_factory=set)

    def chunk_vars(self, jaxpr: Jaxpr) -> set[Var]:
        """The vars that exist as chunks (sharded parameters' inputs included)."""
        out: set[Var] = {jaxpr.invars[i] for i in self.params}
        for i, picks in self.scatter.items():
            out.update(_vars(jaxpr.eqns[i].outvars[k] for k in picks))
        for i in self.chunked:
            out.update(_vars(jaxpr.eqns[i].outvars))
        return out


def _scatter_picks(eqn: JaxprEqn, cut: _Cut, min_bytes: int) -> list[int]:
    """Operands of an all-reduce whose result may be produced as a chunk."""
    p = eqn.params
    if eqn.primitive is not all_reduce_p or p["op"] not in ("sum", "mean") or p["group"] is not None:
        return []
    return [
        k
        for k, v in enumerate(eqn.invars)
        if isinstance(v, Var)
        and cut.chunkable(v.aval)
        and is_floating(v.aval.dtype)
        and nbytes(v.aval) >= min_bytes
        and not isinstance(eqn.outvars[k], DropVar)
    ]


def _is_scalar_broadcast(eqn: JaxprEqn) -> bool:
    """``broadcast_in_dim`` of a scalar (``jnp.where(pred, x, 0.0)``'s ``0.0``, a broadcast predicate)."""
    return (
        eqn.primitive.name == "broadcast_in_dim"
        and len(eqn.invars) == 1
        and getattr(eqn.invars[0].aval, "shape", None) == ()
        and not eqn.params.get("sharding")
    )


def _elementwise_ok(eqn: JaxprEqn, cut: _Cut, info: InvarianceInfo) -> bool:
    """The precondition for computing ``eqn`` on chunks (see the module docstring).

    A ``broadcast_in_dim`` of a scalar counts as element-wise when the scalar is
    proven identical on every replica: every chunk of the broadcast value is the
    scalar broadcast to the chunk's shape.
    """
    if _is_scalar_broadcast(eqn):
        (x,), (out,) = eqn.invars, eqn.outvars
        return not isinstance(out, DropVar) and cut.chunkable(out.aval) and info.is_invariant(x) and not eqn.effects
    if eqn.primitive.name not in ELEMENTWISE or len(eqn.outvars) != 1 or eqn.effects:
        return False
    (out,) = eqn.outvars
    if isinstance(out, DropVar) or not cut.chunkable(out.aval):
        return False
    shape = out.aval.shape
    for v in eqn.invars:
        if isinstance(v, Literal):
            if getattr(v.aval, "shape", ()) != ():
                return False
            continue
        if v.aval.shape not in ((), shape) or not info.is_invariant(v):
            return False
    return True


def _reduction_ok(eqn: JaxprEqn, cut: _Cut, info: InvarianceInfo) -> bool:
    """Stage 2's precondition: a reduction over (at least) the chunk axis of an invariant, chunkable value.

    Its result is then the all-reduce (:data:`REDUCTIONS`) of the same reduction
    of each replica's chunk: every replica computes the same whole result.
    """
    if eqn.primitive.name not in REDUCTIONS or len(eqn.invars) != 1 or len(eqn.outvars) != 1 or eqn.effects:
        return False
    (x,), (out,) = eqn.invars, eqn.outvars
    return (
        isinstance(x, Var)
        and not isinstance(out, DropVar)
        and cut.chunkable(x.aval)
        and cut.axis(x.aval) in eqn.params.get("axes", ())
        and info.is_invariant(x)
    )


def _elementwise_body(eqn: JaxprEqn) -> Jaxpr | None:
    """The body of a ``jit`` call made only of element-wise equations (``jnp.where``'s ``_where``), else None."""
    if eqn.primitive.name != "jit" or eqn.effects:
        return None
    body = eqn.params["jaxpr"]
    if isinstance(body, ClosedJaxpr):
        if body.consts:
            return None
        body = body.jaxpr
    if body.constvars or body.effects:
        return None
    ok = all(
        (e.primitive.name in ELEMENTWISE or _is_scalar_broadcast(e)) and not e.effects and len(e.outvars) == 1
        for e in body.eqns
    )
    return body if ok else None


def _inline_elementwise_calls(jaxpr: Jaxpr) -> Jaxpr:
    """``jaxpr`` with its top-level ``jit`` calls of element-wise bodies replaced by their equations.

    ``jnp.where(pred, new, old)`` is ``jit(_where)`` around one ``select_n`` (and
    ``broadcast_in_dim`` of scalar operands): inlined, the plan sees the
    element-wise equations as it sees ``lax.select``'s. Returns ``jaxpr`` itself if
    there is no such call.
    """
    env: dict[Var, Atom] = {}

    def read(mapping: dict[Var, Atom], atom: Atom) -> Atom:
        return mapping.get(atom, atom) if isinstance(atom, Var) else atom

    eqns: list[JaxprEqn] = []
    for eqn in jaxpr.eqns:
        if env:
            eqn = eqn.replace(invars=[read(env, v) for v in eqn.invars])
        body = _elementwise_body(eqn)
        if body is None:
            eqns.append(eqn)
            continue
        inner: dict[Var, Atom] = dict(zip(body.invars, eqn.invars, strict=True))
        for e in body.eqns:
            outvars = []
            for v in e.outvars:
                if not isinstance(v, DropVar):
                    inner[v] = Var(v.aval)  # fresh: one body may be called twice
                outvars.append(read(inner, v))
            eqns.append(e.replace(invars=[read(inner, v) for v in e.invars], outvars=outvars))
        for var, atom in zip(eqn.outvars, body.outvars, strict=True):
            if not isinstance(var, DropVar):
                env[var] = read(inner, atom)
    if not env:
        return jaxpr
    return jaxpr.replace(eqns=eqns, outvars=[read(env, v) for v in jaxpr.outvars], effects=merge_effects(eqns))


def _why_whole(jaxpr: Jaxpr, info: InvarianceInfo, out: Atom) -> str:
    """Why stage 3 leaves the state leaf whose new value is ``out`` replicated (for the notes)."""
    if not isinstance(out, Var) or out in jaxpr.invars:
        return "its new value is not computed by the step (a constant or another input)"
    if not info.is_invariant(out):
        return "its new value may differ between replicas"
    producers = {o: e for e in jaxpr.eqns for o in _vars(e.outvars)}
    seen: set[Var] = set()
    stack = [out]
    while stack:  # back through the element-wise equations to one that is not
        v = stack.pop()
        eqn = producers.get(v)
        if eqn is None or v in seen:
            continue
        seen.add(v)
        if eqn.primitive.name in ELEMENTWISE or _is_scalar_broadcast(eqn):
            stack.extend(u for u in _vars(eqn.invars) if u.aval.shape == v.aval.shape)
        else:
            name = eqn.primitive.name
            name = f"{name} ({eqn.params['name']})" if name == "jit" and "name" in eqn.params else name
            return (
                f"its new value is identical on every replica but made from the result of "
                f"{name} at {user_source_line(eqn.source_info)}, which ZeRO does not compute "
                f"on chunks (only updates made element by element)"
            )
    return (
        "its new value is identical on every replica and made element by element, but from no value held "
        "in chunks (a reduce-scattered gradient or a sharded leaf), or it is also returned as an output"
    )


def _all_chunked(indices: list[int], chunked: set[int]) -> bool:
    """``indices`` is not empty and every equation in it is computed on chunks."""
    return bool(indices) and all(i in chunked for i in indices)


def _stage3_candidate(v: Var, cut: _Cut, min_bytes: int) -> bool:
    """A state leaf that stage 3 may store sharded, if its update is computed on chunks."""
    return cut.chunkable(v.aval) and is_floating(v.aval.dtype) and nbytes(v.aval) >= min_bytes


def _plan(
    graph: StepGraph, cut: _Cut, info: InvarianceInfo, shard_state: bool, min_bytes: int, stage: int = 1
) -> _Plan:
    jaxpr = graph.jaxpr.jaxpr
    eqns = jaxpr.eqns
    readers: dict[Var, list[int]] = {}
    for i, eqn in enumerate(eqns):
        for v in _vars(eqn.invars):
            readers.setdefault(v, []).append(i)
    in_outvars = {v: sum(1 for o in jaxpr.outvars if o is v) for v in _vars(jaxpr.outvars)}
    state_in = jaxpr.invars[: graph.num_state]
    state_out = jaxpr.outvars[: graph.num_state]

    eligible = {i for i, e in enumerate(eqns) if _elementwise_ok(e, cut, info)}
    # State read only by element-wise equations that may run on chunks
    # (optimizer state): reading it is reason enough to compute on chunks.
    # Parameters, read by the forward pass too, are not.
    chunk_state = {
        v
        for i, v in enumerate(state_in)
        if i not in graph.sharded_state
        and cut.chunkable(v.aval)
        and nbytes(v.aval) >= min_bytes
        and v not in in_outvars
        and readers.get(v)
        and all(r in eligible for r in readers[v])
    }

    # Stage 3: parameters too, if their new value comes out of the chunked update.
    params = (
        {i for i, v in enumerate(state_in) if i not in graph.sharded_state and _stage3_candidate(v, cut, min_bytes)}
        if stage >= 3
        else set()
    )
    reductions = {i for i, e in enumerate(eqns) if _reduction_ok(e, cut, info)} if stage >= 2 else set()

    scatter = {i: picks for i, e in enumerate(eqns) if (picks := _scatter_picks(e, cut, min_bytes))}
    plan = _Plan(scatter=scatter, chunked=set(), sharded=set(), params=params)
    chunks = plan.chunk_vars(jaxpr)
    for i in sorted(eligible):
        if any(v in chunks or v in chunk_state for v in _vars(eqns[i].invars)):
            plan.chunked.add(i)
            chunks.update(_vars(eqns[i].outvars))
    # A broadcast scalar that only chunked equations read is made as chunks too (never whole).
    for i in sorted(eligible):
        out = eqns[i].outvars[0]
        if _is_scalar_broadcast(eqns[i]) and out not in in_outvars and _all_chunked(readers.get(out, []), plan.chunked):
            plan.chunked.add(i)

    def param_kept(i: int, chunks: set[Var]) -> bool:
        """Stage 3 stores parameter ``i`` sharded: its new value is its old one or a chunk nothing else returns."""
        out = state_out[i]
        if out is state_in[i]:
            return True
        return isinstance(out, Var) and out in chunks and in_outvars.get(out) == 1 and out not in state_in

    # Drop chunking that does not pay: a chunk that no chunked equation reads
    # and that is not stored as sharded state, made from no chunk (a slice and
    # a gather for nothing) or by a reduce-scatter (an all-reduce in two steps).
    def shardable(plan: _Plan, chunks: set[Var]) -> set[int]:
        if not shard_state:
            return set()
        return {
            i
            for i, (v, out) in enumerate(zip(state_in, state_out, strict=True))
            if v in chunk_state
            and all(r in plan.chunked for r in readers[v])
            and isinstance(out, Var)
            and out in chunks
            and in_outvars.get(out) == 1
            and all(r in plan.chunked for r in readers.get(out, []))
        }

    while True:
        chunks = plan.chunk_vars(jaxpr)
        plan.params = {i for i in plan.params if param_kept(i, chunks)}
        chunks = plan.chunk_vars(jaxpr)
        plan.sharded = shardable(plan, chunks)
        plan.reduced = {i for i in reductions if eqns[i].invars[0] in chunks}
        stored = {state_out[i] for i in plan.sharded | plan.params}

        def read_as_chunk(v: Var, stored: set = stored) -> bool:
            return v in stored or any(r in plan.chunked or r in plan.reduced for r in readers.get(v, []))

        drop = {
            i
            for i in plan.chunked
            if (not any(v in chunks for v in _vars(eqns[i].invars)) and not read_as_chunk(eqns[i].outvars[0]))
            or (_is_scalar_broadcast(eqns[i]) and not _all_chunked(readers.get(eqns[i].outvars[0], []), plan.chunked))
        }
        unscatter = {i: [k for k in ks if read_as_chunk(eqns[i].outvars[k])] for i, ks in plan.scatter.items()}
        unscatter = {i: ks for i, ks in unscatter.items() if ks}
        if not drop and unscatter == plan.scatter:
            break
        plan.chunked -= drop
        plan.scatter = unscatter
    return plan


def _scattered_stacks(jaxpr: Jaxpr, plan: _Plan, cut: _Cut) -> dict[Var, bool]:
    """Stacks a top-level scan outputs that only a planned reduce-scatter reads (-> is it a mean?)."""
    from_scan = {v for e in jaxpr.eqns if e.primitive.name == "scan" for v in _vars(e.outvars)}
    reads: dict[Var, int] = {}
    for v in _vars([*(v for e in jaxpr.eqns for v in e.invars), *jaxpr.outvars]):
        reads[v] = reads.get(v, 0) + 1
    out = {}
    for i, picks in plan.scatter.items():
        eqn = jaxpr.eqns[i]
        for k in picks:
            x = eqn.invars[k]
            if x in from_scan and reads[x] == 1 and x.aval.shape in cut.not_leading and (cut.axis(x.aval) or 0) >= 1:
                out[x] = eqn.params["op"] == "mean"
    return out


# -- emitting the rewritten graph -----------------------------------------------------


@dataclasses.dataclass
class _Emitter:
    """Builds the new top-level equations from a plan."""

    graph: StepGraph
    cut: _Cut
    out: list[JaxprEqn] = dataclasses.field(default_factory=list)
    prologue: list[JaxprEqn] = dataclasses.field(default_factory=list)
    chunk: dict[Var, Atom] = dataclasses.field(default_factory=dict)  # var -> this replica's chunk
    chunk_only: set[Var] = dataclasses.field(default_factory=set)  # vars with no full value (yet)
    gathered: dict[Var, Atom] = dataclasses.field(default_factory=dict)
    #: Stage 3: gather a chunk again for each equation that reads it whole, so that
    #: no whole copy stays alive between its uses (the forward and the backward pass).
    regather: bool = False
    #: Chunk axes that differ from the cut's (a scan body's slice of a stack: one less).
    axes: dict[Var, int] = dataclasses.field(default_factory=dict)
    #: Stage 3: per-iteration values a scan stacks that only a reduce-scatter reads (mean?),
    #: and the chunks the scan then returns itself.
    scatter_ys: dict[Var, bool] = dataclasses.field(default_factory=dict)
    scattered: dict[Var, Atom] = dataclasses.field(default_factory=dict)
    _rid: Atom | None = None

    def axis(self, atom: Var) -> int | None:
        """The axis ``atom``'s chunks are cut along."""
        return self.axes[atom] if atom in self.axes else self.cut.axis(atom.aval)

    def replica_index(self) -> Atom:
        """One ``replica_id()`` for the whole graph, computed at the start."""
        if self._rid is None:
            eqns, (self._rid,) = inline_function(lambda: replica_id_p.bind(group=None), [], context=self.graph.context)
            self.prologue.extend(eqns)
        return self._rid

    def emit(self, fn: Callable[..., Any], atoms: list[Atom], like: JaxprEqn | None) -> list[Atom]:
        eqns, outs = inline_function(fn, atoms, context=self.graph.context, like=like)
        self.out.extend(eqns)
        return outs

    def full(
        self,
        atom: Atom,
        like: JaxprEqn | None = None,
        gathered: dict[Var, Atom] | None = None,
        after: list[Var] | None = None,
    ) -> Atom:
        """The full value of ``atom``; all-gathers a chunk-only value once (per ``gathered`` cache).

        With ``after``, the gather reads the chunk through an ``optimization_barrier``
        with those values and :func:`_after` the first: it cannot run before they
        exist, and XLA cannot merge it with another gather of the same chunk (which
        would keep the whole value alive from the forward pass to the backward pass).
        """
        if not isinstance(atom, Var) or atom not in self.chunk_only:
            return atom
        cache = self.gathered if gathered is None else gathered
        if atom not in cache:
            n, axis = self.cut.n, self.axis(atom)

            def gather(c: Any, *deps: Any) -> Any:
                if deps:
                    c = _after(lax.optimization_barrier((c, *deps))[0], deps[0])
                return all_gather_p.bind(c, axis=axis, tiled=True, group=None, group_size=n)

            (cache[atom],) = self.emit(gather, [self.chunk[atom], *(after or [])], like)
        return cache[atom]

    def chunk_of(self, atom: Var, like: JaxprEqn) -> Atom:
        """This replica's chunk of an invariant full-shaped value (sliced locally if needed)."""
        if atom not in self.chunk:
            axis = self.cut.axis(atom.aval)
            rows = atom.aval.shape[axis] // self.cut.n
            (self.chunk[atom],) = self.emit(
                lambda x, r: lax.dynamic_slice_in_dim(x, r * rows, rows, axis=axis), [atom, self.replica_index()], like
            )
        return self.chunk[atom]

    def scatter(self, eqn: JaxprEqn, picks: list[int]) -> None:
        rest = [k for k in range(len(eqn.invars)) if k not in picks]
        if rest:
            self.out.append(
                eqn.replace(invars=[self.full(eqn.invars[k]) for k in rest], outvars=[eqn.outvars[k] for k in rest])
            )
        for k in picks:
            x = eqn.invars[k]
            if x in self.scattered:  # a scan reduce-scattered it layer by layer
                c = self.scattered[x]
            else:
                reduce_scatter = _reduce_scatter(self.cut.n, self.cut.axis(x.aval), eqn.params["op"] == "mean")
                (c,) = self.emit(reduce_scatter, [self.full(x)], eqn)
            self.chunk[eqn.outvars[k]] = c
            self.chunk_only.add(eqn.outvars[k])

    def scan(self, eqn: JaxprEqn) -> None:
        """Stage 3: a ``scan`` over stacks stored split along a later axis reads them slice by slice.

        Precondition: an ``xs`` operand is a value held only as chunks (so they are
        chunks of one value, identical on every replica) cut along an axis ``a >= 1``.
        Then slice ``i`` of the chunk is the chunk of slice ``i`` along ``a - 1``: the
        scan gets the chunks as ``xs`` and its body all-gathers, for each equation
        that reads the slice, only that slice. A stacked output that only a
        reduce-scatter over all replicas reads (a gradient) is reduce-scattered
        slice by slice in the body instead (the sum of a stack is the stack of sums),
        so no whole stack of it is built either.
        """
        consts, carry = scan_operand_counts(eqn.params)
        body = eqn.params["jaxpr"]
        slices = [
            j
            for j, v in enumerate(eqn.invars)
            if j >= consts + carry and isinstance(v, Var) and v in self.chunk_only and (self.axis(v) or 0) >= 1
        ]
        ys = [j for j, v in enumerate(eqn.outvars) if j >= carry and v in self.scatter_ys]
        if not slices and not ys:
            self.keep(eqn)
            return
        inner = _Emitter(self.graph, self.cut, regather=True)
        invars, outvars = list(eqn.invars), list(eqn.outvars)
        body_invars = list(body.jaxpr.invars)
        for j in slices:
            old, axis = body_invars[j], self.axis(eqn.invars[j]) - 1
            invars[j] = self.chunk[eqn.invars[j]]
            body_invars[j] = inner.chunk[old] = Var(_cut_along(old.aval, axis, self.cut.n))
            inner.chunk_only.add(old)
            inner.axes[old] = axis
        for e in body.jaxpr.eqns:
            inner.keep(e)
        body_outvars = [inner.full(o) for o in body.jaxpr.outvars]
        for j in ys:
            y, axis = eqn.outvars[j], self.cut.axis(eqn.outvars[j].aval)
            reduce_scatter = _reduce_scatter(self.cut.n, axis - 1, self.scatter_ys[y])
            (body_outvars[j],) = inner.emit(reduce_scatter, [body_outvars[j]], eqn)
            outvars[j] = self.scattered[y] = Var(_cut_along(y.aval, axis, self.cut.n))
        eqns = inner.out
        new_body = body.jaxpr.replace(invars=body_invars, eqns=eqns, outvars=body_outvars, effects=merge_effects(eqns))
        params = dict(eqn.params, jaxpr=ClosedJaxpr(new_body, body.consts))
        self.keep(eqn.replace(invars=invars, outvars=outvars, params=params))

    def elementwise(self, eqn: JaxprEqn) -> None:
        (outvar,) = eqn.outvars
        atoms = [v if isinstance(v, Literal) or v.aval.shape == () else self.chunk_of(v, eqn) for v in eqn.invars]
        # The same equation on chunks, built directly (re-tracing thousands of
        # small equations would dominate the pass's time).
        c = Var(self.cut.chunk_aval(outvar.aval))
        params = dict(eqn.params, shape=c.aval.shape) if _is_scalar_broadcast(eqn) else eqn.params
        self.out.append(eqn.replace(invars=atoms, outvars=[c], params=params))
        self.chunk[outvar] = c
        self.chunk_only.add(outvar)

    def reduce(self, eqn: JaxprEqn) -> None:
        """Stage 2: the reduction of this replica's chunk, then the all-reduce of the partial results."""
        (x,), (outvar,) = eqn.invars, eqn.outvars
        partial = Var(outvar.aval)
        self.out.append(eqn.replace(invars=[self.chunk_of(x, eqn)], outvars=[partial]))
        op, n = REDUCTIONS[eqn.primitive.name], self.cut.n
        eqns, (whole,) = inline_function(
            lambda p: all_reduce_p.bind(p, op=op, group=None, group_size=n),
            [partial],
            context=self.graph.context,
            like=eqn,
        )
        (last,) = eqns  # the all-reduce writes the reduction's own result var
        self.out.append(last.replace(outvars=[outvar if v is whole else v for v in last.outvars]))

    def keep(self, eqn: JaxprEqn) -> None:
        if any(isinstance(v, Var) and v in self.chunk_only for v in eqn.invars):
            if self.regather:  # gathered for this equation only, once its other operands exist
                here: dict[Var, Atom] = {}
                deps = [
                    v
                    for v in dict.fromkeys(_vars(eqn.invars))
                    if v not in self.chunk_only and math.prod(getattr(v.aval, "shape", (0,))) > 0
                ]
                eqn = eqn.replace(invars=[self.full(v, eqn, here, deps) for v in eqn.invars])
            else:
                eqn = eqn.replace(invars=[self.full(v, eqn) for v in eqn.invars])
        self.out.append(eqn)


class ShardOptimizerUpdate(Pass):
    """Reduce-scatter gradients, update 1/N chunks, shard element-wise optimizer state.

    Sound by construction: only values the variance analysis proves identical
    on every replica are cut into chunks (see the module docstring).

    Args:
      shard_state: store state leaves that only the chunked update reads
        sharded over the replicas (ZeRO-1's memory saving). With ``False``
        they stay replicated and only the update work is split (stage 1 only).
      min_tensor_bytes: gradients and state leaves smaller than this stay
        whole (all-reduced, replicated).
      stage: ZeRO's stage. 1: optimizer state sharded. 2: also reductions of
        the reduced gradients (a global norm) computed on chunks, so that no
        whole reduced gradient is rebuilt. 3: also parameters stored sharded,
        all-gathered for each equation that reads them whole.
      slice_scans: stage 3: a stack of layers that a ``lax.scan`` reads as
        ``xs`` is stored split along a later axis and gathered slice by slice
        in the loop, its stacked gradient reduce-scattered slice by slice.
        With ``False`` it is gathered whole before the loop.
    """

    name = "shard-optimizer-update"

    def __init__(
        self,
        *,
        shard_state: bool = True,
        min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
        stage: int = 1,
        slice_scans: bool = True,
    ):
        if stage not in (1, 2, 3):
            raise ValueError(f"ShardOptimizerUpdate(stage={stage!r}): ZeRO's stage is 1, 2 or 3.")
        if stage > 1 and not shard_state:
            raise ValueError(f"ShardOptimizerUpdate(stage={stage}, shard_state=False): stages 2 and 3 shard state.")
        self.shard_state = bool(shard_state)
        self.min_tensor_bytes = int(min_tensor_bytes)
        self.stage = stage
        self.slice_scans = bool(slice_scans)

    def __repr__(self) -> str:
        return (
            f"ShardOptimizerUpdate(shard_state={self.shard_state}, min_tensor_bytes={self.min_tensor_bytes}, "
            f"stage={self.stage}{'' if self.slice_scans else ', slice_scans=False'})"
        )

    def run(self, graph: StepGraph) -> PassResult:
        n = graph.context.num_replicas
        if n == 1:
            return PassResult(graph, False)
        original = graph
        inlined = _inline_elementwise_calls(graph.jaxpr.jaxpr)
        if inlined is not graph.jaxpr.jaxpr:
            graph = graph.with_jaxpr(ClosedJaxpr(inlined, graph.jaxpr.consts))
        try:
            info = analyze(graph)
        except ReplicationError:
            # The invariance check was disabled and the step is one it rejects:
            # nothing can be proven, so nothing is rewritten.
            return PassResult(original, False)
        stacks = _scanned_stacks(graph.jaxpr.jaxpr, n) if self._slicing else frozenset()
        cut = _Cut(n, stacks)
        plan = _plan(graph, cut, info, self.shard_state, self.min_tensor_bytes, self.stage)
        jaxpr = graph.jaxpr.jaxpr
        chunks = plan.chunk_vars(jaxpr)
        notes = self._replicated_notes(graph, plan, cut, info) + self._whole_stack_notes(graph, plan, cut)
        if self.shard_state and not (plan.sharded or plan.params):
            # ZeRO pays by storing state in 1/N: without any, a
            # reduce-scatter + all-gather only replaces an all-reduce.
            return PassResult(original, False, notes)
        if not any(isinstance(v, Var) and v in chunks for v in jaxpr.outvars[: graph.num_state]):
            # No state update is computed on chunks: splitting would only add collectives.
            return PassResult(original, False, notes)
        return PassResult(self._emit(graph, plan, cut), True, notes)

    @property
    def _slicing(self) -> bool:
        return self.stage >= 3 and self.slice_scans

    def _replicated_notes(self, graph: StepGraph, plan: _Plan, cut: _Cut, info: InvarianceInfo) -> tuple[str, ...]:
        """Stage 3: why each floating-point state leaf of at least ``min_tensor_bytes`` stays replicated."""
        if self.stage < 3:
            return ()
        notes = []
        for i, v in enumerate(graph.jaxpr.jaxpr.invars[: graph.num_state]):
            if i in plan.sharded or i in plan.params or i in graph.sharded_state:
                continue
            if not is_floating(v.aval.dtype) or nbytes(v.aval) < self.min_tensor_bytes:
                continue
            if not cut.chunkable(v.aval):
                why = f"no axis of its shape {v.aval.shape} divides by the {cut.n} replicas"
            else:
                why = _why_whole(graph.jaxpr.jaxpr, info, graph.jaxpr.jaxpr.outvars[i])
            notes.append(f"ZeRO-{self.stage}: {graph.state_paths[i]} {v.aval.str_short()} stays replicated: {why}")
        return tuple(notes)

    def _whole_stack_notes(self, graph: StepGraph, plan: _Plan, cut: _Cut) -> tuple[str, ...]:
        """Stage 3: parameters stored sharded that a top-level scan reads as ``xs`` but gets whole."""
        if self.stage < 3:
            return ()
        state = {v: i for i, v in enumerate(graph.jaxpr.jaxpr.invars[: graph.num_state]) if i in plan.params}
        whole = set()
        for eqn in graph.jaxpr.jaxpr.eqns:
            if eqn.primitive.name == "scan":
                consts, carry = scan_operand_counts(eqn.params)
                whole.update(state[v] for v in _vars(eqn.invars[consts + carry :]) if v in state)
        why = (
            "slice_scans=False"
            if not self.slice_scans
            else f"no axis after the scanned one divides by the {cut.n} replicas"
        )
        return tuple(
            f"ZeRO-{self.stage}: {graph.state_paths[i]} is gathered whole before a lax.scan that reads it "
            f"layer by layer: {why}"
            for i in sorted(whole)
            if not self._slicing or (cut.axis(graph.jaxpr.jaxpr.invars[i].aval) or 0) < 1
        )

    def _emit(self, graph: StepGraph, plan: _Plan, cut: _Cut) -> StepGraph:
        jaxpr = graph.jaxpr.jaxpr
        em = _Emitter(graph, cut, regather=self.stage >= 3)
        if self._slicing:
            em.scatter_ys = _scattered_stacks(jaxpr, plan, cut)
        stored = plan.sharded | plan.params
        new_invars = list(jaxpr.invars)
        for i in stored:
            v = jaxpr.invars[i]
            new_invars[i] = em.chunk[v] = Var(cut.chunk_aval(v.aval))
            em.chunk_only.add(v)
        for index, eqn in enumerate(jaxpr.eqns):
            if index in plan.scatter:
                em.scatter(eqn, plan.scatter[index])
            elif index in plan.chunked:
                em.elementwise(eqn)
            elif index in plan.reduced:
                em.reduce(eqn)
            elif self._slicing and eqn.primitive.name == "scan":
                em.scan(eqn)
            else:
                em.keep(eqn)
        outvars = [em.chunk[a] if i in stored else em.full(a) for i, a in enumerate(jaxpr.outvars)]
        eqns = em.prologue + em.out
        new = jaxpr.replace(invars=new_invars, eqns=eqns, outvars=outvars, effects=merge_effects(eqns))
        sharded = ShardedState() | graph.sharded_state | {i: cut.axis(jaxpr.invars[i].aval) for i in stored}
        return dataclasses.replace(graph, jaxpr=ClosedJaxpr(new, graph.jaxpr.consts), sharded_state=sharded)
