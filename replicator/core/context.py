"""The replica context: which mesh a step is being traced for.

Placeholders read it to know group sizes at trace time, and refuse to run
outside of it. ``Replicator`` enters it while tracing ``step_fn``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

__all__ = [
    "GROUPS",
    "REPLICA_AXES",
    "ReplicaContext",
    "check_group",
    "current_context",
    "group_axes",
    "replica_context",
    "require_context",
]

WORKERS = "workers"
CORES = "cores"
REPLICA_AXES: tuple[str, str] = (WORKERS, CORES)
GROUPS: tuple[str | None, ...] = (None, CORES, WORKERS)


def check_group(group: object, api_name: str) -> str | None:
    """Validate a ``group=`` argument; return it unchanged."""
    if group not in GROUPS:
        raise ValueError(
            f"{api_name}(group={group!r}): group must be None (all replicas), "
            f"'cores' (the replicas of one worker) or 'workers' (the replicas "
            f"with the same core index across workers)."
        )
    return group  # type: ignore[return-value]


def group_axes(group: str | None) -> tuple[str, ...]:
    """The mesh axes a collective over ``group`` communicates along."""
    return REPLICA_AXES if group is None else (group,)


@dataclasses.dataclass(frozen=True)
class ReplicaContext:
    """Shape of the replica mesh a step is traced for."""

    num_workers: int
    cores_per_worker: int

    @property
    def num_replicas(self) -> int:
        return self.num_workers * self.cores_per_worker

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {WORKERS: self.num_workers, CORES: self.cores_per_worker}

    @property
    def axis_env(self) -> list[tuple[str, int]]:
        """``axis_env`` for ``jax.make_jaxpr`` to trace real collectives."""
        return [(WORKERS, self.num_workers), (CORES, self.cores_per_worker)]

    def group_size(self, group: str | None) -> int:
        sizes = self.axis_sizes
        n = 1
        for axis in group_axes(group):
            n *= sizes[axis]
        return n


_local = threading.local()


def current_context() -> ReplicaContext | None:
    """The context of the step being traced, or None outside one."""
    return getattr(_local, "context", None)


def require_context(api_name: str) -> ReplicaContext:
    ctx = current_context()
    if ctx is None:
        raise RuntimeError(
            f"replicator.{api_name}() was called outside a replicated step. "
            f"Cross-replica operations only have a meaning inside a step_fn "
            f"run by Replicator.run(step_fn, input_fn, ...) (or traced by "
            f"Replicator.lower); call it from there."
        )
    return ctx


@contextlib.contextmanager
def replica_context(ctx: ReplicaContext) -> Iterator[ReplicaContext]:
    """Make ``ctx`` the current replica context for the duration."""
    previous = current_context()
    _local.context = ctx
    try:
        yield ctx
    finally:
        _local.context = previous
