"""Where the time of a replicated small-MLP step goes, on emulated CPU devices.

Splits the 8-replica training step into cumulative pieces, each a hand-written
``jit(shard_map)`` program, interleaved with the single-device step:

* ``fwd+bwd``            per-replica gradients only (no communication, no update)
* ``fwd+bwd+adam``       plus the (redundant, per-replica) Adam update
* ``+1 flat psum``       plus one all-reduce of the flattened gradients
* ``single``             the whole step on one device, global batch

If ``fwd+bwd`` alone on N emulated devices already costs more than the target
ratio times the single-device step, no rewrite of the communication can reach
the target on this machine: the devices share its cores, and every device runs
every operation of the network on its slice of the batch.

Usage::

    python benchmarks/why_mlp.py --depth 64 --width 32
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.argv, _argv = sys.argv[:1], sys.argv  # bench_step parses its own flags at import
import bench_step as bench  # noqa: E402

sys.argv = _argv

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def variant(params, width: int, batch: int, n: int, stage: str) -> bench.Runner:
    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    tx = bench.TX

    def per_replica(params, opt, x, y):
        loss, g = jax.value_and_grad(bench.mlp_loss)(params, x, y)
        if stage == "fwd+bwd":
            return params, opt, loss + sum(jnp.sum(leaf) for leaf in jax.tree.leaves(g))
        if stage == "+1 flat psum":
            flat, unravel = jax.flatten_util.ravel_pytree(g)
            g = unravel(lax.pmean(flat, "d"))
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, loss

    step = jax.jit(
        jax.shard_map(
            per_replica, mesh=mesh, in_specs=(P(), P(), P("d"), P("d")), out_specs=(P(), P(), P()), check_vma=False
        )
    )
    return bench.hand_runner(step, params, width, batch, NamedSharding(mesh, P()), NamedSharding(mesh, P("d")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=64)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    import jax.flatten_util  # noqa: F401

    n = jax.device_count()
    params = bench.mlp_init(args.depth, args.width)
    variants = {"single": bench.single_variant(params, args.width, args.batch)}
    for stage in ("fwd+bwd", "fwd+bwd+adam", "+1 flat psum"):
        variants[f"{n} replicas: {stage}"] = variant(params, args.width, args.batch, n, stage)
    variants[f"{n} replicas: replicator (default)"] = bench.replicator_variant(params, args.width, args.batch, n)
    medians = bench.time_interleaved(variants, args.rounds, args.steps)
    bench.print_table(f"mlp{args.depth}x{args.width}, global batch {args.batch}: cumulative cost", medians, "single")


if __name__ == "__main__":
    main()
