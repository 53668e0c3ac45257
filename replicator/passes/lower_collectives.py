"""``lower-collectives``: swap every placeholder for a real mesh collective.

The last pass of every pass manager. Each placeholder primitive has a lowering
rule below, written as ordinary ``lax`` code over the mesh axes
``('workers', 'cores')``; the pass traces the rule on the placeholder's operands
and splices the result in its place, in every sub-jaxpr too (``jit``, ``cond``
branches, ``scan``, ``while`` condition and body, ``remat``, custom-derivative
calls, ``closed_call``).

Some collectives can be lowered by more than one *algorithm*
(:data:`ALGORITHMS`); the pass takes the choice in its constructor. For
``all_reduce``:

* ``'native'`` (the default): ``lax.psum``/``pmax``/``pmin`` over the group's
  axes; XLA picks how the data moves.
* ``'ring'``: the bandwidth-optimal ring all-reduce of Baidu and Horovod, from
  ``lax.ppermute``. The operands are flattened into one buffer per dtype,
  padded to a multiple of the group size ``N`` and cut into ``N`` chunks; in
  ``N - 1`` reduce-scatter steps every replica sends one chunk to its
  successor and combines the chunk it receives, after which replica ``r``
  holds the full reduction of chunk ``r + 1 (mod N)``; ``N - 1`` all-gather
  steps pass the reduced chunks around the ring. Each replica sends
  ``2 (N - 1) / N`` times the buffer.
* ``'reduce_broadcast'``: parameter-server style, reduce to one replica then
  broadcast, as a binary tree of ``lax.ppermute``: ``ceil(log2 N)`` steps in
  which replica ``r + d`` sends its partial result to ``r`` (``r`` a multiple
  of ``2d``, ``d = 1, 2, 4, ...``) leave the reduction on replica 0, and as
  many steps back down the tree copy it to everyone. Works for any ``N``.
  Latency-optimal for tiny buffers (``2 log2 N`` messages), but every step
  moves the whole buffer.

Both work for every op (``sum``/``mean`` add, ``max``/``min`` combine with
``lax.max``/``lax.min``) and every group, and give every replica of a group
bitwise the same result (each element is reduced once, on one replica, and
copied). Sums are added in a different order than by ``psum``, so float
results differ from ``'native'`` by rounding (about ``1e-6`` relative in f32).

**Precondition (soundness).** The pass has none of its own: it must run
(it is ``required``) and each rule computes its placeholder's documented
result over the group's mesh axes, for every op, group and dtype the
placeholders accept. Replica order is the mesh's: the linear index of
``lax.axis_index``/``ppermute``/``all_gather``/``psum_scatter`` over
``('workers', 'cores')`` is ``worker * C + core``, the replica id. For the
two alternative ``all_reduce`` algorithms:

* ops: ``sum`` and ``mean`` combine with ``lax.add`` (``mean`` divides the
  sum by ``N`` afterwards, in the operand's dtype, as ``'native'`` does),
  ``max``/``min`` with ``lax.max``/``lax.min``; booleans (``max``/``min``
  only: the API rejects summing them) travel as int32 and are cast back;
* dtypes: any numeric dtype. Integer sums wrap around exactly as ``psum``'s
  (addition mod ``2**bits`` is associative and commutative), ``max``/``min``
  are exact; float sums are added in another order than ``psum``'s, so they
  differ by rounding only;
* group sizes: any ``N >= 1``, powers of two or not. The ring pads the
  buffer with zeros to a multiple of ``N`` and slices them off (padding
  never meets a real element: chunks are combined position by position); the
  tree leaves a replica without a partner as it is (``ppermute`` gives
  non-receivers zeros, which ``select`` discards). ``N = 1`` is the identity;
* groups ``None``, ``'cores'`` and ``'workers'``: each ``ppermute`` and
  ``axis_index`` is over the group's axes only, so the replicas of one group
  talk to each other and to no one else.

Tests: ``tests/passes/test_algorithms.py`` checks both algorithms against
``'native'`` for every op, group and dtype, and against numpy with every
replica simulated (``test_narrow_dtypes_and_odd_group_sizes_match_numpy``:
groups of 3 and 7, wrapping int8 sums, uint8, bool, float16); the
differential fuzzer (``tests/fuzz``) runs all three against all replicas
simulated on one device.

Example: ``all_mean`` becomes a ``psum`` (and a division); with the ring
algorithm (``rp.PassManager.default(all_reduce_algorithm="ring")`` puts
``LowerCollectives(algorithms={"all_reduce": "ring"})`` last), two scans of
``ppermute`` and no ``psum``:

>>> from replicator.passes import count_primitives
>>> step, batch = (lambda b: rp.all_mean(b)), np.ones((8, 4), np.float32)
>>> final = rp.Replicator(1, 8).lower(step, batch).final
>>> count_primitives(final.jaxpr, ["psum", "ppermute"])
{'psum': 1}
>>> ring = rp.Replicator(1, 8, passes=rp.PassManager.default(all_reduce_algorithm="ring"))
>>> count_primitives(ring.lower(step, batch).final.jaxpr, ["psum", "ppermute", "scan"])
{'scan': 2, 'ppermute': 2}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn, Primitive

from replicator.analysis.records import emitted_bytes, estimated_sent_bytes, origin_of
from replicator.core.buffers import nbytes, per_dtype_buffers
from replicator.core.context import group_axes
from replicator.core.graph import CollectiveRecord, StepGraph
from replicator.core.jaxprs import inline_function, iter_regions
from replicator.core.primitives import (
    PLACEHOLDERS,
    all_gather_p,
    all_reduce_p,
    broadcast_p,
    collective_name,
    reduce_scatter_p,
    replica_id_p,
)
from replicator.pass_manager.contract import Pass, PassResult, rewrite_graph

__all__ = [
    "ALGORITHMS",
    "LOWERINGS",
    "LowerCollectives",
    "lower_all_reduce",
    "lower_all_reduce_reduce_broadcast",
    "lower_all_reduce_ring",
]

Lowering = Callable[..., Any]
#: The default lowering of each placeholder.
LOWERINGS: dict[Primitive, Lowering] = {}
#: Alternative lowerings: per placeholder, algorithm name -> lowering. The
#: ``'native'`` entry of each is its rule in :data:`LOWERINGS`.
ALGORITHMS: dict[Primitive, dict[str, Lowering]] = {}


def _as_reducible(x: Any) -> tuple[Any, Any]:
    """Booleans cannot be all-reduced by XLA: carry them as int32."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.int32), jnp.bool_
    return x, None


