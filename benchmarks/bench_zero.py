"""Is ``shard-optimizer-update`` (ZeRO-1) worth having on by default?

One process, N emulated CPU devices, ``Replicator(1, N)`` (and ``2 x N/2`` for
the 50-tensor case). For each workload three variants are interleaved round
by round: the single-device step on the global batch (the floor), the default
pipeline with ``shard_optimizer=False`` and with ``shard_optimizer=True``.
Reported: median ms per step, the ratio ZeRO / no ZeRO, and how many state
leaves ZeRO stores sharded.

Workloads:

* ``mlp64x32``   64 dense layers of width 32, Adam (128 small tensors)
* ``mlp16x128``  16 dense layers of width 128, Adam
* ``convbn``     a small convolutional net with cross-replica batch norm
  (3 conv + BN + ReLU blocks of 16 channels on 16x16x3 images, a dense head),
  SGD with momentum, running batch statistics in the state
* ``sum50``      50 state tensors of 1000 floats each plus an all-sum of a
  per-replica scaling of it (``s + all_sum(s * k)``), no optimizer state

Usage::

    python benchmarks/bench_zero.py                        # all workloads, 8 devices
    python benchmarks/bench_zero.py --workloads convbn --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import replicator as rp  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--workloads", default="mlp64x32,mlp16x128,convbn,sum50")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    return p.parse_args(argv)


ARGS = parse_args()
rp.force_cpu_devices(ARGS.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from dense import dense_layers, regression_batches  # noqa: E402
from timing import time_interleaved  # noqa: E402

Step = Callable  # (state, batch, all_mean, batch_norm) -> (state, loss)


# -- workloads: (initial state, global batches, step written once for both sides) --------


def mlp(depth: int, width: int, batch: int = 512):
    rng = np.random.default_rng(0)
    params = dense_layers(rng, depth, width)
    tx = optax.adam(1e-3)
    batches = regression_batches(rng, 4, batch, width)

    def step(state, b, mean, bn):
        del bn
        params, opt = state

        def loss_fn(ps):
            h = b["x"]
            for p in ps[:-1]:
                h = jnp.tanh(h @ p["w"] + p["b"])
            return jnp.mean((h @ ps[-1]["w"] + ps[-1]["b"] - b["y"]) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt = tx.update(mean(g), opt, params)
        return (optax.apply_updates(params, upd), opt), mean(loss)

    return (params, tx.init(params)), batches, step


def global_bn(x, scale, offset, eps=1e-5):
    axes = tuple(range(x.ndim - 1))
    mean = jnp.mean(x, axis=axes)
    var = jnp.mean(jnp.square(x - mean), axis=axes)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + offset, mean, var


def convbn(batch: int = 64, channels: int = 16, blocks: int = 3):
    rng = np.random.default_rng(0)
    params = {"conv": [], "bn": [], "head": (rng.normal(size=(channels, 10)) * 0.1).astype(np.float32)}
    c_in = 3
    for _ in range(blocks):
        params["conv"].append((rng.normal(size=(3, 3, c_in, channels)) / np.sqrt(9 * c_in)).astype(np.float32))
        params["bn"].append({"scale": np.ones(channels, np.float32), "offset": np.zeros(channels, np.float32)})
        c_in = channels
    stats = [{"mean": np.zeros(channels, np.float32), "var": np.ones(channels, np.float32)} for _ in range(blocks)]
    tx = optax.sgd(0.05, momentum=0.9)
    batches = [
        {
            "x": rng.normal(size=(batch, 16, 16, 3)).astype(np.float32),
            "y": rng.integers(0, 10, size=(batch,)).astype(np.int32),
        }
        for _ in range(4)
    ]

    def step(state, b, mean, bn):
        params, opt, stats = state

        def loss_fn(p):
            h, new_stats = b["x"], []
            for w, s in zip(p["conv"], p["bn"], strict=True):
                h = jax.lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
                h, m, v = bn(h, s["scale"], s["offset"])
                h = jax.nn.relu(h)
                new_stats.append({"mean": m, "var": v})
            logits = jnp.mean(h, axis=(1, 2)) @ p["head"]
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])), new_stats

        (loss, batch_stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        upd, opt = tx.update(mean(g), opt, params)
        stats = jax.tree.map(lambda s, n: 0.9 * s + 0.1 * n, stats, batch_stats)
        return (optax.apply_updates(params, upd), opt, stats), mean(loss)

    return (params, tx.init(params), stats), batches, step


def sum50(batch: int = 64):
    rng = np.random.default_rng(0)
    state = [rng.normal(size=1000).astype(np.float32) for _ in range(50)]
    batches = [{"x": rng.normal(size=(batch, 1)).astype(np.float32)} for _ in range(4)]

    def step(state, b, mean, bn):
        del bn
        k = jnp.mean(b["x"])
        new = [s + 0.001 * mean(s * k) for s in state]
        return new, mean(k)

    return state, batches, step


WORKLOADS = {"mlp64x32": lambda: mlp(64, 32), "mlp16x128": lambda: mlp(16, 128), "convbn": convbn, "sum50": sum50}


# -- variants ------------------------------------------------------------------------------


def single(state, batches, step) -> Callable[[], object]:
    fn = jax.jit(lambda s, b: step(s, b, lambda x: x, global_bn))
    box, i = [jax.device_put(state)], [0]

    def run():
        box[0], loss = fn(box[0], batches[i[0] % len(batches)])
        i[0] += 1
        return loss

    return run


def replicated(state, batches, step, *, shard_optimizer: bool, workers: int = 1):
    n = jax.device_count()
    repl = rp.Replicator(workers, n // workers, passes=rp.PassManager.default(shard_optimizer=shard_optimizer))

    def step_fn(s, b):
        s, loss = step(s, b, rp.all_mean, rp.cross_replica_batch_norm)
        return s, {"loss": loss}

    def input_fn(ctx):
        rows = len(batches[0]["x"]) // ctx.num_workers
        i = 0
        while True:
            b = batches[i % len(batches)]
            yield jax.tree.map(lambda a: a[ctx.worker_id * rows : (ctx.worker_id + 1) * rows], b)
            i += 1

    sharded = len(
        repl.lower(step_fn, jax.tree.map(lambda a: a[: len(a) // workers], batches[0]), state).final.sharded_state
    )
    box = [state]

    def run():
        box[0], out = repl.run(step_fn, input_fn, box[0])
        return out["loss"]

    return run, sharded


def main() -> None:
    n = jax.device_count()
    print(
        f"shard-optimizer-update on/off, {n} emulated CPU devices, median of {ARGS.rounds} rounds x {ARGS.steps} steps"
    )
    print(f"{'workload':<11}{'variant':<22}{'ms/step':>9}{'vs single':>11}{'sharded leaves':>16}")
    for name in ARGS.workloads.split(","):
        state, batches, step = WORKLOADS[name]()
        variants, sharded = {"single": single(state, batches, step)}, {"single": "-"}
        meshes = [1, 2] if name == "sum50" else [1]
        for w in meshes:
            for zero in (False, True):
                label = f"{w}x{n // w} {'zero' if zero else 'no-zero'}"
                variants[label], sharded[label] = replicated(state, batches, step, shard_optimizer=zero, workers=w)
        times = {k: 1e3 * v for k, v in time_interleaved(variants, ARGS.rounds, ARGS.steps).items()}
        for label, ms in times.items():
            print(f"{name:<11}{label:<22}{ms:>9.2f}{ms / times['single']:>10.2f}x{sharded[label]!s:>16}")
        for w in meshes:
            base = f"{w}x{n // w}"
            ratio = times[f"{base} zero"] / times[f"{base} no-zero"]
            print(f"{name:<11}{base + ' zero / no-zero':<22}{ratio:>9.2f}")


if __name__ == "__main__":
    main()
