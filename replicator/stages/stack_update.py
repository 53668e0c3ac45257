"""A scanned stack of layers stays partitioned through the user's own step: each stage stores and updates only
its ``L/S`` slice of the stacked parameters, of their gradient and of the optimizer state that follows them.

:func:`~replicator.stages.scan_split.split_scan` cuts a stack ``(L, ...)`` into ``S`` consecutive slices, one
per stage (a :class:`~replicator.stages.split.Partition` of the input and of its gradient). The forward and
backward programs then take a stage's slice and return its slice's gradient, as for ``run_pipelined``. The
update cut from the step (:mod:`replicator.stages.user_step`) runs on the slices where that is the same
computation. The precondition, checked on the update's equations by :func:`plan_slices` (a stack that does
not meet it stays whole on every stage, its gradient summed across them, as before):

* every equation that reads a sliced value is element-wise
  (:data:`~replicator.passes.shard_optimizer.ELEMENTWISE`: operands of the value's shape or scalars, the
  sliced ones cut alike) or a user's all-reduce over the data-parallel replicas (``rp.all_mean(grads)``). The
  slice of ``f(x, y)`` is then ``f`` of the slices; an operand of that shape computed whole (a constant) is
  sliced where it is read;
* the step's outputs are not sliced values, and a state leaf whose new value is a sliced value is sliced too:
  the stack itself, or an update-only leaf of the same shape kept by every stage (Adam's moments), itself
  read element-wise only.

A reduction over a sliced value (a global-norm clip) or any other reader (a ``dot``, a reshape) would need the
other stages' slices: such a stack stays whole, with every leaf its update ties to it.

With ZeRO (:mod:`~replicator.stages.chunks`) a stage's slice is chunked over its ``D`` devices as a leaf of the
slice's shape (:class:`StageSlices` gives each sliced value its aval on the stage); an equation that would
combine a slice with a chunk of a whole leaf of the same shape keeps the stack whole (checked by the step).

>>> def loss(w, x):
...     h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)
...     return jnp.mean(h**2)
>>> opt = optax.adam(1e-2)
>>> def step(state, x):
...     w, opt_state = state
...     value, grads = jax.value_and_grad(loss)(w, x)
...     updates, opt_state = opt.update(rp.all_mean(grads), opt_state, w)
...     return (optax.apply_updates(w, updates), opt_state), rp.all_mean(value)
>>> w, x = jnp.full((4, 3, 3), 0.2), jnp.ones((8, 3))
>>> repl = rp.Replicator(1, 2, devices=jax.devices()[:2], parallelism=rp.Parallelism(stages=2, microbatches=2))
>>> (new_w, _), _ = repl.run(step, x, (w, opt.init(w)))
>>> built = repl.pipelined.user_step(step, x, (w, opt.init(w)))  # what run built for these shapes
>>> sorted(built.slices.leaves)  # the stack, Adam's mu and nu of it (not its count): stage s keeps 2s, 2s+1
[0, 2, 3]
>>> want = optax.apply_updates(w, opt.update(jax.grad(loss)(w, x), opt.init(w), w)[0])
>>> bool(jnp.allclose(new_w, want, atol=1e-6))
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax import lax
from jax.extend.core import DropVar, JaxprEqn, Literal, Var

from replicator.core.primitives import PLACEHOLDERS, all_reduce_p
from replicator.passes.shard_optimizer import ELEMENTWISE

__all__ = ["SlicePlan", "StageSlices", "plan_slices", "run_on_slices"]

#: ``(stage, start, stop)`` per slice of the leading axis, in ``start`` order (a ``Partition``'s pieces).
Pieces = tuple[tuple[int, int, int], ...]


@dataclasses.dataclass(frozen=True)
class SlicePlan:
    """What the update holds as each stage's slice.

    Attributes:
      leaves: the state leaves each stage keeps as its slice, with their pieces.
      grads: per partitioned parameter among ``leaves``, the position (among the cut values) of its gradient,
        which the stage programs return as the slice alone.
      values: every variable of the update that holds a slice, with its pieces.
    """

    leaves: Mapping[int, Pieces] = dataclasses.field(default_factory=dict)
    grads: Mapping[int, int] = dataclasses.field(default_factory=dict)
    values: Mapping[Var, Pieces] = dataclasses.field(default_factory=dict)

    def kept_aval(self, leaf: int, stage: int, aval: Any) -> Any:
        """Leaf ``leaf`` as ``stage`` keeps it: ``aval``, or its slice's."""
        if leaf not in self.leaves:
            return aval
        start, stop = _bounds(self.leaves[leaf], stage)
        return jax.ShapeDtypeStruct((stop - start, *aval.shape[1:]), aval.dtype)

    def bounds_of(self, leaf: int, stage: int) -> tuple[int, int]:
        """``stage``'s ``(start, stop)`` of the sliced leaf ``leaf``."""
        return _bounds(self.leaves[leaf], stage)

    def bounds(self, stage: int) -> dict[Var, tuple[int, int]]:
        """``stage``'s ``(start, stop)`` of every sliced variable."""
        return {v: _bounds(pieces, stage) for v, pieces in self.values.items()}

    def on_stage(self, stage: int) -> StageSlices:
        """What ``stage`` holds as slices, with their ``(start, stop)`` and avals."""
        return StageSlices(self.bounds(stage))


