"""A GPipe prototype: a marked loss's value and gradient over S stages on S devices, M micro-batches.

The numbers check of the split and the stage programs before the schedules
and the ``Replicator`` option exist (docs/design/pipeline-parallelism.md): one
SPMD program under ``jit(shard_map)`` over a ``('stages',)`` mesh. Each of the
``M + S - 1`` forward ticks, every device runs its stage's forward
(``lax.switch`` on ``axis_index('stages')``) on micro-batch ``t - s``, stashes
the residuals and shifts what it sends to the next stage with ``ppermute``;
the ``M + S - 1`` backward ticks run the other way. Heterogeneous stages pass
values of different shapes: every boundary travels as one flat buffer per
dtype, padded to the largest. Parameters are replicated on every device here
(placing them per stage comes with the option).

>>> def loss(p, x):
...     h = rp.stage_boundary(jnp.tanh(x @ p["a"]))
...     return jnp.mean((h @ p["b"]) ** 2)
>>> p = {"a": jnp.full((3, 4), 0.1), "b": jnp.full((4, 2), 0.2)}
>>> x = jnp.linspace(-1, 1, 24).reshape(8, 3)
>>> value, grads = gpipe_value_and_grad(loss, num_microbatches=4, devices=jax.devices()[:2])(p, x)
>>> want_value, want = jax.value_and_grad(loss)(p, x)
>>> bool(jnp.allclose(value, want_value, rtol=1e-5)), bool(jnp.allclose(grads["a"], want["a"], rtol=1e-5))
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from replicator.stages.programs import StagePrograms, stage_programs
from replicator.stages.split import StageSplitError, split_stages

__all__ = ["STAGE_AXIS", "gpipe_value_and_grad"]

STAGE_AXIS = "stages"


class _Packing:
    """Lists of arrays of different avals, one per stage, as one flat buffer per dtype (padded to the largest)."""

    def __init__(self, layouts: Sequence[Sequence[Any]]):
        self.layouts = [list(layout) for layout in layouts]
        sizes: dict[Any, int] = {}
        for layout in self.layouts:
            per: dict[Any, int] = {}
            for aval in layout:
                per[aval.dtype] = per.get(aval.dtype, 0) + int(np.prod(aval.shape, dtype=np.int64))
            for dtype, n in per.items():
                sizes[dtype] = max(sizes.get(dtype, 0), n)
        self.sizes = dict(sorted(sizes.items(), key=lambda kv: str(kv[0])))

    def zeros(self, lead: tuple[int, ...] = ()) -> dict:
        return {str(d): jnp.zeros((*lead, n), d) for d, n in self.sizes.items()}

    def pack(self, stage: int, values: Sequence[Any]) -> dict:
        parts: dict[Any, list] = {d: [] for d in self.sizes}
        for aval, value in zip(self.layouts[stage], values, strict=True):
            parts[aval.dtype].append(jnp.ravel(value).astype(aval.dtype))
        out = {}
        for dtype, n in self.sizes.items():
            flat = jnp.concatenate(parts[dtype]) if parts[dtype] else jnp.zeros((0,), dtype)
            out[str(dtype)] = jnp.pad(flat, (0, n - flat.shape[0]))
        return out

    def unpack(self, stage: int, buffers: dict) -> list:
        offsets = dict.fromkeys(self.sizes, 0)
        values = []
        for aval in self.layouts[stage]:
            n = int(np.prod(aval.shape, dtype=np.int64))
            start = offsets[aval.dtype]
            values.append(buffers[str(aval.dtype)][start : start + n].reshape(aval.shape))
            offsets[aval.dtype] = start + n
        return values


def gpipe_value_and_grad(
    loss: Callable, *, num_microbatches: int, devices: Sequence[Any] | None = None
) -> Callable[..., tuple[Any, Any]]:
    """``jax.value_and_grad(loss)`` over the stages that ``loss``'s ``rp.stage_boundary`` markers cut, GPipe.

    Args:
      loss: ``loss(params, *batch) -> scalar``, marked with ``rp.stage_boundary``; a mean over its batch.
      num_microbatches: ``M``; the batch leaves' leading axis must be divisible by it.
      devices: one device per stage (default: the first ``S`` devices).

    Returns:
      ``f(params, *batch) -> (value, grads)``: the mean over the ``M`` micro-batches of each one's
      value and gradient (for a loss that is a mean over rows, the value and gradient on the whole batch).
    """
    m = num_microbatches

    def run(params: Any, *batch: Any) -> tuple[Any, Any]:
        leaves = jax.tree.leaves(batch)
        for leaf in leaves:
            if np.shape(leaf)[0] % m:
                raise ValueError(
                    f"gpipe_value_and_grad: a batch leaf of shape {np.shape(leaf)} does not split into "
                    f"num_microbatches={m} equal micro-batches; make the batch a multiple of {m}."
                )
        micro = [jnp.reshape(leaf, (m, leaf.shape[0] // m, *leaf.shape[1:])) for leaf in map(jnp.asarray, leaves)]
        batch_def = jax.tree.structure(batch)
        param_leaves, param_def = jax.tree.flatten(params)

        def one(param_leaves: list, batch_leaves: list) -> Any:
            return jax.value_and_grad(loss)(param_def.unflatten(param_leaves), *batch_def.unflatten(batch_leaves))

        closed = jax.make_jaxpr(one)(param_leaves, [x[0] for x in micro])
        split = split_stages(closed, first_batch=len(param_leaves))
        stages = split.num_stages
        mesh_devices = list(devices) if devices is not None else jax.devices()[:stages]
        if len(mesh_devices) != stages:
            raise StageSplitError(f"the loss has {stages} stages; pass {stages} devices (got {len(mesh_devices)}).")
        programs = stage_programs(split, closed)
        mesh = Mesh(np.array(mesh_devices), (STAGE_AXIS,))
        outs = _schedule(programs, stages, m, mesh, closed.out_avals)(param_leaves, micro)
        return outs[0], param_def.unflatten(outs[1:])

    return run


def _schedule(programs: list[StagePrograms], stages: int, m: int, mesh: Mesh, out_avals: Sequence[Any]) -> Callable:
    sent = _Packing([p.sent for p in programs])
    received = _Packing([p.received for p in programs])
    sent_ct = _Packing([p.sent_ct for p in programs])
    received_ct = _Packing([p.received_ct for p in programs])
    residuals = _Packing([p.residuals for p in programs])
    forward_to = [(s, s + 1) for s in range(stages - 1)]
    backward_to = [(s + 1, s) for s in range(stages - 1)]

    def fwd_branch(p: StagePrograms) -> Callable:
        def branch(inputs: list, got: dict) -> tuple:
            out, kept, outputs = p.forward(inputs, received.unpack(p.stage, got))
            return _as_buffers(sent, p.stage, out, received), residuals.pack(p.stage, kept), outputs

        return branch

    def bwd_branch(p: StagePrograms) -> Callable:
        def branch(inputs: list, kept: dict, got: dict) -> tuple:
            out, outputs = p.backward(inputs, residuals.unpack(p.stage, kept), received_ct.unpack(p.stage, got))
            return _as_buffers(sent_ct, p.stage, out, received_ct), outputs

        return branch

    fwd = [fwd_branch(p) for p in programs]
    bwd = [bwd_branch(p) for p in programs]

    def per_device(param_leaves: list, micro: list) -> list:
        s = lax.axis_index(STAGE_AXIS)
        ticks = m + stages - 1

        def forward_tick(tick: jax.Array, carry: tuple) -> tuple:
            got, stash, total = carry
            k = tick - s  # stage s runs micro-batch t - s
            active, k = (k >= 0) & (k < m), jnp.clip(k, 0, m - 1)
            out, kept, outputs = lax.switch(s, fwd, [*param_leaves, *(x[k] for x in micro)], got)
            stash = {key: _stash(stash[key], kept[key], k, active) for key in stash}
            total = [t + jnp.where(active, o, jnp.zeros_like(o)) for t, o in zip(total, outputs, strict=True)]
            return {key: lax.ppermute(x, STAGE_AXIS, forward_to) for key, x in out.items()}, stash, total

        def backward_tick(tick: jax.Array, carry: tuple) -> tuple:
            got, stash, total = carry
            k = tick - (stages - 1 - s)  # the last stage goes first
            active, k = (k >= 0) & (k < m), jnp.clip(k, 0, m - 1)
            kept = {key: buffer[k] for key, buffer in stash.items()}
            out, outputs = lax.switch(s, bwd, [*param_leaves, *(x[k] for x in micro)], kept, got)
            total = [t + jnp.where(active, o, jnp.zeros_like(o)) for t, o in zip(total, outputs, strict=True)]
            return {key: lax.ppermute(x, STAGE_AXIS, backward_to) for key, x in out.items()}, stash, total

        stash = {key: jnp.zeros((m, *z.shape), z.dtype) for key, z in residuals.zeros().items()}
        total = [jnp.zeros(a.shape, a.dtype) for a in out_avals]
        _, stash, total = lax.fori_loop(0, ticks, forward_tick, (_zeros_like_buffers(sent, received), stash, total))
        _, _, total = lax.fori_loop(0, ticks, backward_tick, (_zeros_like_buffers(sent_ct, received_ct), stash, total))
        return [lax.psum(t, STAGE_AXIS) / m for t in total]

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    return jax.jit(mapped)


def _stash(buffer: jax.Array, value: jax.Array, k: jax.Array, active: jax.Array) -> jax.Array:
    """``buffer[k] = value`` where this tick is active."""
    return buffer.at[k].set(jnp.where(active, value, buffer[k]))


def _as_buffers(sending: _Packing, stage: int, values: list, receiving: _Packing) -> dict:
    """What ``stage`` sends, packed in buffers shaped like every stage's received buffers (one type for all)."""
    packed = sending.pack(stage, values)
    out = {}
    for key, n in _union_sizes(sending, receiving).items():
        flat = packed.get(key, jnp.zeros((0,), jnp.dtype(key)))
        out[key] = jnp.pad(flat, (0, n - flat.shape[0]))
    return out


def _union_sizes(a: _Packing, b: _Packing) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for packing in (a, b):
        for dtype, n in packing.sizes.items():
            sizes[str(dtype)] = max(sizes.get(str(dtype), 0), n)
    return dict(sorted(sizes.items()))


def _zeros_like_buffers(sending: _Packing, receiving: _Packing) -> dict:
    return {key: jnp.zeros((n,), jnp.dtype(key)) for key, n in _union_sizes(sending, receiving).items()}
