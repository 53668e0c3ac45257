"""The split: which pipeline stage runs each equation of a traced step, and what crosses between stages.

A step marked with :func:`replicator.stage_boundary` and differentiated with
``jax.grad`` holds, at its top level, one forward marker per boundary and one
transposed marker per boundary its gradient crosses back
(docs/design/pipeline-parallelism.md). :func:`split_stages` numbers the stages
by dataflow, not by the order of the calls: a value computed from the step's
inputs alone is *free* (any stage can compute it); a forward marker's results
live one stage after its operands, a transposed marker's one stage before; any
other equation runs where its operands live. Two operands living on different
stages are an error (a value crossing stages without passing a boundary),
except for ``add_any``, JAX's sum of the cotangents of a value read twice: a
free value read by two stages (a tied parameter) gets its gradient from both,
and that sum is a sum across stages, of which each stage holds its part until
the schedule adds them up. What it feeds (the rest of the tied parameter's
gradient, linear in those parts, then its update) runs on both stages, which
keep the parameter.

A parameter that the stages read through consecutive slices of its leading axis, one each (the stacked
layers :func:`~replicator.stages.scan_split.split_scan` cuts), is such a tied value too, but each stage needs
only its slice and computes only its slice's gradient (padded, then summed): the split records the inputs
and outputs of that form as partitions (:class:`Partition`), for a caller that keeps each stage's slice alone
(:meth:`StageSplit.partitioned`, :mod:`replicator.stages.train`).

Example: two stages, the head in the second:

>>> def loss(params, x):
...     h = jnp.tanh(x @ params["w0"])
...     h = rp.stage_boundary(h)
...     return jnp.mean((h @ params["w1"]) ** 2)
>>> params = {"w0": jnp.ones((3, 4)), "w1": jnp.ones((4, 2))}
>>> split = split_stages(jax.make_jaxpr(jax.value_and_grad(loss))(params, jnp.ones((5, 3))).jaxpr)
>>> split.num_stages, split.input_stages  # w0, w1, x
(2, (frozenset({0}), frozenset({1}), frozenset({0})))
>>> [(b.sender, b.receiver) for b in split.boundaries]  # the activation, then its gradient back
[(0, 1), (1, 0)]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var
from jax.extend.core import primitives as jax_primitives

from replicator._jax_compat import user_code_line, user_source_line
from replicator.core.jaxprs import CALL_PRIMITIVES, DefUse, iter_eqns, sub_jaxprs
from replicator.core.primitives import PLACEHOLDERS, all_reduce_p, stage_boundary_p
from replicator.errors import ReplicationError

__all__ = ["Boundary", "Partition", "StageSplit", "StageSplitError", "StageSum", "split_stages"]

Placement = frozenset[int] | None  # None: free, computed from the step's inputs alone
FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"
#: Calls that are always inlined before the split: a plain function call (a
#: ``jax.jit`` inside the step) may read several stages' values, e.g. a jitted
#: optimizer update over every parameter. Other calls (``jax.checkpoint``,
#: custom derivatives) are inlined only when they hold a boundary.
_PLAIN_CALLS = frozenset(p for p in (jax_primitives.jit_p, jax_primitives.closed_call_p, jax_primitives.call_p) if p)
#: What a cross-stage sum of cotangents is made of (``jax.grad`` accumulates with it).
_ADD_ANY = "add_any"


class StageSplitError(ReplicationError):
    """A step that cannot be cut into pipeline stages where its boundaries say."""


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One marker of the split step: values that one stage sends to the next (or, transposed, back).

    Attributes:
      eqn: the marker's index in :attr:`StageSplit.jaxpr`.
      sender: the stage that computes ``values``.
      receiver: the stage that reads the marker's results: ``sender + 1``, or ``sender - 1`` when transposed.
      transposed: a cotangent going back (the marker's transpose in the backward pass).
      values: the marker's operands, what crosses.
      source: the user's line of the ``rp.stage_boundary`` call.
    """

    eqn: int
    sender: int
    receiver: int
    transposed: bool
    values: tuple[Any, ...]
    source: str


