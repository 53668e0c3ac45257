"""What the passes record about a step's collectives, for the communication report.

``lower-collectives`` leaves one :class:`CollectiveRecord` per placeholder it
lowered in :attr:`StepGraph.collectives <replicator.core.graph.StepGraph>`:
the placeholder's kind, group, lowering algorithm, the dtype and bytes of its
payload as it goes on the wire (after ``compress-communication``: bfloat16),
and the bytes of the mesh collectives it emitted, counted from the emitted
equations. The passes that replace placeholders by others
(``fuse-collectives``, ``compress-communication``, ``hierarchical-allreduce``)
pass on, in :attr:`StepGraph.collective_origins`, how many of the user's
tensors each new placeholder carries and from which source lines
(:class:`Origin`), so that a fused bucket's row still names them.

:func:`emitted_bytes` is the counting rule: for every ``psum``/``pmax``/
``pmin``/``all_gather``/``reduce_scatter`` (``lax.psum_scatter``)/``ppermute``
equation, the bytes of its operands, times the trip count of every enclosing
``scan`` (a ``fori_loop`` with static bounds is one; a ``while`` counts once).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from jax.extend.core import Jaxpr, JaxprEqn, Var

from replicator._jax_compat import user_source_line
from replicator.core.buffers import nbytes
from replicator.core.graph import Origin
from replicator.core.jaxprs import sub_jaxprs
from replicator.core.primitives import PLACEHOLDERS

__all__ = ["MESH_REDUCTIONS", "emitted_bytes", "estimated_sent_bytes", "origin_of", "pass_on_origin"]

#: Mesh collectives whose operands are all-reduced.
MESH_REDUCTIONS = frozenset(["psum", "pmax", "pmin"])
_COUNTED = MESH_REDUCTIONS | {"all_gather", "reduce_scatter", "ppermute"}


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
