"""Where replicas sit: ``num_workers x cores_per_worker`` logical replicas on a device mesh.

With ``replicas_per_device=F`` a block of ``F`` replicas runs vectorised on one
device (:mod:`replicator.passes.fold` rewrites the graph for it); the
:class:`FoldLayout` says how the logical ``('workers', 'cores')`` mesh folds onto
the device mesh. A placement concept: the runtime, the passes and the tools use it.
"""

from __future__ import annotations

import dataclasses

from replicator.core.context import CORES, REPLICA_AXES, WORKERS
from replicator.errors import ReplicationError

__all__ = ["FOLDED_AXES", "FoldError", "FoldLayout", "fold_layout"]


#: The folded (vmapped) axis that follows each device axis.
FOLDED_AXES: dict[str, str] = {WORKERS: "workers_fold", CORES: "cores_fold"}


class FoldError(ReplicationError):
    """A step that cannot run with several replicas per device."""


@dataclasses.dataclass(frozen=True)
class FoldLayout:
    """How ``num_workers x cores_per_worker`` logical replicas sit on a device mesh.

    >>> layout = fold_layout(2, 4, replicas_per_device=2)
    >>> layout.device_mesh, layout.axis_env
    ((2, 2), (('workers', 2), ('cores', 2), ('cores_fold', 2)))
    >>> fold_layout(64, 8, replicas_per_device=256).device_mesh  # BigGAN's 512 replicas on 2 devices
    (2, 1)
    """

    num_workers: int
    cores_per_worker: int
    workers_fold: int = 1
    cores_fold: int = 1

    @property
    def replicas_per_device(self) -> int:
        return self.workers_fold * self.cores_fold

    @property
    def device_mesh(self) -> tuple[int, int]:
        """Devices along ``('workers', 'cores')``."""
        return self.num_workers // self.workers_fold, self.cores_per_worker // self.cores_fold

    @property
    def folds(self) -> dict[str, int]:
        return {WORKERS: self.workers_fold, CORES: self.cores_fold}

    @property
    def folded_axes(self) -> tuple[tuple[str, int], ...]:
        """The vmapped axes, outermost first, with their sizes (those longer than 1)."""
        return tuple((FOLDED_AXES[a], self.folds[a]) for a in REPLICA_AXES if self.folds[a] > 1)

    @property
    def axis_env(self) -> tuple[tuple[str, int], ...]:
        """Every named axis of the folded graph: device axes, then folded axes."""
        return (*zip(REPLICA_AXES, self.device_mesh, strict=True), *self.folded_axes)

    def expand(self, axes: tuple) -> tuple:
        """Logical mesh axes -> device and folded axes, in replica order (other names kept)."""
        out: list = []
        for a in axes:
            out.append(a)
            if a in FOLDED_AXES and self.folds[a] > 1:
                out.append(FOLDED_AXES[a])
        return tuple(out)

    def size(self, name: str) -> int:
        return dict(self.axis_env)[name]


def fold_layout(num_workers: int, cores_per_worker: int, *, replicas_per_device: int) -> FoldLayout:
    """Place ``replicas_per_device`` consecutive replicas on each device.

    Folds within a worker when ``replicas_per_device`` divides
    ``cores_per_worker``, else whole workers (it must then be a multiple of
    ``cores_per_worker`` that divides the replica count).

    Raises:
      ValueError: no contiguous layout exists; the message lists the choices.
    """
    F, W, C = replicas_per_device, num_workers, cores_per_worker
    if not isinstance(F, int) or F < 1:
        raise ValueError(f"replicas_per_device must be a positive int, got {F!r}.")
    if C % F == 0:
        return FoldLayout(W, C, 1, F)
    if F % C == 0 and W % (F // C) == 0:
        return FoldLayout(W, C, F // C, C)
    choices = sorted({f for f in range(1, W * C + 1) if C % f == 0 or (f % C == 0 and W % (f // C) == 0)})
    raise ValueError(
        f"replicas_per_device={F} does not split {W} workers x {C} cores into equal contiguous blocks: it must "
        f"divide cores_per_worker ({C}) or be a multiple of it that divides the {W * C} replicas. "
        f"Choose one of {choices}."
    )
