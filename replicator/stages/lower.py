"""A tick table lowered to one SPMD loop: a marked loss's value and gradient over S stages, any schedule.

One program under ``jit(shard_map)`` over a ``('stages',)`` mesh. Each tick of
the table (:mod:`replicator.stages.schedule`), every device reads what its
stage runs (``forward_micro[t, s]``, ``backward_micro[t, s]``) and runs its forward ``F_s``,
its backward ``B_s``, or both, forward first (:mod:`replicator.stages.programs`), each a ``lax.switch``
over the stages inside a loop of 0 or 1 trips (which updates the stash and the
gradients in place); then what it sends moves with two
``ppermute`` over ``'stages'``: activations to ``s + 1``, cotangents to
``s - 1``. A receiver reads from the table which micro-batch its neighbour
ran, and keeps the value in an inbox slot until its own tick for that
micro-batch (under 1F1B a value may wait several ticks). Residuals wait in a
stash from a stage's forward to its backward of the same micro-batch.

Stash and inboxes are rings: micro-batch ``m`` sits in slot ``m % K``, with
``K`` the most micro-batches a buffer holds at once in the table (checked to
never collide), so 1F1B keeps ``S`` residual slots where GPipe keeps ``M``.
Heterogeneous stages pass values of different shapes as one flat buffer per
dtype, padded to the largest stage's. Parameters are replicated on every
device here (placing them per stage is the update phase, a later increment).

>>> def loss(p, x):
...     h = rp.stage_boundary(jnp.tanh(x @ p["a"]))
...     return jnp.mean((h @ p["b"]) ** 2)
>>> p = {"a": jnp.full((3, 4), 0.1), "b": jnp.full((4, 2), 0.2)}
>>> x = jnp.linspace(-1, 1, 24).reshape(8, 3)
>>> f = pipeline_value_and_grad(loss, num_microbatches=4, schedule="1f1b", devices=jax.devices()[:2])
>>> value, grads = f(p, x)
>>> want_value, want = jax.value_and_grad(loss)(p, x)
>>> bool(jnp.allclose(value, want_value, rtol=1e-5)), bool(jnp.allclose(grads["a"], want["a"], rtol=1e-5))
(True, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from replicator.stages.packing import Packing, Slots
from replicator.stages.programs import StagePrograms, stage_programs
from replicator.stages.schedule import BACKWARD, FORWARD, Schedule, make_schedule
from replicator.stages.split import StageSplitError, split_stages

__all__ = ["STAGE_AXIS", "OutputLayout", "pipeline_value_and_grad", "ring_slots", "tick_loop"]

STAGE_AXIS = "stages"


def pipeline_value_and_grad(
    loss: Callable,
    *,
    num_microbatches: int,
    schedule: str | Schedule = "gpipe",
    devices: Sequence[Any] | None = None,
    recompute: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad(loss)`` over the stages that ``loss``'s ``rp.stage_boundary`` markers cut.

    Args:
      loss: ``loss(params, *batch) -> scalar``, marked with ``rp.stage_boundary``; a mean over its batch.
      num_microbatches: ``M``; the batch leaves' leading axis must be divisible by it.
      schedule: ``"gpipe"``, ``"1f1b"``, ``"1f1b-fused"`` or a :class:`~replicator.stages.schedule.Schedule`
        for ``S`` and ``M``.
      devices: one device per stage (default: the first ``S`` devices).
      recompute: stash only what each stage receives (its boundary inputs) between a micro-batch's forward and
        its backward, and run the stage's forward again before the backward (GPipe's recomputation from the
        stage boundaries: less memory, about one more forward of compute).

    Returns:
      ``f(params, *batch) -> (value, grads)``: the mean over the ``M`` micro-batches of each one's
      value and gradient (for a loss that is a mean over rows, the value and gradient on the whole batch);
      ``f.lower(params, *batch)`` is its program, lowered.
    """
    m = num_microbatches

    def prepare(params: Any, batch: tuple) -> tuple[Callable, list, list, Any]:
        leaves = jax.tree.leaves(batch)
        for leaf in leaves:
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] % m:
                raise ValueError(
                    f"pipeline_value_and_grad: a batch leaf of shape {np.shape(leaf)} does not split into "
                    f"num_microbatches={m} equal micro-batches; make the batch a multiple of {m}."
                )
        micro = [jnp.reshape(leaf, (m, leaf.shape[0] // m, *leaf.shape[1:])) for leaf in map(jnp.asarray, leaves)]
        batch_def = jax.tree.structure(batch)
        param_leaves, param_def = jax.tree.flatten(params)

        def one(param_leaves: list, batch_leaves: list) -> Any:
            return jax.value_and_grad(loss)(param_def.unflatten(param_leaves), *batch_def.unflatten(batch_leaves))

        # Traced on shapes alone: an argument placed on a mesh must not carry its sharding into the programs.
        closed = jax.make_jaxpr(one)(_shapes(param_leaves), _shapes([x[0] for x in micro]))
        split = split_stages(closed, first_batch=len(param_leaves))
        stages = split.num_stages
        mesh_devices = list(devices) if devices is not None else jax.devices()[:stages]
        if len(mesh_devices) != stages:
            raise StageSplitError(f"the loss has {stages} stages; pass {stages} devices (got {len(mesh_devices)}).")
        table = make_schedule(schedule, stages, m)
        programs = stage_programs(split, closed)
        mesh = Mesh(np.array(mesh_devices), (STAGE_AXIS,))
        return _lower(programs, table, mesh, closed.out_avals, recompute), param_leaves, micro, param_def

    def run(params: Any, *batch: Any) -> tuple[Any, Any]:
        program, param_leaves, micro, param_def = prepare(params, batch)
        outs = program(param_leaves, micro)
        return outs[0], param_def.unflatten(outs[1:])

    def lower(params: Any, *batch: Any) -> jax.stages.Lowered:
        """The program for these arguments, lowered (``.compile().memory_analysis()``: its memory)."""
        program, param_leaves, micro, _ = prepare(params, batch)
        return program.lower(param_leaves, micro)

    run.lower = lower  # type: ignore[attr-defined]
    return run


def ring_slots(table: Schedule) -> dict[str, int]:
    """How many slots each buffer of the lowering needs, read from ``table``: ``"stash"`` (residuals, from a
    stage's forward of a micro-batch to its backward), ``"inbox"`` (a received activation, from the tick after
    the previous stage's forward to this stage's) and ``"inbox_ct"`` (a received cotangent, likewise).
    Micro-batch ``m`` sits in slot ``m % K``; ``K`` is the most micro-batches alive at once in any stage,
    raised until no two alive at once share a slot."""
    s_, m_ = table.num_stages, table.num_microbatches
    tick = {(s, k, m): table.tick_of(s, k, m) for s in range(s_) for k in (FORWARD, BACKWARD) for m in range(m_)}
    lives: dict[str, list[list[tuple[int, int]]]] = {"stash": [], "inbox": [], "inbox_ct": []}
    for s in range(s_):
        lives["stash"].append([(tick[s, FORWARD, m], tick[s, BACKWARD, m]) for m in range(m_)])
        if s > 0:
            lives["inbox"].append([(tick[s - 1, FORWARD, m] + 1, tick[s, FORWARD, m]) for m in range(m_)])
        if s < s_ - 1:
            lives["inbox_ct"].append([(tick[s + 1, BACKWARD, m] + 1, tick[s, BACKWARD, m]) for m in range(m_)])
    slots = {}
    for name, per_stage in lives.items():
        k = max([1] + [_most_alive(spans) for spans in per_stage])
        while k < m_ and any(_collide(spans, k) for spans in per_stage):
            k += 1
        slots[name] = k
    return slots


def _most_alive(spans: list[tuple[int, int]]) -> int:
    ends = {t for span in spans for t in span}
    return max(sum(a <= t <= b for a, b in spans) for t in ends)


def _collide(spans: list[tuple[int, int]], k: int) -> bool:
    return any(
        i % k == j % k and spans[i][0] <= spans[j][1] and spans[j][0] <= spans[i][1]
        for i in range(len(spans))
        for j in range(i)
    )


def _lower(
    programs: list[StagePrograms], table: Schedule, mesh: Mesh, out_avals: Sequence[Any], recompute: bool = False
) -> Callable:
    loop = tick_loop(programs, table, out_avals, recompute=recompute)
    mapped = jax.shard_map(loop, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    return jax.jit(mapped)


class OutputLayout:
    """Where the tick loop accumulates the step's outputs when each stage's caller reads only some of them.

    An output is *own* to stage ``s`` when only ``s`` adds to it and only ``s`` reads it after the loop (a
    gradient of a leaf only that stage keeps): it accumulates in a packed row on ``s``'s devices, padded to the
    largest stage's, and never crosses stages. Every other output that some stage reads is *shared*: each
    stage accumulates its part, and one ``psum`` over the stages after the loop adds them (the loss, a tied
    leaf's gradient, one that another stage's update reads). An output no stage reads is not accumulated.
    Without a layout the loop keeps and sums every output, as if every stage read all of them.

    An output a stage's programs return as its slice (``StagePrograms.sliced``: a partitioned parameter's
    gradient) is own to each stage that reads it, with that stage's slice aval: never summed across stages.

    Args:
      programs: every stage's programs (their ``contributes``); out_avals: the step's outputs.
      needed: per stage, the positions of the outputs its caller reads after the loop.
    """

    def __init__(self, programs: Sequence[StagePrograms], out_avals: Sequence[Any], needed: Sequence[Sequence[int]]):
        stages = len(programs)
        readers: dict[int, set[int]] = {}
        for s, positions in enumerate(needed):
            for p in positions:
                readers.setdefault(p, set()).add(s)
        adders = {p: {s for s in range(stages) if p in programs[s].contributes} for p in range(len(out_avals))}
        sliced = {p for program in programs for p in program.sliced}
        for p in sliced:
            if not readers.get(p, set()) <= {s for s in range(stages) if p in programs[s].sliced}:
                raise ValueError(f"output {p} is read by a stage that holds no slice of it.")
        self.own = [
            [
                p
                for p in sorted(readers)
                if (p in programs[s].sliced and s in readers[p])
                or (p not in sliced and adders[p] <= {s} and readers[p] == {s} and adders[p])
            ]
            for s in range(stages)
        ]
        owned = {p for positions in self.own for p in positions}
        self.shared = [p for p in sorted(readers) if p not in owned]
        self.out_avals = list(out_avals)
        avals = [[programs[s].sliced.get(p, out_avals[p]) for p in positions] for s, positions in enumerate(self.own)]
        # Own outputs that line up across the stages (a balanced stack's gradients) accumulate in slots, as
        # they are; the rest in a packed row.
        self.slots = Slots(avals)
        self.rest = [[k for k in range(len(mine)) if k not in self.slots.of[s]] for s, mine in enumerate(avals)]
        self.packing = Packing([[avals[s][k] for k in rest] for s, rest in enumerate(self.rest)])

    def split(self, stage: int, outputs: Sequence[Any]) -> tuple[tuple[dict, list], list]:
        """One stage's outputs (every position, as its programs return them) as its own (a row and the slots)
        and the shared."""
        own = [outputs[p] for p in self.own[stage]]
        row = _pad(self.packing.pack(stage, [own[k] for k in self.rest[stage]]), self.sizes)
        return (row, self.slots.take(stage, own)), [outputs[p] for p in self.shared]

    @property
    def sizes(self) -> dict[str, int]:
        return {str(d): n for d, n in self.packing.sizes.items()}

    def zeros(self) -> tuple[tuple[dict, list], list]:
        """Nothing accumulated yet, as :meth:`split` lays it out."""
        return (self.packing.zeros(), self.slots.zeros()), [
            jnp.zeros(self.out_avals[p].shape, self.out_avals[p].dtype) for p in self.shared
        ]

    def values(self, stage: int, own: tuple[dict, list], shared: Sequence[Any]) -> list:
        """Every output position as ``stage`` sees it after the loop: its own and the shared values, zeros for
        the outputs it does not read."""
        out = [jnp.zeros(a.shape, a.dtype) for a in self.out_avals]
        row, slots = own
        mine = self.own[stage]
        for k, value in zip(self.rest[stage], self.packing.unpack(stage, row), strict=True):
            out[mine[k]] = value
        for k, slot in self.slots.of[stage].items():
            out[mine[k]] = slots[slot]
        for p, value in zip(self.shared, shared, strict=True):
            out[p] = value
        return out


def tick_loop(
    programs: list[StagePrograms],
    table: Schedule,
    out_avals: Sequence[Any],
    params_of: Callable[[int, Any], list] | None = None,
    *,
    recompute: bool,
    layout: OutputLayout | None = None,
    prepare: Callable[[Any, jax.Array], Any] | None = None,
) -> Callable[[Any, list], Any]:
    """The loop of ``table``'s ticks, to call inside ``shard_map`` over :data:`STAGE_AXIS`.

    Args:
      programs: every stage's programs; table: the schedule; out_avals: the step's outputs.
      params_of: ``(stage, params) -> parameter leaves`` as that stage's programs read them (its inputs before
        the micro-batch), called inside that stage's branches; default: ``params`` is that list already.
      prepare: ``(params, stage) -> params``, run once before the loop, outside the stages' switch (what every
        tick's branch would otherwise slice out again: :class:`~replicator.stages.packing.RowReader`); ``stage``
        is the device's, traced. ``params_of`` reads its result.
      recompute: the stash keeps each stage's received boundary values instead of its residuals, and the
        backward branch runs the stage's forward again on them first (recomputation from the boundaries).
      layout: accumulate each output where it is read (:class:`OutputLayout`); then the loop returns
        ``(own, shared)``, which ``layout.values(stage, own, shared)`` reads, both averaged over the micro-batches.

    Returns:
      ``loop(params, micro_batches) -> outputs``: ``micro_batches`` the batch leaves, each ``(M, rows, ...)``;
      ``outputs`` the step's outputs summed over the stages and averaged over the micro-batches (the same on
      every device); with a ``layout``, ``(own, shared)``.
    """
    stages, m = table.num_stages, table.num_microbatches
    params_of = params_of or (lambda stage, params: params)
    received = Packing([p.received for p in programs])
    messages = _union_sizes(Packing([p.sent for p in programs]), received)
    received_ct = Packing([p.received_ct for p in programs])
    messages_ct = _union_sizes(Packing([p.sent_ct for p in programs]), received_ct)
    # The stash: each micro-batch's residuals, or with recomputation only what the stage received.
    residuals = Packing([p.received if recompute else p.residuals for p in programs])
    sent_pack = Packing([p.sent for p in programs])
    sent_ct_pack = Packing([p.sent_ct for p in programs])
    slots = ring_slots(table)
    forward_to = [(s, s + 1) for s in range(stages - 1)]
    backward_to = [(s + 1, s) for s in range(stages - 1)]

    def zeros(sizes: dict[str, int]) -> dict:
        return {key: jnp.zeros((n,), jnp.dtype(key)) for key, n in sizes.items()}

    # What a forward adds to (the loss): accumulated apart, small; a backward adds to the rest (the gradients).
    forward_positions = sorted({q for p in programs for q in p.forward_outputs})

    def no_outputs() -> Any:
        return [jnp.zeros(a.shape, a.dtype) for a in out_avals] if layout is None else layout.zeros()

    def forward(p: StagePrograms) -> Callable:
        def branch(params: Any, batch: list, got: dict) -> tuple:
            inputs = [*params_of(p.stage, params), *batch]
            got_values = received.unpack(p.stage, got)
            out, new, outputs = p.forward(inputs, got_values)
            sent = _pad(sent_pack.pack(p.stage, out), messages)
            stashed = residuals.pack(p.stage, got_values if recompute else new)
            return sent, stashed, [outputs[q] for q in forward_positions]

        return branch

    def backward(p: StagePrograms) -> Callable:
        def branch(params: Any, batch: list, got_ct: dict, kept: dict) -> tuple:
            inputs = [*params_of(p.stage, params), *batch]
            kept_values = residuals.unpack(p.stage, kept)
            if recompute:  # the forward again, from the stashed boundary inputs; its outputs were counted then
                _, kept_values, _ = p.forward(inputs, kept_values)
            out, outputs = p.backward(inputs, kept_values, received_ct.unpack(p.stage, got_ct))
            sent = _pad(sent_ct_pack.pack(p.stage, out), messages_ct)
            return sent, outputs if layout is None else layout.split(p.stage, outputs)

        return branch

    forward_branches = [forward(p) for p in programs]
    backward_branches = [backward(p) for p in programs]

    def add_forward(stage: int, total: Any, added: list) -> Any:
        """``total`` (laid out) plus the forward's outputs ``added`` (at ``forward_positions``) of ``stage``."""
        avals = [programs[stage].sliced.get(q, a) for q, a in enumerate(out_avals)]  # a slice: its own aval
        outputs = [jnp.zeros(a.shape, a.dtype) for a in avals]
        for q, value in zip(forward_positions, added, strict=True):
            outputs[q] = value
        return jax.tree.map(jnp.add, total, outputs if layout is None else layout.split(stage, outputs))

    # Each stage's row, and its neighbours' (what arrives after the tick), as constants of the program: the
    # micro-batch whose forward (backward) a stage runs in a tick, -1 where none.
    forward_micro = np.asarray(table.forward_micro, np.int32)
    backward_micro = np.asarray(table.backward_micro, np.int32)
    none_column = np.full((table.num_ticks, 1), -1, np.int32)
    previous_forward = np.concatenate([none_column, forward_micro[:, :-1]], axis=1)  # stage s - 1's
    next_backward = np.concatenate([backward_micro[:, 1:], none_column], axis=1)  # stage s + 1's

    # On a tick where no stage sends in a direction (GPipe's forward half sends no cotangent), that ppermute
    # is skipped: the same on every stage (a function of the tick), so every stage skips it alike.
    forward_sends = (forward_micro[:, :-1] >= 0).any(axis=1)
    fused = bool(((forward_micro >= 0) & (backward_micro >= 0)).any())
    backward_sends = (backward_micro[:, 1:] >= 0).any(axis=1)

    def shifted(flags: np.ndarray, t: jax.Array, values: dict, pairs: list) -> dict:
        def send(values: dict) -> dict:
            return {key: lax.ppermute(x, STAGE_AXIS, pairs) for key, x in values.items()}

        if flags.all():
            return send(values)
        return lax.cond(jnp.asarray(flags)[t], send, lambda values: values, values)

    def loop(params: Any, batch: list) -> list:
        s = lax.axis_index(STAGE_AXIS)
        params = params if prepare is None else prepare(params, s)

        def tick(t: jax.Array, carry: tuple) -> tuple:
            inbox, inbox_ct, stash, total, forward_total = carry
            k_forward, k_backward = jnp.asarray(forward_micro)[t, s], jnp.asarray(backward_micro)[t, s]
            # Sliced here, not in the loops below: a loop that read the whole batch would carry it. A table without
            # fused cells runs one phase per tick: one slice serves both (a second is a micro-batch more memory).
            if fused:
                forward_batch = [x[jnp.maximum(k_forward, 0)] for x in batch]
                backward_batch = [x[jnp.maximum(k_backward, 0)] for x in batch]
            else:
                forward_batch = backward_batch = [x[jnp.maximum(k_forward, k_backward)] for x in batch]

            # A stage's forward, then its backward (both, in a fused schedule's tick: the backward may read the
            # forward's stash slot), each in a loop of 0 or 1 trips rather than a conditional: a
            # loop updates what it carries in place (the stash, the gradients), where a conditional's outputs
            # are new buffers copied into the carry on every tick, and an idle or forward tick would write
            # zeros. Each loop reads the rings it carries: a ring sliced before the loop would be sunk into it
            # and copied on every tick.
            def forward_once(c: tuple) -> tuple:
                _, inbox, stash, forward_total, _ = c
                k = k_forward
                got = {key: b[k % slots["inbox"]] for key, b in inbox.items()}
                sent, stashed, added = lax.switch(s, forward_branches, params, forward_batch, got)
                stash = {key: b.at[k % slots["stash"]].set(stashed[key]) for key, b in stash.items()}
                return jnp.zeros((), bool), inbox, stash, jax.tree.map(jnp.add, forward_total, added), sent

            _, inbox, stash, forward_total, out = lax.while_loop(
                lambda c: c[0], forward_once, (k_forward >= 0, inbox, stash, forward_total, zeros(messages))
            )

            # The forward's message goes through this loop too, so its send waits for it: sent before, it would
            # meet the neighbour's send before that stage's work (the neighbour runs a backward when this stage
            # runs a forward) and serialize the two. The barrier keeps XLA from hoisting the unchanged message
            # out of the loop (a fused tick's backward keeps its forward's message).
            def backward_once(c: tuple) -> tuple:
                _, total, _, inbox_ct, stash, out = c
                k = k_backward
                got_ct = {key: b[k % slots["inbox_ct"]] for key, b in inbox_ct.items()}
                kept = {key: b[k % slots["stash"]] for key, b in stash.items()}
                sent, added = lax.switch(s, backward_branches, params, backward_batch, got_ct, kept)
                out = lax.optimization_barrier(out)
                return jnp.zeros((), bool), jax.tree.map(jnp.add, total, added), sent, inbox_ct, stash, out

            _, total, out_ct, inbox_ct, stash, out = lax.while_loop(
                lambda c: c[0], backward_once, (k_backward >= 0, total, zeros(messages_ct), inbox_ct, stash, out)
            )
            arrived = shifted(forward_sends, t, out, forward_to)
            arrived_ct = shifted(backward_sends, t, out_ct, backward_to)
            previous = jnp.asarray(previous_forward)[t, s]
            slot = jnp.maximum(previous, 0) % slots["inbox"]
            inbox = {key: _put(b, arrived[key][: b.shape[1]], slot, previous >= 0) for key, b in inbox.items()}
            following = jnp.asarray(next_backward)[t, s]
            from_next, slot_ct = following >= 0, jnp.maximum(following, 0) % slots["inbox_ct"]
            inbox_ct = {key: _put(b, arrived_ct[key][: b.shape[1]], slot_ct, from_next) for key, b in inbox_ct.items()}
            return inbox, inbox_ct, stash, total, forward_total

        carry = (
            {key: jnp.zeros((slots["inbox"], n), jnp.dtype(key)) for key, n in messages.items()},
            {key: jnp.zeros((slots["inbox_ct"], n), jnp.dtype(key)) for key, n in messages_ct.items()},
            residuals.zeros((slots["stash"],)),
            no_outputs(),
            [jnp.zeros(out_avals[q].shape, out_avals[q].dtype) for q in forward_positions],
        )
        *_, total, forward_total = lax.fori_loop(0, table.num_ticks, tick, carry)
        adders = [functools.partial(add_forward, stage) for stage in range(stages)]
        total = lax.switch(s, adders, total, forward_total)
        if layout is None:
            return [lax.psum(t, STAGE_AXIS) / m for t in total]
        own, shared = total
        return jax.tree.map(lambda v: v / m, own), [lax.psum(t, STAGE_AXIS) / m for t in shared]

    return loop


def _shapes(leaves: list) -> list:
    """Each leaf's shape and dtype, without its placement."""
    return [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves]


def _put(buffer: jax.Array, value: jax.Array, slot: jax.Array, where: jax.Array) -> jax.Array:
    """``buffer[slot] = value`` where ``where``."""
    return buffer.at[slot].set(jnp.where(where, value, buffer[slot]))


def _pad(packed: dict, sizes: dict[str, int]) -> dict:
    """``packed`` (one stage's buffers) padded to ``sizes`` (every stage's), so all branches agree on types."""
    out = {}
    for key, n in sizes.items():
        flat = packed.get(key, jnp.zeros((0,), jnp.dtype(key)))
        out[key] = jnp.pad(flat, (0, n - flat.shape[0]))
    return out


def _union_sizes(a: Packing, b: Packing) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for packing in (a, b):
        for dtype, n in packing.sizes.items():
            sizes[str(dtype)] = max(sizes.get(str(dtype), 0), n)
    return dict(sorted(sizes.items()))
