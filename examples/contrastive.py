"""Contrastive learning (SimCLR/CLIP-style) with negatives from every replica.

Each training image of scikit-learn's bundled ``digits`` (8x8 grey images; no
download) is augmented twice with numpy (shift by up to a pixel, contrast,
noise, dropped pixels). An MLP encoder maps both views to unit-norm embeddings,
and the InfoNCE loss asks every view to pick its partner among ALL the other
view's embeddings of the global batch, not only its replica's share: each
replica gathers every replica's embeddings with
``rp.all_gather(z, tiled=True)`` (a ``(global_batch, dim)`` array in replica
order), scores its own rows against them, and finds its partners at
``rp.replica_id() * local_batch + row``.

What it shows:

* the loss (and its gradient) on 8 replicas equals the loss of one device on
  the whole global batch: the 8 local losses are means over different rows,
  each with all 256 candidates, and their ``rp.all_mean`` is the global loss.
  The gradient of each local loss flows back to the other replicas' rows
  through the transpose of ``all_gather`` (a reduce-scatter), so
  ``rp.all_mean`` of the gradients is the gradient of the global loss;
* training (``rp.Trainer``, Adam via ``rp.wrap_optimizer``) reduces the loss,
  measured on a fixed batch of held-out test images, and raises the
  fraction of those views that find their partner among all 256 candidates;
* a linear probe (scikit-learn's logistic regression) on the frozen encoder
  features, before and after training.

Run it (8 emulated CPU devices by default; needs scikit-learn)::

    python examples/contrastive.py
    python examples/contrastive.py --devices 8 --workers 2 --steps 600
"""

from __future__ import annotations

import argparse
import itertools
import time

# Importing jax does not start its backend; rp.force_cpu_devices() in main() must
# run before anything does (jax.devices(), creating an array).
import jax
import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp

GLOBAL_BATCH = 256  # image pairs per step, over all replicas
TEST_SIZE = 360
HIDDEN, FEATURES, EMBED = 256, 128, 64
TEMPERATURE = 0.2
LEARNING_RATE = 1e-3
LOSS_TOLERANCE = 1e-5  # max |loss on N replicas - loss on one device on the global batch|
GRAD_TOLERANCE = 1e-6  # the same, for every gradient entry (they are up to ~5e-2)


# -- data ---------------------------------------------------------------------------------------------


