"""``plan="auto"``: a tensor-parallel plan chosen by the placement analysis and the cost model.

Which matrices to split, and how, is a search over plans, each judged the way ``explain`` would judge
it, from the traced step alone (nothing is compiled or run):

* **Candidates**: every floating 2-d state leaf (or a stack of them, 3-d) that the step reads as an
  operand of a matrix product or as a lookup table (``gather``): the parameters' matrices. An optimizer's
  moments are never read that way; they follow their parameter by themselves, as they do in a
  hand-written plan. Leaves that differ only by a layer index (``block_0/fc1/kernel``,
  ``block_1/fc1/kernel``) of the same shape are one group and get one choice (``group_layers``).
* **Choices** per group: replicated, ``"column"`` (the last dimension) or ``"row"`` (the second-to-last:
  for a lookup table, its vocabulary rows). A group not chosen yet is left to the rewrite, which splits
  it where the step's update of it comes out split: choosing ``fc1`` column brings ``fc2`` row with it,
  so Megatron's column-then-row pair is one move of the search.
* **Each plan** is split for one device (:func:`~replicator.tensor.split_graph.split_jaxpr`, a trace, no
  compile): a plan whose step would gather a weight is *refused*; otherwise it is scored by the bytes a
  device sends over the tensor axis per step (ring algorithm, as ``explain`` counts them), the state it
  holds per device (split leaves ``1/T``, the others whole, optimizer moments included), and the time the
  cost model predicts: each collective by the alpha-beta model of the tensor link, plus the device's
  own work on its local shapes (:mod:`replicator.cost.compute`: a split matmul is ``1/T`` of the flops).
* **Objective**: with ``memory_budget`` (bytes of state per device), the fewest bytes sent among the
  plans whose state fits, ties to less memory (a plan over the budget is ranked by how far over it is);
  without one, the least predicted step time, ties to less memory.
* **Search**: coordinate descent over the groups in program order (their first use by a matmul or a
  lookup), starting from everything replicated: each group's three choices with the others held, the
  best kept; ``passes`` rounds or until nothing improves.
* **Sequence parallelism** (``sequence_dim``: the activations' sequence dimension; ``None``: not
  tried): the chosen plan is evaluated again with it on, and it is kept if it sends no more bytes and
  the values the device's program makes are smaller (a proxy for activation memory: their bytes, no
  liveness).

>>> import jax, jax.numpy as jnp
>>> def step(w, x):
...     loss = lambda w: jnp.mean(jax.nn.gelu(x @ w["fc1"]) @ w["fc2"])
...     g = jax.grad(loss)(w)
...     return jax.tree.map(lambda p, g: p - 0.1 * g, w, g), loss(w)
>>> w = {"fc1": jnp.ones((8, 32)), "fc2": jnp.ones((32, 8))}
>>> chosen = choose_plan(step, w, jnp.ones((4, 8)), size=2, memory_budget=1024)
>>> chosen.rules
{'fc1': 'column', 'fc2': 'row'}

``Parallelism(tensor=T, tensor_plan="auto", memory_budget=...)`` and ``TensorParallel(step, "auto",
size=T)`` choose it when the step is first traced (from the Replicator's per-replica graph) and then run
it as a hand-written plan; :class:`Auto` gives the other options (``tensor_plan=Auto(sequence_dim=1)``).
:func:`suggest_layout` estimates, for a device count, which pipeline stages ``S``, tensor degree ``T``
and ZeRO stage fit a budget and send the fewest bytes.

Promises:

1. The chosen plan is a plain :class:`~replicator.tensor.TensorPlan` (``AutoPlan.rules``) that behaves
   exactly as the same plan written by hand (``tests/tensor/test_auto.py``).
2. Every plan it reports was split for one device and counted, never estimated; a refused plan is never
   chosen.
3. With a budget no plan reached, :class:`~replicator.tensor.TensorPlacementError` names the smallest
   state per device the search found.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from replicator.core.jaxprs import CALL_PARAMS, iter_eqns, open_jaxpr
from replicator.cost.collectives import ring_matmul_time, tensor_collective_time, tensor_sent_bytes
from replicator.cost.compute import compute_time
from replicator.cost.topology import Topology, get_topology
from replicator.pass_manager.manager import check_options
from replicator.tensor.interpret import BATCH
from replicator.tensor.placement import REPLICATED, Collective, Placement, Shard, TensorPlacementError
from replicator.tensor.plan import TensorPlan, leaf_paths
from replicator.tensor.split_graph import split_jaxpr
from replicator.tensor.state_placements import infer_state_placements

__all__ = ["Auto", "AutoPlan", "Evaluation", "Layout", "choose_plan", "suggest_layout"]

#: The choices tried for each group of candidate leaves.
CHOICES = ("replicated", "column", "row")

#: Equations that pass a leaf on unchanged but for its shape or type (a matmul reading the result reads the leaf).
_SHAPE_OPS = frozenset(
    [
        "reshape",
        "transpose",
        "convert_element_type",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "copy",
        "copy_p",
        "slice",
        "dynamic_slice",
        "rev",
        "reduce_precision",
        "pvary",
    ]
)

#: The backend's preset when no topology is given.
_BACKEND_PRESET = {"cpu": "cpu-emulated", "gpu": "gpu-nvlink-8", "cuda": "gpu-nvlink-8", "tpu": "tpu-v3-pod"}


def _default_topology(topology: Topology | str | None) -> Topology:
    if topology is not None:
        return get_topology(topology)
    return get_topology(_BACKEND_PRESET.get(jax.default_backend(), "gpu-nvlink-8"))


def human(n: float) -> str:
    """``n`` bytes with a binary unit (``1.5 KiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# -- which leaves are candidates --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Uses:
    """What the step does with its state leaves' matrices (indices into the state leaves)."""

    order: tuple[int, ...]  # leaves read by a matmul or a lookup, in order of first use
    tables: frozenset[int]  # leaves looked up by a gather
    activation_shape: tuple[tuple[int, ...], str] | None  # the commonest non-state matmul operand (shape, dtype)


def _matrix_uses(jaxpr: Jaxpr, num_state: int) -> _Uses:
    order: dict[int, None] = {}
    tables: set[int] = set()
    operands: collections.Counter = collections.Counter()

    def walk(j: Jaxpr, marks: Sequence[frozenset[int]]) -> list[frozenset[int]]:
        env: dict[Any, frozenset[int]] = dict(zip(j.invars, marks, strict=True))

        def get(a: Any) -> frozenset[int]:
            return frozenset() if isinstance(a, Literal) else env.get(a, frozenset())

        for eqn in j.eqns:
            ins = [get(a) for a in eqn.invars]
            name = eqn.primitive.name
            outs = [frozenset()] * len(eqn.outvars)
            if name in ("dot_general", "conv_general_dilated"):
                order.update(dict.fromkeys(sorted(ins[0] | ins[1])))
                for a, m in zip(eqn.invars[:2], ins[:2], strict=True):
                    if not m and not isinstance(a, Literal) and len(a.aval.shape) >= 2:
                        operands[(tuple(a.aval.shape), str(a.aval.dtype))] += 1
            elif name == "gather":
                order.update(dict.fromkeys(sorted(ins[0])))
                tables.update(ins[0])
            elif name in _SHAPE_OPS and ins:
                outs = [ins[0]] * len(eqn.outvars)
            elif name in CALL_PARAMS:
                inner = open_jaxpr(eqn.params[CALL_PARAMS[name]])
                got = walk(inner, ins[len(ins) - len(inner.invars) :])
                outs = got if len(got) == len(eqn.outvars) else outs
            elif name == "scan":
                walk(open_jaxpr(eqn.params["jaxpr"]), ins)
            elif name == "while":
                nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
                walk(open_jaxpr(eqn.params["cond_jaxpr"]), ins[:nc] + ins[nc + nb :])
                walk(open_jaxpr(eqn.params["body_jaxpr"]), ins[nc:])
            elif name == "cond":
                for branch in eqn.params["branches"]:
                    walk(open_jaxpr(branch), ins[1:])
            env.update(zip(eqn.outvars, outs, strict=True))
        return [get(a) for a in j.outvars]

    marks = [frozenset([i]) if i < num_state else frozenset() for i in range(len(jaxpr.invars))]
    walk(jaxpr, marks)
    common = operands.most_common(1)[0][0] if operands else None
    return _Uses(tuple(order), frozenset(tables), common)


@dataclasses.dataclass(frozen=True)
class _Group:
    """Candidate leaves that get one choice: the same path but for layer indices, the same shape."""

    pattern: str
    members: tuple[int, ...]
    shape: tuple[int, ...]
    table: bool

    def placement(self, choice: str | None, size: int) -> Placement | None:
        if choice is None or choice == "replicated":
            return None if choice is None else REPLICATED
        dim = len(self.shape) - (1 if choice == "column" else 2)
        return Shard(dim) if self.shape[dim] % size == 0 else None

    def valid(self, choice: str, size: int) -> bool:
        return choice == "replicated" or self.placement(choice, size) is not None


def _generalize(component: str) -> str:
    m = re.fullmatch(r"(.*?)(\d+)", component)
    return f"{m.group(1)}*" if m else component


def _pattern(paths: Sequence[str]) -> str:
    """One glob over ``paths`` (which differ only by layer indices): the components that differ become ``*``."""
    parts = [p.split("/") for p in paths]
    return "/".join(c[0] if len(set(c)) == 1 else _generalize(c[0]) for c in zip(*parts, strict=True))


def _groups(
    uses: _Uses, paths: Sequence[str], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[Any], group_layers: bool
) -> list[_Group]:
    found: dict[Any, list[int]] = {}
    for i in uses.order:
        if len(shapes[i]) not in (2, 3) or not jax.numpy.issubdtype(dtypes[i], jax.numpy.floating):
            continue
        key = (
            "/".join(_generalize(c) for c in paths[i].split("/")) if group_layers else paths[i],
            shapes[i],
            i in uses.tables,
        )
        found.setdefault(key, []).append(i)
    out = []
    for (_, shape, table), members in found.items():
        pattern = _pattern([paths[i] for i in members])
        if len(members) > 1 and sum(_matches(pattern, p) for p in paths) != len(members):
            out.extend(_Group(paths[i], (i,), shape, table) for i in members)  # the glob would match others
        else:
            out.append(_Group(pattern, tuple(members), shape, table))
    return out


def _matches(pattern: str, path: str) -> bool:
    return TensorPlan({pattern: "replicated"}).style_of(path) is not None


# -- judging one plan --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One plan split for one device and counted.

    Attributes:
      choices: each group's choice (``None``: left to the rewrite), by the group's pattern.
      placements: every state leaf's placement the plan gives (the rewrite's fixed point).
      sequence_parallel: the sequence dimension split between regions, or ``None``.
      refused: why the plan cannot run without a gather (its first line), or ``None``.
      sent_bytes: bytes a device sends over the tensor axis per step (ring algorithm).
      collectives: the collectives over the tensor axis the rewrite inserts.
      state_bytes: bytes of state a device holds (split leaves ``1/T``).
      time_s: predicted seconds: the collectives (alpha-beta) plus the device's own work.
      produced_bytes: bytes of the values the device's program makes (a proxy for activations).
      collective_matmul: whether the plan's gathers and scatters around matmuls are rings
        (:mod:`replicator.tensor.overlap`), each costed by :func:`~replicator.cost.collectives.ring_matmul_time`.
    """

    choices: tuple[tuple[str, str | None], ...]
    placements: tuple[Placement, ...]
    sequence_parallel: int | None = None
    refused: str | None = None
    sent_bytes: float = 0.0
    collectives: tuple[Collective, ...] = ()
    state_bytes: int = 0
    time_s: float = 0.0
    produced_bytes: int = 0
    collective_matmul: bool = False

    def key(self, memory_budget: int | None) -> tuple:
        """What the search minimizes (see the module docstring)."""
        if memory_budget is not None:
            return (max(0, self.state_bytes - memory_budget), round(self.sent_bytes), self.state_bytes)
        return (round(self.time_s, 12), self.state_bytes)

    def describe(self) -> str:
        named = [f"{p} {c}" for p, c in self.choices if c is not None]
        return ", ".join(named) or "all replicated"


class _Evaluator:
    """Splits plans of one traced step for one device and counts them (each distinct plan once)."""

    def __init__(
        self,
        closed: ClosedJaxpr,
        names: Sequence[str],
        *,
        num_state: int,
        size: int,
        topology: Topology,
        allow_gather: bool,
    ):
        self.closed, self.names, self.num_state, self.size = closed, list(names), num_state, size
        self.topology, self.allow_gather = topology, allow_gather
        avals = [v.aval for v in closed.jaxpr.invars[:num_state]]
        self.shapes = [tuple(a.shape) for a in avals]
        self.nbytes = [int(np.prod(a.shape, dtype=np.int64)) * a.dtype.itemsize for a in avals]
        self.n_batch = len(closed.jaxpr.invars) - num_state
        self.cache: dict[tuple, Evaluation] = {}
        self.splits = 0  # plans split (traced), for the report

    def state_bytes(self, placements: Sequence[Placement]) -> int:
        return sum(n // self.size if isinstance(p, Shard) else n for n, p in zip(self.nbytes, placements, strict=True))

    def __call__(
        self, named: Sequence[Placement | None], sequence_parallel: int | None, collective_matmul: bool = False
    ) -> Evaluation:
        try:
            placements = infer_state_placements(
                self.closed.jaxpr, named, self.shapes, self.n_batch, self.size, sequence_parallel
            )
        except TensorPlacementError as e:
            return Evaluation((), tuple(p or REPLICATED for p in named), sequence_parallel, str(e).splitlines()[0])
        key = (tuple(placements), sequence_parallel, collective_matmul)
        if key in self.cache:
            return self.cache[key]
        self.splits += 1
        try:
            split = split_jaxpr(
                self.closed,
                placements,
                self.names,
                num_state=self.num_state,
                size=self.size,
                allow_gather=self.allow_gather,
                sequence_parallel=sequence_parallel,
                collective_matmul=collective_matmul,
            )
        except TensorPlacementError as e:
            ev = Evaluation((), tuple(placements), sequence_parallel, str(e).splitlines()[0])
        else:
            comm = math.fsum(
                ring_matmul_time(c.nbytes, self.size, c.flops, self.topology)
                if c.kind.startswith("ring")
                else tensor_collective_time(c.kind, c.nbytes, self.size, self.topology)
                for c in split.collectives
            )
            work = compute_time(split.jaxpr.jaxpr, self.topology.compute) if self.topology.compute else 0.0
            produced = sum(
                int(np.prod(v.aval.shape, dtype=np.int64)) * v.aval.dtype.itemsize
                for eqn in iter_eqns(split.jaxpr.jaxpr)
                for v in eqn.outvars
                if hasattr(v.aval, "dtype")
            )
            ev = Evaluation(
                (),
                tuple(placements),
                sequence_parallel,
                None,
                math.fsum(tensor_sent_bytes(c.kind, c.nbytes, self.size) for c in split.collectives),
                tuple(split.collectives),
                self.state_bytes(placements),
                comm + work,
                produced,
                collective_matmul,
            )
        self.cache[key] = ev
        return ev


# -- the search --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """The plan ``plan="auto"`` chose, with why (``str()``: the report).

    Attributes:
      rules: the plan, as a hand-written one: path globs -> ``"column"`` / ``"row"`` / ``"replicated"``.
      sequence_parallel: the sequence dimension to split activations on, or ``None``.
      size: the tensor degree ``T``.
      memory_budget: bytes of state per device the plan had to fit, or ``None``.
      chosen: the chosen plan's evaluation.
      replicated: the evaluation of everything replicated (the baseline).
      considered: every distinct plan the search split, best first (refused ones last).
      reasons: one line per split group: what it saves and what replicating it instead would do.
      objective: what was minimized, in words.
      paths: the state leaves' paths.
      notes: what sequence parallelism's trial found.
      collective_matmul: whether the plan's gathers and scatters around matmuls run as rings (chosen by the
        predicted time where not asked for), and ``overlap_notes`` why.
    """

    rules: dict[str, str | int]
    sequence_parallel: int | None
    size: int
    memory_budget: int | None
    chosen: Evaluation
    replicated: Evaluation
    considered: tuple[Evaluation, ...]
    reasons: tuple[str, ...]
    objective: str
    paths: tuple[str, ...]
    notes: tuple[str, ...] = ()
    collective_matmul: bool = False
    overlap_notes: tuple[str, ...] = ()

    @property
    def plan(self) -> TensorPlan:
        return TensorPlan(self.rules)

    def placements(self, state: Any, size: int) -> list[Placement | None]:
        """Each state leaf's placement, as :meth:`TensorPlan.placements`."""
        return self.plan.placements(state, size)

    def __str__(self) -> str:
        return self.report()

    def report(self, shown: int | None = 12) -> str:
        """The plan, why, and the ``shown`` best plans considered (``None``: all)."""
        shown = len(self.considered) if shown is None else shown
        c, r = self.chosen, self.replicated
        lines = [f"plan='auto' at T = {self.size}: {self.objective}", "chosen plan:"]
        lines += [f"  {pattern!r}: {style!r}" for pattern, style in self.rules.items()] or ["  (nothing split)"]
        lines.append(
            f"sequence parallelism: {'dimension ' + str(self.sequence_parallel) if self.sequence_parallel is not None else 'off'}"
        )
        lines += [f"  {n}" for n in self.notes]
        lines.append(f"collective matmul: {'on' if self.collective_matmul else 'off'}")
        lines += [f"  {n}" for n in self.overlap_notes]
        lines.append(
            f"per device: state {human(c.state_bytes)} (all replicated: {human(r.state_bytes)}); sends "
            f"{human(c.sent_bytes)} per step in {len(c.collectives)} collectives over 'tensor'; predicted "
            f"{c.time_s * 1e6:.1f} us (all replicated: {r.time_s * 1e6:.1f} us)"
        )
        if self.reasons:
            lines.append("why each split:")
            lines += [f"  {reason}" for reason in self.reasons]
        refused = sum(ev.refused is not None for ev in self.considered)
        lines.append(f"plans considered ({len(self.considered)}, {refused} refused; best first):")
        for ev in self.considered[:shown]:
            mark = "*" if ev is c else " "
            if ev.refused:
                lines.append(f" {mark} refused: {ev.describe()}: {ev.refused}")
            else:
                lines.append(
                    f" {mark} sends {human(ev.sent_bytes):>10} ({len(ev.collectives):>3} collectives), state "
                    f"{human(ev.state_bytes):>10}, predicted {ev.time_s * 1e6:9.1f} us: {ev.describe()}"
                    + (f" (sequence parallel {ev.sequence_parallel})" if ev.sequence_parallel is not None else "")
                    + (" (collective matmul)" if ev.collective_matmul else "")
                )
        if len(self.considered) > shown:
            lines.append(f"   ... and {len(self.considered) - shown} more (AutoPlan.report(shown=None): all)")
        return "\n".join(lines)


