"""Communication report: what a compiled step sends between replicas.

``Replicator.explain(step_fn, input_fn_or_batch, state)`` traces and rewrites a
step (nothing runs) and returns a :class:`CommunicationReport`: one row per
collective that will run, with its kind, group, algorithm, dtype, payload
bytes, bucket membership (how many tensors of the collectives the user
wrote it carries, and from which lines), and an *estimate* of the bytes each replica
sends per step.

The estimates use the bandwidth-optimal cost of each collective for a group of
``N`` replicas and a payload of ``B`` bytes (what ring algorithms achieve and
what XLA's native collectives approach):

=====================  =============================================
all-reduce             ``2 (N-1)/N * B``
hierarchical           ``2 (C-1)/C * B + 2 (W-1)/W * B/C``
all-gather             ``(N-1) * B``  (B: one replica's input)
reduce-scatter         ``(N-1)/N * B``
broadcast              ``2 (N-1)/N * B``  (lowered as a masked all-reduce)
replica_id             ``0``
=====================  =============================================

For the tree (reduce-then-broadcast) algorithm the same average holds, but the
root sends ``log2(N)`` times more than the others. Figures are per replica and
per step; they do not include XLA's own scheduling.

Example::

    print(repl.explain(step_fn, input_fn, state))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn

from replicator._jax_compat import user_source_line
from replicator.core.context import ReplicaContext
from replicator.core.primitives import (
    PLACEHOLDERS,
    all_gather_p,
    all_reduce_p,
    broadcast_p,
    collective_name,
    reduce_scatter_p,
    replica_id_p,
)
from replicator.passes.base import StepGraph, sub_jaxprs
from replicator.passes.pipeline import Lowered, Pipeline

__all__ = ["CollectiveRow", "CommunicationReport", "communication_report"]

FUSE = "fuse-allreduce"
HIERARCHICAL = "hierarchical-allreduce"
LOWER = "lower-collectives"


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """One collective of a compiled step."""

    kind: str  # e.g. 'all_mean', 'all_gather'
    group: str | None
    algorithm: str
    dtype: str
    nbytes: int  # payload of one replica
    tensors: int  # tensors (operands of the user's collectives) it carries
    sources: tuple[str, ...]
    region: str
    sent_bytes: float  # estimated bytes sent per replica per step


@dataclasses.dataclass(frozen=True)
class CommunicationReport:
    """The collectives of one compiled step; ``str()`` is a table."""

    rows: tuple[CollectiveRow, ...]
    num_replicas: int
    passes: tuple[str, ...]

    @property
    def total_sent_bytes(self) -> float:
        return sum(r.sent_bytes for r in self.rows)

    @property
    def num_collectives(self) -> int:
        return sum(1 for r in self.rows if r.kind != "replica_id")

    def __str__(self) -> str:
        header = (
            "#",
            "kind",
            "group",
            "algorithm",
            "dtype",
            "bytes",
            "tensors",
            "sent/replica",
            "region",
            "first source",
        )
        lines = [header]
        for i, r in enumerate(self.rows):
            lines.append(
                (
                    str(i),
                    r.kind,
                    "all" if r.group is None else r.group,
                    r.algorithm,
                    r.dtype,
                    _human(r.nbytes),
                    str(r.tensors),
                    _human(r.sent_bytes),
                    r.region,
                    r.sources[0] if r.sources else "",
                )
            )
        widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
        table = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
        table.insert(1, "  ".join("-" * w for w in widths))
        summary = (
            f"{self.num_collectives} collective(s) on {self.num_replicas} replicas; estimated "
            f"{_human(self.total_sent_bytes)} sent per replica per step. Passes: {', '.join(self.passes)}."
        )
        return "\n".join([*table, summary])


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def _nbytes(aval: object) -> int:
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize  # type: ignore[attr-defined]


def _walk(jaxpr: Jaxpr, region: str) -> Iterator[tuple[str, JaxprEqn]]:
    """Placeholder equations with their region path, callees first."""
    for index, eqn in enumerate(jaxpr.eqns):
        for k, sub in enumerate(sub_jaxprs(eqn.params)):
            yield from _walk(sub, f"{region}/{eqn.primitive.name}@{index}.{k}")
        if eqn.primitive in PLACEHOLDERS:
            yield region, eqn


def _all_reduce_cost(nbytes: int, group: str | None, algorithm: str, context: ReplicaContext) -> float:
    if algorithm == "hierarchical":
        c, w = context.cores_per_worker, context.num_workers
        return 2 * (c - 1) / c * nbytes + 2 * (w - 1) / w * nbytes / c
    n = context.group_size(group)
    return 2 * (n - 1) / n * nbytes


def _algorithm(pipeline: Pipeline, kind: str) -> str:
    for p in pipeline.passes:
        if p.name == LOWER:
            return dict(getattr(p, "algorithms", {}) or {}).get(kind, "native")
    return "native"


def _hierarchical_applies(pipeline: Pipeline, op: str, group: str | None, context: ReplicaContext) -> bool:
    active = HIERARCHICAL in pipeline.names and HIERARCHICAL not in pipeline.disabled
    return (
        active and group is None and op in ("sum", "mean") and context.num_workers > 1 and context.cores_per_worker > 1
    )


def _never(eqn: JaxprEqn) -> bool:
    del eqn
    return False


def communication_report(lowered: Lowered, pipeline: Pipeline) -> CommunicationReport:
    """The report for a step that went through ``pipeline``.

    All-reduce rows come from the fusion plan (one row per bucket, with the
    user's collectives it carries); other collectives from the graph right
    before lowering.
    """
    names = [s.name for s in lowered.stages]
    before_lowering: StepGraph = lowered.stages[names.index(LOWER) - 1].graph
    context = before_lowering.context
    rows: list[CollectiveRow] = []
    native_all_reduce = _algorithm(pipeline, "all_reduce")

    def all_reduce_row(op, group, dtype, nbytes, tensors, sources, region) -> CollectiveRow:
        hierarchical = _hierarchical_applies(pipeline, op, group, context)
        algorithm = "hierarchical" if hierarchical else native_all_reduce
        return CollectiveRow(
            kind=f"all_{op}",
            group=group,
            algorithm=algorithm,
            dtype=dtype,
            nbytes=nbytes,
            tensors=tensors,
            sources=sources,
            region=region,
            sent_bytes=_all_reduce_cost(nbytes, group, algorithm, context),
        )

    def gather_scatter_row(kind, group, dtype, nbytes, tensors, sources, region) -> CollectiveRow:
        n = context.group_size(group)
        sent = (n - 1) * nbytes if kind == "all_gather" else (n - 1) / n * nbytes
        return CollectiveRow(kind, group, "native", dtype, nbytes, tensors, sources, region, sent)

    covered = _never
    if FUSE in names:
        from replicator.passes.fuse_allreduce import FuseAllReduce

        fuser = next(p for p in pipeline.passes if p.name == FUSE)
        assert isinstance(fuser, FuseAllReduce)
        covered = fuser.is_candidate
        for b in fuser.plan(lowered.stages[names.index(FUSE) - 1].graph):
            make = all_reduce_row if b.kind == "all_reduce" else gather_scatter_row
            first = b.op if b.kind == "all_reduce" else b.kind
            rows.append(make(first, b.group, b.dtype, b.nbytes, b.num_operands, b.sources, b.region))
    graph_for_rest = lowered.stages[names.index(FUSE) - 1].graph if FUSE in names else before_lowering
    for region, eqn in _walk(graph_for_rest.jaxpr.jaxpr, "step"):
        if covered(eqn):
            continue
        p = eqn.params
        source = (user_source_line(eqn.source_info),)
        if eqn.primitive is all_reduce_p:
            dtypes = sorted({np.dtype(v.aval.dtype).name for v in eqn.invars})
            nbytes = sum(_nbytes(v.aval) for v in eqn.invars)
            rows.append(all_reduce_row(p["op"], p["group"], "/".join(dtypes), nbytes, len(eqn.invars), source, region))
            continue
        (x,) = eqn.invars if eqn.invars else (None,)
        n = p.get("group_size", 1)
        if eqn.primitive is replica_id_p:
            sent, nbytes, dtype = 0.0, 0, "int32"
        else:
            nbytes, dtype = _nbytes(x.aval), np.dtype(x.aval.dtype).name
            if eqn.primitive is all_gather_p:
                sent = (n - 1) * nbytes
            elif eqn.primitive is reduce_scatter_p:
                sent = (n - 1) / n * nbytes
            elif eqn.primitive is broadcast_p:
                sent = 2 * (n - 1) / n * nbytes
            else:  # pragma: no cover - a new placeholder without a cost model
                sent = float("nan")
        rows.append(
            CollectiveRow(
                kind=collective_name(eqn.primitive, p),
                group=p.get("group"),
                algorithm="native",
                dtype=dtype,
                nbytes=nbytes,
                tensors=1,
                sources=source,
                region=region,
                sent_bytes=sent,
            )
        )
    active = tuple(n for n in pipeline.names if n not in pipeline.disabled)
    return CommunicationReport(tuple(rows), context.num_replicas, active)
