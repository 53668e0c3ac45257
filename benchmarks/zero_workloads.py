"""The training steps the ZeRO benchmarks compare: an MLP, a Flax ResNet, transformer blocks under ``lax.scan``.

Each builder returns a :class:`Workload`: the initial state (Adam's included),
a few global batches, and ``step(state, batch, cross_replica)``, one device's
step. ``cross_replica=False`` is the program on the global batch (one-device
``jax.jit``, and GSPMD, which shards that same program); ``cross_replica=True``
averages the gradients and the loss with ``rp.all_mean`` (and batch norm with
``lax.pmean`` over ``Workload.axis_name``): the step Replicator replicates.
``abstract=True`` returns the state as ``jax.ShapeDtypeStruct`` (for
compiling only, as ``largest_model.py`` does). JAX must be set up by the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from dense import dense_layers, regression_batches
from jax import lax

import replicator as rp

PyTree = Any
Step = Callable[[PyTree, PyTree, bool], tuple[PyTree, jax.Array]]

__all__ = ["WORKLOADS", "Workload", "mlp", "resnet", "transformer_scan"]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark step: ``step(state, batch, cross_replica) -> (state, loss)``."""

    title: str
    state: PyTree
    batches: list[PyTree]
    step: Step
    axis_name: str | None = None  # the ``lax`` axis name the step's own collectives use (Flax's batch norm)


def _initial_state(init: Callable[[], PyTree], abstract: bool) -> PyTree:
    return jax.eval_shape(init) if abstract else init()


def _mean(cross_replica: bool) -> Callable[[PyTree], PyTree]:
    return rp.all_mean if cross_replica else (lambda x: x)


