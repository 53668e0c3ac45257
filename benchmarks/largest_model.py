"""The largest model each variant trains within a per-device memory budget, from XLA's memory analysis alone.

For GSPMD replicated, GSPMD FSDP and Replicator's ZeRO stages 0-3
(``benchmarks/zero_variants.py``), a binary search over one size of a workload
(``benchmarks/zero_workloads.py``) finds the largest whose compiled step's peak
per device (arguments + outputs - aliased + temporaries) fits the budget. Each
probe lowers and compiles the step from shapes only (``jax.ShapeDtypeStruct``
state); nothing runs, so the figures are exact and the same on every run.

* ``--workload mlp``: the width of the issue's MLP (``--depth`` layers, Adam,
  global batch ``--batch``), in multiples of ``--unit`` (default 64, a multiple
  of the device count so that every variant can split the weights);
* ``--workload transformer-scan``: the number of blocks under ``lax.scan``
  (width ``--width``), in multiples of ``--unit`` (default: the device count, so
  that stage 3 can split the stacked parameters).

Usage::

    python benchmarks/largest_model.py                                      # MLP widths, 64 MiB, 8 devices
    python benchmarks/largest_model.py --workload transformer-scan
    python benchmarks/largest_model.py --budget-mib 32 --variants zero1,zero3
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import replicator as rp  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("mlp", "transformer-scan"), default="mlp")
    p.add_argument("--budget-mib", type=float, default=64.0, help="per-device budget in MiB (default 64)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--variants", default="gspmd-replicated,gspmd-fsdp,zero0,zero1,zero2,zero3")
    p.add_argument("--unit", type=int, default=None, help="search step (default: 64 for MLP widths, N for depths)")
    p.add_argument("--depth", type=int, default=8, help="MLP layers (mlp)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the workload's)")
    p.add_argument("--width", type=int, default=64, help="model width (transformer-scan)")
    p.add_argument("--max-units", type=int, default=256, help="give up above this many units")
    args = p.parse_args(argv)
    if args.unit is None:
        args.unit = 64 if args.workload == "mlp" else args.devices
    if args.unit < 1 or args.budget_mib <= 0:
        p.error("--unit and --budget-mib must be positive")
    return args


ARGS = parse_args()
rp.force_cpu_devices(ARGS.devices)

import jax  # noqa: E402
from zero_variants import VARIANTS, Program, compile_variant  # noqa: E402
from zero_workloads import Workload, mlp, transformer_scan  # noqa: E402

MiB = 2.0**20


def build(size: int) -> Workload:
    """The workload at ``size`` (an MLP width or a number of blocks), state as shapes only."""
    batch = {} if ARGS.batch is None else {"batch": ARGS.batch}
    if ARGS.workload == "mlp":
        return mlp(width=size, depth=ARGS.depth, abstract=True, **batch)
    return transformer_scan(width=ARGS.width, depth=size, abstract=True, **batch)


def parameter_count(workload: Workload) -> int:
    params = workload.state[0]  # (params, optimizer state) for both workloads searched
    return sum(leaf.size for leaf in jax.tree.leaves(params))


def largest(name: str, budget: int) -> tuple[int, Program | None, int]:
    """The largest size (a multiple of ``--unit``) whose step fits ``budget`` bytes per device, its program,
    and how many sizes were compiled. 0 and None if even one unit does not fit."""
    probes: dict[int, Program] = {}

    def fits(units: int) -> bool:
        probes[units] = compile_variant(name, build(units * ARGS.unit))
        return probes[units].peak <= budget

    lo, hi = 0, 1
    while hi <= ARGS.max_units and fits(hi):
        lo, hi = hi, hi * 2
    if hi > ARGS.max_units:
        raise SystemExit(f"{name}: still fits at {lo * ARGS.unit}; raise --max-units or lower --budget-mib")
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * ARGS.unit, probes.get(lo), len(probes)


def main() -> int:
    variants = [v.strip() for v in ARGS.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    budget = int(ARGS.budget_mib * MiB)
    size_name = "width" if ARGS.workload == "mlp" else "blocks"
    example = build(ARGS.unit)
    batch = jax.tree.leaves(example.batches[0])[0].shape[0]
    if ARGS.workload == "mlp":
        title = f"MLP of {ARGS.depth} width x width tanh layers, Adam, global batch {batch}"
    else:
        title = f"pre-LN transformer blocks under lax.scan, width {ARGS.width}, Adam, global batch {batch}"
    print(
        f"{title} ({size_name} searched in steps of {ARGS.unit}), {jax.device_count()} devices; "
        f"largest {size_name} whose compiled step's peak per device fits {ARGS.budget_mib:g} MiB"
    )
    print(
        f"| variant | largest {size_name} | parameters | x gspmd-replicated's parameters "
        "| peak per device | state per device | sizes compiled |"
    )
    print("|---|---|---|---|---|---|---|")
    baseline = None
    for name in variants:
        size, program, compiled = largest(name, budget)
        if program is None:
            print(f"| {name} | none fits | | | | | {compiled} |")
            continue
        count = parameter_count(build(size))
        baseline = count if name == "gspmd-replicated" else baseline
        ratio = f"{count / baseline:.2f}" if baseline else ""
        print(
            f"| {name} | {size} | {count / 1e6:.2f} M | {ratio} | {program.peak / MiB:.2f} MiB "
            f"| {program.stored / MiB:.2f} MiB | {compiled} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
