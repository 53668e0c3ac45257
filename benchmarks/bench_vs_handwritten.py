"""Replicator against every way of writing a data-parallel step by hand, in one table.

One process, N emulated CPU devices, a host batch transferred every step, at
most 2 steps in flight for every variant (as ``Replicator`` does on CPU).
Variants of each workload, built in this order and then timed interleaved round
by round (``benchmarks/timing.py``):

* ``single``      ``jax.jit`` on one device, on the global batch (the floor);
* ``shard_map``   hand-written ``jit(shard_map)`` with ``lax.pmean``;
* ``gspmd``       ``jit`` with the batch sharded over the devices, state replicated;
* ``pmap``        ``jax.pmap`` with ``lax.pmean``, the state replicated per device;
* ``replicator``  ``Replicator(1, N)`` with the default pipeline.

Workloads: ``trivial`` (one mean of the batch, averaged over replicas: nothing
but overhead), ``mlp64x32`` and ``mlp16x128`` (the MLPs of
``benchmarks/bench_step.py``, Adam, global batch ``--batch``), ``resnet``
(Flax's ImageNet ResNet and ``train_step`` as written for ``pmap``, from
``examples/flax_imagenet_pmap.py``: ``nn.BatchNorm(axis_name='batch')``, SGD
with momentum; ``single`` is its ``shard_map`` on a one-device mesh, there is
no GSPMD variant of a step written with axis names) and ``fold`` (the 8
replicas of ``mlp64x32`` on 2 devices, ``replicas_per_device=4``, against one
device and hand-written ``vmap`` inside ``shard_map``: ``bench_step.py``'s
fold variants).

Printed: one markdown table, each workload's median step (ms) per variant over
``--rounds`` rounds of ``--steps`` steps, replicator's ratio to the best
hand-written program on the same devices and to ``single``, each variant's
first call (building it, placing its state, tracing, compiling and running one
step, in seconds) and replicator's over ``shard_map``'s. The first calls are measured in this one process, one
variant after another: later variants find JAX's own caches warm (the jitted
``jnp`` helpers), so they are lower than in a fresh process;
``benchmarks/first_call.py`` measures cold processes.

Usage::

    python benchmarks/bench_vs_handwritten.py                    # every workload, 8 devices
    python benchmarks/bench_vs_handwritten.py --workloads mlp64x32,fold --rounds 9
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

WORKLOADS = ("trivial", "mlp64x32", "mlp16x128", "resnet", "fold")
HAND = ("shard_map", "gspmd", "pmap")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices (replicas)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    p.add_argument("--steps", type=int, default=10, help="steps timed per variant per round")
    p.add_argument("--batch", type=int, default=512, help="global batch of the MLPs and the trivial step")
    p.add_argument("--resnet-batch", type=int, default=128, help="global batch of the ResNet (8 x 8 images)")
    return p.parse_args(argv)


ARGS = parse_args()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.argv, _argv = [sys.argv[0], "--devices", str(ARGS.devices)], sys.argv  # bench_step parses its flags at import
import bench_step as bench  # noqa: E402

sys.argv = _argv

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from timing import block, interleaved_samples  # noqa: E402

import replicator as rp  # noqa: E402

Runner = Callable[[], object]
Factory = Callable[[], Runner]  # builds a variant (places its state); its first call compiles


# -- pmap and the trivial step -------------------------------------------------------------


def pmap_runner(per_replica: Callable, state: tuple, batches: Any, n: int, axis_name: str = "d") -> Runner:
    """``jax.pmap(per_replica)`` over ``n`` devices: ``per_replica(*state, batch) -> (*state, out)``,
    the state replicated per device (one stacked copy each) and the host batch split into ``n`` rows."""
    step = jax.pmap(per_replica, axis_name=axis_name, devices=jax.devices()[:n])
    holder = [jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (n, *np.shape(a))), state)]

    def run() -> object:
        split = jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), next(batches))
        *new_state, out = step(*holder[0], split)
        holder[0] = tuple(new_state)
        return out

    return run


def mlp_pmap_variant(params: list[dict], width: int, batch: int, n: int) -> Runner:
    def per_replica(params, opt, xy):
        loss, g = jax.value_and_grad(bench.mlp_loss)(params, *xy)
        upd, opt = bench.TX.update(lax.pmean(g, "d"), opt, params)
        return optax.apply_updates(params, upd), opt, lax.pmean(loss, "d")

    return pmap_runner(per_replica, (params, bench.TX.init(params)), bench.host_batches(batch, width), n)


def trivial_batches(batch: int):
    pool = [np.full((batch,), i, np.float32) for i in range(4)]
    i = 0
    while True:
        yield pool[i % len(pool)]
        i += 1


def trivial_variants(batch: int, n: int) -> dict[str, Factory]:
    """``state + mean(batch)``, the mean over every replica's rows: one all-reduce of a scalar."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))

    def hand(step: Callable, state_on: Any, batch_on: Any) -> Runner:
        state, batches = [jax.device_put(np.float32(0), state_on)], trivial_batches(batch)

        def run() -> object:
            x = next(batches)
            state[0] = step(state[0], jax.device_put(x, batch_on) if batch_on is not None else x)
            return state[0]

        return run

    def pmean_step(s, x):
        return s + lax.pmean(jnp.mean(x), "d")

    def replicator() -> Runner:
        repl = rp.Replicator(1, n, devices=jax.devices()[:n])
        state = [np.float32(0)]

        def input_fn(ctx):
            yield from trivial_batches(batch)

        def step_fn(s, b):
            return s + rp.all_mean(jnp.mean(b)), {}

        def run() -> object:
            state[0], _ = repl.run(step_fn, input_fn, state[0])
            return state[0]

        return run

    def pmap() -> Runner:
        return pmap_runner(lambda s, x: (pmean_step(s, x),) * 2, (np.float32(0),), trivial_batches(batch), n)

    mean_step = jax.jit(lambda s, x: s + jnp.mean(x))
    dev = jax.devices()[0]
    smap = jax.jit(jax.shard_map(pmean_step, mesh=mesh, in_specs=(P(), P("d")), out_specs=P(), check_vma=False))
    gspmd = jax.jit(lambda s, x: s + jnp.mean(x), in_shardings=(rep, shard), out_shardings=rep)
    return {
        "single": lambda: hand(mean_step, dev, dev),
        "shard_map": lambda: hand(smap, rep, shard),
        "gspmd": lambda: hand(gspmd, rep, None),
        "pmap": pmap,
        "replicator": replicator,
    }


