"""Train a small conv net on scikit-learn's handwritten digits, on 8 replicas.

The data set is scikit-learn's bundled ``digits`` (1797 grey 8x8 images of
the digits 0-9, read from a file shipped inside the scikit-learn package: no
download). 360 images are held out as the test set.

What it shows:

* a plain-JAX conv net trained data-parallel with ``rp.Trainer`` and an optax
  optimizer wrapped by ``rp.wrap_optimizer`` (it all-reduces the gradients);
* the Trainer's hooks: ``LoggingHook`` (loss and speed), ``EvalHook`` (test
  accuracy, counted exactly over the whole test set with ``rp.all_sum``) and
  ``CheckpointHook`` (the last checkpoint is read back and compared with the
  trained state);
* the same seed on 1 replica and on 8 replicas gives the same loss curve: the
  training is repeated on a single device (``Replicator(1, 1)``) on the same
  global batches, and the two loss curves are compared step by step.

Run it (8 emulated CPU devices by default; needs scikit-learn)::

    python examples/classifier.py
    python examples/classifier.py --devices 8 --workers 2 --steps 300 --ckpt-dir /tmp/digits-ckpt
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time

# Importing jax does not start its backend; rp.force_cpu_devices() in main() must
# run before anything does (jax.devices(), creating an array).
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import replicator as rp

GLOBAL_BATCH = 128  # training rows per step, summed over all replicas
TEST_SIZE = 360  # held-out images (20% of the 1797)
LEARNING_RATE = 2e-3
MIN_ACCURACY = 0.95  # default --min-accuracy: the test accuracy the default run must reach
CURVE_TOLERANCE = 1e-5  # max |loss on 8 replicas - loss on 1 replica| over all steps


# -- data: scikit-learn's digits, split once, batched with numpy --------------------------------


def load_digits_split(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)``: images (N, 8, 8, 1) in [0, 1] and labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(
            "this example needs scikit-learn for its digits data set: pip install -e '.[examples]' "
            "(or run bash scripts/example.sh classifier)"
        ) from None
    digits = load_digits()  # reads sklearn/datasets/data/digits.csv.gz from the installed package
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return x[train], y[train], x[test], y[test]


def train_batches(x: np.ndarray, y: np.ndarray, seed: int):
    """Global batches of ``GLOBAL_BATCH`` rows: epochs of fresh shuffles, the last partial batch dropped.

    Deterministic in ``seed``, so every run below sees the same batches in the same order.
    """
    for epoch in itertools.count():
        order = np.random.default_rng([seed, epoch]).permutation(len(y))
        for start in range(0, len(y) - GLOBAL_BATCH + 1, GLOBAL_BATCH):
            rows = order[start : start + GLOBAL_BATCH]
            yield x[rows], y[rows]


def make_train_input_fn(x: np.ndarray, y: np.ndarray, seed: int):
    def input_fn(ctx: rp.InputContext):
        """One worker's contiguous slice of every global batch (its cores split it further, in order)."""
        rows = ctx.worker_batch_size(GLOBAL_BATCH)
        start = ctx.worker_id * rows
        for xb, yb in train_batches(x, y, seed):
            yield {"image": xb[start : start + rows], "label": yb[start : start + rows]}

    return input_fn


