"""How many bytes of state each device holds, predicted from the graph alone.

A state leaf that the pipeline left replicated is whole on every device; one it
stores sharded (``StepGraph.sharded_state``: ZeRO's optimizer state) is 1/N of
itself per device, ``N`` the replicas. Compare with what XLA measures after
compiling (``Lowered.memory()``, :mod:`replicator.runtime.memory`).

>>> repl = rp.Replicator(1, 8, passes=rp.Pipeline.default(shard_optimizer=True, shard_optimizer_min_bytes=0))
>>> def step(s, b):
...     g = rp.all_mean(jax.grad(lambda w: jnp.sum((b @ w) ** 2))(s["w"]))
...     m = 0.9 * s["m"] + g
...     return {"m": m, "w": s["w"] - 0.1 * m}, None
>>> state = {"m": np.zeros((64, 4), np.float32), "w": np.ones((64, 4), np.float32)}
>>> final = repl.lower(step, np.ones((8, 64), np.float32), state).final
>>> state_bytes_per_device(final)  # w whole (1024 B), m in eighths (128 B)
1152
"""

from __future__ import annotations

from replicator.core.buffers import nbytes
from replicator.core.graph import StepGraph
from replicator.errors import ReplicationError
from replicator.passes.shard_optimizer import DEFAULT_MIN_TENSOR_BYTES, ShardOptimizerUpdate

__all__ = ["state_bytes_by_zero_stage", "state_bytes_per_device"]


def state_bytes_per_device(final: StepGraph) -> int:
    """Bytes of state one device stores between steps, from the graph that runs.

    ``final``'s state inputs are what one replica receives: a sharded leaf's
    input is already its chunk, a replicated leaf's the whole leaf. This is
    one replica's share; with several replicas folded onto a device
    (``replicas_per_device``), that device holds a chunk of each sharded leaf
    per replica.
    """
    return sum(nbytes(v.aval) for v in final.jaxpr.jaxpr.invars[: final.num_state])


def state_bytes_by_zero_stage(
    graph: StepGraph, *, min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES
) -> dict[int, int] | None:
    """Bytes of state per device at each ZeRO stage 0-3, predicted by running the stage's pass on ``graph``.

    ``graph``: the step before ``shard-optimizer-update`` and the lowering
    (e.g. ``Lowered.after('simplify')``). ``None`` if the graph is not one the pass can read.

    >>> repl = rp.Replicator(1, 8)
    >>> def step(s, b):
    ...     g = rp.all_mean(jax.grad(lambda w: jnp.sum((b @ w) ** 2))(s["w"]))
    ...     m = 0.9 * s["m"] + g
    ...     return {"m": m, "w": s["w"] - 0.1 * m}, None
    >>> state = {"m": np.zeros((64, 4), np.float32), "w": np.ones((64, 4), np.float32)}
    >>> graph = repl.lower(step, np.ones((8, 64), np.float32), state).after("simplify")
    >>> state_bytes_by_zero_stage(graph, min_tensor_bytes=0)  # both whole; m in eighths; both in eighths
    {0: 2048, 1: 1152, 2: 1152, 3: 256}
    """
    out = {0: state_bytes_per_device(graph)}
    for stage in (1, 2, 3):
        try:
            result = ShardOptimizerUpdate(stage=stage, min_tensor_bytes=min_tensor_bytes).run(graph)
        except ReplicationError:
            return None
        out[stage] = state_bytes_per_device(result.graph)
    return out