@dataclasses.dataclass(frozen=True)
class StageSum:
    """An ``add_any`` of cotangents computed on several stages: a sum across them (a tied parameter's gradient).

    Attributes:
      eqn: its index in :attr:`StageSplit.jaxpr`.
      stages: the stages whose cotangents it sums; its result lives on all of them.
      source: the user's line of the value read by several stages.
    """

    eqn: int
    stages: frozenset[int]
    source: str


@dataclasses.dataclass(frozen=True)
class Partition:
    """A value cut along its leading axis into consecutive slices, one per stage (a stack of layers).

    An input is partitioned when its only readers are ``slice`` equations of its leading axis, each run by one
    stage, their ranges consecutive from 0 to its length, a stage at most one of them: each stage needs only
    its slice (the stacked parameters ``(L, ...)`` of :func:`~replicator.stages.scan_split.split_scan`). An
    output is partitioned when it is the ``add_any`` sum of ``pad`` equations (the transposes of such slices),
    each run by one stage and putting its operand at consecutive ranges of the leading axis, zeros elsewhere:
    each stage contributes only its slice (the operand of its pad), and the sum is the slices joined in order.

    Attributes:
      pieces: ``(stage, start, stop)`` per slice, in ``start`` order.
      eqns: per piece, the ``slice`` (an input) or ``pad`` (an output) equation it comes from.
      adds: the ``add_any`` equations that sum the pads (an output; ``()`` for an input).
    """

    pieces: tuple[tuple[int, int, int], ...]
    eqns: tuple[int, ...]
    adds: tuple[int, ...] = ()

    def piece(self, stage: int) -> tuple[int, int] | None:
        """``(start, stop)`` of ``stage``'s slice, ``None`` if it holds none."""
        return next(((a, b) for s, a, b in self.pieces if s == stage), None)

    def eqn_of(self, stage: int) -> int | None:
        """The equation of ``stage``'s piece."""
        return next((e for (s, _, _), e in zip(self.pieces, self.eqns, strict=True) if s == stage), None)


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """Where each equation of a step runs when the step is cut at its ``rp.stage_boundary`` markers.

    Attributes:
      jaxpr: the step, with the calls holding a boundary (and every plain ``jit`` call) inlined; the
        indices below are its equations'.
      num_stages: ``S``: one more than the largest number of forward boundaries on a path.
      eqn_stages: per equation, the stages that run it: one, several for a free equation read by
        several stages (each recomputes it) or for what a cross-stage sum feeds, none if nothing
        reads it. A marker runs on its sender and its receiver.
      phases: per equation, ``'forward'``, ``'backward'`` (under ``jax.grad``'s transpose) or
        ``'update'`` (after the backward: reads a gradient; runs once per step, not per micro-batch).
      boundaries: the markers, in equation order.
      stage_sums: the cross-stage sums of cotangents.
      input_stages: per input of ``jaxpr`` (``invars``), the stages that read it.
      output_stages: per output of ``jaxpr``, the stages that hold it.
      free: per equation, whether it is computed from the step's inputs alone.
      param_only: per equation, whether it is computed from the step's constants and parameters alone (the
        inputs before ``first_batch``): a free equation that reads no micro-batch input, and has no effect nor
        collective (a slice of stacked weights, a cast of a parameter). Its values are the same for every
        micro-batch: a backward that reads them computes them again instead of keeping them per micro-batch
        (:mod:`~replicator.stages.stash`). All false where the split was given no ``first_batch`` (nor
        ``num_state``).
      params_end: the inputs before it are the parameters (``first_batch``, else ``num_state``, else 0), the
        others the micro-batch.
      input_partitions: the inputs (by index) read only through one slice of the leading axis per stage
        (:class:`Partition`).
      output_partitions: the outputs (by position) that are the sum of one padded slice per stage. The split
        itself still treats both as a tied value (read, and its gradient summed, across stages: ``stage_sums``,
        :meth:`tied`); a caller that keeps each stage's slice alone pairs them (:meth:`partitioned`).
    """

    jaxpr: Jaxpr
    num_stages: int
    eqn_stages: tuple[frozenset[int], ...]
    phases: tuple[str, ...]
    boundaries: tuple[Boundary, ...]
    stage_sums: tuple[StageSum, ...]
    input_stages: tuple[frozenset[int], ...]
    output_stages: tuple[frozenset[int], ...]
    free: tuple[bool, ...]
    input_partitions: dict[int, Partition] = dataclasses.field(default_factory=dict)
    output_partitions: dict[int, Partition] = dataclasses.field(default_factory=dict)
    param_only: tuple[bool, ...] = ()
    params_end: int = 0

    def partitioned(self, num_params: int, first_output: int = 1) -> dict[int, Partition]:
        """The parameters (inputs ``0 .. num_params - 1``) that each stage may keep only its slice of: input
        ``i`` partitioned and output ``first_output + i`` (its gradient in a traced ``jax.value_and_grad``)
        partitioned in the same pieces. Keyed by ``i``, the input's partition."""
        pairs = {i: self.partition_pair(i, first_output + i) for i in range(num_params)}
        return {i: given for i, given in pairs.items() if given is not None}

    def partition_pair(self, given: int, grad: int) -> Partition | None:
        """Input ``given``'s partition, if output ``grad`` is partitioned in the same pieces (a parameter a
        stage may keep only its slice of, and its gradient), else None."""
        a, b = self.input_partitions.get(given), self.output_partitions.get(grad)
        return a if a is not None and b is not None and a.pieces == b.pieces else None

    def eqns_of(self, stage: int) -> tuple[int, ...]:
        """The equations ``stage`` runs, in program order."""
        return tuple(i for i, stages in enumerate(self.eqn_stages) if stage in stages)

    def state_stages(self, num_state: int) -> tuple[frozenset[int], ...]:
        """Per state leaf (the first ``num_state`` inputs and outputs), the stages that keep it.

        A leaf read or written by no stage (a state leaf the step ignores) is kept by every stage.
        """
        everyone = frozenset(range(self.num_stages))
        return tuple((self.input_stages[i] | self.output_stages[i]) or everyone for i in range(num_state))

    def tied(self, num_state: int) -> tuple[int, ...]:
        """The state leaves whose new value is computed from a cross-stage sum (:attr:`stage_sums`).

        A parameter the forward of two stages reads (tied input and output embeddings) gets its
        gradient from both; it, and the optimizer state its update writes, are kept on both stages.
        """
        sums = {self.jaxpr.eqns[s.eqn].outvars[0] for s in self.stage_sums}
        for eqn in self.jaxpr.eqns:
            if any(isinstance(v, Var) and v in sums for v in eqn.invars):
                sums.update(v for v in eqn.outvars if isinstance(v, Var))
        return tuple(i for i, v in enumerate(self.jaxpr.outvars[:num_state]) if isinstance(v, Var) and v in sums)

    def read_back(self, stage: int) -> tuple[Var, ...]:
        """The variables ``stage``'s forward equations define (or receive) and its backward equations read."""
        mine = self.eqns_of(stage)
        defined = {v for i in mine if self.phases[i] == FORWARD for v in self.jaxpr.eqns[i].outvars}
        seen: dict[Var, None] = {}
        for i in mine:
            if self.phases[i] == BACKWARD:
                seen.update((v, None) for v in self.jaxpr.eqns[i].invars if isinstance(v, Var) and v in defined)
        return tuple(seen)

    @functools.cached_property
    def producers(self) -> dict[Var, int]:
        """Each variable of :attr:`jaxpr` an equation defines, with that equation's index."""
        return {v: i for i, e in enumerate(self.jaxpr.eqns) for v in e.outvars if isinstance(v, Var)}

    def is_param_only(self, var: Var) -> bool:
        """Whether ``var`` is a value of an equation of the parameters alone (:attr:`param_only`)."""
        index = self.producers.get(var) if self.param_only else None
        return index is not None and self.param_only[index]


