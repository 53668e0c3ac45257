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

The residual stream's share is read from XLA's buffer assignment of each compiled program (the
``*after_optimizations-buffer-assignment.txt`` XLA writes with ``--xla_dump_to``): the bytes of the
temporary allocations' address ranges that ever hold a value of the residual stream's shape on a device,
``f32[b, s, h]`` without sequence parallelism and ``f32[b, s/T, h]`` with it, each byte counted once however
many values reuse it (the issue's goal: with it at most ``1.1 / T`` of the figure without it). With it the
table also gives the bytes of whole-sequence values of that shape: a layer norm's output all-gathered for
the column-parallel matmuls, the row-parallel matmuls' partial sums before their reduce-scatter.
``--layout sbh`` runs the model on Megatron's (sequence, batch, hidden) activations, split on dimension 0.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile

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
    p.add_argument(
        "--layout",
        choices=("bsh", "sbh"),
        default="bsh",
        help="the activations' dimensions: (batch, sequence, hidden), or Megatron's (sequence, batch, hidden)",
    )
    return p.parse_args()


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import replicator as rp  # noqa: E402
from replicator.tensor import TensorParallel  # noqa: E402

PLAN = {"*/wq": "column", "*/wk": "column", "*/wv": "column", "*/wo": "row", "*/fc1": "column", "*/fc2": "row"}


def norm(x, g):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5) * g


def block(p, x, heads, layout="bsh"):
    """A pre-LayerNorm block on ``x`` laid out ``(batch, sequence, hidden)`` or ``(sequence, batch, hidden)``."""
    h = norm(x, p["ln1"])
    n0, n1, d = x.shape
    q, k, v = (jnp.reshape(h @ p[n], (n0, n1, heads, d // heads)) for n in ("wq", "wk", "wv"))
    scores, mix = ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd") if layout == "bsh" else ("qbhd,kbhd->bhqk", "bhqk,kbhd->qbhd")
    a = jax.nn.softmax(jnp.einsum(scores, q, k) / np.sqrt(d // heads), axis=-1)
    x = x + jnp.einsum(mix, a, v).reshape(x.shape) @ p["wo"]
    return x + jax.nn.gelu(norm(x, p["ln2"]) @ p["fc1"]) @ p["fc2"]


def make(blocks: int, h: int, heads: int, layout: str = "bsh"):
    def loss(params, x):
        for p in params:
            x = block(p, x, heads, layout)
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


def residual_stream_bytes(dump: str, module: str, shapes: set[str]) -> int:
    """The bytes of the temporary allocations (not parameters, constants or outputs) in XLA's buffer assignment of
    the newest dump of ``module`` whose address ranges hold a value of one of ``shapes`` (``'f32[4,256,256]'``),
    each byte counted once."""
    files = sorted(glob.glob(os.path.join(dump, f"module_*.{module}.*after_optimizations-buffer-assignment.txt")))
    if not files:
        raise FileNotFoundError(f"no buffer assignment of {module} in {dump}")
    ranges: dict[int, list[tuple[int, int]]] = {}
    allocation, temporary = -1, False
    for line in open(files[-1]).read().split("Total bytes")[0].splitlines():
        head = re.match(r"allocation (\d+): size \d+(.*):$", line)
        if head:
            allocation = int(head.group(1))
            temporary = not any(k in head.group(2) for k in ("parameter", "constant", "maybe-live-out", "output"))
            continue
        value = re.match(r"\s*value: .*\(size=(\d+),offset=(\d+)\): (\w+\[[\d,]*\])", line)
        if value and temporary and value.group(3) in shapes:
            size, offset = int(value.group(1)), int(value.group(2))
            ranges.setdefault(allocation, []).append((offset, offset + size))
    total = 0
    for spans in ranges.values():  # the union of each allocation's ranges
        end = -1
        for start, stop in sorted(spans):
            total += max(0, stop - max(start, end))
            end = max(end, stop)
    return total


def main() -> None:
    args = _parse()
    dump = tempfile.mkdtemp(prefix="bench_sequence_xla_")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
    rp.force_cpu_devices(args.devices)  # before JAX starts its backend
    step, params = make(args.blocks, args.hidden, args.heads, args.layout)
    shape = (args.batch, args.seq, args.hidden) if args.layout == "bsh" else (args.seq, args.batch, args.hidden)
    seq_dim = 1 if args.layout == "bsh" else 0
    x = jax.random.normal(jax.random.key(99), shape)
    want = jax.jit(step)(params, x)
    print(
        f"{args.blocks} blocks, batch {args.batch}, sequence {args.seq}, hidden {args.hidden}, {args.heads} heads, "
        f"activations {args.layout}"
    )
    print(
        "| T | sequence parallel | max rel. error | arguments MiB | temporaries MiB | temporaries vs plain | "
        "residual stream MiB | residual stream vs plain (goal <= 1.1/T) | whole-sequence stream values MiB | collectives |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    b, n, h = args.batch, args.seq, args.hidden
    stream_shape = (lambda n: f"f32[{b},{n},{h}]") if args.layout == "bsh" else (lambda n: f"f32[{n},{b},{h}]")
    for t in (int(d) for d in args.degrees.split(",")):
        plain_temp = plain_stream = None
        whole, split = stream_shape(n), stream_shape(n // t)
        for sp in (None, seq_dim):
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
            text = compiled.as_text()
            module = re.match(r"HloModule (\S+?),", text).group(1)
            stream = residual_stream_bytes(dump, module, {whole if sp is None else split})
            gathered = stream if sp is None else residual_stream_bytes(dump, module, {whole})
            plain_stream = stream if sp is None else plain_stream
            counts = collectives(text)
            shown = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
            ratio = stream / plain_stream
            verdict = "" if sp is None else (" (met)" if ratio <= 1.1 / t else " (**not met**)")
            print(
                f"| {t} | {'no' if sp is None else 'yes'} | {err:.1e} | {memory.argument_size_in_bytes / 2**20:.2f} | "
                f"{temp / 2**20:.2f} | {temp / plain_temp:.2f} | {stream / 2**20:.2f} | {ratio:.3f}{verdict} | "
                f"{gathered / 2**20:.2f} | {shown} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
