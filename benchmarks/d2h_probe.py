"""What copying a state off its device costs the training thread (for asynchronous checkpoint saves).

On the default device (a GPU where there is one), with 100 MB of state as 25 arrays of
4 MB, prints: how long ``copy_to_host_async`` takes to return; how a pure-Python loop
and a tiny jitted step on the training thread slow down while another thread copies the
state to the host (whole arrays with ``np.asarray``, 0.5 MB slices, ``jax.device_get``);
and how long copies on the device take. Findings: benchmarks/results/async-save.md.

Usage::

    python benchmarks/d2h_probe.py
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np


def main() -> None:
    device = jax.devices()[0]
    print(device)

    def state(value: float) -> list[jax.Array]:
        arrays = [jax.device_put(np.full((1024, 1024), value, np.float32), device) for _ in range(25)]
        return jax.block_until_ready(arrays)

    step = jax.jit(lambda a: a * 1.0001)
    tiny = state(0)[0]
    step(tiny).block_until_ready()

    def python_loop(seconds: float) -> int:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            n += 1
        return n

    print(f"python loop alone: {python_loop(0.1)} iterations / 100 ms")

    def during(fetch, label: str) -> None:
        thread = threading.Thread(target=fetch, args=(state(1),))
        t0 = time.perf_counter()
        thread.start()
        n = python_loop(0.1)
        thread.join(timeout=60)
        fetched = (time.perf_counter() - t0) * 1e3
        thread = threading.Thread(target=fetch, args=(state(2),))
        thread.start()
        steps, t0 = 0, time.perf_counter()
        while thread.is_alive():
            step(tiny).block_until_ready()
            steps += 1
        elapsed = (time.perf_counter() - t0) * 1e3
        print(
            f"{label}: python loop {n} / 100 ms while fetching ({fetched:.0f} ms); "
            f"tiny steps {elapsed / max(steps, 1):.3f} ms each over {elapsed:.0f} ms"
        )

    t0 = time.perf_counter()
    for _ in range(200):
        step(tiny).block_until_ready()
    print(f"tiny step alone: {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms")
    during(lambda xs: [np.asarray(a) for a in xs], "np.asarray of whole 4 MB arrays")
    during(
        lambda xs: [np.asarray(a[i : i + 128]) for a in xs for i in range(0, 1024, 128)], "np.asarray of 0.5 MB slices"
    )
    during(jax.device_get, "jax.device_get of all")
    arrays = state(3)
    t0 = time.perf_counter()
    copies = [jax.device_put(a, device, may_alias=False) for a in arrays]
    dispatched = (time.perf_counter() - t0) * 1e3
    jax.block_until_ready(copies)
    print(f"copies on the device: dispatched in {dispatched:.1f} ms, done in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    t0 = time.perf_counter()
    for a in copies:
        a.copy_to_host_async()
    print(f"copy_to_host_async of 25 x 4 MB returned after {(time.perf_counter() - t0) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
