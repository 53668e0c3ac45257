"""Input pipelines: one ``input_fn(ctx)`` per worker, batches split over cores.

``input_fn`` is called once per worker with an :class:`InputContext` and
returns an iterable of that worker's batches (pytrees of arrays). Every leaf's
leading axis is split over the worker's cores in order: core ``c`` of worker
``w`` (replica ``w * cores_per_worker + c``) gets rows
``[c * B/C, (c + 1) * B/C)`` of worker ``w``'s batch of ``B`` rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from replicator.errors import InputExhausted

__all__ = ["InputContext", "WorkerInputs", "check_input_fn", "check_worker_batch"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What an ``input_fn`` needs to know to read its worker's share of data.

    There is one input pipeline per worker (as in TF-Replicator): ``input_fn``
    is called once per worker and reads shard ``worker_id`` of
    ``num_workers``. The ``tf.distribute.InputContext`` names
    ``input_pipeline_id`` and ``num_input_pipelines`` equal them.

    >>> ctx = rp.InputContext(num_workers=2, worker_id=1, cores_per_worker=4)
    >>> ctx.num_input_pipelines, ctx.input_pipeline_id, list(ctx.replica_ids)
    (2, 1, [4, 5, 6, 7])
    >>> ctx.worker_batch_size(64), ctx.get_per_replica_batch_size(64)
    (32, 8)

    Attributes:
      num_workers: workers in the job (input pipelines).
      worker_id: this worker, ``0 <= worker_id < num_workers``.
      cores_per_worker: replicas per worker; this worker's batch is split
        over them along the leading axis.
      num_replicas: ``num_workers * cores_per_worker``.
      num_input_pipelines: ``num_workers`` (``tf.distribute`` name).
      input_pipeline_id: ``worker_id`` (``tf.distribute`` name).
    """

    num_workers: int
    worker_id: int
    cores_per_worker: int

    @property
    def num_replicas(self) -> int:
        return self.num_workers * self.cores_per_worker

    @property
    def replica_ids(self) -> range:
        """Replica ids fed by this worker, in the order its batch is split."""
        start = self.worker_id * self.cores_per_worker
        return range(start, start + self.cores_per_worker)

    # tf.distribute.InputContext names, for users coming from TF-Replicator: one pipeline per worker.
    @property
    def num_input_pipelines(self) -> int:
        """The number of input pipelines: one per worker, so ``num_workers``."""
        return self.num_workers

    @property
    def input_pipeline_id(self) -> int:
        """This input pipeline, ``0 <= input_pipeline_id < num_input_pipelines``: ``worker_id``."""
        return self.worker_id

    def worker_batch_size(self, global_batch_size: int) -> int:
        """This worker's share of a global batch (must divide evenly)."""
        if global_batch_size % self.num_replicas:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by the "
                f"{self.num_replicas} replicas; use a multiple of {self.num_replicas}."
            )
        return global_batch_size // self.num_workers

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Rows each replica sees (``tf.distribute`` name)."""
        return self.worker_batch_size(global_batch_size) // self.cores_per_worker


def check_worker_batch(batch: PyTree, cores_per_worker: int, worker_id: int) -> list[np.ndarray | jax.Array]:
    """Validate one worker's batch; return its leaves.

    Raises a clear error for leaves without a leading axis, leaves with
    different leading sizes, and a leading size not divisible by the cores.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(batch)
    if not flat:
        raise ValueError(f"input_fn of worker {worker_id} yielded an empty batch {batch!r}; yield a pytree of arrays.")
    leaves = []
    sizes: dict[str, int] = {}
    for path, leaf in flat:
        name = "batch" + jax.tree_util.keystr(path)
        if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
            try:
                leaf = np.asarray(leaf)
            except Exception as e:  # noqa: BLE001
                raise TypeError(f"{name} is a {type(leaf).__name__}, not an array.") from e
            if not (jax.dtypes.issubdtype(leaf.dtype, np.number) or leaf.dtype == np.bool_):
                raise TypeError(
                    f"{name} is not a numeric array (dtype {leaf.dtype}); yield arrays of numbers or booleans."
                )
        if leaf.ndim == 0 and any(isinstance(k, jax.tree_util.SequenceKey) for k in path):
            first = next(i for i, k in enumerate(path) if isinstance(k, jax.tree_util.SequenceKey))
            container = "batch" + jax.tree_util.keystr(path[:first])
            raise ValueError(
                f"{container} is a Python list or tuple of numbers, so each number became a separate leaf "
                f"({name} is a scalar). Make it an array in input_fn, e.g. with np.asarray."
            )
        if leaf.ndim == 0:
            raise ValueError(
                f"{name} is a scalar, but every batch leaf is split along its leading axis over "
                f"the {cores_per_worker} cores of a worker; give it a leading batch axis."
            )
        sizes[name] = leaf.shape[0]
        leaves.append(leaf)
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(
            f"the leaves of worker {worker_id}'s batch have different leading sizes ({listing}); "
            f"every leaf must have the same number of rows, which are split over the cores."
        )
    rows = next(iter(sizes.values()))
    if rows == 0:
        raise ValueError(
            f"worker {worker_id}'s batch has 0 rows ({next(iter(sizes))} has shape {leaves[0].shape}); every "
            f"replica needs at least one row (means over no rows are NaN). Skip empty batches in input_fn."
        )
    if rows % cores_per_worker:
        raise ValueError(
            f"worker {worker_id}'s batch has {rows} rows, not divisible by cores_per_worker="
            f"{cores_per_worker}; use a per-worker batch size that is a multiple of "
            f"{cores_per_worker} (e.g. {max(cores_per_worker, rows - rows % cores_per_worker)})."
        )
    return leaves


def check_input_fn(input_fn: object) -> None:
    if not callable(input_fn):
        raise TypeError(
            f"input_fn must be a callable taking an InputContext and returning an iterable of "
            f"batches, got {type(input_fn).__name__}."
        )


class WorkerInputs:
    """The live iterators of one ``input_fn``, one per local worker."""

    def __init__(self, input_fn: Callable[[InputContext], Any], contexts: list[InputContext]):
        check_input_fn(input_fn)
        self.contexts = contexts
        self.iterators: list[Iterator] = []
        for ctx in contexts:
            iterable = input_fn(ctx)
            try:
                self.iterators.append(iter(iterable))
            except TypeError as e:
                raise TypeError(
                    f"input_fn(ctx) must return an iterable of batches (e.g. a generator), got "
                    f"{type(iterable).__name__}."
                ) from e
        self.steps = 0

    def next_batches(self) -> list[PyTree]:
        """One batch from every local worker, in worker order.

        Raises:
          InputExhausted: a worker's iterator ended (an ``InputExhausted``
            raised by the iterator itself passes through unchanged).
        """
        batches = []
        for ctx, it in zip(self.contexts, self.iterators, strict=True):
            try:
                batches.append(next(it))
            except StopIteration:
                raise InputExhausted(
                    f"input_fn of worker {ctx.worker_id} is exhausted after {self.steps} batches. "
                    f"Stop the loop there (catch replicator.InputExhausted), make input_fn yield more "
                    f"(e.g. loop over epochs), or pass a fresh input_fn to start over."
                ) from None
        self.steps += 1
        return batches
