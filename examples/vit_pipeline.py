"""Train a small Vision Transformer over pipeline stages x data-parallel replicas, then check it against one device.

The model has ViT-B/16's structure at a size two CPU cores train in a minute or two: a patch embedding (a
convolution with stride = patch size), a class token and a learned position embedding, ``--depth``
transformer blocks (pre-LayerNorm, multi-head self-attention, an MLP, residual connections), a final
LayerNorm and a linear head on the class token. It is written in Flax linen.

The training step is the one written for data parallelism (the loss, ``jax.grad``,
``rp.all_mean(grads)``, an optax Adam update). The only pipeline-specific lines are the
``rp.stage_boundary`` markers the model puts between its blocks: ``--stages S`` stages, the patch
embedding in the first, the head in the last, the blocks shared out evenly. ``rp.Trainer`` runs the
step on a ``Replicator(..., parallelism=rp.Parallelism(stages=S, microbatches=M, schedule=...))``: with 16 devices and 4
stages, 4 data-parallel replicas of a 4-stage pipeline, each replica's rows cut into M micro-batches.

At the end the same steps run on one device with plain ``jax.jit`` on the same global batches (the
markers are the identity there, and ``rp.all_mean`` is replaced by the identity), and the two sets of
parameters are compared.

Run it (16 emulated CPU devices by default)::

    python examples/vit_pipeline.py
    python examples/vit_pipeline.py --devices 8 --stages 4 --microbatches 4 --schedule gpipe --steps 5
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

# Importing jax does not start its backend; rp.force_cpu_devices() in main() must run before anything does.
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp

IMAGE = 32  # images are IMAGE x IMAGE x 3
PATCH = 8  # 4 x 4 = 16 patches, plus the class token: sequences of 17
WIDTH = 64
HEADS = 4
MLP_DIM = 128
DEPTH = 4
CLASSES = 10
GLOBAL_BATCH = 64
LEARNING_RATE = 1e-3
TOLERANCE = 1e-4  # max |pipelined - single-device| parameter difference allowed


# -- data: noisy images of 10 fixed random templates -------------------------------------------------


def templates(seed: int = 1234) -> np.ndarray:
    """One fixed random pattern per class, (CLASSES, IMAGE, IMAGE, 3): the rule the model learns."""
    return np.random.default_rng(seed).normal(size=(CLASSES, IMAGE, IMAGE, 3)).astype(np.float32)


def synthetic_batch(step: int, size: int = GLOBAL_BATCH) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step``: ``0.5 * template[label]`` plus unit Gaussian noise, and the labels.

    Deterministic in ``step``, so the pipelined and the one-device runs see the same batches.
    """
    rng = np.random.default_rng([7, step])
    labels = rng.integers(0, CLASSES, size)
    images = 0.5 * templates()[labels] + rng.normal(size=(size, IMAGE, IMAGE, 3))
    return images.astype(np.float32), labels.astype(np.int32)


# -- model: ViT in Flax linen -----------------------------------------------------------------------


class SelfAttention(nn.Module):
    """Multi-head self-attention: query, key and value projections per head, softmax over the keys, an output
    projection. The key has no bias: softmax over the keys is unchanged by it (it adds the same ``q . b`` to
    every key's score), so its gradient is zero, and Adam would turn float rounding in that zero into steps of
    the learning rate's size, different on every device count."""

    heads: int = HEADS

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        width = x.shape[-1]
        projection = functools.partial(nn.DenseGeneral, features=(self.heads, width // self.heads))
        q = projection(name="query")(x)
        k = projection(name="key", use_bias=False)(x)
        v = projection(name="value")(x)
        y = nn.dot_product_attention(q, k, v)  # (batch, tokens, heads, width / heads)
        return nn.DenseGeneral(width, axis=(-2, -1), name="out")(y)


class EncoderBlock(nn.Module):
    """Pre-LayerNorm transformer block: ``x + MHSA(LN(x))``, then ``x + MLP(LN(x))``."""

    heads: int = HEADS
    mlp_dim: int = MLP_DIM

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.LayerNorm(name="ln_attention")(x)
        y = SelfAttention(self.heads, name="attention")(y)
        x = x + y
        y = nn.LayerNorm(name="ln_mlp")(x)
        y = nn.Dense(self.mlp_dim, name="mlp_in")(y)
        y = nn.Dense(x.shape[-1], name="mlp_out")(nn.gelu(y))
        return x + y


def boundaries(depth: int, stages: int) -> list[int]:
    """The blocks a stage starts at (a marker goes before each): ``stages`` even shares of ``depth`` blocks."""
    if not 1 <= stages <= depth:
        raise ValueError(f"{stages} stages need between 1 and depth={depth} blocks' worth of cuts; use --depth >= S.")
    return [round(s * depth / stages) for s in range(1, stages)]


class ViT(nn.Module):
    """A small ViT-B/16 look-alike; ``stages`` - 1 ``rp.stage_boundary`` markers cut it between blocks."""

    stages: int = 1
    depth: int = DEPTH
    width: int = WIDTH
    patch: int = PATCH
    heads: int = HEADS
    mlp_dim: int = MLP_DIM
    classes: int = CLASSES

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        x = nn.Conv(self.width, (self.patch, self.patch), strides=self.patch, padding="VALID", name="embedding")(images)
        n, h, w, c = x.shape
        x = x.reshape(n, h * w, c)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.broadcast_to(cls, (n, 1, c)), x], axis=1)
        x = x + self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1, h * w + 1, c))
        cuts = boundaries(self.depth, self.stages)
        for i in range(self.depth):
            if i in cuts:
                x = rp.stage_boundary(x)  # a new pipeline stage starts at block i
            x = EncoderBlock(self.heads, self.mlp_dim, name=f"block_{i}")(x)
        x = nn.LayerNorm(name="ln_final")(x)
        return nn.Dense(self.classes, name="head")(x[:, 0])  # the class token


