"""A resumable :class:`~replicator.Trainer` job that kills itself on schedule, for the restart tests.

Run under ``python -m replicator.launch --num-workers 2 --cores-per-worker 2
--max-restarts N`` by ``tests/test_restarts.py`` and ``benchmarks/fault_matrix.py``.
It trains ``train.py``'s model (a small MLP, Adam) on ``train.py``'s global batches
with a ``Trainer`` that saves a checkpoint every ``--every`` steps into ``--ckpt`` and
resumes from there (``resume_from=``), to ``--steps`` steps; then every worker writes
the final parameters to ``--out/w{w}_param_<name>.npy`` (numpy files, never pickles).

``--kill R:W:PHASE:STEP`` (repeatable) makes worker ``W`` of the job's start ``R``
(``REPLICATOR_RESTART_COUNT == R``) SIGKILL itself when it enters progress phase
``PHASE`` (see ``replicator.runtime.distributed.progress``) with ``STEP`` steps done:
``compiling`` (the first step of a start compiles), ``step``, ``input``, or
``checkpoint-write`` (while writing its part of the save of step ``STEP`` into the
save's temporary directory: a save under way). It prints ``killing myself at <time>``
first. ``--random-kills SEED`` adds three such kills, one in each of the starts 0, 1
and 2, drawn from ``SEED`` by :func:`random_kills`: during a checkpoint save, while the
restarted job compiles, and in a step, worker 0 (the coordinator's host) at least
once. ``--bad-worker W:STEP`` makes worker ``W`` SIGKILL itself in every start of
the job, in the step after ``STEP`` steps: a worker that keeps failing, for
``--min-workers`` (once the job runs on ``W`` workers or fewer there is no worker
``W``). ``--print-steps`` prints ``step K`` after every step (for a killer outside).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import train as model  # noqa: E402

import replicator as rp  # noqa: E402
from replicator.runtime import distributed  # noqa: E402
from replicator.runtime.distributed import progress  # noqa: E402


def parse_kill(text: str) -> tuple[int, int, str, int]:
    start, worker, phase, step = text.split(":")
    if phase not in progress.PHASES:
        raise argparse.ArgumentTypeError(f"unknown phase {phase!r}; one of {sorted(progress.PHASES)}")
    return int(start), int(worker), phase, int(step)


def random_kills(seed: int, steps: int, every: int, workers: int = 2) -> list[tuple[int, int, str, int]]:
    """Three kills ``(start, worker, phase, steps done)`` drawn from ``seed``, one per start.

    Start 0 dies while saving the checkpoint of step ``S`` (a save with an
    older checkpoint before it, when there is one), so start 1 resumes from
    ``S - every``; start 1 dies while compiling its first step; start 2 dies in
    a step after it, at a random step before the last. Worker 0 is among the
    victims at least once.
    """
    rng = random.Random(seed)
    saves = list(range(every, steps, every))
    if not saves:
        raise ValueError(f"--random-kills needs a checkpoint before the last step: --every {every} >= --steps {steps}")
    saved = rng.choice(saves[1:] or saves)
    resumed = saved - every
    victims = [rng.randrange(workers) for _ in range(3)]
    if 0 not in victims:
        victims[rng.randrange(3)] = 0
    in_step = rng.randrange(resumed + 1, steps)
    return [
        (0, victims[0], "checkpoint-write", saved),
        (1, victims[1], "compiling", resumed),
        (2, victims[2], "step", in_step),
    ]


def kill_on(phase: str, step: int, trainer: rp.Trainer) -> None:
    """SIGKILL this process when it enters ``phase`` with ``step`` steps done (a wrapper of progress.set_phase)."""
    set_phase = progress.set_phase

    def watching(name: str, *args, **kwargs) -> None:
        detail = kwargs.get("detail", args[1] if len(args) > 1 else "")
        saving = name != "checkpoint-write" or "/.tmp-" in detail  # writing into the save's temporary directory
        if name == phase and trainer.step == step and saving:
            print(f"killing myself at {time.time():.6f} in {phase} after {step} steps ({detail})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        set_phase(name, *args, **kwargs)

    progress.set_phase = watching  # progress.phase() calls it through the module too


class PrintSteps(rp.Hook):
    def after_step(self, trainer: rp.Trainer) -> None:
        print(f"step {trainer.step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--kill", type=parse_kill, action="append", default=[], metavar="R:W:PHASE:STEP")
    p.add_argument("--random-kills", type=int, metavar="SEED", help="three kills drawn from SEED (random_kills)")
    p.add_argument("--bad-worker", metavar="W:STEP", help="worker W dies in the step after STEP in every start")
    p.add_argument("--print-steps", action="store_true")
    args = p.parse_args()

    info = distributed.initialize()
    start = distributed.restart_count()
    repl = rp.Replicator(num_workers=info.num_workers, cores_per_worker=info.cores_per_worker)
    params = model.init_params()
    hooks = [rp.CheckpointHook(args.ckpt, every=args.every)] + ([PrintSteps()] if args.print_steps else [])
    trainer = rp.Trainer(
        repl, model.train_step, model.input_fn_for(0), (params, model.tx.init(params)), hooks=hooks,
        resume_from=args.ckpt,
    )  # fmt: skip
    kills = args.kill + ([] if args.random_kills is None else random_kills(args.random_kills, args.steps, args.every))
    workers = f"{info.num_workers} of {distributed.initial_num_workers()} workers"
    print(f"worker {info.worker_id}: start {start}, {workers}, from step {trainer.step}", flush=True)
    if start == info.worker_id == 0 and kills:
        print(f"kills (start, worker, phase, steps done): {kills}", flush=True)
    if args.bad_worker:
        bad, step = map(int, args.bad_worker.split(":"))
        kills.append((start, bad, "step", step))
    for r, w, phase, step in kills:
        if (r, w) == (start, info.worker_id):
            kill_on(phase, step, trainer)
    trainer.run(args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, value in trainer.state[0].items():
        np.save(args.out / f"w{info.worker_id}_param_{name}.npy", np.asarray(value), allow_pickle=False)
    print(f"worker {info.worker_id} done: {trainer.step} steps", flush=True)


if __name__ == "__main__":
    main()
