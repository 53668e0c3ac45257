"""How many bytes of state each device holds, predicted from the graph alone.

A state leaf that the passes left replicated is whole on every device; one it
stores sharded (``StepGraph.sharded_state``: ZeRO's optimizer state) is 1/N of
itself per device, ``N`` the replicas. Compare with what XLA measures after
compiling (``Lowered.memory()``, :mod:`replicator.runtime.memory`). Under a ZeRO
stage, :func:`zero_account` says which leaves are stored sharded and why each
other one stays whole (``explain`` prints it).

>>> repl = rp.Replicator(1, 8, passes=rp.PassManager.default(shard_optimizer=True, shard_optimizer_min_bytes=0))
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

import copy
import dataclasses

from replicator.core.buffers import is_floating, nbytes
from replicator.core.graph import StepGraph
from replicator.errors import ReplicationError
from replicator.pass_manager.manager import Lowered
from replicator.passes.shard_optimizer import DEFAULT_MIN_TENSOR_BYTES, ShardOptimizerUpdate

__all__ = [
    "REPLICATED_REASONS",
    "ReplicatedLeaf",
    "ZeroAccount",
    "human_bytes",
    "state_bytes_by_zero_stage",
    "state_bytes_per_device",
    "zero_account",
]


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
    """Bytes of state per device at each ZeRO level 0-3, predicted by running the level's pass on ``graph``.

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


#: Why ZeRO leaves a state leaf whole on every replica (:attr:`ReplicatedLeaf.reason`), in the
#: order :func:`zero_account` tries them, each with what ``explain`` prints (``{n}`` replicas, stage
#: ``{k}``; ``{options}``: the threshold's option where some of the leaves are under it).
REPLICATED_REASONS: dict[str, str] = {
    "no-dividing-axis": "as no axis of the shape divides by the {n} replicas",
    "under-threshold": (
        "under the {threshold} threshold (PassManager.default(zero={k}, shard_optimizer_min_bytes=0) splits them)"
    ),
    "parameter": "as parameters, which ZeRO-{k} leaves whole (PassManager.default(zero=3{options}) splits them)",
    "not-floating": "as not floating point",
    "not-proven": (
        "as their updates, though identical on every replica, are not made element by element from values "
        "ZeRO holds in chunks"
    ),
}


@dataclasses.dataclass(frozen=True)
class ReplicatedLeaf:
    """A state leaf that ZeRO left whole on every replica."""

    path: str
    nbytes: int
    reason: str  # a key of REPLICATED_REASONS


@dataclasses.dataclass(frozen=True)
class ZeroAccount:
    """Every state leaf under the pass manager's ZeRO level: stored sharded, or replicated and why.

    ``len(sharded) + len(replicated)`` is the step's number of state leaves; ``str()``
    prints a line per reason, with the option that changes it.
    """

    stage: int
    num_replicas: int
    min_tensor_bytes: int
    sharded: tuple[str, ...]  # the paths of the leaves stored in 1/N chunks, one per replica
    sharded_bytes: int  # their whole size
    replicated: tuple[ReplicatedLeaf, ...]

    @property
    def num_leaves(self) -> int:
        return len(self.sharded) + len(self.replicated)

    def by_reason(self) -> dict[str, tuple[ReplicatedLeaf, ...]]:
        """The replicated leaves grouped by reason, in the order of :data:`REPLICATED_REASONS`."""
        groups = {
            reason: tuple(leaf for leaf in self.replicated if leaf.reason == reason) for reason in REPLICATED_REASONS
        }
        return {reason: leaves for reason, leaves in groups.items() if leaves}

    def __str__(self) -> str:
        k, n = self.stage, self.num_replicas
        whole = sum(leaf.nbytes for leaf in self.replicated)
        lines = [
            f"ZeRO-{k}: {len(self.sharded)} of {self.num_leaves} state leaves stored in 1/{n} chunks, one per "
            f"replica ({human_bytes(self.sharded_bytes)} in all); {len(self.replicated)} stay whole on every replica "
            f"({human_bytes(whole)} in all):"
        ]
        threshold = human_bytes(self.min_tensor_bytes)
        for reason, leaves in self.by_reason().items():
            count, verb = (f"{len(leaves)} leaf", "stays") if len(leaves) == 1 else (f"{len(leaves)} leaves", "stay")
            size = human_bytes(sum(leaf.nbytes for leaf in leaves))
            small = any(leaf.nbytes < self.min_tensor_bytes for leaf in leaves)
            options = ", shard_optimizer_min_bytes=0" if small else ""
            why = REPLICATED_REASONS[reason].format(n=n, k=k, threshold=threshold, options=options)
            lines.append(f"  {count}, {size} in all, {verb} replicated {why}: {_paths(leaves)}")
        return "\n".join(lines)