# -- the step, written for one data-parallel replica -------------------------------------------------


def make_step(model: ViT, optimizer: optax.GradientTransformation, average: Callable = rp.all_mean) -> Callable:
    """``step(state, batch) -> (state, {"loss"})``; ``average=lambda x: x`` for one device."""

    def loss_fn(params: Any, images: jax.Array, labels: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def step(state: tuple[Any, Any], batch: tuple[jax.Array, jax.Array]) -> tuple[tuple[Any, Any], dict]:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        grads = average(grads)  # the gradients averaged over the data-parallel replicas
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": average(loss)}

    return step


def init_state(model: ViT, optimizer: optax.GradientTransformation, seed: int = 0) -> tuple[Any, Any]:
    params = model.init(jax.random.key(seed), jnp.zeros((1, IMAGE, IMAGE, 3)))["params"]
    return params, optimizer.init(params)


def max_abs_difference(a: Any, b: Any) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# -- main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=16, help="emulated CPU devices (default 16)")
    parser.add_argument("--workers", type=int, default=1, help="workers; cores per worker = devices / workers")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages S (default 4)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches M per replica (default 4)")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b", help="pipeline schedule")
    parser.add_argument("--depth", type=int, default=DEPTH, help=f"transformer blocks (default {DEPTH})")
    parser.add_argument("--batch", type=int, default=GLOBAL_BATCH, help=f"global batch (default {GLOBAL_BATCH})")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--log-every", type=int, default=2, help="print the loss every N steps")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help=f"default {TOLERANCE:.0e}")
    args = parser.parse_args(argv)
    if min(args.devices, args.workers, args.stages, args.microbatches, args.steps, args.log_every) < 1:
        parser.error("--devices, --workers, --stages, --microbatches, --steps and --log-every must be positive")
    if args.devices % args.workers:
        parser.error(f"--devices {args.devices} is not divisible by --workers {args.workers}")
    if args.devices % args.stages:
        parser.error(f"--devices {args.devices} is not divisible by --stages {args.stages}")
    if args.stages > args.depth:
        parser.error(f"--stages {args.stages} > --depth {args.depth}: each stage needs at least one block")
    rows = args.devices // args.stages * args.microbatches
    if args.batch % rows:
        parser.error(
            f"--batch {args.batch} does not split into {args.devices // args.stages} replicas x "
            f"{args.microbatches} micro-batches = {rows}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rp.force_cpu_devices(args.devices)  # before anything starts JAX's backend
    start = time.perf_counter()

    repl = rp.Replicator(
        args.workers,
        args.devices // args.workers,
        parallelism=rp.Parallelism(stages=args.stages, microbatches=args.microbatches, schedule=args.schedule),
    )
    replicas = args.devices // args.stages
    print(repl)
    print(
        f"ViT: {args.depth} blocks of width {WIDTH}, {HEADS} heads, {(IMAGE // PATCH) ** 2} patches of {PATCH}x{PATCH}; "
        f"{args.stages} stages (blocks {[0, *boundaries(args.depth, args.stages)]} start them) x {replicas} "
        f"data-parallel replicas, {args.microbatches} micro-batches of "
        f"{args.batch // replicas // args.microbatches} rows each, schedule {args.schedule}"
    )

    optimizer = optax.adam(LEARNING_RATE)
    model = ViT(stages=args.stages, depth=args.depth)
    state0 = init_state(model, optimizer)
    print(f"parameters: {sum(x.size for x in jax.tree.leaves(state0[0])):,}")

    def input_fn(ctx: rp.InputContext) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """This worker's contiguous share of every global batch, for ``--steps`` steps."""
        rows = ctx.worker_batch_size(args.batch)
        mine = slice(ctx.worker_id * rows, (ctx.worker_id + 1) * rows)
        for step in range(args.steps):
            images, labels = synthetic_batch(step, args.batch)
            yield images[mine], labels[mine]

    log = rp.LoggingHook(every=args.log_every, progress=False)
    trainer = rp.Trainer(repl, make_step(model, optimizer), input_fn, state0, hooks=[log], stream=sys.stdout)
    state = trainer.run(args.steps)
    pipelined_time = time.perf_counter() - start
    losses = [line["metrics"]["loss"] for line in log.history]

    # The same steps on one device: jax.jit of the same step, rp.all_mean replaced by the identity.
    one_device = jax.jit(make_step(model, optimizer, average=lambda x: x))
    ref = jax.device_put(state0, jax.devices()[0])
    for step in range(args.steps):
        ref, out = one_device(ref, synthetic_batch(step, args.batch))
    print(f"one device: final loss {float(out['loss']):.4f}")

    failures = []
    if not losses[-1] < losses[0]:
        failures.append(f"the loss did not go down: {losses[0]:.4f} -> {losses[-1]:.4f}")
    diff = max_abs_difference(state[0], ref[0])
    print(
        f"max |pipelined - one device| parameter difference after {args.steps} steps: {diff:.2e} "
        f"(tolerance {args.tolerance:.0e})"
    )
    if not diff < args.tolerance:
        failures.append(f"pipelined and one-device parameters differ by {diff:.2e} >= {args.tolerance:.0e}")
    print(f"pipelined run took {pipelined_time:.1f} s incl. compiling")
    for failure in failures:
        print(f"FAIL: {failure}")
    if failures:
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
