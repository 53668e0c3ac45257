"""Per-stage programs cut out of a split step: each stage's forward and backward of one micro-batch.

From a :class:`~replicator.stages.split.StageSplit` of a traced
``jax.value_and_grad`` (forward and backward, no update yet), stage ``s`` gets

* ``forward(inputs, received) -> (sent, residuals, outputs)``: its forward
  equations; ``received`` are the values of the forward boundaries into ``s``,
  ``sent`` the operands of those out of it, ``residuals`` what its backward
  reads that depends on the micro-batch (:mod:`~replicator.stages.stash`);
* ``backward(inputs, residuals, received) -> (sent, outputs)``: its backward
  equations, ``received`` the cotangents coming back into ``s``; first it
  computes again what it reads of the parameters alone (a slice of a stack's
  weights: the same for every micro-batch, never stashed per micro-batch).

``inputs`` are all the step's inputs (constants, parameters, the micro-batch;
what a stage does not read costs nothing once compiled). ``outputs`` has one
entry per output of the step: the value where ``s`` contributes it, else zeros.
An output is contributed by one stage (the first that holds it), except a
cross-stage sum (a tied parameter's gradient): each of its stages contributes
its own operands, so the sum over stages of every stage's ``outputs`` is the
step's outputs. A schedule (:mod:`replicator.stages.gpipe`) runs these on
micro-batches and sums.

A *partitioned* parameter (``partitioned=``: a stack of layers that each stage
reads through its own slice of the leading axis, its gradient the sum of the
padded slice gradients; :class:`~replicator.stages.split.Partition`) is given
to a stage as its slice alone: the stage's ``slice`` becomes a rename of the
input, and its output is the slice's gradient (the operand of its ``pad``; the
pads and their ``add_any`` sum are dropped), listed in ``sliced``: it is that
stage's own, never summed with another stage's.

The programs are plain Python functions that bind the equations one by one
(an interpreter), so they run under ``jit``, ``shard_map`` and ``lax.switch``.
A collective the user wrote (``rp.all_mean``, ``rp.all_sum``, ``rp.replica_id``:
batch norm across replicas) is bound as the mesh collective over the data-parallel
axes :data:`DATA_AXES` of the stage that runs it (its group: ``None`` both axes,
``'workers'`` or ``'cores'`` one), never over ``'stages'``: it means what it
means in a data-parallel step, across the replicas of the pipeline, on the
micro-batch at hand. With several replicas per device (``replicas_per_device``) the device's logical
replicas run under ``jax.vmap`` over the fold axes (:func:`folded`, :data:`~replicator.core.layout.FOLDED_AXES`):
a collective then spans those too, and ``replica_id`` counts the logical replicas.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

from replicator._jax_compat import user_source_line
from replicator.core.jaxprs import DefUse, iter_eqns, sub_jaxprs
from replicator.core.layout import FOLDED_AXES
from replicator.core.primitives import PLACEHOLDERS, all_reduce_p, replica_id_p
from replicator.stages.split import BACKWARD, FORWARD, StageSplit, StageSplitError
from replicator.stages.stash import stash_plan

__all__ = ["DATA_AXES", "StagePrograms", "check_collectives", "folded", "stage_programs"]

#: The data-parallel axes of a pipeline's mesh, beside ``'stages'``: the same names as a data-parallel run's,
#: so a collective the user wrote (``group=None``) keeps its meaning. A tensor axis would come innermost.
DATA_AXES = ("workers", "cores")
_REDUCE = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}


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
      contributes: the positions of the step's outputs to which this stage's programs may add a part (the
        outputs it owns, and the cross-stage sums every stage adds to); its other outputs are always zeros.
      sliced: the outputs this stage returns only its slice of (a partitioned parameter's gradient), by
        position, with the slice's aval: the stage's own part, joined (not summed) with the other stages'.
      forward_outputs: the positions of ``contributes`` that ``forward`` may add to (the loss; values the
        forward computes); ``backward`` adds to the others, and returns zeros at these.
    """

    stage: int
    forward: Callable[[Sequence[Any], Sequence[Any]], tuple[list, list, list]]
    backward: Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], tuple[list, list]]
    received: tuple[Any, ...]
    sent: tuple[Any, ...]
    residuals: tuple[Any, ...]
    received_ct: tuple[Any, ...]
    sent_ct: tuple[Any, ...]
    contributes: tuple[int, ...] = ()
    sliced: dict[int, Any] = dataclasses.field(default_factory=dict)
    forward_outputs: tuple[int, ...] = ()


def _read(env: dict[Var, Any], atom: Any) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


