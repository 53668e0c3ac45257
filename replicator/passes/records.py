"""What the passes record about a step's collectives, for the communication report.

``lower-collectives`` leaves one :class:`CollectiveRecord` per placeholder it
lowered in :attr:`StepGraph.collectives <replicator.core.graph.StepGraph>`:
the placeholder's kind, group, lowering algorithm, the dtype and bytes of its
payload as it goes on the wire (after ``compress-communication``: bfloat16),
and the bytes of the mesh collectives it emitted, counted from the emitted
equations. The passes that replace placeholders by others
(``fuse-allreduce``, ``compress-communication``, ``hierarchical-allreduce``)
pass on, in :attr:`StepGraph.collective_origins`, how many of the user's
tensors each new placeholder carries and from which source lines
(:class:`Origin`), so that a fused bucket's row still names them.

:func:`emitted_bytes` is the counting rule: for every ``psum``/``pmax``/
``pmin``/``all_gather``/``reduce_scatter`` (``lax.psum_scatter``)/``ppermute``
equation, the bytes of its operands, times the trip count of every enclosing
``scan`` (a ``fori_loop`` with static bounds is one; a ``while`` counts once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from jax.extend.core import Jaxpr, JaxprEqn, Var

from replicator._jax_compat import user_source_line
from replicator.core.primitives import PLACEHOLDERS
from replicator.passes.base import sub_jaxprs
from replicator.passes.buffers import nbytes

__all__ = [
    "MESH_REDUCTIONS",
    "CollectiveRecord",
    "Origin",
    "emitted_bytes",
    "estimated_sent_bytes",
    "origin_of",
    "pass_on_origin",
]

#: Mesh collectives whose operands are all-reduced.
MESH_REDUCTIONS = frozenset(["psum", "pmax", "pmin"])
_COUNTED = MESH_REDUCTIONS | {"all_gather", "reduce_scatter", "ppermute"}


@dataclasses.dataclass(frozen=True)
class Origin:
    """The user's tensors a placeholder carries: how many, and the source line of each collective."""

    tensors: int
    sources: tuple[str, ...]

    @staticmethod
    def merge(origins: Iterable[Origin]) -> Origin:
        origins = list(origins)
        return Origin(sum(o.tensors for o in origins), tuple(s for o in origins for s in o.sources))


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One placeholder collective as ``lower-collectives`` lowered it.

    Attributes:
      kind: the placeholder, e.g. ``'all_mean'``, ``'all_gather'``, ``'replica_id'``.
      group: the replica group (``None``: all replicas, ``'cores'``, ``'workers'``).
      algorithm: the lowering (``'native'``, ``'ring'``, ``'reduce_broadcast'``).
      dtype: the payload's dtype(s) on the wire, ``/``-joined.
      nbytes: the payload of one replica: the placeholder's operand bytes.
      tensors: the user's tensors it carries (a fused bucket carries several).
      sources: the user's source line of each collective it carries.
      region: where it is: ``'step'``, then ``/<primitive>@<equation>.<sub-jaxpr>``
        per nesting level (:func:`~replicator.passes.base.iter_regions`).
      sent_bytes: estimated bytes one replica sends per step: the
        bandwidth-optimal cost of each emitted mesh collective over its ``N``
        replicas (all-reduce ``2 (N-1)/N B``, all-gather ``(N-1) B``,
        reduce-scatter ``(N-1)/N B``, ``B`` its operand bytes), and for
        ``ppermute`` the bytes sent by the busiest replica, counted from the
        permutation (times the loop trip count).
      emitted_bytes: the operand bytes of the mesh collectives emitted
        (:func:`emitted_bytes`).
      group_size: ``N``.
      operands: the arrays the placeholder reduces at once (an unfused
        ``all_sum`` of a list has one per leaf; a fused bucket has one).
    """

    kind: str
    group: str | None
    algorithm: str
    dtype: str
    nbytes: int
    tensors: int
    sources: tuple[str, ...]
    region: str
    sent_bytes: float
    emitted_bytes: int = 0
    group_size: int = 1
    operands: int = 1


# ----------------------------------------------------------------------------
# Origins: which user tensors a placeholder carries
# ----------------------------------------------------------------------------


def origin_of(eqn: JaxprEqn, origins: Mapping[Var, Origin]) -> Origin:
    """What ``eqn`` carries: the origins recorded on its results, or itself (its operands, its line)."""
    known = [origins[v] for v in eqn.outvars if v in origins]
    if known:
        return Origin.merge(known)
    return Origin(max(len(eqn.invars), 1 if eqn.outvars else 0), (user_source_line(eqn.source_info),))


def pass_on_origin(origin: Origin, new_eqns: Sequence[JaxprEqn]) -> dict[Var, Origin]:
    """``origin`` for every placeholder among ``new_eqns`` (that replace one carrying it), by first result."""
    return {e.outvars[0]: origin for e in new_eqns if e.primitive in PLACEHOLDERS and e.outvars}


# ----------------------------------------------------------------------------
# Counting what the lowering emitted
# ----------------------------------------------------------------------------


def _axes(eqn: JaxprEqn) -> tuple[str, ...]:
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    return axes if isinstance(axes, tuple) else (axes,)


def _walk(eqns: Iterable[JaxprEqn], trips: int) -> Iterable[tuple[JaxprEqn, int]]:
    """Every equation with how many times it runs (``scan`` multiplies by its length)."""
    for eqn in eqns:
        yield eqn, trips
        inner = trips * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else trips
        for sub in sub_jaxprs(eqn.params):
            yield from _walk(sub.eqns, inner)


def emitted_bytes(eqns: Iterable[JaxprEqn] | Jaxpr) -> int:
    """Operand bytes of the mesh collectives among ``eqns`` (sub-jaxprs included, times loop trips)."""
    if isinstance(eqns, Jaxpr):
        eqns = eqns.eqns
    return sum(
        trips * sum(nbytes(v.aval) for v in eqn.invars)
        for eqn, trips in _walk(eqns, 1)
        if eqn.primitive.name in _COUNTED
    )


def estimated_sent_bytes(eqns: Iterable[JaxprEqn], axis_sizes: Mapping[str, int]) -> float:
    """Bytes one replica sends to run ``eqns`` (see :attr:`CollectiveRecord.sent_bytes`)."""
    sent = 0.0
    permuted: dict[int, float] = {}
    for eqn, trips in _walk(eqns, 1):
        name = eqn.primitive.name
        if name not in _COUNTED:
            continue
        n = 1
        for axis in _axes(eqn):
            n *= axis_sizes.get(axis, 1)
        b = trips * sum(nbytes(v.aval) for v in eqn.invars)
        if name in MESH_REDUCTIONS:
            sent += 2 * (n - 1) / n * b
        elif name == "all_gather":
            sent += (n - 1) * b
        elif name == "reduce_scatter":
            sent += (n - 1) / n * b
        else:  # ppermute: only the sources send
            for src, _ in eqn.params["perm"]:
                permuted[src] = permuted.get(src, 0.0) + b
    return sent + max(permuted.values(), default=0.0)
