"""A small GAN, in the spirit of BigGAN, trained on 8 replicas: a ring of 8 Gaussians.

The target is the classic 2-D mixture of 8 Gaussians (standard deviation
``MODE_STD``) on a circle of radius 2. The generator maps 16-D noise to a point
through two hidden layers with **cross-replica batch normalization**
(``rp.cross_replica_batch_norm``: BigGAN's and TF-Replicator's batch norm, whose
statistics span the global batch, not one replica's 32 rows); running averages
of those statistics are kept in the training state and used to sample at the
end. The discriminator is a plain MLP.

One ``step_fn`` alternates the two updates, each with its own optimizer wrapped
by ``rp.wrap_optimizer`` (which all-reduces the gradients): first the
discriminator on real and generated points, then the generator against the
updated discriminator. As in BigGAN the loss is the hinge loss; the
discriminator judges packs of ``PACK`` points (PacGAN), which keeps the
generator from dropping modes in a short run. Noise is drawn inside the step
from ``fold_in(key, step, replica_id)``, so every replica draws different noise
while the state stays identical on all replicas.

What it prints:

* a check that the generator's batch norm on 8 replicas equals batch norm on
  the concatenated global batch on one device;
* after training, a check that the losses and samples are finite and that every
  device holds the same state, bit for bit;
* the losses every ``--log-every`` steps (``rp.LoggingHook``) and, every
  ``--eval-every`` steps, sample quality: the fraction of 2000 samples within
  ``3 * MODE_STD`` of a mode ("high quality", about 0.99 for real data) and the
  number of modes covered (a mode holding at least 2% of the samples);
* a PNG scatter of samples if matplotlib or Pillow is installed.

Run it (8 emulated CPU devices by default)::

    python examples/gan.py
    python examples/gan.py --devices 8 --workers 2 --steps 3000 --png /tmp/gan.png

TF-Replicator's BigGAN shape (512 replicas as 64 workers x 8 cores, global batch
2048, 4 examples per replica, batch-norm statistics over each worker's 8
replicas), folded onto the devices at hand (``replicas_per_device``); a few
steps, timed, with the batch-norm check against one device per group::

    python examples/gan.py --config biggan512            # 512 replicas on 8 devices
    python examples/gan.py --config biggan512 --devices 2 --steps 3
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

import replicator as rp

GLOBAL_BATCH = 256  # real points (and as many generated ones) per step, over all replicas
NOISE_DIM = 16
HIDDEN = 128
MODES = 8
RADIUS = 2.0
MODE_STD = 0.05
BN_MOMENTUM = 0.99  # running averages: avg <- m * avg + (1 - m) * batch statistic
LEARNING_RATE = 3e-3  # both optimizers: Adam(b1=0.5), cosine decay to 0 over the run
PACK = 2  # the discriminator judges packs of 2 points (PacGAN): counters mode collapse
EVAL_SAMPLES = 2000
COVERED_FRACTION = 0.02  # a mode is covered if at least this fraction of the samples is near it
BN_TOLERANCE = 1e-5  # max |generator on N replicas - generator on one device|

CENTERS = RADIUS * np.stack(
    [np.cos(2 * np.pi * np.arange(MODES) / MODES), np.sin(2 * np.pi * np.arange(MODES) / MODES)], axis=1
).astype(np.float32)


# -- data ------------------------------------------------------------------------------------------


def real_batch(step: int, size: int = GLOBAL_BATCH, seed: int = 0) -> np.ndarray:
    """``size`` points of the mixture, deterministic in ``(seed, step)``."""
    rng = np.random.default_rng([seed, step])
    modes = rng.integers(0, MODES, size)
    return (CENTERS[modes] + rng.normal(scale=MODE_STD, size=(size, 2))).astype(np.float32)


def make_input_fn(seed: int, global_batch: int = GLOBAL_BATCH):
    def input_fn(ctx: rp.InputContext):
        """One worker's contiguous slice of every global batch of real points."""
        rows = ctx.worker_batch_size(global_batch)
        start = ctx.worker_id * rows
        for step in itertools.count():
            yield {"real": real_batch(step, global_batch, seed=seed)[start : start + rows]}

    return input_fn


# -- models ------------------------------------------------------------------------------------------


def dense_init(key, n_in, n_out, scale=1.0):
    return {"w": jax.random.normal(key, (n_in, n_out)) * scale * jnp.sqrt(1.0 / n_in), "b": jnp.zeros(n_out)}


