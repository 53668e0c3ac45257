"""Devices -> the ``('workers', 'cores')`` mesh, and CPU device emulation.

Replica ``r = worker * cores_per_worker + core`` runs on ``mesh.devices[worker,
core]``. A worker is a group of devices that share a host process: in a
single process all workers are local; with several processes (one per worker,
on JAX's distributed runtime) each process owns the row of its worker, so the
same mesh and the same compiled step span hosts.

Example (after ``rp.force_cpu_devices(8)``, which must run before JAX starts):

>>> mesh = rp.build_mesh(num_workers=2, cores_per_worker=4)
>>> dict(mesh.shape)
{'workers': 2, 'cores': 4}

Promises:

1. ``build_mesh(W, C)`` is a ``('workers', 'cores')`` mesh of shape ``(W, C)`` whose device ``[w, c]`` is the
   ``(w * C + c)``-th device by (process, id), in whatever order ``devices`` lists them
   (tests/test_run.py::test_replica_r_is_the_rth_device_by_id_whatever_order_the_devices_are_given_in).
2. ``cores_per_worker=None`` is every local device, or ``len(devices) // num_workers`` of the devices given
   (tests/test_run.py::test_cores_per_worker_none_is_every_local_device_or_the_workers_share_of_those_given).
3. A worker or core count that is not a positive int (0, negative, a float, a string) is a ``ValueError``
   naming the argument
   (tests/test_run.py::test_a_worker_or_core_count_that_is_not_a_positive_int_is_refused).
4. More replicas than devices is a ``ValueError`` naming both numbers and ``force_cpu_devices``
   (tests/test_run.py::TestBadInput::test_more_replicas_than_devices).
5. In a job of several processes, each process holds ``W / processes`` consecutive workers, each of its own
   devices: with one worker per process, worker ``w`` is process ``w``
   (tests/test_distributed.py::TestMeshOverProcesses::test_worker_w_is_process_w,
   tests/test_distributed.py::TestMeshOverProcesses::test_several_workers_per_process).
6. Workers that do not split evenly over the processes, a process with too few devices, or devices that
   leave out a process are each a ``ValueError`` naming the numbers and the fix
   (tests/test_distributed.py::TestMeshOverProcesses::test_errors).
7. ``force_cpu_devices(n)`` before JAX starts sets the emulated device count in ``XLA_FLAGS``, other flags
   kept (tests/test_run.py::test_force_cpu_devices_before_start_keeps_other_flags); after, it does nothing if
   JAX has ``n`` CPU devices or more, and with fewer raises a ``RuntimeError`` that says to set ``XLA_FLAGS``
   (tests/test_run.py::TestBadInput::test_force_cpu_devices_after_start); ``n`` not a positive int is a
   ``ValueError`` (tests/test_run.py::test_a_worker_or_core_count_that_is_not_a_positive_int_is_refused).
8. ``with_device_count(flags, n)`` holds the count flag exactly once, set to ``n``, after the other flags,
   which keep their order (earlier count flags removed, wherever they were)
   (tests/test_run.py::test_the_device_count_flag_is_set_once_other_flags_kept_in_order).
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np
from jax.sharding import Mesh

from replicator._jax_compat import backends_initialized
from replicator.core.context import REPLICA_AXES

__all__ = ["build_mesh", "force_cpu_devices", "with_device_count"]

_FLAG = "--xla_force_host_platform_device_count"


def force_cpu_devices(n: int) -> None:
    """Emulate ``n`` CPU devices by setting ``XLA_FLAGS`` (other flags kept).

    Must run before JAX starts its backend (before the first ``jax.devices()``
    or array operation). If JAX already runs with at least ``n`` CPU devices it
    does nothing; with fewer it raises an error that says what to set where.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"force_cpu_devices(n): n must be a positive int, got {n!r}.")
    if backends_initialized():
        have = len(jax.devices("cpu"))
        if have >= n:
            return
        raise RuntimeError(
            f"force_cpu_devices({n}): JAX has already started with {have} CPU device(s), so "
            f"the flag can no longer take effect. Call replicator.force_cpu_devices({n}) at "
            f"the very top of your script, before anything touches jax.devices() or creates "
            f"an array, or set it in the environment before Python starts:\n"
            f"  XLA_FLAGS={_FLAG}={n} python your_script.py"
        )
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), n)


def with_device_count(xla_flags: str, n: int) -> str:
    """``xla_flags`` with the emulated CPU device count set to ``n`` (other flags kept).

    >>> with_device_count("--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=8", 4)
    '--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4'
    """
    flags = re.sub(rf"{_FLAG}=\S*", "", xla_flags).split()
    return " ".join([*flags, f"{_FLAG}={n}"])


