"""The state leaves' placements over the tensor axis: the plan's, and for a leaf it does not name the one its
update comes out in (an optimizer's moments follow their parameter; a column-split layer's bias is split too).

>>> import jax, jax.numpy as jnp
>>> from replicator.tensor.placement import Shard
>>> def step(w, m, x):  # m: a moment of w, updated from w's gradient
...     g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
...     return w - g, 0.9 * m + g
>>> closed = jax.make_jaxpr(step)(jnp.ones((4, 8)), jnp.ones((4, 8)), jnp.ones((2, 4)))
>>> infer_state_placements(closed.jaxpr, [Shard(1), None], [(4, 8), (4, 8)], n_batch=1, size=2)
[S(1), S(1)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from replicator.tensor.interpret import BATCH, analyze
from replicator.tensor.placement import REPLICATED, Placement, Replicated, Shard

__all__ = ["infer_state_placements"]


def infer_state_placements(
    jaxpr: Any,
    named: Sequence[Placement | None],
    shapes: Sequence[tuple[int, ...]],
    n_batch: int,
    size: int,
    sequence_dim: int | None = None,
) -> list[Placement]:
    """The plan's placements, and for unnamed leaves the one their update comes out in (a fixed point)."""
    current: list[Placement] = [p if p is not None else REPLICATED for p in named]
    names = ["the state"] * len(current) + [BATCH] * n_batch
    for _ in range(len(current) + 1):
        outs = analyze(jaxpr, current + [REPLICATED] * n_batch, size=size, sequence_dim=sequence_dim, in_names=names)
        changed = False
        for i, (p, out) in enumerate(zip(current, outs[: len(current)], strict=False)):
            free = named[i] is None and isinstance(p, Replicated)
            if free and isinstance(out, Shard) and shapes[i][out.dim] % size == 0:
                current[i] = out
                changed = True
        if not changed:
            return current
    return current
