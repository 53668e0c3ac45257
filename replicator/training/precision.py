"""Mixed precision on replicas: a dtype policy and dynamic loss scaling.

:class:`MixedPrecision` says which dtype parameters live in (float32 "master"
weights) and which dtype the model computes in (bfloat16 or float16).
:class:`DynamicLossScale` multiplies the loss by a scale before
differentiation so that small float16 gradients do not flush to zero, divides
the gradients by it afterwards, and adapts it: a step whose gradients are not
finite (inf/nan) on ANY replica is skipped on EVERY replica (parameters and
optimizer state unchanged) and the scale is divided by ``factor``; after
``period`` finite steps in a row it is multiplied by ``factor``. The "finite"
decision is made with ``rp.all_min`` (:func:`all_finite`), so it is identical
on every replica and the replicas cannot diverge, and
``check-replica-invariance`` accepts state selected with it.

Example (inside a step run by ``Replicator.run``; ``state`` is
``(params, opt_state, loss_scale)`` with ``loss_scale = DynamicLossScale.create()``)::

    import replicator as rp
    from replicator.training.precision import DynamicLossScale, MixedPrecision, all_finite, select_tree

    policy = MixedPrecision(compute_dtype=jnp.bfloat16, param_dtype=jnp.float32)

    def loss_fn(params, batch, loss_scale):
        logits = model(policy.cast_to_compute(params), policy.cast_to_compute(batch["x"]))
        loss = cross_entropy(logits.astype(jnp.float32), batch["y"])
        return loss_scale.scale_loss(loss), loss

    def step_fn(state, batch):
        params, opt_state, loss_scale = state
        grads, loss = jax.grad(loss_fn, has_aux=True)(params, batch, loss_scale)
        grads = loss_scale.unscale_grads(policy.cast_to_param(grads))
        finite = all_finite(grads)                  # the same on every replica
        updates, new_opt_state = tx.update(rp.all_mean(grads), opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = select_tree(finite, (new_params, new_opt_state), (params, opt_state))
        return (params, opt_state, loss_scale.update(finite)), {"loss": loss, "finite": finite}

    state, out = repl.run(step_fn, input_fn, state)
    state[2].check(out["finite"])   # raises if the scale is stuck at its minimum

**Tolerance against float32.** bfloat16 keeps 8 bits of mantissa (a relative
rounding error of up to 2**-9 per operation), so a bfloat16 forward and
backward pass with float32 master parameters drifts from pure float32 training.
Measured by ``tests/test_precision.py::test_bf16_compute_tracks_float32``
(a 2-32-32-1 tanh MLP, bfloat16 forward and backward pass, float32 master
parameters, SGD with learning rate 0.1, 20 steps on a global batch of 64
rows over 8 replicas, against pure float32 training on one device): the
largest parameter difference was 5.2e-4 (parameters of magnitude up to 1.8)
and every step's loss was within 2.3e-3 of the float32 loss (about 1.5%;
the final loss within 0.7%). The test asserts a parameter difference below
2e-3 and loss differences below 1e-2. With Adam (learning rate 1e-2) the
parameter difference after 20 steps was 2.1e-3, and after 100 SGD steps
7e-4. Expect differences of this order, growing with the number of steps and
the learning rate; float32 replicated training matches one device to ~1e-6.

bfloat16 has float32's exponent range, so it rarely overflows and usually
needs no loss scaling (``DynamicLossScale.create(1.0)`` with a large
``period`` makes it a no-op but still skips non-finite steps); float16 does.
A step that is not finite even at the minimum scale is not an overflow a
smaller scale can fix (the model diverged, or an operation overflows for any
scale): :meth:`DynamicLossScale.check`, called on the host, raises a
``FloatingPointError`` then instead of skipping steps forever.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from replicator.core import primitives
from replicator.core.context import check_group

__all__ = [
    "DEFAULT_FACTOR",
    "DEFAULT_MIN_SCALE",
    "DEFAULT_PERIOD",
    "DynamicLossScale",
    "MixedPrecision",
    "all_finite",
    "cast_floating",
    "select_tree",
]

PyTree = Any
DTypeLike = Any

DEFAULT_PERIOD = 2000
DEFAULT_FACTOR = 2.0
DEFAULT_MIN_SCALE = 1.0


def cast_floating(tree: PyTree, dtype: DTypeLike) -> PyTree:
    """Cast every floating-point leaf of ``tree`` to ``dtype``; leave the others.

    Integer, boolean and complex leaves (step counters, labels, masks) are
    returned unchanged.
    """

    def cast(x: Any) -> Any:
        x = jnp.asarray(x)
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """A dtype policy: parameters in ``param_dtype``, computation in ``compute_dtype``.

    Args:
      compute_dtype: dtype of the forward and backward pass (bfloat16, float16
        or float32).
      param_dtype: dtype of the parameters kept in the state and updated by
        the optimizer (the "master" weights), usually float32.
      output_dtype: dtype of the model outputs handed to the loss (default:
        ``param_dtype``); losses are more accurate in float32.

    Example::

        policy = MixedPrecision(jnp.bfloat16)
        y = model(policy.cast_to_compute(params), policy.cast_to_compute(x))
        loss = loss_fn(policy.cast_to_output(y), labels)
        grads = policy.cast_to_param(grads)   # float32 grads for the optimizer
    """

    compute_dtype: DTypeLike = jnp.bfloat16
    param_dtype: DTypeLike = jnp.float32
    output_dtype: DTypeLike | None = None

    def __post_init__(self) -> None:
        for name in ("compute_dtype", "param_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is None and name == "output_dtype":
                continue
            dtype = np.dtype(value)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(
                    f"MixedPrecision({name}={value!r}): must be a floating-point dtype such as "
                    f"jnp.bfloat16, jnp.float16 or jnp.float32."
                )
            object.__setattr__(self, name, dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Floating leaves of ``tree`` in ``compute_dtype`` (others unchanged)."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Floating leaves of ``tree`` in ``param_dtype`` (e.g. gradients, for the optimizer)."""
        return cast_floating(tree, self.param_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Floating leaves of ``tree`` in ``output_dtype`` (``param_dtype`` if unset)."""
        return cast_floating(tree, self.output_dtype if self.output_dtype is not None else self.param_dtype)


# -- finite checks and skipping ----------------------------------------------------


def all_finite(tree: PyTree, *, cross_replica: bool = True, group: str | None = None) -> jax.Array:
    """Whether every element of every leaf of ``tree`` is finite, as a bool scalar.

    Args:
      tree: a pytree of arrays (non-float leaves count as finite).
      cross_replica: combine the flags of every replica of ``group`` with
        ``rp.all_min`` (inside a step), so the answer is the same on all of
        them: False if any replica has an inf or nan. With False, this
        replica's flag only (usable outside a step).
      group: replicas to combine over: ``None`` (all), ``'cores'``, ``'workers'``.
    """
    check_group(group, "all_finite")
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    finite = jnp.all(jnp.stack(flags)) if flags else jnp.array(True)
    if not cross_replica:
        return finite
    return primitives.all_min(finite.astype(jnp.int32), group=group) > 0


def select_tree(pred: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
    """``on_true`` where the scalar ``pred`` holds, else ``on_false``, leaf by leaf.

    Use it to skip a step: ``select_tree(finite, (new_params, new_opt_state),
    (params, opt_state))``. Both trees must have the same structure, shapes
    and dtypes. A replica-identical ``pred`` (from :func:`all_finite`) keeps
    replica-identical state identical.
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise TypeError(
            f"select_tree: pred must be a bool scalar, got {pred.dtype}{list(pred.shape)}; "
            f"reduce it first, e.g. jnp.all(...)."
        )
    true_def, false_def = jax.tree.structure(on_true), jax.tree.structure(on_false)
    if true_def != false_def:
        raise ValueError(
            f"select_tree: the two trees have different structures:\n  on_true:  {true_def}\n"
            f"  on_false: {false_def}\nPass the new and the old value of the same state."
        )

    def select(a: Any, b: Any) -> Any:
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"select_tree: leaves differ ({a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}); the new "
                f"value must keep the old one's shape and dtype."
            )
        return jnp.where(pred, a, b)

    return jax.tree.map(select, on_true, on_false)


