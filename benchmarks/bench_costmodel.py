"""The communication cost model against measurement, and BigGAN's predicted communication.

(a) Calibrate (``rp.tools.calibrate``) the emulated CPU mesh as 1 x 8 and 2 x 4,
then for each workload on 1, 2, 4 and 8 devices compare the model's predicted
communication time (``Replicator.explain(...).predict(calibrated)``) with the
measured one: the median step time with the collectives minus the median step
time of the same step without them (same devices, same inputs; variants
interleaved round by round, ``benchmarks/timing.py``). Workloads:

* ``50 x 1000 fused``    50 ``all_sum``s of 1000 floats, default pipeline (one fused bucket)
* ``50 x 1000 unfused``  the same with ``fuse-collectives`` disabled (50 collectives)
* ``ring`` / ``tree``    the fused bucket lowered as a ring / a binary tree (``all_reduce_algorithm``)
* ``2xC`` / ``2xC +hier``  two workers, flat and with ``hierarchical-allreduce`` (8 devices)
* ``mlp16x128``          Adam on a 16 x 128 MLP, ``rp.all_mean`` of the gradients (global batch 512)

1 x N workloads are predicted with the 1 x 8 calibration, 2 x 4 ones with the 2 x 4 one.

(a, two processes) With ``--processes 2`` the script re-launches itself with
``python -m replicator.launch`` as 2 worker processes of 4 emulated CPU
devices each (gloo), so that the ``'workers'`` axis of the 2 x 4 mesh crosses
the process boundary. Every worker calibrates the mesh (``calibrate(2, 4)``),
then times ``50 x 1000`` fused, unfused, ``ring``, ``tree`` and fused
``+hierarchical``, and ``mlp16x128 all_mean``, with and without their
collectives, round by round; each worker feeds its own part of the batch.
Worker 0 prints the calibration and the table, predicted with this
calibration, and the prediction of the single-process ``cpu-emulated`` preset
for comparison. Part (b) is not run in this mode.

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
    python benchmarks/bench_costmodel.py --processes 2     # (a) on 2 processes x 4 devices
    python benchmarks/bench_costmodel.py --processes 2 --rounds 1 --steps 2 --repeats 1  # a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import replicator as rp  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="emulated CPU devices (in all processes)")
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run (a) as a job of this many processes (python -m replicator.launch), devices split evenly",
    )
    p.add_argument(
        "--max-time", type=float, default=1800.0, help="with --processes: stop the job after this many seconds"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one process of such a job
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


# Worker processes: give up on a silent peer after this long (the launcher's default, 10 s, is
# short for a loaded 2-core machine); stop the job when no worker moved for this long while one
# waits for another.
HEARTBEAT_TIMEOUT_S, STEP_TIMEOUT_S = 60, 120


def launch_processes(args: argparse.Namespace) -> int:
    """Run (a) as a job of ``args.processes`` worker processes; returns the launcher's exit code.

    Worker 0's lines go to stdout without their prefix (the tables); the
    other workers' lines and gloo's connection messages go to stderr.

    Every wait is bounded: the launcher stops the job after ``--max-time``
    seconds, a dead worker is noticed after :data:`HEARTBEAT_TIMEOUT_S`, a
    stalled one after :data:`STEP_TIMEOUT_S`.
    """
    if args.processes < 2 or args.devices % args.processes:
        raise SystemExit(f"--processes {args.processes} must be >= 2 and divide --devices {args.devices}.")
    command = [
        *(sys.executable, "-m", "replicator.launch"),
        *("--num-workers", str(args.processes), "--cores-per-worker", str(args.devices // args.processes)),
        *("--max-time", f"{args.max_time:g}", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)),
        *("--step-timeout", str(STEP_TIMEOUT_S)),
        *(os.path.abspath(__file__), "--worker"),
        *("--rounds", str(args.rounds), "--steps", str(args.steps), "--repeats", str(args.repeats)),
        *(["--calibrate-only"] if args.calibrate_only else []),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPLICATOR_", "SLURM_", "OMPI_"))}
    proc = subprocess.Popen(command, env=env, cwd=os.path.join(HERE, ".."), stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # ends when the launcher exits (bounded by --max-time)
            ours = line.removeprefix("[worker 0] ")
            # gloo's threads print their connection messages at once: pieces of lines, mixed
            noise = ours is line or "[Gloo]" in ours or "connected peer ranks" in ours
            print(line if noise else ours, end="", file=sys.stderr if noise else sys.stdout, flush=True)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # interrupted: the launcher stops its workers on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


ARGS = parse_args()
if ARGS.processes > 1 and not ARGS.worker:
    sys.exit(launch_processes(ARGS))
if ARGS.worker:
    from replicator.runtime import distributed  # noqa: E402

    INFO = distributed.initialize()  # before JAX starts: the launcher's settings, gloo collectives
else:
    INFO = None
    rp.force_cpu_devices(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from timing import time_interleaved  # noqa: E402

from replicator.core.graph import CollectiveRecord  # noqa: E402
from replicator.cost.collectives import collective_time  # noqa: E402
from replicator.cost.topology import PRESETS, Topology  # noqa: E402
from replicator.runtime.execution import sharded  # noqa: E402
from replicator.tools.calibrate import calibrate  # noqa: E402

# -- (a) calibration ---------------------------------------------------------------------


def print_calibration(topologies: dict[str, Topology]) -> None:
    print("\n### Calibrated links (`rp.tools.calibrate`)\n")
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
    print("\ncompute (`calibrate_compute`, every device at once):\n")
    for label, topo in topologies.items():
        if topo.compute is not None:
            c = topo.compute
            print(
                f"- {label}: {c.seconds_per_element * 1e9:.3f} ns per element-wise op, "
                f"{c.seconds_per_flop * 1e9:.4f} ns per matrix-product flop ({c})"
            )
    topo = topologies.get("2x4")
    if topo is not None:
        print(
            f"\n'cpu-emulated' preset figures: cores={topo.cores!r}, workers={topo.workers!r}, "
            f"p2p_cores={topo.p2p_cores!r}, p2p_workers={topo.p2p_workers!r}, "
            f"native_latency={topo.native_latency!r}, compute={topo.compute!r}"
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
    shape = (N_TENSORS, TENSOR_SIZE)

    def make(step, pipeline):
        repl = rp.Replicator(workers, cores, passes=pipeline, devices=devices)
        if jax.process_count() == 1:
            placed = jax.device_put(np.ones((workers * cores, *shape), np.float32), sharded(repl.mesh))

            def input_fn(ctx):
                while True:
                    yield {"x": placed}

        else:

            def input_fn(ctx):  # this worker's own rows, placed once as its part of the global batch
                mine = np.full((cores, *shape), ctx.worker_id + 1.0, np.float32)
                placed = jax.make_array_from_process_local_data(sharded(repl.mesh), mine, (workers * cores, *shape))
                while True:
                    yield {"x": placed}

        return repl, input_fn, (lambda: repl.run(step, input_fn))

    repl, input_fn, with_comm = make(allreduce_step, rp.PassManager.default(**options))
    report = repl.explain(allreduce_step, {"x": np.ones((cores, N_TENSORS, TENSOR_SIZE), np.float32)})
    _, _, without = make(allreduce_local, rp.PassManager.default())
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


def mlp_case(workers: int, cores: int):
    """(runner with collectives, runner without, report) for Adam on the 16 x 128 MLP, global batch 512."""
    devices = jax.devices()[: workers * cores]

    def input_fn(ctx):  # each worker its own pool, its share of the global batch
        rng = np.random.default_rng(1 + ctx.worker_id)
        pool = [{k: rng.normal(size=(BATCH, WIDTH)).astype(np.float32) for k in ("x", "y")} for _ in range(4)]
        rows = ctx.worker_batch_size(BATCH)
        i = 0
        while True:
            yield {k: v[:rows] for k, v in pool[i % len(pool)].items()}
            i += 1

    def make(step, pipeline):
        repl = rp.Replicator(workers, cores, passes=pipeline, devices=devices)
        params = mlp_params()
        state = [(params, TX.init(params))]

        def run():
            state[0], out = repl.run(step, input_fn, state[0])
            return out["loss"]

        return repl, run

    repl, with_comm = make(mlp_step, rp.PassManager.default())
    params = mlp_params()
    report = repl.explain(mlp_step, input_fn, (params, TX.init(params)))
    # Without the all-mean the state differs between replicas: the invariance check would
    # (rightly) reject the step, so it is off for this timing-only baseline.
    _, without = make(mlp_local, rp.PassManager.default(disable=["check-replica-invariance"]))
    return with_comm, without, report


def measure(topologies: dict[str, Topology]) -> None:
    counts = [k for k in (1, 2, 4, 8) if k <= jax.device_count()]
    cases = {}  # (devices, label) -> (mesh, with, without, report, topology)
    for n in counts:
        flat = topologies["1x8"]
        for label, options in (
            ("50 x 1000 fused", {}),
            ("50 x 1000 unfused", {"disable": ["fuse-collectives"]}),
            ("50 x 1000 ring", {"all_reduce_algorithm": "ring"}),
            ("50 x 1000 tree", {"all_reduce_algorithm": "reduce_broadcast"}),
        ):
            cases[(n, label)] = (f"1x{n}", *allreduce_case(1, n, **options), flat)
        cases[(n, "mlp16x128 all_mean")] = (f"1x{n}", *mlp_case(1, n), flat)
    if 8 in counts:
        two = topologies["2x4"]
        cases[(8, "2x4 fused")] = ("2x4", *allreduce_case(2, 4), two)
        cases[(8, "2x4 fused +hierarchical")] = ("2x4", *allreduce_case(2, 4, hierarchical=True), two)
    print_table(cases, time_rounds(cases), "Predicted vs measured communication")


def measure_processes(topology: Topology, workers: int, cores: int) -> None:
    """(a) on a mesh whose workers are processes; worker 0 prints the table."""
    cases = {}
    for label, options in (
        ("50 x 1000 fused", {}),
        ("50 x 1000 unfused", {"disable": ["fuse-collectives"]}),
        ("50 x 1000 ring", {"all_reduce_algorithm": "ring"}),
        ("50 x 1000 tree", {"all_reduce_algorithm": "reduce_broadcast"}),
        ("50 x 1000 fused +hierarchical", {"hierarchical": True}),
    ):
        cases[(workers * cores, label)] = (f"{workers}x{cores}", *allreduce_case(workers, cores, **options), topology)
    cases[(workers * cores, "mlp16x128 all_mean")] = (f"{workers}x{cores}", *mlp_case(workers, cores), topology)
    rounds = time_rounds(cases)  # every worker runs the same steps; worker 0's clock is reported
    if jax.process_index() == 0:
        title = f"Predicted vs measured communication, {workers} processes x {cores} devices (gloo)"
        print_table(cases, rounds, title, compare="cpu-emulated")


def time_rounds(cases: dict) -> list[dict[str, float]]:
    """Seconds per step of each case with and without its collectives, one dict per round."""
    variants = {}
    for (n, label), (_, with_comm, without, *_rest) in cases.items():
        variants[f"{n}|{label}|with"] = with_comm
        variants[f"{n}|{label}|without"] = without
    # One interleaved round at a time, so that each round gives a paired difference
    # (with - without) measured a few seconds apart: drift in the machine's load cancels.
    return [time_interleaved(variants, 1, ARGS.steps) for _ in range(ARGS.rounds)]


def print_table(cases: dict, rounds: list[dict[str, float]], title: str, compare: str | None = None) -> None:
    """The markdown table; ``compare``: a preset whose prediction is an extra last column."""
    print(
        f"\n### {title} ({ARGS.rounds} interleaved rounds x {ARGS.steps} steps, "
        "medians; measured comm = median over rounds of (with - without), p25-p75 in brackets)\n"
    )
    extra = f" predicted by '{compare}' (ms) |" if compare else ""
    print(
        "| devices | mesh | workload | collectives | predicted (ms) | step with (ms) | step without (ms) "
        "| measured comm (ms) | measured / predicted |" + extra
    )
    print("|---:|---|---|---:|---:|---:|---:|---|---:|" + ("---:|" if compare else ""))
    for (n, label), (mesh, _, _, report, topo) in cases.items():
        pred = report.predict(topo).total_s
        with_ts = [r[f"{n}|{label}|with"] for r in rounds]
        without_ts = [r[f"{n}|{label}|without"] for r in rounds]
        diffs = [a - b for a, b in zip(with_ts, without_ts, strict=True)]
        comm = statistics.median(diffs)
        p25, _, p75 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (comm, comm, comm)
        ratio = f"{comm / pred:.2f}" if pred > 0 else "-"
        cell = f" {report.predict(compare).total_s * 1e3:.3f} |" if compare else ""
        print(
            f"| {n} | {mesh} | {label} | {report.num_collectives} | {pred * 1e3:.3f} "
            f"| {statistics.median(with_ts) * 1e3:.2f} | {statistics.median(without_ts) * 1e3:.2f} "
            f"| {comm * 1e3:.3f} [{p25 * 1e3:.2f}, {p75 * 1e3:.2f}] | {ratio} |" + cell
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
                parallelism=rp.Parallelism(replicas_per_device=replicas // len(devices)),
                passes=rp.PassManager.default(hierarchical=hierarchical),
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


def main_worker() -> None:
    """One process of a ``--processes`` job: calibrate the job's mesh, then (a) on it."""
    workers, cores = INFO.num_workers, INFO.cores_per_worker
    if jax.process_index() == 0:
        print(
            f"# cost model benchmark: {workers} processes x {cores} emulated CPU devices (gloo), "
            f"{os.cpu_count()} host cores, jax {jax.__version__}"
        )
    topology = calibrate(workers, cores, repeats=ARGS.repeats)  # the same figures on every worker
    if jax.process_index() == 0:
        print_calibration({f"{workers}x{cores} ({workers} processes)": topology})
    if not ARGS.calibrate_only:
        measure_processes(topology, workers, cores)


def main() -> None:
    if INFO is not None:
        main_worker()
        return
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
