"""One workload's step compiled six ways: GSPMD replicated, GSPMD FSDP, and Replicator at ZeRO stages 0-3.

* ``gspmd-replicated``: ``jax.jit`` of the one-device step, state replicated
  (``NamedSharding(mesh, P())``), batch sharded over the devices (``P('d')``);
* ``gspmd-fsdp``: the same with every state leaf that has an axis dividing by
  N sharded along its largest such axis (the first of equals): the
  hand-written fully sharded program (for a ``(3, 3, C, F)`` conv kernel,
  ``C`` or ``F``; for a ``(L, D, 4D)`` stack of layers, ``4D``);
* ``zero0`` .. ``zero3``: ``rp.Replicator(1, N)`` with ``PassManager.default(zero=k)``.

Memory per device is XLA's compiled memory analysis of each program (arguments
+ outputs - aliased + temporaries; neither GSPMD nor Replicator donates the
state here, so both count the old and the new state); state per device is the
bytes of the state leaves one device stores between steps. Compiling needs only
shapes: ``memory`` takes ``jax.ShapeDtypeStruct`` state. JAX must be set up by
the caller.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from zero_workloads import Workload

import replicator as rp
from replicator.cost.memory import state_bytes_per_device
from replicator.runtime.memory import MemoryUsage

PyTree = Any

__all__ = ["VARIANTS", "Program", "compile_variant", "fsdp_spec"]

VARIANTS = ("gspmd-replicated", "gspmd-fsdp", "zero0", "zero1", "zero2", "zero3")


@dataclasses.dataclass
class Program:
    """A compiled variant: its memory per device, and how to place a state and run a step on it."""

    memory: MemoryUsage  # bytes per device, XLA's compiled memory analysis
    stored: int  # state bytes per device between steps
    place: Callable[[PyTree], PyTree]  # the initial state, as this variant keeps it
    run: Callable[[PyTree], tuple[PyTree, jax.Array]]  # state -> (state, loss), on the workload's batches in turn

    @property
    def peak(self) -> int:
        return self.memory.peak


def fsdp_spec(shape: tuple[int, ...], n: int) -> P:
    """``P`` sharding the largest axis of ``shape`` that divides by ``n`` (the first of equals), or ``P()``."""
    axes = [a for a, size in enumerate(shape) if size % n == 0]
    if not axes:
        return P()
    axis = max(axes, key=lambda a: (shape[a], -a))
    return P(*([None] * axis), "d")


def _abstract(tree: PyTree, shardings: PyTree | None = None) -> PyTree:
    if shardings is None:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=s), tree, shardings)


def _gspmd(workload: Workload, *, fsdp: bool) -> Program:
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    specs = jax.tree.map(lambda a: fsdp_spec(np.shape(a), n) if fsdp else P(), workload.state)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    batch_sharding = NamedSharding(mesh, P("d"))
    fn = jax.jit(
        lambda s, b: workload.step(s, b, False),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, None),
    )
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=batch_sharding), workload.batches[0])
    analysis = fn.lower(_abstract(workload.state, shardings), batch).compile().memory_analysis()
    memory = MemoryUsage(
        int(analysis.argument_size_in_bytes),
        int(analysis.output_size_in_bytes),
        int(analysis.alias_size_in_bytes),
        int(analysis.temp_size_in_bytes),
    )
    stored = sum(
        math.prod(s.shard_shape(np.shape(a))) * a.dtype.itemsize
        for a, s in zip(jax.tree.leaves(workload.state), jax.tree.leaves(shardings), strict=True)
    )
    batches = itertools.cycle(workload.batches)
    return Program(
        memory,
        int(stored),
        lambda state: jax.device_put(state, shardings),
        lambda state: fn(state, jax.device_put(next(batches), batch_sharding)),
    )


def _zero(workload: Workload, *, stage: int) -> Program:
    repl = rp.Replicator(1, jax.device_count(), axis_name=workload.axis_name, passes=rp.PassManager.default(zero=stage))

    def step_fn(s, b):
        s, loss = workload.step(s, b, True)
        return s, {"loss": loss}

    lowered = repl.lower(step_fn, workload.batches[0], _abstract(workload.state))

    def input_fn(ctx):
        return itertools.cycle(workload.batches)

    def run(state):
        state, out = repl.run(step_fn, input_fn, state)
        return state, out["loss"]

    return Program(lowered.memory(), state_bytes_per_device(lowered.final), lambda state: state, run)


def compile_variant(name: str, workload: Workload) -> Program:
    """``name`` (one of :data:`VARIANTS`) compiled for ``workload`` on all of JAX's devices."""
    if name.startswith("gspmd-"):
        return _gspmd(workload, fsdp=name == "gspmd-fsdp")
    if name.startswith("zero") and name[4:].isdigit():
        return _zero(workload, stage=int(name[4:]))
    raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
