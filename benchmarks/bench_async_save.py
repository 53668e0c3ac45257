"""Step time while checkpoints are saved: no saves, synchronous saves, asynchronous saves.

One process, ``Replicator(1, D)`` on D emulated CPU devices (default 1: the
state lives once in memory), trained with ``rp.Trainer``. The state is a
momentum-SGD pair (parameters and momentum) of ``L`` float32 matrices of
1024 x 1024 each (``--mb``: about that many megabytes of state, both halves);
the step fits every matrix to its own regression batch of ``--rows`` rows
(a matmul forward and backward per matrix, so the step computes in proportion
to the state, as a model's does). Three trainers, one per variant, each with
a ``CheckpointHook(every=K, keep=1)`` (none for ``none``; ``async_save=True``
for ``async``), run ``--saves`` save periods of K steps per round; rounds
interleave the variants, order reversed every other round.

A timing hook after the checkpoint hook waits for each step's state and takes
the time between consecutive steps (the step and every hook of it, the save
included). A step *overlaps a save* if it saved (sync: the whole save; async:
holding the state and starting the thread) or if an asynchronous save was in
flight when it began. Printed per variant: the median of the steps that
overlap a save, of the others, their ratio to the median ``none`` step; for
``async`` also the save steps and the steps after them apart, how many saves
waited for the one before, and how many steps a save overlapped.

Usage::

    python benchmarks/bench_async_save.py --mb 100            # ~100 MB of state
    python benchmarks/bench_async_save.py --mb 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import replicator as rp  # noqa: E402


class StepTimer(rp.Hook):
    """Records each step's time (waiting for its state) and whether it overlapped a save of ``hook``."""

    def __init__(self, hook: rp.CheckpointHook | None):
        self.hook = hook
        self.times: list[float] = []
        self.overlaps: list[bool] = []
        self.saves: list[bool] = []  # the step saved (sync: the whole save; async: holding the state)
        self._last = 0.0
        self._busy = False

    def before_run(self, trainer: rp.Trainer) -> None:
        self._last = time.perf_counter()
        self._busy = False

    def after_step(self, trainer: rp.Trainer) -> None:
        import jax

        jax.block_until_ready(trainer.state)
        now = time.perf_counter()
        saved = self.hook is not None and bool(self.hook.saved) and self.hook.saved[-1] == trainer.step
        self.times.append(now - self._last)
        self.overlaps.append(saved or self._busy)
        self.saves.append(saved)
        self._busy = self.hook is not None and self.hook.manager.in_flight is not None
        self._last = now


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=100, help="megabytes of state (parameters and momentum)")
    p.add_argument("--rows", type=int, default=32, help="rows of each matrix's regression batch")
    p.add_argument("--every", type=int, default=5, help="save every this many steps")
    p.add_argument("--saves", type=int, default=2, help="save periods per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--donate", action="store_true", help="Replicator(donate_state=True)")
    p.add_argument(
        "--nice", type=int, default=0, help="also an async variant whose writer thread has this niceness (writer_nice=)"
    )
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    rp.force_cpu_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np

    n = max(1, round(args.mb * 1e6 / (2 * 4 * 1024 * 1024)))  # matrices per half of the state
    state_mb = 2 * n * 4 * 1024 * 1024 / 1e6

    def init():
        params = [jnp.full((1024, 1024), 0.01 * i, jnp.float32) for i in range(n)]
        return params, [jnp.zeros((1024, 1024), jnp.float32) for _ in range(n)]

    def input_fn(ctx):
        rng = np.random.default_rng(ctx.worker_id)
        x = rng.normal(size=(args.rows * ctx.cores_per_worker, 1024)).astype(np.float32)
        while True:
            yield {"x": x}

    def step_fn(state, batch):
        params, momentum = state
        x = batch["x"]

        def loss(ps):
            return sum(jnp.mean((x @ w - x) ** 2) for w in ps)

        grads = rp.all_mean(jax.grad(loss)(params))
        momentum = [0.9 * m + g for m, g in zip(momentum, grads, strict=True)]
        return ([w - 1e-3 * m for w, m in zip(params, momentum, strict=True)], momentum), {}

    root = args.dir or tempfile.mkdtemp(prefix="bench-async-save-")
    trainers: dict[str, tuple[rp.Trainer, StepTimer, rp.CheckpointHook | None]] = {}
    names = ("none", "sync", "async") + ((f"async-nice{args.nice}",) if args.nice else ())
    for name in names:
        hook = (
            None
            if name == "none"
            else rp.CheckpointHook(
                os.path.join(root, name),
                args.every,
                keep=1,
                async_save=name.startswith("async"),
                writer_nice=args.nice if name.startswith("async-nice") else 0,
            )
        )
        timer = StepTimer(hook)
        repl = rp.Replicator(1, args.devices, donate_state=args.donate)
        hooks = [h for h in (hook, timer) if h is not None]
        trainers[name] = (rp.Trainer(repl, step_fn, input_fn, init(), hooks=hooks), timer, hook)
    print(
        f"state {state_mb:.0f} MB ({2 * n} matrices of 1024 x 1024 float32), {args.rows} rows per matrix per device, "
        f"{args.devices} device(s), donate={args.donate}, save every {args.every} steps, keep=1, {args.rounds} rounds "
        f"x {args.saves} saves per variant; checkpoints in {root}; jax {jax.__version__}; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    per_round = args.every * args.saves
    for trainer, timer, _ in trainers.values():  # compile and warm up (one save each)
        trainer.run(trainer.step + args.every)
        timer.times.clear()
        timer.overlaps.clear()
        timer.saves.clear()
    for r in range(args.rounds):
        order = list(trainers.items())
        if r % 2:
            order.reverse()
        for _, (trainer, _, _) in order:
            trainer.run(trainer.step + per_round)
        print(f"round {r + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    base = statistics.median(trainers["none"][1].times)
    print(f"\n{'variant':8} {'overlapping ms':>15} {'x none':>7} {'other ms':>9} {'x none':>7} {'steps':>6}")
    for name, (_, timer, _) in trainers.items():
        over = [t for t, o in zip(timer.times, timer.overlaps, strict=True) if o]
        other = [t for t, o in zip(timer.times, timer.overlaps, strict=True) if not o]
        cells = [
            f"{1e3 * statistics.median(over):15.1f} {statistics.median(over) / base:7.2f}"
            if over
            else f"{'-':>15} {'-':>7}",
            f"{1e3 * statistics.median(other):9.1f} {statistics.median(other) / base:7.2f}"
            if other
            else f"{'-':>9} {'-':>7}",
        ]
        print(f"{name:8} {cells[0]} {cells[1]} {len(over):>3}/{len(timer.times)}")
    for name in [n for n in trainers if n.startswith("async")]:
        _, timer, hook = trainers[name]
        at_save = [t for t, s in zip(timer.times, timer.saves, strict=True) if s]
        after = [t for t, o, s in zip(timer.times, timer.overlaps, timer.saves, strict=True) if o and not s]
        if at_save and after:
            print(
                f"\n{name}, steps that overlap a save: the save step {1e3 * statistics.median(at_save):.1f} ms "
                f"({statistics.median(at_save) / base:.2f}x none), the steps after it while it is written "
                f"{1e3 * statistics.median(after):.1f} ms ({statistics.median(after) / base:.2f}x none)"
            )
        waits = hook.waits
        print(
            f"{name}: {len(waits)} save(s) waited for the one before"
            + (f" (median {statistics.median(s for _, s in waits):.2f} s)" if waits else "")
        )
        steps_per_save = sum(timer.overlaps) / (args.rounds * args.saves)
        print(f"{name}: {steps_per_save:.1f} steps overlap each save on average (the save step included)")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
