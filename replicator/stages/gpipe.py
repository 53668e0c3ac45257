"""GPipe over S stages: :func:`gpipe_value_and_grad`, the first increment's entry point, now the ``"gpipe"``
tick table (:mod:`replicator.stages.schedule`) run by the table-driven loop of :mod:`replicator.stages.lower`.

>>> def loss(p, x):
...     h = rp.stage_boundary(jnp.tanh(x @ p["a"]))
...     return jnp.mean((h @ p["b"]) ** 2)
>>> p = {"a": jnp.full((3, 4), 0.1), "b": jnp.full((4, 2), 0.2)}
>>> x = jnp.linspace(-1, 1, 24).reshape(8, 3)
>>> value, grads = gpipe_value_and_grad(loss, num_microbatches=4, devices=jax.devices()[:2])(p, x)
>>> want_value, want = jax.value_and_grad(loss)(p, x)
>>> bool(jnp.allclose(value, want_value, rtol=1e-5)), bool(jnp.allclose(grads["a"], want["a"], rtol=1e-5))
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from replicator.stages.lower import STAGE_AXIS, pipeline_value_and_grad

__all__ = ["STAGE_AXIS", "gpipe_value_and_grad"]


def gpipe_value_and_grad(
    loss: Callable, *, num_microbatches: int, devices: Sequence[Any] | None = None
) -> Callable[..., tuple[Any, Any]]:
    """``pipeline_value_and_grad(loss, schedule="gpipe", ...)``: the value and gradient of a marked loss, GPipe.

    Args:
      loss: ``loss(params, *batch) -> scalar``, marked with ``rp.stage_boundary``; a mean over its batch.
      num_microbatches: ``M``; the batch leaves' leading axis must be divisible by it.
      devices: one device per stage (default: the first ``S`` devices).
    """
    return pipeline_value_and_grad(loss, num_microbatches=num_microbatches, schedule="gpipe", devices=devices)
