"""A small SGD job with one injected fault, for the fault matrix (``tests/test_faults.py``).

Run under ``python -m replicator.launch --num-workers 2 --cores-per-worker 2``.
``--fault KIND`` happens in worker ``--worker`` (default 1) at step ``--at``:

* ``none``: no fault; every worker trains ``--steps`` steps and prints its weights;
* ``sleep``: stuck in its own Python code (``time.sleep``) between steps;
* ``input``: stuck in ``input_fn`` (I/O that never returns);
* ``exit``: ``sys.exit(--code)``;
* ``leave``: leaves the training loop early and ends with code 0;
* ``before-init``: ends with code 0 before ``initialize()``;
* ``checkpoint``: stuck while writing the checkpoint of step ``--at`` (process 0: pass
  ``--worker 0``); ``--ckpt DIR`` saves after steps 2 and ``--at``;
* ``lr``: uses another learning rate (a constant that differs between workers);
* ``raise``: an uncaught exception.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
p.add_argument("--worker", type=int, default=1)
p.add_argument("--at", type=int, default=5)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--code", type=int, default=3)
p.add_argument("--ckpt")
args = p.parse_args()
me = int(os.environ.get("REPLICATOR_WORKER_ID", "0"))
faulty = me == args.worker


def fault_now() -> None:
    print(f"fault {args.fault} at {time.time():.6f} in worker {me}", flush=True)


if args.fault == "before-init" and faulty:
    fault_now()
    sys.exit(0)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import replicator as rp  # noqa: E402
from replicator.runtime import distributed  # noqa: E402

info = distributed.initialize()
repl = rp.Replicator(info.num_workers, info.cores_per_worker)
lr = 0.2 if args.fault == "lr" and faulty else 0.1


def input_fn(ctx):
    rng = np.random.default_rng(ctx.worker_id)
    for i in range(10**9):
        if args.fault == "input" and faulty and i == args.at:
            fault_now()
            time.sleep(10**6)
        yield {"x": rng.normal(size=(4 * ctx.cores_per_worker, 3)).astype(np.float32)}


def step_fn(w, batch):
    g = rp.all_mean(jnp.mean(batch["x"], axis=0) + w)
    return w - lr * g, {"g": g}


def stuck_writes() -> None:
    """From now on, writing a checkpoint's arrays never returns (a hung file system)."""
    from replicator.training.checkpoint import files

    def stuck(path, arrays):
        fault_now()
        time.sleep(10**6)

    files.write_arrays = stuck


w = jnp.zeros(3)
for step in range(args.steps):
    if faulty and step == args.at:
        if args.fault in ("sleep", "exit", "leave", "raise"):
            fault_now()
        if args.fault == "sleep":
            time.sleep(10**6)
        elif args.fault == "exit":
            sys.exit(args.code)
        elif args.fault == "leave":
            break
        elif args.fault == "raise":
            raise RuntimeError(f"injected failure in worker {me} at step {step}")
    w, out = repl.run(step_fn, input_fn, w)
    if args.ckpt and step in (2, args.at):  # the first save succeeds; with --fault checkpoint the second hangs
        if args.fault == "checkpoint" and faulty and step == args.at:
            stuck_writes()
        rp.save_checkpoint(args.ckpt, step, w)
print(f"worker {me} done: w = {np.asarray(w).round(6).tolist()}", flush=True)
