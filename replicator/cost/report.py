"""Communication report: what a compiled step sends between replicas.

``Replicator.explain(step_fn, input_fn_or_batch, state)`` traces and rewrites a
step (nothing runs) and returns a :class:`CommunicationReport`: one row per
collective that ``lower-collectives`` lowered, with its kind, group,
algorithm, dtype on the wire, payload bytes, how many tensors of the
collectives the user wrote it carries (a fused bucket carries several) and
from which lines, and an *estimate* of the bytes each replica sends per step.

The report guesses nothing from pass names: every row is a
:class:`~replicator.core.graph.CollectiveRecord` that the passes left in
the lowered graph (:attr:`StepGraph.collectives
<replicator.core.graph.StepGraph>`). So a bucket split by ``fuse-collectives``'s
``threshold_bytes`` or a tensor kept alone by its ``max_tensor_bytes`` is its
own row, ``compress-communication``'s all-reduces show their bfloat16 bytes,
``hierarchical-allreduce`` shows its three steps (a reduce-scatter and an
all-gather over ``'cores'``, an all-reduce over ``'workers'``), and only where
its ``min_bytes`` let it rewrite.

The estimate (``sent/replica``) is counted from the mesh collectives that
``lower-collectives`` emitted for the row, each with ``N`` replicas and ``B``
operand bytes:

=====================  =============================================
psum/pmax/pmin         ``2 (N-1)/N * B``  (bandwidth-optimal)
all_gather             ``(N-1) * B``  (B: one replica's input)
psum_scatter           ``(N-1)/N * B``
ppermute               ``B`` for each replica that sends, times the trip
                       count of the loop around it; the busiest replica
=====================  =============================================

So the ``'ring'`` all-reduce costs ``2 (N-1)`` chunks of ``B/N`` (rounded up),
and the ``'reduce_broadcast'`` tree costs what its busiest replica sends:
``B`` per tree level it sends in (``log2 N`` levels for a power of two). A
broadcast is lowered as a masked all-reduce; ``replica_id`` sends nothing.
Figures are per replica and per step; they do not include XLA's own
scheduling. For a model of *time*, ``report.predict(topology)`` costs every
row with the alpha-beta model of :mod:`replicator.cost.collectives` on a
preset (``'gpu-nvlink-8'``, ...) or a calibrated :class:`Topology`.

>>> repl = rp.Replicator(1, 8, passes=rp.Pipeline.default(all_reduce_algorithm="ring"))
>>> report = repl.explain(lambda b: rp.all_sum(b), np.ones((8, 16), np.float32))
>>> row = report.rows[0]
>>> row.kind, row.algorithm, row.nbytes, row.sent_bytes  # 2 * 7 chunks of 8 bytes
('all_sum', 'ring', 64, 112.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from replicator.core.graph import CollectiveRecord
from replicator.cost.collectives import Prediction
from replicator.cost.collectives import predict as _predict
from replicator.cost.memory import state_bytes_by_zero_stage, state_bytes_per_device
from replicator.cost.table import format_table
from replicator.cost.topology import Topology
from replicator.pipeline.pipeline import Lowered

__all__ = ["CommunicationReport", "communication_report"]


@dataclasses.dataclass(frozen=True)
class CommunicationReport:
    """The collectives of one compiled step; ``str()`` is a table."""

    rows: tuple[CollectiveRecord, ...]
    num_replicas: int
    passes: tuple[str, ...]
    #: Workers of the mesh (which link a collective over all replicas uses); ``None``: unknown.
    num_workers: int | None = None
    #: The pipeline's notes (``auto=True``: the options it chose and why).
    notes: tuple[str, ...] = ()
    #: Bytes of state one device stores between steps, predicted from the graph
    #: (:func:`~replicator.cost.memory.state_bytes_per_device`); ``None``: unknown.
    state_bytes: int | None = None
    #: Compiles the step and returns its measured per-device memory (``Lowered.memory``);
    #: called when the report is printed, or by :meth:`memory`.
    memory_fn: Callable[[], Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    #: The same prediction for each ZeRO stage 0-3 (:func:`~replicator.cost.memory.state_bytes_by_zero_stage`).
    state_bytes_by_stage: Mapping[int, int] | None = None

    def memory(self) -> Any:
        """Per-device memory of the compiled step (XLA's analysis; compiles it), or ``None`` if unknown."""
        return self.memory_fn() if self.memory_fn is not None else None

    @property
    def total_sent_bytes(self) -> float:
        return sum(r.sent_bytes for r in self.rows)

    @property
    def num_collectives(self) -> int:
        return sum(1 for r in self.rows if r.kind != "replica_id")

    def predict(self, topology: str | Topology) -> Prediction:
        """How long these collectives take on ``topology``: a preset name or a :class:`Topology`.

        See :mod:`replicator.cost.collectives` (the alpha-beta model, the
        presets and their sources, ``calibrate``). ``print()`` the result.
        """
        return _predict(self, topology)

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
        lines = []
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
        summary = (
            f"{self.num_collectives} collective(s) on {self.num_replicas} replicas; estimated "
            f"{_human(self.total_sent_bytes)} sent per replica per step. Passes: {', '.join(self.passes)}."
        )
        memory = []
        if self.state_bytes is not None:
            memory.append(f"state per device (predicted from the graph): {_human(self.state_bytes)}")
        if self.state_bytes_by_stage:
            stages = ", ".join(f"{k}: {_human(v)}" for k, v in sorted(self.state_bytes_by_stage.items()))
            memory.append(f"state per device at each ZeRO stage (Pipeline.default(zero_stage=k), predicted): {stages}")
        if self.memory_fn is not None:
            memory.append(str(self.memory()))
        return "\n".join([format_table(header, lines), summary, *memory, *self.notes])


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def communication_report(lowered: Lowered) -> CommunicationReport:
    """The report for a step that went through ``pipeline``.

    One row per collective that ``lower-collectives`` lowered, in the order
    it lowered them (program order, the collectives inside a sub-jaxpr before
    the equation holding it), as recorded in the final graph.
    """
    final = lowered.final
    active = tuple(s.name for s in lowered.stages[1:])  # the passes that ran (auto: the chosen ones)
    return CommunicationReport(
        tuple(final.collectives),
        final.context.num_replicas,
        active,
        num_workers=final.context.num_workers,
        notes=lowered.notes,
        state_bytes=state_bytes_per_device(final),
        memory_fn=lowered.memory_fn,
        state_bytes_by_stage=_by_stage(lowered),
    )


def _by_stage(lowered: Lowered) -> dict[int, int] | None:
    """The state per device at each ZeRO stage, from the graph before any ZeRO stage ran."""
    names = [s.name for s in lowered.stages]
    before = names.index("shard-optimizer-update") - 1 if "shard-optimizer-update" in names else None
    if before is None:
        before = names.index("simplify") if "simplify" in names else 0
    graph = lowered.stages[before].graph
    if graph.sharded_state or graph.collectives:  # already sharded or lowered: not the graph the stages start from
        return None
    return state_bytes_by_zero_stage(graph)
