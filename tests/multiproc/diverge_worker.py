"""A worker whose learning rate differs between workers unless --same: the step programs differ."""

import sys

import numpy as np

import replicator as rp
from replicator import distributed

info = distributed.initialize()

import jax.numpy as jnp  # noqa: E402

repl = rp.Replicator(info.num_workers, info.cores_per_worker)
lr = 0.1 if info.worker_id == 0 or "--same" in sys.argv else 0.2


def step(w, batch):
    return w - lr * rp.all_mean(jnp.mean(batch["x"], axis=0)), {}


rows = np.ones((info.cores_per_worker, 2), np.float32)
w, _ = repl.run(step, lambda ctx: iter([{"x": rows}] * 3), jnp.zeros(2))
print(f"worker {info.worker_id} ran: {np.asarray(w).tolist()}", flush=True)
