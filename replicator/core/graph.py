"""The step graph: the per-replica jaxpr of one step and what its slots mean.

:func:`~replicator.core.tracing.trace_step` builds it, every pass in
:mod:`replicator.passes` maps one to another, and
:mod:`replicator.runtime.execution` runs the last one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from jax.extend.core import ClosedJaxpr, Var

from replicator.core.context import ReplicaContext

__all__ = ["CollectiveRecord", "Origin", "ShardedState", "StepGraph", "TensorLayout", "shard_axis"]


class ShardedState(frozenset):
    """The indices of the state leaves stored sharded, each with the axis it is split along.

    A ``frozenset`` of the indices (``i in s``, ``sorted(s)``, ``s == frozenset()`` work as for
    one) that also knows each leaf's axis; equal to another ``ShardedState`` only if the axes agree.

    >>> s = ShardedState({3: 0, 5: 1})
    >>> sorted(s), s.axis(5), s == frozenset({3, 5}), s == ShardedState({3: 0, 5: 0})
    ([3, 5], 1, True, False)
    """

    __slots__ = ("axes",)
    axes: tuple[tuple[int, int], ...]

    def __new__(cls, axes: Mapping[int, int] | None = None) -> ShardedState:
        axes = dict(axes or {})
        self = super().__new__(cls, axes)
        self.axes = tuple(sorted(axes.items()))
        return self

    def axis(self, index: int) -> int:
        """The axis leaf ``index`` is split along."""
        return dict(self.axes)[index]

    def __or__(self, other: Mapping[int, int] | frozenset[int]) -> ShardedState:  # type: ignore[override]
        return ShardedState({**dict(self.axes), **_axes_of(other)})

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardedState):
            return self.axes == other.axes
        return frozenset.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.axes)

    def __repr__(self) -> str:
        return f"ShardedState({dict(self.axes)})"

    def __reduce__(self) -> tuple:
        return ShardedState, (dict(self.axes),)


def _axes_of(sharded: Mapping[int, int] | frozenset[int]) -> dict[int, int]:
    if isinstance(sharded, ShardedState):
        return dict(sharded.axes)
    if isinstance(sharded, Mapping):
        return dict(sharded)
    return dict.fromkeys(sharded, 0)  # a plain set of indices: split along axis 0


def shard_axis(sharded: frozenset[int], index: int) -> int | None:
    """The axis state leaf ``index`` is split along, or ``None`` if it is replicated.

    ``sharded``: a graph's ``sharded_state`` (a plain set of indices means axis 0).
    """
    if index not in sharded:
        return None
    return sharded.axis(index) if isinstance(sharded, ShardedState) else 0


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How a step graph is split over a tensor (model-parallel) mesh axis
    (:mod:`replicator.tensor.split_graph`): the graph is then one device's program, on local shapes.

    Attributes:
      axis: the mesh axis's name (``'tensor'``).
      size: ``T``, the devices a replica's tensors are split over.
      state_dims: per state leaf, the dimension split over the axis, or ``None`` (whole on every device).
      collectives: what the split inserted over the axis, in program order
        (:class:`replicator.tensor.placement.Collective`: kind, global shape, dtype, line, reason).
    """

    axis: str
    size: int
    state_dims: tuple[int | None, ...]
    collectives: tuple = ()