# ----------------------------------------------------------------------------
# Inlining the calls that hold a boundary
# ----------------------------------------------------------------------------


def _holds_boundary(eqn: JaxprEqn) -> bool:
    return any(e.primitive is stage_boundary_p for sub in sub_jaxprs(eqn.params) for e in iter_eqns(sub))


def _body(eqn: JaxprEqn) -> tuple[Jaxpr, list[Any]]:
    body = eqn.params[CALL_PRIMITIVES[eqn.primitive]]
    if isinstance(body, ClosedJaxpr):
        return body.jaxpr, [Literal(c, v.aval) for c, v in zip(body.consts, body.jaxpr.constvars, strict=True)]
    return body, []


def _inline(
    jaxpr: Jaxpr,
    env: dict[Var, Any],
    transposed: bool,
    out: list[tuple[JaxprEqn, bool]],
    *,
    rename: bool,
    stack: Any = None,
) -> None:
    """Append ``jaxpr``'s equations to ``out``, calls inlined (see :data:`_PLAIN_CALLS`), each with whether it
    is under ``jax.grad``'s transpose. ``env`` maps ``jaxpr``'s variables to the atoms that stand for them;
    an inlined body's results get fresh variables (a body may be inlined twice). ``stack``: the name stack of
    the call being inlined, put before each of its equations' own (which are relative to the call), so that
    the flat graph keeps the ``transpose`` of a ``jax.jit``-ed function's backward (``log_softmax`` in a
    cross-entropy) for any later split of it."""

    def read(atom: Any) -> Any:
        return env.get(atom, atom) if isinstance(atom, Var) else atom

    for eqn in jaxpr.eqns:
        if stack is not None:
            eqn = eqn.replace(source_info=eqn.source_info.replace(name_stack=stack + eqn.source_info.name_stack))
        eqn_transposed = transposed or "transpose" in str(eqn.source_info.name_stack)
        inlinable = eqn.primitive in CALL_PRIMITIVES and (eqn.primitive in _PLAIN_CALLS or _holds_boundary(eqn))
        if inlinable:
            body, consts = _body(eqn)
            if len(body.invars) != len(eqn.invars):
                raise StageSplitError(
                    f"cannot inline the '{eqn.primitive.name}' at {user_source_line(eqn.source_info)} to split "
                    f"it into stages: its body takes {len(body.invars)} operands, the call passes "
                    f"{len(eqn.invars)}. Please report this JAX version's call form."
                )
            inner = {**dict(zip(body.constvars, consts, strict=True))}
            inner.update(zip(body.invars, (read(v) for v in eqn.invars), strict=True))
            _inline(body, inner, eqn_transposed, out, rename=True, stack=eqn.source_info.name_stack)
            for var, atom in zip(eqn.outvars, body.outvars, strict=True):
                if not isinstance(var, DropVar):
                    env[var] = inner.get(atom, atom) if isinstance(atom, Var) else atom
            continue
        if _holds_boundary(eqn):
            _raise_nested(eqn)
        outvars = list(eqn.outvars)
        if rename:
            for k, v in enumerate(outvars):
                if not isinstance(v, DropVar):
                    env[v] = outvars[k] = Var(v.aval)
        if eqn.primitive is all_reduce_p and len(eqn.invars) > 1:
            # rp.all_mean(grads): each operand is reduced on its own, so each may live on its own stage.
            for var, outvar in zip(eqn.invars, outvars, strict=True):
                out.append((eqn.replace(invars=[read(var)], outvars=[outvar]), eqn_transposed))
            continue
        out.append((eqn.replace(invars=[read(v) for v in eqn.invars], outvars=outvars), eqn_transposed))


