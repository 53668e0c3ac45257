"""Interleaved step timing shared by the benchmarks (JAX must be set up by the caller)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax

#: Every variant may run this many steps ahead of the host, as Replicator does
#: on CPU (XLA CPU deadlocks when many collective programs are queued).
MAX_IN_FLIGHT = 2


def block(x: object) -> None:
    jax.block_until_ready(x)


def interleaved_samples(
    variants: dict[str, Callable[[], object]],
    rounds: int,
    steps: int,
    *,
    warmup: int = 2,
    max_in_flight: int | None = MAX_IN_FLIGHT,
) -> dict[str, list[float]]:
    """Seconds per step of each variant, one sample per round, variants interleaved (order reversed every
    other round). ``max_in_flight``: steps a variant may run ahead of the host (None: blocks once a round)."""
    for run in variants.values():  # compile and warm up
        for _ in range(warmup):
            block(run())
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants.items())
        if r % 2:
            order.reverse()
        for name, run in order:
            t0 = time.perf_counter()
            in_flight: list[object] = []
            for _ in range(steps):
                in_flight.append(run())
                if max_in_flight is None:
                    in_flight = in_flight[-1:]
                elif len(in_flight) > max_in_flight:
                    block(in_flight.pop(0))
            block(in_flight)
            samples[name].append((time.perf_counter() - t0) / steps)
    return samples


def time_interleaved(variants: dict[str, Callable[[], object]], rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each variant, variants interleaved per round (see :func:`interleaved_samples`)."""
    return {name: statistics.median(v) for name, v in interleaved_samples(variants, rounds, steps).items()}
