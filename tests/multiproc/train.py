"""A small data-parallel training job, run by the multi-process tests.

Run as one worker of a job (``python -m replicator.launch --num-workers 2
--cores-per-worker 4 tests/multiproc/train.py --out DIR``) or as a single
process (``python tests/multiproc/train.py --workers 2 --cores 4 --out DIR``);
:func:`run` is also imported by the tests to compute references in-process.

Each worker ``w`` writes its results to ``DIR/w{w}_{name}.npy`` (numpy files,
never pickles): the trained parameters, the loss per step, and the outputs of
a probe step that calls collectives over every group. ``--die-at-step K
--die-worker I --die-how kill|stop|raise`` makes worker ``I`` SIGKILL or SIGSTOP
itself, or raise, at step ``K``, printing ``dying at <unix time>`` first.

Checkpoints: ``--resume CKPT`` restores the newest checkpoint in ``CKPT`` (state
and step) and trains from there to ``--steps``; ``--save-at K --ckpt CKPT``
saves a checkpoint of the state after ``K`` steps into ``CKPT`` (every worker
calls save; worker 0 writes) and goes on to ``--steps``. The losses are those of
the steps this run trained.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import replicator as rp  # noqa: E402
from replicator.runtime import distributed  # noqa: E402

GLOBAL_BATCH = 64
PROBE_STEP = 10_000  # the probe step reads global_batch(PROBE_STEP)
SIZES = (4, 16, 16, 1)


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)  # the same on every worker
    params = {}
    for i, (m, n) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        params[f"w{i}"] = (rng.normal(size=(m, n)) / np.sqrt(m)).astype(np.float32)
        params[f"b{i}"] = np.zeros(n, np.float32)
    return params


def global_batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.normal(size=(GLOBAL_BATCH, SIZES[0])).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    return {"x": x, "y": y}


def input_fn_for(first_step: int, extra_rows_worker: int | None = None):
    def input_fn(ctx: rp.InputContext):
        rows = GLOBAL_BATCH // ctx.num_workers
        step = first_step
        while True:
            batch = global_batch(step)
            batch = {k: v[ctx.worker_id * rows : (ctx.worker_id + 1) * rows] for k, v in batch.items()}
            if ctx.worker_id == extra_rows_worker:  # a bug: this worker's batches are larger
                batch = {k: np.concatenate([v, v[: ctx.cores_per_worker]]) for k, v in batch.items()}
            yield batch
            step += 1

    return input_fn


def loss_fn(params: dict, batch: dict) -> jax.Array:
    h = batch["x"]
    n = len(SIZES) - 1
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = jnp.tanh(h)
    return jnp.mean((h - batch["y"]) ** 2)


tx = optax.adam(1e-2)


def train_step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    grads = rp.all_mean(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": rp.all_mean(loss)}


def one_device_reference(steps: int) -> dict[str, np.ndarray]:
    """This training with plain ``jax.jit`` on one device, on the whole global batch: the parameters after
    ``steps`` steps (the reference of the restart and fault-matrix runs)."""

    @jax.jit
    def step(state, batch):
        params, opt_state = state
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = jax.tree.map(jnp.asarray, init_params())
    state = (params, tx.init(params))
    for k in range(steps):
        state = step(state, global_batch(k))
    return {k: np.asarray(v) for k, v in state[0].items()}


def probe_step(batch):
    """Collectives over every group, on integer replica ids and float data."""
    rid = rp.replica_id()
    s = batch["x"].sum()
    return {
        "rid": rid,
        "rid_cores": rp.replica_id(group="cores"),
        "rid_workers": rp.replica_id(group="workers"),
        "sum_all": rp.all_sum(rid),
        "sum_cores": rp.all_sum(rid, group="cores"),
        "sum_workers": rp.all_sum(rid, group="workers"),
        "max_cores": rp.all_max(rid, group="cores"),
        "min_workers": rp.all_min(rid, group="workers"),
        "gather_all": rp.all_gather(rid),
        "gather_cores": rp.all_gather(rid, group="cores"),
        "gather_workers": rp.all_gather(rid, group="workers"),
        "bcast_workers": rp.broadcast(rid * 10, source=rp.num_replicas(group="workers") - 1, group="workers"),
        "mean_all": rp.all_mean(s),
        "mean_cores": rp.all_mean(s, group="cores"),
        "mean_workers": rp.all_mean(s, group="workers"),
    }


def sharded_over_processes(state) -> int:
    """How many leaves of ``state`` no single process holds whole (ZeRO-1's optimizer state)."""
    return sum(
        isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated
        for x in jax.tree.leaves(state)
    )


def run(
    repl: rp.Replicator,
    steps: int,
    *,
    die_at=None,
    die_worker=1,
    die_how="kill",
    sleep=0.0,
    mismatch=None,
    save_at=None,
    ckpt=None,
    resume=None,
):
    """Train up to step ``steps`` and probe the collectives; return this worker's results.

    ``mismatch='state'`` gives worker 1 different initial parameters (worker
    0's are used: rank-0 semantics); ``'batch'`` gives it larger batches than
    the others (a bug that must be reported).
    ``resume=DIR`` starts from the newest checkpoint in ``DIR``;
    ``save_at=K, ckpt=DIR`` saves one after step ``K``.
    """
    me = repl.local_workers[0]
    params = init_params()
    if mismatch == "state" and me == 1:
        params["b1"] = params["b1"] + 1.0
    state = (params, tx.init(params))
    first = 0
    if resume is not None:  # host arrays (numpy): Replicator.run places worker 0's copy on every worker
        first, state, extra = rp.restore_checkpoint(resume, state)
        assert extra == {"input_position": first}, extra
        print(f"resumed from step {first} of {resume}", flush=True)
    losses = []
    input_fn = input_fn_for(first, extra_rows_worker=1 if mismatch == "batch" else None)
    for step in range(first, steps):
        if step == die_at and me == die_worker:
            print(f"dying at {time.time():.6f} (worker {me}, step {step}, {die_how})", flush=True)
            if die_how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if die_how == "stop":  # frozen, as on a host that hangs: no exit, no closed sockets
                os.kill(os.getpid(), signal.SIGSTOP)
            raise RuntimeError(f"injected failure in worker {me} at step {step}")
        state, out = repl.run(train_step, input_fn, state)
        losses.append(distributed.replica_invariant(out)["loss"])
        if step % 10 == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
        if sleep:
            time.sleep(sleep)
        if save_at is not None and step + 1 == save_at:
            split = sharded_over_processes(state)
            path = rp.save_checkpoint(ckpt, save_at, state, extra={"input_position": save_at})
            assert os.path.isdir(path), path  # committed before save returns, on every worker
            print(f"saved step {save_at} to {path} ({split} leaves sharded over processes)", flush=True)
    results = {f"param_{k}": np.asarray(v) for k, v in state[0].items()}
    results["losses"] = np.asarray(losses)
    # Optimizer state that ZeRO-1 shards over processes: np.asarray cannot read it on one
    # process; gather_outputs (a collective) gives every process the whole value.
    for i, leaf in enumerate(jax.tree.leaves(distributed.gather_outputs(state[1]))):
        results[f"opt_{i}"] = leaf
    probe = repl.run(probe_step, input_fn_for(PROBE_STEP))
    for k, v in distributed.gather_outputs(probe).items():
        results[f"probe_{k}"] = v
    results["local_rid"] = distributed.local_outputs(probe)["rid"]
    results["invariant_sum_all"] = np.asarray(distributed.replica_invariant({"sum_all": probe["sum_all"]})["sum_all"])
    try:  # the replica ids differ between this worker's replicas: an error that names them
        distributed.replica_invariant({"rid": probe["rid"]})
        results["varying_error"] = np.array("")
    except ValueError as e:
        results["varying_error"] = np.array(str(e))
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", type=int, default=1, help="single-process mode only")
    p.add_argument("--cores", type=int, default=8, help="single-process mode only")
    p.add_argument("--die-at-step", type=int)
    p.add_argument("--die-worker", type=int, default=1)
    p.add_argument("--die-how", choices=["kill", "stop", "raise"], default="kill")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--mismatch", choices=["state", "batch"], help="give worker 1 other state or batch sizes")
    p.add_argument("--resume", type=Path, help="restore the newest checkpoint in this directory first")
    p.add_argument("--save-at", type=int, help="save a checkpoint after this many steps (into --ckpt)")
    p.add_argument("--ckpt", type=Path, help="the directory --save-at saves into")
    p.add_argument("--zero", action="store_true", help="shard-optimizer-update on every tensor (ZeRO-1)")
    p.add_argument(
        "--replicas-per-device", type=int, default=1, help="fold this many replicas onto each device (more cores)"
    )
    args = p.parse_args(argv)
    if args.save_at is not None and args.ckpt is None:
        p.error("--save-at needs --ckpt DIR")

    info = distributed.initialize()
    fold = args.replicas_per_device
    if info.is_multiprocess:
        workers, cores = info.num_workers, info.cores_per_worker * fold
    else:
        workers, cores = args.workers, args.cores
        rp.force_cpu_devices(workers * cores // fold)
    passes = rp.PassManager.default(shard_optimizer=True, shard_optimizer_min_bytes=0) if args.zero else None
    repl = rp.Replicator(
        num_workers=workers, cores_per_worker=cores, passes=passes, parallelism=rp.Parallelism(replicas_per_device=fold)
    )
    print(f"worker {info.worker_id} of {info.num_workers}: mesh {dict(repl.mesh.shape)}", flush=True)
    results = run(
        repl,
        args.steps,
        die_at=args.die_at_step,
        die_worker=args.die_worker,
        die_how=args.die_how,
        sleep=args.sleep,
        mismatch=args.mismatch,
        save_at=args.save_at,
        ckpt=args.ckpt,
        resume=args.resume,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    for name, value in results.items():
        np.save(args.out / f"w{info.worker_id}_{name}.npy", value, allow_pickle=False)
    print("done", flush=True)


if __name__ == "__main__":
    main()