def _raise_nested(eqn: JaxprEqn) -> None:
    marker = next(e for sub in sub_jaxprs(eqn.params) for e in iter_eqns(sub) if e.primitive is stage_boundary_p)
    loop = eqn.primitive.name in ("scan", "while")
    # Name what the user wrote: lax.fori_loop lowers to a scan or a while, lax.switch to a cond.
    what = {
        "scan": "the loop (lax.fori_loop / lax.scan / lax.map)",
        "while": "the loop (lax.fori_loop / lax.while_loop)",
        "cond": "a branch of the lax.cond / lax.switch",
    }.get(eqn.primitive.name, f"the '{eqn.primitive.name}'")
    hint = (
        "Stages are cut in the step's top level, once per step. For a stack of identical layers under "
        "lax.scan (Flax nn.scan), leave the stack unmarked: a pipelined Replicator cuts it into its stages "
        "(rp.split_scan); or mark the boundaries between layers outside the scan (one scan per stage)."
        if loop
        else "Stages are cut in the step's top level: a boundary that only some branches (or some replicas) "
        "reach cannot be scheduled. Move rp.stage_boundary out of the cond/switch, after it."
    )
    raise StageSplitError(
        f"rp.stage_boundary at {user_code_line(marker.source_info)} is inside {what} at "
        f"{user_code_line(eqn.source_info)}. {hint}"
    )


