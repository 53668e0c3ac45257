"""Sequence parallelism: per-device memory and collectives of transformer blocks, with and without it.

    python benchmarks/bench_sequence.py [--devices 8] [--degrees 2,4] [--blocks 4] [--batch 4] [--seq 256] [--hidden 256]

The model: ``--blocks`` pre-LayerNorm transformer blocks (separate q, k, v projections split by columns,
the heads with them, the output projection and the MLP's second matrix by rows), one SGD step of the mean
square of the output. At each tensor degree T, ``TensorParallel(step, plan, size=T)`` without and with
``sequence_parallel=1``; each is checked against ``jax.jit`` of the step on one device, then compiled, and
XLA's compiled memory analysis gives the bytes per device (arguments, outputs, temporaries), and the
compiled HLO the collectives. These are properties of the compiled programs, not timings: the same on a
loaded machine. The activations between the tensor-parallel regions (the residual stream, the layer
norms' inputs and outputs) are what sequence parallelism splits: Megatron's activation memory per layer
falls from ``sbh(10 + 24/t + ...)`` to ``sbh(34/t + ...)``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--degrees", default="2,4")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    return p.parse_args()


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import replicator as rp  # noqa: E402
from replicator.tensor import TensorParallel  # noqa: E402

PLAN = {"*/wq": "column", "*/wk": "column", "*/wv": "column", "*/wo": "row", "*/fc1": "column", "*/fc2": "row"}


def norm(x, g):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g


def block(p, x, heads):
    h = norm(x, p["ln1"])
    b, s, d = x.shape
    q, k, v = (jnp.reshape(h @ p[n], (b, s, heads, d // heads)) for n in ("wq", "wk", "wv"))
    a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(x.shape) @ p["wo"]
    return x + jax.nn.gelu(norm(x, p["ln2"]) @ p["fc1"]) @ p["fc2"]


def make(blocks: int, h: int, heads: int):
    def loss(params, x):
        for p in params:
            x = block(p, x, heads)
        return jnp.mean(x**2)

    def step(params, x):
        value, g = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda a, b: a - 0.01 * b, params, g), value

    params = []
    for i in range(blocks):
        k = jax.random.split(jax.random.key(i), 6)
        params.append(
            {
                "ln1": jnp.ones(h),
                "ln2": jnp.ones(h),
                **{n: jax.random.normal(k[j], (h, h)) / np.sqrt(h) for j, n in enumerate(("wq", "wk", "wv", "wo"))},
                "fc1": jax.random.normal(k[4], (h, 4 * h)) / np.sqrt(h),
                "fc2": jax.random.normal(k[5], (4 * h, h)) / np.sqrt(4 * h),
            }
        )
    return step, params


def collectives(text: str) -> dict[str, int]:
    kinds = ("all-reduce", "reduce-scatter", "all-gather")
    return {k: len(re.findall(rf"= \S+ {k}(?:-start)?\(", text)) for k in kinds}


def main() -> None:
    args = _parse()
    rp.force_cpu_devices(args.devices)  # before JAX starts its backend
    step, params = make(args.blocks, args.hidden, args.heads)
    x = jax.random.normal(jax.random.key(99), (args.batch, args.seq, args.hidden))
    want = jax.jit(step)(params, x)
    print(f"{args.blocks} blocks, batch {args.batch}, sequence {args.seq}, hidden {args.hidden}, {args.heads} heads")
    print(
        "| T | sequence parallel | max rel. error | arguments MiB | temporaries MiB | temporaries vs plain | collectives |"
    )
    print("|---|---|---|---:|---:|---:|---|")
    for t in (int(d) for d in args.degrees.split(",")):
        plain_temp = None
        for sp in (None, 1):
            tp = TensorParallel(step, PLAN, size=t, sequence_parallel=sp)
            got = tp(tp.shard(params, x), x)
            err = max(
                float(jnp.max(jnp.abs(a - b))) / max(1.0, float(jnp.max(jnp.abs(b))))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
            )
            compiled = tp.lower(params, x).compile()
            memory = compiled.memory_analysis()
            temp = memory.temp_size_in_bytes
            plain_temp = temp if sp is None else plain_temp
            counts = collectives(compiled.as_text())
            shown = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
            print(
                f"| {t} | {'yes' if sp else 'no'} | {err:.1e} | {memory.argument_size_in_bytes / 2**20:.2f} | "
                f"{temp / 2**20:.2f} | {temp / plain_temp:.2f} | {shown} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