def _run(eqns: Sequence[JaxprEqn], env: dict[Var, Any]) -> None:
    """Bind ``eqns`` in order, reading and writing ``env`` (autodidax's ``eval_jaxpr``)."""

    for eqn in eqns:
        if eqn.primitive in PLACEHOLDERS:
            _collective(eqn, env)
            continue
        bound = eqn.primitive.get_bind_params(eqn.params)  # older JAX: (subfuns, params); 0.10: params
        subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
        outs = eqn.primitive.bind(*subfuns, *(_read(env, v) for v in eqn.invars), **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for var, value in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, DropVar):
                env[var] = value


#: The fold axes (``FoldLayout.folded_axes``: ``(name, size)``, outermost first) the programs run vmapped over.
_FOLD: contextvars.ContextVar[tuple[tuple[str, int], ...]] = contextvars.ContextVar("fold", default=())


@contextlib.contextmanager
def folded(fold_axes: Sequence[tuple[str, int]]) -> Iterator[None]:
    """While tracing under ``jax.vmap`` over ``fold_axes`` (a device's logical replicas), a user's collective
    also spans them: ``rp.all_mean`` is over every logical replica, ``rp.replica_id`` the logical index."""
    token = _FOLD.set(tuple(fold_axes))
    try:
        yield
    finally:
        _FOLD.reset(token)


def _axes(group: str | None) -> tuple[str, ...]:
    """The mesh axes of ``group``, each followed by its fold axis where the programs run folded."""
    fold = dict(_FOLD.get())
    out: list[str] = []
    for axis in DATA_AXES if group is None else (group,):
        out.append(axis)
        if FOLDED_AXES[axis] in fold:
            out.append(FOLDED_AXES[axis])
    return tuple(out)


def _replica_id(group: str | None) -> Any:
    """The logical replica's index in ``group``: the device's index on the group's mesh axes times the
    replicas it hosts, plus the fold index (a device hosts consecutive replicas, so this is replica order)."""
    fold = dict(_FOLD.get())
    mesh_axes = DATA_AXES if group is None else (group,)
    index = lax.axis_index(mesh_axes)
    for axis in mesh_axes:  # fold_layout folds along one axis only where the other has one device
        if FOLDED_AXES[axis] in fold:
            index = index * fold[FOLDED_AXES[axis]] + lax.axis_index(FOLDED_AXES[axis])
    return index


def _collective(eqn: JaxprEqn, env: dict[Var, Any]) -> None:
    """A user's collective placeholder, bound as the mesh collective over the data axes of its group (and
    the fold axes, where :func:`folded`)."""
    args = [_read(env, v) for v in eqn.invars]
    axes = _axes(eqn.params["group"])
    if eqn.primitive is all_reduce_p:
        outs = [_REDUCE[eqn.params["op"]](x, axes) for x in args]
    elif eqn.primitive is replica_id_p:
        outs = [_replica_id(eqn.params["group"]).astype(jnp.int32)]
    else:  # check_collectives refused it before the programs were built
        raise AssertionError(eqn.primitive.name)
    for var, value in zip(eqn.outvars, outs, strict=True):
        if not isinstance(var, DropVar):
            env[var] = value