def _style(p: Placement, ndim: int) -> str | int:
    assert isinstance(p, Shard)
    return "column" if p.dim == ndim - 1 else "row" if p.dim == ndim - 2 else p.dim


def _named_from_rules(rules: dict, paths: Sequence[str], shapes: Sequence[tuple[int, ...]], size: int) -> list:
    plan = TensorPlan(rules)
    out: list[Placement | None] = []
    for path, shape in zip(paths, shapes, strict=True):
        style = plan.style_of(path)
        if style is None:
            out.append(None)
        elif style == "replicated":
            out.append(REPLICATED)
        else:
            out.append(Shard(len(shape) - 1 if style == "column" else len(shape) - 2 if style == "row" else style))
    return out


def choose_for_jaxpr(
    closed: ClosedJaxpr,
    names: Sequence[str],
    *,
    num_state: int,
    size: int,
    memory_budget: int | None = None,
    topology: Topology | str | None = None,
    sequence_dim: int | None = None,
    sequence_parallel: int | None = None,
    allow_gather: bool = False,
    group_layers: bool = True,
    passes: int = 2,
    over_budget: bool = False,
    collective_matmul: bool | None = None,
) -> AutoPlan:
    """:func:`choose_plan` on a traced step ``closed(state..., batch...)``; ``names``: each input's name (the
    state leaves' paths, then :data:`~replicator.tensor.interpret.BATCH`). ``sequence_parallel``: a fixed
    sequence dimension (the user's), searched with; ``sequence_dim``: one to try on the chosen plan;
    ``over_budget``: return the plan nearest the budget instead of refusing when none fits.
    ``collective_matmul``: ``True`` rings asked for, ``False`` not allowed (inside pipeline stages), ``None``
    tried on the chosen plan and kept where the cost model predicts a shorter step."""
    topo = _default_topology(topology)
    paths = list(names[:num_state])
    avals = [v.aval for v in closed.jaxpr.invars[:num_state]]
    shapes = [tuple(a.shape) for a in avals]
    evaluate = _Evaluator(closed, names, num_state=num_state, size=size, topology=topo, allow_gather=allow_gather)
    uses = _matrix_uses(closed.jaxpr, num_state)
    groups = _groups(uses, paths, shapes, [a.dtype for a in avals], group_layers)

    def run(choices: dict[str, str | None]) -> Evaluation:
        named: list[Placement | None] = [None] * num_state
        for g in groups:
            for i in g.members:
                named[i] = g.placement(choices[g.pattern], size)
        ev = evaluate(named, sequence_parallel)
        return dataclasses.replace(ev, choices=tuple(choices.items()))

    current: dict[str, str | None] = {g.pattern: None for g in groups}
    best = baseline = run(current)
    if best.refused:
        raise TensorPlacementError(
            f"plan='auto': the step cannot run over the tensor axis even with nothing split: {best.refused}"
        )
    seen: dict[tuple, Evaluation] = {(best.placements, best.sequence_parallel, best.refused): best}

    def moves(group: _Group) -> list[tuple[str, Evaluation]]:
        """Each other choice for ``group``, the others held, evaluated (refused ones left out)."""
        out = []
        for choice in CHOICES:
            if choice != current[group.pattern] and group.valid(choice, size):
                ev = run({**current, group.pattern: choice})
                seen.setdefault((ev.placements, ev.sequence_parallel, ev.refused), ev)
                if ev.refused is None:
                    out.append((choice, ev))
        return out

    # Over the budget: the move that saves memory at the fewest more bytes sent per byte saved, until it fits.
    while memory_budget is not None and best.state_bytes > memory_budget:
        smaller = [(g, c, ev) for g in groups for c, ev in moves(g) if ev.state_bytes < best.state_bytes]
        if not smaller:
            break
        g, choice, best = min(
            smaller, key=lambda o: (o[2].sent_bytes - best.sent_bytes) / (best.state_bytes - o[2].state_bytes)
        )
        current[g.pattern] = choice
    # Then coordinate descent in program order: each group's best choice with the others held.
    for _ in range(passes):
        moved = False
        for g in groups:
            pick = None
            for choice, ev in moves(g):
                if ev.key(memory_budget) < best.key(memory_budget):
                    best, pick = ev, choice
            if pick is not None:
                current[g.pattern] = pick
                moved = True
        if not moved:
            break

    if memory_budget is not None and best.state_bytes > memory_budget and not over_budget:
        raise TensorPlacementError(
            f"plan='auto': no plan at T = {size} fits memory_budget={memory_budget} bytes of state per device: "
            f"the smallest the search reached is {best.state_bytes} bytes ({human(best.state_bytes)}; all "
            f"replicated: {human(baseline.state_bytes)}), with {best.describe()}.\nFix: a budget of at least "
            f"{best.state_bytes} bytes, a larger tensor degree, or ZeRO over the data replicas "
            f"(replicator.tensor.auto.suggest_layout says what would fit)."
        )

    rules = _rules(best, groups, paths, shapes)
    final = evaluate(_named_from_rules(rules, paths, shapes, size), sequence_parallel)
    if final.placements != best.placements:  # a leaf left to the rewrite would split: name the replicated ones
        for g in groups:
            if not isinstance(best.placements[g.members[0]], Shard):
                rules[g.pattern] = "replicated"
        final = evaluate(_named_from_rules(rules, paths, shapes, size), sequence_parallel)
    assert final.placements == best.placements, "plan='auto': the written plan differs from the one chosen"
    chosen = dataclasses.replace(final, choices=best.choices)

    notes = []
    chosen_sp = sequence_parallel
    if sequence_dim is not None and sequence_parallel is None:
        with_sp = evaluate(_named_from_rules(rules, paths, shapes, size), sequence_dim)
        with_sp = dataclasses.replace(with_sp, choices=best.choices)
        seen.setdefault((with_sp.placements, with_sp.sequence_parallel, with_sp.refused), with_sp)
        if with_sp.refused:
            notes.append(f"tried on dimension {sequence_dim}: refused ({with_sp.refused})")
        elif with_sp.sent_bytes <= chosen.sent_bytes * (1 + 1e-9) and with_sp.produced_bytes < chosen.produced_bytes:
            notes.append(
                f"tried on dimension {sequence_dim} and kept: sends {human(with_sp.sent_bytes)} (off: "
                f"{human(chosen.sent_bytes)}), the device's values {human(with_sp.produced_bytes)} (off: "
                f"{human(chosen.produced_bytes)})"
            )
            chosen, chosen_sp = with_sp, sequence_dim
        else:
            notes.append(
                f"tried on dimension {sequence_dim} and left off: sends {human(with_sp.sent_bytes)} (off: "
                f"{human(chosen.sent_bytes)}), the device's values {human(with_sp.produced_bytes)} (off: "
                f"{human(chosen.produced_bytes)})"
            )
    elif sequence_dim is None and sequence_parallel is None:
        notes.append("not tried (give sequence_dim, the activations' sequence dimension, to try it)")

    overlap_notes = []
    written = _named_from_rules(rules, paths, shapes, size)
    if collective_matmul:
        chosen = dataclasses.replace(evaluate(written, chosen_sp, True), choices=best.choices)
        overlap_notes.append("asked for (collective_matmul=True)")
    elif collective_matmul is None:
        ring = dataclasses.replace(evaluate(written, chosen_sp, True), choices=best.choices)
        rings = sum(c.kind.startswith("ring") for c in ring.collectives)
        if ring.refused or not rings:
            why = f"refused ({ring.refused})" if ring.refused else "no gather or scatter of a matmul to ring"
            overlap_notes.append(f"tried: {why}")
        else:
            verdict = "kept" if ring.time_s < chosen.time_s else "left off"
            overlap_notes.append(
                f"tried and {verdict}: {rings} rings, predicted {ring.time_s * 1e6:.1f} us (off: "
                f"{chosen.time_s * 1e6:.1f} us); {topo.name} "
                + ("overlaps sends with matmuls" if topo.overlap else "does not overlap sends with matmuls")
            )
            seen.setdefault((ring.placements, ring.sequence_parallel, ring.refused, True), ring)
            if ring.time_s < chosen.time_s:
                chosen = ring
    else:
        overlap_notes.append("not allowed here (inside pipeline stages)")

    reasons = []
    for g in groups:
        first = chosen.placements[g.members[0]]
        if not isinstance(first, Shard):
            continue
        own = sum(evaluate.nbytes[i] for i in g.members) * (size - 1) // size
        alone = {**dict(best.choices), g.pattern: "replicated"}
        other = run(alone)
        seen.setdefault((other.placements, other.sequence_parallel, other.refused), other)
        if other.refused:
            instead = f"replicated instead (the others as chosen) is refused: {other.refused}"
        else:
            instead = (
                f"replicated instead: state +{human(other.state_bytes - best.state_bytes)}, sends "
                f"{human(other.sent_bytes)} ({len(other.collectives)} collectives) against {human(best.sent_bytes)} "
                f"({len(best.collectives)})"
            )
        what = "vocabulary rows" if g.table and first.dim == len(g.shape) - 2 else _style(first, len(g.shape))
        how = "chosen" if dict(best.choices)[g.pattern] is not None else "split by the rewrite with the chosen ones"
        reasons.append(
            f"{g.pattern} ({len(g.members)} x {g.shape}) {what}, {how}: saves {human(own)} per device of its own "
            f"(its optimizer moments follow); {instead}"
        )

    if memory_budget is not None:
        objective = (
            f"the fewest bytes over 'tensor' with the state within {human(memory_budget)} per device "
            f"(ties: less memory); {evaluate.splits} plans split and counted"
        )
    else:
        objective = (
            f"the least predicted step time on {topo.name} (collectives over its cores link + the device's work; "
            f"ties: less memory); {evaluate.splits} plans split and counted"
        )
    ranked = sorted((e for e in seen.values() if e.refused is None), key=lambda e: e.key(memory_budget)) + [
        e for e in seen.values() if e.refused is not None
    ]
    if chosen not in ranked:
        ranked.insert(0, chosen)
    return AutoPlan(
        rules=rules,
        sequence_parallel=chosen_sp,
        size=size,
        memory_budget=memory_budget,
        chosen=chosen,
        replicated=baseline,
        considered=tuple(ranked),
        reasons=tuple(reasons),
        objective=objective,
        paths=tuple(paths),
        notes=tuple(notes),
        collective_matmul=chosen.collective_matmul,
        overlap_notes=tuple(overlap_notes),
    )