def _restore(x: Any, dtype: Any) -> Any:
    return x if dtype is None else x.astype(dtype)


# ----------------------------------------------------------------------------
# all_reduce: native, ring, reduce_broadcast
# ----------------------------------------------------------------------------


def lower_all_reduce(*xs: Any, op: str, group: str | None, group_size: int) -> list:
    """``psum``/``pmax``/``pmin`` over the group's mesh axes (mean: psum, then divide)."""
    axes = group_axes(group)
    if op == "sum":
        return list(lax.psum(list(xs), axes))
    if op == "mean":
        return [s / jnp.asarray(group_size, s.dtype) for s in lax.psum(list(xs), axes)]
    reduce = lax.pmax if op == "max" else lax.pmin
    out = []
    for x in xs:
        x, dtype = _as_reducible(x)
        out.append(_restore(reduce(x, axes), dtype))
    return out


LOWERINGS[all_reduce_p] = lower_all_reduce
ALGORITHMS[all_reduce_p] = {"native": lower_all_reduce}

#: How two partial results are combined, per all-reduce op.
_COMBINE: dict[str, Callable[[Any, Any], Any]] = {"sum": lax.add, "mean": lax.add, "max": lax.max, "min": lax.min}
BufferReduction = Callable[[Any, tuple[str, ...], int, Callable[[Any, Any], Any]], Any]


def _per_buffer(xs: tuple, op: str, group: str | None, group_size: int, reduce_buffer: BufferReduction) -> list:
    """All-reduce ``xs`` with ``reduce_buffer``, one flat buffer per dtype.

    The operands of each ``(dtype, weak_type)`` are flattened and concatenated
    into one 1-D buffer (:func:`~replicator.core.buffers.per_dtype_buffers`;
    booleans carried as int32), ``reduce_buffer(buffer, axes, group_size,
    combine)`` reduces it over the group, and the result is cut back into the
    operands' shapes. ``mean`` divides the sum by the group size, as the
    native lowering does.
    """
    axes = group_axes(group)

    def reduce_each(buffers: list) -> list:
        out = []
        for buf in buffers:
            buf, dtype = _as_reducible(buf)
            out.append(_restore(reduce_buffer(buf, axes, group_size, _COMBINE[op]), dtype))
        return out

    out = per_dtype_buffers(xs, reduce_each)
    if op == "mean":
        out = [s / jnp.asarray(group_size, s.dtype) for s in out]
    return out