@dataclasses.dataclass(frozen=True)
class StepGraph:
    """The per-replica program of one step and the meaning of its slots.

    Attributes:
      jaxpr: ``(*state_leaves, *batch_leaves) -> (*new_state_leaves, *output_leaves)``
        for one replica, traced with per-replica shapes.
      context: the mesh shape the step was traced for.
      state_paths: a readable path per state leaf, e.g. ``state['w']``.
      output_paths: a readable path per output leaf.
      sharded_state: indices of state leaves stored sharded, with their axes (see the field).
      collectives: what ``lower-collectives`` emitted (see the field).
      collective_origins: the user's tensors each placeholder carries (see the field).
    """

    jaxpr: ClosedJaxpr
    context: ReplicaContext
    state_paths: tuple[str, ...]
    output_paths: tuple[str, ...]
    #: State leaves stored sharded over all replicas (ZeRO), each along one
    #: axis (:class:`ShardedState`, :func:`shard_axis`; a plain set means axis
    #: 0): their jaxpr input and output are this replica's 1/N chunk. The
    #: others are replicated.
    sharded_state: frozenset[int] = ShardedState()
    #: One record per placeholder that ``lower-collectives`` lowered: kind,
    #: group, algorithm, wire dtype, payload and emitted bytes
    #: (:class:`CollectiveRecord`); empty before
    #: lowering. The communication report counts from it.
    collectives: tuple[CollectiveRecord, ...] = ()
    #: For placeholders that a pass made out of others (fused buckets,
    #: compressed or hierarchical all-reduces), keyed by the new placeholder's
    #: first result: how many of the user's tensors it carries, and their
    #: source lines (:class:`Origin`).
    collective_origins: Mapping[Var, Origin] = dataclasses.field(default_factory=dict, compare=False, hash=False)
    #: Constants of ``jaxpr`` (some of its ``constvars``) that the compiled
    #: step receives as arguments, with the same value on every call, rather
    #: than as literals XLA can see (``share-slice-kernels``: offsets that,
    #: left visible, would make XLA compile one kernel per offset).
    runtime_constants: frozenset[Var] = frozenset()
    #: State leaves kept per replica (``Replicator.run(..., per_replica_state=...)``): each replica
    #: keeps its own copy, as ``jax.pmap`` keeps per-device batch statistics. They are also in
    #: ``sharded_state``, split along axis 0: their global value has a leading axis of size
    #: ``num_replicas`` and the jaxpr's input and output are this replica's row, of size 1.
    per_replica_state: frozenset[int] = frozenset()
    #: Set when the graph is split over a tensor axis: it is then one device's program (its shapes
    #: local, ``1/T`` of a split leaf), with the collectives over that axis in it.
    tensor: TensorLayout | None = None

    @property
    def num_state(self) -> int:
        return len(self.state_paths)

    @property
    def num_batch(self) -> int:
        return len(self.jaxpr.jaxpr.invars) - self.num_state

    def with_jaxpr(self, jaxpr: ClosedJaxpr) -> StepGraph:
        return dataclasses.replace(self, jaxpr=jaxpr)

    def with_runtime_constants(self, constvars: frozenset[Var]) -> StepGraph:
        return dataclasses.replace(self, runtime_constants=frozenset(constvars))

    def __str__(self) -> str:
        return str(self.jaxpr)


@dataclasses.dataclass(frozen=True)
class Origin:
    """The user's tensors a placeholder carries: how many, and the source line of each collective."""

    tensors: int
    sources: tuple[str, ...]

    @staticmethod
    def merge(origins: Iterable[Origin]) -> Origin:
        origins = list(origins)
        return Origin(sum(o.tensors for o in origins), tuple(s for o in origins for s in o.sources))


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One placeholder collective as ``lower-collectives`` lowered it.

    Attributes:
      kind: the placeholder, e.g. ``'all_mean'``, ``'all_gather'``, ``'replica_id'``.
      group: the replica group (``None``: all replicas, ``'cores'``, ``'workers'``).
      algorithm: the lowering (``'native'``, ``'ring'``, ``'reduce_broadcast'``).
      dtype: the payload's dtype(s) on the wire, ``/``-joined.
      nbytes: the payload of one replica: the placeholder's operand bytes.
      tensors: the user's tensors it carries (a fused bucket carries several).
      sources: the user's source line of each collective it carries.
      region: where it is: ``'step'``, then ``/<primitive>@<equation>.<sub-jaxpr>``
        per nesting level (:func:`~replicator.core.jaxprs.iter_regions`).
      sent_bytes: estimated bytes one replica sends per step: the
        bandwidth-optimal cost of each emitted mesh collective over its ``N``
        replicas (all-reduce ``2 (N-1)/N B``, all-gather ``(N-1) B``,
        reduce-scatter ``(N-1)/N B``, ``B`` its operand bytes), and for
        ``ppermute`` the bytes sent by the busiest replica, counted from the
        permutation (times the loop trip count).
      emitted_bytes: the operand bytes of the mesh collectives emitted
        (:func:`emitted_bytes`).
      group_size: ``N``.
      operands: the arrays the placeholder reduces at once (an unfused
        ``all_sum`` of a list has one per leaf; a fused bucket has one).
    """

    kind: str
    group: str | None
    algorithm: str
    dtype: str
    nbytes: int
    tensors: int
    sources: tuple[str, ...]
    region: str
    sent_bytes: float
    emitted_bytes: int = 0
    group_size: int = 1
    operands: int = 1
