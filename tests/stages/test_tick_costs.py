"""What a pipelined step's tick loop costs per tick, read from the compiled program (XLA's HLO text).

A tick runs one stage's forward or backward of one micro-batch. What it must not do, each a cost found and
removed (BENCHMARKS.md, "Pipeline parallelism"), each checked on both schedules and on 2 and 4 stages:

* copy a parameter-sized buffer: slice a layer's weights out of the packed row (they cross the stages'
  switch as they are, in slots), copy the gradient accumulator out of a conditional, or copy the stash ring;
  nor, once per step, slice the weights out of a row (between steps each layer lies in a slot of its own);
* send before the backward loop: a send meets the neighbour's; sent before the tick's backward it meets a
  neighbour still running its forward, and serializes the two stages' work.

The numbers these programs compute are checked against one device in test_train.py and test_lower.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import replicator as rp
from replicator.stages.train import pipeline_train_step

WIDTH, LAYERS, ROWS, M = 32, 4, 16, 8  # a layer's weights: 1024 elements; a micro-batch's activation: 64


def loss_in(stages: int):
    def loss(p, x, y):
        h = x
        for i in range(LAYERS):
            if i and i % (LAYERS // stages) == 0:
                h = rp.stage_boundary(h)
            h = jnp.tanh(h @ p[i]["w"] + p[i]["b"])
        return jnp.mean((h - y) ** 2)

    return loss


def compiled_text(stages: int, schedule: str) -> str:
    rng = np.random.default_rng(0)
    p = [
        {"w": rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) / 5, "b": np.zeros(WIDTH, np.float32)}
        for _ in range(LAYERS)
    ]
    x, y = (rng.normal(size=(ROWS, WIDTH)).astype(np.float32) for _ in range(2))
    opt = optax.adam(1e-3)
    train = pipeline_train_step(
        loss_in(stages), opt, num_microbatches=M, schedule=schedule, devices=jax.devices()[:stages]
    )
    built = train.built(p, x, y)
    rows = train.pack(p, opt.init(p))
    return built.step.lower(rows, built.micro_leaves((x, y))).compile().as_text()


def computations(hlo: str) -> dict[str, list[str]]:
    """Each computation's instruction lines, by name."""
    out: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            out[name].append(line)
    return out


def called(line: str) -> list[str]:
    """The computations an instruction calls (a loop's body and condition, a conditional's branches, a fusion's)."""
    names = []
    for key in ("body=", "condition=", "calls=", "to_apply="):
        names += re.findall(re.escape(key) + r"%([\w.\-]+)", line)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        names += re.findall(r"%([\w.\-]+)", group)
    return names


def reachable(comps: dict[str, list[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += [c for line in comps[name] for c in called(line)]
    return seen


def elements(line: str) -> int:
    shape = re.search(r"= \w+\[([\d,]*)\]", line)
    return int(np.prod([int(d) for d in shape.group(1).split(",") if d])) if shape else 0


def loop_bodies(comps: dict[str, list[str]]) -> list[str]:
    return [
        b
        for lines in comps.values()
        for line in lines
        if " while(" in line
        for b in re.findall(r"body=%([\w.\-]+)", line)
    ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-fused"])
@pytest.mark.parametrize("stages", [2, 4])
def test_a_tick_copies_no_parameter_sized_buffer(stages, schedule):
    comps = computations(compiled_text(stages, schedule))
    inside = reachable(comps, loop_bodies(comps))
    assert inside, "no loop found in the compiled step"
    copies = [line.strip() for name in inside for line in comps[name] if re.search(r" copy\(", line)]
    big = [c for c in copies if elements(c) >= WIDTH * WIDTH]
    assert not big, "copies of a parameter-sized buffer on every tick:\n" + "\n".join(big)
    big = [line.strip() for name in inside for line in comps[name] if _sliced(comps, line) >= WIDTH * WIDTH]
    assert not big, "parameter-sized slices (a layer's weights out of the row) on every tick:\n" + "\n".join(big)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-fused"])
@pytest.mark.parametrize("stages", [2, 4])
def test_a_step_reads_the_weights_where_they_are_stored(stages, schedule):
    """The layers line up across the stages, so each lies in a buffer of its own between steps (a slot): the
    step reads it with a reshape, and no parameter-sized slice of the weights is taken, per tick or per step."""
    comps = computations(compiled_text(stages, schedule))
    big = [line.strip() for lines in comps.values() for line in lines if _sliced(comps, line) >= WIDTH * WIDTH]
    assert not big, "parameter-sized slices (a layer's weights out of a packed row):\n" + "\n".join(big)


def _sliced(comps: dict[str, list[str]], line: str) -> int:
    """The elements of the largest slice an instruction takes (a slice, or one in the fusion it is; not a
    dynamic-update-slice)."""
    bodies = [line] + [x for c in called(line) if " fusion(" in line for x in comps.get(c, [])]
    return max([elements(x) for x in bodies if re.search(r"(?<![\w-])(slice|dynamic-slice)\(", x)], default=0)


def sends(comps: dict[str, list[str]], line: str) -> bool:
    """Whether an instruction is a send (collective-permute) or a conditional that holds one."""
    if "collective-permute" in line:
        return True
    return " conditional(" in line and any(
        "collective-permute" in x for c in reachable(comps, called(line)) for x in comps[c]
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "1f1b-fused"])
@pytest.mark.parametrize("stages", [2, 4])
def test_a_tick_sends_after_its_forward_and_backward(stages, schedule):
    comps = computations(compiled_text(stages, schedule))
    ticks = [name for name in loop_bodies(comps) if sum(" while(" in line for line in comps[name]) >= 2]
    assert ticks, "no tick loop (a loop whose body runs the forward and backward loops) in the compiled step"
    for name in ticks:
        lines = comps[name]  # a scheduled module: in the order they run
        last_loop = max(i for i, line in enumerate(lines) if " while(" in line)
        early = [line.strip()[:120] for line in lines[:last_loop] if sends(comps, line)]
        assert not early, "a send scheduled before the tick's backward:\n" + "\n".join(early)
