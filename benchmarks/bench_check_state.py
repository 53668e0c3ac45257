"""What ``Replicator(check_state_every=K)`` costs per step.

One process, N emulated CPU devices, ``Replicator(1, N)``, the MLP workloads of
``bench_zero.py`` (Adam; 64x32 has 384 state leaves, 16x128 has 96). Variants,
interleaved round by round: no check, ``K = 100`` and ``K = 10`` (and ``K = 1``
to show the cost of one check). Reported: median ms per step and the ratio to
no check. Target: under 2% at ``K = 100``.

Usage::

    python benchmarks/bench_check_state.py                 # 8 devices, both workloads
    python benchmarks/bench_check_state.py --rounds 5 --steps 200
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
    p.add_argument("--workloads", default="mlp64x32,mlp16x128")
    args = p.parse_args(argv)
    rp.force_cpu_devices(args.devices)

    import itertools

    from bench_zero import mlp
    from timing import time_interleaved

    shapes = {"mlp64x32": (64, 32), "mlp16x128": (16, 128)}
    print(f"{args.devices} devices, {args.rounds} rounds x {args.steps} steps, medians (ms/step)")
    print(f"{'workload':<10} {'no check':>9} {'K=100':>9} {'K=10':>9} {'K=1':>9}   K=100/none  K=10/none  K=1/none")
    for name in args.workloads.split(","):
        state0, batches, step = mlp(*shapes[name])
        step_fn = lambda s, b, step=step: step(s, b, rp.all_mean, None)  # noqa: E731
        variants = {}
        for label, every in (("none", None), ("100", 100), ("10", 10), ("1", 1)):
            repl = rp.Replicator(1, args.devices, check_state_every=every)
            cycle = itertools.cycle(batches)
            holder = {"state": repl.broadcast_state(state0)}

            def input_fn(ctx, cycle=cycle):
                yield from cycle

            def run(repl=repl, holder=holder, input_fn=input_fn, step_fn=step_fn):
                holder["state"], _ = repl.run(step_fn, input_fn, holder["state"])
                return holder["state"]

            variants[label] = run
        t = time_interleaved(variants, args.rounds, args.steps)
        ms = {k: 1e3 * v for k, v in t.items()}
        print(
            f"{name:<10} {ms['none']:>9.2f} {ms['100']:>9.2f} {ms['10']:>9.2f} {ms['1']:>9.2f}"
            f"   {t['100'] / t['none']:>10.3f} {t['10'] / t['none']:>10.3f} {t['1'] / t['none']:>9.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
