"""Pipeline schedules as data: tick tables, apart from their lowering.

A schedule for ``S`` stages and ``M`` micro-batches is a table: for each tick
``t`` and stage ``s``, what ``s`` runs during ``t``: the forward of a
micro-batch, its backward, or nothing. A tick is one micro-batch's forward (or
backward) on one stage; what a stage sends during tick ``t`` arrives for tick
``t + 1``. :mod:`replicator.stages.lower` runs any table as one loop of ticks;
:func:`schedule_stats` reads from it what ``explain`` prints (the bubble,
per-stage peak live activations).

* :func:`gpipe`: all forwards (stage ``s`` runs micro-batch ``m`` at tick
  ``m + s``), then all backwards, the last stage first. Bubble
  ``(S-1)/(M+S-1)``; stage ``s`` keeps the residuals of all ``M`` micro-batches.
* :func:`one_f_one_b` (PipeDream-Flush, Megatron-LM's 1F1B): stage ``s`` runs
  ``min(S-1-s, M)`` warm-up forwards, then alternates one forward and one
  backward, then drains the backwards. The same bubble, but at most
  ``min(S-s, M)`` micro-batches alive on stage ``s``.
* :func:`fused_one_f_one_b` ("1f1b-fused"): each tick, every stage runs its
  next forward *and* its next backward, as soon as their inputs are there. On
  devices that wait for each other every tick (one SPMD loop), 1F1B's tick
  pairs one stage's forward with its neighbour's backward and lasts as long as
  the backward; a fused tick lasts one forward plus one backward on every
  stage, so the step takes ``(M+S-1)`` ticks of one micro-batch's forward and
  backward: the schedule's ideal. The price: stage ``s`` keeps up to
  ``min(2(S-1-s)+1, M)`` micro-batches alive (``2S-1`` on the first stage),
  still independent of ``M``.

>>> table = one_f_one_b(2, 3)
>>> print(table)
tick    stage 0  stage 1
   0    F0       .
   1    F1       F0
   2    .        B0
   3    B0       F1
   4    F2       B1
   5    B1       F2
   6    .        B2
   7    B2       .
>>> stats = schedule_stats(table)
>>> stats.bubble, stats.peak_live
(0.25, (2, 1))
>>> print(fused_one_f_one_b(2, 3))
tick    stage 0  stage 1
   0    F0       .
   1    F1       F0+B0
   2    F2+B0    F1+B1
   3    B1       F2+B2
   4    B2       .
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "BACKWARD",
    "FORWARD",
    "IDLE",
    "SCHEDULES",
    "FORWARD_BACKWARD",
    "check_schedule",
    "fused_one_f_one_b",
    "Schedule",
    "ScheduleStats",
    "gpipe",
    "make_schedule",
    "one_f_one_b",
    "schedule_stats",
    "table_span",
]

#: What a stage does during a tick (the values of :attr:`Schedule.kind`), a bit mask: ``FORWARD_BACKWARD``
#: runs a forward, then a backward, in the same tick (a fused schedule).
IDLE, FORWARD, BACKWARD = 0, 1, 2
FORWARD_BACKWARD = FORWARD | BACKWARD


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A tick table.

    Attributes:
      name: the schedule's name (``"gpipe"``, ``"1f1b"``, ``"1f1b-fused"``).
      num_stages: ``S``; num_microbatches: ``M``.
      kind: ``int`` array ``(ticks, S)``: :data:`IDLE`, :data:`FORWARD`, :data:`BACKWARD` or
        :data:`FORWARD_BACKWARD`.
      micro: ``int`` array ``(ticks, S)``: the micro-batch (0 where idle); where both run, the forward's.
      micro_backward: where ``kind`` is :data:`FORWARD_BACKWARD`, the backward's micro-batch (``None``: no
        such cell).
    """

    name: str
    num_stages: int
    num_microbatches: int
    kind: np.ndarray
    micro: np.ndarray
    micro_backward: np.ndarray | None = None

    @property
    def forward_micro(self) -> np.ndarray:
        """``(ticks, S)``: the micro-batch whose forward each stage runs in each tick, ``-1`` where none."""
        return np.where(self.kind & FORWARD, self.micro, -1)

    @property
    def backward_micro(self) -> np.ndarray:
        """``(ticks, S)``: the micro-batch whose backward each stage runs in each tick, ``-1`` where none."""
        micro = self.micro
        if self.micro_backward is not None:
            micro = np.where(self.kind == FORWARD_BACKWARD, self.micro_backward, micro)
        return np.where(self.kind & BACKWARD, micro, -1)

    @property
    def num_ticks(self) -> int:
        return int(self.kind.shape[0])

    def tick_of(self, stage: int, phase: int, micro: int) -> int:
        """The tick at which ``stage`` runs ``phase`` of micro-batch ``micro``."""
        runs = self.forward_micro if phase == FORWARD else self.backward_micro
        (ticks,) = np.nonzero(runs[:, stage] == micro)
        if len(ticks) != 1:
            raise ValueError(f"{self.name}: stage {stage} runs {_LETTER[phase]}{micro} {len(ticks)} times, not once.")
        return int(ticks[0])

    def __str__(self) -> str:
        width = max(len(f"stage {s}") for s in range(self.num_stages))
        if self.micro_backward is not None:
            width = max(width, 2 * len(str(self.num_microbatches - 1)) + 3)  # "F99+B99"
        rows = [("tick    " + "  ".join(f"stage {s}".ljust(width) for s in range(self.num_stages))).rstrip()]
        forward, backward = self.forward_micro, self.backward_micro
        for t in range(self.num_ticks):
            cells = [
                "+".join([f"F{f}"] * int(f >= 0) + [f"B{b}"] * int(b >= 0)) or "."
                for f, b in zip(forward[t], backward[t], strict=True)
            ]
            rows.append((f"{t:4d}    " + "  ".join(c.ljust(width) for c in cells)).rstrip())
        return "\n".join(rows)


