"""A pipeline's data-parallel replicas: how the global batch is cut into each replica's micro-batches, the
fold of several replicas onto one device (``replicas_per_device``), and the checks of those options and of
the ZeRO level. Read by the one build of a pipelined step (:mod:`replicator.stages.user_step`).

>>> [x.shape for x in micro_batches((np.zeros((8, 3)),), m=2, replicas=2)]
[(2, 2, 2, 3)]
>>> check_zero_stage(4)
Traceback (most recent call last):
...
ValueError: zero must be 0, 1, 2 or 3, got 4: ZeRO on each pipeline stage's data-parallel replicas stores 1/D per device of 1 the optimizer state, 2 also the averaged gradients, 3 also the parameters (0: off).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from replicator.core.layout import FOLDED_AXES
from replicator.pass_manager.manager import take_renamed
from replicator.stages.programs import DATA_AXES, folded

__all__ = [
    "check_fold_axes",
    "check_zero_stage",
    "fold_map",
    "fold_mean",
    "logical_data_shape",
    "micro_batches",
    "over_fold",
    "takes_zero_stage",
    "user_stacklevel",
]


def user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside the ``replicator`` package (the user's line)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def logical_data_shape(mesh: Mesh | None, fold_axes: Sequence[tuple[str, int]] = ()) -> tuple[int, int]:
    """The ``(workers, cores)`` grid of a pipeline's logical data-parallel replicas: the mesh's data axes, each
    times its fold (``FoldLayout.folded_axes``: a device hosts that many consecutive replicas along it)."""
    if mesh is None:
        return 1, 1
    fold = dict(fold_axes)
    return tuple(  # type: ignore[return-value]
        mesh.shape[a] * fold.get(FOLDED_AXES[a], 1) for a in DATA_AXES
    )


def fold_map(fn: Callable[[list], Any], fold_axes: Sequence[tuple[str, int]]) -> Callable[[list], Any]:
    """``fn`` of one replica's ``(M, rows, ...)`` batch leaves, run on a device's ``(k, M, rows, ...)`` block: on
    block 0 without folding (``k = 1``), else under ``jax.vmap`` over each fold axis (outermost first, ``k``
    their product) with the user's collectives spanning them (:func:`~replicator.stages.programs.folded`); the
    outputs then have the fold axes leading. What ``fn`` closes over (the parameter rows) is not batched."""
    if not fold_axes:
        return lambda batch: fn([x[0] for x in batch])
    sizes = tuple(n for _, n in fold_axes)
    mapped = over_fold(fn, fold_axes)
    return lambda batch: mapped([jnp.reshape(x, (*sizes, *x.shape[1:])) for x in batch])


def over_fold(fn: Callable, fold_axes: Sequence[tuple[str, int]]) -> Callable:
    """``fn`` of one replica's values, vmapped over the fold axes leading its arguments' leaves (outermost
    first), the user's collectives spanning them (:func:`~replicator.stages.programs.folded`)."""
    for name, _ in reversed(fold_axes):
        fn = jax.vmap(fn, axis_name=name)

    def run(*args: Any) -> Any:
        with folded(fold_axes):
            return fn(*args)

    return run


def fold_mean(tree: Any, fold_axes: Sequence[tuple[str, int]]) -> Any:
    """The mean over the leading fold axes of :func:`fold_map`'s outputs (each leaf keeps its dtype)."""
    if not fold_axes:
        return tree
    axes = tuple(range(len(fold_axes)))
    return jax.tree.map(lambda v: jnp.mean(v, axis=axes).astype(v.dtype), tree)


def micro_batches(batch: tuple, m: int, replicas: int = 1) -> list:
    """Each batch leaf ``(B, ...)`` as ``(replicas, m, B / (replicas m), ...)``: replica ``r`` takes the ``r``-th
    contiguous block of rows (as :meth:`Replicator.run` gives replica ``r`` its share), cut into ``m``."""
    leaves = jax.tree.leaves(batch)
    parts = m * replicas
    for leaf in leaves:
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] % parts:
            rows = "a scalar" if np.ndim(leaf) == 0 else f"{np.shape(leaf)[0]} rows"
            across = f" x {replicas} data-parallel replicas = {parts}" if replicas > 1 else ""
            raise ValueError(
                f"a batch leaf of shape {np.shape(leaf)} ({rows}) does not split into num_microbatches={m}"
                f"{across} equal parts; make the batch's leading axis a multiple of {parts}."
            )
    return [jnp.reshape(x, (replicas, m, x.shape[0] // parts, *x.shape[1:])) for x in map(jnp.asarray, leaves)]


def check_fold_axes(fold_axes: Sequence[tuple[str, int]], mesh: Mesh | None) -> tuple[tuple[str, int], ...]:
    """``fold_axes`` as a tuple, checked: ``(name, size)`` pairs of :data:`~replicator.core.layout.FOLDED_AXES`
    names in replica order, sizes above 1, and a mesh to fold onto."""
    axes = tuple((str(name), int(size)) for name, size in fold_axes)
    order = [FOLDED_AXES[a] for a in DATA_AXES]
    names = [name for name, _ in axes]
    if (
        any(name not in order for name in names)
        or names != sorted(names, key=order.index)
        or len(set(names)) < len(names)
    ):
        raise ValueError(f"fold_axes must name {order} (in that order, each at most once), got {names}.")
    if any(size < 2 for _, size in axes):
        raise ValueError(f"fold_axes sizes must be above 1 (leave a size-1 fold out), got {axes}.")
    if axes and mesh is None:
        raise ValueError("fold_axes (several replicas per device) needs mesh= (stages x data-parallel devices).")
    return axes


def check_zero_stage(zero: Any) -> int:
    """``zero`` (the ZeRO level) if it is 0, 1, 2 or 3, else a ``ValueError`` that says what each means."""
    if isinstance(zero, bool) or not isinstance(zero, (int, np.integer)) or not 0 <= zero <= 3:
        raise ValueError(
            f"zero must be 0, 1, 2 or 3, got {zero!r}: ZeRO on each pipeline stage's data-parallel "
            "replicas stores 1/D per device of 1 the optimizer state, 2 also the averaged gradients, 3 also the "
            "parameters (0: off)."
        )
    return int(zero)


def takes_zero_stage(function: Callable) -> Callable:
    """``function`` (a function or an ``__init__`` with a ``zero=`` parameter), still taking ``zero=``'s old name
    ``zero_stage=``: with a ``DeprecationWarning`` naming the new one; both given, a ``TypeError``.

    >>> f = takes_zero_stage(lambda *, zero=0: zero)
    >>> f(zero=1, zero_stage=1)
    Traceback (most recent call last):
    ...
    TypeError: <lambda>(): zero_stage= is the old name of zero=; give zero= only.
    """
    where = function.__qualname__.removesuffix(".__init__")

    @functools.wraps(function)
    def taking(*args: Any, **kwargs: Any) -> Any:
        take_renamed(where, kwargs, {"zero_stage": "zero"})
        return function(*args, **kwargs)

    return taking
