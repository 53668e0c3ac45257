"""Layers whose statistics span replicas: cross-replica batch normalization.

Plain batch norm inside a replicated step normalizes each replica's rows with
that replica's own statistics: with 8 replicas of 4 rows each, every
normalization sees 4 rows, not the global batch of 32, and small per-replica
batches make training noisy or unstable. :func:`cross_replica_batch_norm`
computes the batch statistics over the rows of every replica of a group
(TF-Replicator's and TPUEstimator's cross-replica batch norm, PyTorch's
``SyncBatchNorm``), with replicator's placeholders, so it is differentiable
and the passes see its collectives.

Example (inside a step run by ``Replicator.run``)::

    from replicator.training.nn import cross_replica_batch_norm

    def loss_fn(params, batch):
        h = batch["x"] @ params["w"]
        h, mean, var = cross_replica_batch_norm(h, params["scale"], params["offset"])
        return jnp.mean((jax.nn.relu(h) @ params["v"] - batch["y"]) ** 2), (mean, var)

    def step_fn(state, batch):
        params, opt_state, stats = state
        (loss, (mean, var)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        grads = rp.all_mean(grads)
        ...
        stats = jax.tree.map(lambda s, b: 0.9 * s + 0.1 * b, stats, {"mean": mean, "var": var})
        return (params, opt_state, stats), {"loss": rp.all_mean(loss)}

The returned ``mean`` and ``var`` are identical on every replica of the group,
so running averages of them may be kept in the state.

**Gradients.** Differentiate each replica's own loss (``jax.grad`` of the
per-replica loss, as usual): the cotangents of the statistics flow back to
every replica through the transposes of the placeholders, so the gradient with
respect to this replica's ``x`` is the gradient of the *sum of every replica's
loss* with respect to it, and the gradients with respect to ``scale`` and
``offset`` are this replica's share. With per-replica losses that are means
over rows, ``rp.all_mean`` of the parameter gradients is the gradient of the
mean loss over the global batch, exactly as without batch norm;
``tests/test_nn.py`` checks both against single-device batch norm on the
concatenated batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from replicator.core import primitives
from replicator.core.context import check_group

__all__ = ["cross_replica_batch_norm"]


def _stats_dtype(dtype: np.dtype) -> np.dtype:
    """Statistics of low-precision inputs are computed in float32."""
    return jnp.promote_types(dtype, jnp.float32)


def cross_replica_batch_norm(
    x: jax.Array,
    scale: jax.Array,
    offset: jax.Array,
    *,
    eps: float = 1e-5,
    group: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Batch normalization (training mode) with statistics over every replica of ``group``.

    The statistics are over every axis of ``x`` but the last (the features),
    and over the rows of every replica of the group, as if the replicas' ``x``
    were concatenated along the leading axis. Every replica holds the same
    number of rows (``Replicator.run`` splits batches evenly), so the global
    mean is the mean of the per-replica means. Two passes, for accuracy: first
    ``mean = all_mean(mean(x))``, then ``var = all_mean(mean((x - mean)**2))``
    (the biased variance), each one all-reduce of a feature vector. Inputs in a
    lower precision than float32 (bfloat16, float16) are normalized in float32
    and the result is cast back.

    Args:
      x: this replica's activations, shape ``(..., C)`` with at least two axes.
      scale: ``(C,)``, multiplies the normalized ``x``.
      offset: ``(C,)``, added after scaling.
      eps: added to the variance before the square root.
      group: replicas whose rows the statistics span: ``None`` (all),
        ``'cores'`` (the replicas of my worker) or ``'workers'``.

    Returns:
      ``(y, mean, var)``: ``y = (x - mean) / sqrt(var + eps) * scale + offset``
      (shape and dtype of ``x``), and the batch ``mean`` and biased ``var``
      (shape ``(C,)``, float32 or wider), identical on every replica of the
      group. For an unbiased running variance, multiply ``var`` by
      ``n / (n - 1)`` with ``n`` the number of rows over the group.

    Raises:
      ValueError: if ``x`` has fewer than two axes or ``scale``/``offset`` are
        not of shape ``(C,)``.
      RuntimeError: outside a step run by ``Replicator.run``.
    """
    check_group(group, "cross_replica_batch_norm")
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(
            f"cross_replica_batch_norm: x has shape {x.shape}; it needs a batch axis and a feature "
            f"axis (shape (..., C)). Reshape a vector of per-row values to (rows, 1)."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"cross_replica_batch_norm: x must be floating point, got {x.dtype}; cast it first.")
    features = x.shape[-1]
    for name, value in (("scale", scale), ("offset", offset)):
        if np.shape(value) != (features,):
            raise ValueError(
                f"cross_replica_batch_norm: {name} has shape {np.shape(value)}, but x has {features} "
                f"features (last axis of {x.shape}); {name} must have shape ({features},)."
            )
    axes = tuple(range(x.ndim - 1))
    xf = x.astype(_stats_dtype(x.dtype))
    mean = primitives.all_mean(jnp.mean(xf, axis=axes), group=group)
    centered = xf - mean
    var = primitives.all_mean(jnp.mean(jnp.square(centered), axis=axes), group=group)
    y = centered * lax.rsqrt(var + eps) * scale + offset
    return y.astype(x.dtype), mean, var