_LETTER = {FORWARD: "F", BACKWARD: "B"}


def _from_rows(name: str, stages: int, m: int, rows: list[list[tuple[int, int]]]) -> Schedule:
    """A table from per-tick rows of ``(forward micro-batch, backward micro-batch)`` per stage, ``-1`` for none."""
    cells = np.array(rows, dtype=np.int32).reshape(len(rows), stages, 2)
    forward, backward = cells[..., 0], cells[..., 1]
    kind = np.where(forward >= 0, FORWARD, IDLE) | np.where(backward >= 0, BACKWARD, IDLE)
    micro = np.where(forward >= 0, forward, np.maximum(backward, 0))
    fused = (kind == FORWARD_BACKWARD).any()
    return Schedule(name, stages, m, kind.astype(np.int32), micro, np.maximum(backward, 0) if fused else None)


def _table(name: str, stages: int, m: int, orders: Sequence[Sequence[tuple[int, int]]]) -> Schedule:
    """Run each stage's ordered list of ``(phase, micro-batch)`` as early as its dependencies allow."""
    done: dict[tuple[int, int, int], int] = {}  # (stage, phase, micro) -> tick
    position = [0] * stages
    rows: list[list[tuple[int, int]]] = []
    while any(position[s] < len(orders[s]) for s in range(stages)):
        tick = len(rows)
        if tick > 4 * (m + stages) + 8:
            raise AssertionError(f"{name}: the schedule for S={stages}, M={m} does not finish; please report it.")
        row = []
        for s in range(stages):
            if position[s] == len(orders[s]):
                row.append((IDLE, 0))
                continue
            phase, k = orders[s][position[s]]
            if phase == FORWARD:
                needs = [(s - 1, FORWARD, k)] if s > 0 else []
            else:
                needs = [(s, FORWARD, k)] + ([(s + 1, BACKWARD, k)] if s < stages - 1 else [])
            if all(done.get(n, tick) < tick for n in needs):
                row.append((phase, k))
            else:
                row.append((IDLE, 0))
        for s, (phase, k) in enumerate(row):
            if phase != IDLE:
                done[(s, phase, k)] = tick
                position[s] += 1
        rows.append(row)
    table = np.array(rows, dtype=np.int32).reshape(len(rows), stages, 2)
    return Schedule(name, stages, m, table[..., 0].copy(), table[..., 1].copy())


