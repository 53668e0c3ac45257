"""ZeRO stages 0-3 against hand-written GSPMD: per-device memory and step time.

One process, N emulated CPU devices. One workload's one-device step
(``benchmarks/zero_workloads.py``: the issue's MLP, a Flax ResNet, transformer
blocks under ``lax.scan``) is compiled six ways (``benchmarks/zero_variants.py``):
GSPMD with the state replicated, GSPMD FSDP (every state leaf sharded along an
axis that divides by N), and ``rp.Replicator(1, N)`` with
``PassManager.default(zero=k)`` for k = 0..3.

Memory per device is XLA's compiled memory analysis of each program (exact, the
same on every run); state per device counts the bytes of the state leaves one
device stores. Step times are medians of interleaved rounds (noisy on a loaded
machine; compare the ratios within one run). Correctness: after 3 steps each
variant's state is compared with one-device ``jax.jit`` on the global batch;
the script exits 1 if a difference exceeds ``--tolerance``.

Usage::

    python benchmarks/bench_zero_stages.py                                  # the MLP, 8 devices
    python benchmarks/bench_zero_stages.py --workload resnet --rounds 3 --steps 3
    python benchmarks/bench_zero_stages.py --workload transformer-scan --rounds 3 --steps 3
    python benchmarks/bench_zero_stages.py --workload transformer-scan --memory-only   # compile only
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import replicator as rp  # noqa: E402

WORKLOAD_NAMES = ("mlp", "resnet", "transformer-scan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=WORKLOAD_NAMES, default="mlp")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument(
        "--memory-only", action="store_true", help="compile only: print each variant's memory breakdown, run nothing"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="largest relative error of the state's change over 3 steps against one-device jit (default 1e-3)",
    )
    return p.parse_args(argv)


ARGS = parse_args()
rp.force_cpu_devices(ARGS.devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from timing import time_interleaved  # noqa: E402
from zero_variants import VARIANTS, compile_variant  # noqa: E402
from zero_workloads import WORKLOADS  # noqa: E402

MiB = 2.0**20


def leaves64(tree, *, floating_only: bool = False) -> list[np.ndarray]:
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
    return [x.astype(np.float64) for x in leaves if not floating_only or np.issubdtype(x.dtype, np.floating)]


def max_difference(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(leaves64(a), leaves64(b), strict=True))


def relative_update_error(state, reference, initial) -> float:
    """``|state - reference| / |reference - initial|`` over the floating-point state leaves (Euclidean norms):
    how far off the 3 steps' change is. Adam moves an element whose gradient is near zero by about ``lr``
    either way, so a rounding difference can show in the max difference; a wrong update shows here."""
    state, reference, initial = (leaves64(t, floating_only=True) for t in (state, reference, initial))
    off = sum(float(np.sum((x - y) ** 2)) for x, y in zip(state, reference, strict=True))
    moved = sum(float(np.sum((y - z) ** 2)) for y, z in zip(reference, initial, strict=True))
    return float(np.sqrt(off / moved))


def print_memory(title: str, programs: dict) -> None:
    """Each variant's compiled memory per device, XLA's breakdown (peak = arguments + outputs - aliased +
    temporaries)."""
    print(f"{title}, {jax.device_count()} devices; XLA's compiled memory analysis per device, MiB")
    print("| variant | state | arguments | outputs | aliased | temporaries | peak |")
    print("|---|---|---|---|---|---|---|")
    for name, p in programs.items():
        m = p.memory
        sizes = (p.stored, m.arguments, m.outputs, m.aliased, m.temporaries, m.peak)
        print(f"| {name} | " + " | ".join(f"{b / MiB:.2f}" for b in sizes) + " |")


def main() -> int:
    if ARGS.memory_only:
        workload = WORKLOADS[ARGS.workload](abstract=True)
        print_memory(workload.title, {name: compile_variant(name, workload) for name in VARIANTS})
        return 0
    workload = WORKLOADS[ARGS.workload]()
    state = workload.state
    whole = sum(np.asarray(x).nbytes for x in jax.tree.leaves(state))

    reference = state
    ref_step = jax.jit(lambda s, b: workload.step(s, b, False))
    for b in workload.batches:
        reference, _ = ref_step(reference, b)

    programs = {name: compile_variant(name, workload) for name in VARIANTS}
    # correctness first: 3 steps of each from the initial state (each variant's first 3 batches) against jit
    boxes, errors, relative = {}, {}, {}
    for name, program in programs.items():
        current = program.place(state)
        for _ in workload.batches:
            current, _ = program.run(current)
        boxes[name] = [current]
        errors[name] = max_difference(current, reference)
        relative[name] = relative_update_error(current, reference, state)

    def runner(name):
        def run():
            boxes[name][0], loss = programs[name].run(boxes[name][0])
            return loss

        return run

    times = time_interleaved({name: runner(name) for name in programs}, ARGS.rounds, ARGS.steps)
    print(
        f"{workload.title}, {jax.device_count()} devices; whole state {whole / MiB:.2f} MiB; "
        f"median of {ARGS.rounds} interleaved rounds of {ARGS.steps} steps"
    )
    print(
        "| variant | state per device | x whole state | peak per device | x replicated peak | ms per step "
        "| x gspmd-fsdp time | max diff vs one device after 3 steps | relative error of the change |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    replicated_peak = programs["gspmd-replicated"].peak
    for name, p in programs.items():
        print(
            f"| {name} | {p.stored / MiB:.2f} MiB | {p.stored / whole:.3f} | {p.peak / MiB:.2f} MiB "
            f"| {p.peak / replicated_peak:.2f} | {times[name] * 1e3:.1f} "
            f"| {times[name] / times['gspmd-fsdp']:.2f} | {errors[name]:.1e} | {relative[name]:.1e} |"
        )
    worst = max(relative.values())
    if worst > ARGS.tolerance:
        print(f"FAIL: relative error of the change {worst:.1e} > tolerance {ARGS.tolerance:.0e}")
        return 1
    print(f"every variant's change within {ARGS.tolerance:.0e} (relative) of one-device jit's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
