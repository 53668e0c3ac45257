"""Communication cost model: how long a step's collectives take (alpha-beta).

Every row of a :class:`~replicator.passes.report.CommunicationReport` is one
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
:data:`PRESETS` and in ``docs/COSTMODEL.md``), or measure the machine at hand
with :func:`calibrate`:

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
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from replicator.core.primitives import REDUCE_OPS
from replicator.passes.computemodel import Compute, agreed, calibrate_compute
from replicator.passes.records import CollectiveRecord

if TYPE_CHECKING:
    from replicator.passes.report import CommunicationReport

__all__ = [
    "PRESETS",
    "Link",
    "Measurement",
    "Prediction",
    "Topology",
    "calibrate",
    "collective_time",
    "fit_link",
    "get_topology",
    "predict",
]

#: The kinds costed as an all-reduce: ``all_<op>`` for every op of ``rp.all_reduce``, and
#: ``broadcast`` (lowered as a masked all-reduce).
ALL_REDUCE_KINDS = frozenset([*(f"all_{op}" for op in REDUCE_OPS), "broadcast"])


# ----------------------------------------------------------------------------
# Links and topologies
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Link:
    """One mesh axis's link: ``alpha_s`` seconds per message, ``beta_s_per_byte`` seconds per byte sent."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        for name in ("alpha_s", "beta_s_per_byte"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"Link.{name} must be a finite number >= 0 (seconds), got {value!r}; "
                    f"for a bandwidth of G bytes/s use Link.from_bandwidth(alpha_s, G)."
                )

    @classmethod
    def from_bandwidth(cls, alpha_s: float, bytes_per_s: float) -> Link:
        """A link with latency ``alpha_s`` and bandwidth ``bytes_per_s`` (bytes one replica sends per second)."""
        if not bytes_per_s > 0:
            raise ValueError(f"Link.from_bandwidth: bytes_per_s must be > 0, got {bytes_per_s!r}.")
        return cls(float(alpha_s), 1.0 / bytes_per_s)

    @property
    def bytes_per_s(self) -> float:
        return math.inf if self.beta_s_per_byte == 0 else 1.0 / self.beta_s_per_byte

    def __str__(self) -> str:
        return f"alpha {self.alpha_s * 1e6:.3g} us, {self.bytes_per_s / 1e9:.3g} GB/s"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One calibration point: the median time of one ``psum`` of ``nbytes`` over ``axis`` (``group_size`` replicas)."""

    axis: str
    group_size: int
    nbytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Topology:
    """The links of the ``('workers', 'cores')`` mesh.

    Attributes:
      name: a label (a preset's name, or ``'calibrated ...'``).
      cores: the link of a collective over ``'cores'`` (inside a worker).
      workers: the link of a collective over ``'workers'``; also the link of a
        collective over all replicas when there is more than one worker (with
        one worker, such a collective uses ``cores``).
      source: where the numbers come from.
      measurements: what :func:`calibrate` measured (empty for presets).
    """

    name: str
    cores: Link
    workers: Link
    source: str
    measurements: tuple[Measurement, ...] = dataclasses.field(default=(), compare=False, repr=False)
    #: Point-to-point messages (``ppermute``: the ``'ring'`` and ``'reduce_broadcast'``
    #: lowerings) when they cost otherwise than the native collectives (``None``: the same).
    #: On emulated CPU devices a native ``psum`` is one in-memory reduction while every
    #: ``ppermute`` step is a separate exchange (measured by :func:`calibrate`).
    p2p_cores: Link | None = None
    p2p_workers: Link | None = None
    #: How a native collective's latency grows: ``'ring'``, ``alpha`` per ring step (NCCL's
    #: ring, ``2 (N-1)`` steps for an all-reduce); ``'one'``, one ``alpha`` per collective
    #: (emulated CPU devices share memory: XLA reduces in one pass, whatever ``N``).
    native_latency: str = "ring"
    #: One device's speed at the step's own work (:mod:`~replicator.passes.computemodel`),
    #: for choices that trade communication for compute (``Pipeline.default(auto=True)``);
    #: ``None``: communication only.
    compute: Compute | None = None

    def link(self, group: str | None, num_workers: int | None = None, *, p2p: bool = False) -> Link:
        """The link a collective over ``group`` uses (``num_workers=None``: unknown, the slower link);
        ``p2p``: of the point-to-point messages of the ring and tree algorithms."""
        if p2p:
            messages = dataclasses.replace(
                self, cores=self.p2p_cores or self.cores, workers=self.p2p_workers or self.workers
            )
            return dataclasses.replace(messages, p2p_cores=None, p2p_workers=None).link(group, num_workers)
        if group == "cores":
            return self.cores
        if group == "workers":
            return self.workers
        if group is not None:
            raise ValueError(f"unknown replica group {group!r}; expected None (all replicas), 'cores' or 'workers'.")
        if num_workers is not None and num_workers <= 1:
            return self.cores
        # Over both axes (or an unknown number of workers): paced by the slower link, per term.
        return Link(
            max(self.cores.alpha_s, self.workers.alpha_s), max(self.cores.beta_s_per_byte, self.workers.beta_s_per_byte)
        )

    def __str__(self) -> str:
        compute = f"; compute {self.compute}" if self.compute else ""
        return f"{self.name}: cores {self.cores}; workers {self.workers}{compute} ({self.source})"


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
      record: a row of :class:`~replicator.passes.report.CommunicationReport`.
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
        k = max(1, getattr(record, "operands", 1))
        if topology.native_latency == "one":
            return k * link.alpha_s + 2 * (n - 1) / n * b * link.beta_s_per_byte
        return (k - 1) * ring_allreduce_time(n, 0.0, link) + ring_allreduce_time(n, b, link)
    raise ValueError(
        f"collective_time: unknown algorithm {record.algorithm!r} for {kind}; "
        f"the model knows 'native', 'ring' and 'reduce_broadcast'."
    )


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

    @property
    def total_s(self) -> float:
        """Predicted communication time of one step, collectives one after another (no overlap)."""
        return math.fsum(self.seconds)

    def __str__(self) -> str:
        header = ("#", "kind", "group", "algorithm", "N", "bytes", "link", "predicted", "share")
        lines = [header]
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
        widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
        table = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
        table.insert(1, "  ".join("-" * w for w in widths))
        summary = (
            f"predicted communication per step: {_seconds(total)} on {self.num_replicas} replicas, "
            f"topology {self.topology.name} (cores {self.topology.cores}; workers {self.topology.workers})"
        )
        return "\n".join([*table, summary])


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


def predict(report: CommunicationReport, topology: Topology | str) -> Prediction:
    """The predicted time of every collective in ``report`` on ``topology`` (a :class:`Topology` or preset name)."""
    topology = get_topology(topology)
    num_workers = getattr(report, "num_workers", None)
    seconds = tuple(collective_time(r, topology, num_workers=num_workers) for r in report.rows)
    return Prediction(topology, tuple(report.rows), seconds, report.num_replicas, num_workers)


# ----------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------

_NCCL_TUNING = (
    "https://github.com/NVIDIA/nccl/blob/01afd20a77b5804e0ecf1042509dd9d20ebf9e93/src/graph/tuning.cc "
    "(hwLat, Ring/Simple: NVLink 3.4 us, network 9.6 us per step)"
)
_NVLINK = (
    "https://www.nvidia.com/en-us/data-center/nvlink/ and "
    "https://developer.nvidia.com/blog/upgrading-multi-gpu-interconnectivity-with-the-third-generation-nvidia-nvswitch/ "
    "(H100 NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s each way)"
)
_NVLINK_LINK = Link.from_bandwidth(3.4e-6, 450e9)
_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 3.35 TB/s HBM3, 989 TFLOPS dense bf16)"
#: An unfused element-wise op streams its float32 operand and result through HBM: 8 bytes.
_H100_COMPUTE = Compute(8 / 3.35e12, 1 / 989e12, source=_H100)

#: The 'cpu-emulated' preset's compute (``python benchmarks/bench_costmodel.py --calibrate-only``):
#: one element-wise op per element, and one flop of a float32 matrix product, on each of 8
#: emulated devices running at once on 2 host cores.
COMPUTE_ELEMENT_S = 7.0e-10  # 1.4 G element-ops/s per device
COMPUTE_FLOP_S = 1.29e-10  # 7.8 GFLOP/s per device

#: Named topologies. Every figure comes from a public source (also listed in
#: ``docs/COSTMODEL.md``):
#:
#: * ``'cpu-emulated'``: this repository's machine, 8 emulated CPU devices on 2
#:   host cores (JAX 0.10.2), measured with
#:   ``python benchmarks/bench_costmodel.py`` (``calibrate(2, 4)``; ``--calibrate-only`` prints just that).
#: * ``'gpu-nvlink-8'``: 8 H100 SXM GPUs behind NVSwitch (DGX/HGX H100), both axes
#:   on NVLink: beta from NVIDIA's 900 GB/s bidirectional per GPU
#:   (https://www.nvidia.com/en-us/data-center/nvlink/), i.e. 450 GB/s of bus
#:   bandwidth each way, the figure nccl-tests' bus bandwidth is compared to
#:   (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md);
#:   alpha 3.4 us, NCCL's own per-step latency of a ring over NVLink with the
#:   Simple protocol, the one it uses for large buffers (``hwLat`` in
#:   https://github.com/NVIDIA/nccl/blob/01afd20a77b5804e0ecf1042509dd9d20ebf9e93/src/graph/tuning.cc).
#: * ``'gpu-hosts-100gbe'``: ``cores`` as ``'gpu-nvlink-8'``; ``workers`` 100 Gb/s
#:   Ethernet = 12.5 GB/s per GPU (one 100 Gb/s port per GPU, or that share of a
#:   faster NIC) with NCCL's per-step network latency of a ring, Simple
#:   protocol, 9.6 us (same ``tuning.cc``).
#: * ``'tpu-v3-pod'``: a TPU v3 pod slice, every core on ICI (hosts are joined by
#:   ICI too, not the data-center network): alpha 1 us per hop
#:   (https://jax-ml.github.io/scaling-book/sharding/, "A note on ICI latency"),
#:   beta from Google's all-reduce bandwidth of a v3 pod, 340 TB/s over its
#:   1024 chips = 2048 cores, 166 GB/s per core
#:   (https://cloud.google.com/tpu/docs/v3), consistent with 2e11 bytes/s
#:   bidirectional per ICI link shared by a chip's 2 cores
#:   (https://jax-ml.github.io/scaling-book/tpus/).
PRESETS: dict[str, Topology] = {
    "cpu-emulated": Topology(
        "cpu-emulated",
        cores=Link(alpha_s=7.48e-5, beta_s_per_byte=1.488e-9),  # 74.8 us per psum, 0.672 GB/s
        workers=Link(alpha_s=8.24e-5, beta_s_per_byte=1.848e-9),  # 82.4 us per psum, 0.541 GB/s
        source="rp.passes.calibrate(2, 4) on 8 emulated CPU devices, 2 host cores, JAX 0.10.2 "
        "(python benchmarks/bench_costmodel.py prints the same calibration)",
        p2p_cores=Link(alpha_s=1.42e-4, beta_s_per_byte=1.789e-9),  # 142 us per ppermute, 0.559 GB/s
        p2p_workers=Link(alpha_s=1.27e-4, beta_s_per_byte=1.976e-9),  # 127 us per ppermute, 0.506 GB/s
        native_latency="one",
        compute=Compute(COMPUTE_ELEMENT_S, COMPUTE_FLOP_S, source="calibrate_compute on 8 emulated CPU devices"),
    ),
    "gpu-nvlink-8": Topology(
        "gpu-nvlink-8",
        cores=_NVLINK_LINK,
        workers=_NVLINK_LINK,
        source=f"8 x H100 SXM on NVSwitch; bandwidth {_NVLINK}; latency {_NCCL_TUNING}",
        compute=_H100_COMPUTE,
    ),
    "gpu-hosts-100gbe": Topology(
        "gpu-hosts-100gbe",
        cores=_NVLINK_LINK,
        workers=Link.from_bandwidth(9.6e-6, 12.5e9),
        source=f"NVLink inside a host ({_NVLINK}); 100 Gb/s Ethernet per GPU between hosts "
        f"(12.5 GB/s); latency {_NCCL_TUNING}",
        compute=_H100_COMPUTE,
    ),
    "tpu-v3-pod": Topology(
        "tpu-v3-pod",
        cores=Link.from_bandwidth(1e-6, 340e12 / 2048),
        workers=Link.from_bandwidth(1e-6, 340e12 / 2048),
        source="ICI: 1 us per hop (https://jax-ml.github.io/scaling-book/sharding/); all-reduce bandwidth "
        "340 TB/s per 1024-chip (2048-core) pod (https://cloud.google.com/tpu/docs/v3)",
        # Per core, half a chip: 900 GB/s of HBM2 and 123 TFLOPS (bf16) per chip (same page).
        compute=Compute(8 / 450e9, 1 / 61.5e12, source="https://cloud.google.com/tpu/docs/v3"),
    ),
}


def get_topology(topology: Topology | str) -> Topology:
    """``topology`` itself, or the preset of that name.

    Raises:
      ValueError: an unknown name (the message lists the presets).
    """
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, str):
        try:
            return PRESETS[topology]
        except KeyError:
            raise ValueError(
                f"unknown topology {topology!r}; the presets are {sorted(PRESETS)}. Or pass a "
                f"Topology(name, cores=Link(alpha_s, beta_s_per_byte), workers=Link(...), source=...), "
                f"or measure this machine with replicator.passes.calibrate(num_workers, cores_per_worker)."
            ) from None
    raise TypeError(f"topology must be a Topology or a preset name (one of {sorted(PRESETS)}), got {topology!r}.")


# ----------------------------------------------------------------------------
# Calibration
# ----------------------------------------------------------------------------


def fit_link(points: Iterable[tuple[int, float, float]], *, formula: str = "ring") -> Link:
    """Fit ``alpha, beta >= 0`` of the ring formula to ``(N, B, seconds)`` points
    (``formula='message'``: of one point-to-point message, ``alpha + B beta``;
    ``'one'``: one latency per all-reduce, ``alpha + 2 (N-1)/N B beta``).

    Least squares on relative error (each equation divided by its measured
    time, so that the small, latency-bound sizes count as much as the large
    ones), with non-negative coefficients: if the unconstrained fit makes one
    negative, it is set to 0 and the other refitted alone.
    """
    if formula not in ("ring", "message", "one"):
        raise ValueError(f"fit_link: formula must be 'ring', 'message' or 'one', got {formula!r}.")
    if formula == "ring":
        rows = [(2.0 * (n - 1), 2.0 * (n - 1) / n * b, t) for n, b, t in points if n > 1 and t > 0]
    elif formula == "one":  # one latency per all-reduce, the ring's bytes
        rows = [(1.0, 2.0 * (n - 1) / n * b, t) for n, b, t in points if n > 1 and t > 0]
    else:
        rows = [(1.0, float(b), t) for n, b, t in points if n > 1 and t > 0]
    if len(rows) < 2:
        raise ValueError(
            f"fit_link: need at least 2 positive measurements over groups of more than 1 replica, got {len(rows)}."
        )
    a = np.array([[x, y] for x, y, _ in rows]) / np.array([[t] for *_, t in rows])
    target = np.ones(len(rows))
    alpha, beta = np.linalg.lstsq(a, target, rcond=None)[0]
    if alpha < 0 or beta < 0:
        candidates = []
        for col in (0, 1):
            coef = max(float(a[:, col] @ target / (a[:, col] @ a[:, col])), 0.0)
            residual = float(np.sum((a[:, col] * coef - target) ** 2))
            candidates.append((residual, col, coef))
        _, col, coef = min(candidates)
        alpha, beta = (coef, 0.0) if col == 0 else (0.0, coef)
    return Link(float(alpha), float(beta))


def calibrate(
    num_workers: int = 1,
    cores_per_worker: int | None = None,
    *,
    sizes: Sequence[int] = (2**10, 16 * 2**10, 256 * 2**10, 2**20, 4 * 2**20),
    repeats: int = 5,
    devices: list | None = None,
    chain: int = 4,
    time_budget_s: float = 60.0,
    name: str | None = None,
    compute: bool = True,
) -> Topology:
    """Measure ``alpha`` and ``beta`` of each mesh axis on the machine at hand.

    For each axis of the ``num_workers x cores_per_worker`` mesh
    (:func:`replicator.build_mesh`) with more than one replica, and each
    payload in ``sizes`` (bytes of float32 per replica), it times two jitted
    ``shard_map`` programs: one ``lax.psum`` over the axis, and ``chain + 1``
    dependent ones. Their difference over ``chain`` is the time of one psum
    inside a program, without the per-call launch overhead (the medians of
    ``repeats`` paired runs). :func:`fit_link` then fits the ring formula.
    An axis of size 1 cannot be measured: it gets the other axis's link.

    Args:
      num_workers, cores_per_worker, devices: the mesh, as for ``build_mesh``.
      sizes: payload bytes per replica, at least 2 different ones.
      repeats: timed runs per size (the median is used).
      chain: extra psums in the long program.
      time_budget_s: stop repeating once this much time has passed (every
        size is measured at least once).
      name: the topology's name (default ``'calibrated WxC'``).

    It also times chains of ``lax.ppermute`` shifts (one message per replica)
    and fits ``alpha + B beta`` per message: the ``p2p`` links, which cost the
    ``'ring'`` and ``'reduce_broadcast'`` lowerings; and, unless
    ``compute=False``, the devices' element-wise and matrix-product speed
    (:func:`~replicator.passes.computemodel.calibrate_compute`).

    Returns:
      A :class:`Topology` with the fitted links and, in ``measurements``, the
      median time per psum of each axis and size.
    """
    import jax  # the runtime layer is above the passes: import it only to measure
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from replicator.runtime.mesh import build_mesh

    sizes = sorted({int(s) for s in sizes})
    if len(sizes) < 2 or sizes[0] < 4:
        raise ValueError(f"calibrate: sizes must hold at least 2 different byte counts >= 4, got {sizes}.")
    if repeats < 1 or chain < 1:
        raise ValueError(f"calibrate: repeats and chain must be >= 1, got repeats={repeats}, chain={chain}.")
    mesh = build_mesh(num_workers, cores_per_worker, devices=devices)
    shape = dict(mesh.shape)
    axes = [axis for axis in ("cores", "workers") if shape[axis] > 1]
    if not axes:
        raise ValueError(
            "calibrate: a 1 x 1 mesh has nothing to measure; use at least 2 replicas "
            "(e.g. calibrate(1, 8) after replicator.force_cpu_devices(8))."
        )
    spec = P("workers", "cores")

    def program(axis: str, count: int, kind: str = "psum"):
        scale = 1.0 / shape[axis]
        shift = [(i, (i + 1) % shape[axis]) for i in range(shape[axis])]

        def body(x):
            for _ in range(count):
                x = lax.psum(x, axis) * scale if kind == "psum" else lax.ppermute(x, axis, shift) * 0.5
            return x

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

    def run_once(f, x) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        return time.perf_counter() - t0

    cases = []
    for kind in ("psum", "ppermute"):
        for axis in axes:
            for size in sizes:
                x = jax.device_put(
                    np.ones((shape["workers"], shape["cores"], size // 4), np.float32), NamedSharding(mesh, spec)
                )
                short, long = program(axis, 1, kind), program(axis, chain + 1, kind)
                for f in (short, long):  # compile and warm up
                    run_once(f, x)
                    run_once(f, x)
                cases.append((kind, axis, size, short, long, x, []))
    # A mesh over several processes: every process must run the same programs, so process 0's
    # clock ends the repeats, and its medians are everyone's (the same topology on every worker; computemodel.agreed).
    start = time.perf_counter()
    for r in range(repeats):
        for _, _, _, short, long, x, samples in cases if r % 2 == 0 else reversed(cases):
            samples.append((run_once(long, x) - run_once(short, x)) / chain)
        if agreed(mesh, [time.perf_counter() - start > time_budget_s])[0]:
            break
    medians = agreed(mesh, [statistics.median(case[-1]) for case in cases])
    measured = {
        kind: tuple(
            Measurement(axis, shape[axis], size, seconds)
            for (k, axis, size, *_), seconds in zip(cases, medians, strict=True)
            if k == kind
        )
        for kind in ("psum", "ppermute")
    }

    def fitted(kind: str, formula: str) -> tuple[Link, Link]:
        links = {
            axis: fit_link(
                ((m.group_size, m.nbytes, m.seconds) for m in measured[kind] if m.axis == axis), formula=formula
            )
            for axis in axes
        }
        cores = links.get("cores", links.get("workers"))
        return cores, links.get("workers", cores)

    # Emulated CPU devices share one memory: a psum costs one latency whatever N (measured:
    # about 100 us over 2 replicas and over 8), not one per ring step.
    native_latency = "one" if mesh.devices.flat[0].platform == "cpu" else "ring"
    cores, workers = fitted("psum", native_latency)
    p2p_cores, p2p_workers = fitted("ppermute", "message")
    measurements = measured["psum"]
    label = name or f"calibrated {shape['workers']}x{shape['cores']}"
    platform = mesh.devices.flat[0].platform
    source = (
        f"calibrate({shape['workers']}, {shape['cores']}) on {mesh.devices.size} {platform} device(s), "
        f"sizes {sizes} B, median of {len(cases[0][-1])} run(s)"
    )
    return Topology(
        label,
        cores,
        workers,
        source,
        measurements,
        p2p_cores=p2p_cores,
        p2p_workers=p2p_workers,
        native_latency=native_latency,
        compute=calibrate_compute(mesh, repeats=repeats) if compute else None,
    )