# ----------------------------------------------------------------------------
# The split
# ----------------------------------------------------------------------------


def _where(facts: DefUse, jaxpr: Jaxpr, var: Any) -> str:
    producer = facts.producer(var)
    if producer is None:
        return "an input of the step"
    return user_source_line(jaxpr.eqns[producer].source_info)


def split_stages(
    jaxpr: Jaxpr | ClosedJaxpr,
    *,
    num_state: int | None = None,
    first_batch: int | None = None,
    update_reads_all: bool = False,
) -> StageSplit:
    """Assign every equation of a traced step to the pipeline stages that run it.

    Args:
      jaxpr: the step (forward, backward and update), as traced: ``(*state, *batch) -> (*new_state, *outputs)``
        (a ``StepGraph``'s jaxpr) or any jaxpr.
      num_state: how many leading inputs and outputs are the state (input ``i`` becomes output ``i``):
        a state leaf that an output returns unchanged is then kept where it is read. ``None``: no state.
      first_batch: the index of the first input that is per-micro-batch data (default ``num_state``, else 0);
        the inputs before it are parameters, whose products two stages may both compute.
      update_reads_all: an update-phase equation (after the backward) that reads values of several stages
        runs on all of them (a global-norm clip's sum of every stage's gradients): true where every stage holds
        every gradient once the schedule is done (:mod:`replicator.stages.user_step`); else an error.

    Returns:
      The :class:`StageSplit`.

    Raises:
      StageSplitError: a boundary inside a loop body, a branch or another sub-program; a boundary whose
        operands come from different stages; a value read by a stage other than its own without passing a
        boundary. Each message names the user's source lines.
    """
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    inlined: list[tuple[JaxprEqn, bool]] = []
    env: dict[Var, Any] = {}
    _inline(jaxpr, env, False, inlined, rename=False)
    eqns = [eqn for eqn, _ in inlined]
    outvars = [env.get(v, v) if isinstance(v, Var) else v for v in jaxpr.outvars]
    # replace, not Jaxpr(...): on JAX 0.12 a Jaxpr built with constvars and no consts takes them as inputs.
    flat = jaxpr.replace(outvars=outvars, eqns=eqns)
    facts = DefUse(flat)

    # Forward: where each equation's operands live decides where it runs.
    place: dict[Var, Placement] = {}
    placements: list[Placement] = []
    boundaries: dict[int, Boundary] = {}
    sums: list[StageSum] = []
    late: set[Var] = set()  # what the backward computed, and what reads it (the update), as _phases has it
    for index, (eqn, transposed) in enumerate(inlined):
        lived = [place[v] for v in eqn.invars if isinstance(v, Var) and place.get(v) is not None]
        reads_late = any(isinstance(v, Var) and v in late for v in eqn.invars)
        update = reads_late and not transposed
        if transposed or reads_late:
            late.update(v for v in eqn.outvars if isinstance(v, Var))
        if eqn.primitive is stage_boundary_p:
            out, boundary = _boundary_placement(index, eqn, lived)
            if boundary is not None:
                boundaries[index] = boundary
        elif not lived:
            out = None
        elif eqn.primitive.name == _ADD_ANY and len(set(lived)) > 1:
            # Cotangents of a value read on several stages: each stage holds its part, the sum is theirs.
            out = frozenset.union(*lived)
            sums.append(StageSum(index, out, user_source_line(eqn.source_info)))
        else:
            out = frozenset.intersection(*lived)
            if not out and update_reads_all and update:
                out = frozenset.union(*lived)
            elif not out:
                _raise_crossing(flat, facts, eqn, place, transposed)
        placements.append(out)
        place.update((v, out) for v in eqn.outvars if isinstance(v, Var) and not isinstance(v, DropVar))
    num_stages = 1 + max((b.receiver for b in boundaries.values() if not b.transposed), default=0)
    everyone = frozenset(range(num_stages))

    # Backward: a free equation runs on the stages that read its results (each computes it again).
    def needs(outputs: Sequence[frozenset[int]]) -> tuple[list[frozenset[int]], dict[Var, frozenset[int]]]:
        need: dict[Var, frozenset[int]] = {}
        for atom, stages in zip(outvars, outputs, strict=True):
            if isinstance(atom, Var):
                need[atom] = need.get(atom, frozenset()) | stages
        eqn_stages = [frozenset()] * len(eqns)
        for index in range(len(eqns) - 1, -1, -1):
            eqn, boundary = eqns[index], boundaries.get(index)
            if boundary is not None:
                stages, reads = frozenset({boundary.sender, boundary.receiver}), frozenset({boundary.sender})
            elif placements[index] is not None:
                stages = reads = placements[index]
            else:
                stages = reads = frozenset().union(*(need.get(v, frozenset()) for v in eqn.outvars))
            eqn_stages[index] = stages
            for v in eqn.invars:
                if isinstance(v, Var):
                    need[v] = need.get(v, frozenset()) | reads
        return eqn_stages, need

    held = [place.get(v) if isinstance(v, Var) else None for v in outvars]
    _, need = needs([p or frozenset() for p in held])
    output_stages = []
    for position, p in enumerate(held):
        read_by = need.get(flat.invars[position], frozenset()) if num_state and position < num_state else frozenset()
        output_stages.append(p if p is not None else read_by or everyone)  # a free output: where it is needed
    eqn_stages, need = needs(output_stages)
    _check_recomputed(
        flat,
        facts,
        placements,
        eqn_stages,
        batch=set(flat.invars[first_batch if first_batch is not None else num_state or 0 :]),
    )

    phases = _phases(flat, [t for _, t in inlined])
    params_end = first_batch if first_batch is not None else num_state or 0
    param_only = _param_only(flat, placements, set(boundaries), params_end)
    return StageSplit(
        jaxpr=flat,
        num_stages=num_stages,
        eqn_stages=tuple(eqn_stages),
        phases=phases,
        boundaries=tuple(boundaries[i] for i in sorted(boundaries)),
        stage_sums=tuple(sums),
        input_stages=tuple(need.get(v, frozenset()) for v in flat.invars),
        output_stages=tuple(output_stages),
        free=tuple(p is None and i not in boundaries for i, p in enumerate(placements)),
        input_partitions=_input_partitions(flat, facts, eqn_stages, phases, params_end),
        output_partitions=_output_partitions(flat, facts, eqn_stages),
        param_only=param_only,
        params_end=params_end,
    )


