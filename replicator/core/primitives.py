"""Cross-replica placeholders: what a step says, before a pass says how.

Inside a ``step_fn`` run by :class:`replicator.Replicator`, each function here
binds a *placeholder* primitive instead of a real collective. The step is
traced per replica into a jaxpr that still says "all_sum of these leaves over
this group"; passes in :mod:`replicator.passes` analyse and optimize that
graph, and the ``lower-collectives`` pass finally swaps every placeholder for
``lax.psum``/``all_gather``/``psum_scatter``/... over the mesh axes.

Every placeholder has abstract-eval, JVP, transpose and batching rules, so it
works under ``jax.grad``, ``jax.vmap``, ``jax.jit``, control flow and
``jax.checkpoint`` inside the step. Traced per replica with no tracking of
which values vary between replicas, the transpose of a cross-replica sum is a
cross-replica sum (the gradient of a loss that is all-summed on every replica
flows back to every replica).

Example: 2 workers x 4 cores, one row per replica (row ``r`` on replica ``r``):

>>> repl = rp.Replicator(num_workers=2, cores_per_worker=4)
>>> def step_fn(batch):
...     x = batch["x"][0]  # this replica's row, shape (2,)
...     return {
...         "mean": rp.all_mean(x),  # over all 8 replicas
...         "worker_sum": rp.all_sum(x, group="cores"),  # over my worker's 4 replicas
...         "rows": rp.all_gather(x),  # (8, 2): every replica's row, in replica order
...         "chunk": rp.reduce_scatter(jnp.tile(x, 4)),  # the sum, cut in 8: my chunk
...     }
>>> x = np.arange(16, dtype=np.float32).reshape(8, 2)
>>> out = repl.run(step_fn, lambda ctx: iter([{"x": x[4 * ctx.worker_id : 4 * ctx.worker_id + 4]}]))
>>> out["mean"][0].tolist(), out["worker_sum"][5].tolist(), out["rows"][3].shape
([7.0, 8.0], [44.0, 48.0], (8, 2))
>>> np.asarray(out["chunk"]).ravel().tolist() == np.tile(x.sum(0), 4).tolist()
True

Each primitive's rules are registered right below it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from replicator.core.context import check_group, require_context

__all__ = [
    "PLACEHOLDERS",
    "all_gather",
    "all_gather_p",
    "all_max",
    "all_mean",
    "all_min",
    "all_reduce_p",
    "all_sum",
    "broadcast",
    "broadcast_p",
    "collective_name",
    "num_replicas",
    "reduce_scatter",
    "reduce_scatter_p",
    "replica_id",
    "replica_id_p",
]

PyTree = Any
LOWERING_PASS = "lower-collectives"
PLACEHOLDERS: set[Primitive] = set()


def _placeholder(name: str, *, multiple_results: bool = False) -> Primitive:
    """A primitive that must be rewritten before it reaches XLA."""
    prim = Primitive(name)
    prim.multiple_results = multiple_results

    def impl(*args: Any, **params: Any) -> Any:
        del args, params
        raise RuntimeError(
            f"The cross-replica placeholder '{name}' was evaluated eagerly. "
            f"Call replicator's collectives from a step_fn run by "
            f"Replicator.run(step_fn, input_fn, ...)."
        )

    def unlowered(ctx: Any, *args: Any, **params: Any) -> Any:
        del ctx, args
        raise RuntimeError(
            f"The cross-replica placeholder '{name}' (params {params}) reached "
            f"XLA unlowered: the pass '{LOWERING_PASS}' should have replaced it "
            f"with a mesh collective. Keep '{LOWERING_PASS}' in the pass manager "
            f"(it cannot be disabled), and call collectives only inside a "
            f"step_fn run by Replicator.run."
        )

    prim.def_impl(impl)
    mlir.register_lowering(prim, unlowered)
    PLACEHOLDERS.add(prim)
    return prim


def _leaves(tree: PyTree, api_name: str) -> tuple[list[jax.Array], Any]:
    leaves, treedef = jax.tree.flatten(tree)
    arrays = []
    for leaf in leaves:
        try:
            arrays.append(jnp.asarray(leaf))
        except TypeError as e:
            raise TypeError(
                f"replicator.{api_name}: every leaf must be an array or a number, "
                f"got {type(leaf).__name__}. Pass a pytree of arrays."
            ) from e
    return arrays, treedef


def _zeros_like_aval(aval: Any) -> Any:
    return ad.Zero(aval.to_tangent_aval())


def _zero_tangent(primal: Any) -> Any:
    """The symbolic zero tangent of ``primal`` (``ad.Zero.from_primal_value`` is gone)."""
    return _zeros_like_aval(jax.typeof(primal))


# ----------------------------------------------------------------------------
# all_reduce: all_sum, all_mean, all_max, all_min
# ----------------------------------------------------------------------------

all_reduce_p = _placeholder("rp.all_reduce", multiple_results=True)
REDUCE_OPS = ("sum", "mean", "max", "min")


def _all_reduce(tree: PyTree, op: str, group: str | None, api_name: str) -> PyTree:
    ctx = require_context(api_name)
    check_group(group, api_name)
    leaves, treedef = _leaves(tree, api_name)
    if not leaves:
        return tree
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    for path, leaf in zip(paths, leaves, strict=True):
        if op in ("sum", "mean") and leaf.dtype == jnp.bool_:
            raise TypeError(
                f"replicator.{api_name}: leaf x{path} is boolean and cannot be summed; cast first, "
                "e.g. x.astype(jnp.int32)."
            )
        if op == "mean" and not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(
                f"replicator.all_mean: leaf x{path} has dtype {leaf.dtype}, and a mean of integers is not an "
                "integer. Use rp.all_sum (then divide) or cast it to float; if it is a counter identical on "
                "every replica (Equinox's batch-norm state), leave it out of the mean, e.g. "
                "eqx.partition(tree, eqx.is_inexact_array)."
            )
    out = all_reduce_p.bind(*leaves, op=op, group=group, group_size=ctx.group_size(group))
    return treedef.unflatten(out)


def all_sum(x: PyTree, *, group: str | None = None) -> PyTree:
    """Sum of ``x`` over the replicas of ``group``, on every replica.

    Args:
      x: a pytree of arrays.
      group: ``None`` (all replicas), ``'cores'`` (the replicas of one
        worker) or ``'workers'`` (same core index across workers).

    Returns:
      A pytree like ``x``; every replica of a group holds the same sum.
    """
    return _all_reduce(x, "sum", group, "all_sum")


def all_mean(x: PyTree, *, group: str | None = None) -> PyTree:
    """Mean of ``x`` over the replicas of ``group`` (float leaves only)."""
    return _all_reduce(x, "mean", group, "all_mean")


def all_max(x: PyTree, *, group: str | None = None) -> PyTree:
    """Element-wise maximum of ``x`` over the replicas of ``group``."""
    return _all_reduce(x, "max", group, "all_max")


def all_min(x: PyTree, *, group: str | None = None) -> PyTree:
    """Element-wise minimum of ``x`` over the replicas of ``group``."""
    return _all_reduce(x, "min", group, "all_min")


def _all_reduce_abstract_eval(*avals: Any, op: str, group: str | None, group_size: int) -> list:
    del op, group, group_size
    return list(avals)


all_reduce_p.def_abstract_eval(_all_reduce_abstract_eval)


def _all_reduce_jvp_rule(primals: list, tangents: list, *, op: str, group: str | None, group_size: int) -> tuple:
    params = dict(group=group, group_size=group_size)
    out = all_reduce_p.bind(*primals, op=op, **params)
    # Only float leaves with a nonzero tangent take part: an integer or bool
    # leaf's tangent is a float0 zero, which must stay symbolic.
    out_tangents: list = [_zero_tangent(y) for y in out]
    live = [
        i
        for i, (x, t) in enumerate(zip(primals, tangents, strict=True))
        if type(t) is not ad.Zero and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not live:
        return out, out_tangents
    if op in ("sum", "mean"):
        summed = all_reduce_p.bind(*(tangents[i] for i in live), op=op, **params)
        for i, t in zip(live, summed, strict=True):
            out_tangents[i] = t
        return out, out_tangents
    # max/min: the tangent of the chosen value, averaged over ties (as jnp.max).
    # The tie counts depend on primals only and are summed in their own bind:
    # bound together with the tangents they would become part of the linear
    # program, and dividing by them could not be transposed.
    chosen = [primals[i] == out[i] for i in live]
    counts = all_reduce_p.bind(
        *(c.astype(tangents[i].dtype) for c, i in zip(chosen, live, strict=True)), op="sum", **params
    )
    picked = all_reduce_p.bind(
        *(jnp.where(c, tangents[i], jnp.zeros_like(tangents[i])) for c, i in zip(chosen, live, strict=True)),
        op="sum",
        **params,
    )
    for i, count, t in zip(live, counts, picked, strict=True):
        out_tangents[i] = t / count
    return out, out_tangents


def _all_reduce_transpose_rule(cts: list, *primals: Any, op: str, group: str | None, group_size: int) -> list:
    if op not in ("sum", "mean"):
        raise NotImplementedError(f"all_{op} is not linear; only its JVP is defined.")
    live = [i for i, ct in enumerate(cts) if type(ct) is not ad.Zero]
    results: list = [ad.Zero(p.aval) for p in primals]
    if live:
        summed = all_reduce_p.bind(*(cts[i] for i in live), op=op, group=group, group_size=group_size)
        for i, ct in zip(live, summed, strict=True):
            results[i] = ct
    return results


def _all_reduce_batching_rule(args: list, dims: list, **params: Any) -> tuple:
    return all_reduce_p.bind(*args, **params), dims


ad.primitive_jvps[all_reduce_p] = _all_reduce_jvp_rule
ad.primitive_transposes[all_reduce_p] = _all_reduce_transpose_rule
batching.primitive_batchers[all_reduce_p] = _all_reduce_batching_rule


# ----------------------------------------------------------------------------
# all_gather
# ----------------------------------------------------------------------------

all_gather_p = _placeholder("rp.all_gather")


def _check_axis(axis: int, ndim: int, api_name: str, *, extra: int = 0) -> int:
    if not isinstance(axis, (int, np.integer)):
        raise TypeError(f"replicator.{api_name}: axis must be an int, got {axis!r}.")
    bound = ndim + extra
    if not -bound <= axis < bound:
        raise ValueError(
            f"replicator.{api_name}: axis={axis} is out of range for a leaf of rank "
            f"{ndim} (valid: {-bound}..{bound - 1})."
        )
    return int(axis) % bound


def all_gather(x: PyTree, *, axis: int = 0, tiled: bool = False, group: str | None = None) -> PyTree:
    """Every replica's ``x``, in replica-id order, on every replica.

    Args:
      x: a pytree of arrays.
      axis: where the replica axis goes. With ``tiled=False`` a new axis of
        size N is inserted there; with ``tiled=True`` the leaves are
        concatenated along the existing ``axis``.
      tiled: concatenate instead of stack.
      group: see :func:`all_sum`.

    Example: with 8 replicas each holding ``x`` of shape ``(4, 3)``,
    ``all_gather(x).shape == (8, 4, 3)`` and
    ``all_gather(x, tiled=True).shape == (32, 3)``.
    """
    ctx = require_context("all_gather")
    check_group(group, "all_gather")
    leaves, treedef = _leaves(x, "all_gather")
    n = ctx.group_size(group)
    out = []
    for leaf in leaves:
        if tiled and leaf.ndim == 0:
            raise ValueError(
                "replicator.all_gather(tiled=True) needs leaves of rank >= 1; use tiled=False for scalars."
            )
        ax = _check_axis(axis, leaf.ndim, "all_gather", extra=0 if tiled else 1)
        out.append(all_gather_p.bind(leaf, axis=ax, tiled=bool(tiled), group=group, group_size=n))
    return treedef.unflatten(out)


def _all_gather_abstract_eval(aval: Any, *, axis: int, tiled: bool, group: str | None, group_size: int) -> Any:
    del group
    shape = list(aval.shape)
    if tiled:
        shape[axis] *= group_size
    else:
        shape.insert(axis, group_size)
    return aval.update(shape=tuple(shape))


def _all_gather_transpose_rule(ct: Any, x: Any, *, axis: int, tiled: bool, group: str | None, group_size: int) -> list:
    del x
    if type(ct) is ad.Zero:
        return [None]
    summed = reduce_scatter_p.bind(ct, axis=axis, group=group, group_size=group_size)
    return [summed if tiled else lax.squeeze(summed, (axis,))]


def _all_gather_batching_rule(args: list, dims: list, *, axis: int, tiled: bool, **params: Any) -> tuple:
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    return all_gather_p.bind(x, axis=axis + 1, tiled=tiled, **params), 0


all_gather_p.def_abstract_eval(_all_gather_abstract_eval)
ad.deflinear2(all_gather_p, _all_gather_transpose_rule)
batching.primitive_batchers[all_gather_p] = _all_gather_batching_rule


# ----------------------------------------------------------------------------
# reduce_scatter
# ----------------------------------------------------------------------------

reduce_scatter_p = _placeholder("rp.reduce_scatter")


def reduce_scatter(x: PyTree, *, axis: int = 0, group: str | None = None) -> PyTree:
    """Sum over replicas; replica i keeps the i-th of N equal chunks along ``axis``.

    ``x.shape[axis]`` must be divisible by the number of replicas N of the
    group. Example: 8 replicas, ``x`` of shape ``(16,)`` -> shape ``(2,)``.
    """
    ctx = require_context("reduce_scatter")
    check_group(group, "reduce_scatter")
    leaves, treedef = _leaves(x, "reduce_scatter")
    n = ctx.group_size(group)
    out = []
    for leaf in leaves:
        if leaf.ndim == 0:
            raise ValueError("replicator.reduce_scatter needs leaves of rank >= 1, got a scalar.")
        ax = _check_axis(axis, leaf.ndim, "reduce_scatter")
        if leaf.shape[ax] % n:
            raise ValueError(
                f"replicator.reduce_scatter: axis {ax} of a leaf with shape {leaf.shape} has "
                f"size {leaf.shape[ax]}, not divisible by the {n} replicas of group={group!r}; "
                f"pad it to a multiple of {n}."
            )
        if leaf.dtype == jnp.bool_:
            raise TypeError(
                "replicator.reduce_scatter: a leaf is boolean and cannot be summed; cast first, e.g. x.astype(jnp.int32)."
            )
        out.append(reduce_scatter_p.bind(leaf, axis=ax, group=group, group_size=n))
    return treedef.unflatten(out)


def _reduce_scatter_abstract_eval(aval: Any, *, axis: int, group: str | None, group_size: int) -> Any:
    del group
    shape = list(aval.shape)
    shape[axis] //= group_size
    return aval.update(shape=tuple(shape))


def _reduce_scatter_transpose_rule(ct: Any, x: Any, *, axis: int, group: str | None, group_size: int) -> list:
    del x
    if type(ct) is ad.Zero:
        return [None]
    return [all_gather_p.bind(ct, axis=axis, tiled=True, group=group, group_size=group_size)]


def _reduce_scatter_batching_rule(args: list, dims: list, *, axis: int, **params: Any) -> tuple:
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    return reduce_scatter_p.bind(x, axis=axis + 1, **params), 0


reduce_scatter_p.def_abstract_eval(_reduce_scatter_abstract_eval)
ad.deflinear2(reduce_scatter_p, _reduce_scatter_transpose_rule)
batching.primitive_batchers[reduce_scatter_p] = _reduce_scatter_batching_rule


# ----------------------------------------------------------------------------
# broadcast
# ----------------------------------------------------------------------------

broadcast_p = _placeholder("rp.broadcast")


def broadcast(x: PyTree, *, source: int = 0, group: str | None = None) -> PyTree:
    """Replica ``source``'s ``x`` on every replica of the group.

    ``source`` is an index within the group: a replica id for ``group=None``,
    a core index for ``'cores'``, a worker index for ``'workers'``.
    """
    ctx = require_context("broadcast")
    check_group(group, "broadcast")
    n = ctx.group_size(group)
    if not isinstance(source, (int, np.integer)) or not 0 <= source < n:
        raise ValueError(
            f"replicator.broadcast: source={source!r} is out of range; group={group!r} "
            f"has {n} replicas, so source must be an int in 0..{n - 1}."
        )
    leaves, treedef = _leaves(x, "broadcast")
    out = [broadcast_p.bind(leaf, source=int(source), group=group, group_size=n) for leaf in leaves]
    return treedef.unflatten(out)


def _broadcast_transpose_rule(ct: Any, x: Any, *, source: int, group: str | None, group_size: int) -> list:
    del x
    if type(ct) is ad.Zero:
        return [None]
    (total,) = all_reduce_p.bind(ct, op="sum", group=group, group_size=group_size)
    mine = replica_id_p.bind(group=group) == source
    return [jnp.where(mine, total, jnp.zeros_like(total))]


broadcast_p.def_abstract_eval(lambda aval, **params: aval)
ad.deflinear2(broadcast_p, _broadcast_transpose_rule)
batching.primitive_batchers[broadcast_p] = lambda args, dims, **params: (broadcast_p.bind(*args, **params), dims[0])


# ----------------------------------------------------------------------------
# replica_id, num_replicas
# ----------------------------------------------------------------------------

replica_id_p = _placeholder("rp.replica_id")


def replica_id(*, group: str | None = None) -> jax.Array:
    """This replica's index, an int32 scalar.

    ``group=None``: ``worker * cores_per_worker + core``; ``'cores'``: the core
    index within the worker; ``'workers'``: the worker index.
    """
    require_context("replica_id")
    check_group(group, "replica_id")
    return replica_id_p.bind(group=group)


def num_replicas(*, group: str | None = None) -> int:
    """The number of replicas in ``group`` (a Python int, known at trace time)."""
    ctx = require_context("num_replicas")
    return ctx.group_size(check_group(group, "num_replicas"))


replica_id_p.def_abstract_eval(lambda **params: jax.core.ShapedArray((), jnp.int32))


def _replica_id_jvp_rule(primals: list, tangents: list, **params: Any) -> tuple:
    del primals, tangents
    out = replica_id_p.bind(**params)
    return out, _zero_tangent(out)


ad.primitive_jvps[replica_id_p] = _replica_id_jvp_rule
batching.primitive_batchers[replica_id_p] = lambda args, dims, **params: (replica_id_p.bind(**params), None)


# ----------------------------------------------------------------------------
# Names for messages and reports
# ----------------------------------------------------------------------------

_NAMES: dict[Primitive, Callable[[dict], str]] = {
    all_reduce_p: lambda params: f"all_{params['op']}",
    all_gather_p: lambda params: "all_gather",
    reduce_scatter_p: lambda params: "reduce_scatter",
    broadcast_p: lambda params: "broadcast",
    replica_id_p: lambda params: "replica_id",
}


def collective_name(prim: Primitive, params: dict) -> str:
    """The user-facing name of a placeholder equation, e.g. ``all_mean``."""
    return _NAMES[prim](params)


# ----------------------------------------------------------------------------
# stage_boundary: where a pipeline-parallel step is cut into stages
# ----------------------------------------------------------------------------

#: Not a placeholder: it runs (as the identity) where no pipeline splits the step.
stage_boundary_p = Primitive("rp.stage_boundary")
stage_boundary_p.multiple_results = True


def stage_boundary(x: PyTree) -> PyTree:
    """Mark the end of a pipeline stage: ``x`` is what the next stage receives.

    The identity everywhere except where a pipeline splits the step: under
    plain ``jax.jit``, in a data-parallel ``Replicator.run``, or eagerly, the
    step computes what it computes without the marker. Under ``jax.grad`` the
    marker is linear and its transpose is the marker again, with
    ``transposed=True``: the backward pass holds one marker per boundary
    crossed by a gradient, which is where the split sends the cotangent back
    to the previous stage (docs/design/pipeline-parallelism.md). It also
    passes through ``vmap``, ``jit``, ``scan`` and ``jax.checkpoint``; the
    split rejects a boundary inside a loop body or a branch.

    Args:
      x: a pytree of arrays: every value the next stage reads from this one
        (bind one marker per boundary, e.g. ``h, mask = rp.stage_boundary((h, mask))``).

    Returns:
      ``x``, unchanged.

    >>> def f(w, x):
    ...     h = rp.stage_boundary(jnp.tanh(x * w))  # stage 0 | stage 1
    ...     return jnp.sum(h**2)
    >>> names = [e.primitive.name for e in jax.make_jaxpr(jax.grad(f))(0.5, 2.0).eqns]
    >>> names.count("rp.stage_boundary")  # forward and, transposed, backward
    2
    >>> bool(jax.grad(f)(0.5, 2.0) == jax.grad(lambda w, x: jnp.sum(jnp.tanh(x * w) ** 2))(0.5, 2.0))
    True
    """
    leaves, treedef = _leaves(x, "stage_boundary")
    if not leaves:
        return x
    return treedef.unflatten(stage_boundary_p.bind(*leaves, transposed=False))


def _stage_boundary_impl(*xs: Any, transposed: bool) -> list:
    del transposed
    return list(xs)


def _stage_boundary_lowering(ctx: Any, *xs: Any, transposed: bool) -> list:
    del ctx, transposed
    return list(xs)


def _stage_boundary_jvp_rule(primals: list, tangents: list, *, transposed: bool) -> tuple:
    out = stage_boundary_p.bind(*primals, transposed=transposed)
    out_tangents: list = [_zero_tangent(y) for y in out]
    # An integer leaf's (token ids') tangent reaches here as a symbolic zero, even one given as float0.
    live = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    if live:
        for i, t in zip(live, stage_boundary_p.bind(*(tangents[i] for i in live), transposed=transposed), strict=True):
            out_tangents[i] = t
    return out, out_tangents


def _stage_boundary_transpose_rule(cts: list, *primals: Any, transposed: bool) -> list:
    results: list = [ad.Zero(p.aval) if ad.is_undefined_primal(p) else None for p in primals]
    live = [i for i, ct in enumerate(cts) if type(ct) is not ad.Zero and ad.is_undefined_primal(primals[i])]
    if live:
        for i, ct in zip(live, stage_boundary_p.bind(*(cts[i] for i in live), transposed=not transposed), strict=True):
            results[i] = ct
    return results


def _stage_boundary_batching_rule(args: list, dims: list, *, transposed: bool) -> tuple:
    return stage_boundary_p.bind(*args, transposed=transposed), list(dims)


stage_boundary_p.def_impl(_stage_boundary_impl)
stage_boundary_p.def_abstract_eval(lambda *avals, transposed: list(avals))
mlir.register_lowering(stage_boundary_p, _stage_boundary_lowering)
ad.primitive_jvps[stage_boundary_p] = _stage_boundary_jvp_rule
ad.primitive_transposes[stage_boundary_p] = _stage_boundary_transpose_rule
batching.primitive_batchers[stage_boundary_p] = _stage_boundary_batching_rule
__all__ += ["stage_boundary", "stage_boundary_p"]
