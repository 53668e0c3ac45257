"""The tick tables of the schedules, checked as data for many (S, M): each unit of work once, dependencies,
live activations and the bubble against the formulas."""

from __future__ import annotations

import numpy as np
import pytest

from replicator.stages import schedule
from replicator.stages.schedule import (
    BACKWARD,
    FORWARD,
    FORWARD_BACKWARD,
    IDLE,
    Schedule,
    check_schedule,
    fused_one_f_one_b,
    gpipe,
    make_schedule,
    one_f_one_b,
    schedule_stats,
)

SIZES = [(s, m) for s in (1, 2, 3, 4, 5, 8) for m in sorted({1, 2, 3, s - 1, s, s + 1, 2 * s, 4 * s} - {0})]
BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b, "1f1b-fused": fused_one_f_one_b}


def _cases():
    return [pytest.param(name, s, m, id=f"{name}-S{s}-M{m}") for name in BUILDERS for s, m in SIZES]


def check_every_unit_once(table: Schedule) -> None:
    s_, m_ = table.num_stages, table.num_microbatches
    assert table.kind.shape == table.micro.shape == (table.num_ticks, s_)
    seen: dict[tuple[int, int, int], int] = {}
    for t in range(table.num_ticks):
        for s in range(s_):
            kind = int(table.kind[t, s])
            assert kind in (IDLE, FORWARD, BACKWARD, FORWARD_BACKWARD), (t, s, kind)
            units = []
            if kind & FORWARD:
                units.append((FORWARD, int(table.micro[t, s])))
            if kind == BACKWARD:
                units.append((BACKWARD, int(table.micro[t, s])))
            if kind == FORWARD_BACKWARD:
                units.append((BACKWARD, int(table.micro_backward[t, s])))
            for phase, m in units:
                assert 0 <= m < m_, (t, s, phase, m)
                assert (s, phase, m) not in seen, f"stage {s} runs {phase}/{m} twice"
                seen[(s, phase, m)] = t
    assert len(seen) == 2 * s_ * m_, "some (stage, micro-batch, phase) never runs"


def check_dependencies(table: Schedule) -> None:
    s_, m_ = table.num_stages, table.num_microbatches
    for m in range(m_):
        for s in range(s_):
            f, b = table.tick_of(s, FORWARD, m), table.tick_of(s, BACKWARD, m)
            if s > 0:
                assert table.tick_of(s - 1, FORWARD, m) < f, f"F{m} on stage {s} before its input arrives"
            if s < s_ - 1:
                assert table.tick_of(s + 1, BACKWARD, m) < b, f"B{m} on stage {s} before its cotangent arrives"
            # In the same tick only as one fused cell, whose forward runs first.
            assert f < b or (f == b and table.kind[f, s] == FORWARD_BACKWARD), f"B{m} on stage {s} before its forward"


@pytest.mark.parametrize("name, s, m", _cases())
def test_table(name, s, m):
    table = BUILDERS[name](s, m)
    assert table.name == name and (table.num_stages, table.num_microbatches) == (s, m)
    check_every_unit_once(table)
    check_dependencies(table)
    stats = schedule_stats(table)
    assert stats.ticks == (m + 2 * (s - 1) if name == "1f1b-fused" else 2 * (m + s - 1))
    assert stats.bubble == pytest.approx((s - 1) / (m + s - 1), abs=1e-12)
    if name == "gpipe":
        assert stats.peak_live == (m,) * s
    elif name == "1f1b":
        assert stats.peak_live == tuple(min(s - stage, m) for stage in range(s))
        assert max(stats.peak_live) <= s
    else:
        assert stats.peak_live == tuple(min(2 * (s - 1 - stage) + 1, m) for stage in range(s))


@pytest.mark.parametrize("s, m", [(2, 1), (2, 8), (3, 4), (4, 4), (4, 16), (8, 3)])
def test_span_where_devices_wait_each_tick(s, m):
    # A backward costs two forwards; a tick lasts as long as its busiest stage. The ideal is M + S - 1 ticks
    # of one forward and one backward: GPipe (phases apart) and the fused 1F1B reach it; 1F1B pairs one
    # stage's forward with its neighbour's backward in its steady state and pays a backward for each.
    ideal = 3 * (m + s - 1)
    assert schedule_stats(gpipe(s, m), backward_cost=2).span == ideal
    assert schedule_stats(fused_one_f_one_b(s, m), backward_cost=2).span == ideal
    steady = max(0, m - (s - 1))  # micro-batches in 1F1B's steady state
    assert schedule_stats(one_f_one_b(s, m), backward_cost=2).span >= ideal + steady
    # The bubble over that span: every stage busy 3M of it.
    stats = schedule_stats(fused_one_f_one_b(s, m), backward_cost=2)
    assert stats.bubble == pytest.approx(1 - 3 * m / stats.span)


