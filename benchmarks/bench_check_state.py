"""What ``Replicator(check_state_every=K)`` costs per step.

One process, N emulated CPU devices, ``Replicator(1, N)``, the MLP workloads of
``bench_zero.py`` (Adam; 64x32 has 384 state leaves, 16x128 has 96). Variants,
interleaved round by round: no check, ``K = 100`` and ``K = 10`` (and ``K = 1``
to show the cost of one check). Reported: median ms per step and the ratio to
no check. Target: under 2% at ``K = 100``.

``pipe-mlp8x128``: a pipeline instead, ``Replicator(1, N,
parallelism=rp.Parallelism(stages=2, microbatches=4))``, ``run_pipelined`` of an 8-layer MLP (width 128, batch 64, Adam)
cut in two by one ``rp.stage_boundary``; its check compares each stage's copies
of its packed rows across that stage's ``N / 2`` replicas.

Usage::

    python benchmarks/bench_check_state.py                 # 8 devices, both workloads
    python benchmarks/bench_check_state.py --rounds 5 --steps 200
    python benchmarks/bench_check_state.py --workloads pipe-mlp8x128 --rounds 5 --steps 100
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import replicator as rp  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200, help="steps per variant per round (a multiple of 100)")
    p.add_argument("--workloads", default="mlp64x32,mlp16x128", help="and/or pipe-mlp8x128")
    args = p.parse_args(argv)
    rp.force_cpu_devices(args.devices)

    from timing import time_interleaved

    shapes = {"mlp64x32": (64, 32), "mlp16x128": (16, 128)}
    print(f"{args.devices} devices, {args.rounds} rounds x {args.steps} steps, medians (ms/step)")
    print(f"{'workload':<10} {'no check':>9} {'K=100':>9} {'K=10':>9} {'K=1':>9}   K=100/none  K=10/none  K=1/none")
    for name in args.workloads.split(","):
        if name == "pipe-mlp8x128":
            variants = {label: pipelined_runner(args.devices, every) for label, every in EVERY}
        else:
            variants = data_parallel_runners(args.devices, *shapes[name])
        t = time_interleaved(variants, args.rounds, args.steps)
        ms = {k: 1e3 * v for k, v in t.items()}
        print(
            f"{name:<10} {ms['none']:>9.2f} {ms['100']:>9.2f} {ms['10']:>9.2f} {ms['1']:>9.2f}"
            f"   {t['100'] / t['none']:>10.3f} {t['10'] / t['none']:>10.3f} {t['1'] / t['none']:>9.3f}"
        )
    return 0


EVERY = (("none", None), ("100", 100), ("10", 10), ("1", 1))  # variant label, check_state_every


def data_parallel_runners(devices: int, depth: int, width: int) -> dict:
    """One ``Replicator.run`` step of ``bench_zero``'s MLP per call, for each ``check_state_every``."""
    import itertools

    from bench_zero import mlp

    state0, batches, step = mlp(depth, width)
    step_fn = lambda s, b: step(s, b, rp.all_mean, None)  # noqa: E731
    variants = {}
    for label, every in EVERY:
        repl = rp.Replicator(1, devices, check_state_every=every)
        cycle = itertools.cycle(batches)
        holder = {"state": repl.broadcast_state(state0)}

        def input_fn(ctx, cycle=cycle):
            yield from cycle

        def run(repl=repl, holder=holder, input_fn=input_fn):
            holder["state"], _ = repl.run(step_fn, input_fn, holder["state"])
            return holder["state"]

        variants[label] = run
    return variants


def pipelined_runner(devices: int, every: int | None):
    """One ``run_pipelined`` step of the 2-stage MLP per call, the state kept between calls."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    layers, width, batch = 8, 128, 64
    rng = np.random.default_rng(0)
    params = [
        {"w": (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32), "b": np.zeros(width, np.float32)}
        for _ in range(layers)
    ]
    data = tuple(rng.normal(size=(batch, width)).astype(np.float32) for _ in range(2))

    def loss(p, x, y):
        h = x
        for i, layer in enumerate(p):
            if i == layers // 2:
                h = rp.stage_boundary(h)
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean((h - y) ** 2)

    tx = optax.adam(1e-3)
    repl = rp.Replicator(1, devices, parallelism=rp.Parallelism(stages=2, microbatches=4), check_state_every=every)
    holder = {"state": (params, tx.init(params))}

    def run():
        holder["state"], _ = repl.run_pipelined(loss, tx, data, holder["state"])
        return holder["state"]

    return run


if __name__ == "__main__":
    raise SystemExit(main())
