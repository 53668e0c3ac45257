"""A 2-process job that restores a checkpoint onto a layout split over both processes and saves one sharded.

Run by ``tests/test_checkpoint_sharded.py`` as one worker of a job
(``python -m replicator.launch --num-workers 2 --cores-per-worker 4
tests/multiproc/checkpoint_worker.py --resume A --save-at K --ckpt B --steps N
--out DIR``), with the model of ``train.py`` and ZeRO-1 on every tensor:

1. restores the newest checkpoint in ``A`` onto a target whose leaves that
   split over the replicas are split over every device of both processes
   (the rest replicated), counting the shard records this process reads;
2. trains from its step to ``K`` and saves into ``B`` (every process writes
   its own shards), then trains to ``N``.

``--fail-write-worker W`` makes worker ``W``'s writing of its shards fail
halfway (an ``OSError``), to check that the save then fails on every worker
and leaves nothing behind. ``--async-save`` saves with
``CheckpointManager.save_async``, trains on while it is written, and waits
for it (a collective) after the last step.

Each worker ``w`` writes ``DIR/w{w}_{name}.npy`` (numpy files, never
pickles): the restored state and the final state read whole with
``rp.gather_outputs`` (``restored_<i>``, ``final_<i>``), the losses, and
``reads``: the records it read, as rows ``(leaf, start of axis 0, stop)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import train as model  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import replicator as rp  # noqa: E402
from replicator.runtime import distributed  # noqa: E402
from replicator.training.checkpoint import shards  # noqa: E402


def target_for(repl: rp.Replicator, state) -> object:
    """The state's shapes, split along axis 0 over every replica where that divides, else replicated."""
    split = NamedSharding(repl.mesh, P(("workers", "cores")))
    whole = NamedSharding(repl.mesh, P())

    def one(x):
        x = np.asarray(x)
        sharding = split if x.ndim and x.shape[0] % repl.mesh.devices.size == 0 else whole
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, state)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--resume", type=Path, required=True)
    p.add_argument("--save-at", type=int, required=True)
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--fail-write-worker", type=int, help="this worker's shard writing fails (an OSError)")
    p.add_argument("--async-save", action="store_true", help="save in the background, wait after the last step")
    args = p.parse_args(argv)

    info = distributed.initialize()
    if args.fail_write_worker == info.worker_id:

        def half_then_fail(directory, *rest, **kwargs):
            with open(os.path.join(directory, shards.shard_file(info.worker_id)), "xb") as f:
                f.write(b"\0" * 10)
            raise OSError("injected: disk full")

        shards.write_own = half_then_fail
    passes = rp.PassManager.default(shard_optimizer=True, shard_optimizer_min_bytes=0)
    repl = rp.Replicator(num_workers=info.num_workers, cores_per_worker=info.cores_per_worker, passes=passes)
    params = model.init_params()
    state = (params, model.tx.init(params))

    reads: list[tuple[str, int, int]] = []
    real_record = shards.LeafReader._record

    def counting(self, k):
        if k not in self._data:
            bounds, _ = self._records[k]
            reads.append((self.entry["path"], *bounds[0]))
        return real_record(self, k)

    shards.LeafReader._record = counting
    first, state, extra = rp.restore_checkpoint(args.resume, target_for(repl, state))
    shards.LeafReader._record = real_record
    spanning = sum(not x.is_fully_addressable and not x.is_fully_replicated for x in jax.tree.leaves(state))
    print(f"restored step {first} of {args.resume} ({spanning} leaves split over both processes)", flush=True)
    # The test reads these facts from files: stdout lines may interleave with Gloo's own output.
    results = {"restored_step": np.asarray(first), "restored_spanning": np.asarray(spanning)}
    results |= {f"restored_{i}": x for i, x in enumerate(jax.tree.leaves(distributed.gather_outputs(state)))}
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    results["reads"] = np.array([(paths.index(path), a, b) for path, a, b in reads], np.int64).reshape(-1, 3)

    losses = []
    input_fn = model.input_fn_for(first)
    manager = rp.CheckpointManager(args.ckpt)
    saved = ""
    for step in range(first, args.steps):
        state, out = repl.run(model.train_step, input_fn, state)
        losses.append(distributed.replica_invariant(out)["loss"])
        if step + 1 == args.save_at:
            split = model.sharded_over_processes(state)
            results["saved_split"] = np.asarray(split)
            saved = f"saved step {args.save_at} to {{}} ({split} leaves split over processes)"
            if args.async_save:
                path = manager.save_async(args.save_at, state, extra={"input_position": args.save_at})
                print(f"saving step {args.save_at} in the background", flush=True)
            else:
                path = manager.save(args.save_at, state, extra={"input_position": args.save_at})
                assert os.path.isdir(path), path  # committed before save returns, on every worker
                print(saved.format(path), flush=True)
    if args.async_save:
        manager.wait()  # a collective: committed on every worker when it returns, or raised on every worker
        assert os.path.isdir(path), path
        print(saved.format(path), flush=True)
    for i, x in enumerate(jax.tree.leaves(distributed.gather_outputs(state))):
        results[f"final_{i}"] = x
    results["losses"] = np.asarray(losses)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, value in results.items():
        np.save(args.out / f"w{info.worker_id}_{name}.npy", np.asarray(value), allow_pickle=False)
    print("done", flush=True)


if __name__ == "__main__":
    main()
