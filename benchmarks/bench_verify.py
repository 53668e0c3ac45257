"""What ``verify=True`` costs: the default pipeline's time on a 64-layer x 32 Adam MLP step.

Runs the passes on the traced step with ``verify=False`` and ``True``,
interleaved, and prints the medians (XLA's compile is not included).

Usage::

    python benchmarks/bench_verify.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import replicator as rp  # noqa: E402

rp.force_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from replicator.core.tracing import trace_step  # noqa: E402

TX = optax.adam(1e-3)


def step(state, batch):
    params, opt = state

    def loss(ps):
        h = batch["x"]
        for layer in ps:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean(h**2)

    updates, opt = TX.update(rp.all_mean(jax.grad(loss)(params)), opt, params)
    return (optax.apply_updates(params, updates), opt), {}


def specs(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def main(rounds: int = 5) -> None:
    params = [{"w": np.ones((32, 32), np.float32), "b": np.zeros(32, np.float32)} for _ in range(64)]
    repl = rp.Replicator(1, 8)
    batch = {"x": np.ones((64, 32), np.float32)}
    graph = trace_step(step, specs((params, TX.init(params))), specs(batch), repl.context).graph
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for verify in (False, True):
            pipeline = rp.PassManager.default(verify=verify)
            t0 = time.perf_counter()
            pipeline.run(graph)
            seconds[verify].append(time.perf_counter() - t0)
    off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"passes: {off:.3f} s without verify, {on:.3f} s with verify ({on / off:.1f}x), median of {rounds}")


if __name__ == "__main__":
    main()