def _rules(best: Evaluation, groups: Sequence[_Group], paths: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> dict:
    """The plan of ``best``'s placements: one glob per group split alike, else each split leaf's path."""
    rules: dict[str, str | int] = {}
    for g in groups:
        styles = {
            _style(best.placements[i], len(shapes[i])) for i in g.members if isinstance(best.placements[i], Shard)
        }
        split = [i for i in g.members if isinstance(best.placements[i], Shard)]
        if len(styles) == 1 and len(split) == len(g.members):
            rules[g.pattern] = styles.pop()
        else:
            for i in split:
                rules[paths[i]] = _style(best.placements[i], len(shapes[i]))
    return rules


def choose_plan(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    batch: Any,
    size: int,
    memory_budget: int | None = None,
    *,
    topology: Topology | str | None = None,
    sequence_dim: int | None = None,
    allow_gather: bool = False,
    group_layers: bool = True,
    passes: int = 2,
) -> AutoPlan:
    """The tensor-parallel plan for ``step(state, batch) -> (new_state, aux)`` (one device's step) at degree
    ``size`` (see the module docstring for how it is chosen).

    Args:
      step, state, batch: the step and example inputs (arrays or ``jax.ShapeDtypeStruct``: only shapes are read).
      size: the tensor degree ``T``.
      memory_budget: bytes of state (parameters and optimizer state; not activations) one device may hold;
        ``None``: no budget, minimize the predicted step time instead.
      topology: the cost model's topology for the predicted time (a preset name or a ``Topology``);
        ``None``: the preset for the backend (``cpu-emulated``, ``gpu-nvlink-8``, ``tpu-v3-pod``).
      sequence_dim: the activations' sequence dimension, to try sequence parallelism with; ``None``: off.
      allow_gather: let plans gather split values (otherwise such plans are refused).
      group_layers: one choice for leaves that differ only by a layer index.
      passes: rounds of the coordinate descent.

    Returns:
      An :class:`AutoPlan`: ``.rules`` the plan, ``str()`` the report.
    """
    closed = jax.make_jaxpr(step)(state, batch)
    paths = leaf_paths(state)
    names = paths + [BATCH] * len(jax.tree_util.tree_leaves(batch))
    return choose_for_jaxpr(
        closed,
        names,
        num_state=len(paths),
        size=size,
        memory_budget=memory_budget,
        topology=topology,
        sequence_dim=sequence_dim,
        allow_gather=allow_gather,
        group_layers=group_layers,
        passes=passes,
    )


# -- plan="auto" inside TensorParallel and a Replicator -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Auto:
    """``plan="auto"`` with its options: the plan is chosen (:func:`choose_for_jaxpr`) when the step is first
    traced, once per state and batch shapes, and then used as a hand-written one.

    >>> Auto(memory_budget=1 << 20).memory_budget
    1048576

    Attributes:
      memory_budget: bytes of state per device (parameters and optimizer state, not activations); ``None``:
        no budget, the least predicted step time.
      sequence_dim: the activations' sequence dimension, to try sequence parallelism with; ``None``: off.
      topology: the cost model's topology (``None``: the backend's preset).
      group_layers, passes: as for :func:`choose_plan`.
    """

    memory_budget: int | None = None
    sequence_dim: int | None = None
    topology: Topology | str | None = None
    group_layers: bool = True
    passes: int = 2
    _chosen: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"memory_budget={budget!r}: give bytes of state per device (a positive int), or None.")

    def resolve(
        self,
        closed: ClosedJaxpr,
        names: Sequence[str],
        *,
        num_state: int,
        size: int,
        sequence_parallel: int | None = None,
        allow_gather: bool = False,
        collective_matmul: bool | None = None,
    ) -> AutoPlan:
        """The plan for this traced step (chosen once per shapes; the last one is :attr:`chosen`)."""
        avals = tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in closed.jaxpr.invars)
        key = (avals, tuple(names), size, sequence_parallel, allow_gather, collective_matmul)
        if key not in self._chosen:
            self._chosen[key] = choose_for_jaxpr(
                closed,
                names,
                num_state=num_state,
                size=size,
                memory_budget=self.memory_budget,
                topology=self.topology,
                sequence_dim=self.sequence_dim,
                sequence_parallel=sequence_parallel,
                allow_gather=allow_gather,
                group_layers=self.group_layers,
                passes=self.passes,
                collective_matmul=collective_matmul,
            )
        chosen = self._chosen.pop(key)
        self._chosen[key] = chosen  # the most recent last
        return chosen

    @property
    def chosen(self) -> AutoPlan | None:
        """The plan chosen for the step traced last, or ``None`` before any."""
        return next(reversed(self._chosen.values()), None)

    def placements(self, state: Any, size: int) -> list[Placement | None]:
        """The chosen plan's placements for ``state`` (once a step with this state was traced)."""
        paths = tuple(leaf_paths(state))
        for plan in reversed(self._chosen.values()):
            if plan.size == size and plan.paths == paths:
                return plan.placements(state, size)
        raise TensorPlacementError(
            "plan='auto' is chosen from the traced step, which needs the batch too: nothing was traced with this "
            "state yet.\nFix: run the step once (tp(state, batch)), or pass the batch: tp.shard(state, batch)."
        )


