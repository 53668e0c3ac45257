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
scheduling. Below the table the report gives the state bytes per device
(predicted, then XLA's measured memory) and, with ZeRO, every state
leaf it left whole, grouped by reason with the option that changes it
(:func:`~replicator.cost.memory.zero_account`). For a model of *time*, ``report.predict(topology)`` costs every
row with the alpha-beta model of :mod:`replicator.cost.collectives` on a
preset (``'gpu-nvlink-8'``, ...) or a calibrated :class:`Topology`.

>>> repl = rp.Replicator(1, 8, passes=rp.PassManager.default(all_reduce_algorithm="ring"))
>>> report = repl.explain(lambda b: rp.all_sum(b), np.ones((8, 16), np.float32))
>>> row = report.rows[0]
>>> row.kind, row.algorithm, row.nbytes, row.sent_bytes  # 2 * 7 chunks of 8 bytes
('all_sum', 'ring', 64, 112.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from replicator.core.graph import CollectiveRecord, TensorLayout
from replicator.cost.collectives import Prediction, tensor_sent_bytes
from replicator.cost.collectives import predict as _predict
from replicator.cost.memory import (
    ZeroAccount,
    human_bytes,
    state_bytes_by_zero_stage,
    state_bytes_per_device,
    zero_account,
)
from replicator.cost.table import format_table
from replicator.cost.topology import Topology
from replicator.pass_manager.manager import Lowered
from replicator.passes.shard_optimizer import DEFAULT_MIN_TENSOR_BYTES

__all__ = ["CommunicationReport", "communication_report", "tensor_lines"]


@dataclasses.dataclass(frozen=True)
class CommunicationReport:
    """The collectives of one compiled step; ``str()`` is a table."""

    rows: tuple[CollectiveRecord, ...]
    num_replicas: int
    passes: tuple[str, ...]
    #: Workers of the mesh (which link a collective over all replicas uses); ``None``: unknown.
    num_workers: int | None = None
    #: The pass manager's notes (``auto=True``: the options it chose and why).
    notes: tuple[str, ...] = ()
    #: Bytes of state one device stores between steps, predicted from the graph
    #: (:func:`~replicator.cost.memory.state_bytes_per_device`); ``None``: unknown.
    state_bytes: int | None = None
    #: Compiles the step and returns its measured per-device memory (``Lowered.memory``);
    #: called when the report is printed, or by :meth:`memory`.
    memory_fn: Callable[[], Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    #: The same prediction for each ZeRO level 0-3 (:func:`~replicator.cost.memory.state_bytes_by_zero_stage`),
    #: with the pass manager's ``shard_optimizer_min_bytes`` if it runs ZeRO.
    state_bytes_by_stage: Mapping[int, int] | None = None
    #: With ZeRO: every state leaf, sharded or replicated and why
    #: (:func:`~replicator.cost.memory.zero_account`); ``None`` without one.
    zero: ZeroAccount | None = None
    #: With a tensor axis: its size and what the split inserted over it
    #: (:class:`~replicator.tensor.placement.Collective`, program order); ``None`` without one.
    tensor: TensorLayout | None = None

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
                    human_bytes(r.nbytes),
                    str(r.tensors),
                    human_bytes(r.sent_bytes),
                    r.region,
                    r.sources[0] if r.sources else "",
                )
            )
        summary = (
            f"{self.num_collectives} collective(s) on {self.num_replicas} replicas; estimated "
            f"{human_bytes(self.total_sent_bytes)} sent per replica per step. Passes: {', '.join(self.passes)}."
        )
        memory = [*tensor_lines(self.tensor)]
        if self.state_bytes is not None:
            memory.append(f"state per device (predicted from the graph): {human_bytes(self.state_bytes)}")
        if self.state_bytes_by_stage:
            stages = ", ".join(f"{k}: {human_bytes(v)}" for k, v in sorted(self.state_bytes_by_stage.items()))
            options = "zero=k"
            if self.zero is not None and self.zero.min_tensor_bytes != DEFAULT_MIN_TENSOR_BYTES:
                options += f", shard_optimizer_min_bytes={self.zero.min_tensor_bytes}"
            memory.append(f"state per device at each ZeRO level (PassManager.default({options}), predicted): {stages}")
        if self.zero is not None:
            memory.append(str(self.zero))
        if self.memory_fn is not None:
            memory.append(str(self.memory()))
        return "\n".join([format_table(header, lines), summary, *memory, *self.notes])


def tensor_lines(t: TensorLayout | None, per: str = "step") -> list[str]:
    """The collectives over the tensor axis, each with the user's line and why, and bytes a device sends
    (none without a tensor axis); ``per``: what one pass of the split graph is (a step, a micro-batch)."""
    if t is None:
        return []
    rows = [
        (
            str(i),
            c.kind,
            c.dtype,
            "x".join(map(str, c.shape)) or "()",
            human_bytes(c.nbytes),
            human_bytes(tensor_sent_bytes(c.kind, c.nbytes, t.size)),
            c.line,
            c.reason,
        )
        for i, c in enumerate(t.collectives)
    ]
    header = ("#", "kind", "dtype", "shape", "bytes", "sent/device", "source", "reason")
    total = sum(tensor_sent_bytes(c.kind, c.nbytes, t.size) for c in t.collectives)
    return [
        f"over the tensor axis '{t.axis}' (T = {t.size}), inserted by the plan:",
        format_table(header, rows) if rows else "  none",
        f"{len(rows)} collective(s) over '{t.axis}'; {human_bytes(total)} sent per device per {per} (ring).",
    ]


def communication_report(lowered: Lowered) -> CommunicationReport:
    """The report for a step that went through the pass manager.

    One row per collective that ``lower-collectives`` lowered, in the order
    it lowered them (program order, the collectives inside a sub-jaxpr before
    the equation holding it), as recorded in the final graph.
    """
    final = lowered.final
    active = tuple(s.name for s in lowered.snapshots[1:])  # the passes that ran (auto: the chosen ones)
    zero = zero_account(lowered)
    return CommunicationReport(
        tuple(final.collectives),
        final.context.num_replicas,
        active,
        num_workers=final.context.num_workers,
        notes=lowered.notes,
        state_bytes=state_bytes_per_device(final),
        memory_fn=lowered.memory_fn,
        state_bytes_by_stage=_by_stage(lowered, DEFAULT_MIN_TENSOR_BYTES if zero is None else zero.min_tensor_bytes),
        zero=zero,
        tensor=final.tensor,
    )


def _by_stage(lowered: Lowered, min_tensor_bytes: int) -> dict[int, int] | None:
    """The state per device at each ZeRO level, from the graph before ZeRO ran."""
    names = [s.name for s in lowered.snapshots]
    before = names.index("shard-optimizer-update") - 1 if "shard-optimizer-update" in names else None
    if before is None:
        before = names.index("simplify") if "simplify" in names else 0
    graph = lowered.snapshots[before].graph
    if graph.sharded_state or graph.collectives:  # already sharded or lowered: not the graph the stages start from
        return None
    return state_bytes_by_zero_stage(graph, min_tensor_bytes=min_tensor_bytes)
