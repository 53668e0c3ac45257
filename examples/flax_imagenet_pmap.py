"""Flax's ImageNet ``train_step`` and ResNet, written for ``jax.pmap``, run by ``Replicator.run``.

The model and the step below are written as in Flax's ImageNet example
(``examples/imagenet/models.py`` and ``train.py``): ResNet v1 blocks with
``nn.BatchNorm(axis_name='batch')``, a ``TrainState`` with ``batch_stats`` (and
``DynamicScale(axis_name='batch')`` when ``--dynamic-scale``), gradients and
metrics averaged with ``lax.pmean(..., axis_name='batch')``; only the images are
tiny and the data synthetic. Nothing in them knows about replicator.

The script trains the same steps three ways and compares the parameters:

* ``Replicator(workers, cores, axis_name='batch').run(train_step, input_fn, state)``:
  the only line that changes when porting (the ``pmap`` loop);
* ``jax.pmap(train_step, axis_name='batch')`` over the same 8 devices;
* ``jax.pmap`` over ONE device with the whole global batch (batch norm and the
  means then span the global batch: the single-device reference).

Run it (8 emulated CPU devices, about a minute on 2 cores)::

    python examples/flax_imagenet_pmap.py
    python examples/flax_imagenet_pmap.py --workers 2 --steps 5 --dynamic-scale
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import replicator as rp

TOLERANCE = 1e-5  # max |replicated - reference| parameter difference allowed
NUM_CLASSES = 10


# -- the model: Flax's examples/imagenet/models.py, shrunk ---------------------------
def _flax():
    import flax.linen as nn  # an example dependency: pip install -e '.[test]'

    return nn


def make_model(num_filters: int = 8, stage_sizes: Sequence[int] = (1, 1), axis_name: str | None = "batch") -> Any:
    """Flax's ImageNet ResNet v1; ``axis_name=None``: batch norm over the local batch only (one device, GSPMD)."""
    nn = _flax()

    class ResNetBlock(nn.Module):
        filters: int
        conv: Any
        norm: Any
        act: Callable
        strides: tuple[int, int] = (1, 1)

        @nn.compact
        def __call__(self, x):
            residual = x
            y = self.conv(self.filters, (3, 3), self.strides)(x)
            y = self.norm()(y)
            y = self.act(y)
            y = self.conv(self.filters, (3, 3))(y)
            y = self.norm(scale_init=nn.initializers.zeros_init())(y)
            if residual.shape != y.shape:
                residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
                residual = self.norm(name="norm_proj")(residual)
            return self.act(residual + y)

    class ResNet(nn.Module):
        stage_sizes: Sequence[int]
        num_classes: int
        num_filters: int = 64
        dtype: Any = jnp.float32
        act: Callable = nn.relu
        axis_name: str | None = "batch"

        @nn.compact
        def __call__(self, x, train: bool = True):
            conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
            norm = functools.partial(
                nn.BatchNorm,
                use_running_average=not train,
                momentum=0.9,
                epsilon=1e-5,
                dtype=self.dtype,
                axis_name=self.axis_name,
            )
            x = conv(self.num_filters, (3, 3), name="conv_init")(x)
            x = norm(name="bn_init")(x)
            x = nn.relu(x)
            for i, block_size in enumerate(self.stage_sizes):
                for j in range(block_size):
                    strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                    x = ResNetBlock(self.num_filters * 2**i, strides=strides, conv=conv, norm=norm, act=self.act)(x)
            x = jnp.mean(x, axis=(1, 2))
            x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
            return jnp.asarray(x, self.dtype)

    return ResNet(stage_sizes=tuple(stage_sizes), num_classes=NUM_CLASSES, num_filters=num_filters, axis_name=axis_name)


# -- the step: Flax's examples/imagenet/train.py ------------------------------------
def cross_entropy_loss(logits, labels):
    one_hot_labels = jax.nn.one_hot(labels, num_classes=NUM_CLASSES)
    xentropy = optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels)
    return jnp.mean(xentropy)


def compute_metrics(logits, labels):
    loss = cross_entropy_loss(logits, labels)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    metrics = {"loss": loss, "accuracy": accuracy}
    metrics = jax.lax.pmean(metrics, axis_name="batch")
    return metrics


