"""Communication cost model: how long a step's collectives take (alpha-beta).

Every row of a :class:`~replicator.cost.report.CommunicationReport` is one
collective with ``N`` replicas (its ``group_size``) and ``B`` payload bytes per
replica (its ``nbytes``). A :class:`Link` has a latency ``alpha`` (seconds per
message, one step of the algorithm) and an inverse bandwidth ``beta`` (seconds
per byte one replica sends); the time of one collective is the classic
alpha-beta estimate (Thakur, Rabenseifner and Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005;
https://doi.org/10.1177/1094342005051521):

=================================  ==============================================
all-reduce, ``'ring'``             ``2 (N-1) alpha + 2 (N-1)/N B beta``
all-reduce, ``'native'``           as ``'ring'``: NCCL's choice for large buffers
                                   (XLA hands the all-reduce to NCCL on GPUs)
all-reduce, ``'reduce_broadcast'`` ``2 ceil(log2 N) (alpha + B beta)``: a binary
                                   tree to replica 0 and back, whole buffers
all_gather                         ``(N-1) alpha + (N-1) B beta`` (``B``: one
                                   replica's input)
reduce_scatter                     ``(N-1) alpha + (N-1)/N B beta``
broadcast                          an all-reduce (it is lowered as a masked one)
replica_id, or ``N == 1``          ``0``
=================================  ==============================================

All-reduces are ``all_sum``, ``all_mean``, ``all_max`` and ``all_min``.

Which link: a :class:`Topology` has one link per mesh axis. A collective over
``'cores'`` uses ``cores``, over ``'workers'`` uses ``workers``. A collective
over all replicas (``group=None``) spans both: with more than one worker its
ring crosses both links and the slower one paces every step, so it is costed
for all ``N`` replicas with the larger ``alpha`` and the larger ``beta`` of
the two (``workers`` on every preset; an upper bound: the hops on the faster
link are cheaper); with one worker it is costed with ``cores``. ``hierarchical-allreduce`` exists to avoid exactly this: its
three rows cost a reduce-scatter and an all-gather on ``cores`` and an
all-reduce of ``B / cores`` bytes on ``workers``.

What it does not model: overlap of communication with compute or with other
collectives, congestion between the concurrent rings of a collective over
``'workers'`` (one per core) that share a host's network interface (give
such a topology the per-replica share of the bandwidth), the per-call launch
overhead of the runtime, protocol changes with message size (NCCL's LL/LL128
protocols have lower latency for small messages than the Simple protocol
whose latency the GPU presets use), and loop trip counts: a collective inside
a ``scan`` is one row and is counted once.

Presets (:data:`PRESETS`; each figure's source is in the docstring of
:data:`PRESETS` and in ``docs/design/costmodel.md``), or measure the machine at hand
with :func:`replicator.tools.calibrate.calibrate`:

>>> report = rp.Replicator(2, 4).explain(lambda b: rp.all_sum(b), np.ones((4, 256), np.float32))
>>> prediction = report.predict("gpu-hosts-100gbe")
>>> row = report.rows[0]
>>> row.kind, row.group, row.group_size, row.nbytes
('all_sum', None, 8, 1024)
>>> round(prediction.total_s * 1e6, 2)  # two workers, so Ethernet: 2*7 * 9.6 us + 2*7/8 * 1024 B / 12.5 GB/s
134.54
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from replicator.core.graph import CollectiveRecord
from replicator.core.primitives import REDUCE_OPS
from replicator.cost.table import format_table
from replicator.cost.topology import Link, Topology, get_topology

__all__ = ["Prediction", "collective_time", "predict"]

#: The kinds costed as an all-reduce: ``all_<op>`` for every op of ``rp.all_reduce``, and
#: ``broadcast`` (lowered as a masked all-reduce).
ALL_REDUCE_KINDS = frozenset([*(f"all_{op}" for op in REDUCE_OPS), "broadcast"])


# ----------------------------------------------------------------------------
# Links and topologies
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# The formulas
# ----------------------------------------------------------------------------


def ring_allreduce_time(n: int, nbytes: float, link: Link) -> float:
    """``2 (N-1) alpha + 2 (N-1)/N B beta``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes * link.beta_s_per_byte


def tree_allreduce_time(n: int, nbytes: float, link: Link) -> float:
    """``2 ceil(log2 N) (alpha + B beta)``: reduce up a binary tree, broadcast down."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * (link.alpha_s + nbytes * link.beta_s_per_byte)


def all_gather_time(n: int, nbytes: float, link: Link) -> float:
    """``(N-1) alpha + (N-1) B beta``, ``B`` one replica's input."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) * nbytes * link.beta_s_per_byte