class StageSlices(Mapping[Var, tuple[int, int]]):
    """One stage's sliced variables, each with its ``(start, stop)`` of the leading axis, and the aval a
    variable has on the stage (:meth:`aval`: its slice's, or its own)."""

    def __init__(self, bounds: Mapping[Var, tuple[int, int]]):
        self._bounds = dict(bounds)

    def __getitem__(self, v: Var) -> tuple[int, int]:
        return self._bounds[v]

    def __iter__(self) -> Iterator[Var]:
        return iter(self._bounds)

    def __len__(self) -> int:
        return len(self._bounds)

    def aval(self, v: Any) -> Any:
        """``v``'s aval on this stage: its slice's where it is sliced."""
        if not (isinstance(v, Var) and v in self._bounds):
            return v.aval
        start, stop = self._bounds[v]
        return jax.ShapeDtypeStruct((stop - start, *v.aval.shape[1:]), v.aval.dtype)


def _bounds(pieces: Pieces, stage: int) -> tuple[int, int]:
    return next((a, b) for s, a, b in pieces if s == stage)


def _on_slices(eqn: JaxprEqn, reads: Sequence[Var]) -> bool:
    """Whether ``eqn``, reading the sliced ``reads``, computes a slice from slices (an element-wise equation of
    one shape)."""
    shape = reads[0].aval.shape
    return (
        eqn.primitive.name in ELEMENTWISE
        and not eqn.effects
        and len(eqn.outvars) == 1
        and eqn.outvars[0].aval.shape == shape
        and all(getattr(v.aval, "shape", ()) in ((), shape) for v in eqn.invars)
    )


def _propagate(
    eqns: Sequence[JaxprEqn], seeds: Mapping[Var, tuple[Pieces, frozenset[int]]]
) -> tuple[dict[Var, tuple[Pieces, frozenset[int]]], set[int]]:
    """The sliced values computed from ``seeds`` (each with its pieces and the leaves it comes from), and the
    leaves of the values some equation reads whole."""
    values, whole = dict(seeds), set()
    for eqn in eqns:
        reads = [v for v in eqn.invars if isinstance(v, Var) and v in values]
        if not reads:
            continue
        roots = frozenset().union(*(values[v][1] for v in reads))
        if eqn.primitive is all_reduce_p:  # a sum, mean, maximum or minimum over the replicas
            for v, out in zip(eqn.invars, eqn.outvars, strict=True):  # replica by replica: shape-agnostic
                if isinstance(v, Var) and v in values and not isinstance(out, DropVar):
                    values[out] = values[v]
            continue
        pieces = {values[v][0] for v in reads}
        if eqn.primitive not in PLACEHOLDERS and len(pieces) == 1 and _on_slices(eqn, reads):
            if not isinstance(eqn.outvars[0], DropVar):
                values[eqn.outvars[0]] = (pieces.pop(), roots)
        else:
            whole |= roots
    return values, whole


def plan_slices(
    eqns: Sequence[JaxprEqn],
    state_in: Sequence[Var],
    state_out: Sequence[Any],
    outputs: Sequence[Any],
    pairs: Mapping[int, tuple[int, Var, Pieces]],
    movable: Callable[[int], bool],
) -> SlicePlan:
    """Which leaves the update ``eqns`` can keep as slices (see the module docstring).

    Args:
      eqns: the update's equations (every stage's, in order); state_in, state_out: the state leaves' variables
        before and after it; outputs: the step's outputs.
      pairs: per partitioned parameter, ``(position, variable, pieces)`` of its gradient among the cut values.
      movable: whether an update-only leaf may be kept as slices (kept by every stage).
    """
    leaves: dict[int, Pieces] = {i: pieces for i, (_, _, pieces) in pairs.items()}
    rejected: set[int] = set()
    while True:
        seeds = {state_in[i]: (pieces, frozenset({i})) for i, pieces in leaves.items()}
        seeds.update((g, (pieces, frozenset({i}))) for i, (_, g, pieces) in pairs.items() if i in leaves)
        values, bad = _propagate(eqns, seeds)
        for atom in outputs:
            if isinstance(atom, Var) and atom in values:
                bad |= values[atom][1]
        grow: dict[int, Pieces] = {}
        for j, atom in enumerate(state_out):
            if not isinstance(atom, Var) or atom not in values or j in leaves:
                continue
            pieces, roots = values[atom]
            if j not in rejected and movable(j) and state_in[j].aval.shape == atom.aval.shape:
                grow[j] = pieces
            else:
                bad |= roots
        if bad:
            rejected |= bad
            leaves = {i: p for i, p in leaves.items() if i not in bad}
        elif grow:
            leaves.update(grow)
        else:
            grads = {i: position for i, (position, _, _) in pairs.items() if i in leaves}
            return SlicePlan(leaves, grads, {v: pieces for v, (pieces, _) in values.items()})


def run_on_slices(eqn: JaxprEqn, env: dict[Var, Any], bounds: Mapping[Var, tuple[int, int]]) -> None:
    """Bind the element-wise ``eqn`` on this stage's slices: a sliced operand as ``env`` holds it, a scalar
    whole, an operand of the value's shape computed whole sliced to the same ``(start, stop)``."""
    start, stop = next(bounds[v] for v in eqn.invars if isinstance(v, Var) and v in bounds)
    args = []
    for v in eqn.invars:
        value = v.val if isinstance(v, Literal) else env[v]
        if isinstance(v, Var) and v not in bounds and getattr(v.aval, "shape", ()) != ():
            value = lax.slice_in_dim(value, start, stop)
        args.append(value)
    bound = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    (out,) = eqn.outvars
    value = eqn.primitive.bind(*subfuns, *args, **params)
    if not isinstance(out, DropVar):
        env[out] = value
