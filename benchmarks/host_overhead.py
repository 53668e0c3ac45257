"""Where the host time of one ``Replicator.run`` call goes, against a hand-written ``jit(shard_map)`` call.

One process, N emulated CPU devices, ``Replicator(1, N)``. Workloads (a host
batch every step, as a training loop has):

* ``trivial``: one ``rp.all_mean`` of a scalar (the mean of the replica's batch
  rows), a scalar state; nothing but overhead.
* ``leaves64``: the same collective, a state of 64 small leaves and a batch of
  8 leaves (the per-leaf costs of the host path).

The hand-written program is ``jax.jit(jax.shard_map(...lax.pmean...))`` on the
same mesh, the state replicated, called two ways: ``shard_map (hand)`` is given the
NumPy batch itself (the jitted function's own dispatch places it by the program's
input sharding; the reference of the overheads printed), ``shard_map (hand,
device_put)`` first puts it on the devices with one ``jax.device_put(batch,
NamedSharding(mesh, P(('workers', 'cores'))))``. Every variant keeps at most 2 steps
in flight (``Replicator``'s default on CPU).

Printed, variants interleaved round by round (order reversed every other
round), medians over rounds:

1. microseconds per step of each variant and the overhead over the hand-written
   call given the NumPy batch, ``shard_map (hand)`` (``--rounds``, ``--steps``):
   the difference of the medians (``over hand``) and the median of the rounds'
   differences (``paired``: steadier on a loaded machine);
   ``replicator`` is the default (no prefetch on CPU devices: the NumPy batch goes
   to the compiled step's own dispatch, as in the hand-written call),
   ``prefetch=1`` draws and places the next batch with ``jax.device_put`` right
   after each dispatch, ``replicator, batch given`` is given each batch itself
   (``repl.run(step_fn, batch, state)``, where ``run`` takes one). ``python benchmarks/host_overhead.py --workloads trivial``
   is the trivial step with a host batch every call against the hand-written
   call given the same NumPy batch, interleaved, medians;
2. the phase breakdown of one steady-state call of the default Replicator
   (skip it with ``--no-breakdown``): the same loop with a ``time.perf_counter_ns`` wrapper around each
   phase of ``Replicator.run`` (drawing from ``input_fn``, checking the batch,
   the compile-cache lookup, placing state and batch, waiting for room in
   flight, the dispatch of the compiled step); the rest of the call is the
   ``other`` row (Python glue, pytrees, freeing the previous step's arrays, and time the
   host thread loses to the device threads on shared cores). The wrappers cost about 1 us each, so these rounds run
   separately from the rounds of table 1. Phases are found by name in the
   installed ``replicator`` (older and newer layouts of the host path both);
3. with ``--prefetch-table``: the caller reads an output after every step
   (``float(out[...])``, as logging the loss does) and ``input_fn`` does some
   work (a fresh random batch of 512 x 64 floats), by default and with
   ``prefetch=1``, where the Replicator has that option;
4. with ``--cprofile K``: the K functions with the most own time over a profiled
   steady-state loop of the ``trivial`` workload;
5. with ``--count-calls``: the Python calls (``sys.setprofile`` "call" events) each
   variant makes per steady-state step of the ``trivial`` workload, by function beyond
   the hand-written call's, and whether any frame of jax's ``pjit.py`` ran (a miss of
   the jitted function's C++ fast path). Deterministic: it does not depend on the
   machine's load, unlike the timings.

Usage::

    python benchmarks/host_overhead.py                       # 8 devices, 9 rounds x 300 steps
    python benchmarks/host_overhead.py --rounds 15 --prefetch-table
    python benchmarks/host_overhead.py --import-from /tmp/replicator-HEAD   # another checkout's replicator/

``--import-from DIR`` imports ``replicator`` from ``DIR`` (a directory holding a
``replicator/`` package, e.g. ``git archive HEAD replicator | tar -x -C DIR``),
to profile an earlier commit with this script.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=300, help="steps per variant per round")
    p.add_argument("--workloads", default="trivial,leaves64")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip the phase breakdown")
    p.add_argument("--prefetch-table", action="store_true", help="also time a loop that reads an output every step")
    p.add_argument("--cprofile", type=int, default=0, metavar="K", help="print the K top functions by own time")
    p.add_argument("--cprofile-workload", default="trivial", help="the workload --cprofile profiles")
    p.add_argument("--count-calls", action="store_true", help="print the Python calls per step of each variant")
    p.add_argument("--import-from", default=None, metavar="DIR", help="import replicator from DIR")
    return p.parse_args(argv)


ARGS = parse_args()
sys.path.insert(0, ARGS.import_from or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import replicator as rp  # noqa: E402

rp.force_cpu_devices(ARGS.devices)

import inspect  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from timing import interleaved_samples  # noqa: E402

AXES = ("workers", "cores")
MAX_IN_FLIGHT = 2
HAS_PREFETCH = "prefetch" in inspect.signature(rp.Replicator.run).parameters
#: Whether ``run`` takes a batch itself in place of ``input_fn`` (its annotation names the iterator form too).
HAS_GIVEN_BATCH = "Iterator" in str(inspect.signature(rp.Replicator.run).parameters["input_fn"].annotation)

Step = Callable[[], Any]  # one step; returns something to block on


# -- workloads -------------------------------------------------------------------


def make_workload(name: str, n: int) -> tuple[Any, Callable[[Any], Any], Callable, Callable]:
    """``(state0, input_fn, replicator step_fn, hand-written per-replica fn)`` of a workload."""
    leaves = {"trivial": (1, 1), "leaves64": (64, 8)}[name]
    n_state, n_batch = leaves
    rows = 8 * n
    state0 = [np.zeros((), np.float32)] if n_state == 1 else [np.zeros((4,), np.float32) for _ in range(n_state)]
    batch = {f"x{i}": np.ones((rows,), np.float32) for i in range(n_batch)}

    def input_fn(ctx: Any) -> Any:
        while True:
            yield batch

    def step_fn(state: list, b: dict) -> tuple[list, dict]:
        m = rp.all_mean(jnp.mean(b["x0"]))
        return [s + m for s in state], {"m": m}

    def per_replica(state: list, b: dict) -> tuple[list, dict]:
        m = lax.pmean(jnp.mean(b["x0"]), AXES)
        return [s + m for s in state], {"m": m[None]}

    return state0, input_fn, step_fn, per_replica


def replicator_step(
    workload: str, n: int, *, sync: bool = False, given: bool = False, **run_kwargs: Any
) -> tuple[Step, rp.Replicator]:
    """``Replicator.run`` of the workload; ``given``: ``run`` is given each batch itself, not ``input_fn``."""
    state0, input_fn, step_fn, _ = make_workload(workload, n)
    if sync:
        input_fn = working_input(n)
    repl = rp.Replicator(1, n)
    holder = {"state": repl.broadcast_state(state0)}
    batches = input_fn(None)

    def run() -> Any:
        source = next(batches) if given else input_fn
        holder["state"], out = repl.run(step_fn, source, holder["state"], **run_kwargs)
        if sync:
            float(out["m"][0])
        return holder["state"]

    return run, repl


def hand_step(workload: str, n: int, mesh: Any, *, sync: bool = False, device_put: bool = False) -> Step:
    """The hand-written ``jit(shard_map)`` call; ``device_put``: place the NumPy batch first (else the jitted
    function is given the NumPy batch and places it itself)."""
    state0, input_fn, _, per_replica = make_workload(workload, n)
    if sync:
        input_fn = working_input(n)
    state_specs = [P()] * len(state0)
    program = jax.jit(
        jax.shard_map(
            per_replica, mesh=mesh, in_specs=(state_specs, P(AXES)), out_specs=(state_specs, P(AXES)), check_vma=False
        )
    )
    target = NamedSharding(mesh, P(AXES))
    holder = {"state": jax.device_put(state0, NamedSharding(mesh, P()))}
    batches = input_fn(None)
    in_flight: collections.deque = collections.deque()

    def run() -> Any:
        batch = jax.device_put(next(batches), target) if device_put else next(batches)
        while len(in_flight) >= MAX_IN_FLIGHT:
            in_flight.popleft().block_until_ready()
        holder["state"], out = program(holder["state"], batch)
        in_flight.append(holder["state"][0])
        if sync:
            float(out["m"][0])
        return holder["state"]

    return run


def working_input(n: int) -> Callable[[Any], Any]:
    """An ``input_fn`` that does some host work per batch: a fresh random batch of 512 x 64 floats."""

    def input_fn(ctx: Any) -> Any:
        rng = np.random.default_rng(0)
        while True:
            yield {"x0": rng.standard_normal((512, 64), np.float32).mean(axis=1)[: 8 * n]}

    return input_fn


# -- timing ----------------------------------------------------------------------


def interleaved(variants: dict[str, Step], rounds: int, steps: int) -> dict[str, list[float]]:
    """Microseconds per step of each variant, one sample per round, variants interleaved; the host blocks only at
    the end of a round (each variant bounds its own queue)."""
    samples = interleaved_samples(variants, rounds, steps, warmup=20, max_in_flight=None)
    return {name: [s * 1e6 for s in v] for name, v in samples.items()}


# -- the phase breakdown -----------------------------------------------------------

#: Phases of ``Replicator.run``: (label, [(module, attribute path), ...]); every path that exists is wrapped.
#: Earlier and later layouts of the host path are both listed; none of these calls another one of them.
PHASES: list[tuple[str, list[tuple[str, str]]]] = [
    ("input_fn (draw a batch)", [("replicator.runtime.inputs", "WorkerInputs.next_batches")]),
    (
        "batch checks",
        [("replicator.api", "check_worker_batch"), ("replicator.runtime.inputs", "BatchChecker.check")],
    ),
    ("compile-cache lookup", [("replicator.api", "Replicator._compile"), ("replicator.api", "Replicator._lookup")]),
    ("state placement", [("replicator.api", "place_state")]),
    ("batch placement", [("replicator.api", "place_batch"), ("replicator.runtime.inputs", "place_batch")]),
    ("in-flight bound (wait)", [("replicator.api", "Replicator._wait_for_room")]),
]
DISPATCH = "dispatch (jit call)"
OTHER = "other (progress, pytrees, glue)"


class PhaseClock:
    """Accumulates nanoseconds per phase while installed."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = collections.defaultdict(int)
        self._undo: list[Callable[[], None]] = []
        self.found: dict[str, list[str]] = collections.defaultdict(list)

    def _wrap(self, label: str, fn: Callable) -> Callable:
        ns = self.ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[label] += time.perf_counter_ns() - t0

        return timed

    def install(self) -> None:
        import importlib

        for label, candidates in PHASES:
            for module_name, path in candidates:
                owner: Any = importlib.import_module(module_name)
                *parents, attr = path.split(".")
                for parent in parents:
                    owner = getattr(owner, parent, None)
                fn = getattr(owner, attr, None) if owner is not None else None
                if fn is None:
                    continue
                raw = owner.__dict__[attr]
                setattr(owner, attr, self._wrap(label, fn) if not isinstance(raw, staticmethod) else raw)
                self._undo.append(lambda owner=owner, attr=attr, raw=raw: setattr(owner, attr, raw))
                self.found[label].append(f"{module_name}.{path}")

    def wrap_executables(self, repl: rp.Replicator) -> None:
        for compiled in repl._compiled.values():
            original = compiled.executable
            compiled.executable = self._wrap(DISPATCH, original)
            self._undo.append(lambda c=compiled, e=original: setattr(c, "executable", e))

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def breakdown(workload: str, n: int, mesh: Any, rounds: int, steps: int) -> None:
    """Median microseconds per call of each phase, Replicator and hand-written call interleaved."""
    run, repl = replicator_step(workload, n)
    hand = hand_step(workload, n, mesh)
    for _ in range(20):
        run(), hand()
    jax.block_until_ready((run(), hand()))
    clock = PhaseClock()
    clock.install()
    clock.wrap_executables(repl)
    per_round: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for r in range(rounds):
            order = [("replicator", run), ("hand", hand)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                clock.ns.clear()
                t0 = time.perf_counter_ns()
                for _ in range(steps):
                    out = fn()
                jax.block_until_ready(out)
                total = (time.perf_counter_ns() - t0) / steps / 1e3
                if name == "hand":
                    per_round["hand"].append(total)
                    continue
                phases = {label: clock.ns.get(label, 0) / steps / 1e3 for label, _ in PHASES}
                phases[DISPATCH] = clock.ns.get(DISPATCH, 0) / steps / 1e3
                phases[OTHER] = total - sum(phases.values())
                for label, value in phases.items():
                    per_round[label].append(value)
                per_round["total"].append(total)
    finally:
        clock.uninstall()
    print(f"\nphase breakdown, {workload}: median us per steady-state call over {rounds} rounds x {steps} steps")
    for label, _ in PHASES:
        where = ", ".join(clock.found.get(label, [])) or "(not found in this replicator)"
        print(f"  {label:<34} {statistics.median(per_round[label]):8.1f}   {where}")
    print(f"  {DISPATCH:<34} {statistics.median(per_round[DISPATCH]):8.1f}")
    print(f"  {OTHER:<34} {statistics.median(per_round[OTHER]):8.1f}")
    print(f"  {'total (instrumented)':<34} {statistics.median(per_round['total']):8.1f}")
    print(f"  {'hand-written call, same rounds':<34} {statistics.median(per_round['hand']):8.1f}")


def cprofile(workload: str, n: int, steps: int, top: int) -> None:
    import cProfile
    import pstats

    run, _ = replicator_step(workload, n)
    for _ in range(50):
        run()
    jax.block_until_ready(run())
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        out = run()
    jax.block_until_ready(out)
    profile.disable()
    print(f"\ncProfile, {workload}, {steps} steps (own time; the jit call's C++ path counts as the caller's):")
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def calls_per_step(fn: Step, steps: int = 50) -> tuple[float, collections.Counter]:
    """Median Python calls per call of ``fn`` (steady state), and the calls by ``file:function`` over ``steps``."""
    for _ in range(20):
        fn()
    jax.block_until_ready(fn())
    per_step: list[int] = []
    by_function: collections.Counter = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            per_step[-1] += 1
            code = frame.f_code
            parts = code.co_filename.replace(os.sep, "/").split("/")
            by_function[f"{'/'.join(parts[-2:])}:{code.co_name}"] += 1

    for _ in range(steps):
        per_step.append(0)
        sys.setprofile(profile)
        try:
            out = fn()
        finally:
            sys.setprofile(None)
        jax.block_until_ready(out)
    return statistics.median(per_step), by_function


def count_calls(n: int, mesh: Any, steps: int = 50) -> None:
    """The Python calls per steady-state step of each variant of the ``trivial`` workload."""
    variants: dict[str, Step] = {"shard_map (hand)": hand_step("trivial", n, mesh)}
    variants["replicator"] = replicator_step("trivial", n)[0]
    if HAS_GIVEN_BATCH:
        variants["replicator, batch given"] = replicator_step("trivial", n, given=True)[0]
    counted = {name: calls_per_step(fn, steps) for name, fn in variants.items()}
    reference, reference_calls = counted["shard_map (hand)"]
    print(f"\nPython calls per steady-state step, trivial (median of {steps} steps; beyond the hand-written call):")
    for name, (calls, by_function) in counted.items():
        pjit = sorted(k for k in by_function if "/pjit.py:" in k)
        print(f"  {name:<30} {calls:6.1f} ({calls - reference:+.1f}); jax's pjit.py frames: {pjit or 'none'}")
        extra = by_function - reference_calls
        for function, count in sorted(extra.items(), key=lambda kv: (-kv[1], kv[0])):
            if count / steps >= 0.5:
                print(f"      {count / steps:5.1f}  {function}")


# -- main ------------------------------------------------------------------------------


def report(title: str, samples: dict[str, list[float]], reference: str) -> None:
    """Medians over rounds, and the median over rounds of each round's difference from the reference (the
    variants of one round ran back to back, so a load that changes between rounds cancels there)."""
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\n{title}")
    print(f"  {'variant':<30} {'us/step':>9} {'over hand':>10} {'ratio':>7} {'paired':>8}   (min-max over rounds)")
    for name, value in med.items():
        lo, hi = min(samples[name]), max(samples[name])
        paired = statistics.median(a - b for a, b in zip(samples[name], samples[reference], strict=True))
        print(
            f"  {name:<30} {value:9.1f} {value - med[reference]:+10.1f} {value / med[reference]:7.2f} {paired:+8.1f}"
            f"   ({lo:.0f}-{hi:.0f})"
        )


def main() -> int:
    n = ARGS.devices
    mesh = rp.Replicator(1, n).mesh
    load = os.getloadavg()
    print(
        f"JAX {jax.__version__}, {n} emulated CPU devices on {os.cpu_count()} cores, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; replicator from {os.path.dirname(rp.__file__)}"
        f"{'' if HAS_PREFETCH else ' (no prefetch option)'}"
    )
    for workload in ARGS.workloads.split(","):
        variants: dict[str, Step] = {"shard_map (hand)": hand_step(workload, n, mesh)}
        variants["shard_map (hand, device_put)"] = hand_step(workload, n, mesh, device_put=True)
        variants["replicator"] = replicator_step(workload, n)[0]
        if HAS_GIVEN_BATCH:
            variants["replicator, batch given"] = replicator_step(workload, n, given=True)[0]
        if HAS_PREFETCH:
            variants["replicator prefetch=1"] = replicator_step(workload, n, prefetch=1)[0]
        samples = interleaved(variants, ARGS.rounds, ARGS.steps)
        report(f"{workload}: {ARGS.rounds} rounds x {ARGS.steps} steps, medians", samples, "shard_map (hand)")
        if ARGS.breakdown:
            breakdown(workload, n, mesh, ARGS.rounds, ARGS.steps)
    if ARGS.prefetch_table:
        variants = {"shard_map (hand)": hand_step("trivial", n, mesh, sync=True)}
        variants["replicator"] = replicator_step("trivial", n, sync=True)[0]
        if HAS_PREFETCH:
            variants["replicator prefetch=1"] = replicator_step("trivial", n, sync=True, prefetch=1)[0]
        samples = interleaved(variants, ARGS.rounds, ARGS.steps // 3)
        report(
            f"reading an output every step, input_fn making a random batch: {ARGS.rounds} rounds x "
            f"{ARGS.steps // 3} steps, medians",
            samples,
            "shard_map (hand)",
        )
    if ARGS.cprofile:
        cprofile(ARGS.cprofile_workload, n, ARGS.steps * 3, ARGS.cprofile)
    if ARGS.count_calls:
        count_calls(n, mesh)
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