def _param_only(jaxpr: Jaxpr, placements: Sequence[Placement], markers: set[int], params_end: int) -> tuple[bool, ...]:
    """Per equation, whether it computes from the constants and the inputs before ``params_end`` alone, with
    no effect and no collective (:attr:`StageSplit.param_only`)."""
    known: set[Var] = {*jaxpr.constvars, *jaxpr.invars[:params_end]}
    out = []
    for index, eqn in enumerate(jaxpr.eqns):
        ok = (
            params_end > 0
            and placements[index] is None
            and index not in markers
            and not eqn.effects
            and eqn.primitive not in PLACEHOLDERS
            and all(v in known for v in eqn.invars if isinstance(v, Var))
        )
        if ok:
            known.update(v for v in eqn.outvars if isinstance(v, Var))
        out.append(ok)
    return tuple(out)


def _consecutive(pieces: list[tuple[int, int, int]], length: int) -> bool:
    """Whether the ``(stage, start, stop)`` pieces, sorted, cover ``0 .. length`` in consecutive ranges, on
    distinct stages."""
    stages = [p[0] for p in pieces]
    bounds = [0, *(b for _, _, b in pieces)]
    starts = [a for _, a, _ in pieces]
    return (
        len(pieces) > 1
        and len(set(stages)) == len(stages)
        and starts == bounds[:-1]
        and bounds[-1] == length
        and all(a < b for _, a, b in pieces)
    )


def _one_stage(eqn_stages: Sequence[frozenset[int]], index: int) -> int | None:
    stages = eqn_stages[index]
    return min(stages) if len(stages) == 1 else None


