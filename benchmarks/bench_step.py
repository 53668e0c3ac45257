"""Step-time benchmark: replicator against what JAX users write by hand.

One process, N emulated CPU devices; variants are interleaved round by round
(so machine noise hits them alike) and the table reports medians and ratios to
the single-device step on the same global batch (the floor).

Variants, for each training workload (Adam, state carried between steps, a
host batch each step):

* ``single``        ``jax.jit`` on one device, global batch (the floor)
* ``shard_map``     hand-written ``jit(shard_map)`` + ``lax.pmean`` of the gradient pytree
* ``gspmd``         ``jit`` with the batch sharded over the devices, params replicated
* ``replicator``    ``Replicator(1, N)`` with the default pipeline
* ``-<pass>``       the same with one optimization pass disabled

Workloads: ``mlp64x32`` (64 layers of width 32: 128 small tensors),
``mlp16x128`` (fewer, larger tensors), ``allreduce`` (50 all-reduces of 1000
floats: separate psums, one hand-flattened psum, replicator fused / unfused,
the ring and tree algorithms, bf16 on the wire, hierarchical on 2 workers), and
``threshold`` (MLPs with 0.25 and 8 MiB of gradients under several fusion
bucket sizes; not in the default list, run it with ``--workloads threshold``),
and ``fold-mlpDxW`` (the ``N`` replicas on ``N``, ``2`` and ``1`` devices with
``replicas_per_device``, against hand-written ``vmap`` inside ``shard_map``;
``--workloads fold-mlp64x32,fold-mlp16x128``), and ``auto-mlpDxW`` /
``auto-allreduce`` (``PassManager.default(auto=True, topology=--topology)``
against each fixed setting it chooses among, on 2 x N/2).

Also reported: time spent tracing + in our passes against XLA's compile time.

Usage::

    python benchmarks/bench_step.py                       # all workloads, 8 devices
    python benchmarks/bench_step.py --workloads allreduce --rounds 3
    python benchmarks/bench_step.py --scaling --plot scaling.png
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import replicator as rp  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices (replicas)")
    p.add_argument("--workloads", default="mlp64x32,mlp16x128,allreduce")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    p.add_argument("--steps", type=int, default=10, help="steps timed per variant per round")
    p.add_argument("--batch", type=int, default=512, help="global batch size")
    p.add_argument("--scaling", action="store_true", help="also time replicator/single on 1, 2, 4, ... replicas")
    p.add_argument("--plot", default=None, help="write the scaling plot here (PNG; needs matplotlib)")
    p.add_argument("--topology", default="cpu-emulated", help="cost-model topology of the auto-* workloads")
    return p.parse_args(argv)


ARGS = parse_args()
rp.force_cpu_devices(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from timing import time_interleaved  # noqa: E402

from replicator.runtime.execution import place_batch, place_state, sharded  # noqa: E402

Runner = Callable[[], object]  # one step, returns something to block on


# -- workloads -----------------------------------------------------------------


def mlp_init(depth: int, width: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "w": (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32),
            "b": np.zeros(width, np.float32),
        }
        for _ in range(depth)
    ]


def mlp_loss(params: list[dict], x: jax.Array, y: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    out = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((out - y) ** 2)


def host_batches(batch: int, width: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    pool = [
        (rng.normal(size=(batch, width)).astype(np.float32), rng.normal(size=(batch, width)).astype(np.float32))
        for _ in range(4)
    ]
    i = 0
    while True:
        yield pool[i % len(pool)]
        i += 1


TX = optax.adam(1e-3)


def adam_step(params, opt, x, y):
    """The whole training step on one device (or under GSPMD)."""
    loss, g = jax.value_and_grad(mlp_loss)(params, x, y)
    upd, opt = TX.update(g, opt, params)
    return optax.apply_updates(params, upd), opt, loss


def hand_runner(step: Callable, params: list[dict], width: int, batch: int, state_on, batch_on) -> Runner:
    """One step of a hand-written variant: state on ``state_on``, a host batch each call.

    ``batch_on`` is where the batch is put before the call (``None``: the host
    arrays are passed as they are, and ``jit``'s ``in_shardings`` place them).
    """
    state = [jax.device_put(params, state_on), jax.device_put(TX.init(params), state_on)]
    data = host_batches(batch, width)

    def run() -> object:
        x, y = next(data)
        if batch_on is not None:
            x, y = jax.device_put(x, batch_on), jax.device_put(y, batch_on)
        state[0], state[1], loss = step(state[0], state[1], x, y)
        return loss

    return run


def single_variant(params: list[dict], width: int, batch: int) -> Runner:
    dev = jax.devices()[0]
    return hand_runner(jax.jit(adam_step), params, width, batch, dev, dev)


def _pmean_flat(g: Any, axis: str) -> Any:
    """``lax.pmean`` of a gradient pytree as one flat buffer (``ravel_pytree``, one ``pmean``, unravelled)."""
    from jax.flatten_util import ravel_pytree

    flat, unravel = ravel_pytree(g)
    return unravel(lax.pmean(flat, axis))


def shard_map_variant(params: list[dict], width: int, batch: int, n: int, flat: bool = False) -> Runner:
    """Hand-written ``jit(shard_map)`` with ``lax.pmean`` of the gradients (``flat``: as one buffer)."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    average = _pmean_flat if flat else lax.pmean

    def per_replica(params, opt, x, y):
        loss, g = jax.value_and_grad(mlp_loss)(params, x, y)
        g = average(g, "d")
        upd, opt = TX.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, lax.pmean(loss, "d")

    step = jax.jit(
        jax.shard_map(
            per_replica, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")), out_specs=(P(), P(), P()), check_vma=False
        )
    )
    return hand_runner(step, params, width, batch, NamedSharding(mesh, P()), NamedSharding(mesh, P("d")))


def shard_map_flat_variant(params: list[dict], width: int, batch: int, n: int) -> Runner:
    """``shard_map_variant`` with its gradients averaged as one flat buffer: tensor fusion by hand,
    what ``fuse-collectives`` does."""
    return shard_map_variant(params, width, batch, n, flat=True)


def gspmd_variant(params: list[dict], width: int, batch: int, n: int) -> Runner:
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    step = jax.jit(adam_step, in_shardings=(rep, rep, shard, shard), out_shardings=(rep, rep, rep))
    return hand_runner(step, params, width, batch, rep, None)


def replicator_step(state, batch):
    params, opt = state
    loss, g = jax.value_and_grad(mlp_loss)(params, batch["x"], batch["y"])
    g = rp.all_mean(g)
    upd, opt = TX.update(g, opt, params)
    return (optax.apply_updates(params, upd), opt), {"loss": rp.all_mean(loss)}


def replicator_variant(
    params: list[dict],
    width: int,
    batch: int,
    n: int,
    disable: tuple[str, ...] = (),
    workers: int = 1,
    replicas_per_device: int = 1,
    **options: object,
) -> Runner:
    repl = rp.Replicator(
        workers,
        n // workers,
        passes=rp.PassManager.default(disable=disable, **options),
        parallelism=rp.Parallelism(replicas_per_device=replicas_per_device),
        devices=jax.devices()[: n // replicas_per_device],
    )

    def input_fn(ctx):
        for x, y in host_batches(batch, width):
            yield {"x": x, "y": y}

    state = [(params, TX.init(params))]
    if options.get("auto"):
        print(f"auto, mlp on {workers}x{n // workers}: {_auto_note(repl, replicator_step, input_fn, state[0])}")

    def run() -> object:
        state[0], out = repl.run(replicator_step, input_fn, state[0])
        return out["loss"]

    return run


def _auto_note(repl: rp.Replicator, step: Callable, input_fn: Callable, state: object = None) -> str:
    batch = next(iter(input_fn(repl.input_context(0))))
    return repl.lower(step, batch, state).notes[0]


def optimization_passes() -> list[str]:
    return [p.name for p in rp.passes.default_passes() if not p.required and p.name != "check-replica-invariance"]


def training_variants(depth: int, width: int, batch: int, n: int) -> dict[str, Runner]:
    params = mlp_init(depth, width)
    variants = {
        "single": single_variant(params, width, batch),
        "shard_map+pmean": shard_map_variant(params, width, batch, n),
        "gspmd": gspmd_variant(params, width, batch, n),
        "replicator": replicator_variant(params, width, batch, n),
    }
    for name in optimization_passes():
        variants[f"replicator -{name}"] = replicator_variant(params, width, batch, n, (name,))
    if n % 2 == 0 and n >= 4:
        w = 2
        variants[f"replicator {w}x{n // w}"] = replicator_variant(params, width, batch, n, workers=w)
        variants[f"replicator {w}x{n // w} +hierarchical"] = replicator_variant(
            params, width, batch, n, workers=w, hierarchical=True
        )
    return variants


def fold_variants(depth: int, width: int, batch: int, n: int) -> dict[str, Runner]:
    """``n`` replicas on ``n``, 2 and 1 devices (``replicas_per_device``), the
    hand-written equivalent of folding (``vmap`` over a replica axis inside ``shard_map``),
    and, on the fewer devices, one replica per device (replicator, and hand-written
    ``shard_map`` with one flat ``pmean``): the cost of data parallelism on those devices
    without any folding."""
    params = mlp_init(depth, width)
    variants = {
        "single": single_variant(params, width, batch),
        f"replicator {n} replicas on {n} devices": replicator_variant(params, width, batch, n),
    }
    for per_device in (n // 2, n):
        if per_device > 1 and n % per_device == 0:
            devices = n // per_device
            variants[f"replicator {n} replicas on {devices} device(s)"] = replicator_variant(
                params, width, batch, n, replicas_per_device=per_device
            )
            variants[f"hand vmap in shard_map, {n} on {devices}"] = vmap_in_shard_map_variant(
                params, width, batch, devices, per_device
            )
            if devices > 1:  # the same devices without folding: what data parallelism on them costs
                variants[f"replicator {devices} replicas on {devices} devices"] = replicator_variant(
                    params, width, batch, devices
                )
                variants[f"hand flat pmean, {devices} on {devices}"] = shard_map_flat_variant(
                    params, width, batch, devices
                )
    return variants


def vmap_in_shard_map_variant(params: list[dict], width: int, batch: int, devices: int, per_device: int) -> Runner:
    """The issue's hand-written experiment: ``jax.vmap(step, axis_name='v')`` inside ``shard_map``."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))

    def per_replica(params, opt, x, y):
        loss, g = jax.value_and_grad(mlp_loss)(params, x, y)
        g = lax.pmean(g, ("d", "v"))
        upd, opt = TX.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, lax.pmean(loss, ("d", "v"))

    def per_device_fn(params, opt, x, y):
        split = lambda a: a.reshape(per_device, a.shape[0] // per_device, *a.shape[1:])  # noqa: E731
        p, o, loss = jax.vmap(per_replica, in_axes=(None, None, 0, 0), axis_name="v")(params, opt, split(x), split(y))
        return jax.tree.map(lambda a: a[0], p), jax.tree.map(lambda a: a[0], o), loss[0]

    step = jax.jit(
        jax.shard_map(
            per_device_fn, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")), out_specs=(P(), P(), P()), check_vma=False
        )
    )
    return hand_runner(step, params, width, batch, NamedSharding(mesh, P()), NamedSharding(mesh, P("d")))


#: The fixed settings ``auto`` chooses among (each one option away from the default).
FIXED_SETTINGS: dict[str, dict] = {
    "default": {},
    "ring": {"all_reduce_algorithm": "ring"},
    "tree": {"all_reduce_algorithm": "reduce_broadcast"},
    "hierarchical": {"hierarchical": True},
    "fusion 1 MiB": {"fuse_threshold_bytes": 1 << 20},
    "fusion 64 KiB": {"fuse_threshold_bytes": 64 << 10},
    "fusion off": {"disable": ("fuse-collectives",)},
    "zero": {"shard_optimizer": True},
}


def auto_variants(workload: str, batch: int, n: int, topology: str) -> dict[str, Runner]:
    """``PassManager.default(auto=True)`` against every fixed setting it chooses among, on 2 x n/2."""
    workers = 2 if n % 2 == 0 and n >= 4 else 1
    variants: dict[str, Runner] = {}
    if workload == "allreduce":
        runners = allreduce_variants(n, only_replicator=True)
        for name, options in FIXED_SETTINGS.items():
            if name != "zero":  # no optimizer state
                variants[f"fixed: {name}"] = runners(workers=workers, **options)
        variants["auto"] = runners(workers=workers, auto=True, topology=topology)
        return variants
    depth, width = (int(v) for v in workload.removeprefix("mlp").split("x"))
    params = mlp_init(depth, width)
    variants["single"] = single_variant(params, width, batch)
    for name, options in FIXED_SETTINGS.items():
        options = dict(options)
        disable = tuple(options.pop("disable", ()))
        variants[f"fixed: {name}"] = replicator_variant(params, width, batch, n, disable, workers=workers, **options)
    variants["auto"] = replicator_variant(params, width, batch, n, workers=workers, auto=True, topology=topology)
    return variants


def print_auto_table(title: str, medians: dict[str, float]) -> None:
    fixed = {k: v for k, v in medians.items() if k.startswith("fixed: ")}
    best = min(fixed, key=fixed.get)
    print(f"\n### {title}\n")
    print("| variant | median step (ms) | ratio to the best fixed setting |")
    print("|---|---:|---:|")
    for name, t in medians.items():
        mark = " (best fixed)" if name == best else ""
        print(f"| {name}{mark} | {t * 1e3:.2f} | {t / fixed[best]:.2f}x |")


# -- the fusion threshold ------------------------------------------------------------

#: (depth, width, global batch): 0.25 MiB of gradients in 32 tensors, and 8 MiB in 16.
THRESHOLD_MLPS = ((16, 128, 512), (8, 512, 64))
THRESHOLDS = (64 * 2**10, 256 * 2**10, 2**20, 4 * 2**20, 25 * 2**20, 64 * 2**20)


def threshold_variants(n: int, depth: int, width: int, batch: int) -> dict[str, Runner]:
    params = mlp_init(depth, width)
    variants = {"single": single_variant(params, width, batch)}
    for t in THRESHOLDS:
        label = f"{t // 2**20} MiB" if t >= 2**20 else f"{t // 2**10} KiB"
        variants[f"buckets of {label}, every tensor fused"] = replicator_variant(
            params, width, batch, n, fuse_threshold_bytes=t, fuse_max_tensor_bytes=None
        )
    variants["default (64 MiB buckets, tensors > 64 KiB alone)"] = replicator_variant(params, width, batch, n)
    return variants


# -- the many-small-tensors all-reduce ---------------------------------------------

N_TENSORS, TENSOR_SIZE = 50, 1000


def allreduce_variants(n: int, only_replicator: bool = False) -> Any:
    """The 50-all-reduce variants; with ``only_replicator``, the factory of replicator runners."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    shard = NamedSharding(mesh, P("d"))
    x = jax.device_put(np.ones((n, N_TENSORS, TENSOR_SIZE), np.float32), shard)

    # Every variant returns one scalar (the sum of every reduced tensor), so that
    # output handling is the same and all 50 results are needed.
    def separate(x):
        return sum(jnp.sum(lax.psum(x[0, i] * (i + 1), "d")) for i in range(N_TENSORS))

    def flattened(x):
        parts = [x[0, i] * (i + 1) for i in range(N_TENSORS)]
        total = lax.psum(jnp.concatenate(parts), "d")
        return sum(jnp.sum(t) for t in jnp.split(total, N_TENSORS))

    def smap(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=False))

    def repl_step(batch):
        return sum(jnp.sum(t) for t in rp.all_sum([batch["x"][0, i] * (i + 1) for i in range(N_TENSORS)]))

    def repl_runner(disable: tuple[str, ...] = (), workers: int = 1, **options: object) -> Runner:
        repl = rp.Replicator(workers, n // workers, passes=rp.PassManager.default(disable=disable, **options))
        # Already on the mesh, like the shard_map variants' input: no host transfer.
        placed = jax.device_put(np.ones((n, N_TENSORS, TENSOR_SIZE), np.float32), sharded(repl.mesh))

        def input_fn(ctx):
            while True:
                yield {"x": placed}

        if options.get("auto"):
            print(f"auto, {N_TENSORS} all-reduces on {workers}x{n // workers}: {_auto_note(repl, repl_step, input_fn)}")
        return lambda: repl.run(repl_step, input_fn)

    if only_replicator:
        return repl_runner

    sep, flat = smap(separate), smap(flattened)
    return {
        "50 psums (shard_map)": lambda: sep(x),
        "1 flattened psum (shard_map)": lambda: flat(x),
        "replicator all_sum (fused)": repl_runner(),
        "replicator -fuse-collectives": repl_runner(("fuse-collectives",)),
        "replicator ring": repl_runner(all_reduce_algorithm="ring"),
        "replicator reduce+broadcast (tree)": repl_runner(all_reduce_algorithm="reduce_broadcast"),
        "replicator bf16 on the wire": repl_runner(compress=True),
        **(
            {
                f"replicator 2x{n // 2}": repl_runner(workers=2),
                f"replicator 2x{n // 2} +hierarchical": repl_runner(workers=2, hierarchical=True),
            }
            if n % 2 == 0 and n >= 4
            else {}
        ),
    }


# -- timing ---------------------------------------------------------------------------


def print_table(title: str, medians: dict[str, float], floor: str) -> None:
    print(f"\n### {title}\n")
    print("| variant | median step (ms) | ratio to " + floor + " |")
    print("|---|---:|---:|")
    for name, t in medians.items():
        print(f"| {name} | {t * 1e3:.2f} | {t / medians[floor]:.2f}x |")


def compile_overhead(depth: int, width: int, batch: int, n: int) -> None:
    """Trace + our passes vs XLA compile time, for the replicator step."""
    params = mlp_init(depth, width)
    repl = rp.Replicator(1, n)
    state = (params, TX.init(params))
    b = {"x": np.zeros((batch, width), np.float32), "y": np.zeros((batch, width), np.float32)}
    t0 = time.perf_counter()
    compiled = repl._compile(replicator_step, state, b)
    t_ours = time.perf_counter() - t0
    args = (place_state(jax.tree.leaves(state), repl.mesh), place_batch([jax.tree.leaves(b)], repl.mesh))
    t0 = time.perf_counter()
    lowered = compiled.executable.lower(*args)
    t_lower = time.perf_counter() - t0
    t0 = time.perf_counter()
    lowered.compile()
    t_xla = time.perf_counter() - t0
    print(
        f"\ncompile overhead mlp{depth}x{width}: trace+passes {t_ours * 1e3:.0f} ms, "
        f"jit lowering to StableHLO {t_lower * 1e3:.0f} ms, XLA compile {t_xla * 1e3:.0f} ms; "
        f"trace+passes = {100 * t_ours / t_xla:.0f}% of XLA compile"
    )


def scaling(depth: int, width: int, batch: int, rounds: int, steps: int, plot: str | None) -> None:
    counts = [k for k in (1, 2, 4, 8, 16) if k <= jax.device_count()]
    params = mlp_init(depth, width)
    variants: dict[str, Runner] = {"single": single_variant(params, width, batch)}
    for k in counts:
        variants[f"replicator x{k}"] = replicator_variant(params, width, batch, k)
        variants[f"shard_map x{k}"] = shard_map_variant(params, width, batch, k)
    medians = time_interleaved(variants, rounds, steps)
    print_table(f"scaling, mlp{depth}x{width}, global batch {batch}", medians, "single")
    if plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot written")
            return
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for label in ("replicator", "shard_map"):
            ax.plot(counts, [medians[f"{label} x{k}"] / medians["single"] for k in counts], marker="o", label=label)
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_xlabel("replicas (emulated CPU devices)")
        ax.set_ylabel("step time / single-device step")
        ax.set_xscale("log", base=2)
        ax.set_title(f"mlp{depth}x{width}, global batch {batch}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
        print(f"plot written to {plot}")


def main() -> None:
    n = jax.device_count()
    print(f"# replicator benchmark: {n} emulated CPU devices, {os.cpu_count()} host cores, jax {jax.__version__}")
    print(f"# {ARGS.rounds} interleaved rounds x {ARGS.steps} steps; medians")
    for w in ARGS.workloads.split(","):
        if w == "threshold":
            for depth, width, batch in THRESHOLD_MLPS:
                medians = time_interleaved(threshold_variants(n, depth, width, batch), ARGS.rounds, ARGS.steps)
                grads = 4 * depth * (width + 1) * width / 2**20
                print_table(
                    f"fusion threshold, mlp{depth}x{width} ({grads:.2f} MiB of gradients), global batch {batch}",
                    medians,
                    "single",
                )
        elif w.startswith("auto-"):
            workload = w.removeprefix("auto-")
            medians = time_interleaved(auto_variants(workload, ARGS.batch, n, ARGS.topology), ARGS.rounds, ARGS.steps)
            print_auto_table(f"auto ({ARGS.topology}) against fixed settings, {workload} on 2x{n // 2}", medians)
        elif w.startswith("fold-"):
            depth, width = (int(v) for v in w.removeprefix("fold-mlp").split("x"))
            medians = time_interleaved(fold_variants(depth, width, ARGS.batch, n), ARGS.rounds, ARGS.steps)
            print_table(
                f"{n} replicas folded onto fewer devices, mlp{depth}x{width}, Adam, global batch {ARGS.batch}",
                medians,
                "single",
            )
        elif w == "allreduce":
            medians = time_interleaved(allreduce_variants(n), ARGS.rounds, ARGS.steps)
            print_table(f"{N_TENSORS} all-reduces of {TENSOR_SIZE} floats", medians, "1 flattened psum (shard_map)")
        else:
            depth, width = (int(v) for v in w.removeprefix("mlp").split("x"))
            medians = time_interleaved(training_variants(depth, width, ARGS.batch, n), ARGS.rounds, ARGS.steps)
            print_table(f"{w}: Adam, global batch {ARGS.batch}", medians, "single")
            compile_overhead(depth, width, ARGS.batch, n)
    if ARGS.scaling:
        scaling(64, 32, ARGS.batch, ARGS.rounds, ARGS.steps, ARGS.plot)


if __name__ == "__main__":
    main()
