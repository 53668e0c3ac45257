"""Why replicator's tensor-parallel step was slower than GSPMD's: the programs and the calls, apart.

    python benchmarks/why_tensor.py [--devices 8] [--degrees 2,4] [--rounds 21] [--steps 5]

The model and the three variants are ``bench_tensor.py``'s (replicator's ``TensorParallel``,
GSPMD, Megatron's MLP by hand under ``shard_map``). For each tensor degree T this prints

1. **the compiled programs**: the entry computation's instructions by kind (fusions, dots,
   all-reduces, copies, transposes, dynamic slices, loops, custom calls, ``partition-id``), what
   replicator's and the hand-written program hold that GSPMD's does not (every computation's
   instructions by opcode and shape),
   XLA's cost analysis (flops, bytes accessed) and memory analysis (arguments, outputs,
   temporaries, aliased bytes), and whether the state's buffers are donated;
2. **the host's work per call** outside the jitted call: replicator's cache key and pytree
   handling, now and as it was before this script (``np.shape`` and ``str(dtype)`` per leaf,
   two flattens; emulated here so that both run in one process);
3. **step times**, rounds interleaving the variants in a rotating order, each round ``--steps``
   steps of each: every variant called as the benchmark calls it (the state placed, the batch
   as ``jax.random`` made it, on device 0), replicator's jitted call on the flattened leaves
   (no wrapper), and each variant's compiled executable called on the same arguments placed
   as it takes them (the device's work and the C++ dispatch alone), and, as a check,
   replicator's program with the ``add_any`` rule summing a partial cotangent at each addition of a
   replicated one (GSPMD's order). Until the interpreter kept such sums in two parts
   (``interpret._PendingSum``), the default absorbed the replicated term into the partial sum with a
   ``select`` on ``partition-id`` (about 4% of the step at T = 2); the two programs are now the
   same. Medians, the median of each round's ratio to GSPMD (paired) and the geometric mean of
   those ratios with a 95% interval.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import statistics
import sys
import time
import timeit

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_tensor as bt  # noqa: E402

import replicator as rp  # noqa: E402
from replicator.tensor import rules  # noqa: E402
from replicator.tensor.parallelize import _signature  # noqa: E402

KINDS = (
    "fusion",
    "dot",
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "copy",
    "transpose",
    "dynamic-slice",
    "dynamic-update-slice",
    "while",
    "custom-call",
    "partition-id",
    "parameter",
)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--degrees", default="2,4")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    return p.parse_args()


def entry_ops(text: str) -> collections.Counter:
    """Instructions of the entry computation by opcode."""
    ops: collections.Counter = collections.Counter()
    for line in text[text.index("\nENTRY") :].splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%\S+ = .*?\b([a-z][a-z\-]*)\(", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def all_instructions(text: str) -> collections.Counter:
    """Every instruction of every computation (fusions' bodies included) by opcode and result shape."""
    found: collections.Counter = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\S+) ([a-z][a-z\-]*)\(", line)
        if m:
            found[f"{m.group(2)} {m.group(1)}"] += 1
    return found


def differences(a, b) -> str:
    """How two compiled programs differ in their instructions (opcode and shape, every computation): what
    one has more of than the other; "none" where they hold the same instructions (names and the order of
    operands aside)."""
    ia, ib = all_instructions(a.as_text()), all_instructions(b.as_text())
    more, fewer = ia - ib, ib - ia
    if not more and not fewer:
        return f"none ({sum(ia.values())} instructions each)"
    shown = lambda c: ", ".join(f"{n} x {k}" for k, n in sorted(c.items())) or "nothing"  # noqa: E731
    return f"it has {shown(more)} more; {shown(fewer)} fewer"


def describe(name: str, compiled) -> str:
    text = compiled.as_text()
    ops = entry_ops(text)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    counts = ", ".join(f"{k} {ops[k]}" for k in KINDS if ops[k])
    return (
        f"  {name:15s} {sum(ops.values())} instructions: {counts}\n"
        f"  {'':15s} flops {cost.get('flops', 0):.4g}, bytes accessed {cost.get('bytes accessed', 0):.4g}; "
        f"arguments {mem.argument_size_in_bytes}, outputs {mem.output_size_in_bytes}, temporaries "
        f"{mem.temp_size_in_bytes}, aliased {mem.alias_size_in_bytes} B; donated: "
        f"{'input_output_alias' in text}"
    )


def _previous_key(state, batch) -> tuple:
    leaves = jax.tree_util.tree_leaves((state, batch))
    return (
        jax.tree_util.tree_structure((state, batch)),
        tuple((np.shape(x), str(getattr(x, "dtype", None) or np.result_type(x))) for x in leaves),
    )


def previous_call(tp, state, batch):
    """``TensorParallel.__call__`` as it was before this script: its key by np.shape and str(dtype) per
    leaf, then the leaves flattened again for the call."""
    fn, _, _, out_tree, _ = tp._build(state, batch)
    built = {_previous_key(state, batch): (fn, out_tree)}

    def call(state, batch):
        fn, out_tree = built[_previous_key(state, batch)]
        outs = fn(*jax.tree_util.tree_leaves((state, batch)))
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return call


def host_us(stmt) -> float:
    n = 2000
    return 1e6 * min(timeit.repeat(stmt, number=n, repeat=5)) / n


def degree(T: int, args: argparse.Namespace, state, batch, want) -> None:
    """The programs, the host's work and the step times at tensor degree ``T``."""
    mesh = Mesh(np.array(jax.devices()[:T]), ("tensor",))
    tp = bt.TensorParallel(bt.step, bt.PLAN, size=T)
    placements = tp.placements(state, batch)
    rplaced = tp.shard(state, batch)
    g, gplaced = bt.build_gspmd(state, batch, placements, mesh)
    h, hplaced = bt.build_hand(state, batch, placements, mesh)
    placed_batch = jax.device_put(batch, NamedSharding(mesh, P()))
    fn = tp._build(state, batch)[0]
    rleaves = jax.tree_util.tree_leaves((rplaced, batch))
    rleaves_placed = jax.tree_util.tree_leaves((rplaced, placed_batch))
    rexe = tp.lower(state, batch).compile()
    # The check: the same step with the add_any rule summing a partial cotangent at each addition of a
    # replicated one (as GSPMD's program does); the rule is restored at once.
    absorbing = rules.RULES["add_any"]
    rules.RULES["add_any"] = rules._all_partial_or(rules._elementwise)
    try:
        sum_first = bt.TensorParallel(bt.step, bt.PLAN, size=T)
        sexe = sum_first.lower(state, batch).compile()
    finally:
        rules.RULES["add_any"] = absorbing
    gexe = g.lower(gplaced, batch).compile()
    hexe = h.lower(hplaced, batch).compile()
    print(f"\n## T = {T}\n\ncompiled programs (entry computation):")
    for name, exe in (
        ("replicator", rexe),
        ("replicator, add_any summing first", sexe),
        ("GSPMD", gexe),
        ("hand shard_map", hexe),
    ):
        print(describe(name, exe))
    print("instructions of replicator's program against GSPMD's (every computation):", differences(rexe, gexe))
    print("instructions of the hand-written program against GSPMD's:", differences(hexe, gexe))
    old = previous_call(tp, rplaced, batch)
    now_us = host_us(lambda: _signature(*jax.tree_util.tree_flatten((rplaced, batch))))
    before_us = host_us(lambda: _previous_key(rplaced, batch))
    print(
        f"host work per call, the cache key of {len(jax.tree_util.tree_leaves((rplaced, batch)))} leaves "
        f"(min of 5 x 2000 calls): now {now_us:.1f} us, before {before_us:.1f} us"
    )
    variants = {
        "replicator": lambda: tp(rplaced, batch),
        "replicator, previous call": lambda: old(rplaced, batch),
        "replicator jit(*leaves)": lambda: fn(*rleaves),
        "GSPMD": lambda: g(gplaced, batch),
        "hand shard_map": lambda: h(hplaced, batch),
        "replicator executable": lambda: rexe(*rleaves_placed),
        "replicator executable, add_any summing first": lambda: sexe(*rleaves_placed),
        "GSPMD executable": lambda: gexe(gplaced, placed_batch),
        "hand executable": lambda: hexe(hplaced, placed_batch),
    }
    for name, f in variants.items():
        err = bt.max_rel_error(f(), want)
        if err > 1e-5:
            raise SystemExit(f"{name} at T = {T} differs from one device by {err:.1e}")
        jax.block_until_ready(f())
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    loads = []
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            f = variants[name]
            start = time.perf_counter()
            for _ in range(args.steps):
                out = f()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / args.steps)
        loads.append(os.getloadavg()[0])
    print(f"step times (load average {min(loads):.1f}-{max(loads):.1f}):")
    print(
        "| variant | median step (ms) | / GSPMD (paired median) | / GSPMD (geometric mean, 95% interval) |\n"
        "|---|---:|---:|---:|"
    )
    for name, ts in times.items():
        ratios = [a / b for a, b in zip(ts, times["GSPMD"], strict=True)]
        logs = [math.log(x) for x in ratios]
        half = 2 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
        mean = statistics.mean(logs)
        print(
            f"| {name} | {1e3 * statistics.median(ts):.2f} | {statistics.median(ratios):.3f} | "
            f"{math.exp(mean):.3f} ({math.exp(mean - half):.3f}-{math.exp(mean + half):.3f}) |"
        )


def main() -> None:
    args = _parse()
    rp.force_cpu_devices(args.devices)
    params = bt.make_params(args.blocks, args.hidden)
    state = (params, bt.OPT.init(params))
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    batch = (jax.random.normal(kx, (args.batch, args.hidden)), jax.random.normal(ky, (args.batch, args.hidden)))
    want = jax.jit(bt.step)(state, batch)
    print(
        f"# why_tensor: jax {jax.__version__}, {args.devices} emulated CPU devices, {os.cpu_count()} host cores, "
        f"load average {os.getloadavg()[0]:.1f}; {args.blocks} MLP blocks h={args.hidden}, batch {args.batch}; "
        f"{args.rounds} rotating rounds x {args.steps} steps"
    )
    for T in [int(d) for d in args.degrees.split(",")]:
        degree(T, args, state, batch, want)


if __name__ == "__main__":
    main()
