"""``share-slice-kernels``: cut a buffer into same-shaped pieces at offsets XLA cannot see.

A fused collective is followed by one ``slice`` per tensor it carries
(``fuse-collectives`` concatenates, all-reduces once and slices back). XLA
fuses each slice into the code that reads the piece (an optimizer update,
say), and a slice at its own offset makes each of those fusions distinct: XLA's
CPU backend then generates and compiles one kernel per tensor where the
unfused program compiled one per *shape* (64 identical Adam updates share one
kernel; read from 64 offsets of one buffer they are 64 kernels). On a 64-layer
MLP that was most of the first call (``benchmarks/first_call.py --why-kernels``).

In the default pass manager it runs right after ``fuse-collectives``, whose pieces
are then slices of the placeholder's result. Where the top-level jaxpr takes two
or more slices of the same shape (and stride 1) from the result of one
collective, it rewrites each into a
``dynamic_slice`` whose start is a *runtime constant*: a scalar that the
compiled step receives as an argument (``StepGraph.runtime_constants``; the
executable passes the same values on every call) instead of a literal in the
program. The fusions that read the pieces are then identical, and XLA compiles
one kernel for all of them::

    a = slice[start=(0,) limit=(1024,)] buf           b = slice[start=(1024,) limit=(2048,)] buf

becomes (``o_a = 0`` and ``o_b = 1024`` are runtime constants)::

    a = dynamic_slice[slice_sizes=(1024,)] buf o_a    b = dynamic_slice[slice_sizes=(1024,)] buf o_b

An axis along which every slice of the group starts at the same index keeps it
as a literal.

The price is at run time: each reader computes its piece's address from an
argument, and the step carries one more (int32) argument per piece. On the
64-layer MLP the step measured 1.4% slower with the pass (16.50 against 16.27
ms, ``python benchmarks/bench_step.py --workloads mlp64x32 --rounds 15``),
against 1.3 s less XLA compile in its first call: for a long run on which
every step counts, ``PassManager.default(disable=["share-slice-kernels"])``.

**Precondition (soundness).** A group is rewritten only when all of these hold,
and the pass checks each:

* the equations are ``slice`` with unit strides (or none) in the top-level
  jaxpr, reading the same variable, with equal ``limit - start`` on every
  axis (the same output shape);
* that variable is the result of a collective (a placeholder or a lowered
  one, ``COLLECTIVES``): the buffers the library packs. Slices the user
  wrote are left as written (XLA may fold a static slice into the operand
  of a matmul, which a dynamic one could prevent);
* every start fits the index dtype (int32): the offsets and the starts kept as
  literals are int32 in JAX's 64-bit mode too.

``dynamic_slice`` clamps its start to ``[0, dim - size]``; a static slice's
start already lies there, so each piece holds exactly the elements it held.
Nothing else changes: the equations keep their place and results. Sub-jaxprs
(``scan`` bodies, ``cond`` branches, calls) are left alone: their constants are
not arguments of the step. The pass reads no replica-dependent value and
makes none (the runtime constants are the same on every replica, and the
variance analysis treats constants as identical everywhere).

Tests (``tests/passes/test_share_slice_kernels.py``): what is rewritten and
what is not (one slice of a shape, strided slices, slices in a ``scan`` body,
slices of arrays that are not collective results, one slice each of two
collective results), same-shaped slices of two collective results grouped
apart (``test_slices_of_different_collective_results_are_grouped_apart``, and
their numbers on a square mesh), the numbers against the vmap simulation and a
one-device reference, and the compiled program's distinct kernels.

>>> import replicator as rp
>>> def step(batch):
...     g = {f"w{i}": batch.sum(0) * i for i in range(4)}
...     return rp.all_mean(g)
>>> lowered = rp.Replicator(1, 8).lower(step, np.ones((8, 2, 3), np.float32))
>>> final = lowered.final
>>> len(final.runtime_constants)  # the 4 pieces of the fused buffer start at runtime offsets
4
>>> rp.passes.count_primitives(final.jaxpr, ["slice", "dynamic_slice"])
{'dynamic_slice': 4}
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, JaxprEqn, Var

from replicator.core.graph import StepGraph
from replicator.core.jaxprs import inline_function
from replicator.core.primitives import PLACEHOLDERS
from replicator.pass_manager.contract import Pass, PassResult
from replicator.pass_manager.verify import MESH_COLLECTIVES

__all__ = ["ShareSliceKernels"]

INDEX_DTYPE = np.dtype(np.int32)

#: Primitives whose results the pass cuts: the placeholders and the mesh collectives they lower to.
COLLECTIVES = frozenset(p.name for p in PLACEHOLDERS) | MESH_COLLECTIVES


def _group_key(eqn: JaxprEqn, collective_results: set[Var]) -> tuple | None:
    """``(operand, sizes)`` of a rewritable slice, else None."""
    if eqn.primitive is not lax.slice_p or not isinstance(eqn.invars[0], Var):
        return None
    if eqn.invars[0] not in collective_results:
        return None
    strides = eqn.params.get("strides")
    if strides is not None and any(s != 1 for s in strides):
        return None
    starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
    if any(int(s) > np.iinfo(INDEX_DTYPE).max for s in starts):
        return None
    return eqn.invars[0], tuple(int(hi) - int(lo) for lo, hi in zip(starts, limits, strict=True))


class ShareSliceKernels(Pass):
    """Same-shaped slices of one array start at runtime constants, so XLA compiles one kernel for their readers.

    Args:
      min_group: rewrite only groups of at least this many slices (one slice
        alone gains nothing: its readers are distinct anyway).
    """

    name = "share-slice-kernels"
    #: It rewrites slices, not collectives: it works on placeholders or on the lowered graph.
    needs_placeholders = False
    #: The buffers it cuts are those that fusion makes.
    run_after = ("fuse-collectives",)

    def __init__(self, min_group: int = 2):
        if isinstance(min_group, bool) or not isinstance(min_group, int) or min_group < 2:
            raise ValueError(f"ShareSliceKernels: min_group must be an int >= 2, got {min_group!r}.")
        self.min_group = min_group

    def __repr__(self) -> str:
        return f"{type(self).__name__}(min_group={self.min_group})"

    def run(self, graph: StepGraph) -> PassResult:
        jaxpr = graph.jaxpr.jaxpr
        collective_results = {v for e in jaxpr.eqns if e.primitive.name in COLLECTIVES for v in e.outvars}
        groups: dict[tuple, list[int]] = {}
        for index, eqn in enumerate(jaxpr.eqns):
            key = _group_key(eqn, collective_results)
            if key is not None:
                groups.setdefault(key, []).append(index)
        chosen = [indices for indices in groups.values() if len(indices) >= self.min_group]
        if not chosen:
            return PassResult(graph, False)
        # Each group is emitted where its first slice was (its operand is defined there; the offsets are
        # constants), its other slices are dropped; later equations read the new pieces.
        emitted_at: dict[int, list[JaxprEqn]] = {}
        dropped: set[int] = set()
        env: dict[Var, Any] = {}
        new_constvars: list[Var] = []
        new_consts: list[Any] = []
        for indices in chosen:
            members = [jaxpr.eqns[i] for i in indices]
            starts = [tuple(int(s) for s in eqn.params["start_indices"]) for eqn in members]
            varying = [axis for axis in range(len(starts[0])) if len({s[axis] for s in starts}) > 1]
            if not varying:  # the same slice several times: its readers share a kernel already
                continue
            offsets = [Var(jax.core.ShapedArray((), INDEX_DTYPE)) for _ in members for _ in varying]
            new_constvars += offsets
            new_consts += [INDEX_DTYPE.type(start[axis]) for start in starts for axis in varying]
            eqns, outs = _dynamic_slices(graph, members, starts, varying, offsets)
            emitted_at[indices[0]] = eqns
            dropped.update(indices[1:])
            env.update((eqn.outvars[0], out) for eqn, out in zip(members, outs, strict=True))
        if not emitted_at:
            return PassResult(graph, False)
        eqns = []
        for index, eqn in enumerate(jaxpr.eqns):
            if index in emitted_at:
                eqns.extend(emitted_at[index])
            elif index not in dropped:
                reads_new = any(isinstance(v, Var) and v in env for v in eqn.invars)
                eqns.append(eqn.replace(invars=[_read(env, v) for v in eqn.invars]) if reads_new else eqn)
        new = jaxpr.replace(
            constvars=[*jaxpr.constvars, *new_constvars],
            eqns=eqns,
            outvars=[_read(env, v) for v in jaxpr.outvars],
        )
        closed = ClosedJaxpr(new, [*graph.jaxpr.consts, *new_consts])
        runtime = frozenset(graph.runtime_constants) | frozenset(new_constvars)
        result = graph.with_jaxpr(closed)
        return PassResult(result.with_runtime_constants(runtime), True)


def _read(env: dict[Var, Any], atom: Any) -> Any:
    return env.get(atom, atom) if isinstance(atom, Var) else atom


def _dynamic_slices(
    graph: StepGraph, members: list[JaxprEqn], starts: list[tuple[int, ...]], varying: list[int], offsets: list[Var]
) -> tuple[list[JaxprEqn], list[Any]]:
    """The slices ``members`` of one array as ``dynamic_slice``s starting at ``offsets`` along ``varying`` axes
    (``len(varying)`` offsets per member, in order); one trace for the group."""
    limits = members[0].params["limit_indices"]
    sizes = [int(hi) - int(lo) for lo, hi in zip(starts[0], limits, strict=True)]

    def fn(x: Any, *dynamic: Any) -> list:
        pieces = []
        for m, start in enumerate(starts):
            # The literal starts in the offsets' dtype: a Python int is int64 under ``jax.enable_x64`` and
            # ``dynamic_slice`` takes indices of one dtype.
            index: list[Any] = [INDEX_DTYPE.type(s) for s in start]
            for k, axis in enumerate(varying):
                index[axis] = dynamic[m * len(varying) + k]
            # Starts are never negative: no wrap-around code in every reader (JAX adds it by default).
            pieces.append(lax.dynamic_slice(x, index, sizes, allow_negative_indices=False))
        return pieces

    return inline_function(fn, [members[0].invars[0], *offsets], context=graph.context, like=members[0])