# -- the MLPs and folding ----------------------------------------------------------------------


def mlp_variants(depth: int, width: int, batch: int, n: int) -> dict[str, Factory]:
    params = bench.mlp_init(depth, width)
    return {
        "single": lambda: bench.single_variant(params, width, batch),
        "shard_map": lambda: bench.shard_map_variant(params, width, batch, n),
        "gspmd": lambda: bench.gspmd_variant(params, width, batch, n),
        "pmap": lambda: mlp_pmap_variant(params, width, batch, n),
        "replicator": lambda: bench.replicator_variant(params, width, batch, n),
    }


def fold_variants(batch: int, n: int, devices: int = 2) -> dict[str, Factory]:
    """``n`` replicas of ``mlp64x32`` on ``devices`` devices; ``shard_map`` is hand-written ``vmap`` in it."""
    params, width, per_device = bench.mlp_init(64, 32), 32, n // devices
    return {
        "single": lambda: bench.single_variant(params, width, batch),
        "shard_map": lambda: bench.vmap_in_shard_map_variant(params, width, batch, devices, per_device),
        "replicator": lambda: bench.replicator_variant(params, width, batch, n, replicas_per_device=per_device),
    }


# -- the Flax ResNet ----------------------------------------------------------------------------


def resnet_variants(batch: int, n: int) -> dict[str, Factory]:
    import flax_imagenet_pmap as flax_example

    lr = 0.1
    model = flax_example.make_model()
    step_fn = functools.partial(flax_example.train_step, learning_rate_fn=lambda step: lr)
    state = flax_example.create_train_state(model, lambda step: lr, 8, dynamic_scale=False)
    pool = flax_example.synthetic_batches(4, batch, 8)

    def batches():
        i = 0
        while True:
            yield pool[i % len(pool)]
            i += 1

    def smap(devices: int) -> Runner:
        mesh = Mesh(np.array(jax.devices()[:devices]), ("batch",))
        step = jax.jit(
            jax.shard_map(step_fn, mesh=mesh, in_specs=(P(), P("batch")), out_specs=(P(), P()), check_vma=False)
        )
        holder, data = [jax.device_put(state, NamedSharding(mesh, P()))], batches()
        target = NamedSharding(mesh, P("batch"))

        def run() -> object:
            holder[0], metrics = step(holder[0], jax.device_put(next(data), target))
            return metrics["loss"]

        return run

    def pmap() -> Runner:
        return pmap_runner(step_fn, (state,), batches(), n, axis_name="batch")

    def replicator() -> Runner:
        repl = rp.Replicator(1, n, axis_name="batch", devices=jax.devices()[:n])
        holder = [state]

        def input_fn(ctx):
            yield from batches()

        def run() -> object:
            holder[0], metrics = repl.run(step_fn, input_fn, holder[0])
            return metrics["loss"]

        return run

    return {"single": lambda: smap(1), "shard_map": lambda: smap(n), "pmap": pmap, "replicator": replicator}


