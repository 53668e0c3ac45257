"""What a pipeline stage keeps per micro-batch between its forward and its backward (the stash), and what its
backward computes again instead.

A stage's backward reads values its forward computed
(:meth:`~replicator.stages.split.StageSplit.read_back`). Kept for every micro-batch in flight, they cost the schedule's peak
live micro-batches times their size, so only what depends on the micro-batch is kept:

* a value of the parameters alone (:attr:`~replicator.stages.split.StageSplit.param_only`: the slice of a
  stack's weights a cut ``lax.scan`` reads, ``p["w"][i]``, a cast of a parameter) is the same for every
  micro-batch: the backward runs its equations again (``recompute``; a partitioned stack's slice is the
  stage's input itself, a rename);
* a ``lax.scan``'s stacked carry-in is rebuilt from the scan's initial carry (``rebuilt``): JAX 0.10's scan
  keeps, for its backward, each iteration's carry as it came in *and* as it went out (the same activations
  twice but for the first and the last): the carry-in is rebuilt from the carry-out; JAX 0.12's keeps the
  carry-in alone, whose first entry is the initial carry (the micro-batch, or what the stage received): the
  forward keeps the rest of it;
* everything else is kept (``kept``).

>>> def loss(p, x):
...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p)
...     return jnp.mean(h**2)
>>> closed = jax.make_jaxpr(jax.value_and_grad(rp.stages.split_scan(loss, 2)))(jnp.ones((4, 3, 3)), jnp.ones((2, 3)))
>>> split = rp.stages.split_stages(closed, first_batch=1)
>>> plan = stash_plan(split, 0)
>>> all(v.aval.shape[1:] == (2, 3) for v in plan.kept)  # stacked activations of 2 rows, no (2, 3, 3) weights
True
>>> [tuple(v.aval.shape) for v in plan.recomputed]  # the stage's slice of the weights, read again
[(2, 3, 3)]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.extend.core import Var

from replicator._jax_compat import scan_operand_counts
from replicator.stages.split import FORWARD, StageSplit

__all__ = ["CarryStack", "Stash", "stash_plan"]


@dataclasses.dataclass(frozen=True)
class CarryStack:
    """A scan's stacked carry-in ``[init, c_1, ..., c_{L-1}]`` (the order reversed for a ``reverse=True``
    scan), rebuilt from its initial carry ``init`` and ``source``: the stacked carry-out ``[c_1, ..., c_L]``
    where the backward reads it too (JAX 0.10 keeps both), else (``tail``) the stack's own last ``L - 1``
    entries, which the forward stashes in its place (a fresh variable, :meth:`take`)."""

    source: Var
    init: Any
    reverse: bool
    tail: bool = False

    def take(self, stacked: Any) -> Any:
        """What the forward stashes of the stacked carry-in (``tail`` only): all but the initial carry."""
        return stacked[:-1] if self.reverse else stacked[1:]

    def rebuild(self, source: Any, init: Any) -> Any:
        """The stacked carry-in from the values of ``source`` and ``init``."""
        first = jnp.expand_dims(jnp.asarray(init, source.dtype), 0)
        rest = source if self.tail else (source[1:] if self.reverse else source[:-1])
        return lax.concatenate([rest, first] if self.reverse else [first, rest], 0)


@dataclasses.dataclass(frozen=True)
class Stash:
    """One stage's stash.

    Attributes:
      kept: the variables its forward returns per micro-batch, for its backward (a ``tail`` carry stack's
        ``source`` among them: a variable of no equation, which the forward computes after its equations).
      recompute: the equations (indices of the split's jaxpr) of values of the parameters alone that its
        backward runs again, in program order, before its own.
      rebuilt: the scans' stacked carry-ins its backward rebuilds (:class:`CarryStack`), after ``recompute``.
      recomputed: the values of the parameters alone its backward reads (those ``recompute`` computes).
      other: of ``kept``, the values that do not depend on the micro-batch (neither on a batch input nor on a
        value received from another stage) and are kept all the same: a value of the parameters computed by a
        collective or an effect, which the backward does not run again. The rest of ``kept`` is activations.
    """

    kept: tuple[Var, ...]
    recompute: tuple[int, ...]
    rebuilt: dict[Var, CarryStack]
    recomputed: tuple[Var, ...]
    other: tuple[Var, ...] = ()


def stash_plan(split: StageSplit, stage: int) -> Stash:
    """``stage``'s :class:`Stash` in ``split``."""
    read = split.read_back(stage)
    param_only = [v for v in read if split.is_param_only(v)]
    rest = [v for v in read if not split.is_param_only(v)]
    rebuilt = _carry_stacks(split, stage, rest, param_only)
    kept = [v for v in rest if v not in rebuilt]
    for stack in rebuilt.values():
        init = stack.init
        if stack.tail:
            kept.append(stack.source)
        if not isinstance(init, Var) or init in kept or init in param_only or init not in split.producers:
            continue  # a literal or an input: the backward has it
        (param_only if split.is_param_only(init) else kept).append(init)
    varying = _micro_batch_values(split)
    varying.update(stack.source for var, stack in rebuilt.items() if stack.tail and var in varying)
    other = tuple(v for v in kept if v not in varying)
    return Stash(tuple(kept), _closure(split, stage, param_only), rebuilt, tuple(param_only), other)


def _micro_batch_values(split: StageSplit) -> set[Var]:
    """The variables of ``split.jaxpr`` that depend on the micro-batch: on an input from ``params_end`` on, or on
    a value received across a boundary. (Without ``params_end``, every input counts as the micro-batch.)"""

    jaxpr = split.jaxpr
    varying: set[Var] = set(jaxpr.invars[split.params_end :] if split.params_end else jaxpr.invars)
    markers = {b.eqn for b in split.boundaries}
    for index, eqn in enumerate(jaxpr.eqns):
        if split.phases[index] != FORWARD:
            continue
        if index in markers or any(isinstance(v, Var) and v in varying for v in eqn.invars):
            varying.update(v for v in eqn.outvars if isinstance(v, Var))
    return varying


def _closure(split: StageSplit, stage: int, wanted: list[Var]) -> tuple[int, ...]:
    """The parameter-only equations of ``stage`` that compute ``wanted``, in program order."""
    producer = {v: i for i in split.eqns_of(stage) if split.param_only[i] for v in split.jaxpr.eqns[i].outvars}
    needed: set[int] = set()
    todo = list(wanted)
    while todo:
        index = producer.get(todo.pop())
        if index is None or index in needed:
            continue
        needed.add(index)
        todo.extend(v for v in split.jaxpr.eqns[index].invars if isinstance(v, Var))
    return tuple(sorted(needed))


def _carry_stacks(split: StageSplit, stage: int, read: list[Var], param_only: list[Var]) -> dict[Var, CarryStack]:
    """The outputs in ``read`` of ``stage``'s forward scans that stack a carry as it came in: rebuilt from the
    stacked carry-out where ``read`` holds it, else from their tail where the initial carry costs nothing to
    keep (an input, a literal, a value of the parameters alone or one kept already)."""

    wanted = set(read)
    found: dict[Var, CarryStack] = {}
    for index in split.eqns_of(stage):
        eqn = split.jaxpr.eqns[index]
        if eqn.primitive.name != "scan" or split.phases[index] != FORWARD:
            continue
        body = eqn.params["jaxpr"]
        body = getattr(body, "jaxpr", body)  # a closed jaxpr
        consts, carries = scan_operand_counts(eqn.params)
        carry_in = body.invars[consts : consts + carries]
        carry_out = body.outvars[:carries]
        ys = body.outvars[carries:]
        reverse = bool(eqn.params["reverse"])
        for k, y in enumerate(ys):
            stacked = eqn.outvars[carries + k]
            if stacked not in wanted or not isinstance(y, Var) or y not in carry_in:
                continue
            j = carry_in.index(y)
            out, init = carry_out[j], eqn.invars[consts + j]
            if not isinstance(out, Var) or out in body.invars:  # a carry passed on unchanged: nothing to shift
                continue
            twins = [eqn.outvars[carries + q] for q, z in enumerate(ys) if z is out and q != k]
            twin = next((t for t in twins if t in wanted and _alike(t, stacked)), None)
            if twin is not None:
                found[stacked] = CarryStack(twin, init, reverse)
                continue
            free = not isinstance(init, Var) or init not in split.producers or init in param_only or init in wanted
            if free and stacked.aval.shape[0] > 1:
                shape = (stacked.aval.shape[0] - 1, *stacked.aval.shape[1:])
                found[stacked] = CarryStack(Var(stacked.aval.update(shape=shape)), init, reverse, tail=True)
    return found


def _alike(a: Var, b: Var) -> bool:
    return (a.aval.shape, a.aval.dtype) == (b.aval.shape, b.aval.dtype)
