"""Where the first call of a replicated step goes, against the hand-written program's first call.

Each measurement is a fresh Python process (a first call is a cold process:
nothing traced, compiled or cached yet), N emulated CPU devices, the training
step of ``benchmarks/bench_step.py`` (Adam, global batch ``--batch``, the state
on the mesh, a host batch). Variants:

* ``single``      ``jax.jit`` of the step on one device, on the global batch;
* ``shard_map``   hand-written ``jit(shard_map(... lax.pmean ...))`` on the N devices;
* ``shard_map-flat``  the same with the gradients averaged as one flat buffer
  (``jax.flatten_util.ravel_pytree``, one ``pmean``, unravelled): tensor fusion by hand;
* ``replicator``  ``Replicator(1, N).run`` with the default pipeline (what users get:
  ``REPLICATOR_VERIFY`` unset, whatever the caller's environment says);
* ``replicator+cache``  the same in a process whose persistent compilation cache
  (``jax_compilation_cache_dir``, a fresh temporary directory per repeat) was filled
  by one earlier process running the same step: XLA's compilation is read from it;
* ``replicator-unfused``  ``PassManager.default(disable=["fuse-collectives"])``: where the
  rest of XLA's compile time goes (the fused buffer's slices; see below);
* ``replicator-static-slices``  ``PassManager.default(disable=["share-slice-kernels"])``: the
  fused buffer cut at offsets XLA sees (one kernel per tensor; see ``--why-kernels``).

A first call is timed from building the variant (mesh, state placed) to its first
result ready on the host; the phases inside it are read from JAX's own duration events
(``jax.monitoring``: tracing to a jaxpr, lowering to StableHLO, XLA's backend compile)
and from timers around replicator's phases (``trace_step``, each pass of the pipeline,
folding, ``build_executable``). ``other`` is the rest (placing state and batch,
dispatch, the step's execution, Python glue). The first call's CPU time (``time.process_time``,
every thread of the process) is printed too: on a machine shared with other work it
moves less than wall-clock time.

Printed: median seconds per phase over ``--repeats`` processes per variant (variants
interleaved: repeat r runs every variant once, the order reversed every other repeat),
the ratio of each first call to the hand-written one, and the cache hits and misses JAX
reported (``/jax/compilation_cache/cache_hits`` and ``cache_misses``).

With ``--why-kernels``, instead: why a fused gradient buffer costs XLA compile time on
CPU. 128 tensors (64 of 32 x 32, 64 of 32) are all-reduced and each result then goes
through ``y * c + 1``, compiled under ``jit(shard_map)`` three ways: as a tuple
``psum`` with one ``c`` for all (``tuple``), as a tuple with a different ``c`` per
tensor (``tuple, distinct``), and as one concatenated buffer sliced back (``fused``,
what ``fuse-collectives`` emits, one ``c``). XLA's CPU backend compiles one kernel
per *distinct* fusion; a slice at its own offset makes every consumer distinct.

Usage::

    python benchmarks/first_call.py                         # mlp64x32, 8 devices, 3 repeats
    python benchmarks/first_call.py --workload mlp16x128 --repeats 5
    python benchmarks/first_call.py --import-from /tmp/replicator-OLD   # another checkout's replicator/
    python benchmarks/first_call.py --why-kernels
    python benchmarks/first_call.py --no-gc      # Python's garbage collector off during each first call
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

VARIANTS = (
    "single",
    "shard_map",
    "shard_map-flat",
    "replicator",
    "replicator+cache",
    "replicator-unfused",
    "replicator-static-slices",
)
#: JAX's duration events (seconds), by the label printed for them.
JAX_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "jax: trace to jaxpr",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "jax: lower to StableHLO",
    "/jax/core/compile/backend_compile_duration": "jax: XLA compile",
}
TOTALS = ("first call", "first call, CPU", "second call")
CACHE_EVENTS = ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses")
#: A child that takes longer than this is killed (nothing ever hangs).
CHILD_TIMEOUT_S = 600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--workload", default="mlp64x32", help="mlpDxW (depth x width)")
    p.add_argument("--batch", type=int, default=512, help="global batch size")
    p.add_argument("--repeats", type=int, default=3, help="processes per variant; medians are printed")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--import-from", default=None, metavar="DIR", help="import replicator from DIR")
    p.add_argument("--why-kernels", action="store_true", help="time XLA's compile of fused vs unfused buffers")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--no-gc", action="store_true", help="Python's garbage collector off during each first call (where it lands)"
    )
    return p.parse_args(argv)


# -- one first call (in the child process) -------------------------------------------------


class PhaseTimer:
    """Seconds per phase: replicator's phases by wrappers, JAX's by its duration events, each
    event filed under the replicator phase that was running when JAX reported it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.counts: dict[str, int] = collections.defaultdict(int)
        self.current = ""
        self._undo: list[Callable[[], None]] = []

    def on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event in JAX_EVENTS:
            where = f" (in {self.current})" if self.current else ""
            self.seconds[JAX_EVENTS[event] + where] += duration

    def on_event(self, event: str, **_: Any) -> None:
        if event in CACHE_EVENTS:
            self.counts[event.rsplit("/", 1)[1]] += 1

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        outer, self.current = self.current, label
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[label] += time.perf_counter() - t0
            self.current = outer

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(label):
                return original(*args, **kwargs)

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original))