def test_fused_table():
    # Each tick a stage runs its next forward and then its next backward, as soon as their inputs are there;
    # the last stage runs a micro-batch's forward and backward in one tick.
    table = fused_one_f_one_b(3, 4)
    assert str(table).splitlines() == [
        "tick    stage 0  stage 1  stage 2",
        "   0    F0       .        .",
        "   1    F1       F0       .",
        "   2    F2       F1       F0+B0",
        "   3    F3       F2+B0    F1+B1",
        "   4    B0       F3+B1    F2+B2",
        "   5    B1       B2       F3+B3",
        "   6    B2       B3       .",
        "   7    B3       .        .",
    ]
    assert table.kind[3, 1] == FORWARD_BACKWARD and table.micro[3, 1] == 2 and table.micro_backward[3, 1] == 0
    np.testing.assert_array_equal(table.forward_micro[3], [3, 2, 1])
    np.testing.assert_array_equal(table.backward_micro[3], [-1, 0, 1])
    assert schedule_stats(table).peak_live == (4, 3, 1)
    assert make_schedule("1f1b-fused", 3, 4).name == "1f1b-fused"


def test_wide_fused_cells_keep_their_columns():
    # From M = 101 a fused cell ("F100+B100") is wider than "stage 0": the columns widen, the header with them.
    table = fused_one_f_one_b(2, 101)
    head, *rows = str(table).splitlines()
    column = head.index("stage 1")
    assert head == "tick    stage 0    stage 1"  # as wide as "F100+B100", no wider
    for t, line in enumerate(rows):
        cells = [
            "+".join([f"F{f}"] * int(f >= 0) + [f"B{b}"] * int(b >= 0)) or "."
            for f, b in zip(table.forward_micro[t], table.backward_micro[t], strict=True)
        ]
        assert line[8:column].strip() == cells[0] and line[column - 2 : column] == "  ", line
        assert line[column:].rstrip() == cells[1], line
    assert "F100+B100" in str(table)


def test_an_order_that_cannot_finish_is_reported():
    # Stage 0 lists B0 before F0 and stage 1 waits on stage 0's F0: nothing ever runs.
    stuck = [[(BACKWARD, 0), (FORWARD, 0)], [(FORWARD, 0), (BACKWARD, 0)]]
    with pytest.raises(AssertionError, match="stuck: the schedule for S=2, M=1 does not finish"):
        schedule._table("stuck", 2, 1, stuck)


def test_a_fused_cell_is_checked():
    table = fused_one_f_one_b(2, 3)
    check_schedule(table)
    backward = table.micro_backward.copy()
    backward[table.kind == FORWARD_BACKWARD] = 5
    with pytest.raises(ValueError, match="outside 0..2"):
        check_schedule(Schedule("broken", 2, 3, table.kind, table.micro, backward))
    with pytest.raises(ValueError, match="needs micro_backward"):
        check_schedule(Schedule("broken", 2, 3, table.kind, table.micro))
    # Stage 0 runs F2+B0 in tick 2, B1 in tick 3. Swapping the backwards (B1 fused into tick 2, before stage
    # 1's B1 arrives) is caught.
    kind, micro, backward = table.kind.copy(), table.micro.copy(), table.micro_backward.copy()
    assert (kind[2, 0], micro[2, 0], backward[2, 0], kind[3, 0], micro[3, 0]) == (FORWARD_BACKWARD, 2, 0, BACKWARD, 1)
    backward[2, 0], micro[3, 0] = 1, 0
    with pytest.raises(ValueError, match="stage 0 runs B1 at tick 2, before stage 1's B1 arrives"):
        check_schedule(Schedule("broken", 2, 3, kind, micro, backward))


