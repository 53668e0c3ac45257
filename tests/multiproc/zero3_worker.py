"""A 2-process job under ZeRO stage 3, run by ``tests/test_distributed.py``.

Run as one worker of a job (``python -m replicator.launch --num-workers 2
--cores-per-worker 4 tests/multiproc/zero3_worker.py --out DIR``). The model
has a dense layer whose leading axis does not divide by the replicas (stored
split along its second axis), a stack of layers run by ``lax.scan`` and an
output layer; every leaf is stored split over the devices of both processes
(``shard_optimizer_min_bytes=0``). :func:`reference` trains the same model
with one-device ``jax.jit`` on the global batch, for the test to compare.

Each worker ``w`` writes ``DIR/w{w}_{name}.npy`` (numpy files, never pickles):
the final state read whole with ``rp.gather_outputs`` (``final_<i>``), the
losses, and ``split``: how many state leaves no single process held whole.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import train as model  # noqa: E402

import replicator as rp  # noqa: E402
from replicator.runtime import distributed  # noqa: E402

GLOBAL_BATCH, FEATURES, WIDTH, LAYERS, STEPS = 32, 4, 16, 4, 3
tx = optax.adam(1e-2)


def init_state() -> tuple:
    rng = np.random.default_rng(0)  # the same on every worker
    params = {
        "w_in": (rng.normal(size=(FEATURES, WIDTH)) / 2).astype(np.float32),
        "stack": (rng.normal(size=(LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
        "stack_b": np.zeros((LAYERS, WIDTH), np.float32),
        "w_out": (rng.normal(size=(WIDTH, 1)) / np.sqrt(WIDTH)).astype(np.float32),
    }
    return params, tx.init(params)


def global_batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2000 + step)
    x = rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)}


def loss_fn(params: dict, batch: dict) -> jax.Array:
    def layer(h, wb):
        w, b = wb
        return jnp.tanh(h @ w + b), None

    h, _ = jax.lax.scan(layer, jnp.tanh(batch["x"] @ params["w_in"]), (params["stack"], params["stack_b"]))
    return jnp.mean((h @ params["w_out"] - batch["y"]) ** 2)


def make_step(average):
    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(average(grads), opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": average(loss)}

    return step


def reference() -> tuple[list[np.ndarray], np.ndarray]:
    """The final state's leaves and the losses of one-device ``jax.jit`` on the global batch."""
    step = jax.jit(make_step(lambda x: x))
    state, losses = init_state(), []
    for k in range(STEPS):
        state, out = step(state, global_batch(k))
        losses.append(float(out["loss"]))
    return [np.asarray(x) for x in jax.tree.leaves(state)], np.asarray(losses)


def save(out: Path, worker: int, results: dict) -> None:
    """``out/w{worker}_{name}.npy`` for each result (no pickles)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, value in results.items():
        np.save(out / f"w{worker}_{name}.npy", np.asarray(value), allow_pickle=False)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    info = distributed.initialize()
    passes = rp.PassManager.default(zero=3, shard_optimizer_min_bytes=0)
    repl = rp.Replicator(num_workers=info.num_workers, cores_per_worker=info.cores_per_worker, passes=passes)

    def input_fn(ctx: rp.InputContext):
        rows = GLOBAL_BATCH // ctx.num_workers
        for k in range(STEPS):
            yield {name: v[ctx.worker_id * rows : (ctx.worker_id + 1) * rows] for name, v in global_batch(k).items()}

    step, state, losses = make_step(rp.all_mean), init_state(), []
    for _ in range(STEPS):  # each run draws the next batch of input_fn's iterator
        state, out = repl.run(step, input_fn, state)
        losses.append(distributed.replica_invariant(out)["loss"])
    whole = jax.tree.leaves(distributed.gather_outputs(state))
    results = {"losses": np.asarray(losses), "split": np.asarray(model.sharded_over_processes(state))}
    results.update((f"final_{i}", x) for i, x in enumerate(whole))
    save(args.out, info.worker_id, results)


if __name__ == "__main__":
    main()
