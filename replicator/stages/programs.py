"""Per-stage programs cut out of a split step: each stage's forward and backward of one micro-batch.

From a :class:`~replicator.stages.split.StageSplit` of a traced
``jax.value_and_grad`` (forward and backward, no update yet), stage ``s`` gets

* ``forward(inputs, received) -> (sent, residuals, outputs)``: its forward
  equations; ``received`` are the values of the forward boundaries into ``s``,
  ``sent`` the operands of those out of it, ``residuals`` what its backward
  reads (:meth:`StageSplit.residuals`);
* ``backward(inputs, residuals, received) -> (sent, outputs)``: its backward
  equations, ``received`` the cotangents coming back into ``s``.

``inputs`` are all the step's inputs (constants, parameters, the micro-batch;
what a stage does not read costs nothing once compiled). ``outputs`` has one
entry per output of the step: the value where ``s`` contributes it, else zeros.
An output is contributed by one stage (the first that holds it), except a
cross-stage sum (a tied parameter's gradient): each of its stages contributes
its own operands, so the sum over stages of every stage's ``outputs`` is the
step's outputs. A schedule (:mod:`replicator.stages.gpipe`) runs these on
micro-batches and sums.

The programs are plain Python functions that bind the equations one by one
(an interpreter), so they run under ``jit``, ``shard_map`` and ``lax.switch``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

from replicator.core.jaxprs import DefUse
from replicator.stages.split import BACKWARD, FORWARD, StageSplit, StageSplitError

__all__ = ["StagePrograms", "stage_programs"]


@dataclasses.dataclass(frozen=True)
class StagePrograms:
    """Stage ``stage``'s programs and the avals of what they pass around.

    Attributes:
      stage: the stage.
      forward: ``(inputs, received) -> (sent, residuals, outputs)``, lists of arrays.
      backward: ``(inputs, residuals, received) -> (sent, outputs)``.
      received: avals of the forward values ``stage`` receives (in boundary order), and
      sent: of those it sends; ``residuals``: of what its forward keeps for its backward;
      received_ct, sent_ct: the same for the cotangents of the backward.
    """

    stage: int
    forward: Callable[[Sequence[Any], Sequence[Any]], tuple[list, list, list]]
    backward: Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], tuple[list, list]]
    received: tuple[Any, ...]
    sent: tuple[Any, ...]
    residuals: tuple[Any, ...]
    received_ct: tuple[Any, ...]
    sent_ct: tuple[Any, ...]


def _read(env: dict[Var, Any], atom: Any) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


def _run(eqns: Sequence[JaxprEqn], env: dict[Var, Any]) -> None:
    """Bind ``eqns`` in order, reading and writing ``env`` (autodidax's ``eval_jaxpr``)."""

    for eqn in eqns:
        bound = eqn.primitive.get_bind_params(eqn.params)  # older JAX: (subfuns, params); 0.10: params
        subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
        outs = eqn.primitive.bind(*subfuns, *(_read(env, v) for v in eqn.invars), **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for var, value in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, DropVar):
                env[var] = value


def stage_programs(split: StageSplit, closed: ClosedJaxpr) -> list[StagePrograms]:
    """The programs of every stage of ``split``, a split of ``closed`` (a traced value-and-gradient).

    Raises:
      StageSplitError: the step has an update phase (this increment splits a value-and-gradient only).
    """
    jaxpr: Jaxpr = split.jaxpr
    if any(phase not in (FORWARD, BACKWARD) for phase in split.phases):
        raise StageSplitError(
            "stage programs are cut from a value-and-gradient for now: the step has an update phase "
            "(an optimizer after the gradient). Split jax.value_and_grad(loss) and apply the update outside."
        )
    facts = DefUse(jaxpr)
    owner = _output_owners(split, facts)
    sums = {s.eqn: s for s in split.stage_sums}
    marker = {b.eqn for b in split.boundaries}
    return [_programs_of(split, closed, s, owner, sums, marker, facts) for s in range(split.num_stages)]


def _output_owners(split: StageSplit, facts: DefUse) -> list[int | None]:
    """Per output of the step, the one stage that contributes it (``None``: a cross-stage sum or what it feeds,
    to which every stage contributes its part)."""
    sums = {split.jaxpr.eqns[s.eqn].outvars[0] for s in split.stage_sums}
    for eqn in split.jaxpr.eqns:  # and what they feed: each stage holds its part of it
        if any(isinstance(v, Var) and v in sums for v in eqn.invars):
            sums.update(v for v in eqn.outvars if isinstance(v, Var))
    owners: list[int | None] = []
    for atom, stages in zip(split.jaxpr.outvars, split.output_stages, strict=True):
        if isinstance(atom, Var) and atom in sums:
            owners.append(None)
        elif isinstance(atom, Var) and facts.is_input(atom):
            raise StageSplitError(
                "an output of the split step is one of its inputs, returned as is: not supported yet."
            )
        else:
            owners.append(min(stages))
    return owners


def _programs_of(
    split: StageSplit,
    closed: ClosedJaxpr,
    stage: int,
    owner: list[int | None],
    sums: dict,
    marker: set[int],
    facts: DefUse,
) -> StagePrograms:
    jaxpr = split.jaxpr
    mine = split.eqns_of(stage)
    fwd = [jaxpr.eqns[i] for i in mine if split.phases[i] == FORWARD and i not in marker and i not in sums]
    bwd_idx = [i for i in mine if split.phases[i] == BACKWARD and i not in marker]
    forward_b = [b for b in split.boundaries if not b.transposed and split.phases[b.eqn] == FORWARD]
    backward_b = [b for b in split.boundaries if b.transposed]
    received = [v for b in forward_b if b.receiver == stage for v in jaxpr.eqns[b.eqn].outvars]
    sent = [v for b in forward_b if b.sender == stage for v in b.values]
    received_ct = [v for b in backward_b if b.receiver == stage for v in jaxpr.eqns[b.eqn].outvars]
    sent_ct = [v for b in backward_b if b.sender == stage for v in b.values]
    residuals = list(split.residuals(stage))
    # A forward recomputed in the backward (jax.checkpoint) crosses the boundaries again with the same
    # values: the receiver keeps what it received in the forward and reads it there (recomputation from
    # the boundaries); the sender's recomputation of it is left unread.
    again = _recomputed_crossings(split, stage)
    residuals += [v for v in dict.fromkeys(again.values()) if v not in residuals]
    inputs = [*jaxpr.constvars, *jaxpr.invars]
    consts = list(closed.consts)
    phase_of = {v: split.phases[facts.producer(v)] for v in jaxpr.outvars if facts.producer(v) is not None}

    def outputs(env: dict[Var, Any], phase: str) -> list:
        out = []
        for position, atom in enumerate(jaxpr.outvars):
            zeros = jnp.zeros(atom.aval.shape, atom.aval.dtype)
            if isinstance(atom, Literal):
                here = owner[position] == stage and phase == BACKWARD  # a constant: once, with the gradients
                out.append(jnp.broadcast_to(jnp.asarray(atom.val, atom.aval.dtype), atom.aval.shape) if here else zeros)
            elif phase_of.get(atom) == phase and (owner[position] is None or owner[position] == stage):
                out.append(env.get(atom, zeros))
            else:
                out.append(zeros)
        return out

    def run_backward(env: dict[Var, Any]) -> None:
        """The backward equations; a cross-stage sum is this stage's part: the sum of its own operands.
        What follows it is linear in the cotangents, so each stage's parts add up to the whole."""
        for index in bwd_idx:
            eqn = jaxpr.eqns[index]
            if index not in sums:
                _run([eqn], env)
                continue
            (var,) = eqn.outvars
            total = jnp.zeros(var.aval.shape, var.aval.dtype)
            for v in eqn.invars:
                if isinstance(v, Var) and v in env and _local(split, facts, v, stage):
                    total = total + env[v]
            env[var] = total

    def forward(step_inputs: Sequence[Any], got: Sequence[Any]) -> tuple[list, list, list]:
        env = dict(zip(inputs, [*consts, *step_inputs], strict=True))
        env.update(zip(received, got, strict=True))
        _run(fwd, env)
        return [_read(env, v) for v in sent], [env[v] for v in residuals], outputs(env, FORWARD)

    def backward(step_inputs: Sequence[Any], kept: Sequence[Any], got: Sequence[Any]) -> tuple[list, list]:
        env = dict(zip(inputs, [*consts, *step_inputs], strict=True))
        env.update(zip(residuals, kept, strict=True))
        env.update(zip(received_ct, got, strict=True))
        env.update((var, env[first]) for var, first in again.items())
        run_backward(env)
        return [_read(env, v) for v in sent_ct], outputs(env, BACKWARD)

    return StagePrograms(
        stage=stage,
        forward=forward,
        backward=backward,
        received=tuple(v.aval for v in received),
        sent=tuple(v.aval for v in sent),
        residuals=tuple(v.aval for v in residuals),
        received_ct=tuple(v.aval for v in received_ct),
        sent_ct=tuple(v.aval for v in sent_ct),
    )


def _recomputed_crossings(split: StageSplit, stage: int) -> dict[Var, Var]:
    """The results of the forward markers in the backward phase into ``stage``, each with the result of the
    forward phase's marker it repeats (the k-th crossing between the same two stages)."""
    jaxpr = split.jaxpr
    first: dict[tuple[int, int], list] = {}
    again: dict[tuple[int, int], list] = {}
    for b in split.boundaries:
        if not b.transposed and b.receiver == stage:
            table = first if split.phases[b.eqn] == FORWARD else again
            table.setdefault((b.sender, b.receiver), []).append(b)
    pairs: dict[Var, Var] = {}
    for key, repeats in again.items():
        originals = first.get(key, [])
        if len(repeats) > len(originals):
            raise StageSplitError(
                f"the backward recomputes a crossing from stage {key[0]} to {key[1]} (at {repeats[0].source}) "
                "that the forward does not make; please report this step."
            )
        for k, b in enumerate(repeats):
            source = jaxpr.eqns[originals[k].eqn].outvars
            target = jaxpr.eqns[b.eqn].outvars
            if [v.aval for v in source] != [v.aval for v in target]:
                raise StageSplitError(
                    f"the crossing recomputed at {b.source} differs from the forward's ({originals[k].source})."
                )
            pairs.update(zip(target, source, strict=True))
    return pairs


def _local(split: StageSplit, facts: DefUse, var: Var, stage: int) -> bool:
    """Whether ``stage`` computes its own ``var``, an operand of a cross-stage sum (a free one: the first stage)."""
    index = facts.producer(var)
    if index is None:
        return stage == 0
    stages = split.eqn_stages[index]
    return stage == min(stages) if split.free[index] else stage in stages