def child(args: argparse.Namespace) -> dict:
    """Build the variant, make its first call, return the phases (seconds) as a dict."""
    variant = args.child
    if variant.startswith("replicator"):
        os.environ.pop("REPLICATOR_VERIFY", None)  # the user's default
        os.environ.pop("REPLICATOR_VALIDATE", None)
    sys.path.insert(0, args.import_from or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.argv = [sys.argv[0], "--devices", str(args.devices)]  # bench_step parses its own flags at import
    import bench_step as bench
    import jax
    import jax.monitoring

    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    timer = PhaseTimer()
    jax.monitoring.register_event_duration_secs_listener(timer.on_duration)
    jax.monitoring.register_event_listener(timer.on_event)
    depth, width = (int(v) for v in args.workload.removeprefix("mlp").split("x"))
    params = bench.mlp_init(depth, width)
    if variant.startswith("replicator"):
        import replicator.api as api

        timer.wrap(api, "trace_step", "replicator: trace_step")
        timer.wrap(api, "fold_lowered", "replicator: fold")
        timer.wrap(api, "build_executable", "replicator: build_executable")
    import replicator as rp

    passes = rp.PassManager.default().passes

    def pass_label(p: Any) -> str:
        return f"replicator: pass {p.name}"

    for p in passes:  # every PassManager.default() builds new pass objects: time the classes' run
        timer.wrap(type(p), "run", pass_label(p))
    if args.no_gc:
        import gc

        gc.disable()  # a full collection of the heap would otherwise land in whichever phase crosses its threshold
    t0, cpu0 = time.perf_counter(), time.process_time()
    if variant == "single":
        run = bench.single_variant(params, width, args.batch)
    elif variant == "shard_map":
        run = bench.shard_map_variant(params, width, args.batch, args.devices)
    elif variant == "shard_map-flat":
        run = bench.shard_map_flat_variant(params, width, args.batch, args.devices)
    else:
        disable = {
            "replicator-unfused": ("fuse-collectives",),
            "replicator-static-slices": ("share-slice-kernels",),
        }.get(variant, ())
        run = bench.replicator_variant(params, width, args.batch, args.devices, disable)
    jax.block_until_ready(run())
    first, first_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    second = time.perf_counter() - t0
    phases = dict(timer.seconds)
    phases["first call"] = first
    phases["first call, CPU"] = first_cpu
    phases["second call"] = second
    return {"phases": phases, "counts": dict(timer.counts)}


# -- why: distinct kernels ------------------------------------------------------------------


def why_kernels(args: argparse.Namespace) -> None:
    """CPU seconds of XLA's compile of 128 all-reduced tensors: tuple, tuple with distinct consumers, fused."""
    sys.path.insert(0, args.import_from or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import replicator as rp

    rp.force_cpu_devices(args.devices)
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("d",))
    xs = [np.ones(shape, np.float32) for shape in [(32, 32), (32,)] * 64]

    def program(mode: str) -> Any:
        def per_device(xs: list) -> list:
            xs = [x * 2 for x in xs]
            if mode == "fused":
                buf = lax.psum(lax.concatenate([x.reshape(-1) for x in xs], 0), "d")
                ys, offset = [], 0
                for x in xs:
                    ys.append(lax.slice(buf, (offset,), (offset + x.size,)).reshape(x.shape))
                    offset += x.size
            else:
                ys = lax.psum(xs, "d")
            factors = range(3, 3 + len(ys)) if mode == "tuple, distinct" else [3] * len(ys)
            return [y * c + 1 for y, c in zip(ys, factors, strict=True)]

        return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))

    modes = ("tuple", "tuple, distinct", "fused")
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            lowered = program(mode).lower(xs)
            t0 = time.process_time()
            compiled = lowered.compile()
            cpu[mode].append(time.process_time() - t0)
            del compiled
    print(f"XLA compile, CPU seconds (all threads), median of {args.repeats}, {args.devices} emulated CPU devices:")
    for mode in modes:
        print(f"  {mode:<16} {statistics.median(cpu[mode]):.2f}")


