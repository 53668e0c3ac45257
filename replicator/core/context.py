"""The replica context: which mesh a step is being traced for.

Placeholders read it to know group sizes at trace time, and refuse to run
outside of it. ``Replicator`` enters it while tracing ``step_fn``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "axis_names",
    "GROUPS",
    "REPLICA_AXES",
    "ReplicaContext",
    "check_group",
    "current_context",
    "group_axes",
    "normalize_axis_names",
    "replica_context",
    "require_context",
]

WORKERS = "workers"
CORES = "cores"
REPLICA_AXES: tuple[str, str] = (WORKERS, CORES)
GROUPS: tuple[str | None, ...] = (None, CORES, WORKERS)


def axis_names(value: Any) -> tuple:
    """The axis names of a collective's ``axes``/``axis_name`` param: a name or a tuple of them, as a tuple."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


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
    """Shape of the replica mesh a step is traced for.

    ``axis_names`` binds the user's own axis names (code written for
    ``jax.pmap``/``shard_map``: ``lax.pmean(x, 'batch')``) to replica groups,
    as ``((name, group), ...)`` with ``group`` one of :data:`GROUPS`.
    """

    num_workers: int
    cores_per_worker: int
    axis_names: tuple[tuple[str, str | None], ...] = ()

    @property
    def num_replicas(self) -> int:
        return self.num_workers * self.cores_per_worker

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {WORKERS: self.num_workers, CORES: self.cores_per_worker}

    @property
    def axis_env(self) -> list[tuple[str, int]]:
        """``axis_env`` for ``jax.make_jaxpr`` to trace real collectives (mesh and user names)."""
        user = [(name, self.group_size(group)) for name, group in self.axis_names]
        return [(WORKERS, self.num_workers), (CORES, self.cores_per_worker), *user]

    def group_of_axes(self, axes: tuple[str, ...]) -> str | None:
        """The replica group that named axes span, e.g. ``('batch',)`` -> ``None`` (all replicas).

        Raises:
          ValueError: the axes overlap, are out of replica order, or one is unbound.
        """
        mapping = dict(self.axis_names)
        mesh_axes: list[str] = []
        for name in axes:
            if name in REPLICA_AXES:
                mesh_axes.append(name)
            elif name in mapping:
                mesh_axes.extend(group_axes(mapping[name]))
            else:
                raise ValueError(f"axis name {name!r} is not bound; {self.describe_names()}")
        if tuple(mesh_axes) == REPLICA_AXES:
            return None
        if len(mesh_axes) == 1:
            return mesh_axes[0]
        raise ValueError(
            f"axes {axes!r} span the mesh axes {tuple(mesh_axes)}, which is not one replica group "
            f"(all replicas ('workers', 'cores') in that order, 'cores' or 'workers')"
        )

    def describe_names(self) -> str:
        """The bound axis names, for error messages."""
        user = ", ".join(f"{n!r} -> {'all replicas' if g is None else repr(g)}" for n, g in self.axis_names)
        return "bound are the mesh axes 'workers' and 'cores'" + (f" and {user}" if user else "")

    def group_size(self, group: str | None) -> int:
        sizes = self.axis_sizes
        n = 1
        for axis in group_axes(group):
            n *= sizes[axis]
        return n


def normalize_axis_names(axis_name: object) -> tuple[tuple[str, str | None], ...]:
    """``Replicator(axis_name=...)`` as ``((name, group), ...)``.

    ``'batch'`` means ``{'batch': None}``: the name spans all replicas (what
    ``jax.pmap(..., axis_name='batch')`` over every device means).
    """
    if axis_name is None:
        return ()
    if isinstance(axis_name, str):
        axis_name = {axis_name: None}
    if not isinstance(axis_name, Mapping):
        raise TypeError(
            f"axis_name must be a name (str) or a mapping {{name: group}}, got {type(axis_name).__name__}; "
            "e.g. axis_name='batch' or axis_name={'batch': None, 'local': 'cores'}."
        )
    out = []
    for name, group in axis_name.items():
        if not isinstance(name, str) or name in REPLICA_AXES:
            raise ValueError(
                f"axis_name: {name!r} cannot be mapped: names must be strings other than the mesh axes "
                f"{REPLICA_AXES}, which are always bound."
            )
        if group not in GROUPS:
            raise ValueError(
                f"axis_name: {name!r} maps to {group!r}; map it to None (all replicas), 'cores' (the replicas "
                "of one worker) or 'workers' (one replica per worker)."
            )
        out.append((name, group))
    return tuple(out)


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