def _input_partitions(
    jaxpr: Jaxpr, facts: DefUse, eqn_stages: Sequence[frozenset[int]], phases: Sequence[str], params_end: int
) -> dict[int, Partition]:
    """The parameter inputs read only through consecutive slices of their leading axis, one stage each."""
    found = {}
    for index, var in enumerate(jaxpr.invars[:params_end]):
        shape = tuple(var.aval.shape)
        readers = facts.readers(var)
        if not shape or len(readers) < 2 or facts.output_positions(var):
            continue
        pieces = []
        for r in readers:
            eqn = jaxpr.eqns[r]
            stage = _one_stage(eqn_stages, r)
            if eqn.primitive.name != "slice" or phases[r] != FORWARD or stage is None:
                break
            start, limit, strides = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params["strides"]
            whole_rest = all(a == 0 for a in start[1:]) and tuple(limit[1:]) == shape[1:]
            if not whole_rest or (strides is not None and any(k != 1 for k in strides)):
                break
            pieces.append((int(start[0]), stage, int(limit[0]), r))
        else:
            pieces.sort()
            if _consecutive([(s, a, b) for a, s, b, _ in pieces], shape[0]):
                found[index] = Partition(tuple((s, a, b) for a, s, b, _ in pieces), tuple(r for *_, r in pieces))
    return found


def _output_partitions(jaxpr: Jaxpr, facts: DefUse, eqn_stages: Sequence[frozenset[int]]) -> dict[int, Partition]:
    """The outputs that are an ``add_any`` tree of padded slices of their leading axis, one stage each."""
    found = {}
    for position, root in enumerate(jaxpr.outvars):
        if not isinstance(root, Var) or len(facts.output_positions(root)) != 1 or facts.readers(root):
            continue
        shape = tuple(root.aval.shape)
        pads: list[tuple[int, int, int, int]] = []
        adds: list[int] = []
        todo, ok = [root], bool(shape)
        while todo and ok:
            var = todo.pop()
            index = facts.producer(var)
            inner = var is not root and (len(facts.readers(var)) != 1 or facts.output_positions(var))
            if not isinstance(var, Var) or index is None or inner:
                ok = False
                break
            eqn = jaxpr.eqns[index]
            if eqn.primitive.name == _ADD_ANY:
                adds.append(index)
                todo.extend(eqn.invars)
            elif eqn.primitive.name == "pad":
                config, fill = eqn.params["padding_config"], eqn.invars[1]
                stage = _one_stage(eqn_stages, index)
                zero_fill = isinstance(fill, Literal) and not fill.val
                rest = all(tuple(c) == (0, 0, 0) for c in config[1:])
                lo, hi, interior = config[0]
                ok = stage is not None and zero_fill and rest and interior == 0 and lo >= 0 and hi >= 0
                pads.append((int(lo), stage, shape[0] - int(hi), index))
            else:
                ok = False
        if ok and pads:
            pads.sort()
            pieces = [(s, a, b) for a, s, b, _ in pads]
            if _consecutive(pieces, shape[0]):
                found[position] = Partition(tuple(pieces), tuple(i for *_, i in pads), tuple(sorted(adds)))
    return found


def _boundary_placement(index: int, eqn: JaxprEqn, lived: list[frozenset[int]]) -> tuple[Placement, Boundary | None]:
    source = user_source_line(eqn.source_info)
    transposed = eqn.params["transposed"]
    distinct = sorted({tuple(sorted(p)) for p in lived})
    if len(distinct) > 1 or any(len(p) > 1 for p in lived):
        stages = ", ".join(str(list(p)) for p in distinct)
        raise StageSplitError(
            f"the rp.stage_boundary at {source} receives values computed on different stages ({stages}): every "
            "value must pass each boundary on its way, one stage at a time. Pass the earlier value through the "
            "boundaries it skips, e.g. `h, skip = rp.stage_boundary((h, skip))` at each of them."
        )
    if not transposed:
        sender = min(lived[0]) if lived else 0  # a boundary on inputs alone ends an empty stage 0
        return frozenset({sender + 1}), Boundary(index, sender, sender + 1, False, tuple(eqn.invars), source)
    if not lived:  # a cotangent computed from inputs alone (a constant): nothing to send
        return None, None
    sender = min(lived[0])
    if sender == 0:
        raise StageSplitError(
            f"the gradient through the rp.stage_boundary at {source} comes from stage 0: the step's backward "
            "does not mirror its forward (was the marker's transpose bound by hand?)."
        )
    return frozenset({sender - 1}), Boundary(index, sender, sender - 1, True, tuple(eqn.invars), source)


