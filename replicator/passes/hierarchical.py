"""``hierarchical-allreduce``: all-reduce within workers, then across them.

On a two-level mesh the links between the cores of one worker are usually
fast and the links between workers slow (on one host they need not be:
measurements in BENCHMARKS.md). An all-reduce over every replica can be split
so that only ``1 / C`` of the buffer crosses the slow links (``C`` cores per
worker), as in Horovod's hierarchical all-reduce and NCCL's tree/ring hybrids::

    s = rp.all_reduce[op=mean group=None] g                  # f32[20], W x C replicas

becomes, still on placeholders::

    buf   = pad (concatenate (reshape g) ...) to a multiple of C     # f32[20 + p]
    chunk = rp.reduce_scatter[group='cores'] buf                     # my 1/C, summed in my worker
    chunk = rp.all_reduce[op=sum group='workers'] chunk              # summed across workers
    chunk = chunk / (W * C)                                          # mean: scale once
    full  = rp.all_gather[tiled=True group='cores'] chunk            # every core's chunk
    s     = reshape (slice full 0:20)

Only ``all_reduce`` placeholders with op ``sum`` or ``mean`` over all replicas
(``group=None``) are rewritten; the operands of each ``(dtype, weak_type)``
share one buffer. Nothing changes when the mesh has one worker or one core
per worker (there is no hierarchy to exploit), for ``max``/``min`` (no
``reduce_scatter`` for them) or for buffers below ``min_bytes``. The pass
binds placeholders only, so ``lower-collectives`` stays the one place that
knows the mesh axes, and an all-reduce algorithm chosen there (e.g.
``'ring'``) applies to the inter-worker step too.

**Precondition (soundness).** An ``rp.all_reduce`` is rewritten only if
all of these hold (:meth:`HierarchicalAllReduce.is_candidate`):

* its op is ``sum`` or ``mean``: a reduce-scatter can only add. (``max`` and
  ``min`` would decompose too, but there is no max-scatter placeholder; they
  are left alone);
* its group is ``None`` (all ``W x C`` replicas) on a mesh with ``W >= 2``
  and ``C >= 2``: group collectives and one-level meshes are left alone;
* every operand has a numeric, non-boolean NumPy dtype (booleans cannot be
  added; extended dtypes such as PRNG keys are not arrays of numbers) and
  together they carry at least ``min_bytes`` (and more than zero) bytes.

Why it is then the same reduction: the padded buffer is cut into ``C`` chunks;
core ``c`` of every worker ends the reduce-scatter with chunk ``c`` summed
over its worker's cores, the all-reduce over ``'workers'`` adds the chunks
``c`` of all workers (the replicas with core index ``c``), and the tiled
all-gather over ``'cores'`` puts chunk ``c`` back at position ``c``. Every
element is thus the sum of its ``W * C`` values, and every replica holds the
same buffer. Integer sums wrap around exactly as one sum does (addition mod
``2**bits`` is associative); floating-point sums are added in another order,
so they differ from one ``psum`` by rounding only, as two XLA algorithms do.
A ``mean`` (float dtypes only: ``all_mean`` rejects integers) divides the
summed chunk by ``W * C`` once, in the operand's dtype, as the native lowering
does. Tests just outside (``tests/passes/test_hierarchical.py``):
``test_only_sum_and_mean_over_all_replicas_are_rewritten``,
``test_nothing_to_do_without_two_levels``,
``test_zero_size_operands_are_left_alone``, ``test_min_bytes``; against numpy:
``test_integer_sums_wrap_and_means_match_numpy``.

Run it after ``fuse-collectives`` (it then splits the fused buckets, one
rewrite per bucket) and before ``lower-collectives``. It recurses into every
sub-jaxpr (``cond`` branches, ``scan``/``while`` bodies, ``jit``, ``remat``,
custom-derivative calls) and never moves a collective across a control-flow
boundary. Running it on its own output changes nothing.

Example (``rp.PassManager.default(hierarchical=True)`` inserts it with
``min_bytes=0``):

>>> from replicator.passes import HierarchicalAllReduce, default_passes
>>> passes = default_passes()
>>> passes.insert(-1, HierarchicalAllReduce(min_bytes=1024))
>>> repl = rp.Replicator(num_workers=2, cores_per_worker=4, passes=rp.PassManager(passes))
>>> report = repl.explain(lambda b: rp.all_mean(b), np.ones((8, 1024), np.float32))
>>> [(r.kind, r.group) for r in report.rows]
[('reduce_scatter', 'cores'), ('all_sum', 'workers'), ('all_gather', 'cores')]
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from replicator.core.buffers import nbytes, per_dtype_buffers
from replicator.core.context import CORES, WORKERS, ReplicaContext
from replicator.core.graph import StepGraph
from replicator.core.primitives import all_gather_p, all_reduce_p, reduce_scatter_p
from replicator.pass_manager.contract import Pass, PassResult, replace_placeholders

__all__ = ["HierarchicalAllReduce", "hierarchical_all_reduce"]

Atom = Any  # Var | Literal
#: The all-reduce ops this pass rewrites (a reduce-scatter can only sum).
OPS = ("sum", "mean")


def hierarchical_all_reduce(*xs: Any, op: str, context: ReplicaContext) -> list:
    """All-reduce ``xs`` over every replica in three placeholder steps.

    Args:
      xs: the operands of one ``all_reduce`` (any shapes; numeric dtypes).
      op: ``'sum'`` or ``'mean'``.
      context: the mesh shape (``W`` workers, ``C`` cores per worker).

    Returns:
      One array per operand, like ``xs``: the sum (or mean) over all ``W * C``
      replicas, computed as reduce-scatter over ``'cores'``, all-reduce over
      ``'workers'`` of the ``1 / C`` chunk, all-gather over ``'cores'``.
    """
    workers, cores = context.num_workers, context.cores_per_worker
    total = workers * cores

    def reduce(buffers: list) -> list:
        chunks = []
        for buf in buffers:
            size = buf.shape[0]
            padded = -(-size // cores) * cores
            if padded != size:
                buf = lax.pad(buf, np.zeros((), buf.dtype), ((0, padded - size, 0),))
            chunks.append(reduce_scatter_p.bind(buf, axis=0, group=CORES, group_size=cores))
        # One inter-worker collective for the chunks of every dtype.
        chunks = all_reduce_p.bind(*chunks, op="sum", group=WORKERS, group_size=workers)
        out = []
        for chunk in chunks:
            if op == "mean":
                chunk = chunk / jnp.asarray(total, chunk.dtype)
            out.append(all_gather_p.bind(chunk, axis=0, tiled=True, group=CORES, group_size=cores))
        return out

    return per_dtype_buffers(xs, reduce)


class HierarchicalAllReduce(Pass):
    """Split all-replica sum/mean all-reduces into cores / workers / cores steps.

    Args:
      min_bytes: rewrite only all-reduces that carry at least this many bytes
        (all operands together); smaller ones keep a single collective, whose
        latency is lower than three.
    """

    name = "hierarchical-allreduce"

    def __init__(self, min_bytes: int = 0):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, (int, np.integer)):
            raise TypeError(f"HierarchicalAllReduce: min_bytes must be an int, got {min_bytes!r}.")
        if min_bytes < 0:
            raise ValueError(f"HierarchicalAllReduce: min_bytes must be >= 0, got {min_bytes}.")
        self.min_bytes = int(min_bytes)

    def __repr__(self) -> str:
        return f"HierarchicalAllReduce(min_bytes={self.min_bytes})"

    def is_candidate(self, eqn: JaxprEqn) -> bool:
        """An all-reduce this pass rewrites (on a mesh with both levels)."""
        if eqn.primitive is not all_reduce_p or eqn.params["op"] not in OPS or eqn.params["group"] is not None:
            return False
        avals = [v.aval for v in eqn.invars]
        if not avals or not all(isinstance(getattr(a, "dtype", None), np.dtype) for a in avals):
            return False
        if any(a.dtype == np.bool_ for a in avals):
            return False
        size = sum(nbytes(a) for a in avals)
        return size > 0 and size >= self.min_bytes

    def run(self, graph: StepGraph) -> PassResult:
        context = graph.context
        if context.num_workers == 1 or context.cores_per_worker == 1:
            return PassResult(graph, False)

        def lowering(eqn: JaxprEqn) -> Any:
            op = eqn.params["op"]
            return lambda *xs: hierarchical_all_reduce(*xs, op=op, context=context)

        return replace_placeholders(graph, self.is_candidate, lowering)