def make_eval_input_fn(x: np.ndarray, y: np.ndarray):
    """The whole test set as ONE global batch, padded to a multiple of the replicas.

    Padding rows have ``mask == 0`` and are not counted, so the accuracy is
    exactly the fraction of the test images classified correctly.
    """

    def input_fn(ctx: rp.InputContext):
        total = -(-len(y) // ctx.num_replicas) * ctx.num_replicas
        pad = total - len(y)
        image = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
        label = np.concatenate([y, np.zeros(pad, y.dtype)])
        mask = np.concatenate([np.ones(len(y), np.float32), np.zeros(pad, np.float32)])
        rows = total // ctx.num_workers
        part = slice(ctx.worker_id * rows, (ctx.worker_id + 1) * rows)
        yield {"image": image[part], "label": label[part], "mask": mask[part]}

    return input_fn


# -- model: a tiny conv net in plain JAX ---------------------------------------------------------


def init_params(key: jax.Array) -> dict[str, dict[str, jax.Array]]:
    k1, k2, k3, k4 = jax.random.split(key, 4)

    def he(k, shape, fan_in):
        return jax.random.normal(k, shape) * jnp.sqrt(2.0 / fan_in)

    return {
        "conv1": {"w": he(k1, (3, 3, 1, 16), 9), "b": jnp.zeros(16)},  # 8x8x1 -> 8x8x16
        "conv2": {"w": he(k2, (3, 3, 16, 32), 9 * 16), "b": jnp.zeros(32)},  # stride 2 -> 4x4x32
        "dense": {"w": he(k3, (4 * 4 * 32, 64), 512), "b": jnp.zeros(64)},
        "out": {"w": he(k4, (64, 10), 64) * 0.1, "b": jnp.zeros(10)},
    }


def conv(x, layer, stride):
    y = lax.conv_general_dilated(x, layer["w"], (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu(y + layer["b"])


def convnet(params, image):
    h = conv(image, params["conv1"], 1)
    h = conv(h, params["conv2"], 2)
    h = jax.nn.relu(h.reshape(h.shape[0], -1) @ params["dense"]["w"] + params["dense"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def loss_fn(params, batch):
    logits = convnet(params, batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, (logits.argmax(-1) == batch["label"]).mean()


# rp.wrap_optimizer (also reachable as repl.wrap_optimizer): update() first averages the
# gradients over all replicas with rp.all_mean, then runs Adam. init() is Adam's.
tx = rp.wrap_optimizer(optax.adam(LEARNING_RATE))


# -- the steps, written for ONE replica -------------------------------------------------------------


def train_step(state, batch):
    params, opt_state = state
    (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)  # this replica's rows
    updates, opt_state = tx.update(grads, opt_state, params)  # all-reduce, then Adam
    params = optax.apply_updates(params, updates)
    return (params, opt_state), rp.all_mean({"loss": loss, "accuracy": accuracy})


def eval_step(state, batch):
    params, _ = state
    logits = convnet(params, batch["image"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    correct = (logits.argmax(-1) == batch["label"]).astype(jnp.float32)
    # Sums over every replica's rows, padding masked out: exact figures over the whole test set.
    total = rp.all_sum({"n": batch["mask"].sum(), "correct": (correct * batch["mask"]).sum()})
    loss_sum = rp.all_sum((losses * batch["mask"]).sum())
    return {"accuracy": total["correct"] / total["n"], "loss": loss_sum / total["n"], "images": total["n"]}


def replicas(repl: rp.Replicator) -> str:
    return f"{repl.num_replicas} replica{'s' if repl.num_replicas != 1 else ''}"


class LossCurve(rp.Hook):
    """Keeps every step's loss (the outputs stay on the devices until the end: no extra syncs)."""

    def __init__(self):
        self.outputs = []

    def after_step(self, trainer: rp.Trainer) -> None:
        self.outputs.append(trainer.outputs["loss"])

    def values(self) -> np.ndarray:
        # Outputs have a leading replica axis; all_mean made the entries equal: take replica 0's.
        return np.array([np.asarray(out)[0] for out in self.outputs], np.float64)


# -- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices (default 8)")
    parser.add_argument("--workers", type=int, default=1, help="workers; cores per worker = devices / workers")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300, ~27 epochs)")
    parser.add_argument("--log-every", type=int, default=50, help="LoggingHook: print the loss every N steps")
    parser.add_argument("--eval-every", type=int, default=100, help="EvalHook: test accuracy every N steps")
    parser.add_argument("--ckpt-every", type=int, default=100, help="CheckpointHook: save every N steps")
    parser.add_argument("--ckpt-dir", default=None, help="an empty or new checkpoint directory (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0, help="initialization and data-order seed")
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=MIN_ACCURACY,
        help=f"fail unless the final test accuracy reaches this (default {MIN_ACCURACY}, for the default --steps)",
    )
    parser.add_argument(
        "--tolerance", type=float, default=CURVE_TOLERANCE, help="max loss-curve difference, 1 vs N replicas"
    )
    args = parser.parse_args()
    if min(args.devices, args.workers, args.steps, args.log_every, args.eval_every, args.ckpt_every) < 1:
        parser.error("--devices, --workers, --steps, --log-every, --eval-every and --ckpt-every must be positive")
    if args.devices % args.workers:
        parser.error(f"--devices {args.devices} is not divisible by --workers {args.workers}")
    if GLOBAL_BATCH % args.devices:
        parser.error(f"the global batch {GLOBAL_BATCH} is not divisible by --devices {args.devices}")
    if args.ckpt_dir is not None and rp.latest_step(args.ckpt_dir) is not None:
        parser.error(f"--ckpt-dir {args.ckpt_dir} already holds checkpoints; give an empty or new directory")
    return args


def main() -> None:
    args = parse_args()
    rp.force_cpu_devices(args.devices)  # before anything starts JAX's backend
    # The checks compare with one-device runs to float32 rounding. GPUs multiply float32 as TF32 by default
    # (10-bit mantissa), which moves both runs apart by more than that (measured on an H100: BENCHMARKS.md).
    jax.config.update("jax_default_matmul_precision", "highest")
    start = time.perf_counter()

    x_train, y_train, x_test, y_test = load_digits_split()
    print(f"digits: {len(y_train)} training and {len(y_test)} test images of 8x8 pixels, 10 classes")

    repl = rp.Replicator(num_workers=args.workers, cores_per_worker=args.devices // args.workers)
    print(repl)
    print(f"{replicas(repl)}, global batch {GLOBAL_BATCH}, {GLOBAL_BATCH // repl.num_replicas} rows each")

    params = init_params(jax.random.key(args.seed))
    state0 = (params, tx.init(params))
    n_params = sum(leaf.size for leaf in jax.tree.leaves(params))
    print(f"conv net: {n_params} parameters; Adam(lr={LEARNING_RATE}) wrapped by rp.wrap_optimizer")

    ckpt_tmp = tempfile.TemporaryDirectory(prefix="replicator-digits-") if args.ckpt_dir is None else None
    ckpt_dir = args.ckpt_dir or os.path.join(ckpt_tmp.name, "ckpt")

    # -- training on all replicas, with hooks ---------------------------------------------------------
    curve = LossCurve()
    log_hook = rp.LoggingHook(every=args.log_every)
    evaluation = rp.EvalHook(eval_step, make_eval_input_fn(x_test, y_test), every=args.eval_every, name="test")
    checkpoints = rp.CheckpointHook(ckpt_dir, every=args.ckpt_every, keep=2)
    trainer = rp.Trainer(
        repl,
        train_step,
        make_train_input_fn(x_train, y_train, args.seed),
        state0,
        hooks=[curve, log_hook, evaluation, checkpoints],
    )
    state = trainer.run(args.steps)
    train_time = time.perf_counter() - start
    accuracy = evaluation.history[-1]["metrics"]["accuracy"]
    tested = int(evaluation.history[-1]["metrics"]["images"])
    print(f"{replicas(repl)}: {args.steps} steps in {train_time:.1f} s incl. compiling")

    # -- the last checkpoint holds the trained state -----------------------------------------------------
    step, restored, extra = rp.restore_checkpoint(ckpt_dir, state0)
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True)
    )
    print(
        f"checkpoints saved at steps {checkpoints.saved} into {ckpt_dir}"
        f"{' (a temporary directory; keep them with --ckpt-dir)' if ckpt_tmp else ''}; step {step} restored "
        f"(input position {extra['input_position']}): {'identical to' if same else 'DIFFERENT from'} the trained state"
    )

    # -- the same training on ONE device ------------------------------------------------------------------
    t0 = time.perf_counter()
    single = rp.Replicator(num_workers=1, cores_per_worker=1)  # a 1x1 mesh: jax.devices()[0]
    single_curve = LossCurve()
    rp.Trainer(single, train_step, make_train_input_fn(x_train, y_train, args.seed), state0, hooks=[single_curve]).run(
        args.steps
    )
    losses, single_losses = curve.values(), single_curve.values()
    diff = float(np.max(np.abs(losses - single_losses)))
    print(f"1 replica: {args.steps} steps in {time.perf_counter() - t0:.1f} s incl. compiling")
    every = max(1, args.steps // 6)
    for i in sorted({*range(0, args.steps, every), args.steps - 1}):
        print(f"  loss curve, step {i + 1:4d}:  {replicas(repl)} {losses[i]:.6f}   1 replica {single_losses[i]:.6f}")

    # -- checks -------------------------------------------------------------------------------------------
    print(f"test accuracy after {args.steps} steps: {accuracy:.4f} on {tested} test images")
    print(
        f"max |loss({replicas(repl)}) - loss(1 replica)| over {args.steps} steps: {diff:.2e} "
        f"(tolerance {args.tolerance:.0e})"
    )
    print(f"total time {time.perf_counter() - start:.1f} s")
    failures = []
    if not same:
        failures.append("the restored checkpoint differs from the trained state")
    if tested != len(y_test):
        failures.append(f"evaluated {tested} test images, expected {len(y_test)}")
    if not accuracy >= args.min_accuracy:
        failures.append(f"test accuracy {accuracy:.4f} < {args.min_accuracy}")
    if not diff < args.tolerance:
        failures.append(
            f"loss curves on {repl.num_replicas} and 1 replicas differ by {diff:.2e} >= {args.tolerance:.0e}"
        )
    if failures:
        raise SystemExit("FAIL: " + "; ".join(failures))
    print(f"PASS: test accuracy {accuracy:.4f} >= {args.min_accuracy}")
    print(f"PASS: 1 vs {replicas(repl)}, same loss curve within {args.tolerance:.0e} (max diff {diff:.2e})")
    print("PASS")
    if ckpt_tmp is not None:
        ckpt_tmp.cleanup()


if __name__ == "__main__":
    main()
