"""The communication cost model against measurement, and BigGAN's predicted communication.

(a) Calibrate (``rp.passes.calibrate``) the emulated CPU mesh as 1 x 8 and 2 x 4,
then for each workload on 1, 2, 4 and 8 devices compare the model's predicted
communication time (``Replicator.explain(...).predict(calibrated)``) with the
measured one: the median step time with the collectives minus the median step
time of the same step without them (same devices, same inputs; variants
interleaved round by round, ``benchmarks/timing.py``). Workloads:

* ``50 x 1000 fused``    50 ``all_sum``s of 1000 floats, default pipeline (one fused bucket)
* ``50 x 1000 unfused``  the same with ``fuse-allreduce`` disabled (50 collectives)
* ``ring`` / ``tree``    the fused bucket lowered as a ring / a binary tree (``all_reduce_algorithm``)
* ``2xC`` / ``2xC +hier``  two workers, flat and with ``hierarchical-allreduce`` (8 devices)
* ``mlp16x128``          Adam on a 16 x 128 MLP, ``rp.all_mean`` of the gradients (global batch 512)

1 x N workloads are predicted with the 1 x 8 calibration, 2 x 4 ones with the 2 x 4 one.

(b) The BigGAN configuration of ``examples/gan.py --config biggan512`` (workers
= replicas / 8 x 8 cores, global batch 2048, batch norm over each worker's
cores, generator and discriminator of width 128), traced by ``explain`` with
``replicas_per_device`` folding onto the 8 devices, for 8 to 512 replicas: the
predicted communication per step under every preset, with and without
``hierarchical-allreduce``; a markdown table and a PNG plot.

Usage::

    python benchmarks/bench_costmodel.py                   # (a) and (b), plot to benchmarks/results/
    python benchmarks/bench_costmodel.py --calibrate-only  # the figures of the 'cpu-emulated' preset
    python benchmarks/bench_costmodel.py --skip-measure    # (b) only
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import replicator as rp  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the median is reported")
    p.add_argument("--steps", type=int, default=10, help="steps timed per variant per round")
    p.add_argument("--repeats", type=int, default=7, help="calibration: timed runs per size")
    p.add_argument("--calibrate-only", action="store_true", help="print the calibrated topologies and stop")
    p.add_argument("--skip-measure", action="store_true", help="skip (a): only the BigGAN predictions")
    p.add_argument("--skip-biggan", action="store_true", help="skip (b)")
    p.add_argument(
        "--plot",
        default=os.path.join(HERE, "results", "costmodel_biggan.png"),
        help="where to write the BigGAN plot (PNG, needs matplotlib; '' to skip)",
    )
    return p.parse_args(argv)


ARGS = parse_args()
rp.force_cpu_devices(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from timing import time_interleaved  # noqa: E402

from replicator.passes import PRESETS, Topology, calibrate  # noqa: E402
from replicator.passes.costmodel import collective_time  # noqa: E402
from replicator.passes.records import CollectiveRecord  # noqa: E402
from replicator.runtime.execution import sharded  # noqa: E402

# -- (a) calibration ---------------------------------------------------------------------


def print_calibration(topologies: dict[str, Topology]) -> None:
    print("\n### Calibrated links (`rp.passes.calibrate`)\n")
    print("| mesh | axis | N | alpha (us) | bandwidth (GB/s) |")
    print("|---|---|---:|---:|---:|")
    for label, topo in topologies.items():
        sizes = {m.axis: m.group_size for m in topo.measurements}
        for axis in ("cores", "workers"):
            if axis in sizes:
                link = getattr(topo, axis)
                print(f"| {label} | {axis} | {sizes[axis]} | {link.alpha_s * 1e6:.2f} | {link.bytes_per_s / 1e9:.3f} |")
    print("\nfit against its own measurements (time of one psum inside a program):\n")
    print("| mesh | axis | bytes | measured (us) | fitted (us) | fitted / measured |")
    print("|---|---|---:|---:|---:|---:|")
    for label, topo in topologies.items():
        for m in topo.measurements:
            one_psum = CollectiveRecord("all_sum", m.axis, "native", "float32", m.nbytes, 1, (), "step", 0.0)
            fit = collective_time(dataclasses.replace(one_psum, group_size=m.group_size), topo)
            print(
                f"| {label} | {m.axis} | {m.nbytes} | {m.seconds * 1e6:.1f} | {fit * 1e6:.1f} | {fit / m.seconds:.2f} |"
            )
    topo = topologies.get("2x4")
    if topo is not None:
        print(
            f"\n'cpu-emulated' preset figures: cores={topo.cores!r}, workers={topo.workers!r}, "
            f"p2p_cores={topo.p2p_cores!r}, p2p_workers={topo.p2p_workers!r}, "
            f"native_latency={topo.native_latency!r}"
        )


# -- (a) workloads -------------------------------------------------------------------------

N_TENSORS, TENSOR_SIZE = 50, 1000


def _scaled(batch):
    return [batch["x"][0, i] * (i + 1) for i in range(N_TENSORS)]


def allreduce_step(batch):
    return sum(jnp.sum(t) for t in rp.all_sum(_scaled(batch)))


def allreduce_local(batch):  # the same step without its collectives
    return sum(jnp.sum(t) for t in _scaled(batch))


def allreduce_case(workers: int, cores: int, **options):
    """(runner with collectives, runner without, report) for the 50 x 1000 workload."""
    devices = jax.devices()[: workers * cores]

    def make(step, pipeline):
        repl = rp.Replicator(workers, cores, passes=pipeline, devices=devices)
        placed = jax.device_put(np.ones((workers * cores, N_TENSORS, TENSOR_SIZE), np.float32), sharded(repl.mesh))

        def input_fn(ctx):
            while True:
                yield {"x": placed}

        return repl, input_fn, (lambda: repl.run(step, input_fn))

    repl, input_fn, with_comm = make(allreduce_step, rp.Pipeline.default(**options))
    report = repl.explain(allreduce_step, {"x": np.ones((cores, N_TENSORS, TENSOR_SIZE), np.float32)})
    _, _, without = make(allreduce_local, rp.Pipeline.default())
    return with_comm, without, report


DEPTH, WIDTH, BATCH = 16, 128, 512
TX = optax.adam(1e-3)


def mlp_params(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "w": (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
            "b": np.zeros(WIDTH, np.float32),
        }
        for _ in range(DEPTH)
    ]


def mlp_loss(params, x, y):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean((x @ params[-1]["w"] + params[-1]["b"] - y) ** 2)


def mlp_step(state, batch, reduce=True):
    params, opt = state
    loss, g = jax.value_and_grad(mlp_loss)(params, batch["x"], batch["y"])
    if reduce:
        g, loss = rp.all_mean((g, loss))
    upd, opt = TX.update(g, opt, params)
    return (optax.apply_updates(params, upd), opt), {"loss": loss}


def mlp_local(state, batch):
    return mlp_step(state, batch, reduce=False)


def mlp_case(n: int):
    devices = jax.devices()[:n]
    rng = np.random.default_rng(1)
    pool = [{k: rng.normal(size=(BATCH, WIDTH)).astype(np.float32) for k in ("x", "y")} for _ in range(4)]

    def input_fn(ctx):
        rows = ctx.worker_batch_size(BATCH)
        i = 0
        while True:
            yield {k: v[:rows] for k, v in pool[i % len(pool)].items()}
            i += 1

    def make(step, pipeline):
        repl = rp.Replicator(1, n, passes=pipeline, devices=devices)
        params = mlp_params()
        state = [(params, TX.init(params))]

        def run():
            state[0], out = repl.run(step, input_fn, state[0])
            return out["loss"]

        return repl, run

    repl, with_comm = make(mlp_step, rp.Pipeline.default())
    params = mlp_params()
    report = repl.explain(mlp_step, input_fn, (params, TX.init(params)))
    # Without the all-mean the state differs between replicas: the invariance check would
    # (rightly) reject the step, so it is off for this timing-only baseline.
    _, without = make(mlp_local, rp.Pipeline.default(disable=["check-replica-invariance"]))
    return with_comm, without, report


def measure(topologies: dict[str, Topology]) -> None:
    counts = [k for k in (1, 2, 4, 8) if k <= jax.device_count()]
    cases = {}  # label -> (devices, mesh, with, without, report, topology)
    for n in counts:
        flat = topologies["1x8"]
        for label, options in (
            ("50 x 1000 fused", {}),
            ("50 x 1000 unfused", {"disable": ["fuse-allreduce"]}),
            ("50 x 1000 ring", {"all_reduce_algorithm": "ring"}),
            ("50 x 1000 tree", {"all_reduce_algorithm": "reduce_broadcast"}),
        ):
            cases[(n, label)] = (f"1x{n}", *allreduce_case(1, n, **options), flat)
        cases[(n, "mlp16x128 all_mean")] = (f"1x{n}", *mlp_case(n), flat)
    if 8 in counts:
        two = topologies["2x4"]
        cases[(8, "2x4 fused")] = ("2x4", *allreduce_case(2, 4), two)
        cases[(8, "2x4 fused +hierarchical")] = ("2x4", *allreduce_case(2, 4, hierarchical=True), two)
    variants = {}
    for (n, label), (_, with_comm, without, *_rest) in cases.items():
        variants[f"{n}|{label}|with"] = with_comm
        variants[f"{n}|{label}|without"] = without
    # One interleaved round at a time, so that each round gives a paired difference
    # (with - without) measured a few seconds apart: drift in the machine's load cancels.
    rounds = [time_interleaved(variants, 1, ARGS.steps) for _ in range(ARGS.rounds)]
    print(
        f"\n### Predicted vs measured communication ({ARGS.rounds} interleaved rounds x {ARGS.steps} steps, "
        "medians; measured comm = median over rounds of (with - without), p25-p75 in brackets)\n"
    )
    print(
        "| devices | mesh | workload | collectives | predicted (ms) | step with (ms) | step without (ms) "
        "| measured comm (ms) | measured / predicted |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---|---:|")
    for (n, label), (mesh, _, _, report, topo) in cases.items():
        pred = report.predict(topo).total_s
        with_ts = [r[f"{n}|{label}|with"] for r in rounds]
        without_ts = [r[f"{n}|{label}|without"] for r in rounds]
        diffs = [a - b for a, b in zip(with_ts, without_ts, strict=True)]
        comm = statistics.median(diffs)
        p25, _, p75 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (comm, comm, comm)
        ratio = f"{comm / pred:.2f}" if pred > 0 else "-"
        print(
            f"| {n} | {mesh} | {label} | {report.num_collectives} | {pred * 1e3:.3f} "
            f"| {statistics.median(with_ts) * 1e3:.2f} | {statistics.median(without_ts) * 1e3:.2f} "
            f"| {comm * 1e3:.3f} [{p25 * 1e3:.2f}, {p75 * 1e3:.2f}] | {ratio} |"
        )


# -- (b) BigGAN -----------------------------------------------------------------------------

REPLICAS = (8, 16, 32, 64, 128, 256, 512)
COLUMNS = [(name, False) for name in PRESETS] + [("gpu-hosts-100gbe", True), ("tpu-v3-pod", True)]


def biggan_reports() -> dict[tuple[int, bool], object]:
    import gan  # examples/gan.py

    cfg = gan.CONFIGS["biggan512"]
    g_tx, d_tx = gan.make_optimizers(cfg["steps"])
    state = gan.init_state(0, g_tx, d_tx)
    step = gan.make_train_step(0, g_tx, d_tx, cfg["bn_group"])
    input_fn = gan.make_input_fn(0, cfg["global_batch"])
    devices = jax.devices()[:8]
    reports = {}
    for replicas in REPLICAS:
        workers, cores = replicas // 8, 8
        for hierarchical in (False, True):
            repl = rp.Replicator(
                workers,
                cores,
                replicas_per_device=replicas // len(devices),
                passes=rp.Pipeline.default(hierarchical=hierarchical),
                devices=devices,
            )
            reports[replicas, hierarchical] = repl.explain(step, input_fn, state)
    return reports


def biggan(plot: str) -> None:
    reports = biggan_reports()
    first = reports[REPLICAS[-1], False]
    print("\n### BigGAN (examples/gan.py --config biggan512): predicted communication per step (ms)\n")
    print(f"512 replicas, default pipeline, on gpu-hosts-100gbe:\n\n```\n{first.predict('gpu-hosts-100gbe')}\n```\n")
    heads = [f"{name}{' +hier' if hier else ''}" for name, hier in COLUMNS]
    print("| replicas | mesh | collectives | sent/replica (KiB) | " + " | ".join(heads) + " |")
    print("|---:|---|---:|---:|" + "---:|" * len(heads))
    table: dict[tuple[str, bool], list[float]] = {col: [] for col in COLUMNS}
    for replicas in REPLICAS:
        flat = reports[replicas, False]
        cells = []
        for name, hier in COLUMNS:
            t = reports[replicas, hier].predict(name).total_s
            table[name, hier].append(t)
            cells.append(f"{t * 1e3:.3f}")
        print(
            f"| {replicas} | {replicas // 8}x8 | {flat.num_collectives} | {flat.total_sent_bytes / 1024:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    if not plot:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\nmatplotlib is not installed: no plot written (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = {name: f"C{i}" for i, name in enumerate(PRESETS)}
    for (name, hier), times in table.items():
        ax.plot(
            REPLICAS,
            [t * 1e3 for t in times],
            marker="o",
            ls="--" if hier else "-",
            color=colors[name],
            label=f"{name}{' +hierarchical' if hier else ''}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(REPLICAS, [str(r) for r in REPLICAS])
    ax.set_xlabel("replicas (workers x 8 cores)")
    ax.set_ylabel("predicted communication per step (ms)")
    ax.set_title("BigGAN config (gan.py biggan512): alpha-beta model")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(plot)), exist_ok=True)
    fig.savefig(plot, dpi=120)
    print(f"\nplot written to {os.path.relpath(plot)}")


def main() -> None:
    n = jax.device_count()
    print(f"# cost model benchmark: {n} emulated CPU devices, {os.cpu_count()} host cores, jax {jax.__version__}")
    if not ARGS.skip_measure:
        topologies = {"1x8": calibrate(1, 8, repeats=ARGS.repeats), "2x4": calibrate(2, 4, repeats=ARGS.repeats)}
        print_calibration(topologies)
        if ARGS.calibrate_only:
            return
        measure(topologies)
    if not ARGS.skip_biggan:
        biggan(ARGS.plot)


if __name__ == "__main__":
    main()