def _check(stages: int, m: int) -> None:
    if stages < 1 or m < 1:
        raise ValueError(f"a schedule needs at least one stage and one micro-batch (got S={stages}, M={m}).")


def gpipe(stages: int, m: int) -> Schedule:
    """GPipe: every forward, then every backward (the last stage first); ``2(M+S-1)`` ticks."""
    _check(stages, m)
    return _table("gpipe", stages, m, [[(FORWARD, k) for k in range(m)] + [(BACKWARD, k) for k in range(m)]] * stages)


def one_f_one_b(stages: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm-up forwards, one forward one backward, drain; ``2(M+S-1)`` ticks."""
    _check(stages, m)
    orders = []
    for s in range(stages):
        warmup = min(stages - 1 - s, m)
        order = [(FORWARD, k) for k in range(warmup)]
        for k in range(m - warmup):
            order += [(FORWARD, warmup + k), (BACKWARD, k)]
        order += [(BACKWARD, k) for k in range(m - warmup, m)]
        orders.append(order)
    return _table("1f1b", stages, m, orders)


def fused_one_f_one_b(stages: int, m: int) -> Schedule:
    """1F1B with a forward and a backward in every tick: each stage runs its next forward and then its next
    backward as soon as their inputs are there; ``M + 2(S-1)`` ticks, each one forward and one backward long
    at most."""
    _check(stages, m)
    forward_at: dict[tuple[int, int], int] = {}  # (stage, micro) -> tick
    backward_at: dict[tuple[int, int], int] = {}
    next_forward, next_backward = [0] * stages, [0] * stages
    rows: list[list[tuple[int, int]]] = []
    while min(next_backward) < m:
        tick = len(rows)
        row = []
        for s in range(stages):
            f = next_forward[s]
            if f == m or (s > 0 and forward_at.get((s - 1, f), tick) >= tick):
                f = -1
            b = next_backward[s]
            own_forward = forward_at.get((s, b), tick + (f != b))  # this tick's forward runs first
            if b == m or own_forward > tick or (s < stages - 1 and backward_at.get((s + 1, b), tick) >= tick):
                b = -1
            row.append((f, b))
        for s, (f, b) in enumerate(row):
            if f >= 0:
                forward_at[(s, f)] = tick
                next_forward[s] += 1
            if b >= 0:
                backward_at[(s, b)] = tick
                next_backward[s] += 1
        rows.append(row)
    return _from_rows("1f1b-fused", stages, m, rows)


def check_schedule(table: Schedule) -> None:
    """Raise ``ValueError`` unless ``table`` runs each stage's forward and backward of each micro-batch exactly
    once, a forward after the previous stage's (at an earlier tick), a backward after the next stage's and
    after its own forward: what a lowering needs to compute the right numbers."""
    stages, m = table.num_stages, table.num_microbatches
    where = f"schedule {table.name!r} (S={stages}, M={m})"
    if table.kind.shape != (table.num_ticks, stages) or table.micro.shape != table.kind.shape:
        raise ValueError(f"{where}: kind and micro must both be (ticks, {stages}) arrays.")
    if not np.isin(table.kind, (IDLE, FORWARD, BACKWARD, FORWARD_BACKWARD)).all():
        raise ValueError(f"{where}: kind holds values other than IDLE, FORWARD, BACKWARD, FORWARD_BACKWARD.")
    fused = table.kind == FORWARD_BACKWARD
    if fused.any() and (table.micro_backward is None or table.micro_backward.shape != table.kind.shape):
        raise ValueError(f"{where}: a FORWARD_BACKWARD cell needs micro_backward, a (ticks, {stages}) array.")
    busy = table.kind != IDLE
    if ((table.micro < 0) | (table.micro >= m))[busy].any() or (
        fused.any() and ((table.micro_backward < 0) | (table.micro_backward >= m))[fused].any()
    ):
        raise ValueError(f"{where}: a micro-batch index outside 0..{m - 1}.")
    for s in range(stages):
        for k in range(m):
            f, b = table.tick_of(s, FORWARD, k), table.tick_of(s, BACKWARD, k)
            if s > 0 and table.tick_of(s - 1, FORWARD, k) >= f:
                raise ValueError(f"{where}: stage {s} runs F{k} at tick {f}, before stage {s - 1}'s F{k} arrives.")
            if s < stages - 1 and table.tick_of(s + 1, BACKWARD, k) >= b:
                raise ValueError(f"{where}: stage {s} runs B{k} at tick {b}, before stage {s + 1}'s B{k} arrives.")
            if f > b:  # the same tick is a fused cell: its forward runs first
                raise ValueError(f"{where}: stage {s} runs B{k} at tick {b}, before its own F{k} (tick {f}).")


#: The schedules by name.
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "1f1b-fused": fused_one_f_one_b}


def make_schedule(name: str | Schedule, stages: int, m: int) -> Schedule:
    """The schedule ``name`` (a key of :data:`SCHEDULES`) for ``S`` stages and ``M`` micro-batches, or ``name``
    itself if it is a :class:`Schedule` (checked to be for ``S`` and ``M``)."""
    if isinstance(name, Schedule):
        if (name.num_stages, name.num_microbatches) != (stages, m):
            raise ValueError(
                f"the schedule is for S={name.num_stages}, M={name.num_microbatches}; the step has S={stages} "
                f"stages and M={m} micro-batches. Build it with make_schedule(name, {stages}, {m})."
            )
        check_schedule(name)
        return name
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; use one of {sorted(SCHEDULES)}.")
    return SCHEDULES[name](stages, m)


def table_span(table: Schedule, forward_cost: Any, backward_cost: Any) -> float:
    """The step's length when each tick lasts as long as its busiest stage's work there: a forward costs
    ``forward_cost``, a backward ``backward_cost`` (each a number, or one per stage)."""
    work = (table.forward_micro >= 0) * np.asarray(forward_cost, float) + (table.backward_micro >= 0) * np.asarray(
        backward_cost, float
    )
    return float(work.max(axis=1).sum())


@dataclasses.dataclass(frozen=True)
class ScheduleStats:
    """What a table costs, read from the table.

    Attributes:
      ticks: the table's length.
      span: the step's length in forwards, a tick as long as its busiest stage's work (a forward 1, a
        backward ``backward_cost``): what the table costs where the stages' devices wait for each other at
        every tick's exchange and do not share their compute.
      bubble: the fraction of the stages' time idle over that span (with ``backward_cost=1``, for tables of
        one unit per cell: idle (stage, tick) slots over all slots).
      peak_live: per stage, the most micro-batches whose forward ran and whose backward has not yet
        (residuals kept), at any point of a tick (a fused cell's forward runs before its backward).
    """

    ticks: int
    span: float
    bubble: float
    peak_live: tuple[int, ...]


def schedule_stats(table: Schedule, backward_cost: float = 1.0) -> ScheduleStats:
    """The span, bubble fraction and per-stage peak live activations of ``table``, a backward costing
    ``backward_cost`` forwards.

    >>> [schedule_stats(make(2, 8), backward_cost=2).span for make in (one_f_one_b, fused_one_f_one_b)]
    [34.0, 27.0]

    (The ideal: ``(M + S - 1)`` ticks of one forward and one backward, 27.)
    """
    forwards, backwards = table.forward_micro >= 0, table.backward_micro >= 0
    live = np.cumsum(forwards, axis=0) - np.cumsum(backwards, axis=0) + backwards  # before the tick's backward
    span = table_span(table, 1.0, backward_cost)
    work = forwards.sum() + backward_cost * backwards.sum()  # every stage's units, busy or not
    return ScheduleStats(
        ticks=table.num_ticks,
        span=span,
        bubble=float(1 - work / (table.num_stages * span)),
        peak_live=tuple(int(x) for x in live.max(axis=0)),
    )