def init_generator(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "l1": dense_init(k1, NOISE_DIM, HIDDEN),
        "bn1": {"scale": jnp.ones(HIDDEN), "offset": jnp.zeros(HIDDEN)},
        "l2": dense_init(k2, HIDDEN, HIDDEN),
        "bn2": {"scale": jnp.ones(HIDDEN), "offset": jnp.zeros(HIDDEN)},
        "out": dense_init(k3, HIDDEN, 2),
    }


def init_discriminator(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "l1": dense_init(k1, 2 * PACK, HIDDEN),
        "l2": dense_init(k2, HIDDEN, HIDDEN),
        "out": dense_init(k3, HIDDEN, 1),
    }


def init_bn_stats():
    return {name: {"mean": jnp.zeros(HIDDEN), "var": jnp.ones(HIDDEN)} for name in ("bn1", "bn2")}


def local_batch_norm(x, scale, offset, eps=1e-5):
    """Batch norm over this device's rows only (the single-device reference)."""
    mean = x.mean(0)
    var = jnp.square(x - mean).mean(0)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + offset, mean, var


def running_batch_norm(stats):
    """Inference-mode batch norm with the running averages ``stats[name]``."""

    def bn(name, x, scale, offset, eps=1e-5):
        s = stats[name]
        return (x - s["mean"]) * jax.lax.rsqrt(s["var"] + eps) * scale + offset, s["mean"], s["var"]

    return bn


def cross_replica_bn(group=None):
    """Batch norm whose statistics span every replica's rows (``group=None``) or a worker's (``'cores'``)."""

    def bn(name, x, scale, offset):
        return rp.cross_replica_batch_norm(x, scale, offset, group=group)

    return bn


def generator(params, z, bn=None):
    """``(points, batch statistics)``; ``bn(name, x, scale, offset) -> (y, mean, var)``."""
    bn = cross_replica_bn() if bn is None else bn
    stats = {}
    h = z
    for layer, norm in (("l1", "bn1"), ("l2", "bn2")):
        h = h @ params[layer]["w"] + params[layer]["b"]
        h, mean, var = bn(norm, h, params[norm]["scale"], params[norm]["offset"])
        stats[norm] = {"mean": mean, "var": var}
        h = jax.nn.relu(h)
    return h @ params["out"]["w"] + params["out"]["b"], stats


def discriminator(params, x):
    x = x.reshape(x.shape[0] // PACK, 2 * PACK)
    h = jax.nn.leaky_relu(x @ params["l1"]["w"] + params["l1"]["b"], 0.2)
    h = jax.nn.leaky_relu(h @ params["l2"]["w"] + params["l2"]["b"], 0.2)
    return (h @ params["out"]["w"] + params["out"]["b"])[:, 0]


def make_optimizers(steps: int):
    """Two optimizers; each update() all-reduces its gradients first (rp.all_mean), then runs Adam."""
    schedule = optax.cosine_decay_schedule(LEARNING_RATE, steps)
    return rp.wrap_optimizer(optax.adam(schedule, b1=0.5)), rp.wrap_optimizer(optax.adam(schedule, b1=0.5))


def init_state(seed: int, g_tx, d_tx):
    kg, kd = jax.random.split(jax.random.key(seed))
    g, d = init_generator(kg), init_discriminator(kd)
    return {
        "g": g,
        "d": d,
        "g_opt": g_tx.init(g),
        "d_opt": d_tx.init(d),
        "bn_stats": init_bn_stats(),
        "step": jnp.zeros((), jnp.int32),
    }


# -- the step, written for ONE replica -----------------------------------------------------------------


def make_train_step(seed: int, g_tx, d_tx, bn_group: str | None = None):
    bn = cross_replica_bn(bn_group)

    def train_step(state, batch):
        real = batch["real"]  # this replica's rows
        # Different noise on every replica and step; nothing replica-dependent goes into the state.
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed + 1), state["step"]), rp.replica_id())
        k_d, k_g = jax.random.split(key)

        # 1. Discriminator (hinge loss, as in BigGAN): real points -> score >= 1, generated -> <= -1.
        fake, _ = generator(state["g"], jax.random.normal(k_d, (real.shape[0], NOISE_DIM)), bn)
        fake = jax.lax.stop_gradient(fake)

        def d_loss_fn(d):
            real_logits, fake_logits = discriminator(d, real), discriminator(d, fake)
            loss = jnp.mean(jax.nn.relu(1 - real_logits)) + jnp.mean(jax.nn.relu(1 + fake_logits))  # hinge
            return loss, (real_logits.mean(), fake_logits.mean())

        (d_loss, (d_real, d_fake)), d_grads = jax.value_and_grad(d_loss_fn, has_aux=True)(state["d"])
        d_updates, d_opt = d_tx.update(d_grads, state["d_opt"], state["d"])
        d = optax.apply_updates(state["d"], d_updates)

        # 2. Generator, against the updated discriminator.
        def g_loss_fn(g):
            points, stats = generator(g, jax.random.normal(k_g, (real.shape[0], NOISE_DIM)), bn)
            return -jnp.mean(discriminator(d, points)), stats  # hinge loss, generator side

        (g_loss, stats), g_grads = jax.value_and_grad(g_loss_fn, has_aux=True)(state["g"])
        g_updates, g_opt = g_tx.update(g_grads, state["g_opt"], state["g"])
        g = optax.apply_updates(state["g"], g_updates)

        # The batch statistics are over the global batch (or a worker's share: averaged over the
        # workers), identical on every replica: keep their running averages.
        if bn_group is not None:
            stats = rp.all_mean(stats)
        bn_stats = jax.tree.map(lambda avg, s: BN_MOMENTUM * avg + (1 - BN_MOMENTUM) * s, state["bn_stats"], stats)
        new_state = {"g": g, "d": d, "g_opt": g_opt, "d_opt": d_opt, "bn_stats": bn_stats, "step": state["step"] + 1}
        metrics = rp.all_mean({"d_loss": d_loss, "g_loss": g_loss, "D_real": d_real, "D_fake": d_fake})
        return new_state, metrics

    return train_step