# -- timing and the table -------------------------------------------------------------------------


def measure(factories: dict[str, Factory], rounds: int, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """``(median seconds per step, first call in seconds)`` of each variant."""
    runners: dict[str, Runner] = {}
    first: dict[str, float] = {}
    for name, factory in factories.items():
        t0 = time.perf_counter()
        runners[name] = factory()
        block(runners[name]())
        first[name] = time.perf_counter() - t0
    samples = interleaved_samples(runners, rounds, steps, warmup=1)
    return {name: statistics.median(s) for name, s in samples.items()}, first


def workload_variants(name: str, n: int) -> dict[str, Factory]:
    if name == "trivial":
        return trivial_variants(ARGS.batch, n)
    if name == "resnet":
        return resnet_variants(ARGS.resnet_batch, n)
    if name == "fold":
        return fold_variants(ARGS.batch, n)
    depth, width = (int(v) for v in name.removeprefix("mlp").split("x"))
    return mlp_variants(depth, width, ARGS.batch, n)


LABELS = {
    "trivial": "trivial (one scalar all-mean)",
    "mlp64x32": "mlp64x32 (Adam, 128 small tensors)",
    "mlp16x128": "mlp16x128 (Adam, 32 tensors)",
    "resnet": "Flax ResNet (pmap-style step)",
    "fold": "fold: mlp64x32, 8 replicas on 2 devices",
}


def row(name: str, step: dict[str, float], first: dict[str, float]) -> str:
    cells = [f"{step[v] * 1e3:.2f}" if v in step else "-" for v in ("single", *HAND, "replicator")]
    best = min((v for v in HAND if v in step), key=step.get)
    r = step["replicator"]
    firsts = "/".join(f"{first[v]:.1f}" if v in first else "-" for v in ("single", *HAND, "replicator"))
    return (
        f"| {LABELS[name]} | " + " | ".join(cells) + f" | {r / step[best]:.2f}x ({best}) | {r / step['single']:.2f}x "
        f"| {firsts} | {first['replicator'] / first['shard_map']:.2f}x |"
    )


def main() -> int:
    n = ARGS.devices
    load = os.getloadavg()
    print(
        f"# {n} emulated CPU devices on {os.cpu_count()} cores, JAX {jax.__version__}, {ARGS.rounds} interleaved "
        f"rounds x {ARGS.steps} steps, medians; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    rows = []
    for name in ARGS.workloads.split(","):
        if name not in WORKLOADS and not name.startswith("mlp"):
            raise SystemExit(f"--workloads: unknown {name!r}; choose from {WORKLOADS}")
        step, first = measure(workload_variants(name, n), ARGS.rounds, ARGS.steps)
        LABELS.setdefault(name, name)
        rows.append(row(name, step, first))
        print(
            f"{name}: " + ", ".join(f"{v} {t * 1e3:.2f} ms (first {first[v]:.1f} s)" for v, t in step.items()),
            flush=True,
        )
    print(
        "\n| workload | single (ms) | shard_map (ms) | gspmd (ms) | pmap (ms) | replicator (ms) "
        "| replicator / best hand | replicator / single "
        "| first call (s): single/shard_map/gspmd/pmap/replicator | first call / shard_map's |"
    )
    print("|---|" + "---:|" * 9)
    print("\n".join(rows))
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
