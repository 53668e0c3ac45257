"""ZeRO stages 0-3 against hand-written GSPMD: per-device memory and step time.

One process, N emulated CPU devices. The same one-device step (``step(state,
batch, mean)``) runs as:

* ``gspmd-replicated``: ``jax.jit`` with the state replicated and the batch
  sharded over the devices (``NamedSharding(mesh, P())`` / ``P('d')``);
* ``gspmd-fsdp``: the same with every state leaf whose leading axis divides by
  N sharded along it (``P('d')``): the hand-written fully sharded program;
* ``zero0`` .. ``zero3``: ``rp.Replicator(1, N)`` with
  ``Pipeline.default(zero_stage=k)``.

Memory per device is XLA's compiled memory analysis (arguments + outputs -
aliased + temporaries) of each program; state per device counts the bytes of
the state leaves one device holds. Step times are medians of interleaved rounds.
Correctness: after 3 steps each variant's state is compared with one-device
``jax.jit`` on the global batch.

Usage::

    python benchmarks/bench_zero_stages.py                      # the MLP, 8 devices
    python benchmarks/bench_zero_stages.py --rounds 5 --steps 5
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import replicator as rp  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=256, help="global batch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    return p.parse_args(argv)


ARGS = parse_args()
rp.force_cpu_devices(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from dense import dense_layers, regression_batches  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from timing import time_interleaved  # noqa: E402

from replicator.cost.memory import state_bytes_per_device  # noqa: E402

MiB = 2.0**20


def mlp(width: int, depth: int, batch: int):
    """An ``depth``-layer ``width x width`` tanh MLP with Adam (the issue's workload)."""
    rng = np.random.default_rng(0)
    params = dense_layers(rng, depth, width)
    tx = optax.adam(1e-3)
    batches = regression_batches(rng, 3, batch, width)

    def step(state, b, mean):
        params, opt = state

        def loss_fn(ps):
            h = b["x"]
            for p in ps:
                h = jnp.tanh(h @ p["w"] + p["b"])
            return jnp.mean((h - b["y"]) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt = tx.update(mean(g), opt, params)
        return (optax.apply_updates(params, upd), opt), mean(loss)

    return (params, tx.init(params)), batches, step


def leaf_bytes_per_device(tree) -> int:
    """Bytes of ``tree`` on one device (the first), from the arrays' own shards."""
    device = jax.devices()[0]
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.device == device)


def gspmd(state, batches, step, *, fsdp: bool):
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def spec(leaf) -> NamedSharding:
        shape = np.shape(leaf)
        split = fsdp and len(shape) >= 1 and shape[0] % n == 0
        return NamedSharding(mesh, P("d") if split else P())

    state_shardings = jax.tree.map(spec, state)
    batch_sharding = NamedSharding(mesh, P("d"))
    fn = jax.jit(
        lambda s, b: step(s, b, lambda x: x),
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, None),
    )
    placed = jax.device_put(state, state_shardings)
    batches = [jax.device_put(b, batch_sharding) for b in batches]
    memory = fn.lower(placed, batches[0]).compile().memory_analysis()
    box, i = [placed], [0]

    def run():
        box[0], loss = fn(box[0], batches[i[0] % len(batches)])
        i[0] += 1
        return loss

    return run, box, memory


def replicated(state, batches, step, *, stage: int):
    n = jax.device_count()
    repl = rp.Replicator(1, n, passes=rp.Pipeline.default(zero_stage=stage))

    def step_fn(s, b):
        s, loss = step(s, b, rp.all_mean)
        return s, {"loss": loss}

    def input_fn(ctx):
        i = 0
        while True:
            yield batches[i % len(batches)]
            i += 1

    lowered = repl.lower(step_fn, batches[0], state)
    usage = lowered.memory()
    box = [state]

    def run():
        box[0], out = repl.run(step_fn, input_fn, box[0])
        return out["loss"]

    return run, box, usage, state_bytes_per_device(lowered.final)


def peak(memory) -> int:
    return int(
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def main() -> None:
    state, batches, step = mlp(ARGS.width, ARGS.depth, ARGS.batch)
    whole = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))

    reference = state
    ref_step = jax.jit(lambda s, b: step(s, b, lambda x: x))
    for b in batches:
        reference, _ = ref_step(reference, b)

    runs: dict[str, Callable[[], object]] = {}
    boxes, peaks, stored = {}, {}, {}
    for fsdp in (False, True):
        name = "gspmd-fsdp" if fsdp else "gspmd-replicated"
        runs[name], boxes[name], memory = gspmd(state, batches, step, fsdp=fsdp)
        peaks[name] = peak(memory)
        stored[name] = leaf_bytes_per_device(boxes[name][0])
    for stage in (0, 1, 2, 3):
        name = f"zero{stage}"
        runs[name], boxes[name], usage, stored[name] = replicated(state, batches, step, stage=stage)
        peaks[name] = usage.peak

    # correctness first: 3 steps of each from the initial state against one-device jit
    errors = {}
    for name, run in runs.items():
        boxes[name][0] = (
            state
            if name.startswith("zero")
            else jax.device_put(state, jax.tree.map(lambda a: a.sharding, boxes[name][0]))
        )
        for _ in batches:
            run()
        errors[name] = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(boxes[name][0]), jax.tree.leaves(reference), strict=True)
        )

    times = time_interleaved(runs, ARGS.rounds, ARGS.steps)
    print(
        f"MLP {ARGS.depth} x {ARGS.width}x{ARGS.width} tanh, Adam, global batch {ARGS.batch}, "
        f"{jax.device_count()} devices; whole state {whole / MiB:.2f} MiB; "
        f"median of {ARGS.rounds} interleaved rounds of {ARGS.steps} steps"
    )
    print(
        "| variant | state per device | x whole state | peak per device | x replicated peak | ms per step "
        "| x gspmd-fsdp time | max diff vs one device after 3 steps |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in runs:
        print(
            f"| {name} | {stored[name] / MiB:.2f} MiB | {stored[name] / whole:.3f} | {peaks[name] / MiB:.2f} MiB "
            f"| {peaks[name] / peaks['gspmd-replicated']:.2f} | {times[name] * 1e3:.1f} "
            f"| {times[name] / times['gspmd-fsdp']:.2f} | {errors[name]:.1e} |"
        )


if __name__ == "__main__":
    main()
