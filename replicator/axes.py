"""Where a :class:`~replicator.Replicator`'s axes of parallelism go on its devices.

Each axis is built in its own folder; this module only places them:

* **data** (``('workers', 'cores')``, ``runtime/mesh.py``): ``num_workers x cores_per_worker`` devices,
  a step built once by ``runtime/build.py`` (trace, passes, ``jit(shard_map)``);
* **tensor** (``Parallelism(tensor=T)``, ``tensor/axis.py``): each worker's devices cut into groups of
  ``T`` neighbours, the mesh ``('workers', 'cores', 'tensor')``, the step split for one device of a
  group before anything else;
* **stages** (``Parallelism(stages=S)``, ``stages/replicas.py``): the device grid (with its tensor
  groups) cut into ``S`` stages, within a worker where ``S`` divides its devices, else across
  workers: the mesh ``('stages', 'workers', 'cores'[, 'tensor'])``, the step cut at its
  ``rp.stage_boundary`` markers into one program with a schedule (GPipe, 1F1B, fused 1F1B);
* **folding** (``Parallelism(replicas_per_device=k)``, ``core/layout.py``): ``k`` consecutive replicas
  run vmapped on each device, so ``num_workers x cores_per_worker`` replicas need ``1/k`` as many
  devices; ``k`` divides ``cores_per_worker`` or is a multiple of it that divides the replica count.
  Results are those of one replica per device (up to rounding); replica-invariant work runs once per
  device (``passes/fold.py``). With stages, the stages cut the device grid.

The data-parallel replicas are what is left: ``num_workers x cores_per_worker / (S x T)``.

>>> axes = place_axes(1, 8, None, rp.Parallelism(stages=2, tensor=2, tensor_plan={"w": "column"}))
>>> dict(axes.pipelined.mesh.shape), axes.pipelined.replicas
({'stages': 2, 'workers': 1, 'cores': 2, 'tensor': 2}, 2)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from replicator.core.layout import FoldLayout, fold_layout
from replicator.parallelism import Parallelism, check_tensor_supported, older_keywords
from replicator.pass_manager.manager import PassManager
from replicator.runtime.mesh import build_mesh
from replicator.runtime.pipelined import zero_of
from replicator.stages.replicas import PipelinedReplicas
from replicator.tensor.axis import TensorAxis

__all__ = ["Axes", "place_axes"]


@dataclasses.dataclass(frozen=True)
class Axes:
    """The placed axes: the mesh of the data (and tensor) axes, the fold of replicas onto devices, the
    logical replicas per worker and workers, the tensor axis (or None) and the pipeline (or None)."""

    mesh: Mesh
    fold: FoldLayout
    num_workers: int
    cores_per_worker: int
    tensor: TensorAxis | None
    pipelined: PipelinedReplicas | None


def place_axes(
    num_workers: int,
    cores_per_worker: int | None,
    devices: list | None,
    parallelism: Parallelism | None,
    older: dict[str, Any] | None = None,
    passes: PassManager | None = None,
) -> Axes:
    """The axes of ``parallelism`` (or of the ``older`` keywords, :func:`~replicator.parallelism.older_keywords`)
    on ``devices`` (default: all), as a ``Replicator(num_workers, cores_per_worker, ...)`` runs them.
    ``passes``: the Replicator's ``passes=`` (a pipeline takes its ZeRO level from it)."""
    if older is None:
        older = older_keywords(parallelism)
    stages, microbatches = older["pipeline_stages"], older["microbatches"]
    schedule, recompute = older["schedule"], older["pipeline_recompute"]
    tensor = None
    if parallelism is not None and parallelism.tensor > 1:
        check_tensor_supported(parallelism)
        tensor = TensorAxis(
            parallelism.tensor,
            parallelism.tensor_plan,
            parallelism.allow_gather,
            parallelism.sequence_parallel,
            collective_matmul=parallelism.collective_matmul,
            rings_allowed=stages == 1,
        )
        k = older["replicas_per_device"]
        if k == 1:
            mesh = tensor.mesh(build_mesh(num_workers, cores_per_worker, devices=devices))
            num_workers, cores_per_worker = mesh.devices.shape[:2]
            fold = FoldLayout(num_workers, cores_per_worker)
        else:  # W x C slots on W x C / k devices: T of them per tensor group, each group hosting k replicas
            if cores_per_worker is None or cores_per_worker % tensor.size:
                raise ValueError(
                    f"replicas_per_device={k} with tensor={tensor.size} needs cores_per_worker, a multiple of "
                    f"{tensor.size} (the tensor groups' share of each worker), got {cores_per_worker}."
                )
            cores_per_worker //= tensor.size  # the logical data-parallel replicas per worker
            fold = fold_layout(num_workers, cores_per_worker, replicas_per_device=k)
            workers, cores = fold.device_mesh
            mesh = tensor.mesh(build_mesh(workers, cores * tensor.size, devices=devices))
    elif older["replicas_per_device"] == 1:
        mesh = build_mesh(num_workers, cores_per_worker, devices=devices)
        num_workers, cores_per_worker = mesh.devices.shape
        fold = FoldLayout(num_workers, cores_per_worker)
    else:
        if cores_per_worker is None:
            raise ValueError(
                "Parallelism(replicas_per_device=...) needs an explicit cores_per_worker (the logical replicas)."
            )
        fold = fold_layout(num_workers, cores_per_worker, replicas_per_device=older["replicas_per_device"])
        mesh = build_mesh(*fold.device_mesh, devices=devices)
    if stages == 1 and microbatches is None and (schedule is not None or recompute):
        recompute_name = "recompute" if parallelism is not None else "pipeline_recompute"  # as the caller spelled it
        given = ", ".join(name for name, value in (("schedule", schedule), (recompute_name, recompute)) if value)
        raise ValueError(
            f"{given} only applies to a pipelined Replicator, and this one has one stage: pass "
            "parallelism=rp.Parallelism(stages=S, ...) (the stages cut at rp.stage_boundary markers) or leave "
            "these options out."
        )
    pipelined = None
    if stages != 1 or microbatches is not None:
        # With replicas_per_device=k the stages cut the device grid; each device hosts k replicas.
        pipelined = PipelinedReplicas(
            mesh.devices,
            stages,
            microbatches,
            schedule or "1f1b",
            recompute,
            zero=zero_of(passes),
            fold_axes=fold.folded_axes,
            tensor=tensor,
        )
    return Axes(mesh, fold, num_workers, cores_per_worker, tensor, pipelined)