def as_plan(plan: Any, memory_budget: int | None = None) -> TensorPlan | Auto:
    """A plan value as given by the user: a :class:`TensorPlan`, its mapping, ``"auto"`` or an :class:`Auto`."""
    if isinstance(plan, str) and plan == "auto":
        return Auto(memory_budget=memory_budget)
    if isinstance(plan, Auto) and memory_budget is not None:
        raise ValueError("memory_budget= given twice: in Auto(memory_budget=...) and beside it; give it once.")
    if memory_budget is not None:
        raise ValueError(
            "memory_budget= is the budget of tensor_plan='auto' (bytes of state per device); a hand-written plan "
            "does not use one.\nFix: tensor_plan='auto', or leave memory_budget out."
        )
    if isinstance(plan, (TensorPlan, Auto)):
        return plan
    if isinstance(plan, str):
        raise ValueError(f"plan={plan!r}: give 'auto', a TensorPlan or a mapping of path globs to styles.")
    return TensorPlan(plan)


def resolve_plan(
    plan: TensorPlan | Auto,
    closed: ClosedJaxpr,
    names: Sequence[str],
    *,
    num_state: int,
    size: int,
    sequence_parallel: int | None,
    allow_gather: bool,
    collective_matmul: bool = False,
    rings_allowed: bool = True,
) -> tuple[TensorPlan | AutoPlan, int | None, bool]:
    """The plan to split ``closed`` with, its sequence parallelism and whether its gathers and scatters around
    matmuls run as rings: a hand-written plan as given, an :class:`Auto` one's choice for this step (the rings
    chosen by the cost model unless asked for, never where ``rings_allowed`` is false)."""
    if not isinstance(plan, Auto):
        return plan, sequence_parallel, collective_matmul
    chosen = plan.resolve(
        closed,
        names,
        num_state=num_state,
        size=size,
        sequence_parallel=sequence_parallel,
        allow_gather=allow_gather,
        collective_matmul=True if collective_matmul else None if rings_allowed else False,
    )
    return chosen, chosen.sequence_parallel, chosen.collective_matmul