def reduce_scatter_time(n: int, nbytes: float, link: Link) -> float:
    """``(N-1) alpha + (N-1)/N B beta``, ``B`` one replica's whole input."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes * link.beta_s_per_byte


def collective_time(record: CollectiveRecord, topology: Topology | str, *, num_workers: int | None = None) -> float:
    """Predicted seconds of one collective (a report row) on ``topology``.

    Args:
      record: a row of :class:`~replicator.cost.report.CommunicationReport`.
      topology: a :class:`Topology` or the name of a preset in :data:`PRESETS`.
      num_workers: the mesh's workers, which decide the link of a collective
        over all replicas (see :meth:`Topology.link`); ``None``: the slower link.
    """
    topology = get_topology(topology)
    n, b, kind = record.group_size, record.nbytes, record.kind
    if kind == "replica_id" or n <= 1:
        return 0.0
    link = topology.link(record.group, num_workers)
    one = topology.native_latency == "one"
    if kind == "all_gather":
        return all_gather_time(n, b, link) - ((n - 2) * link.alpha_s if one else 0.0)
    if kind == "reduce_scatter":
        return reduce_scatter_time(n, b, link) - ((n - 2) * link.alpha_s if one else 0.0)
    if kind not in ALL_REDUCE_KINDS:
        raise ValueError(f"collective_time: no cost formula for a collective of kind {kind!r}.")
    if record.algorithm == "reduce_broadcast":
        return tree_allreduce_time(n, b, topology.link(record.group, num_workers, p2p=True))
    if record.algorithm == "ring":
        return ring_allreduce_time(n, b, topology.link(record.group, num_workers, p2p=True))
    if record.algorithm == "native":
        # Several operands (an unfused all_sum of a list) are one all-reduce each: a latency term per
        # operand, the bytes once (the ring and tree lowerings pack them into one buffer first).
        k = max(1, record.operands)
        if topology.native_latency == "one":
            return k * link.alpha_s + 2 * (n - 1) / n * b * link.beta_s_per_byte
        return (k - 1) * ring_allreduce_time(n, 0.0, link) + ring_allreduce_time(n, b, link)
    raise ValueError(
        f"collective_time: unknown algorithm {record.algorithm!r} for {kind}; "
        f"the model knows 'native', 'ring' and 'reduce_broadcast'."
    )


def tensor_sent_bytes(kind: str, nbytes: float, size: int) -> float:
    """Bytes one device sends, by the ring algorithm, for a collective over the tensor axis of a value of
    ``nbytes`` in all: an all-reduce 2(T-1)/T of it, a reduce-scatter, an all-gather or a ring of collective
    matmul (T-1)/T (Megatron's count)."""
    share = (size - 1) / size
    return (2 * share if kind.startswith("all-reduce") else share) * nbytes


def tensor_collective_time(kind: str, nbytes: float, size: int, topology: Topology | str) -> float:
    """Predicted seconds of one collective over the tensor axis (``T = size`` neighbours of a worker: the
    ``cores`` link) of a value of ``nbytes`` in all: ``'all-reduce'`` (also ``-max``/``-min``), ``'reduce-scatter'``
    or ``'all-gather'`` (each device starts with ``nbytes / size``), and the rings of collective matmul
    (``'ring all-gather matmul'``, ``'ring matmul reduce-scatter'``: ``T - 1`` sends of ``nbytes / size``)."""
    topology = get_topology(topology)
    if size <= 1:
        return 0.0
    link, one = topology.cores, topology.native_latency == "one"
    if kind.startswith("all-reduce"):
        if one:
            return link.alpha_s + 2 * (size - 1) / size * nbytes * link.beta_s_per_byte
        return ring_allreduce_time(size, nbytes, link)
    if kind == "reduce-scatter":
        return reduce_scatter_time(size, nbytes, link) - ((size - 2) * link.alpha_s if one else 0.0)
    if kind == "all-gather":
        return all_gather_time(size, nbytes / size, link) - ((size - 2) * link.alpha_s if one else 0.0)
    if kind in ("ring all-gather matmul", "ring matmul reduce-scatter"):
        # Collective matmul (tensor/overlap.py): T - 1 ppermutes of one block each; the sends alone, as if
        # none of them were hidden behind the partial matmuls.
        return reduce_scatter_time(size, nbytes, link)
    raise ValueError(f"tensor_collective_time: no cost formula for {kind!r}.")


def ring_matmul_time(nbytes: float, size: int, flops: float, topology: Topology | str) -> float:
    """Predicted seconds a ring of collective matmul (``tensor/overlap.py``) adds to its matmul's own: ``T - 1``
    point-to-point sends of one block of ``nbytes / size`` (the ``ppermute`` link, ``p2p_cores``), each hidden
    behind one step's partial matmul (``flops / T`` of them) where the topology overlaps computation and
    communication (:attr:`Topology.overlap`), else after it.

    >>> ring_matmul_time(2**20, 4, 0.0, "gpu-nvlink-8") == ring_matmul_time(2**20, 4, 0.0, "cpu-emulated")
    False
    >>> ring_matmul_time(2**20, 4, 1e12, "gpu-nvlink-8")  # the sends all hidden behind a large matmul
    0.0
    """
    topology = get_topology(topology)
    if size <= 1:
        return 0.0
    link = topology.link("cores", p2p=True)
    send = link.alpha_s + nbytes / size * link.beta_s_per_byte
    if not topology.overlap:
        return (size - 1) * send
    step = flops / size * topology.compute.seconds_per_flop if topology.compute else 0.0
    # Step 0 computes on the block the device holds; each later step waits for the longer of its send and
    # the previous step's matmul.
    return (size - 1) * max(step, send) - (size - 1) * step


# ----------------------------------------------------------------------------
# Predictions
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted time of each collective of a step on a topology; ``str()`` is a table."""

    topology: Topology
    rows: tuple[CollectiveRecord, ...]
    seconds: tuple[float, ...]
    num_replicas: int
    num_workers: int | None = None
    #: With a tensor axis: its collectives (kind, dtype, shape, line, reason: ``tensor.placement.Collective``)
    #: and their predicted seconds, over the ``cores`` link.
    tensor_rows: tuple[Any, ...] = ()
    tensor_seconds: tuple[float, ...] = ()

    @property
    def total_s(self) -> float:
        """Predicted communication time of one step, collectives one after another (no overlap)."""
        return math.fsum(self.seconds) + math.fsum(self.tensor_seconds)

    def __str__(self) -> str:
        header = ("#", "kind", "group", "algorithm", "N", "bytes", "link", "predicted", "share")
        lines = []
        total = self.total_s
        for i, (r, t) in enumerate(zip(self.rows, self.seconds, strict=True)):
            link = "" if r.kind == "replica_id" or r.group_size <= 1 else _link_name(r.group, self.num_workers)
            lines.append(
                (
                    str(i),
                    r.kind,
                    "all" if r.group is None else r.group,
                    r.algorithm,
                    str(r.group_size),
                    str(r.nbytes),
                    link,
                    _seconds(t),
                    f"{100 * t / total:.0f}%" if total > 0 else "-",
                )
            )
        for j, (c, t) in enumerate(zip(self.tensor_rows, self.tensor_seconds, strict=True)):
            share = f"{100 * t / total:.0f}%" if total > 0 else "-"
            lines.append(
                (str(len(self.rows) + j), c.kind, "tensor", "native", "", str(c.nbytes), "cores", _seconds(t), share)
            )
        summary = (
            f"predicted communication per step: {_seconds(total)} on {self.num_replicas} replicas, "
            f"topology {self.topology.name} (cores {self.topology.cores}; workers {self.topology.workers})"
        )
        return "\n".join([format_table(header, lines), summary])


def _link_name(group: str | None, num_workers: int | None) -> str:
    if group is not None:
        return group
    return "cores" if num_workers == 1 else "workers" if num_workers else "slower"


def _seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def predict(
    records: Sequence[CollectiveRecord] | Any,
    topology: Topology | str,
    *,
    num_replicas: int | None = None,
    num_workers: int | None = None,
) -> Prediction:
    """The predicted time of every collective on ``topology`` (a :class:`Topology` or preset name).

    Args:
      records: the step's collective records (``StepGraph.collectives``), or a
        :class:`~replicator.cost.report.CommunicationReport` (its rows, replica and worker counts).
      topology: where it runs.
      num_replicas, num_workers: the mesh (taken from a report when one is given);
        ``num_workers`` picks the link of a collective over all replicas.
    """
    tensor = getattr(records, "tensor", None)  # a report's tensor axis (TensorLayout), if any
    if hasattr(records, "rows"):  # a CommunicationReport
        records, num_replicas, num_workers = records.rows, records.num_replicas, records.num_workers
    if num_replicas is None:
        raise TypeError("predict(records, topology): pass num_replicas= with a sequence of records.")
    topology = get_topology(topology)
    seconds = tuple(collective_time(r, topology, num_workers=num_workers) for r in records)
    tensor_rows = tuple(tensor.collectives) if tensor is not None else ()
    tensor_seconds = tuple(tensor_collective_time(c.kind, c.nbytes, tensor.size, topology) for c in tensor_rows)
    return Prediction(topology, tuple(records), seconds, num_replicas, num_workers, tensor_rows, tensor_seconds)


# ----------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------
