"""Placements of a value over the tensor axis, and moving a value between them.

Every value of a tensor-parallel step is, on the ``'tensor'`` mesh axis of size
``T``, in one of three placements (DTensor's names; JAX calls a partial sum
*unreduced*):

* :data:`REPLICATED`: every device holds the whole value;
* :class:`Shard` ``(d)``: device ``i`` holds the ``i``-th of ``T`` equal
  contiguous blocks of dimension ``d``;
* :data:`PARTIAL`: every device holds a value of the whole shape, and the
  value is their sum.

Moving between them is a collective or a local slice (:func:`convert`):

========================  ======================================  ===========
from -> to                how                                     bytes moved
========================  ======================================  ===========
partial -> replicated     ``psum`` (an all-reduce)                2(T-1)/T x
partial -> shard(d)       ``psum_scatter`` (a reduce-scatter)     (T-1)/T x
replicated -> shard(d)    a local slice (free)                    0
shard(d) -> replicated    ``all_gather``: refused unless allowed  (T-1)/T x
========================  ======================================  ===========

Promises:

1. :func:`convert` returns the value of the wanted placement, equal on every
   device to the reference's (``tests/tensor/test_placement.py``).
2. A gather of a sharded value is refused with :class:`TensorPlacementError`
   naming the user's line, unless ``allow_gather`` was given (or, under sequence
   parallelism, the value is an activation); every collective
   made is recorded in ``context.events`` with its line and reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax import lax

from replicator.errors import ReplicationError

__all__ = [
    "PARTIAL",
    "REPLICATED",
    "Collective",
    "Partial",
    "Placement",
    "Replicated",
    "Shard",
    "TensorContext",
    "TensorPlacementError",
    "convert",
    "gather_allowed",
    "local_shape",
]


@dataclasses.dataclass(frozen=True)
class Replicated:
    """Every device holds the whole value."""

    def __repr__(self) -> str:
        return "R"


@dataclasses.dataclass(frozen=True)
class Partial:
    """Every device holds a summand of the value (a partial sum)."""

    def __repr__(self) -> str:
        return "P"


@dataclasses.dataclass(frozen=True)
class Shard:
    """Device ``i`` holds block ``i`` of ``T`` along dimension ``dim``."""

    dim: int

    def __repr__(self) -> str:
        return f"S({self.dim})"


Placement = Replicated | Partial | Shard
REPLICATED = Replicated()
PARTIAL = Partial()


class TensorPlacementError(ReplicationError):
    """A tensor-parallel plan the step cannot run under as asked."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective over the tensor axis that the rewrite inserted."""

    # "all-reduce", "reduce-scatter", "all-gather", "all-reduce-max", and the rings of collective matmul
    # (replicator.tensor.overlap): "ring all-gather matmul", "ring matmul reduce-scatter"
    kind: str
    shape: tuple[int, ...]  # the global shape of the value
    dtype: str
    line: str  # the user's source line of the consumer
    reason: str
    #: A ring of collective matmul: the flops of its matmul on one device (what its sends may hide behind).
    flops: float = 0.0

    @property
    def nbytes(self) -> int:
        """The bytes of the whole value."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass
class TensorContext:
    """What the rewrite needs to know and what it records."""

    axis: str
    size: int
    allow_gather: bool = False
    events: list[Collective] = dataclasses.field(default_factory=list)
    #: Sequence parallelism: the dimension of activations split between the tensor-parallel regions
    #: (a partial sum met by a consumer that needs it whole is reduce-scattered on it instead of summed),
    #: and activations (values computed from the batch) may be gathered; weights never are. ``None``: off.
    sequence_dim: int | None = None
    #: The batch's sequence lengths (its leaves' sizes on ``sequence_dim``): a value is an activation
    #: split on the sequence only if it has rank >= 3 and one of these sizes there (a weight's gradient,
    #: a partial sum too, is summed whole).
    sequence_lengths: frozenset[int] = frozenset()
    #: Collective matmul (:mod:`replicator.tensor.overlap`): an all-gather feeding a ``dot_general`` on a
    #: free dimension of its operand, and a reduce-scatter of a ``dot_general``'s output (its only use) on a
    #: free dimension, are each a ring of ``size`` partial matmuls and ``ppermute`` instead.
    collective_matmul: bool = False

    def record(
        self, kind: str, x: Any, line: str, reason: str, shape: tuple[int, ...] | None = None, flops: float = 0.0
    ) -> None:
        self.events.append(Collective(kind, tuple(shape or x.shape), str(x.dtype), line, reason, flops))


def local_shape(shape: tuple[int, ...], placement: Placement, size: int) -> tuple[int, ...]:
    """The shape a device holds of a value of global ``shape``."""
    if not isinstance(placement, Shard):
        return tuple(shape)
    out = list(shape)
    out[placement.dim] //= size
    return tuple(out)


def _global(shape: tuple[int, ...], placement: Placement, size: int) -> tuple[int, ...]:
    out = list(shape)
    if isinstance(placement, Shard):
        out[placement.dim] *= size
    return tuple(out)


def gather_allowed(ctx: TensorContext, activation: bool) -> bool:
    """Whether a split value may be gathered whole: ``allow_gather``, or an activation (a value computed
    from the batch) under sequence parallelism."""
    return ctx.allow_gather or (activation and ctx.sequence_dim is not None)


def _gather(ctx: TensorContext, x: Any, dim: int, line: str, reason: str, activation: bool = False) -> Any:
    if not gather_allowed(ctx, activation):
        raise TensorPlacementError(
            f"at {line}: {reason} needs the whole of a value held sharded over '{ctx.axis}' "
            f"(shape {_global(x.shape, Shard(dim), ctx.size)}, split on dimension {dim}), which would "
            f"gather it on every device.\n"
            f"Fix: change the plan so that this value is not split on that dimension (e.g. mark the "
            f"parameter it comes from 'replicated'), or allow the gather with allow_gather=True."
        )
    ctx.record("all-gather", x, line, reason, _global(x.shape, Shard(dim), ctx.size))
    return lax.all_gather(x, ctx.axis, axis=dim, tiled=True)


def _local_slice(ctx: TensorContext, x: Any, dim: int) -> Any:
    n = x.shape[dim] // ctx.size
    return lax.dynamic_slice_in_dim(x, lax.axis_index(ctx.axis) * n, n, dim)


def convert(
    ctx: TensorContext, x: Any, have: Placement, want: Placement, line: str, reason: str, activation: bool = False
) -> Any:
    """``x`` (this device's part of a value in placement ``have``) in placement ``want``.

    ``activation``: ``x`` is computed from the batch (under sequence parallelism it may be gathered).
    """
    if have == want or ctx.size == 1:
        return x  # on one device every placement is the whole value
    if isinstance(have, Partial):
        if isinstance(want, Replicated):
            ctx.record("all-reduce", x, line, reason)
            return lax.psum(x, ctx.axis)
        assert isinstance(want, Shard)
        ctx.record("reduce-scatter", x, line, reason)
        return lax.psum_scatter(x, ctx.axis, scatter_dimension=want.dim, tiled=True)
    if isinstance(have, Replicated):
        if isinstance(want, Shard):
            return _local_slice(ctx, x, want.dim)
        # replicated -> partial: one device keeps the value, the others hold zeros.
        keep = lax.axis_index(ctx.axis) == 0
        return lax.select(lax.broadcast(keep, np.shape(x)), x, lax.full_like(x, 0))
    whole = _gather(ctx, x, have.dim, line, reason, activation)
    return convert(ctx, whole, REPLICATED, want, line, reason)