def zero_account(lowered: Lowered) -> ZeroAccount | None:
    """Which state leaves the ZeRO level of ``lowered``'s passes stored sharded, and why each other one is whole.

    ``None`` if no ``shard-optimizer-update`` ran, or with one replica. A leaf's
    reason is the first that holds, in the order of :data:`REPLICATED_REASONS`:
    no axis of its shape divides by the replicas; it is under the pass's
    ``min_tensor_bytes`` and the same stage without the threshold splits it;
    below stage 3, stage 3 without the threshold splits it (a parameter); it is
    not floating point; otherwise its update is not one the pass can prove and
    split (at ZeRO-3 the pass manager's notes say what stops each such floating-point
    leaf of at least ``min_tensor_bytes``).
    The two what-ifs run the pass again on the graph it was given.

    >>> def step(s, b):
    ...     g = rp.all_mean(jax.grad(lambda w: jnp.sum((b @ w) ** 2))(s["w"]))
    ...     m = 0.9 * s["m"] + g
    ...     return {"m": m, "w": s["w"] - 0.1 * m}, None
    >>> state = {"m": np.zeros((64, 4), np.float32), "w": np.ones((64, 4), np.float32)}
    >>> repl = rp.Replicator(1, 8, passes=rp.PassManager.default(zero=1))
    >>> print(zero_account(repl.lower(step, np.ones((8, 64), np.float32), state)))
    ZeRO-1: 0 of 2 state leaves stored in 1/8 chunks, one per replica (0 B in all); 2 stay whole
      on every replica (2.0 KiB in all):
      1 leaf, 1.0 KiB in all, stays replicated under the 64.0 KiB threshold
        (PassManager.default(zero=1, shard_optimizer_min_bytes=0) splits them): state['m']
      1 leaf, 1.0 KiB in all, stays replicated as parameters, which ZeRO-1 leaves whole
        (PassManager.default(zero=3, shard_optimizer_min_bytes=0) splits them): state['w']
    """
    index = next((i for i, s in enumerate(lowered.snapshots) if isinstance(s.by, ShardOptimizerUpdate)), None)
    if index is None:
        return None
    zero = lowered.snapshots[index].by
    before, after = lowered.snapshots[index - 1].graph, lowered.snapshots[index].graph
    n = before.context.num_replicas
    if n == 1:
        return None
    sharded = set(after.sharded_state)

    def split_by(stage: int, min_tensor_bytes: int) -> set[int]:
        what_if = copy.copy(zero)
        what_if.stage, what_if.min_tensor_bytes = stage, min_tensor_bytes
        try:
            return set(what_if.run(before).graph.sharded_state)
        except ReplicationError:
            return set()

    avals = [v.aval for v in before.jaxpr.jaxpr.invars[: before.num_state]]
    without_threshold = split_by(zero.stage, 0) if zero.min_tensor_bytes > 0 else sharded
    at_stage3 = split_by(3, 0) if zero.stage < 3 and zero.shard_state else set()
    replicated = []
    for i, aval in enumerate(avals):
        if i in sharded:
            continue
        size = nbytes(aval)
        if not any(d > 0 and d % n == 0 for d in aval.shape) or 0 in aval.shape:
            reason = "no-dividing-axis"
        elif size < zero.min_tensor_bytes and i in without_threshold:
            reason = "under-threshold"
        elif i in at_stage3:
            reason = "parameter"
        elif not is_floating(aval.dtype):
            reason = "not-floating"
        else:
            reason = "not-proven"
        replicated.append(ReplicatedLeaf(before.state_paths[i], size, reason))
    return ZeroAccount(
        stage=zero.stage,
        num_replicas=n,
        min_tensor_bytes=zero.min_tensor_bytes,
        sharded=tuple(before.state_paths[i] for i in sorted(sharded)),
        sharded_bytes=sum(nbytes(avals[i]) for i in sharded),
        replicated=tuple(replicated),
    )


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB (``'64.0 KiB'``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def _paths(leaves: tuple[ReplicatedLeaf, ...], shown: int = 6) -> str:
    names = [leaf.path for leaf in leaves[:shown]]
    more = len(leaves) - shown
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")
