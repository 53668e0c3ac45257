"""Collective matmul: an all-gather feeding a matmul, and a matmul feeding a reduce-scatter, as rings.

Inside ``shard_map`` over a tensor axis of ``T`` devices, where device ``i`` holds block ``i`` of a
value on one dimension, two products are written here as ``T`` partial matmuls and ``T - 1``
``ppermute`` steps of a ring instead of one collective and one matmul (the *collective matmul* of
Wang et al., ASPLOS 2023; XLA's windowed einsum; the JAX ``shard_map`` guide's example), so that each
step's send and the next step's matmul are independent in the graph:

* :func:`all_gather_matmul`: ``dot(all_gather(x, d), y)`` with ``d`` a free (neither contracting nor
  batch) dimension of ``x``. Each device multiplies the block it holds, passes it to its right-hand
  neighbour and writes the product into its rows of the whole output: after ``T`` steps every block
  of ``x`` has met ``y`` once, and ``x`` itself is whole too (the blocks the ring passed, put in place:
  another consumer of the gathered ``x`` reads it without a second gather).
* :func:`matmul_reduce_scatter`: ``psum_scatter(dot(x, y), d)`` with ``d`` a free dimension of the
  output. The output's block ``c`` is the product of the operand's block ``c`` on the dimension that
  becomes ``d``; each device adds its product for one block to an accumulator that travels to the
  left-hand neighbour, and after ``T`` steps device ``i`` holds the sum for block ``i``.

Each device sends ``T - 1`` blocks, as the ring algorithm of the collective it replaces does: the
bytes are the same, the order is not (the reduce-scatter's sums are added in ring order).
:mod:`replicator.tensor.interpret` uses them where the rewrite would gather a matmul's operand or
reduce-scatter its output, when ``collective_matmul`` is asked for.

>>> from jax.sharding import Mesh, PartitionSpec as P
>>> mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
>>> dn = (((1,), (0,)), ((), ()))  # x @ w
>>> x, w = np.arange(32.0).reshape(8, 4), np.linspace(-1, 1, 12).reshape(4, 3)
>>> ring = lambda x, w: all_gather_matmul(x, w, dn, operand=0, dim=0, axis="tensor", size=2)
>>> f = jax.shard_map(ring, mesh=mesh, in_specs=(P("tensor"), P()), out_specs=P(), check_vma=False)
>>> product, gathered = f(x, w)
>>> bool(np.allclose(product, x @ w)), bool(np.array_equal(gathered, x))
(True, True)
>>> ring = lambda x, w: matmul_reduce_scatter(x, w, dn, dim=0, axis="tensor", size=2)
>>> f = jax.shard_map(ring, mesh=mesh, in_specs=(P(None, "tensor"), P("tensor")), out_specs=P("tensor"), check_vma=False)
>>> bool(np.allclose(f(x, w), x @ w))
True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["all_gather_matmul", "dot_flops", "matmul_reduce_scatter", "operand_dim", "output_dim"]

#: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``, as ``lax.dot_general`` takes them.
DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]
Dot = Callable[[jax.Array, jax.Array], jax.Array]


def dot_flops(dn: DimensionNumbers, lhs: Sequence[int], rhs: Sequence[int]) -> float:
    """The floating-point operations of ``dot_general`` of operands of these shapes (a multiply-add is 2).

    >>> dot_flops((((1,), (0,)), ((), ())), (8, 4), (4, 3))  # (8, 4) @ (4, 3)
    192.0
    """
    (lc, _), (lb, _) = dn
    free = [n for d, n in enumerate(lhs) if d not in lc and d not in lb]
    (_, rc), (_, rb) = dn
    rfree = [n for d, n in enumerate(rhs) if d not in rc and d not in rb]
    prod = lambda xs: float(math.prod(xs))  # noqa: E731
    return 2.0 * prod([lhs[d] for d in lb]) * prod(free) * prod(rfree) * prod([lhs[d] for d in lc])


def _free(dn: DimensionNumbers, ndims: tuple[int, int]) -> list[tuple[int, int]]:
    """``(operand, dimension)`` of each of the output's free dimensions, in the output's order."""
    (lc, rc), (lb, rb) = dn
    lhs = [(0, d) for d in range(ndims[0]) if d not in lc and d not in lb]
    rhs = [(1, d) for d in range(ndims[1]) if d not in rc and d not in rb]
    return lhs + rhs


def output_dim(dn: DimensionNumbers, ndims: tuple[int, int], operand: int, dim: int) -> int | None:
    """The output dimension that dimension ``dim`` of operand ``operand`` (0: lhs, 1: rhs) becomes, or
    ``None`` if it is contracted or a batch dimension (``ndims``: the operands' ranks).

    >>> output_dim((((1,), (0,)), ((), ())), (2, 2), 0, 0), output_dim((((1,), (0,)), ((), ())), (2, 2), 0, 1)
    (0, None)
    """
    free = _free(dn, ndims)
    return len(dn[1][0]) + free.index((operand, dim)) if (operand, dim) in free else None


def operand_dim(dn: DimensionNumbers, ndims: tuple[int, int], out: int) -> tuple[int, int] | None:
    """``(operand, dimension)`` that output dimension ``out`` comes from, or ``None`` for a batch one."""
    k = out - len(dn[1][0])
    free = _free(dn, ndims)
    return free[k] if 0 <= k < len(free) else None


def _default_dot(dn: DimensionNumbers) -> Dot:
    return functools.partial(lax.dot_general, dimension_numbers=dn)


def all_gather_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: DimensionNumbers,
    *,
    operand: int,
    dim: int,
    axis: str,
    size: int,
    dot: Dot | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``dot(lhs, rhs)`` with operand ``operand`` (0: ``lhs``, 1: ``rhs``) all-gathered on ``dim`` first,
    as a ring of ``size`` partial matmuls (call inside ``shard_map`` over ``axis`` of ``size`` devices).

    Args:
      lhs, rhs: this device's operands; the gathered one holds block ``axis_index`` of ``dim``.
      dimension_numbers: the product's, as ``lax.dot_general`` takes them (global and local alike).
      operand, dim: which operand is gathered and on which dimension: a free one (``ValueError`` else).
      axis, size: the mesh axis and its size.
      dot: the product of two local operands (default: ``lax.dot_general`` with ``dimension_numbers``).

    Returns:
      The product of the gathered operand and the other, and the gathered operand (assembled from the
      blocks the ring passed; nothing more is sent, and XLA drops it where it is not used).
    """
    dot = dot or _default_dot(dimension_numbers)
    ops = [lhs, rhs]
    out = output_dim(dimension_numbers, (lhs.ndim, rhs.ndim), operand, dim)
    if out is None:
        raise ValueError(f"all_gather_matmul: dimension {dim} of operand {operand} is contracted or a batch one.")
    block = ops[operand]
    n = block.shape[dim]
    me = lax.axis_index(axis)
    right = [(j, (j + 1) % size) for j in range(size)]

    def product(x: jax.Array) -> jax.Array:
        ops[operand] = x
        return dot(ops[0], ops[1])

    whole: Any = None
    shape = list(block.shape)
    shape[dim] *= size
    gathered = jnp.zeros(shape, block.dtype)
    for k in range(size):
        nxt = lax.ppermute(block, axis, right) if k + 1 < size else None  # sent while this block is multiplied
        part = product(block)
        if whole is None:
            shape = list(part.shape)
            shape[out] *= size
            whole = jnp.zeros(shape, part.dtype)
        start = ((me + size - k) % size) * n  # the block came from device me - k
        whole = lax.dynamic_update_slice_in_dim(whole, part, start, out)
        gathered = lax.dynamic_update_slice_in_dim(gathered, block, start, dim)
        block = nxt
    return whole, gathered


def matmul_reduce_scatter(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: DimensionNumbers,
    *,
    dim: int,
    axis: str,
    size: int,
    dot: Dot | None = None,
) -> jax.Array:
    """``psum_scatter(dot(lhs, rhs), axis, scatter_dimension=dim, tiled=True)`` as a ring of ``size``
    partial matmuls (call inside ``shard_map`` over ``axis`` of ``size`` devices).

    Args:
      lhs, rhs: this device's operands, whose product is its summand of the output.
      dimension_numbers: as ``lax.dot_general`` takes them.
      dim: the output dimension scattered: a free one whose size ``size`` divides (``ValueError`` else).
      axis, size: the mesh axis and its size.
      dot: the product of two local operands (default: ``lax.dot_general`` with ``dimension_numbers``).

    Returns:
      Block ``axis_index`` of ``dim`` of the sum over the axis of every device's product.
    """
    dot = dot or _default_dot(dimension_numbers)
    ops = [lhs, rhs]
    source = operand_dim(dimension_numbers, (lhs.ndim, rhs.ndim), dim)
    if source is None or ops[source[0]].shape[source[1]] % size:
        raise ValueError(f"matmul_reduce_scatter: output dimension {dim} is a batch one or not divisible by {size}.")
    operand, d = source
    whole = ops[operand]
    n = whole.shape[d] // size
    me = lax.axis_index(axis)
    left = [(j, (j - 1) % size) for j in range(size)]

    def product(c: Any) -> jax.Array:
        ops[operand] = lax.dynamic_slice_in_dim(whole, c * n, n, d)
        return dot(ops[0], ops[1])

    acc = product((me + 1) % size)  # the block this device's accumulator ends at, T - 1 steps to the left
    for k in range(1, size):
        acc = lax.ppermute(acc, axis, left) + product((me + k + 1) % size)
    return acc