# -- sample quality ------------------------------------------------------------------------------------


@jax.jit
def sample(g_params, bn_stats, z):
    """Inference mode: batch norm with the running averages."""
    return generator(g_params, z, running_batch_norm(bn_stats))[0]


def quality(points: np.ndarray) -> tuple[float, int, np.ndarray]:
    """``(fraction within 3 std of a mode, modes covered, samples near each mode)``."""
    dist = np.linalg.norm(points[:, None, :] - CENTERS[None], axis=-1)
    nearest, near = dist.argmin(1), dist.min(1) < 3 * MODE_STD
    counts = np.bincount(nearest[near], minlength=MODES)
    return float(near.mean()), int((counts >= COVERED_FRACTION * len(points)).sum()), counts


class SampleQuality(rp.Hook):
    """Every ``every`` steps (and at the end): draw samples with the running averages, measure them."""

    def __init__(self, every: int, z: np.ndarray):
        self.every, self.z, self.history = every, z, []

    def measure(self, trainer: rp.Trainer) -> None:
        points = np.asarray(sample(trainer.state["g"], trainer.state["bn_stats"], self.z))
        hq, covered, counts = quality(points)
        self.history.append({"step": trainer.step, "quality": hq, "covered": covered, "points": points})
        trainer.log(
            f"samples step {trainer.step}  high quality {hq:.3f}  modes covered {covered}/{MODES}  "
            f"per mode {counts.tolist()}"
        )

    def after_step(self, trainer: rp.Trainer) -> None:
        if trainer.step % self.every == 0:
            self.measure(trainer)

    def after_run(self, trainer: rp.Trainer) -> None:
        if not self.history or self.history[-1]["step"] != trainer.step:
            self.measure(trainer)


def leaves_that_differ_between_devices(state) -> list[str]:
    """The replicated state leaves whose copies on the devices are not all the same, bit for bit.

    Each step updates the state from all-reduced values only, so every device
    (and every replica folded onto it) must end it holding the same state.
    """
    differ = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if not leaf.sharding.is_fully_replicated:  # stored sharded on purpose: nothing to compare
            continue
        copies = [np.asarray(shard.data).tobytes() for shard in leaf.addressable_shards]
        if any(copy != copies[0] for copy in copies[1:]):
            differ.append(jax.tree_util.keystr(path))
    return differ