def _ring_buffer(buf: Any, axes: tuple[str, ...], n: int, combine: Callable[[Any, Any], Any]) -> Any:
    """Ring all-reduce of a 1-D buffer over the ``n`` replicas along ``axes``.

    Replica ``r`` sends to ``r + 1 (mod n)`` in every step. Reduce-scatter
    step ``s`` (``0 <= s < n - 1``): send chunk ``r - s``, combine the
    received one into chunk ``r - 1 - s``; afterwards chunk ``r + 1`` is fully
    reduced on replica ``r``. All-gather step ``s``: send chunk ``r + 1 - s``,
    store the received one as chunk ``r - s``. The steps run in a
    ``lax.fori_loop`` (a scan of ``n - 1`` steps), so the graph does not grow
    with ``n``.
    """
    if n == 1:
        return buf
    size = buf.shape[0]
    chunk = -(-size // n)
    if chunk * n != size:
        buf = lax.pad(buf, np.zeros((), buf.dtype), ((0, chunk * n - size, 0),))
    chunks = lax.reshape(buf, (n, chunk))
    me = lax.axis_index(axes)
    to_next = tuple((i, (i + 1) % n) for i in range(n))

    def index(offset: int, step: Any) -> Any:
        """``(me + offset - step) mod n``; the operand of ``rem`` stays >= 0."""
        return lax.rem(me + np.int32(n + offset) - step, np.int32(n))

    def reduce_scatter_step(step: Any, chunks: Any) -> Any:
        sent = lax.dynamic_slice_in_dim(chunks, index(0, step), 1, axis=0)
        received = lax.ppermute(sent, axes, to_next)
        into = index(-1, step)
        mine = lax.dynamic_slice_in_dim(chunks, into, 1, axis=0)
        return lax.dynamic_update_slice_in_dim(chunks, combine(mine, received), into, axis=0)

    def all_gather_step(step: Any, chunks: Any) -> Any:
        sent = lax.dynamic_slice_in_dim(chunks, index(1, step), 1, axis=0)
        received = lax.ppermute(sent, axes, to_next)
        return lax.dynamic_update_slice_in_dim(chunks, received, index(0, step), axis=0)

    chunks = lax.fori_loop(0, n - 1, reduce_scatter_step, chunks)
    chunks = lax.fori_loop(0, n - 1, all_gather_step, chunks)
    return lax.slice(lax.reshape(chunks, (chunk * n,)), (0,), (size,))


def lower_all_reduce_ring(*xs: Any, op: str, group: str | None, group_size: int) -> list:
    """Ring all-reduce (reduce-scatter, then all-gather) from ``lax.ppermute``."""
    return _per_buffer(xs, op, group, group_size, _ring_buffer)


ALGORITHMS[all_reduce_p]["ring"] = lower_all_reduce_ring


def _tree_buffer(buf: Any, axes: tuple[str, ...], n: int, combine: Callable[[Any, Any], Any]) -> Any:
    """Binary-tree reduce onto replica 0, then tree broadcast from it.

    Reduce, for ``d = 1, 2, 4, ... < n``: replica ``r`` with ``r % 2d == d``
    sends its partial result to ``r - d``, which combines it with its own
    (a replica ``r % 2d == 0`` with ``r + d >= n`` has no partner and keeps
    its value: this is what makes any ``n`` work). Replica 0 ends with the
    reduction of all ``n``. Broadcast, for the same ``d`` in reverse: replica
    ``r`` with ``r % 2d == 0`` sends to ``r + d`` (if ``< n``), which takes it.
    """
    me = lax.axis_index(axes)
    distance = 1
    while distance < n:
        pairs = tuple((src, src - distance) for src in range(distance, n, 2 * distance))
        received = lax.ppermute(buf, axes, pairs)
        receives = (lax.rem(me, np.int32(2 * distance)) == 0) & (me + np.int32(distance) < n)
        buf = lax.select(lax.broadcast(receives, buf.shape), combine(buf, received), buf)
        distance *= 2
    while distance > 1:
        distance //= 2
        pairs = tuple((src, src + distance) for src in range(0, n, 2 * distance) if src + distance < n)
        received = lax.ppermute(buf, axes, pairs)
        receives = lax.rem(me, np.int32(2 * distance)) == distance
        buf = lax.select(lax.broadcast(receives, buf.shape), received, buf)
    return buf


def lower_all_reduce_reduce_broadcast(*xs: Any, op: str, group: str | None, group_size: int) -> list:
    """Reduce onto replica 0 of the group, then broadcast (binary trees of ``lax.ppermute``)."""
    return _per_buffer(xs, op, group, group_size, _tree_buffer)


ALGORITHMS[all_reduce_p]["reduce_broadcast"] = lower_all_reduce_reduce_broadcast


# ----------------------------------------------------------------------------
# all_gather, reduce_scatter, broadcast, replica_id
# ----------------------------------------------------------------------------


def lower_all_gather(x: Any, *, axis: int, tiled: bool, group: str | None, group_size: int) -> Any:
    del group_size
    return lax.all_gather(x, group_axes(group), axis=axis, tiled=tiled)


LOWERINGS[all_gather_p] = lower_all_gather


def lower_reduce_scatter(x: Any, *, axis: int, group: str | None, group_size: int) -> Any:
    del group_size
    return lax.psum_scatter(x, group_axes(group), scatter_dimension=axis, tiled=True)


LOWERINGS[reduce_scatter_p] = lower_reduce_scatter


def lower_broadcast(x: Any, *, source: int, group: str | None, group_size: int) -> Any:
    del group_size
    axes = group_axes(group)
    x, dtype = _as_reducible(x)
    mine = lax.axis_index(axes) == source
    return _restore(lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axes), dtype)