# -- stages x tensor x ZeRO ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayoutOption:
    """One (S, T, ZeRO stage) layout of the devices, estimated.

    Attributes:
      stages, tensor, data, zero: ``S``, ``T``, the data-parallel replicas ``D`` and the ZeRO stage.
      state_bytes: estimated bytes of state per device.
      gradient_bytes: estimated bytes of one gradient per device (transient; not in ``fits``).
      data_bytes, tensor_bytes, stage_bytes: estimated bytes a device sends per step over each axis.
      fits: ``state_bytes`` within the budget.
      plan: the tensor plan assumed at ``T`` (its rules).
    """

    stages: int
    tensor: int
    data: int
    zero: int
    state_bytes: float
    gradient_bytes: float
    data_bytes: float
    tensor_bytes: float
    stage_bytes: float
    fits: bool
    plan: dict

    @property
    def sent_bytes(self) -> float:
        return self.data_bytes + self.tensor_bytes + self.stage_bytes

    def key(self) -> tuple:
        return (not self.fits, round(self.sent_bytes), self.stages, self.state_bytes)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What :func:`suggest_layout` would choose (``str()``: the table and the reasons)."""

    choice: LayoutOption | None
    options: tuple[LayoutOption, ...]
    devices: int
    memory_budget: int
    notes: tuple[str, ...]

    def __str__(self) -> str:
        lines = [f"layouts of {self.devices} devices for a state budget of {human(self.memory_budget)} per device:"]
        lines.append("   S   T   D  ZeRO  state/device  gradient   sent/device/step (data + tensor + stages)  fits")
        for o in self.options:
            mark = "*" if o is self.choice else " "
            lines.append(
                f" {mark}{o.stages:>2} {o.tensor:>3} {o.data:>3} {o.zero:>5} {human(o.state_bytes):>13} "
                f"{human(o.gradient_bytes):>9}   {human(o.sent_bytes):>10} = {human(o.data_bytes)} + "
                f"{human(o.tensor_bytes)} + {human(o.stage_bytes)}   {'yes' if o.fits else 'no'}"
            )
        if self.choice is None:
            smallest = min(self.options, key=lambda o: o.state_bytes)
            lines.append(
                f"none fits: the smallest is {human(smallest.state_bytes)} per device (S = {smallest.stages}, "
                f"T = {smallest.tensor}, ZeRO {smallest.zero})."
            )
        else:
            c = self.choice
            lines.append(
                f"choice: S = {c.stages}, T = {c.tensor}, ZeRO stage {c.zero} over D = {c.data} replicas: the fewest "
                f"bytes sent among the layouts that fit (ties: fewer stages, then less memory)"
                + (f"; tensor plan {c.plan}" if c.tensor > 1 else "")
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@check_options(renamed={"zero_stages": "zero"})
def suggest_layout(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    batch: Any,
    devices: int,
    memory_budget: int,
    *,
    zero: Sequence[int] = (0, 1, 2, 3),
    max_tensor: int | None = None,
    param_root: str | None = None,
) -> Layout:
    """Which pipeline stages ``S``, tensor degree ``T`` and ZeRO stage a budget of ``memory_budget`` bytes of state
    per device calls for on ``devices`` devices (``D = devices / (S T)`` data replicas), estimated from the
    one-device step.

    What it estimates, per device: the state: the parameters' and the optimizer state's bytes, split leaves
    ``1/T`` (at each ``T`` the plan ``plan='auto'`` reaches with the smallest budget: the most split), ``1/S``
    for stages (an even cut of the layers), the optimizer state ``1/D`` from ZeRO 1, the parameters ``1/D`` at
    ZeRO 3 (gradients, ``1/D`` from ZeRO 2, are listed apart); the bytes sent per step: the gradients'
    all-reduce over the data replicas (``2 (D-1)/D`` of them; ZeRO 3 adds the parameters' all-gathers, 1.5x),
    the plan's collectives over the tensor axis counted at ``T`` for the whole batch and scaled by ``1/(D S)``
    (each replica's share of the rows, each stage's of the layers), and per stage boundary the commonest
    matmul activation forward and its gradient backward, ``1/D``. What it ignores: activations' memory, the
    pipeline's bubble (``(S-1)/(M+S-1)`` of the time with ``M`` micro-batches: ties go to fewer stages), the
    difference in speed between the links (bytes on the tensor axis usually cross the fastest), uneven stages
    and leaves shared by stages.

    ``param_root``: the first path component of the parameters (default: that of the first matrix the step
    reads); the other leaves are optimizer state. ``zero``: the ZeRO levels to consider (``zero_stages=``,
    its old name, warns ``DeprecationWarning``).
    """
    closed = jax.make_jaxpr(step)(state, batch)
    paths = leaf_paths(state)
    n = len(paths)
    names = paths + [BATCH] * len(jax.tree_util.tree_leaves(batch))
    avals = [v.aval for v in closed.jaxpr.invars[:n]]
    nbytes = [int(np.prod(a.shape, dtype=np.int64)) * a.dtype.itemsize for a in avals]
    uses = _matrix_uses(closed.jaxpr, n)
    root = param_root if param_root is not None else (paths[uses.order[0]].split("/")[0] if uses.order else "")
    is_param = [p.split("/")[0] == root for p in paths]
    boundary = 0
    if uses.activation_shape is not None:
        shape, dtype = uses.activation_shape
        boundary = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize

    per_t: dict[int, tuple[float, float, float, dict]] = {}  # T -> (params, optimizer, tensor bytes, rules)
    notes = []
    for t in _divisors(devices):
        if max_tensor is not None and t > max_tensor:
            continue
        if t == 1:
            per_t[1] = (
                sum(b for b, p in zip(nbytes, is_param, strict=True) if p),
                sum(b for b, p in zip(nbytes, is_param, strict=True) if not p),
                0.0,
                {},
            )
            continue
        try:  # a budget of one byte: the plan that splits the most (the fewest bytes among those)
            chosen = choose_for_jaxpr(closed, names, num_state=n, size=t, memory_budget=1, over_budget=True)
        except TensorPlacementError as e:
            notes.append(f"T = {t}: {str(e).splitlines()[0]}")
            continue
        pl = chosen.chosen.placements
        held = [b // t if isinstance(p, Shard) else b for b, p in zip(nbytes, pl, strict=True)]
        per_t[t] = (
            sum(h for h, p in zip(held, is_param, strict=True) if p),
            sum(h for h, p in zip(held, is_param, strict=True) if not p),
            chosen.chosen.sent_bytes,
            dict(chosen.rules),
        )

    options = []
    for t, (params, optimizer, tensor_sent, rules) in per_t.items():
        for s in _divisors(devices // t):
            d = devices // (t * s)
            for z in zero:
                if z and d == 1:
                    continue
                p, o = params / s, optimizer / s
                state_b = p / (d if z >= 3 else 1) + o / (d if z >= 1 else 1)
                grad = p / (d if z >= 2 else 1)
                data_b = (3 if z >= 3 else 2) * (d - 1) / d * p
                options.append(
                    LayoutOption(
                        s,
                        t,
                        d,
                        z,
                        state_b,
                        grad,
                        data_b,
                        tensor_sent / (d * s),
                        2 * boundary / d if s > 1 else 0.0,
                        state_b <= memory_budget,
                        rules,
                    )
                )
    options.sort(key=LayoutOption.key)
    fits = [o for o in options if o.fits]
    notes.append(
        "estimates from the one-device step's shapes; activations' memory and the pipeline's bubble are not counted"
    )
    return Layout(fits[0] if fits else None, tuple(options), devices, memory_budget, tuple(notes))