def load_digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: images (N, 8, 8) in [0, 1] and labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(
            "this example needs scikit-learn for its digits data set: pip install -e '.[examples]' "
            "(or run bash scripts/example.sh contrastive)"
        ) from None
    digits = load_digits()  # reads sklearn/datasets/data/digits.csv.gz from the installed package
    x = (digits.images / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return x[train], y[train], x[test], y[test]


def augment(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random view of every (8, 8) image, flattened to 64 values."""
    n = len(images)
    padded = np.pad(images, ((0, 0), (1, 1), (1, 1)))
    dy, dx = rng.integers(0, 3, n), rng.integers(0, 3, n)  # shift by -1, 0 or +1 pixel
    rows = dy[:, None] + np.arange(8)[None]
    cols = dx[:, None] + np.arange(8)[None]
    out = padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
    out = out * rng.uniform(0.6, 1.4, (n, 1, 1))  # contrast
    out = out * (rng.uniform(size=out.shape) > 0.15)  # drop 15% of the pixels
    out = out + rng.normal(scale=0.1, size=out.shape)  # noise
    return out.reshape(n, 64).astype(np.float32)


def two_views(images: np.ndarray, seed) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"view1": augment(images, rng), "view2": augment(images, rng)}


def train_batches(x: np.ndarray, seed: int):
    """Global batches of two views of ``GLOBAL_BATCH`` training images; deterministic in ``seed``."""
    for epoch in itertools.count():
        order = np.random.default_rng([seed, epoch]).permutation(len(x))
        for i, start in enumerate(range(0, len(x) - GLOBAL_BATCH + 1, GLOBAL_BATCH)):
            yield two_views(x[order[start : start + GLOBAL_BATCH]], [seed, epoch, i])


def worker_slice(ctx: rp.InputContext, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This worker's contiguous rows of a global batch (its cores split them further, in order)."""
    rows = ctx.worker_batch_size(GLOBAL_BATCH)
    return {k: v[ctx.worker_id * rows : (ctx.worker_id + 1) * rows] for k, v in batch.items()}


def make_train_input_fn(x: np.ndarray, seed: int):
    def input_fn(ctx: rp.InputContext):
        for batch in train_batches(x, seed):
            yield worker_slice(ctx, batch)

    return input_fn


def make_fixed_input_fn(batch: dict[str, np.ndarray]):
    def input_fn(ctx: rp.InputContext):
        yield worker_slice(ctx, batch)

    return input_fn


# -- model ----------------------------------------------------------------------------------------------


def init_params(key: jax.Array):
    sizes = [(64, HIDDEN), (HIDDEN, FEATURES), (FEATURES, EMBED)]  # encoder, encoder, projection head
    return [
        {"w": jax.random.normal(k, (n_in, n_out)) * jnp.sqrt(2.0 / n_in), "b": jnp.zeros(n_out)}
        for (n_in, n_out), k in zip(sizes, jax.random.split(key, len(sizes)), strict=True)
    ]


def features(params, x):
    """The representation a linear probe reads (before the projection head)."""
    h = jax.nn.relu(x @ params[0]["w"] + params[0]["b"])
    return h @ params[1]["w"] + params[1]["b"]


def embed(params, x):
    z = jax.nn.relu(features(params, x)) @ params[2]["w"] + params[2]["b"]
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def info_nce(z1, z2, all1, all2, offset):
    """Symmetric InfoNCE of local rows ``z1``/``z2`` against all rows ``all2``/``all1``.

    Row ``i`` of ``z1`` is row ``offset + i`` of ``all1`` (its partner: row
    ``offset + i`` of ``all2``). Returns the mean loss over the local rows and
    the fraction of local rows whose partner scores highest.
    """
    labels = offset + jnp.arange(z1.shape[0])
    logits12 = z1 @ all2.T / TEMPERATURE  # (local rows, global rows)
    logits21 = z2 @ all1.T / TEMPERATURE
    loss = 0.5 * (
        optax.softmax_cross_entropy_with_integer_labels(logits12, labels).mean()
        + optax.softmax_cross_entropy_with_integer_labels(logits21, labels).mean()
    )
    top1 = 0.5 * ((logits12.argmax(-1) == labels).mean() + (logits21.argmax(-1) == labels).mean())
    return loss, top1


def replica_loss(params, batch):
    """The loss of this replica's rows, with negatives from every replica (inside a step)."""
    z1, z2 = embed(params, batch["view1"]), embed(params, batch["view2"])
    all1 = rp.all_gather(z1, tiled=True)  # (global batch, EMBED), replica order
    all2 = rp.all_gather(z2, tiled=True)
    return info_nce(z1, z2, all1, all2, offset=rp.replica_id() * z1.shape[0])


def single_device_loss(params, batch):
    """The same loss on one device holding the whole global batch."""
    z1, z2 = embed(params, batch["view1"]), embed(params, batch["view2"])
    return info_nce(z1, z2, z1, z2, offset=0)


tx = rp.wrap_optimizer(optax.adam(LEARNING_RATE))  # all-reduces the gradients, then Adam


def replicas(repl: rp.Replicator) -> str:
    return f"{repl.num_replicas} replica{'s' if repl.num_replicas != 1 else ''}"


# -- steps, written for ONE replica ------------------------------------------------------------------------


def train_step(state, batch):
    params, opt_state = state
    (loss, top1), grads = jax.value_and_grad(replica_loss, has_aux=True)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), rp.all_mean({"loss": loss, "top1": top1})


def eval_step(state, batch):
    loss, top1 = replica_loss(state[0], batch)
    return rp.all_mean({"loss": loss, "top1": top1})


def loss_and_grad_step(params, batch):
    """Loss and gradient of the global batch, assembled from the replicas' shares."""
    (loss, _), grads = jax.value_and_grad(replica_loss, has_aux=True)(params, batch)
    return params, rp.all_mean({"loss": loss, "grads": grads})


# -- checks --------------------------------------------------------------------------------------------------


def compare_with_single_device(repl: rp.Replicator, params, batch) -> tuple[float, float, float, float]:
    """``(loss, |loss difference|, max |gradient difference|, max |gradient|)`` on one global batch."""
    _, out = repl.run(loss_and_grad_step, make_fixed_input_fn(batch), params)
    loss = float(out["loss"][0])  # every replica holds the same all_mean: take replica 0's
    grads = jax.tree.map(lambda g: np.asarray(g)[0], out["grads"])
    (ref_loss, _), ref_grads = jax.jit(jax.value_and_grad(single_device_loss, has_aux=True))(params, batch)
    grad_diff = max(
        float(np.max(np.abs(a - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
    )
    grad_max = max(float(np.max(np.abs(np.asarray(g)))) for g in jax.tree.leaves(ref_grads))
    return loss, abs(loss - float(ref_loss)), grad_diff, grad_max


def linear_probe(params, x_train, y_train, x_test, y_test) -> float:
    """Test accuracy of logistic regression on the frozen features of the un-augmented images."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    f = jax.jit(features)
    train, test = np.asarray(f(params, x_train.reshape(-1, 64))), np.asarray(f(params, x_test.reshape(-1, 64)))
    scaler = StandardScaler().fit(train)
    probe = LogisticRegression(max_iter=2000).fit(scaler.transform(train), y_train)
    return float(probe.score(scaler.transform(test), y_test))


# -- main ----------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices (default 8)")
    parser.add_argument("--workers", type=int, default=1, help="workers; cores per worker = devices / workers")
    parser.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    parser.add_argument("--log-every", type=int, default=100, help="print the training loss every N steps")
    parser.add_argument("--eval-every", type=int, default=200, help="loss on the fixed test batch every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-probe", action="store_true", help="skip the linear probe")
    args = parser.parse_args()
    if min(args.devices, args.workers, args.steps, args.log_every, args.eval_every) < 1:
        parser.error("--devices, --workers, --steps, --log-every and --eval-every must be positive")
    if args.devices % args.workers:
        parser.error(f"--devices {args.devices} is not divisible by --workers {args.workers}")
    if GLOBAL_BATCH % args.devices:
        parser.error(f"the global batch {GLOBAL_BATCH} is not divisible by --devices {args.devices}")
    return args


def main() -> None:
    args = parse_args()
    rp.force_cpu_devices(args.devices)  # before anything starts JAX's backend
    start = time.perf_counter()

    x_train, y_train, x_test, y_test = load_digits_split()
    repl = rp.Replicator(num_workers=args.workers, cores_per_worker=args.devices // args.workers)
    print(repl)
    local = GLOBAL_BATCH // repl.num_replicas
    print(
        f"{repl.num_replicas} replicas x {local} image pairs; every view is scored against all "
        f"{GLOBAL_BATCH} partners gathered with rp.all_gather(z, tiled=True) (chance loss ln {GLOBAL_BATCH} = "
        f"{np.log(GLOBAL_BATCH):.3f})"
    )

    params0 = init_params(jax.random.key(args.seed))
    state0 = (params0, tx.init(params0))
    first_batch = next(train_batches(x_train, args.seed))
    test_batch = two_views(x_test[:GLOBAL_BATCH], [args.seed, 10**6])  # fixed held-out views

    # 1. N replicas == one device on the global batch, before training.
    loss0, loss_diff0, grad_diff0, grad_max0 = compare_with_single_device(repl, params0, first_batch)
    print(
        f"initial params, first batch: loss {loss0:.6f} on {replicas(repl)}; vs one device on the "
        f"global batch: |loss diff| {loss_diff0:.2e}, max |grad diff| {grad_diff0:.2e} (max |grad| {grad_max0:.2e})"
    )

    # 2. Training.
    evaluation = rp.EvalHook(eval_step, make_fixed_input_fn(test_batch), every=args.eval_every, name="test batch")
    trainer = rp.Trainer(
        repl,
        train_step,
        make_train_input_fn(x_train, args.seed),
        state0,
        hooks=[rp.LoggingHook(args.log_every), evaluation],
    )
    before = evaluation.evaluate(trainer)  # step 0
    params, _ = trainer.run(args.steps)
    after = evaluation.history[-1]["metrics"]
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f} s incl. compiling")

    # ... and again after training, on the same first batch.
    loss1, loss_diff1, grad_diff1, grad_max1 = compare_with_single_device(repl, params, first_batch)
    print(
        f"trained params, first batch: loss {loss1:.6f} on {replicas(repl)}; vs one device on the "
        f"global batch: |loss diff| {loss_diff1:.2e}, max |grad diff| {grad_diff1:.2e} (max |grad| {grad_max1:.2e})"
    )
    print(
        f"test batch ({GLOBAL_BATCH} held-out images, 2 views): loss {before['loss']:.4f} -> {after['loss']:.4f}, "
        f"partner found among {GLOBAL_BATCH} (top-1) {before['top1']:.3f} -> {after['top1']:.3f}"
    )
    if not args.no_probe:
        t0 = time.perf_counter()
        probe0 = linear_probe(params0, x_train, y_train, x_test, y_test)
        probe1 = linear_probe(params, x_train, y_train, x_test, y_test)
        print(
            f"linear probe on frozen {FEATURES}-d features, test accuracy: random encoder {probe0:.4f}, "
            f"trained encoder {probe1:.4f} ({time.perf_counter() - t0:.1f} s)"
        )
    print(f"total time {time.perf_counter() - start:.1f} s")

    loss_diff, grad_diff = max(loss_diff0, loss_diff1), max(grad_diff0, grad_diff1)
    failures = []
    if not loss_diff < LOSS_TOLERANCE:
        failures.append(f"replicated and single-device losses differ by {loss_diff:.2e} >= {LOSS_TOLERANCE:.0e}")
    if not grad_diff < GRAD_TOLERANCE:
        failures.append(f"replicated and single-device gradients differ by {grad_diff:.2e} >= {GRAD_TOLERANCE:.0e}")
    if not after["loss"] < before["loss"]:
        failures.append(f"training did not reduce the test-batch loss ({before['loss']:.4f} -> {after['loss']:.4f})")
    if failures:
        raise SystemExit("FAIL: " + "; ".join(failures))
    print(
        f"PASS: loss on {replicas(repl)} == loss on one device (max diff {loss_diff:.2e} < "
        f"{LOSS_TOLERANCE:.0e}; gradients {grad_diff:.2e} < {GRAD_TOLERANCE:.0e})"
    )
    print(f"PASS: training reduced the test-batch loss {before['loss']:.4f} -> {after['loss']:.4f}")
    print("PASS")


if __name__ == "__main__":
    main()
