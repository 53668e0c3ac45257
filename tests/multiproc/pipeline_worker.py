"""A 2-process pipelined job, run by ``tests/test_distributed.py``.

Run as one worker of a job (``python -m replicator.launch --num-workers 2 --cores-per-worker C
tests/multiproc/pipeline_worker.py --stages S --out DIR``): an MLP of four ``tanh`` layers and a head,
cut into ``S`` stages by ``rp.stage_boundary``, trained with Adam by ``Replicator.run_pipelined`` on the
same global batch in every process. With one core per worker and 2 stages, each process holds one stage;
with 2 cores per worker and 2 stages, each process holds a whole pipeline, a data-parallel replica of the
other. With ``--input-fn`` each worker's ``input_fn`` yields its rows of the global batch. With ``--host-state`` each step gets a numpy copy of the state the last one returned (what a
checkpoint restores), so every step unpacks and packs the state across the processes. With ``--own-step`` the
job runs the data-parallel step itself (``repl.run(step_fn, batch, state)``: ``value_and_grad``,
``rp.all_mean``, the Adam update, cut from it), and with ``--zero K`` under ZeRO-K
(``passes=rp.PassManager.default(zero=K)``); with ``--tensor T`` (the user's step) each stage's layers
are split over ``T`` devices of a process (``w0`` and ``w2`` by columns, ``w1`` and ``w3`` by rows). :func:`reference` trains the same model with one-device ``jax.jit`` on the global batch.

Each worker ``w`` writes ``DIR/w{w}_{name}.npy`` (numpy files, never pickles): the losses and the final
parameters, read whole with ``rp.gather_outputs`` (``final_<i>``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import replicator as rp  # noqa: E402
from replicator.runtime import distributed  # noqa: E402

GLOBAL_BATCH, WIDTH, LAYERS, STEPS, MICROBATCHES = 16, 8, 4, 3, 2
tx = optax.adam(1e-2)


def init_params() -> dict:
    rng = np.random.default_rng(0)  # the same on every worker
    p = {f"w{i}": (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32) for i in range(LAYERS)}
    p["head"] = (rng.normal(size=(WIDTH, 2)) / np.sqrt(WIDTH)).astype(np.float32)
    return p


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3000 + step)
    return rng.normal(size=(GLOBAL_BATCH, WIDTH)).astype(np.float32), rng.normal(size=(GLOBAL_BATCH, 2)).astype(
        np.float32
    )


def loss_in(stages: int):
    """The loss with a boundary before every ``LAYERS / stages``-th layer (none for one stage)."""

    def loss(p, x, y):
        h = x
        for i in range(LAYERS):
            if i and stages > 1 and i % (LAYERS // stages) == 0:
                h = rp.stage_boundary(h)
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean((h @ p["head"] - y) ** 2)

    return loss


def reference() -> tuple[list[np.ndarray], np.ndarray]:
    """The final parameters' leaves and the losses of one-device ``jax.jit`` on the global batch."""

    @jax.jit
    def step(p, s, x, y):
        value, grads = jax.value_and_grad(loss_in(1))(p, x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    p, s, losses = init_params(), tx.init(init_params()), []
    for k in range(STEPS):
        p, s, value = step(p, s, *global_batch(k))
        losses.append(float(value))
    return [np.asarray(x) for x in jax.tree.leaves(p)], np.asarray(losses)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stages", type=int, required=True)
    p.add_argument(
        "--input-fn",
        action="store_true",
        help="give run_pipelined an input_fn (each worker yields its rows of the global batch) instead of the batch",
    )
    p.add_argument(
        "--host-state",
        action="store_true",
        help="give each step a host copy of the state the last returned (numpy), not the arrays themselves: "
        "every step reads the returned leaves and packs them again",
    )
    p.add_argument("--own-step", action="store_true", help="repl.run of the data-parallel step, not run_pipelined")
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage on each stage's data-parallel replicas")
    p.add_argument("--tensor", type=int, default=1, help="T: each stage's layers split over T devices (own step)")
    args = p.parse_args(argv)

    info = distributed.initialize()
    tensor = {}
    if args.tensor > 1:  # Megatron's pairs: a column-split layer, then a row-split one (within each stage)
        args.own_step = True
        plan = {f"0/w{i}": "column" if i % 2 == 0 else "row" for i in range(LAYERS)}
        tensor = {"tensor": args.tensor, "tensor_plan": plan}
    repl = rp.Replicator(
        info.num_workers,
        info.cores_per_worker,
        parallelism=rp.Parallelism(stages=args.stages, microbatches=MICROBATCHES, **tensor),
        passes=rp.PassManager.default(zero=args.zero) if args.zero else None,
        check_state_every=1,  # each stage's copies compared after every step, across the processes too
    )
    loss = loss_in(args.stages)

    def step_fn(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = tx.update(rp.all_mean(grads), opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": rp.all_mean(value)}

    params = init_params()
    state, losses = (params, tx.init(params)), []

    def input_fn(ctx: rp.InputContext):
        rows = GLOBAL_BATCH // ctx.num_workers
        for k in range(STEPS):
            yield tuple(a[ctx.worker_id * rows : (ctx.worker_id + 1) * rows] for a in global_batch(k))

    for k in range(STEPS):
        batch = input_fn if args.input_fn else global_batch(k)
        if args.own_step:
            state, out = repl.run(step_fn, batch, state)
            # Every data replica's row, read whole (with one replica, its row lives on every device of the
            # mesh, which replica_invariant takes for a state leaf and returns with its axis).
            value = np.asarray(distributed.gather_outputs(out)["loss"])[0]
        else:
            state, value = repl.run_pipelined(loss, tx, batch, state)
        if args.host_state:
            state = jax.tree.map(np.asarray, state)
        losses.append(float(value))  # the loss: the same on every device
    whole = jax.tree.leaves(distributed.gather_outputs(state[0]))
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"losses": np.asarray(losses), **{f"final_{i}": x for i, x in enumerate(whole)}}
    for name, value in results.items():
        np.save(args.out / f"w{info.worker_id}_{name}.npy", np.asarray(value), allow_pickle=False)


if __name__ == "__main__":
    main()
