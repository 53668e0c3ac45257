"""Tensor parallelism: replicator's rewrite against GSPMD and a hand-written shard_map Megatron MLP.

    python benchmarks/bench_tensor.py [--devices 8] [--degrees 1,2,4] [--rounds 7] [--steps 5]

The model: L residual MLP blocks (h -> 4h -> h, gelu), AdamW, the loss a mean
square. Three programs of the same step at each tensor degree T, on T devices:

* **replicator**: ``TensorParallel(step, plan, size=T)`` with the plan
  ``fc1: column, fc2: row``, from the one-device step;
* **GSPMD**: ``jax.jit`` of the one-device step with the same placements as
  ``NamedSharding`` on every state leaf (parameters and Adam's moments) and a
  ``with_sharding_constraint`` on each block's hidden activation (MaxText's
  way); XLA's propagation decides the rest;
* **hand shard_map**: the Megatron MLP written by hand under ``shard_map``
  (column-split ``fc1``, row-split ``fc2``, one ``psum`` forward, the
  backward by ``jax.grad`` of the local program with a ``psum`` of the input
  gradient), the same AdamW.

Each is checked against ``jax.jit`` of the step on one device (the new state and
the loss, relative to each leaf's largest value), then timed: rounds
interleave the variants in a rotating order, each round times ``--steps`` steps of each, and the
table gives the median step and the median of each round's ratio to GSPMD.
Memory per device is XLA's compiled memory analysis; collectives are counted
in the compiled HLO.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    return p.parse_args()


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import replicator as rp  # noqa: E402
from replicator.tensor import Shard, TensorParallel  # noqa: E402

# eps well above rounding: Adam divides each gradient by its own size, so with the default eps a
# gradient near zero turns two programs' rounding differences into whole steps of the learning rate.
OPT = optax.adamw(1e-3, eps=1e-4)


def make_params(blocks: int, h: int) -> list:
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * blocks)
    return [
        {
            "fc1": jax.random.normal(keys[2 * i], (h, 4 * h)) / np.sqrt(h),
            "fc2": jax.random.normal(keys[2 * i + 1], (4 * h, h)) / np.sqrt(4 * h),
        }
        for i in range(blocks)
    ]


def loss_fn(params: list, x: jax.Array, y: jax.Array, constrain=lambda a: a) -> jax.Array:
    for p in params:
        x = x + constrain(jax.nn.gelu(x @ p["fc1"])) @ p["fc2"]
    return jnp.mean((x - y) ** 2)


def step(state: tuple, batch: tuple) -> tuple:
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


PLAN = {"0/*/fc1": "column", "0/*/fc2": "row"}


def spec_of(p) -> P:
    if isinstance(p, Shard):
        return P(*[("tensor" if d == p.dim else None) for d in range(p.dim + 1)])
    return P()


def build_gspmd(state, batch, placements: dict, mesh: Mesh):
    leaves, tree = jax.tree_util.tree_flatten(state)
    specs = [spec_of(p) for p in placements.values()]
    shardings = jax.tree_util.tree_unflatten(tree, [NamedSharding(mesh, s) for s in specs])
    hidden = NamedSharding(mesh, P(None, "tensor"))

    def gspmd_step(state, batch):
        params, opt_state = state
        constrain = lambda a: jax.lax.with_sharding_constraint(a, hidden)  # noqa: E731
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, *batch, constrain=constrain))(params)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    replicated = NamedSharding(mesh, P())
    fn = jax.jit(
        gspmd_step,
        in_shardings=(shardings, (replicated, replicated)),
        out_shardings=(shardings, replicated),
    )
    placed = jax.device_put(state, shardings)
    return fn, placed


def build_hand(state, batch, placements: dict, mesh: Mesh):
    """Megatron's MLP by hand: local column/row matmuls, f and g as psums."""
    leaves, tree = jax.tree_util.tree_flatten(state)
    specs = jax.tree_util.tree_unflatten(tree, [spec_of(p) for p in placements.values()])

    @jax.custom_vjp
    def f(x):  # forward: identity; backward: all-reduce
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (jax.lax.psum(g, "tensor"),))

    @jax.custom_vjp
    def g(x):  # forward: all-reduce; backward: identity
        return jax.lax.psum(x, "tensor")

    g.defvjp(lambda x: (jax.lax.psum(x, "tensor"), None), lambda _, dy: (dy,))

    def local_loss(params, x, y):
        for p in params:
            x = x + g(jax.nn.gelu(f(x) @ p["fc1"]) @ p["fc2"])
        return jnp.mean((x - y) ** 2)

    def local_step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(local_loss)(params, *batch)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    mapped = jax.shard_map(local_step, mesh=mesh, in_specs=(specs, (P(), P())), out_specs=(specs, P()), check_vma=False)
    fn = jax.jit(mapped)
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)
    return fn, jax.device_put(state, shardings)


