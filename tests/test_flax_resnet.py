"""A Flax ResNet and the ImageNet example's training step, replicated vs one device.

The model follows the structure of Flax's ImageNet example (ResNet v1 blocks,
batch norm after every convolution, zero-initialised last scale of each block,
global average pooling, SGD with Nesterov momentum, L2 weight decay, a
``TrainState`` plus ``batch_stats``), shrunk to tiny images. Replicated, batch
norm is :func:`replicator.cross_replica_batch_norm` inside a linen module; the
reference is the same step on one device with Flax's own ``nn.BatchNorm`` on
the global batch. This is the workload on which an unsound
``shard-optimizer-update`` once drifted by 5.7e-2 in five steps.
"""

from collections.abc import Callable
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import replicator as rp
from replicator.passes import PassManager


class CrossReplicaBatchNorm(nn.Module):
    """Training-mode batch norm over every replica's rows, with Flax's running averages."""

    momentum: float = 0.9
    epsilon: float = 1e-5
    scale_init: Callable = nn.initializers.ones

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        scale = self.param("scale", self.scale_init, (features,))
        bias = self.param("bias", nn.initializers.zeros, (features,))
        running_mean = self.variable("batch_stats", "mean", jnp.zeros, (features,))
        running_var = self.variable("batch_stats", "var", jnp.ones, (features,))
        y, mean, var = rp.cross_replica_batch_norm(x, scale, bias, eps=self.epsilon)
        if not self.is_initializing():
            running_mean.value = self.momentum * running_mean.value + (1 - self.momentum) * mean
            running_var.value = self.momentum * running_var.value + (1 - self.momentum) * var
        return y


class Block(nn.Module):
    filters: int
    norm: Any
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = partial(nn.Conv, use_bias=False)
        # Explicit names: the replicated and the reference norms share parameter paths.
        y = nn.relu(self.norm(name="bn1")(conv(self.filters, (3, 3), self.strides, name="conv1")(x)))
        y = self.norm(name="bn2", scale_init=nn.initializers.zeros_init())(conv(self.filters, (3, 3), name="conv2")(y))
        if x.shape != y.shape:
            x = self.norm(name="norm_proj")(conv(self.filters, (1, 1), self.strides, name="conv_proj")(x))
        return nn.relu(x + y)


class TinyResNet(nn.Module):
    stage_sizes: tuple[int, ...] = (1, 1)
    num_filters: int = 8
    num_classes: int = 10
    replicated: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.replicated:
            norm = CrossReplicaBatchNorm
        else:
            norm = partial(nn.BatchNorm, use_running_average=False, momentum=0.9, epsilon=1e-5, use_fast_variance=False)
        x = nn.relu(norm(name="bn_init")(nn.Conv(self.num_filters, (3, 3), use_bias=False, name="conv_init")(x)))
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = Block(self.num_filters * 2**i, norm=norm, strides=strides)(x)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


class TrainState(train_state.TrainState):
    batch_stats: Any


def make_train_step(model: nn.Module, average: Callable) -> Callable:
    """The ImageNet example's step: cross entropy + L2, averaged gradients, new batch stats."""

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": state.batch_stats}, batch["image"], mutable=["batch_stats"]
            )
            one_hot = jax.nn.one_hot(batch["label"], 10)
            loss = jnp.mean(optax.softmax_cross_entropy(logits, one_hot))
            l2 = sum(jnp.sum(p**2) for p in jax.tree.leaves(params) if p.ndim > 1)
            return loss + 1e-4 * 0.5 * l2, (updates, loss)

        (_, (updates, loss)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        grads = average(grads)
        state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
        return state, {"loss": average(loss)}

    return train_step


def _init(rng: np.random.Generator, global_batch: int) -> tuple[TrainState, list[dict]]:
    images = rng.normal(size=(4, global_batch, 8, 8, 3)).astype(np.float32)
    labels = rng.integers(0, 10, size=(4, global_batch)).astype(np.int32)
    reference = TinyResNet(replicated=False)
    variables = reference.init(jax.random.key(0), images[0][:2])
    tx = optax.sgd(0.1, momentum=0.9, nesterov=True)
    state = TrainState.create(
        apply_fn=reference.apply, params=variables["params"], tx=tx, batch_stats=variables["batch_stats"]
    )
    return state, [{"image": im, "label": lab} for im, lab in zip(images, labels, strict=True)]


@pytest.mark.parametrize(
    ("workers", "zero_stage"), [(1, 0), (2, 0), (1, 1), (2, 1), (2, 2), (1, 3), (2, 3)], ids=lambda v: str(v)
)
def test_flax_resnet_training_matches_one_device(n_devices, workers, zero_stage):
    state, batches = _init(np.random.default_rng(0), 2 * n_devices)
    repl = rp.Replicator(
        workers,
        n_devices // workers,
        passes=PassManager.default(zero=zero_stage, shard_optimizer_min_bytes=0),
    )

    def input_fn(ctx):
        rows = len(batches[0]["label"]) // workers
        for b in batches:
            yield jax.tree.map(lambda a: a[ctx.worker_id * rows : (ctx.worker_id + 1) * rows], b)

    step = make_train_step(TinyResNet(replicated=True), rp.all_mean)
    got = state
    for _ in batches:
        got, out = repl.run(step, input_fn, got)

    reference_step = jax.jit(make_train_step(TinyResNet(replicated=False), lambda x: x))
    ref = state
    for b in batches:
        ref, ref_out = reference_step(ref, b)

    stored_sharded = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(got.params)
        if not leaf.sharding.is_fully_replicated
    ]
    if zero_stage == 3:
        assert "['Dense_0']['kernel']" in stored_sharded and "['bn_init']['scale']" in stored_sharded, stored_sharded
        # conv kernels (3, 3, C, F): split along the first axis that divides by the replicas, not the leading 3
        kernels = {
            jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(got.params)
            if "conv" in jax.tree_util.keystr(path)
        }
        assert kernels and set(kernels) <= set(stored_sharded), (sorted(kernels), stored_sharded)
        for path, kernel in kernels.items():
            (axis,) = [k for k, names in enumerate(kernel.sharding.spec) if names is not None]
            assert axis >= 2 and kernel.shape[axis] % repl.num_replicas == 0, (path, kernel.sharding.spec)
            assert kernel.addressable_shards[0].data.shape[axis] == kernel.shape[axis] // repl.num_replicas
    else:
        assert not stored_sharded, stored_sharded
    moved = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(state.params), strict=True)
    )
    assert moved > 1e-3  # the check below is not vacuous
    for name in ("params", "batch_stats", "opt_state"):
        for a, b in zip(jax.tree.leaves(getattr(got, name)), jax.tree.leaves(getattr(ref, name)), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(np.asarray(out["loss"]), float(ref_out["loss"]), rtol=1e-5)