# -- dynamic loss scaling ------------------------------------------------------------


class DynamicLossScale(NamedTuple):
    """State of dynamic loss scaling: a pytree of two scalars, kept in the step's state.

    Attributes:
      scale: float32 scalar, the current loss scale.
      good_steps: int32 scalar, finite steps in a row since the scale last changed.

    Create it with :meth:`create`; call :meth:`scale_loss` on the loss before
    differentiating, :meth:`unscale_grads` on the gradients, and
    :meth:`update` with the (replica-identical) finite flag.
    """

    scale: jax.Array  # f32[]
    good_steps: jax.Array  # i32[]

    @classmethod
    def create(cls, initial_scale: float = 2.0**15) -> DynamicLossScale:
        """The initial state: ``scale=initial_scale``, no good steps yet."""
        if not np.isfinite(initial_scale) or initial_scale <= 0:
            raise ValueError(
                f"DynamicLossScale.create: initial_scale must be positive and finite, got {initial_scale}."
            )
        return cls(jnp.asarray(initial_scale, jnp.float32), jnp.asarray(0, jnp.int32))

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        """``loss * scale`` (in the loss's dtype)."""
        loss = jnp.asarray(loss)
        return loss * self.scale.astype(loss.dtype)

    def unscale_grads(self, grads: PyTree) -> PyTree:
        """``grads / scale``, computed in float32 (or wider) and cast back per leaf."""

        def unscale(g: Any) -> Any:
            g = jnp.asarray(g)
            if not jnp.issubdtype(g.dtype, jnp.floating):
                return g
            wide = jnp.promote_types(g.dtype, jnp.float32)
            return (g.astype(wide) / self.scale.astype(wide)).astype(g.dtype)

        return jax.tree.map(unscale, grads)

    def update(
        self,
        grads_finite: jax.Array,
        *,
        period: int = DEFAULT_PERIOD,
        factor: float = DEFAULT_FACTOR,
        min_scale: float = DEFAULT_MIN_SCALE,
    ) -> DynamicLossScale:
        """The state for the next step.

        A finite step counts one more good step; at ``period`` good steps the
        scale is multiplied by ``factor`` (unless that overflows float32) and the
        count restarts. A non-finite step divides the scale by ``factor``, not
        below ``min_scale``, and restarts the count.

        Args:
          grads_finite: bool scalar, identical on every replica (use
            :func:`all_finite`).
          period: finite steps in a row before the scale grows.
          factor: growth and shrink factor (> 1).
          min_scale: the scale never drops below this.
        """
        if period < 1 or factor <= 1 or min_scale <= 0:
            raise ValueError(
                f"DynamicLossScale.update: needs period >= 1, factor > 1 and min_scale > 0; got "
                f"period={period}, factor={factor}, min_scale={min_scale}."
            )
        finite = jnp.asarray(grads_finite)
        if finite.shape != () or finite.dtype != jnp.bool_:
            raise TypeError(
                f"DynamicLossScale.update: grads_finite must be a bool scalar, got {finite.dtype}"
                f"{list(finite.shape)}; use replicator.training.precision.all_finite(grads)."
            )
        good = self.good_steps + 1
        grow = good >= period
        grown = self.scale * factor
        grown = jnp.where(jnp.isfinite(grown), grown, self.scale)
        shrunk = jnp.maximum(self.scale / factor, jnp.float32(min_scale))
        scale = jnp.where(finite, jnp.where(grow, grown, self.scale), shrunk)
        good_steps = jnp.where(finite & ~grow, good, 0)
        return DynamicLossScale(scale.astype(jnp.float32), good_steps.astype(jnp.int32))

    def check(self, grads_finite: Any, *, min_scale: float = DEFAULT_MIN_SCALE) -> None:
        """On the host, after a step: raise if a step was skipped at the minimum scale.

        Call it on the loss scale a step *returned*, with that step's finite
        flag (a bool, or the per-replica stacked output of ``Replicator.run``).
        A step that was skipped and left the scale at ``min_scale`` means that
        even the smallest allowed scale does not make the gradients finite:
        skipping more steps would not help.

        Raises:
          FloatingPointError: naming the scale, with what to do.
        """
        finite = bool(np.all(np.asarray(grads_finite)))
        scale = float(np.asarray(self.scale))
        if not finite and scale <= min_scale:
            raise FloatingPointError(
                f"DynamicLossScale: the gradients are not finite (inf or nan on at least one replica) and "
                f"the loss scale has dropped to its minimum {min_scale:g}: lowering it cannot make them "
                f"finite. The model has probably diverged (lower the learning rate, clip gradients, check "
                f"the data for inf/nan), or an operation overflows in the compute dtype (compute it in "
                f"float32, e.g. softmax and losses)."
            )
