"""Optimizers on replicas: an all-reducing optax wrapper and gradient accumulation.

Two ways to turn per-replica gradients into the gradient of the global batch,
both written with replicator's placeholders (``rp.all_mean``/``rp.all_sum``),
so the passes see, check and fuse them like any collective the user writes:

* :func:`wrap_optimizer` wraps an optax ``GradientTransformation``: its
  ``update`` first averages (or sums) the gradient pytree across replicas,
  then runs the wrapped transformation. ``init`` is unchanged. This is
  TF-Replicator's / Horovod's ``DistributedOptimizer``.
* :func:`accumulate_gradients` splits this replica's batch into ``k``
  micro-batches, sums their gradients locally in a ``lax.scan`` and all-reduces
  once at the end (Horovod's ``backward_passes_per_step``, PyTorch DDP's
  ``no_sync``): a ``k`` times larger batch for the memory of one micro-batch
  and the communication of one step.

Example (run by ``Replicator.run``; ``loss_fn(params, batch)`` is a mean over
the batch's rows, ``state = (params, adam.init(params))`` is built on the host)::

    import optax
    import replicator as rp
    from replicator.training.optim import accumulate_gradients, wrap_optimizer

    adam = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    tx = wrap_optimizer(adam)  # tx.init is adam.init

    def step_fn(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # this replica's gradients
        updates, opt_state = tx.update(grads, opt_state, params)  # rp.all_mean, then adam
        return (optax.apply_updates(params, updates), opt_state), {"loss": rp.all_mean(loss)}

    def accumulating_step_fn(state, batch):  # 4 micro-batches, one all-reduce
        params, opt_state = state
        loss, grads = accumulate_gradients(loss_fn, params, batch, 4)  # already averaged
        updates, opt_state = adam.update(grads, opt_state, params)  # so: the plain optimizer
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

**Gradient accumulation across steps (optax.MultiSteps).** Use
``wrap_optimizer(optax.MultiSteps(tx, k))``: every micro step all-reduces its
gradient, and ``MultiSteps`` accumulates the (replica-identical) averages; after
``k`` calls it applies ``tx`` to the average, which equals one step on the
``k``-times larger global batch. It costs one all-reduce per *micro* step.
The other nesting, ``optax.MultiSteps(wrap_optimizer(tx), k)``, would keep
each replica's *local* sum in the optimizer state, but state is one copy that
is identical on every replica, so ``check-replica-invariance`` rejects it with
a ``DivergentStateError`` (optax 0.2.8's ``MultiSteps`` also calls the inner
update, so the all-reduce, on every micro step and keeps the result only on
the ``k``-th). For one all-reduce per real step, accumulate inside one step
with :func:`accumulate_gradients` (a worker batch of ``k`` micro-batches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from replicator.core import primitives
from replicator.core.context import check_group

__all__ = ["REDUCTIONS", "accumulate_gradients", "reduce_gradients", "wrap_optimizer"]

PyTree = Any

#: The reductions a gradient can take across replicas.
REDUCTIONS = ("mean", "sum")


def _check_reduce(reduce: object, api_name: str, *, allow_none: bool = False) -> None:
    allowed = REDUCTIONS + ((None,) if allow_none else ())
    if reduce not in allowed:
        raise ValueError(
            f"{api_name}(reduce={reduce!r}): reduce must be one of {allowed}. Use 'mean' when the "
            f"loss is a mean over the batch's rows (the result is the gradient of the mean over "
            f"the global batch), 'sum' when it is a sum over rows."
            + (" None skips the all-reduce (e.g. when a wrapped optimizer does it)." if allow_none else "")
        )


def reduce_gradients(grads: PyTree, reduce: str = "mean", *, group: str | None = None) -> PyTree:
    """All-reduce a gradient pytree across replicas (inside a step).

    Args:
      grads: a pytree of float arrays.
      reduce: ``'mean'`` (``rp.all_mean``) or ``'sum'`` (``rp.all_sum``).
      group: ``None``, ``'cores'`` or ``'workers'`` (see ``rp.all_sum``).

    Returns:
      A pytree like ``grads``, identical on every replica of the group.
    """
    _check_reduce(reduce, "reduce_gradients")
    reducer = primitives.all_mean if reduce == "mean" else primitives.all_sum
    return reducer(grads, group=group)


# -- structure checks ------------------------------------------------------------


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


def _paths(tree: PyTree) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def _listing(paths: list[str], limit: int = 5) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _tree_difference(got: PyTree, want: PyTree, got_name: str, want_name: str) -> str | None:
    """A sentence naming the first way ``got`` differs from ``want``, or None.

    Compares pytree structure, then the shape of every leaf.
    """
    got_def, want_def = jax.tree.structure(got), jax.tree.structure(want)
    got_leaves, want_leaves = _paths(got), _paths(want)
    if got_def != want_def:
        extra = [p for p in got_leaves if p not in want_leaves]
        missing = [p for p in want_leaves if p not in got_leaves]
        parts = []
        if extra:
            parts.append(f"{got_name} has leaves that {want_name} lacks: {_listing(extra)}")
        if missing:
            parts.append(f"{got_name} lacks leaves that {want_name} has: {_listing(missing)}")
        if not parts:  # same leaf paths, different node types (tuple vs list, ...)
            parts.append(f"the pytree structures differ:\n  {got_name}: {got_def}\n  {want_name}: {want_def}")
        return "; ".join(parts)
    for (path, a), b in zip(got_leaves.items(), want_leaves.values(), strict=True):
        if np.shape(a) != np.shape(b):
            return f"{got_name}{path} has shape {tuple(np.shape(a))} where {want_name} has {tuple(np.shape(b))}"
    return None


def _check_update_args(
    tx: optax.GradientTransformationExtraArgs, updates: PyTree, state: PyTree, params: PyTree | None
) -> None:
    """Trace-time checks that ``updates``, ``state`` and ``params`` belong together."""
    if params is not None:
        diff = _tree_difference(updates, params, "grads", "params")
        if diff is not None:
            raise ValueError(
                f"wrap_optimizer: the gradients passed to update() do not match params: {diff}. "
                f"Fix: pass the gradients of exactly these params, e.g. "
                f"grads = jax.grad(loss_fn)(params, batch), and the same params as "
                f"tx.update(grads, opt_state, params)."
            )
    reference = params if params is not None else updates
    try:
        expected = jax.eval_shape(tx.init, jax.tree.map(_spec, reference))
    except Exception:  # noqa: BLE001 -- an init that cannot be traced abstractly: nothing to compare with.
        return
    diff = _tree_difference(jax.tree.map(_spec, state), expected, "opt_state", "tx.init(params)")
    if diff is not None:
        raise ValueError(
            f"wrap_optimizer: the optimizer state passed to update() does not match the "
            f"{'params' if params is not None else 'gradients'}: {diff}. It was created for other "
            f"params or by another optimizer. Fix: build it with the same (wrapped or unwrapped) "
            f"optimizer, opt_state = tx.init(params), for the params you differentiate."
        )


# -- wrap_optimizer ------------------------------------------------------------------


def _as_extra_args(tx: Any) -> optax.GradientTransformationExtraArgs:
    if hasattr(tx, "gradient_transformation"):  # optax.MultiSteps and other wrapper classes
        tx = tx.gradient_transformation()
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"wrap_optimizer(tx): tx must be an optax.GradientTransformation (with init and update), "
            f"got {type(tx).__name__}. Build one with optax, e.g. optax.adam(1e-3)."
        )
    return optax.with_extra_args_support(tx)


def wrap_optimizer(
    tx: optax.GradientTransformation, reduce: str = "mean", group: str | None = None
) -> optax.GradientTransformationExtraArgs:
    """An optax transformation that all-reduces the gradients, then applies ``tx``.

    ``init`` is ``tx.init``. ``update(grads, state, params=None, **extra_args)``
    checks at trace time that ``grads`` match ``params`` and that ``state``
    matches what ``tx.init`` builds for them (raising a ``ValueError`` that names
    the first differing leaf), all-reduces ``grads`` with ``rp.all_mean``
    (``reduce='mean'``) or ``rp.all_sum`` (``'sum'``) over ``group``, then calls
    ``tx.update``. Extra keyword arguments reach ``tx`` if it takes them
    (``optax.GradientTransformationExtraArgs``) and are dropped otherwise.

    Works with chains, schedules, ``optax.masked``, ``optax.multi_transform``
    and ``optax.MultiSteps`` (see the module docstring for which nesting); the
    state stays identical on every replica because everything after the
    all-reduce is.

    Args:
      tx: the optimizer, e.g. ``optax.adam(1e-3)`` or an ``optax.MultiSteps``.
      reduce: ``'mean'`` for losses that are means over rows (the usual case),
        ``'sum'`` for sums over rows.
      group: replicas to reduce over: ``None`` (all), ``'cores'`` or ``'workers'``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; ``update`` must be called
      inside a step run by ``Replicator.run``.

    Example::

        tx = wrap_optimizer(optax.adam(1e-3))
        opt_state = tx.init(params)                    # on the host
        updates, opt_state = tx.update(grads, opt_state, params)  # in the step
    """
    _check_reduce(reduce, "wrap_optimizer")
    check_group(group, "wrap_optimizer")
    inner = _as_extra_args(tx)

    def update_fn(
        updates: PyTree, state: PyTree, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, PyTree]:
        _check_update_args(inner, updates, state, params)
        reduced = reduce_gradients(updates, reduce, group=group)
        return inner.update(reduced, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)


# -- accumulate_gradients ------------------------------------------------------------


def _micro_batches(batch: PyTree, k: int) -> PyTree:
    """``batch`` with every leaf reshaped from ``(B, ...)`` to ``(k, B // k, ...)``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    if not flat:
        raise ValueError("accumulate_gradients: the batch has no arrays to split into micro-batches.")
    rows: dict[str, int] = {}
    for path, leaf in flat:
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"accumulate_gradients: batch{jax.tree_util.keystr(path)} is a scalar; every batch leaf "
                f"needs a leading axis of rows to split into micro-batches. Pass constants through "
                f"loss_fn's closure instead."
            )
        rows[jax.tree_util.keystr(path)] = shape[0]
    sizes = sorted(set(rows.values()))
    if len(sizes) > 1:
        listing = ", ".join(f"batch{p}: {n}" for p, n in rows.items())
        raise ValueError(
            f"accumulate_gradients: batch leaves have different leading sizes ({listing}); all must "
            f"have the same number of rows to be split into micro-batches."
        )
    (b,) = sizes
    if b % k:
        divisors = [d for d in range(1, b + 1) if b % d == 0]
        raise ValueError(
            f"accumulate_gradients: num_micro_batches={k} does not divide the per-replica batch of "
            f"{b} rows. Use a num_micro_batches that divides {b} (one of {divisors}), or make the "
            f"per-replica batch a multiple of {k}."
        )
    return jax.tree.map(lambda x: jnp.reshape(x, (k, b // k, *np.shape(x)[1:])), batch)


def _accumulator_dtype(dtype: Any) -> Any:
    """Sum low-precision floats in float32 (or wider)."""
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def accumulate_gradients(
    loss_fn: Callable[..., Any],
    params: PyTree,
    batch: PyTree,
    num_micro_batches: int,
    *,
    has_aux: bool = False,
    reduce: str | None = "mean",
    group: str | None = None,
) -> tuple[Any, PyTree]:
    """Loss and gradients of this replica's batch in ``k`` micro-batches, one all-reduce.

    Splits the leading axis of every ``batch`` leaf into ``num_micro_batches``
    equal micro-batches, runs ``jax.value_and_grad(loss_fn)`` on each inside a
    ``lax.scan`` (so only one micro-batch's activations are live), sums losses
    and gradients locally (in float32 for lower-precision floats), and
    all-reduces the loss and the gradients together in ONE ``rp.all_mean`` /
    ``rp.all_sum``.

    With ``reduce='mean'`` and a ``loss_fn`` that is a mean over rows, the
    result equals ``jax.value_and_grad(loss_fn)`` on the global batch (every
    replica's rows concatenated); with ``reduce='sum'`` and a sum over rows,
    likewise.

    Args:
      loss_fn: ``loss_fn(params, micro_batch) -> loss`` (a scalar), or
        ``-> (loss, aux)`` with ``has_aux=True``.
      params: differentiated, as by ``jax.grad``.
      batch: this replica's batch; every leaf has the same leading size ``B``.
      num_micro_batches: ``k``; must divide ``B``.
      has_aux: as for ``jax.value_and_grad``.
      reduce: ``'mean'`` (average micro-batches and replicas), ``'sum'`` (sum
        them), or ``None`` (average micro-batches, no all-reduce: e.g. when the
        gradients go to a :func:`wrap_optimizer` optimizer, which reduces).
      group: replicas to reduce over: ``None`` (all), ``'cores'``, ``'workers'``.

    Returns:
      ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux``, where
      ``aux`` is this replica's, stacked over micro-batches (leading axis ``k``)
      and not reduced. ``loss`` and ``grads`` are reduced like each other.

    Raises:
      ValueError: if ``num_micro_batches`` does not divide the batch (naming
        both numbers), or the batch leaves have different leading sizes.
    """
    _check_reduce(reduce, "accumulate_gradients", allow_none=True)
    check_group(group, "accumulate_gradients")
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, (int, np.integer)):
        raise TypeError(f"accumulate_gradients: num_micro_batches must be an int, got {num_micro_batches!r}.")
    k = int(num_micro_batches)
    if k < 1:
        raise ValueError(f"accumulate_gradients: num_micro_batches must be >= 1, got {k}.")
    micro = _micro_batches(batch, k)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), micro)
    out_shape, grad_shape = jax.eval_shape(grad_fn, params, first)
    loss_shape = out_shape[0] if has_aux else out_shape
    zeros = lambda s: jnp.zeros(s.shape, _accumulator_dtype(s.dtype))  # noqa: E731

    def body(carry: tuple, micro_batch: PyTree) -> tuple[tuple, Any]:
        loss_sum, grad_sum = carry
        out, grads = grad_fn(params, micro_batch)
        loss, aux = out if has_aux else (out, None)
        loss_sum = loss_sum + loss.astype(loss_sum.dtype)
        grad_sum = jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), grad_sum, grads)
        return (loss_sum, grad_sum), aux

    init = (zeros(loss_shape), jax.tree.map(zeros, grad_shape))
    (loss_sum, grad_sum), aux = lax.scan(body, init, micro)
    if reduce != "sum":
        loss_sum, grad_sum = jax.tree.map(lambda x: x / k, (loss_sum, grad_sum))
    if reduce is not None:
        loss_sum, grad_sum = reduce_gradients((loss_sum, grad_sum), reduce, group=group)
    loss = loss_sum.astype(loss_shape.dtype)
    grads = jax.tree.map(lambda g, s: g.astype(s.dtype), grad_sum, grad_shape)
    return ((loss, aux) if has_aux else loss), grads