# -- the driver -------------------------------------------------------------------------------


def run_child(args: argparse.Namespace, variant: str, cache_dir: str | None = None) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", variant]
    command += ["--devices", str(args.devices), "--workload", args.workload, "--batch", str(args.batch)]
    if args.import_from:
        command += ["--import-from", args.import_from]
    if cache_dir:
        command += ["--cache-dir", cache_dir]
    if args.no_gc:
        command += ["--no-gc"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def first_call_with_cache(args: argparse.Namespace) -> dict:
    """The replicator's first call in a process whose compilation cache an earlier process filled."""
    with tempfile.TemporaryDirectory(prefix="replicator-cache-") as cache_dir:
        filled = run_child(args, "replicator", cache_dir)
        entries = len(os.listdir(cache_dir))
        result = run_child(args, "replicator+cache", cache_dir)
        result["counts"]["entries written by the first process"] = entries
        result["counts"]["entries added by the second process"] = len(os.listdir(cache_dir)) - entries
        result["counts"]["misses of the first process"] = filled["counts"].get("cache_misses", 0)
    return result


def main() -> int:
    args = parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.why_kernels:
        why_kernels(args)
        return 0
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
    load = os.getloadavg()
    print(
        f"first call, {args.workload}, global batch {args.batch}, {args.devices} emulated CPU devices on "
        f"{os.cpu_count()} cores, {args.repeats} processes per variant; load average {load[0]:.2f}"
    )
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            result = first_call_with_cache(args) if variant == "replicator+cache" else run_child(args, variant)
            results[variant].append(result)
            print(f"  repeat {r}: {variant:<18} first call {result['phases']['first call']:.2f} s", flush=True)
    report(results, "shard_map" if "shard_map" in results else variants[0])
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


def report(results: dict[str, list[dict]], reference: str) -> None:
    labels: list[str] = []
    for runs in results.values():
        for run in runs:
            labels += [k for k in run["phases"] if k not in labels and k not in TOTALS]
    medians = {
        v: {k: statistics.median(run["phases"].get(k, 0.0) for run in runs) for k in [*labels, *TOTALS]}
        for v, runs in results.items()
    }
    names = list(results)
    print(f"\nmedian seconds over processes ({', '.join(f'{v}: {len(results[v])}' for v in names)})\n")
    print("| phase | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label in sorted(labels, key=lambda k: (k.startswith("jax"), k)):
        print(f"| {label} | " + " | ".join(f"{medians[v][label]:.3f}" for v in names) + " |")
    print("| **first call** | " + " | ".join(f"**{medians[v]['first call']:.2f}**" for v in names) + " |")
    ref = medians[reference]["first call"]
    print(f"| ratio to {reference} | " + " | ".join(f"{medians[v]['first call'] / ref:.2f}x" for v in names) + " |")
    cpu = medians[reference]["first call, CPU"]
    print(
        "| first call, CPU seconds (all threads) | "
        + " | ".join(f"{medians[v]['first call, CPU']:.2f}" for v in names)
        + " |"
    )
    print(
        f"| CPU ratio to {reference} | "
        + " | ".join(f"{medians[v]['first call, CPU'] / cpu:.2f}x" for v in names)
        + " |"
    )
    print(
        "| second call | "
        + " | ".join(f"{statistics.median(r['phases']['second call'] for r in results[v]):.3f}" for v in names)
        + " |"
    )
    for v, runs in results.items():
        counts = collections.Counter()
        for run in runs:
            counts.update(run["counts"])
        if counts:
            print(f"\n{v}: summed over its processes: " + ", ".join(f"{k} {c}" for k, c in sorted(counts.items())))


if __name__ == "__main__":
    sys.exit(main())
