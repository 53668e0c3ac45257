"""Data-parallel replicas of a pipeline: the ``('stages', 'workers', 'cores')`` mesh, the ``Replicator`` option
and the description of a pipelined step (schedule, bubble, per-stage compute and memory).

``S`` stages x ``D`` data-parallel replicas on ``S * D`` devices. The mesh's axes are ``'stages'`` then the
data axes ``('workers', 'cores')`` (a tensor-parallel axis would come innermost, later). The data axes keep
their meaning: replica ``r`` of the pipeline takes the ``r``-th contiguous ``1/D`` of the batch's rows, runs
the schedule on its ``M`` micro-batches, and the gradients and the loss are then averaged over the data axes,
which is what ``rp.all_mean(grads)`` in a data-parallel step does (``group=None``: every replica). A stage's
devices are the ``D`` replicas of that stage; the compiler's own collectives (``ppermute`` of boundary values,
``psum`` of a tied leaf's gradient) are over ``'stages'`` only.

With ``replicas_per_device=k`` (:class:`~replicator.core.layout.FoldLayout`) the grid is the *device* grid:
each device of a stage hosts ``k`` consecutive data-parallel replicas, run vmapped over the fold axes
(``D = k x`` the stage's devices; replica ``r`` still takes the ``r``-th ``1/D`` of the rows, so a device
takes a contiguous ``k/D``); their loss and gradients are averaged over the fold before the data axes, and a
user's collective spans every logical replica (:func:`~replicator.stages.programs.folded`).

Where stages sit (:func:`pipeline_mesh`): from a ``Replicator``'s ``(workers, cores)`` device grid, *within a
worker* when ``S`` divides ``cores_per_worker`` (activations cross stages inside a host; ``C' = C / S``), else
*across workers* when ``S`` divides ``num_workers`` (``W' = W / S``).

>>> grid = np.array(jax.devices()[:8]).reshape(1, 8)
>>> mesh = pipeline_mesh(grid, stages=2)
>>> dict(mesh.shape), [d.id for d in mesh.devices[1].flat]
({'stages': 2, 'workers': 1, 'cores': 4}, [4, 5, 6, 7])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import JaxprEqn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator.core.graph import TensorLayout
from replicator.stages.data_replicas import check_fold_axes, check_zero_stage, takes_zero_stage
from replicator.stages.lower import STAGE_AXIS, ring_slots
from replicator.stages.programs import DATA_AXES
from replicator.stages.schedule import SCHEDULES as schedule_tables
from replicator.stages.schedule import schedule_stats, table_span
from replicator.stages.split import BACKWARD, FORWARD
from replicator.stages.stash import stash_plan
from replicator.stages.train import PipelineTrainStep
from replicator.stages.user_step import PipelinedStep

__all__ = [
    "DeviceMemory",
    "PipelineReport",
    "PipelinedReplicas",
    "StageReport",
    "compiled_memory",
    "describe",
    "pipeline_mesh",
]

SCHEDULES = tuple(schedule_tables)


def pipeline_mesh(grid: np.ndarray, stages: int, replicas_per_device: int = 1) -> Mesh:
    """The ``('stages', 'workers', 'cores')`` mesh of ``stages`` stages over ``grid``, a ``(workers, cores)``
    array of devices (a ``Replicator``'s ``mesh.devices``); see the module docstring for the layout.
    ``replicas_per_device``: the replicas each device hosts (only for the error's words)."""
    grid = np.asarray(grid)
    if grid.ndim not in (2, 3):
        raise ValueError(
            "pipeline_mesh: grid must be a (workers, cores) array of devices, or (workers, cores, tensor), "
            f"got shape {grid.shape}."
        )
    tensor = grid.shape[2:]  # the tensor axis, innermost, goes along with each (worker, core) group
    w, c = grid.shape[:2]
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"Parallelism(stages=...) must be a positive int, got {stages!r}.")
    if c % stages == 0:  # within a worker: the cores of each worker split into S groups
        devices = grid.reshape(w, stages, c // stages, *tensor).transpose(1, 0, 2, *range(3, 3 + len(tensor)))
    elif w % stages == 0:  # across workers: consecutive workers form a stage
        devices = grid.reshape(stages, w // stages, c, *tensor)
    elif replicas_per_device > 1:
        raise ValueError(
            f"Parallelism(stages={stages}) does not cut the {w} x {c} device grid (replicas_per_device="
            f"{replicas_per_device} folds the replicas onto {w * c} devices; stages cut devices, not replicas): "
            f"it divides neither its {c} devices per worker nor its {w} worker rows; pick a number of stages that "
            "divides one of them, or a smaller Parallelism(replicas_per_device=...)."
        )
    else:
        raise ValueError(
            f"Parallelism(stages={stages}) divides neither cores_per_worker={c} (stages within a worker) nor "
            f"num_workers={w} (stages across workers), so the {w} x {c} devices do not form {stages} stages of "
            "data-parallel replicas; pick a number of stages that divides one of them."
        )
    return Mesh(devices, (STAGE_AXIS, *DATA_AXES, *(["tensor"] if tensor else [])))


@dataclasses.dataclass(frozen=True)
class StageReport:
    """One stage of a pipelined step, per device of that stage.

    Attributes:
      stage: its index.
      parameters: the leaves it keeps (their paths).
      parameter_bytes: their bytes (a tied leaf counted on each stage that keeps it); the device holds the
        packed row, padded to the largest stage's (:attr:`PipelineReport.row_bytes`).
      forward_s, backward_s: the cost model's seconds of one micro-batch's forward, and backward, on this
        stage (``None`` without a cost model); the step runs ``M`` of each.
      residual_bytes: what one micro-batch's forward keeps for its backward (the stash, per micro-batch):
        its activations (:attr:`stash_activation_bytes`) and ``stash_other_bytes``.
      peak_live: the most micro-batches whose residuals are alive at once under the schedule.
      stash_other_bytes: of ``residual_bytes``, what does not depend on the micro-batch and is stashed all the
        same (:attr:`~replicator.stages.stash.Stash.other`: a value of the parameters through a collective).
      recomputed_bytes: what the backward reads of the parameters alone (a slice of a stacked scan's weights)
        and computes again from them rather than stash per micro-batch: not stored.
    """

    stage: int
    parameters: tuple[str, ...]
    parameter_bytes: int
    forward_s: float | None
    backward_s: float | None
    residual_bytes: int
    peak_live: int
    stash_other_bytes: int = 0
    recomputed_bytes: int = 0

    @property
    def stash_activation_bytes(self) -> int:
        """Of the per-micro-batch stash, the activations: values that depend on the micro-batch."""
        return self.residual_bytes - self.stash_other_bytes

    @property
    def compute_s(self) -> float | None:
        """One micro-batch's forward and backward."""
        return None if self.forward_s is None or self.backward_s is None else self.forward_s + self.backward_s

    @property
    def activation_bytes(self) -> int:
        """Residual memory at the schedule's peak (stash slots actually alive)."""
        return self.residual_bytes * self.peak_live


@dataclasses.dataclass(frozen=True)
class PipelineReport:
    """What a pipelined step will run: printed by ``Replicator.describe_pipeline``.

    Attributes:
      schedule: the tick table (``str()`` draws it); stages: ``S``; microbatches: ``M``; replicas: ``D``.
      ticks: the table's ticks; bubble: its idle share (``(S-1)/(M+S-1)`` for every built table;
        :func:`~replicator.stages.schedule.schedule_stats`).
      row_bytes: per device, the packed parameters (the largest stage's row; its ``1/D`` under ZeRO-3);
        optimizer_bytes: per device, the optimizer state (its parameter-shaped parts packed the same way, their
        ``1/D`` under ZeRO, scalars whole), or ``None`` where the row holds the whole state (the user's own
        step: parameters and optimizer state alike).
      stash_slots: the residual ring's slots (``M`` for GPipe, ``S`` for 1F1B).
      per_stage: one :class:`StageReport` per stage.
      device_memory: XLA's memory analysis of the compiled step (:class:`DeviceMemory`), where asked for.
      zero_stage: ZeRO on each stage's data-parallel replicas (0: off), over its devices.
      replicas_per_device: ``k``, the data-parallel replicas each device hosts (``replicas_per_device``):
        ``D / k`` devices per stage.
    """

    schedule: Any
    stages: int
    microbatches: int
    replicas: int
    ticks: int
    bubble: float
    row_bytes: int
    optimizer_bytes: int | None
    stash_slots: int
    per_stage: tuple[StageReport, ...]
    device_memory: DeviceMemory | None = None
    zero_stage: int = 0
    replicas_per_device: int = 1
    #: With a tensor axis: how the step is split over it (the collectives it inserts per micro-batch).
    tensor: TensorLayout | None = None
    #: Lines that describe those collectives (filled by ``Replicator.explain``).
    tensor_lines: tuple[str, ...] = ()

    def __str__(self) -> str:
        s, m, d, k = self.stages, self.microbatches, self.replicas, self.replicas_per_device
        devices = d // k  # per stage
        lines = [
            f"pipeline: {s} stages x {d} data-parallel replicas"
            + (f" ({k} per device)" if k > 1 else "")
            + f" on {s * devices} devices, {m} micro-batches, schedule {self.schedule.name}"
            + (
                f", ZeRO-{self.zero_stage} over each stage's {devices} " + ("devices" if k > 1 else "replicas")
                if self.zero_stage
                else ""
            ),
            f"  {self.ticks} ticks, bubble {self.bubble:.3f} (= (S-1)/(M+S-1) = {s - 1}/{m + s - 1})",
            f"  per device: parameters {_bytes(self.row_bytes)} "
            f"({f'1/{devices} of the packed row' if self.zero_stage >= 3 else 'packed row'}), optimizer state "
            f"{_bytes(self.optimizer_bytes)}, residual ring of {self.stash_slots} slots"
            if self.optimizer_bytes is not None
            else f"  per device: state {_bytes(self.row_bytes)} (packed row: parameters and optimizer state"
            f"{f'; with ZeRO-{self.zero_stage}, 1/{devices} of each chunked leaf' if self.zero_stage else ''}), "
            f"residual ring of {self.stash_slots} slots",
            "  stage  compute/micro-batch  parameters  stash/micro-batch: activations  other  peak live  "
            "stash at peak  leaves",
        ]
        for r in self.per_stage:
            compute = "-" if r.compute_s is None else f"{r.compute_s * 1e6:.1f} us"
            leaves = ", ".join(r.parameters) if len(r.parameters) <= 4 else f"{len(r.parameters)} leaves"
            lines.append(
                f"  {r.stage:5d}  {compute:>19}  {_bytes(r.parameter_bytes):>10}  "
                f"{_bytes(r.stash_activation_bytes):>30}  {_bytes(r.stash_other_bytes):>5}  "
                f"{r.peak_live:9d}  {_bytes(r.activation_bytes):>13}  {leaves}"
            )
        recomputed = [r for r in self.per_stage if r.recomputed_bytes]
        if recomputed:
            lines.append(
                "  not stashed, read again from the parameters in each backward (a stacked scan's slice of weights): "
                + ", ".join(f"stage {r.stage} {_bytes(r.recomputed_bytes)}" for r in recomputed)
            )
        computes = [r.compute_s for r in self.per_stage]
        if all(c is not None for c in computes) and max(computes) > 0:  # type: ignore[type-var]
            lines.append(
                f"  cost model: the step about {self.span_s() * 1e3:.3f} ms ({self.ticks} ticks, each as long as its "
                f"slowest stage's work); the lightest stage does "
                f"{min(computes) / max(computes):.2f} of the heaviest's work"  # type: ignore[type-var,operator]
            )
        if self.device_memory is not None:
            mem = self.device_memory
            lines.append(
                f"  compiled, per device (XLA's memory analysis): total {_bytes(mem.total)} = arguments "
                f"{_bytes(mem.arguments)} + outputs {_bytes(mem.outputs)} + temporaries {_bytes(mem.temporaries)}"
                + (f" - aliased {_bytes(mem.aliased)}" if mem.aliased else "")
                + " (every buffer as if alive at once: an upper bound, not XLA's peak)"
            )
        lines.extend(self.tensor_lines)
        lines.append("schedule (F: forward, B: backward of micro-batch m):")
        lines.append(str(self.schedule))
        return "\n".join(lines)

    def span_s(self) -> float:
        """The cost model's step: each tick of the table as long as its slowest stage's forward and backward
        there (the stages' devices wait for each other at every tick's exchange)."""
        return table_span(self.schedule, [r.forward_s for r in self.per_stage], [r.backward_s for r in self.per_stage])


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * jnp.dtype(aval.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """XLA's memory analysis of the compiled step, per device (bytes): what the step's arguments, its outputs
    and its temporaries (activations, residual rings, the optimizer's scratch) take, and the output bytes that
    reuse an argument's buffer (donation). ``total`` is their sum less the aliased bytes: every buffer the
    program owns, counted as if all were alive at once, an upper bound on what it holds at any moment, not
    XLA's own peak (which it does not report)."""

    arguments: int
    outputs: int
    temporaries: int
    aliased: int

    @property
    def total(self) -> int:
        """Arguments + outputs + temporaries - aliased."""
        return self.arguments + self.outputs + self.temporaries - self.aliased

    @property
    def peak(self) -> int:
        """The former name of :attr:`total` (kept working): not XLA's peak, the sum of its buffers."""
        return self.total


def compiled_memory(jitted: Any, *args: Any) -> DeviceMemory:
    """Compile ``jitted`` for ``args`` (``jax.ShapeDtypeStruct`` with their shardings) and read XLA's memory
    analysis of one device's program."""
    stats = jitted.lower(*args).compile().memory_analysis()
    return DeviceMemory(
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes),
    )


def _placed(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """Shapes of ``tree`` (arrays or shapes) as ``jax.ShapeDtypeStruct`` placed on ``mesh`` by ``specs``."""
    return jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=NamedSharding(mesh, spec)), tree, specs
    )


def _stage_reports(
    split: Any,
    programs: Sequence[Any],
    layout: Sequence[Sequence[int]],
    aval_of: Callable[[int, int], Any],
    paths: Sequence[str],
    peak_live: Sequence[int],
    stage_cost: Callable[[Sequence[JaxprEqn]], float] | None,
) -> tuple[StageReport, ...]:
    """Per stage: the leaves it keeps, the cost model's forward and backward of one micro-batch, its residuals.
    ``aval_of(leaf, stage)``: the leaf as that stage keeps it (whole, or its slice of a partitioned leaf)."""
    reports = []
    stash = [stash_plan(split, s) for s in range(len(layout))]
    for s in range(len(layout)):
        phase = {
            p: [split.jaxpr.eqns[i] for i in split.eqns_of(s) if split.phases[i] == p] for p in (FORWARD, BACKWARD)
        }
        reports.append(
            StageReport(
                stage=s,
                parameters=tuple(paths[i] for i in layout[s]),
                parameter_bytes=sum(_nbytes(aval_of(i, s)) for i in layout[s]),
                forward_s=None if stage_cost is None else float(stage_cost(phase[FORWARD])),
                backward_s=None if stage_cost is None else float(stage_cost(phase[BACKWARD])),
                residual_bytes=sum(_nbytes(a) for a in programs[s].residuals),
                peak_live=int(peak_live[s]),
                stash_other_bytes=sum(_nbytes(v.aval) for v in stash[s].other),
                recomputed_bytes=sum(_nbytes(v.aval) for v in stash[s].recomputed),
            )
        )
    return tuple(reports)


def describe(
    step: PipelineTrainStep,
    params: Any,
    *batch: Any,
    stage_cost: Callable[[Sequence[JaxprEqn]], float] | None = None,
    memory: bool = False,
) -> PipelineReport:
    """What ``step`` (a loss and an optimizer, :func:`~replicator.stages.train.pipeline_train_step`) runs on these
    shapes, traced and split, not run: :func:`describe_user_step` of the step it builds.

    Args:
      step: a pipelined training step; params, batch: as for the step (arrays).
      stage_cost: seconds for a list of equations (the cost model's, :mod:`replicator.cost.compute`; this layer
        sits below it, so the caller passes it); ``None``: no compute column.
      memory: also compile the step and report XLA's memory analysis per device (:class:`DeviceMemory`).
    """
    return describe_user_step(step.built(params, *batch), batch, stage_cost=stage_cost, memory=memory)


def describe_user_step(
    step: PipelinedStep,
    batch: Any,
    *,
    stage_cost: Callable[[Sequence[JaxprEqn]], float] | None = None,
    memory: bool = False,
) -> PipelineReport:
    """What the user's own step cut over the stages (:class:`PipelinedStep`) runs on ``batch``'s shapes, as
    :func:`describe`: its packed rows hold the whole state, parameters and optimizer state alike."""
    stats = schedule_stats(step.table)
    device_memory = None
    if memory:
        packed = jax.eval_shape(step.zeros)
        micro = jax.eval_shape(step.micro_leaves, batch)
        device_memory = compiled_memory(
            step.step,
            _placed(packed, step.mesh, {k: step.row_spec[k] for k in packed}),
            _placed(micro, step.mesh, [P(DATA_AXES)] * len(micro)),
        )
    return PipelineReport(
        schedule=step.table,
        stages=step.stages,
        microbatches=step.table.num_microbatches,
        replicas=step.replicas,
        ticks=stats.ticks,
        bubble=float(stats.bubble),
        row_bytes=step.nbytes,  # a device's: its stage's whole row, its 1/D of the chunked leaves (ZeRO)
        optimizer_bytes=None,
        stash_slots=ring_slots(step.table)["stash"],
        per_stage=_stage_reports(
            step.split,
            step.programs,
            step.layout,
            lambda i, s: step.slices.kept_aval(i, s, step.avals[i]),  # a stack: the stage's slice of it
            step.paths,
            stats.peak_live,
            stage_cost,
        ),
        device_memory=device_memory,
        zero_stage=step.zero_stage,
        tensor=None if step.tensor_split is None else step.tensor_split.layout(*step.tensor_axis),
        replicas_per_device=step.replicas_per_device,
    )


class PipelinedReplicas:
    """The ``Replicator`` option ``parallelism=rp.Parallelism(stages=S, microbatches=M, schedule=...)``: what
    ``Replicator.run_pipelined`` and ``Replicator.describe_pipeline`` run (one compiled step per loss and
    optimizer, cached). ``zero``: the ZeRO level on each stage's ``D`` data-parallel replicas
    (:func:`~replicator.stages.train.pipeline_train_step`), for ``run_pipelined``, and for the user's own step
    (:meth:`run_step`, :mod:`~replicator.stages.chunks`) with one replica per device. ``fold_axes``: with ``replicas_per_device=k``, ``FoldLayout.folded_axes``
    (``grid`` is then the device grid, each device hosting ``k`` consecutive data-parallel replicas)."""

    @takes_zero_stage
    def __init__(
        self,
        grid: np.ndarray,
        stages: int,
        microbatches: int | None,
        schedule: str,
        recompute: bool = False,
        zero: int = 0,
        fold_axes: Sequence[tuple[str, int]] = (),
        tensor: Any = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
        if microbatches is None:
            microbatches = stages
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {microbatches!r}.")
        fold = int(np.prod([k for _, k in fold_axes], dtype=int))
        self.mesh = pipeline_mesh(grid, stages, replicas_per_device=fold)
        self.stages, self.microbatches, self.schedule = stages, microbatches, schedule
        self._last_step: Any = None  # the step that ran last (a PipelineTrainStep or a PipelinedStep)
        if not isinstance(recompute, bool):
            raise TypeError(f"Parallelism(recompute=...) must be a bool, got {recompute!r}.")
        self.recompute = recompute
        self.zero_stage = check_zero_stage(zero)
        self.fold_axes = check_fold_axes(fold_axes, self.mesh)
        #: The tensor axis (:class:`~replicator.tensor.axis.TensorAxis`, innermost in the mesh), or None.
        self.tensor = tensor
        self.replicas_per_device = int(np.prod([k for _, k in self.fold_axes], dtype=int))
        #: ``D``: the logical data-parallel replicas (``replicas_per_device`` per device of a stage).
        self.replicas = int(np.prod([self.mesh.shape[a] for a in DATA_AXES])) * self.replicas_per_device
        self._steps: dict[tuple[int, int], tuple[Callable, Any, PipelineTrainStep]] = {}
        self._user_steps: dict[Any, tuple[Callable, PipelinedStep]] = {}

    def __repr__(self) -> str:
        return (
            f"PipelinedReplicas(stages={self.stages}, replicas={self.replicas}, "
            + (f"replicas_per_device={self.replicas_per_device}, " if self.replicas_per_device > 1 else "")
            + f"microbatches={self.microbatches}, "
            f"schedule={self.schedule!r}{', recompute=True' if self.recompute else ''}"
            f"{f', zero={self.zero_stage}' if self.zero_stage else ''})"
        )

    @property
    def user_steps_built(self) -> int:
        """How many of the user's steps (a ``step_fn`` and its shapes) have been traced and compiled here."""
        return len(self._user_steps)

    def step_for(self, loss_fn: Callable, optimizer: optax.GradientTransformation) -> PipelineTrainStep:
        """The pipelined training step of ``loss_fn`` with ``optimizer`` on this mesh (built once)."""
        key = (id(loss_fn), id(optimizer))
        if key not in self._steps:  # the functions are kept alive with their step, so ids stay theirs
            step = PipelineTrainStep(
                loss_fn,
                optimizer,
                num_microbatches=self.microbatches,
                schedule=self.schedule,
                devices=None,
                mesh=self.mesh,
                recompute=self.recompute,
                zero=self.zero_stage,
                fold_axes=self.fold_axes,
                tensor=self.tensor,
            )
            self._steps[key] = (loss_fn, optimizer, step)
        return self._steps[key][2]

    def run(self, loss_fn: Callable, optimizer: optax.GradientTransformation, batch: Any, state: Any) -> tuple:
        """One step: ``state = (params, opt_state)`` with global shapes; returns ``((params, opt_state), loss)``."""
        params, opt_state = _split_state(state)
        batch = batch if isinstance(batch, tuple) else (batch,)
        self._last_step = self.step_for(loss_fn, optimizer)
        new_params, new_opt_state, value = self._last_step(params, opt_state, *batch)
        return (new_params, new_opt_state), value

    def run_step(self, step_fn: Callable, batch: Any, state: Any) -> tuple[Any, Any]:
        """``Replicator.run(step_fn, batch, state)`` on the pipeline: the user's own step, its update phase cut
        from it (:mod:`replicator.stages.user_step`); returns ``(new_state, outputs)``, each output leaf with a
        leading axis of the ``D`` data-parallel replicas."""
        self._last_step = self.user_step(step_fn, batch, state)
        return self._last_step(state, batch)

    @property
    def last_rows(self) -> Any:
        """The packed state the last step returned, as it lies on the mesh (``None`` before the first)."""
        return None if self._last_step is None else self._last_step.last_rows

    def describe_step(
        self,
        step_fn: Callable,
        batch: Any,
        state: Any,
        stage_cost: Callable[[Sequence[JaxprEqn]], float] | None = None,
        memory: bool = False,
    ) -> PipelineReport:
        """What :meth:`run_step` runs on these shapes (:func:`describe_user_step`)."""
        built = self.user_step(step_fn, batch, state)
        return describe_user_step(built, batch, stage_cost=stage_cost, memory=memory)

    def user_step(self, step_fn: Callable, batch: Any, state: Any) -> PipelinedStep:
        """The user's step cut for these shapes (built once per ``step_fn``, structure and shapes)."""
        leaves = jax.tree.leaves((state, batch))
        key = (
            id(step_fn),
            jax.tree.structure((state, batch)),
            tuple((np.shape(x), jnp.result_type(x)) for x in leaves),
        )
        if key not in self._user_steps:  # step_fn kept alive with its step, so its id stays its own
            built = PipelinedStep(
                step_fn,
                state,
                batch,
                self.mesh,
                self.microbatches,
                self.schedule,
                self.recompute,
                self.zero_stage,
                self.fold_axes,
                tensor=self.tensor,
            )
            self._user_steps[key] = (step_fn, built)
        return self._user_steps[key][1]

    def describe(
        self,
        loss_fn: Callable,
        optimizer: optax.GradientTransformation,
        batch: Any,
        state: Any,
        stage_cost: Callable[[Sequence[JaxprEqn]], float] | None = None,
        memory: bool = False,
    ) -> PipelineReport:
        """:func:`describe` of the step :meth:`run` would run."""
        params, _ = _split_state(state)
        batch = batch if isinstance(batch, tuple) else (batch,)
        return describe(self.step_for(loss_fn, optimizer), params, *batch, stage_cost=stage_cost, memory=memory)


def _split_state(state: Any) -> tuple[Any, Any]:
    if not (isinstance(state, tuple) and len(state) == 2):
        raise TypeError(
            "run_pipelined: state must be the pair (params, opt_state) with their global shapes, "
            f"got {type(state).__name__}."
        )
    return state
