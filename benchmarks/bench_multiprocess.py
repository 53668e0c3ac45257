"""Multi-process step time, and how fast a multi-process job notices failures.

Step time: the same data-parallel training step (Adam, ``rp.all_mean`` of the
gradients, state carried between steps, a host batch every step, the loss read
back every step) on 8 replicas three ways:

* ``1 proc x 8``   one process, ``Replicator(1, 8)``
* ``1 proc 2x4``   one process, ``Replicator(2, 4)`` (the same mesh as below)
* ``2 procs x 4``  two processes of 4 emulated CPU devices each, collectives over gloo,
  started by ``python -m replicator.launch``; also with ``hierarchical-allreduce``
  on (``+hier``), with ``fuse-collectives`` off (``-fuse``), and with
  ``shard-optimizer-update`` explicitly on (``zero``) and off (``no-zero``)

for two MLPs: ``small`` (4 -> 16 -> 16 -> 1, batch 64: all overhead) and ``wide``
(256 -> 512 x 3 -> 1, batch 512: compute and a 0.8 M-float all-reduce), and
``sum50``: 50 state tensors of 1000 floats, each plus an all-sum of a
per-replica scaling of it (50 small all-reduces, no optimizer state).

Failures (``--failures``): with the launcher's defaults (kill grace 5 s,
heartbeat timeout 10 s), the seconds from a worker's death (or freeze) to the
launcher's exit, and from start to exit when a worker never starts (start
timeout 10 s).

Usage::

    python benchmarks/bench_multiprocess.py                  # step times
    python benchmarks/bench_multiprocess.py --failures       # and failure detection times
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TRAIN = ROOT / "tests" / "multiproc" / "train.py"

WORKLOADS = {"small": ((4, 16, 16, 1), 64), "wide": ((256, 512, 512, 512, 1), 512)}


def worker(args: argparse.Namespace) -> None:
    """One process of a benchmark job: time the step, print a JSON line (worker 0)."""
    from replicator.runtime import distributed

    info = distributed.initialize()
    import replicator as rp

    if info.is_multiprocess:
        workers, cores = info.num_workers, info.cores_per_worker
    else:
        workers, cores = args.workers, args.cores
        rp.force_cpu_devices(workers * cores)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    options = json.loads(args.pipeline)
    disable = options.pop("disable", [])
    repl = rp.Replicator(
        num_workers=workers, cores_per_worker=cores, passes=rp.PassManager.default(disable=disable, **options)
    )
    tx = optax.adam(1e-3)
    results = {}
    for name, (sizes, batch) in WORKLOADS.items():
        rng = np.random.default_rng(0)
        params = {
            f"w{i}": (rng.normal(size=(m, n)) / np.sqrt(m)).astype(np.float32)
            for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
        }

        n_layers = len(sizes) - 1

        def loss_fn(p, b, n_layers=n_layers):
            h = b["x"]
            for i in range(n_layers):
                h = h @ p[f"w{i}"]
                if i < n_layers - 1:
                    h = jnp.tanh(h)
            return jnp.mean((h - b["y"]) ** 2)

        def step(state, b, loss_fn=loss_fn):
            p, opt = state
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            updates, opt = tx.update(rp.all_mean(g), opt, p)
            return (optax.apply_updates(p, updates), opt), {"loss": rp.all_mean(loss)}

        def input_fn(ctx, sizes=sizes, batch=batch):
            r = np.random.default_rng(ctx.worker_id)
            rows = batch // ctx.num_workers
            while True:
                yield {
                    "x": r.normal(size=(rows, sizes[0])).astype(np.float32),
                    "y": r.normal(size=(rows, 1)).astype(np.float32),
                }

        state = (params, tx.init(params))
        results[name] = _time_steps(args, repl, step, input_fn, state, distributed)
    results["sum50"] = _time_steps(args, repl, *_sum50(rp, jnp, np), distributed)
    if info.worker_id == 0:
        print("RESULT " + json.dumps(results), flush=True)


def _sum50(rp, jnp, np):
    """50 state tensors of 1000 floats, each plus an all-sum of a per-replica scaling of it."""

    def step(state, b):
        k = jnp.mean(b["x"])
        return [s + 0.001 * rp.all_sum(s * k) for s in state], {"loss": rp.all_mean(k)}

    def input_fn(ctx):
        r = np.random.default_rng(ctx.worker_id)
        while True:
            yield {"x": r.normal(size=(8 // ctx.num_workers, 1)).astype(np.float32)}

    return step, input_fn, [np.ones(1000, np.float32) for _ in range(50)]


def _time_steps(args, repl, step, input_fn, state, distributed) -> float:
    """Median ms per step (the loss read back every step) after ``args.warmup`` steps."""
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, out = repl.run(step, input_fn, state)
        float(distributed.replica_invariant(out)["loss"])
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPLICATOR_", "SLURM_", "OMPI_"))}
    env.pop("XLA_FLAGS", None)
    return env


def _result(command: list[str]) -> dict[str, float]:
    proc = subprocess.run(command, env=_clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    match = re.search(r"RESULT (\{.*\})", proc.stdout)
    if proc.returncode or not match:
        raise RuntimeError(f"benchmark job failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(match.group(1))


def step_times(args: argparse.Namespace) -> None:
    me = [str(Path(__file__).resolve()), "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup)]
    launcher = [sys.executable, "-m", "replicator.launch"]
    multi = [*launcher, "--num-workers", "2", "--cores-per-worker", "4", *me]
    variants = {
        "1 proc x 8": [sys.executable, *me, "--workers", "1", "--cores", "8"],
        "1 proc 2x4": [sys.executable, *me, "--workers", "2", "--cores", "4"],
        "2 procs x 4": multi,
        "2 procs zero": [*multi, "--pipeline", json.dumps({"shard_optimizer": True})],
        "2 procs no-zero": [*multi, "--pipeline", json.dumps({"shard_optimizer": False})],
        "2 procs +hier": [*multi, "--pipeline", json.dumps({"hierarchical": True})],
        "2 procs -fuse": [*multi, "--pipeline", json.dumps({"disable": ["fuse-collectives"]})],
    }
    rounds: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(args.rounds):  # interleaved, so that machine noise hits every variant alike
        for name, command in variants.items():
            rounds[name].append(_result(command))
    print(f"median step time, ms ({args.steps} steps after {args.warmup} warm-up, median of {args.rounds} runs)")
    columns = [*WORKLOADS, "sum50"]
    print(f"{'variant':<20}" + "".join(f"{w:>10}" for w in columns))
    for name, runs in rounds.items():
        print(f"{name:<20}" + "".join(f"{statistics.median(r[w] for r in runs):>10.2f}" for w in columns))


def _job(options: list[str], train_args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    proc = subprocess.run(
        [sys.executable, "-m", "replicator.launch", *options, str(TRAIN), *train_args],
        env=_clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, time.time()


def _died(stdout: str) -> float:
    return float(re.search(r"dying at ([0-9.]+)", stdout).group(1))


def failure_times() -> None:
    from replicator.launch import free_port

    print("\nfailure detection (launcher defaults: --kill-grace 5, --heartbeat-timeout 10), seconds")
    with tempfile.TemporaryDirectory() as out:
        local = ["--num-workers", "2", "--cores-per-worker", "2"]
        dying = ["--out", out, "--steps", "100000", "--die-at-step", "5"]
        for how in ("kill", "raise", "stop"):
            proc, end = _job(local, [*dying, "--die-how", how])
            print(
                f"  worker 1 {how:<5} -> launcher exit: {end - _died(proc.stdout):6.2f}  (exit code {proc.returncode})"
            )
        start = time.time()
        proc, end = _job(
            ["--coordinator", f"127.0.0.1:{free_port()}", "--num-workers", "2", "--worker-id", "0"]
            + ["--start-timeout", "10"],
            ["--out", out],
        )
        print(
            f"  worker 1 never starts (start timeout 10) -> exit after: {end - start:6.2f}  (exit code {proc.returncode})"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--cores", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--failures", action="store_true", help="also measure failure detection times")
    p.add_argument("--pipeline", default="{}", help=argparse.SUPPRESS)  # JSON: PassManager.default options
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    step_times(args)
    if args.failures:
        failure_times()


if __name__ == "__main__":
    main()