def _devices_by_process(devices: list) -> list:
    """Devices ordered by (process, id): each process's devices contiguous."""
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def _rows_by_process(available: list, num_workers: int, cores_per_worker: int, process_count: int) -> list[list]:
    """Mesh rows for a multi-process job: each process feeds the same number of workers.

    Worker ``w`` is ``cores_per_worker`` devices of one process; processes
    take consecutive workers in process order (with one worker per process,
    worker ``w`` is process ``w``), so that every process has a share of the
    batch and runs the same program.
    """
    per_process: dict[int, list] = {}
    for d in available:  # sorted by (process, id)
        per_process.setdefault(d.process_index, []).append(d)
    n_proc = len(per_process)
    if n_proc != process_count:
        raise ValueError(
            f"the devices given cover process(es) {sorted(per_process)} of the job's "
            f"{process_count}; every process runs the step and must feed a worker, so pass "
            f"devices of every process (or leave devices=None)."
        )
    counts = {p: len(ds) for p, ds in per_process.items()}
    if num_workers % n_proc:
        raise ValueError(
            f"num_workers={num_workers} does not split evenly over the job's {n_proc} processes; every "
            f"process must feed the same number of workers. Use num_workers={n_proc} (one worker per "
            f"process, the usual choice) or a multiple of {n_proc}."
        )
    per = num_workers // n_proc
    short = {p: c for p, c in counts.items() if c < per * cores_per_worker}
    if short:
        raise ValueError(
            f"{num_workers} workers of {cores_per_worker} cores over {n_proc} processes need "
            f"{per * cores_per_worker} devices in each process, but process(es) {sorted(short)} have only "
            f"{sorted(set(short.values()))} (devices per process: {counts}). Use cores_per_worker=None "
            f"(all local devices), fewer workers, or start each process with more devices "
            f"(python -m replicator.launch --cores-per-worker C emulates C CPU devices per worker)."
        )
    return [ds[i * cores_per_worker : (i + 1) * cores_per_worker] for ds in per_process.values() for i in range(per)]


def build_mesh(num_workers: int = 1, cores_per_worker: int | None = None, *, devices: list | None = None) -> Mesh:
    """The ``('workers', 'cores')`` mesh for ``num_workers x cores_per_worker``.

    Args:
      num_workers: number of workers (rows of the mesh).
      cores_per_worker: devices per worker; ``None`` means all devices of a
        process (``jax.local_device_count()``).
      devices: the devices to use (default ``jax.devices()``).

    In a multi-process job (``jax.process_count() > 1``) a worker's cores are
    devices of one process, and each process holds ``num_workers /
    process_count`` consecutive workers: with one worker per process, worker
    ``w`` is process ``w``'s first ``cores_per_worker`` local devices.

    Raises:
      ValueError: if more replicas are asked for than there are devices, or
        (multi-process) if the workers do not split evenly over the processes'
        devices; the message names the numbers and the fix.
    """
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}.")
    if cores_per_worker is None:
        cores_per_worker = jax.local_device_count() if devices is None else len(devices) // num_workers
    if not isinstance(cores_per_worker, int) or cores_per_worker < 1:
        raise ValueError(f"cores_per_worker must be a positive int or None, got {cores_per_worker!r}.")
    available = _devices_by_process(list(jax.devices() if devices is None else devices))
    wanted = num_workers * cores_per_worker
    if wanted > len(available):
        platform = available[0].platform if available else "cpu"
        raise ValueError(
            f"Replicator(num_workers={num_workers}, cores_per_worker={cores_per_worker}) needs "
            f"{wanted} devices but only {len(available)} {platform} device(s) are available. "
            f"Use fewer replicas, run several replicas on each device (Replicator(..., parallelism=rp.Parallelism("
            f"replicas_per_device={-(-wanted // max(len(available), 1))})) if that divides the replicas evenly), "
            f"or emulate CPU devices: call replicator.force_cpu_devices({wanted}) "
            f"before JAX starts, or run with XLA_FLAGS={_FLAG}={wanted}."
        )
    grid = np.empty((num_workers, cores_per_worker), dtype=object)
    if jax.process_count() > 1:
        rows = _rows_by_process(available, num_workers, cores_per_worker, jax.process_count())
    else:
        rows = [available[w * cores_per_worker : (w + 1) * cores_per_worker] for w in range(num_workers)]
    for w, row in enumerate(rows):
        grid[w, :] = row
    return Mesh(grid, REPLICA_AXES)