def mlp(width: int = 512, depth: int = 8, batch: int = 256, *, abstract: bool = False) -> Workload:
    """A ``depth``-layer ``width x width`` tanh MLP, regression, Adam (the issue's workload)."""
    rng = np.random.default_rng(0)
    params = dense_layers(rng, depth, width)
    batches = regression_batches(rng, 3, batch, width)
    tx = optax.adam(1e-3)

    def step(state, b, cross_replica):
        params, opt = state
        mean = _mean(cross_replica)

        def loss_fn(ps):
            h = b["x"]
            for p in ps:
                h = jnp.tanh(h @ p["w"] + p["b"])
            return jnp.mean((h - b["y"]) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt = tx.update(mean(g), opt, params)
        return (optax.apply_updates(params, upd), opt), mean(loss)

    title = f"MLP {depth} x {width}x{width} tanh, Adam, global batch {batch}"
    return Workload(title, _initial_state(lambda: (params, tx.init(params)), abstract), batches, step)


def resnet(
    filters: int = 16,
    stage_sizes: tuple[int, ...] = (2, 2, 2, 2),
    image: int = 16,
    batch: int = 64,
    *,
    abstract: bool = False,
) -> Workload:
    """Flax's ImageNet ResNet v1 (``examples/flax_imagenet_pmap.py``), ``TrainState`` + ``batch_stats``, Adam.

    ``stage_sizes=(2, 2, 2, 2)`` is ResNet-18's layout; ``filters`` the first stage's width.
    """
    from flax.training import train_state

    from examples.flax_imagenet_pmap import cross_entropy_loss, make_model, synthetic_batches

    class TrainState(train_state.TrainState):
        batch_stats: Any

    models = {c: make_model(filters, stage_sizes, axis_name="batch" if c else None) for c in (False, True)}
    tx = optax.adam(1e-3)

    def init() -> PyTree:
        variables = models[False].init(jax.random.key(0), jnp.ones((1, image, image, 3)), train=False)
        state = TrainState.create(
            apply_fn=None, params=variables["params"], tx=tx, batch_stats=variables["batch_stats"]
        )
        return state.replace(step=jnp.asarray(state.step, jnp.int32))

    def step(state, b, cross_replica):
        model, mean = models[cross_replica], _mean(cross_replica)

        def loss_fn(params):
            variables = {"params": params, "batch_stats": state.batch_stats}
            logits, new = model.apply(variables, b["image"], mutable=["batch_stats"])
            return cross_entropy_loss(logits, b["label"]), new["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=mean(grads), batch_stats=batch_stats), mean(loss)

    title = (
        f"Flax ResNet v1, stages {tuple(stage_sizes)}, {filters} filters, {image}x{image} images, "
        f"Adam, global batch {batch}"
    )
    return Workload(title, _initial_state(init, abstract), synthetic_batches(3, batch, image), step, "batch")


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-5) * scale + bias


def transformer_block(h: jax.Array, p: dict[str, jax.Array], heads: int) -> jax.Array:
    """Pre-LN block: causal self-attention then a 4x GELU MLP, each added to the residual ``h`` (B, T, D)."""
    b, t, d = h.shape
    q, k, v = jnp.split(layer_norm(h, p["ln1_scale"], p["ln1_bias"]) @ p["qkv"], 3, axis=-1)
    q, k, v = (x.reshape(b, t, heads, d // heads) for x in (q, k, v))
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // heads)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    att = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v).reshape(b, t, d)
    h = h + att @ p["proj"]
    x = layer_norm(h, p["ln2_scale"], p["ln2_bias"])
    return h + jax.nn.gelu(x @ p["up"] + p["up_bias"]) @ p["down"] + p["down_bias"]


def transformer_scan(
    width: int = 128,
    depth: int = 8,
    batch: int = 16,
    *,
    heads: int = 4,
    seq: int = 32,
    vocab: int = 256,
    abstract: bool = False,
) -> Workload:
    """``depth`` pre-LN transformer blocks, parameters stacked ``(depth, ...)`` and applied with ``lax.scan``.

    Next-token cross-entropy on random tokens, embedding tied to the output layer, Adam.
    """
    tx = optax.adam(1e-3)

    def init() -> PyTree:
        keys = iter(jax.random.split(jax.random.key(0), 5))

        def normal(shape: tuple[int, ...], fan_in: int) -> jax.Array:
            return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(fan_in)

        d, f = width, 4 * width
        ones, zeros = jnp.ones((depth, d)), jnp.zeros((depth, d))
        blocks = {
            "ln1_scale": ones,
            "ln1_bias": zeros,
            "qkv": normal((depth, d, 3 * d), d),
            "proj": normal((depth, d, d), d),
            "ln2_scale": ones,
            "ln2_bias": zeros,
            "up": normal((depth, d, f), d),
            "up_bias": jnp.zeros((depth, f)),
            "down": normal((depth, f, d), f),
            "down_bias": zeros,
        }
        params = {"embed": normal((vocab, d), 1), "blocks": blocks, "ln_scale": jnp.ones(d), "ln_bias": jnp.zeros(d)}
        return params, tx.init(params)

    def step(state, b, cross_replica):
        params, opt = state
        mean = _mean(cross_replica)

        def loss_fn(ps):
            h = ps["embed"][b["tokens"]]
            h, _ = lax.scan(lambda h, p: (transformer_block(h, p, heads), None), h, ps["blocks"])
            logits = layer_norm(h, ps["ln_scale"], ps["ln_bias"]) @ ps["embed"].T
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]))

        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt = tx.update(mean(g), opt, params)
        return (optax.apply_updates(params, upd), opt), mean(loss)

    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, vocab, size=(batch, seq + 1)).astype(np.int32) for _ in range(3)]
    batches = [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
    title = (
        f"{depth} pre-LN transformer blocks under lax.scan, width {width}, {heads} heads, sequence {seq}, "
        f"vocabulary {vocab}, Adam, global batch {batch}"
    )
    return Workload(title, _initial_state(init, abstract), batches, step)


#: The ``--workload`` choices and their builders (defaults: the sizes the benchmark runs).
WORKLOADS: dict[str, Callable[..., Workload]] = {
    "mlp": mlp,
    "resnet": resnet,
    "transformer-scan": transformer_scan,
}
