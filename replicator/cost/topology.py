"""Where a step runs, for the cost models: a :class:`Topology` holds one alpha-beta
:class:`Link` per mesh axis (and point-to-point links, and the devices' compute
speed), and :data:`PRESETS` names measured or published ones. Measure the
machine at hand with :func:`replicator.tools.calibrate.calibrate`.

>>> topology = get_topology("gpu-hosts-100gbe")
>>> topology.workers.beta_s_per_byte > topology.cores.beta_s_per_byte  # Ethernet is slower than NVLink
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from replicator.cost.compute import Compute

if TYPE_CHECKING:
    pass

__all__ = ["COMPUTE_ELEMENT_S", "COMPUTE_FLOP_S", "Link", "Measurement", "PRESETS", "Topology", "get_topology"]


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
    #: One device's speed at the step's own work (:mod:`~replicator.cost.compute`),
    #: for choices that trade communication for compute (``PassManager.default(auto=True)``);
    #: ``None``: communication only.
    compute: Compute | None = None
    #: Whether a device computes while its links send (asynchronous collectives: GPUs' streams, TPUs'
    #: ICI), so that collective matmul's sends hide behind its partial matmuls. Emulated CPU devices: no
    #: (a ``ppermute`` is a rendezvous of the devices' threads, the matmuls wait for it).
    overlap: bool = False

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
#: ``docs/design/costmodel.md``):
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
        overlap=True,
    ),
    "gpu-hosts-100gbe": Topology(
        "gpu-hosts-100gbe",
        cores=_NVLINK_LINK,
        workers=Link.from_bandwidth(9.6e-6, 12.5e9),
        source=f"NVLink inside a host ({_NVLINK}); 100 Gb/s Ethernet per GPU between hosts "
        f"(12.5 GB/s); latency {_NCCL_TUNING}",
        compute=_H100_COMPUTE,
        overlap=True,
    ),
    "tpu-v3-pod": Topology(
        "tpu-v3-pod",
        cores=Link.from_bandwidth(1e-6, 340e12 / 2048),
        workers=Link.from_bandwidth(1e-6, 340e12 / 2048),
        source="ICI: 1 us per hop (https://jax-ml.github.io/scaling-book/sharding/); all-reduce bandwidth "
        "340 TB/s per 1024-chip (2048-core) pod (https://cloud.google.com/tpu/docs/v3)",
        # Per core, half a chip: 900 GB/s of HBM2 and 123 TFLOPS (bf16) per chip (same page).
        compute=Compute(8 / 450e9, 1 / 61.5e12, source="https://cloud.google.com/tpu/docs/v3"),
        overlap=True,
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