LOWERINGS[broadcast_p] = lower_broadcast


def lower_replica_id(*, group: str | None) -> Any:
    return lax.axis_index(group_axes(group)).astype(jnp.int32)


LOWERINGS[replica_id_p] = lower_replica_id


# ----------------------------------------------------------------------------
# The pass
# ----------------------------------------------------------------------------


def _short_name(prim: Primitive) -> str:
    return prim.name.removeprefix("rp.")


class LowerCollectives(Pass):
    """Replace each placeholder by its rule in :data:`LOWERINGS` or :data:`ALGORITHMS`.

    Args:
      algorithms: the algorithm per collective, e.g. ``{"all_reduce": "ring"}``;
        collectives not named use ``'native'``. The choices are the keys of
        :data:`ALGORITHMS` (``all_reduce``: ``'native'``, ``'ring'``,
        ``'reduce_broadcast'``).
    """

    name = "lower-collectives"
    lowers = True
    needs_placeholders = False
    required = True

    def __init__(self, algorithms: Mapping[str, str] | None = None):
        by_name = {_short_name(p): p for p in ALGORITHMS}
        algorithms = dict(algorithms or {})
        unknown = sorted(set(algorithms) - set(by_name))
        if unknown:
            raise ValueError(
                f"LowerCollectives(algorithms=...): no algorithms for {unknown}; "
                f"collectives with a choice: {sorted(by_name)}."
            )
        chosen: dict[str, str] = {}
        for name in sorted(by_name):
            algorithm = algorithms.get(name, "native")
            choices = ALGORITHMS[by_name[name]]
            if algorithm not in choices:
                raise ValueError(
                    f"LowerCollectives: unknown algorithm {algorithm!r} for {name}; choose from {sorted(choices)}."
                )
            chosen[name] = algorithm
        self.algorithms = chosen
        self._lowerings: dict[Primitive, Lowering] = dict(LOWERINGS)
        for name, algorithm in chosen.items():
            self._lowerings[by_name[name]] = ALGORITHMS[by_name[name]][algorithm]

    def __repr__(self) -> str:
        return f"LowerCollectives(algorithms={self.algorithms!r})"

    def run(self, graph: StepGraph) -> PassResult:
        """Lower every placeholder; record each in the new graph's ``collectives``."""
        regions = {
            eqn.outvars[0]: region
            for region, eqn in iter_regions(graph.jaxpr.jaxpr)
            if eqn.primitive in PLACEHOLDERS and eqn.outvars
        }
        records: list[CollectiveRecord] = []

        def rule(eqn: JaxprEqn) -> Any:
            lowering = self._lowerings.get(eqn.primitive)
            if lowering is None:
                return None

            def fn(*xs: Any) -> Any:
                return lowering(*xs, **eqn.params)

            eqns, outs = inline_function(fn, eqn.invars, context=graph.context, like=eqn)
            records.append(
                self._record(eqn, eqns, graph, regions.get(eqn.outvars[0], "step") if eqn.outvars else "step")
            )
            return eqns, outs

        result = rewrite_graph(graph, rule)
        if not records:
            return result
        return PassResult(dataclasses.replace(result.graph, collectives=tuple(records)), result.changed)

    def _record(self, eqn: JaxprEqn, emitted: list[JaxprEqn], graph: StepGraph, region: str) -> CollectiveRecord:
        """What one placeholder became: its payload, algorithm and the bytes of what was emitted."""
        name = _short_name(eqn.primitive)
        origin = origin_of(eqn, graph.collective_origins)
        dtypes = sorted({np.dtype(v.aval.dtype).name for v in eqn.invars}) or ["int32"]
        return CollectiveRecord(
            kind=collective_name(eqn.primitive, eqn.params),
            group=eqn.params.get("group"),
            algorithm=self.algorithms.get(name, "native"),
            dtype="/".join(dtypes),
            nbytes=sum(nbytes(v.aval) for v in eqn.invars),
            tensors=origin.tensors,
            sources=origin.sources,
            region=region,
            sent_bytes=estimated_sent_bytes(emitted, graph.context.axis_sizes),
            emitted_bytes=emitted_bytes(emitted),
            group_size=graph.context.group_size(eqn.params.get("group")),
            operands=max(1, len(eqn.invars)),
        )