def save_png(path: str, points: np.ndarray, real: np.ndarray) -> str:
    """Write a scatter of generated (blue) over real (grey) points; returns how, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
        ax.scatter(real[:, 0], real[:, 1], s=2, c="0.7", label="real")
        ax.scatter(points[:, 0], points[:, 1], s=2, c="tab:blue", label="generated")
        ax.set(xlim=(-3, 3), ylim=(-3, 3), aspect="equal", title="GAN samples (8 replicas)")
        ax.legend(loc="upper right", markerscale=4)
        fig.savefig(path)
        plt.close(fig)
        return "matplotlib"
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return ""
    size = 400
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for pts, colour in ((real, (180, 180, 180)), (points, (31, 119, 180))):
        for x, y in (pts + 3.0) / 6.0 * size:
            draw.ellipse((x - 1, size - y - 1, x + 1, size - y + 1), fill=colour)
    image.save(path)
    return "Pillow"


# -- main -----------------------------------------------------------------------------------------------


#: TF-Replicator's BigGAN configuration: 512 replicas (64 workers x 8 cores), global batch 2048.
CONFIGS = {
    "biggan512": {
        "workers": 64,
        "replicas": 512,
        "global_batch": 2048,
        "bn_group": "cores",
        "steps": 5,
        "log_every": 1,
        "eval_every": 5,
        "min_modes": 0,
        "min_quality": 0.0,
    }
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), help="a preset (its values, then the flags given)")
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices (default 8)")
    parser.add_argument("--workers", type=int, default=1, help="workers; cores per worker = replicas / workers")
    parser.add_argument("--replicas", type=int, help="replicas (default: one per device; more are folded)")
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH, help="real points per step, all replicas")
    parser.add_argument(
        "--bn-group",
        choices=["all", "cores"],
        default="all",
        help="batch-norm statistics over all replicas or a worker's",
    )
    parser.add_argument("--steps", type=int, default=3000, help="training steps (default 3000)")
    parser.add_argument("--log-every", type=int, default=300, help="print the losses every N steps")
    parser.add_argument("--eval-every", type=int, default=500, help="measure sample quality every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--png",
        default=os.path.join(tempfile.gettempdir(), "replicator_gan_samples.png"),
        help="where to save a scatter of samples ('' to skip; needs matplotlib or Pillow)",
    )
    parser.add_argument("--min-modes", type=int, default=MODES, help=f"fail with fewer modes covered (default {MODES})")
    parser.add_argument(
        "--min-quality", type=float, default=0.6, help="fail with a smaller high-quality fraction (default 0.6)"
    )
    argv = list(argv) if argv is not None else None
    first = parser.parse_args(argv)
    if first.config:  # the preset's values are the defaults; flags given on the command line win
        parser.set_defaults(**CONFIGS[first.config])
    args = parser.parse_args(argv)
    args.replicas = args.replicas or args.devices
    args.bn_group = None if args.bn_group == "all" else args.bn_group
    if min(args.devices, args.workers, args.steps, args.log_every, args.eval_every, args.replicas) < 1:
        parser.error("--devices, --workers, --replicas, --steps, --log-every and --eval-every must be positive")
    if args.replicas % args.workers or args.replicas % args.devices:
        parser.error(f"--replicas {args.replicas} must be divisible by --workers {args.workers} and --devices")
    if args.global_batch % (args.replicas * PACK):
        parser.error(
            f"the global batch {args.global_batch} is not divisible by {args.replicas} replicas x {PACK} (packs)"
        )
    return args


def single_device_generator(g_params, z: np.ndarray, groups: int) -> np.ndarray:
    """The generator on one device, batch norm over each of ``groups`` consecutive slices of ``z``."""

    def per_group(zg):
        return generator(g_params, zg, lambda _, *a: local_batch_norm(*a))[0]

    out = jax.jit(jax.vmap(per_group))(z.reshape(groups, -1, NOISE_DIM))
    return np.asarray(out).reshape(len(z), 2)


def check_batch_norm(repl: rp.Replicator, g_params, global_batch: int = GLOBAL_BATCH, bn_group=None) -> float:
    """Max difference between the generator on the replicas and on one device, same global batch of noise.

    With ``bn_group='cores'`` the statistics span one worker's replicas: the
    reference normalises each worker's rows separately.
    """
    z = np.random.default_rng(123).normal(size=(global_batch, NOISE_DIM)).astype(np.float32)
    bn = cross_replica_bn(bn_group)

    def noise_input_fn(ctx: rp.InputContext):
        rows = ctx.worker_batch_size(global_batch)
        yield {"z": z[ctx.worker_id * rows : (ctx.worker_id + 1) * rows]}

    def forward(params, batch):
        points, _ = generator(params, batch["z"], bn)
        return params, points

    _, points = repl.run(forward, noise_input_fn, g_params)  # (replicas, rows each, 2), in replica order
    replicated = np.asarray(points).reshape(global_batch, 2)
    single = single_device_generator(g_params, z, repl.num_workers if bn_group == "cores" else 1)
    return float(np.max(np.abs(replicated - single)))


def make_replicator(args: argparse.Namespace) -> rp.Replicator:
    per_device = args.replicas // args.devices
    return rp.Replicator(
        num_workers=args.workers,
        cores_per_worker=args.replicas // args.workers,
        parallelism=rp.Parallelism(replicas_per_device=per_device),
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rp.force_cpu_devices(args.devices)  # before anything starts JAX's backend
    # The checks compare with one-device runs to float32 rounding. GPUs multiply float32 as TF32 by default
    # (10-bit mantissa), which moves both runs apart by more than that (measured on an H100: BENCHMARKS.md).
    jax.config.update("jax_default_matmul_precision", "highest")
    start = time.perf_counter()

    repl = make_replicator(args)
    print(repl)
    rows = args.global_batch // repl.num_replicas
    where = f"on {args.devices} devices ({repl.fold.replicas_per_device} per device)"
    print(
        f"{repl.num_replicas} replicas {where}, global batch {args.global_batch} real + {args.global_batch} "
        f"generated, {rows} each; batch norm over {'each worker' if args.bn_group else 'all replicas'}"
    )
    print(f"target: {MODES} Gaussians (std {MODE_STD}) on a circle of radius {RADIUS}")

    g_tx, d_tx = make_optimizers(args.steps)
    state0 = init_state(args.seed, g_tx, d_tx)
    bn_diff = check_batch_norm(repl, state0["g"], args.global_batch, args.bn_group)
    print(
        f"generator with cross-replica batch norm on {repl.num_replicas} x {rows} rows vs batch norm on "
        f"{args.global_batch} rows on one device: max difference {bn_diff:.2e} (tolerance {BN_TOLERANCE:.0e})"
    )

    z_eval = np.random.default_rng([args.seed, 2]).normal(size=(EVAL_SAMPLES, NOISE_DIM)).astype(np.float32)
    samples = SampleQuality(args.eval_every, z_eval)
    reference = real_batch(0, EVAL_SAMPLES, seed=args.seed + 10_000)  # held-out real points
    real_hq, real_covered, _ = quality(reference)
    print(f"real data: high quality {real_hq:.3f}  modes covered {real_covered}/{MODES}")
    trainer = rp.Trainer(
        repl,
        make_train_step(args.seed, g_tx, d_tx, args.bn_group),
        make_input_fn(args.seed, args.global_batch),
        state0,
        hooks=[rp.LoggingHook(args.log_every), samples],
    )
    jax.block_until_ready(trainer.run(1))  # compiles
    first = time.perf_counter()
    jax.block_until_ready(trainer.run(args.steps))
    after = time.perf_counter()
    final = samples.history[-1]
    per_step = (after - first) / max(args.steps - 1, 1)
    print(
        f"trained {args.steps} steps in {after - start:.1f} s incl. compiling; "
        f"{per_step * 1e3:.1f} ms per step after the first"
    )

    if args.png:
        how = save_png(args.png, final["points"], reference)
        print(f"samples saved to {args.png} ({how})" if how else "matplotlib/Pillow not installed: no PNG saved")

    failures = []
    if not bn_diff < BN_TOLERANCE:
        failures.append(f"cross-replica batch norm differs from single-device batch norm by {bn_diff:.2e}")
    if not all(np.isfinite(np.asarray(trainer.outputs[name])).all() for name in ("d_loss", "g_loss")):
        failures.append("the last step's losses are not all finite")
    if not np.isfinite(final["points"]).all():
        failures.append("the generator's samples are not all finite")
    differ = leaves_that_differ_between_devices(trainer.state)
    if differ:
        failures.append(f"the devices' copies of the state differ after training: {', '.join(differ)}")
    quality_checked = args.min_modes > 0 or args.min_quality > 0
    if final["covered"] < args.min_modes:
        failures.append(f"{final['covered']} modes covered < {args.min_modes}")
    if not final["quality"] >= args.min_quality:
        failures.append(f"high-quality fraction {final['quality']:.3f} < {args.min_quality}")
    if failures:
        raise SystemExit("FAIL: " + "; ".join(failures))
    over = "each worker's rows" if args.bn_group else "the global batch"
    print(f"PASS: cross-replica batch norm == single-device batch norm on {over} (max diff {bn_diff:.2e})")
    print(
        f"PASS: {args.steps} training steps on {repl.num_replicas} replicas: the losses and every sample are finite, "
        f"the state is identical on all {args.devices} devices"
    )
    if quality_checked:
        print(
            f"PASS: {final['covered']}/{MODES} modes covered (>= {args.min_modes}), "
            f"high quality {final['quality']:.3f} (>= {args.min_quality})"
        )
    else:  # --min-modes 0 --min-quality 0 (the biggan512 preset, short test runs)
        print(
            f"not checked: sample quality ({final['covered']}/{MODES} modes covered, high quality "
            f"{final['quality']:.3f}); {args.steps} steps are too few to learn the modes, the default 3000-step "
            f"run checks >= {MODES} modes and >= 0.6"
        )
    print("PASS")


if __name__ == "__main__":
    main()
