"""One worker of a 2-process job giving ``run`` its batch directly, with one typed PRNG key per replica.

Run by ``tests/test_porting_inputs.py`` (``python -m replicator.launch --num-workers 2
--cores-per-worker 4 tests/multiproc/keys_worker.py --out DIR``). Each process gives ``run``
its own rows of :func:`global_batch` and the keys of its own replicas, once as a batch and
once from an iterator of batches, and writes its replicas' outputs (``rp.local_outputs``) to
``DIR/w{w}_{name}.npy`` (numpy files, never pickles).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import replicator as rp  # noqa: E402
from replicator.runtime import distributed  # noqa: E402

ROWS_PER_REPLICA = 3


def global_batch(replicas: int, step: int) -> dict:
    """Every replica's rows and its key, for the whole job (each process gives its share)."""
    x = np.random.default_rng(step).normal(size=(ROWS_PER_REPLICA * replicas, 2)).astype(np.float32)
    return {"x": x, "key": jax.random.split(jax.random.key(100 + step), replicas)}


def step_fn(count, batch):
    noise = jax.random.normal(batch["key"][0], (2,))
    return count + 1, {"y": jnp.mean(batch["x"], axis=0) + noise, "total": rp.all_sum(jnp.sum(batch["x"]))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    info = distributed.initialize()
    repl = rp.Replicator(num_workers=info.num_workers, cores_per_worker=info.cores_per_worker)
    n, c, w = repl.num_replicas, repl.cores_per_worker, info.worker_id

    def mine(step: int) -> dict:
        batch = global_batch(n, step)
        return {
            "x": batch["x"][ROWS_PER_REPLICA * c * w : ROWS_PER_REPLICA * c * (w + 1)],
            "key": batch["key"][c * w : c * (w + 1)],
        }

    count, out0 = repl.run(step_fn, mine(0), jnp.int32(0))
    batches = iter([mine(1), mine(2)])
    for _ in range(2):
        count, out = repl.run(step_fn, batches, count)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, value in {
        "y0": rp.local_outputs(out0)["y"],
        "total0": rp.local_outputs(out0)["total"],
        "y2": rp.local_outputs(out)["y"],
        "count": np.asarray(count.addressable_data(0)),
    }.items():
        np.save(args.out / f"w{w}_{name}.npy", np.asarray(value), allow_pickle=False)
    print("done", flush=True)


if __name__ == "__main__":
    main()