def check_collectives(jaxpr: Jaxpr) -> None:
    """Raise :class:`StageSplitError` naming the line of a collective a pipelined step cannot run yet: any but
    ``all_sum``/``all_mean``/``all_max``/``all_min`` and ``replica_id``, or one inside a sub-graph the split
    keeps whole (a ``scan`` or ``while`` body, a ``cond`` branch, a ``jax.checkpoint``)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive in PLACEHOLDERS and eqn.primitive not in (all_reduce_p, replica_id_p):
            raise StageSplitError(
                f"{eqn.primitive.name} at {user_source_line(eqn.source_info)}: a pipelined loss runs rp.all_sum, "
                "rp.all_mean, rp.all_max, rp.all_min and rp.replica_id across the data-parallel replicas; "
                "all_gather, reduce_scatter and broadcast are not supported in a pipeline yet."
            )
        for sub in sub_jaxprs(eqn.params):
            for inner in iter_eqns(sub):
                if inner.primitive in PLACEHOLDERS:
                    raise StageSplitError(
                        f"{inner.primitive.name} at {user_source_line(inner.source_info)} is inside the "
                        f"{eqn.primitive.name} at {user_source_line(eqn.source_info)}: a pipelined loss runs "
                        "collectives at its top level only for now; move it out of the loop, branch or checkpoint."
                    )


def stage_programs(
    split: StageSplit, closed: ClosedJaxpr, partitioned: Mapping[int, int] | None = None
) -> list[StagePrograms]:
    """The programs of every stage of ``split``, a split of ``closed`` (a traced value-and-gradient).

    Args:
      split, closed: the split and the traced step.
      partitioned: input index (of ``split.jaxpr.invars``) -> output position, for each parameter a stage
        takes as its slice alone, and its gradient (both in ``split.input_partitions`` and
        ``split.output_partitions`` with the same pieces: :meth:`StageSplit.partitioned`).

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
    partitioned = dict(partitioned or {})
    for i, p in partitioned.items():
        if split.partition_pair(i, p) is None:
            raise ValueError(f"input {i} and output {p} are not partitioned alike (see StageSplit.partitioned).")
    return [_programs_of(split, closed, s, owner, sums, marker, facts, partitioned) for s in range(split.num_stages)]


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
    partitioned: dict[int, int],
) -> StagePrograms:
    jaxpr = split.jaxpr
    mine = split.eqns_of(stage)
    # A partitioned input: this stage's slice of it is the input itself. Its gradient: this stage's slice's
    # (the operand of its pad); the pads and their sum are not run.
    renames: dict[Var, Var] = {}
    sliced: dict[int, Any] = {}  # output position -> the variable of this stage's slice of it
    skip: set[int] = set()
    for i, position in partitioned.items():
        given, grad = split.input_partitions[i], split.output_partitions[position]
        skip.update((*given.eqns, *grad.eqns, *grad.adds))
        if (index := given.eqn_of(stage)) is not None:
            renames[jaxpr.eqns[index].outvars[0]] = jaxpr.invars[i]
            sliced[position] = jaxpr.eqns[grad.eqn_of(stage)].invars[0]
    dropped = marker | skip
    fwd = [jaxpr.eqns[i] for i in mine if split.phases[i] == FORWARD and i not in dropped and i not in sums]
    bwd_idx = [i for i in mine if split.phases[i] == BACKWARD and i not in dropped]
    unread = {p for p in partitioned.values() if p not in sliced}  # a partitioned output this stage holds none of
    forward_b = [b for b in split.boundaries if not b.transposed and split.phases[b.eqn] == FORWARD]
    backward_b = [b for b in split.boundaries if b.transposed]
    received = [v for b in forward_b if b.receiver == stage for v in jaxpr.eqns[b.eqn].outvars]
    sent = [v for b in forward_b if b.sender == stage for v in b.values]
    received_ct = [v for b in backward_b if b.receiver == stage for v in jaxpr.eqns[b.eqn].outvars]
    sent_ct = [v for b in backward_b if b.sender == stage for v in b.values]
    # The stash: what depends on the micro-batch. Values of the parameters alone (a slice of a stack's weights)
    # are computed again by the backward (a rename, for a partitioned stack's slice), a scan's stacked carry-in
    # rebuilt from its carry-out (stash.py).
    plan = stash_plan(split, stage)
    residuals = list(plan.kept)
    refwd = [jaxpr.eqns[i] for i in plan.recompute if i not in dropped]
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
            if position in sliced:
                part = sliced[position]
                zeros = jnp.zeros(part.aval.shape, part.aval.dtype)
                out.append(
                    _read(env, part) if phase == BACKWARD and (isinstance(part, Literal) or part in env) else zeros
                )
            elif position in unread:
                out.append(zeros)
            elif isinstance(atom, Literal):
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
        env.update((out, env[given]) for out, given in renames.items())
        env.update(zip(received, got, strict=True))
        _run(fwd, env)
        env.update((stack.source, stack.take(env[var])) for var, stack in plan.rebuilt.items() if stack.tail)
        return [_read(env, v) for v in sent], [env[v] for v in residuals], outputs(env, FORWARD)

    def backward(step_inputs: Sequence[Any], kept: Sequence[Any], got: Sequence[Any]) -> tuple[list, list]:
        env = dict(zip(inputs, [*consts, *step_inputs], strict=True))
        env.update((out, env[given]) for out, given in renames.items())
        env.update(zip(residuals, kept, strict=True))
        env.update(zip(received_ct, got, strict=True))
        env.update((var, env[first]) for var, first in again.items())
        _run(refwd, env)
        env.update(
            (var, stack.rebuild(env[stack.source], _read(env, stack.init))) for var, stack in plan.rebuilt.items()
        )
        run_backward(env)
        return [_read(env, v) for v in sent_ct], outputs(env, BACKWARD)

    contributes = tuple(i for i, o in enumerate(owner) if (o is None or o == stage) and i not in unread)
    return StagePrograms(
        stage=stage,
        forward=forward,
        backward=backward,
        received=tuple(v.aval for v in received),
        sent=tuple(v.aval for v in sent),
        residuals=tuple(v.aval for v in residuals),
        received_ct=tuple(v.aval for v in received_ct),
        sent_ct=tuple(v.aval for v in sent_ct),
        contributes=contributes,
        sliced={position: part.aval for position, part in sliced.items()},
        forward_outputs=tuple(
            i
            for i in contributes
            if i not in sliced and isinstance(jaxpr.outvars[i], Var) and phase_of.get(jaxpr.outvars[i]) == FORWARD
        ),
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