def max_rel_error(got, want) -> float:
    errs = []
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errs.append(float(np.max(np.abs(a - b))) / max(1.0, float(np.max(np.abs(b)))))
    return max(errs)


def count_collectives(compiled_text: str) -> dict:
    out = {}
    for name in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all"):
        out[name] = compiled_text.count(f" {name}(") + compiled_text.count(f" {name}-start(")
    return out


def time_steps(fn, state, batch, steps: int) -> float:
    out = None
    start = time.perf_counter()
    for _ in range(steps):
        out = fn(state, batch)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def main() -> None:
    args = _parse()
    rp.force_cpu_devices(args.devices)  # before JAX starts its backend
    degrees = [int(d) for d in args.degrees.split(",")]
    params = make_params(args.blocks, args.hidden)
    state = (params, OPT.init(params))
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    batch = (jax.random.normal(kx, (args.batch, args.hidden)), jax.random.normal(ky, (args.batch, args.hidden)))
    want = jax.jit(step)(state, batch)
    print(
        f"# tensor benchmark: jax {jax.__version__}, {args.devices} emulated CPU devices, {os.cpu_count()} host "
        f"cores; {args.blocks} MLP blocks h={args.hidden} (4h hidden), batch {args.batch}, AdamW; "
        f"{args.rounds} interleaved rounds x {args.steps} steps, medians\n"
    )
    rows = []
    for T in degrees:
        mesh = Mesh(np.array(jax.devices()[:T]), ("tensor",))
        tp = TensorParallel(step, PLAN, size=T)
        placements = tp.placements(state, batch)
        variants = {
            "replicator": (tp, tp.shard(state, batch)),
            "GSPMD": build_gspmd(state, batch, placements, mesh),
            "hand shard_map": build_hand(state, batch, placements, mesh),
        }
        info = {}
        for name, (fn, placed) in variants.items():
            got = fn(placed, batch)
            err = max_rel_error(got, want)
            if err > 1e-5:
                raise SystemExit(f"{name} at T = {T} differs from one device by {err:.1e} (relative): not timed")
            lowered = tp.lower(state, batch) if name == "replicator" else fn.lower(placed, batch)
            compiled = lowered.compile()
            mem = compiled.memory_analysis()
            info[name] = {
                "err": err,
                "args": mem.argument_size_in_bytes,
                "temps": mem.temp_size_in_bytes,
                "peak": mem.argument_size_in_bytes
                + mem.output_size_in_bytes
                + mem.temp_size_in_bytes
                - mem.alias_size_in_bytes,
                "coll": count_collectives(compiled.as_text()),
                "times": [],
                "ratios": [],
            }
            fn(placed, batch)  # warm
        names = list(variants)
        for r in range(args.rounds):
            # The order rotates round by round: no variant always runs first, or after the same one.
            order = names[r % len(names) :] + names[: r % len(names)]
            times = {name: time_steps(*variants[name], batch, args.steps) for name in order}
            for name, t in times.items():
                info[name]["times"].append(t)
                info[name]["ratios"].append(t / times["GSPMD"])
        for name, d in info.items():
            rows.append((T, name, d))
    print(
        "| T | variant | median step (ms) | / GSPMD (paired median) | max rel. error vs one device | "
        "arguments (KiB) | temporaries (KiB) | peak (KiB) | all-reduce | all-gather | reduce-scatter |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T, name, d in rows:
        c = d["coll"]
        print(
            f"| {T} | {name} | {1e3 * statistics.median(d['times']):.2f} | {statistics.median(d['ratios']):.2f} | "
            f"{d['err']:.1e} | {d['args'] / 1024:.1f} | {d['temps'] / 1024:.1f} | {d['peak'] / 1024:.1f} | "
            f"{c['all-reduce']} | {c['all-gather']} | {c['reduce-scatter']} |"
        )


if __name__ == "__main__":
    main()
