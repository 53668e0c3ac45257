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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = [
    "BACKWARD",
    "FORWARD",
    "IDLE",
    "SCHEDULES",
    "check_schedule",
    "Schedule",
    "ScheduleStats",
    "gpipe",
    "make_schedule",
    "one_f_one_b",
    "schedule_stats",
]

#: What a stage does during a tick (the values of :attr:`Schedule.kind`).
IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A tick table.

    Attributes:
      name: the schedule's name (``"gpipe"``, ``"1f1b"``).
      num_stages: ``S``; num_microbatches: ``M``.
      kind: ``int`` array ``(ticks, S)``: :data:`IDLE`, :data:`FORWARD` or :data:`BACKWARD`.
      micro: ``int`` array ``(ticks, S)``: the micro-batch (0 where idle).
    """

    name: str
    num_stages: int
    num_microbatches: int
    kind: np.ndarray
    micro: np.ndarray

    @property
    def num_ticks(self) -> int:
        return int(self.kind.shape[0])

    def tick_of(self, stage: int, phase: int, micro: int) -> int:
        """The tick at which ``stage`` runs ``phase`` of micro-batch ``micro``."""
        (ticks,) = np.nonzero((self.kind[:, stage] == phase) & (self.micro[:, stage] == micro))
        if len(ticks) != 1:
            raise ValueError(f"{self.name}: stage {stage} runs {_LETTER[phase]}{micro} {len(ticks)} times, not once.")
        return int(ticks[0])

    def __str__(self) -> str:
        head = "tick    " + "  ".join(f"stage {s:<2d}".rstrip() for s in range(self.num_stages))
        width = max(len(f"stage {s}") for s in range(self.num_stages))
        rows = [head]
        for t in range(self.num_ticks):
            cells = [
                "." if k == IDLE else f"{_LETTER[int(k)]}{int(m)}"
                for k, m in zip(self.kind[t], self.micro[t], strict=True)
            ]
            rows.append((f"{t:4d}    " + "  ".join(c.ljust(width) for c in cells)).rstrip())
        return "\n".join(rows)


_LETTER = {FORWARD: "F", BACKWARD: "B"}


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


def check_schedule(table: Schedule) -> None:
    """Raise ``ValueError`` unless ``table`` runs each stage's forward and backward of each micro-batch exactly
    once, a forward after the previous stage's (at an earlier tick), a backward after the next stage's and
    after its own forward: what a lowering needs to compute the right numbers."""
    stages, m = table.num_stages, table.num_microbatches
    where = f"schedule {table.name!r} (S={stages}, M={m})"
    if table.kind.shape != (table.num_ticks, stages) or table.micro.shape != table.kind.shape:
        raise ValueError(f"{where}: kind and micro must both be (ticks, {stages}) arrays.")
    if not np.isin(table.kind, (IDLE, FORWARD, BACKWARD)).all():
        raise ValueError(f"{where}: kind holds values other than IDLE, FORWARD, BACKWARD.")
    busy = table.kind != IDLE
    if ((table.micro < 0) | (table.micro >= m))[busy].any():
        raise ValueError(f"{where}: a micro-batch index outside 0..{m - 1}.")
    for s in range(stages):
        for k in range(m):
            f, b = table.tick_of(s, FORWARD, k), table.tick_of(s, BACKWARD, k)
            if s > 0 and table.tick_of(s - 1, FORWARD, k) >= f:
                raise ValueError(f"{where}: stage {s} runs F{k} at tick {f}, before stage {s - 1}'s F{k} arrives.")
            if s < stages - 1 and table.tick_of(s + 1, BACKWARD, k) >= b:
                raise ValueError(f"{where}: stage {s} runs B{k} at tick {b}, before stage {s + 1}'s B{k} arrives.")
            if f >= b:
                raise ValueError(f"{where}: stage {s} runs B{k} at tick {b}, not after its own F{k} (tick {f}).")


#: The schedules by name.
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


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


@dataclasses.dataclass(frozen=True)
class ScheduleStats:
    """What a table costs, read from the table.

    Attributes:
      ticks: the table's length.
      bubble: idle (stage, tick) slots over all slots.
      peak_live: per stage, the most micro-batches whose forward ran and whose backward has not yet
        (residuals kept), after any tick.
    """

    ticks: int
    bubble: float
    peak_live: tuple[int, ...]


def schedule_stats(table: Schedule) -> ScheduleStats:
    """The bubble fraction and per-stage peak live activations of ``table``."""
    kind = table.kind
    live = np.cumsum(kind == FORWARD, axis=0) - np.cumsum(kind == BACKWARD, axis=0)
    return ScheduleStats(
        ticks=table.num_ticks,
        bubble=float(np.mean(kind == IDLE)),
        peak_live=tuple(int(x) for x in live.max(axis=0)),
    )
