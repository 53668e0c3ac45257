"""Measure the cost models' figures on the devices at hand (this runs JAX).

:func:`calibrate` times collectives over each mesh axis and fits the alpha-beta
links of a :class:`~replicator.cost.topology.Topology`; :func:`calibrate_compute`
times element-wise work and matrix products for the compute model. Across
several processes every process runs the same programs and takes process 0's
measurements (:func:`~replicator.runtime.distributed.agreement.from_process0`),
so that every worker chooses the same pass options.

>>> link = fit_link([(8, 1e6, 3e-4), (8, 4e6, 9e-4), (2, 1e6, 2e-4)])
>>> link.alpha_s >= 0 and link.beta_s_per_byte > 0
True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence

import numpy as np

from replicator.cost.compute import Compute
from replicator.cost.topology import Link, Measurement, Topology
from replicator.runtime.distributed.agreement import from_process0
from replicator.runtime.mesh import build_mesh

__all__ = ["calibrate", "calibrate_compute", "fit_link"]


def _seconds_of_call(f, *args) -> float:
    """Wall time of one call of ``f``, its results waited for."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def agreed(mesh, values: list) -> list:
    """Process 0's ``values`` on every process when ``mesh`` spans several processes, else ``values``."""
    return from_process0(values) if len({d.process_index for d in mesh.devices.flat}) > 1 else values


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
    (:func:`~replicator.cost.compute.calibrate_compute`).

    Returns:
      A :class:`Topology` with the fitted links and, in ``measurements``, the
      median time per psum of each axis and size.
    """
    import jax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

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

    cases = []
    for kind in ("psum", "ppermute"):
        for axis in axes:
            for size in sizes:
                x = jax.device_put(
                    np.ones((shape["workers"], shape["cores"], size // 4), np.float32), NamedSharding(mesh, spec)
                )
                short, long = program(axis, 1, kind), program(axis, chain + 1, kind)
                for f in (short, long):  # compile and warm up
                    _seconds_of_call(f, x)
                    _seconds_of_call(f, x)
                cases.append((kind, axis, size, short, long, x, []))
    # A mesh over several processes: every process must run the same programs, so process 0's
    # clock ends the repeats, and its medians are everyone's (the same topology on every worker; agreed).
    start = time.perf_counter()
    for r in range(repeats):
        for _, _, _, short, long, x, samples in cases if r % 2 == 0 else reversed(cases):
            samples.append((_seconds_of_call(long, x) - _seconds_of_call(short, x)) / chain)
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


def calibrate_compute(
    mesh,
    *,
    elements: int = 1 << 18,
    matmul: int = 256,
    chain: int = 8,
    repeats: int = 5,
    time_budget_s: float = 20.0,
) -> Compute:
    """Measure :class:`Compute` on every device of ``mesh`` at once (devices that share host cores share them here too).

    Two jitted ``shard_map`` programs per kind, one with ``chain`` more
    operations than the other; the difference of their median times over the
    extra operations: ``x = x * 0.999 + y_i`` on ``elements`` floats per device,
    each ``y_i`` a different array (2 element-wise operations per element,
    one operand read from memory, as in an optimizer's update), and ``x @ x.T``
    on ``matmul x matmul`` float32 matrices (``2 matmul**3`` flops).
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axes = tuple(mesh.axis_names)
    spec = P(axes)
    devices = mesh.devices.size

    def program(kind: str, count: int):
        def body(x, ys):
            for i in range(count):
                x = x * 0.999 + ys[i] if kind == "element" else (x @ x.T) * (1.0 / matmul)
            return x

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False))

    def put(shape: tuple[int, ...], value: float):
        return jax.device_put(np.full(shape, value, np.float32), NamedSharding(mesh, spec))

    cases = []
    for kind, shape in (("element", (devices * elements,)), ("matmul", (devices * matmul, matmul))):
        ys = [put(shape, 1e-3 * i) for i in range(chain + 1)] if kind == "element" else []
        args = (put(shape, 0.5), ys)
        short, long = program(kind, 1), program(kind, chain + 1)
        for f in (short, long):
            _seconds_of_call(f, *args)
        cases.append((kind, short, long, args, []))
    start = time.perf_counter()
    for _ in range(repeats):
        for _, short, long, args, samples in cases:
            samples.append(max(_seconds_of_call(long, *args) - _seconds_of_call(short, *args), 0.0) / chain)
        if agreed(mesh, [time.perf_counter() - start > time_budget_s])[0]:
            break
    medians = agreed(mesh, [statistics.median(samples) for *_, samples in cases])
    per_op = {kind: median for (kind, *_), median in zip(cases, medians, strict=True)}
    return Compute(
        seconds_per_element=per_op["element"] / (2 * elements),
        seconds_per_flop=per_op["matmul"] / (2.0 * matmul**3),
        source=f"calibrate_compute on {devices} {mesh.devices.flat[0].platform} device(s) at once",
    )