def train_step(state, batch, learning_rate_fn):
    """Perform a single training step."""

    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, batch["image"], mutable=["batch_stats"]
        )
        loss = cross_entropy_loss(logits, batch["label"])
        weight_penalty_params = jax.tree_util.tree_leaves(params)
        weight_decay = 0.0001
        weight_l2 = sum(jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1)
        weight_penalty = weight_decay * 0.5 * weight_l2
        loss = loss + weight_penalty
        return loss, (new_model_state, logits)

    step = state.step
    dynamic_scale = state.dynamic_scale
    lr = learning_rate_fn(step)

    if dynamic_scale:
        grad_fn = dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name="batch")
        dynamic_scale, is_fin, aux, grads = grad_fn(state.params)
        # dynamic loss takes care of averaging gradients across replicas
    else:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        aux, grads = grad_fn(state.params)
        # Re-use same axis_name as in the call to `pmap(...train_step...)` below.
        grads = jax.lax.pmean(grads, axis_name="batch")
    new_model_state, logits = aux[1]
    metrics = compute_metrics(logits, batch["label"])
    metrics["learning_rate"] = lr

    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    if dynamic_scale:
        # if is_fin == False the gradients contain Inf/NaNs and optimizer state and
        # params should be restored (= skip this step).
        new_state = new_state.replace(
            opt_state=jax.tree_util.tree_map(
                functools.partial(jnp.where, is_fin), new_state.opt_state, state.opt_state
            ),
            params=jax.tree_util.tree_map(functools.partial(jnp.where, is_fin), new_state.params, state.params),
            dynamic_scale=dynamic_scale,
        )
        metrics["scale"] = dynamic_scale.scale

    return new_state, metrics


def create_train_state(model, learning_rate_fn, image_size: int, dynamic_scale: bool):
    from flax.training import dynamic_scale as dynamic_scale_lib
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        batch_stats: Any
        dynamic_scale: dynamic_scale_lib.DynamicScale

    variables = jax.jit(functools.partial(model.init, train=False))(
        jax.random.key(0), jnp.ones((1, image_size, image_size, 3))
    )
    tx = optax.sgd(learning_rate=learning_rate_fn, momentum=0.9, nesterov=True)
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
        dynamic_scale=dynamic_scale_lib.DynamicScale() if dynamic_scale else None,
    )


# -- the data and the three runs ----------------------------------------------------
def synthetic_batches(steps: int, global_batch: int, image_size: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(steps, global_batch, image_size, image_size, 3)).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, size=(steps, global_batch)).astype(np.int32)
    return [{"image": im, "label": lab} for im, lab in zip(images, labels, strict=True)]


def run_replicator(repl: rp.Replicator, step_fn, state, batches: list[dict]) -> tuple[Any, list]:
    """The port: the only code that differs from the pmap loop."""
    workers = repl.num_workers
    rows = batches[0]["label"].shape[0] // workers

    def input_fn(ctx):  # worker w's slice of every global batch
        for b in batches:
            yield jax.tree.map(lambda a: a[ctx.worker_id * rows : (ctx.worker_id + 1) * rows], b)

    metrics = []
    for _ in batches:
        state, m = repl.run(step_fn, input_fn, state)
        metrics.append(m)
    return state, metrics


def run_pmap(step_fn, state, batches: list[dict], devices: list) -> tuple[Any, list]:
    """Flax's own loop: replicate the state, shard the batch over devices, pmap."""
    n = len(devices)
    p_step = jax.pmap(step_fn, axis_name="batch", devices=devices)
    replicated = jax.tree.map(lambda a: jnp.stack([a] * n), state)  # one copy per device
    metrics = []
    for b in batches:
        sharded = jax.tree.map(lambda a: a.reshape(n, a.shape[0] // n, *a.shape[1:]), b)
        replicated, m = p_step(replicated, sharded)
        metrics.append(m)
    return jax.tree.map(lambda a: a[0], replicated), metrics


def max_difference(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=8)
    p.add_argument("--dynamic-scale", action="store_true", help="Flax's DynamicScale(axis_name='batch')")
    args = p.parse_args(argv)
    rp.force_cpu_devices(args.devices)

    model = make_model()
    learning_rate_fn = optax.cosine_decay_schedule(0.1, decay_steps=100)
    step_fn = functools.partial(train_step, learning_rate_fn=learning_rate_fn)
    state = create_train_state(model, learning_rate_fn, args.image_size, args.dynamic_scale)
    batches = synthetic_batches(args.steps, args.global_batch, args.image_size)

    repl = rp.Replicator(args.workers, args.devices // args.workers, axis_name="batch")
    start = time.perf_counter()
    replicated, metrics = run_replicator(repl, step_fn, state, batches)
    elapsed = time.perf_counter() - start
    for i, m in enumerate(metrics):
        print(f"step {i}  loss {float(m['loss'][0]):.4f}  accuracy {float(m['accuracy'][0]):.3f}")
    print(f"Replicator({args.workers} x {args.devices // args.workers}): {args.steps} steps in {elapsed:.1f} s")
    print(repl.explain(step_fn, {k: v[: args.global_batch // args.workers] for k, v in batches[0].items()}, state))

    pmapped, _ = run_pmap(step_fn, state, batches, jax.devices()[: args.devices])
    single, _ = run_pmap(step_fn, state, batches, jax.devices()[:1])
    fields = {"params": lambda s: s.params, "batch_stats": lambda s: s.batch_stats}
    ok = True
    for name, get in fields.items():
        d_pmap = max_difference(get(replicated), get(pmapped))
        d_single = max_difference(get(replicated), get(single))
        print(f"{name}: max |replicator - pmap| {d_pmap:.2e}, max |replicator - one device| {d_single:.2e}")
        ok &= d_pmap <= TOLERANCE and d_single <= TOLERANCE
    print("PASS" if ok else f"FAIL (tolerance {TOLERANCE})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