def _raise_crossing(jaxpr: Jaxpr, facts: DefUse, eqn: JaxprEqn, place: dict[Var, Placement], transposed: bool) -> None:
    parts = []
    for v in eqn.invars:
        p = place.get(v) if isinstance(v, Var) else None
        if p is not None:
            parts.append(
                f"a value of stage {sorted(p) if len(p) > 1 else min(p)} computed at {_where(facts, jaxpr, v)}"
            )
    seen = list(dict.fromkeys(parts))
    what = "the gradient of a line that" if transposed else "a line that"
    raise StageSplitError(
        f"{what} reads values of different pipeline stages without a boundary between them: "
        f"'{eqn.primitive.name}' at {user_source_line(eqn.source_info)} reads " + " and ".join(seen) + ". "
        "A value crosses stages only through rp.stage_boundary: pass it through every boundary between "
        "where it is computed and where it is read (e.g. `h, skip = rp.stage_boundary((h, skip))`), or compute "
        "it again in the later stage. A reduction over every stage's gradients (a global-norm clip) is not "
        "supported by pipeline stages yet."
    )


#: Where a free value that two stages read (and so both compute) costs real work: recomputing it is not
#: what the user meant, it is an activation that skips a boundary.
_CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})


def _check_recomputed(
    jaxpr: Jaxpr, facts: DefUse, placements: list[Placement], eqn_stages: list[frozenset[int]], batch: set[Var]
) -> None:
    """Raise on a free value computed from the batch with a matrix product or convolution on its way that two
    stages read: a skip connection that does not pass the boundaries between them. Cheap free values (a cast
    or transpose of a parameter, a mask or one-hot of the batch) are computed again on every stage that reads
    them."""
    batch = set(batch)  # grows: the free values computed from the batch
    heavy: set[Var] = set()  # ... through a contraction
    for index, eqn in enumerate(jaxpr.eqns):
        if placements[index] is not None or eqn.primitive is stage_boundary_p:
            continue
        ins = [v for v in eqn.invars if isinstance(v, Var)]
        outs = [v for v in eqn.outvars if isinstance(v, Var)]
        if any(v in batch for v in ins):
            batch.update(outs)
            if eqn.primitive.name in _CONTRACTIONS or any(v in heavy for v in ins):
                heavy.update(outs)
        if len(eqn_stages[index]) < 2:
            continue
        for v in eqn.outvars:
            if v not in heavy:
                continue
            by_stage: dict[int, int] = {}
            for r in facts.readers(v):
                reader = jaxpr.eqns[r]
                if reader.primitive is stage_boundary_p and eqn_stages[r]:  # read on its sender's side
                    stages = {(max if reader.params["transposed"] else min)(eqn_stages[r])}
                else:
                    stages = eqn_stages[r] if placements[r] is not None else set()
                for stage in stages:
                    by_stage.setdefault(stage, r)
            if len(by_stage) > 1:
                (first, _), (stage, reader) = sorted(by_stage.items())[:2]
                raise StageSplitError(
                    f"the value computed at {user_source_line(eqn.source_info)} (stage {first}) is read on stage "
                    f"{stage} by '{jaxpr.eqns[reader].primitive.name}' at "
                    f"{user_source_line(jaxpr.eqns[reader].source_info)} without passing the boundaries between "
                    "them. A value crosses stages only through rp.stage_boundary: pass it through every boundary "
                    "on its way (e.g. `h, skip = rp.stage_boundary((h, skip))`)."
                )


def _phases(jaxpr: Jaxpr, under: list[bool]) -> tuple[str, ...]:
    """Forward, backward (under a transpose), or update (after the backward: reads what it computed)."""
    late: set[Var] = set()
    phases = []
    for index, eqn in enumerate(jaxpr.eqns):
        if under[index]:
            phase = BACKWARD
        elif any(isinstance(v, Var) and v in late for v in eqn.invars):
            phase = UPDATE
        else:
            phase = FORWARD
        if phase != FORWARD:
            late.update(v for v in eqn.outvars if isinstance(v, Var))
        phases.append(phase)
    return tuple(phases)
