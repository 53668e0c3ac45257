"""Byte sizes and flat communication buffers, shared by the passes.

Several rewrites move many tensors through one collective: they flatten the
tensors, concatenate them into one buffer, communicate it, and slice the
result back into the tensors' shapes (``fuse-collectives``'s buckets,
``hierarchical-allreduce``'s chunks, the ``'ring'`` and ``'reduce_broadcast'``
all-reduces of ``lower-collectives``). :func:`pack` and :func:`unpack` are that
bookkeeping; :func:`per_dtype_buffers` does it for operands of mixed dtypes.
They are plain ``lax`` code, called inside the functions that
:func:`~replicator.core.jaxprs.inline_function` traces.

>>> from replicator.core.buffers import pack, unpack
>>> xs = [jnp.ones((2, 3)), jnp.arange(4.0)]
>>> buf, sizes = pack(xs)
>>> buf.shape, sizes
((10,), (6, 4))
>>> [y.shape for y in unpack(buf * 2, sizes, [x.shape for x in xs])]
[(2, 3), (4,)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

__all__ = ["is_floating", "nbytes", "pack", "per_dtype_buffers", "unpack"]


def is_floating(dtype: Any, *, include_complex: bool = False) -> bool:
    """Whether ``dtype`` is a floating-point type (bfloat16 included, which ``np.issubdtype`` misses)."""
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact if include_complex else jax.numpy.floating))


def nbytes(aval: Any) -> int:
    """The bytes of an array (or abstract value) with a NumPy dtype: elements times itemsize.

    >>> from replicator.core.buffers import nbytes
    >>> nbytes(jax.ShapeDtypeStruct((4, 4), jnp.bfloat16))
    32
    """
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def pack(xs: Sequence[Any], rows: int | None = None) -> tuple[Any, tuple[int, ...]]:
    """Concatenate ``xs`` (one dtype) into one buffer; return it and each one's size.

    Args:
      xs: arrays of one dtype.
      rows: ``None``: each array is flattened and the buffer is 1-D (one
        array alone is only flattened). An int: each array is viewed as
        ``(rows, size / rows)`` and the views are concatenated along axis 1,
        so that row ``r`` of the buffer holds row ``r`` of every array.

    Returns:
      ``(buffer, sizes)``: ``sizes`` are the lengths (1-D) or column counts
      (with ``rows``) of each array in the buffer, in order.
    """
    if rows is None:
        flat = [lax.reshape(x, (math.prod(x.shape),)) for x in xs]
        sizes = tuple(f.shape[0] for f in flat)
        return (flat[0] if len(flat) == 1 else lax.concatenate(flat, 0)), sizes
    sizes = tuple(math.prod(x.shape) // rows for x in xs)
    return lax.concatenate([lax.reshape(x, (rows, c)) for x, c in zip(xs, sizes, strict=True)], 1), sizes


def unpack(buf: Any, sizes: Sequence[int], shapes: Sequence[tuple[int, ...]]) -> list:
    """The inverse of :func:`pack`: cut ``buf`` into pieces of ``sizes``, reshaped to ``shapes``.

    A 1-D ``buf`` may be longer than ``sum(sizes)`` (padding at its end is
    dropped). A 2-D one is cut along axis 1, keeping every row.
    """
    out, offset = [], 0
    for size, shape in zip(sizes, shapes, strict=True):
        if buf.ndim == 1:
            piece = lax.slice(buf, (offset,), (offset + size,))
        else:
            piece = lax.slice(buf, (0, offset), (buf.shape[0], offset + size))
        out.append(lax.reshape(piece, tuple(shape)))
        offset += size
    return out


def per_dtype_buffers(xs: Sequence[Any], fn: Callable[[list], Sequence[Any]], *, skip_empty: bool = True) -> list:
    """Run ``fn`` on one flat buffer per ``(dtype, weak_type)`` of ``xs``, and cut the results back.

    The operands of each ``(dtype, weak_type)``, in order of first
    appearance, are flattened and concatenated (:func:`pack`);
    ``fn(buffers)`` returns one buffer per input buffer, at least as long
    (padding at the end is dropped), and each is sliced back into its
    operands' shapes. With ``skip_empty``, zero-size operands are not packed
    and come back as they are; ``fn`` is not called if no buffer is left.

    Returns:
      One array per operand of ``xs``.
    """
    out = list(xs)
    by_type: dict[tuple, list[int]] = {}
    for i, x in enumerate(xs):
        if x.size or not skip_empty:
            aval = jax.typeof(x)
            by_type.setdefault((aval.dtype, aval.weak_type), []).append(i)
    if not by_type:
        return out
    groups = list(by_type.values())
    packed = [pack([xs[i] for i in indices]) for indices in groups]
    results = fn([buf for buf, _ in packed])
    for indices, (_, sizes), result in zip(groups, packed, results, strict=True):
        for i, y in zip(indices, unpack(result, sizes, [xs[i].shape for i in indices]), strict=True):
            out[i] = y
    return out