def test_live_counts_are_from_the_table():
    # Stage 0 of 1F1B at S=2, M=3 runs F0 F1 . B0 F2 B1 . B2: two alive after tick 1, never three.
    table = one_f_one_b(2, 3)
    assert [f"{'.FB'[k]}{m}" for k, m in zip(table.kind[:, 0], table.micro[:, 0], strict=True)] == [
        "F0", "F1", ".0", "B0", "F2", "B1", ".0", "B2"
    ]  # fmt: skip
    assert schedule_stats(table).peak_live == (2, 1)
    assert schedule_stats(gpipe(2, 3)).peak_live == (3, 3)


def test_checks_catch_a_broken_table():
    # The checks above can fail: swap a stage's forward after its successor's, and drop a unit.
    table = gpipe(3, 2)
    kind, micro = table.kind.copy(), table.micro.copy()
    t0, t1 = table.tick_of(1, FORWARD, 0), table.tick_of(2, FORWARD, 0)
    kind[[t0, t1], 1], micro[[t0, t1], 1] = kind[[t1, t0], 1], micro[[t1, t0], 1]
    with pytest.raises(AssertionError, match="before its input arrives"):
        check_dependencies(Schedule("broken", 3, 2, kind, micro))
    kind = table.kind.copy()
    kind[table.tick_of(0, BACKWARD, 1), 0] = IDLE
    with pytest.raises(AssertionError, match="never runs"):
        check_every_unit_once(Schedule("broken", 3, 2, kind, table.micro))


def test_make_schedule():
    assert make_schedule("1f1b", 3, 4).name == "1f1b"
    table = gpipe(2, 4)
    assert make_schedule(table, 2, 4) is table
    with pytest.raises(ValueError, match=r"make_schedule\(name, 3, 4\)"):
        make_schedule(table, 3, 4)
    with pytest.raises(ValueError, match="unknown schedule 'zb'; use one of"):
        make_schedule("zb", 2, 2)
    with pytest.raises(ValueError, match="M=0"):
        gpipe(2, 0)


def test_printed_table():
    assert str(gpipe(2, 1)).splitlines() == [
        "tick    stage 0  stage 1",
        "   0    F0       .",
        "   1    .        F0",
        "   2    .        B0",
        "   3    B0       .",
    ]
    assert np.array_equal(gpipe(2, 1).kind[:, 1], [IDLE, FORWARD, BACKWARD, IDLE])


def test_check_schedule_rejects_what_a_lowering_would_get_wrong():
    for builder in BUILDERS.values():
        for s, m in SIZES:
            check_schedule(builder(s, m))  # every built table passes
    table = one_f_one_b(3, 3)

    def broken(edit) -> Schedule:
        kind, micro = table.kind.copy(), table.micro.copy()
        edit(kind, micro)
        return Schedule("broken", 3, 3, kind, micro)

    def swap(stage_a, tick_a, stage_b, tick_b):
        def edit(kind, micro):
            for a in (kind, micro):
                a[tick_a, stage_a], a[tick_b, stage_b] = a[tick_b, stage_b].copy(), a[tick_a, stage_a].copy()

        return edit

    f0_on_1 = table.tick_of(1, FORWARD, 0)  # move stage 1's F0 to tick 0, beside stage 0's
    with pytest.raises(ValueError, match="stage 1 runs F0 at tick 0, before stage 0's F0 arrives"):
        make_schedule(broken(swap(1, f0_on_1, 1, 0)), 3, 3)
    b0_on_2, b0_on_1 = table.tick_of(2, BACKWARD, 0), table.tick_of(1, BACKWARD, 0)
    with pytest.raises(ValueError, match="before stage 2's B0 arrives"):
        make_schedule(broken(swap(1, b0_on_1, 1, b0_on_2)), 3, 3)
    f1_on_2, b1_on_2 = table.tick_of(2, FORWARD, 1), table.tick_of(2, BACKWARD, 1)
    with pytest.raises(ValueError, match="before its own F1"):
        make_schedule(broken(swap(2, f1_on_2, 2, b1_on_2)), 3, 3)
    with pytest.raises(ValueError, match="runs B2 0 times, not once"):
        make_schedule(broken(lambda kind, micro: kind.__setitem__((table.tick_of(0, BACKWARD, 2), 0), IDLE)), 3, 3)
    with pytest.raises(ValueError, match="outside 0..2"):
        make_schedule(broken(lambda kind, micro: micro.__setitem__((table.tick_of(0, BACKWARD, 2), 0), 7)), 3, 3)
