"""JAX's persistent compilation cache works for replicated steps.

A second process that runs the same step with the same ``jax_compilation_cache_dir``
reads XLA's compiled program from the cache instead of compiling it: JAX reports a
cache hit for every program the first process wrote (``/jax/compilation_cache/cache_hits``
through ``jax.monitoring``) and the directory gains no entry. Both processes must also
compute the same result as NumPy. Run as a script, this file is one such process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.multiprocess

#: Seconds a worker process may take (importing JAX and compiling a small step).
WORKER_TIMEOUT_S = 240
DEVICES = 8
ROWS_PER_REPLICA = 2


def _batch() -> np.ndarray:
    return np.arange(DEVICES * ROWS_PER_REPLICA * 3, dtype=np.float32).reshape(-1, 3) / 10


def _expected(w0: np.ndarray) -> np.ndarray:
    """Two steps of gradient descent on ``mean((x @ w - 1)^2)`` over the global batch, in NumPy."""
    x = _batch().astype(np.float64)
    w = w0.astype(np.float64)
    for _ in range(2):
        w = w - 0.1 * (2 * x.T @ (x @ w - 1) / len(x))
    return w


def _run_worker(cache_dir: str) -> dict:
    """Run this file as a fresh process with the cache in ``cache_dir``; its JSON report."""
    env = dict(os.environ, REPLICATOR_VERIFY="")  # the user's default pipeline
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), cache_dir],
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_reads_the_compiled_step_from_the_cache(tmp_path):
    cache_dir = str(tmp_path / "cache")
    first = _run_worker(cache_dir)
    entries = sorted(os.listdir(cache_dir))
    assert first["misses"] >= 1 and entries, (first, entries)  # the first process compiled and wrote
    second = _run_worker(cache_dir)
    assert second["hits"] >= first["misses"], (first, second)
    assert second["misses"] == 0, second
    assert sorted(os.listdir(cache_dir)) == entries  # nothing compiled anew, so nothing written
    expected = _expected(np.zeros(3, np.float32))
    for report in (first, second):
        np.testing.assert_allclose(report["w"], expected, rtol=1e-5, atol=1e-6)


def _worker(cache_dir: str) -> None:
    """Two steps of a replicated linear regression with the compilation cache in ``cache_dir``."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import replicator as rp

    rp.force_cpu_devices(DEVICES)
    import jax
    import jax.monitoring
    import jax.numpy as jnp

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    counts = {"hits": 0, "misses": 0}

    def on_event(event: str, **_: object) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            counts["hits"] += 1
        elif event == "/jax/compilation_cache/cache_misses":
            counts["misses"] += 1

    jax.monitoring.register_event_listener(on_event)
    repl = rp.Replicator(1, DEVICES)
    batch = _batch()

    def input_fn(ctx):
        while True:
            yield {"x": batch}

    def step_fn(w, b):
        grad = jax.grad(lambda w: jnp.mean((b["x"] @ w - 1.0) ** 2))(w)
        return w - 0.1 * rp.all_mean(grad), {}

    w = jnp.zeros(3, jnp.float32)
    for _ in range(2):
        w, _ = repl.run(step_fn, input_fn, w)
    print(json.dumps({**counts, "w": np.asarray(w).tolist()}))


if __name__ == "__main__":
    _worker(sys.argv[1])
