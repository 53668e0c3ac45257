"""A full training step over S stages: the schedule's value and gradient, then each stage's optimizer update
on its own parameters, with parameters and optimizer state kept per stage.

Each stage keeps the parameter leaves its programs read (a tied leaf, read by two stages, on both; of a
*partitioned* leaf, a stack of layers ``(L, ...)`` that each stage reads through its own slice of the leading
axis, as :func:`~replicator.stages.scan_split.split_scan` cuts it, only its slice, and only that slice's
gradient, never summed across stages: :class:`~replicator.stages.split.Partition`), packed
into one flat buffer per dtype padded to the largest stage's: global shape ``(S, n)``, sharded over
``'stages'``, so device ``s`` holds row ``s`` only. An optimizer whose state mirrors the parameters
(optax's Adam, SGD, ... elementwise ones) is run on those buffers, so its moments are packed the same way;
its scalars (Adam's step count) are replicated. After the tick loop (:func:`~replicator.stages.lower.tick_loop`)
every stage packs its own leaves' gradients (a tied leaf's is the sum over its stages) and updates its row.

ZeRO on each stage's ``D`` data-parallel replicas (``zero_stage``; DeepSpeed's stages, as ``zero_stage`` of
:meth:`~replicator.pipeline.Pipeline.default` is for a data-parallel step): each row, padded to a multiple of
``D``, is cut in ``D`` chunks and device ``r`` of a stage (its index over ``('workers', 'cores')``) owns chunk
``r``. Stage 1 stores only that chunk of the optimizer state (rows sharded ``P('stages', ('workers',
'cores'))``), updates that chunk of the parameters from that chunk of the averaged gradient, and all-gathers the
new parameter rows; stage 2 reduce-scatters the gradient row (``psum_scatter``, then ``/ D``) instead of
all-reducing it, so no device holds the whole averaged gradient row; stage 3 also stores the parameter rows
``1/D`` per device between steps and all-gathers them at the start of the step. Stage 3 is a first increment:
the stored state between steps is ``1/D``, but the step's peak holds the stage's whole parameter row (gathered
once per step, not per use). The optimizer's scalars (Adam's count) stay whole on every device. The
optimizer is elementwise (checked), so its update on a chunk is the chunk of its update.

Several data-parallel replicas per device (``fold_axes``, from ``Replicator(replicas_per_device=k)``): each
device of a stage takes ``k`` consecutive replicas' blocks of the batch, ``(k, M, rows, ...)``, and runs the tick
loop on them under ``jax.vmap`` over the fold axes (:func:`fold_map`; the rows not batched), then averages the
loop's outputs over the fold (:func:`fold_mean`) before the data axes; ZeRO splits the rows over the devices.

:meth:`PipelineTrainStep.__call__` takes and returns the parameters and optimizer state with their global
(the user's) shapes; :meth:`~PipelineTrainStep.pack`, :meth:`~PipelineTrainStep.step` and
:meth:`~PipelineTrainStep.unpack` keep them packed across steps.

>>> def loss(p, x):
...     h = rp.stage_boundary(jnp.tanh(x @ p["a"]))
...     return jnp.mean((h @ p["b"]) ** 2)
>>> p = {"a": jnp.full((3, 4), 0.1), "b": jnp.full((4, 2), 0.2)}
>>> x = jnp.linspace(-1, 1, 24).reshape(8, 3)
>>> opt = optax.adam(1e-2)
>>> train = pipeline_train_step(loss, opt, num_microbatches=4, schedule="1f1b", devices=jax.devices()[:2])
>>> new_p, new_s, value = train(p, opt.init(p), x)
>>> want_p = optax.apply_updates(p, opt.update(jax.grad(loss)(p, x), opt.init(p), p)[0])
>>> bool(jnp.allclose(new_p["a"], want_p["a"], atol=1e-6)), train.held(p)["b"]
(True, (1,))
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.core import ClosedJaxpr
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from replicator._jax_compat import user_source_line
from replicator.core.context import ReplicaContext, replica_context
from replicator.core.jaxprs import iter_eqns
from replicator.core.layout import FOLDED_AXES
from replicator.stages.lower import STAGE_AXIS, OutputLayout, _shapes, tick_loop
from replicator.stages.packing import Packing, RowReader
from replicator.stages.programs import DATA_AXES, check_collectives, folded, stage_programs
from replicator.stages.rows import LastRows, RowPacker, RowUnpacker
from replicator.stages.scan_split import traced_in_stages
from replicator.stages.schedule import Schedule, make_schedule
from replicator.stages.split import StageSplitError, split_stages

__all__ = ["DATA_AXES", "PipelineTrainStep", "check_zero_stage", "pipeline_train_step"]


class _Built:
    """What one set of parameter and batch shapes compiles to."""

    def __init__(self, owner: PipelineTrainStep, params: Any, batch: tuple) -> None:
        m = owner.num_microbatches
        replicas = owner.data_devices  # the devices of a stage: ZeRO's chunks (data_replicas / k with folding)
        param_leaves, self.param_def = jax.tree.flatten(params)
        if not self.param_def.num_nodes > 1:
            raise TypeError("pipeline_train_step: pass the parameters as a pytree (a dict, a list), not one array.")
        micro = _micro_batches(batch, m, owner.data_replicas)
        batch_def = jax.tree.structure(batch)
        param_def = self.param_def
        data = logical_data_shape(owner.mesh, owner.fold_axes)

        def trace(loss: Callable) -> ClosedJaxpr:
            def one(param_leaves: list, batch_leaves: list) -> Any:
                params, batch_args = param_def.unflatten(param_leaves), batch_def.unflatten(batch_leaves)
                return jax.value_and_grad(loss)(params, *batch_args)

            # Traced on shapes alone: an argument placed on a mesh must not carry its sharding into the programs.
            # Inside the data-parallel replicas' context: the user's collectives (batch norm) are theirs.
            with replica_context(ReplicaContext(*data)):
                return jax.make_jaxpr(one)(_shapes(param_leaves), _shapes([x[0, 0] for x in micro]))

        # On a mesh of S stages, an unmarked loss's scanned stack is cut into them (split_scan).
        closed = traced_in_stages(trace, owner.loss, 1 if owner.mesh is None else owner.mesh.shape[STAGE_AXIS])
        split = split_stages(closed, first_batch=len(param_leaves))
        check_collectives(split.jaxpr)
        stages = split.num_stages
        if owner.mesh is not None:
            self.mesh = owner.mesh
            if self.mesh.shape[STAGE_AXIS] != stages:
                raise StageSplitError(
                    f"the loss has {stages} stages (its rp.stage_boundary markers cut it {stages - 1} times) but the "
                    f"mesh has {self.mesh.shape[STAGE_AXIS]}; mark {self.mesh.shape[STAGE_AXIS] - 1} boundaries or "
                    f"ask for {stages} stages."
                )
        else:
            devices = list(owner.devices) if owner.devices is not None else jax.devices()[:stages]
            if len(devices) != stages:
                raise StageSplitError(f"the loss has {stages} stages; pass {stages} devices (got {len(devices)}).")
            self.mesh = Mesh(np.array(devices).reshape(stages, 1, 1), (STAGE_AXIS, *DATA_AXES))
        if m < stages:
            warnings.warn(
                f"num_microbatches={m} < {stages} stages: most of the step is bubble (idle fraction "
                f"{(stages - 1) / (m + stages - 1):.2f} = (S-1)/(M+S-1)); use at least {stages} micro-batches.",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )
        self.closed, self.split = closed, split
        self.stages = stages
        n = len(param_leaves)
        everyone = frozenset(range(stages))
        # A leaf is kept where it is read and where its gradient is computed (output 0 is the loss).
        self.held = [split.input_stages[i] | split.output_stages[1 + i] or everyone for i in range(n)]
        self.layout = [[i for i in range(n) if s in self.held[i]] for s in range(stages)]
        self.avals = [v.aval for v in closed.jaxpr.invars[:n]]
        # A stack of layers read by each stage through its own slice (split_scan): each keeps only its slice.
        self.partitions = split.partitioned(n)
        self.pieces = {i: part.pieces for i, part in self.partitions.items()}
        zero = self.zero_stage = owner.zero_stage
        # ZeRO splits each row in D equal chunks: its length a multiple of D (the padding is zeros, kept zero).
        self.packing = Packing(
            [[self.kept_aval(i, s) for i in layout] for s, layout in enumerate(self.layout)],
            replicas if zero else 1,
            slots=True,
        )
        table = make_schedule(owner.schedule, stages, m)
        partitioned = {i: 1 + i for i in self.partitions}  # input i, its gradient output 1 + i
        self.table, self.programs = table, stage_programs(split, closed, partitioned)
        # Each stage reads the loss and the gradients of the leaves it keeps: those accumulate where they are read.
        self.outputs = OutputLayout(
            self.programs, closed.out_avals, [[0, *(1 + i for i in lay)] for lay in self.layout]
        )
        reader = RowReader(self.packing, self.layout, self.avals)
        loop = tick_loop(
            self.programs,
            table,
            closed.out_avals,
            reader.leaves,
            recompute=owner.recompute,
            layout=self.outputs,
            prepare=reader.prepare,
        )
        optimizer = owner.optimizer
        packed_def = jax.tree.structure(self.packing.zeros((stages,)))
        self.packed_def = packed_def
        state_shape = jax.eval_shape(optimizer.init, self.packing.zeros((stages,)))
        _check_elementwise(optimizer, self.packing.zeros((stages,)), state_shape)
        # A row whole on each device of its stage, or (ZeRO) split over them: device r of a stage holds chunk r.
        whole, split_rows = P(STAGE_AXIS), P(STAGE_AXIS, DATA_AXES)
        self.state_specs = _specs(state_shape, packed_def, split_rows if zero >= 1 else whole)
        self.params_spec = jax.tree.map(lambda _: split_rows if zero >= 3 else whole, self.packing.zeros((stages,)))
        self._packer = RowPacker(
            self.packing, self.layout, self.mesh, split_rows if zero >= 3 else whole, pieces=self.pieces
        )
        self._state_packer = RowPacker(
            self.packing, self.layout, self.mesh, split_rows if zero >= 1 else whole, pieces=self.pieces
        )
        self._unpacker = RowUnpacker(self.packing, self.layout, [min(h) for h in self.held], pieces=self.pieces)
        self.last = LastRows()

        def chunk(rows: dict) -> dict:
            """This device's chunk of each ``(1, n)`` row: the ``r``-th ``1/D``, ``r`` its index on the data axes."""
            r = lax.axis_index(DATA_AXES)
            return {
                k: lax.dynamic_slice_in_dim(v, r * (v.shape[1] // replicas), v.shape[1] // replicas, 1)
                for k, v in rows.items()
            }

        def gather(rows: dict) -> dict:
            """Every device's chunk, in order: the whole ``(1, n)`` rows."""
            return {k: lax.all_gather(v, DATA_AXES, axis=1, tiled=True) for k, v in rows.items()}

        def per_device(params: dict, state: Any, batch: list) -> tuple:
            # ZeRO-3 stores each row split over the stage's devices: the step runs on the whole row, gathered.
            whole_params = gather(params) if zero >= 3 else params
            # Each data-parallel replica runs the pipeline on its share (a (1, M, rows, ...) block; with k
            # replicas per device, (k, M, rows, ...), vmapped over the fold axes and averaged over them); the
            # value and gradients are then averaged over the replicas, as rp.all_mean(grads) does today.
            outputs = fold_mean(fold_map(lambda b: loop(whole_params, b), owner.fold_axes)(batch), owner.fold_axes)
            own, shared = outputs if zero >= 2 else lax.pmean(outputs, DATA_AXES)
            packers = [self._pack_grads(s) for s in range(stages)]
            grads, value = lax.switch(lax.axis_index(STAGE_AXIS), packers, own, shared)
            if zero == 0:
                updates, state = optimizer.update(grads, state, params)
                return optax.apply_updates(params, updates), state, value
            if zero >= 2:  # ZeRO-2: each device receives only its chunk of the averaged gradient row
                grads = {
                    k: (lax.psum_scatter(v, DATA_AXES, scatter_dimension=1, tiled=True) / replicas).astype(v.dtype)
                    for k, v in grads.items()
                }
                value = lax.pmean(value, DATA_AXES)
            else:
                grads = chunk(grads)
            mine = params if zero >= 3 else chunk(params)
            updates, state = optimizer.update(grads, state, mine)
            new = optax.apply_updates(mine, updates)
            return (new if zero >= 3 else gather(new)), state, value

        self.step = jax.jit(
            jax.shard_map(
                per_device,
                mesh=self.mesh,
                in_specs=(self.params_spec, self.state_specs, P(DATA_AXES)),
                out_specs=(self.params_spec, self.state_specs, P()),
                check_vma=False,
            )
        )

    def kept_aval(self, leaf: int, stage: int) -> Any:
        """Leaf ``leaf`` as ``stage`` keeps it: whole, or its slice of a partitioned leaf."""
        aval = self.avals[leaf]
        if leaf not in self.partitions:
            return aval
        start, stop = self.partitions[leaf].piece(stage)
        return jax.ShapeDtypeStruct((stop - start, *aval.shape[1:]), aval.dtype)

    def _pack_grads(self, stage: int) -> Callable[[dict, list], tuple[dict, jax.Array]]:
        def pack(own: dict, shared: list) -> tuple[dict, jax.Array]:
            """This stage's gradients packed as its row, and the loss."""
            value, *grads = self.outputs.values(stage, own, shared)
            row = self.packing.pack(stage, [grads[i] for i in self.layout[stage]])
            return {k: v[None] for k, v in row.items()}, value

        return pack

    def pack(self, tree: Any) -> dict:
        return self._packer(self.param_def.flatten_up_to(tree))

    def unpack(self, packed: dict) -> Any:
        return self.param_def.unflatten(self._unpacker(packed))

    def pack_state(self, state: Any) -> Any:
        def one(sub: Any) -> Any:
            if jax.tree.structure(sub) == self.param_def:
                return self._state_packer(self.param_def.flatten_up_to(sub))
            return jax.device_put(sub, NamedSharding(self.mesh, P()))

        return jax.tree.map(one, state, is_leaf=lambda x: jax.tree.structure(x) == self.param_def)

    def unpack_state(self, state: Any) -> Any:
        def one(sub: Any) -> Any:
            return self.unpack(sub) if jax.tree.structure(sub) == self.packed_def else sub

        return jax.tree.map(one, state, is_leaf=lambda x: jax.tree.structure(x) == self.packed_def)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside the ``replicator`` package (the user's line)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


#: Primitives that read across the elements of an operand: an update with one is not the same per stage.
_ACROSS = frozenset({"dot_general", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "sort"})


def _check_elementwise(optimizer: optax.GradientTransformation, params: dict, state: Any) -> None:
    """Raise ``TypeError`` if ``optimizer.update`` reduces across parameter elements (a global-norm clip, LAMB's
    trust ratio): run on each stage's row alone it would compute a different update."""
    traced = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p))(params, state, params)
    for eqn in iter_eqns(traced.jaxpr):
        name = eqn.primitive.name
        if (name.startswith("reduce_") and name != "reduce_precision") or name in _ACROSS:
            raise TypeError(
                f"pipeline_train_step: the optimizer's update reads across parameters ({name} at "
                f"{user_source_line(eqn.source_info)}), so updating each stage's parameters alone would change it. "
                "Use an elementwise optimizer (optax.adam, optax.sgd, ...) for now; a reduction over every stage "
                "(optax.clip_by_global_norm) comes with the update phase cut from the step."
            )


def _specs(state: Any, packed_def: Any, rows: P) -> Any:
    """``rows`` for the leaves of the parameter-shaped parts of an optimizer state, ``P()`` elsewhere."""

    def one(sub: Any) -> Any:
        if jax.tree.structure(sub) == packed_def:
            return jax.tree.map(lambda _: rows, sub)
        return P()

    return jax.tree.map(one, state, is_leaf=lambda x: jax.tree.structure(x) == packed_def)


def logical_data_shape(mesh: Mesh | None, fold_axes: Sequence[tuple[str, int]] = ()) -> tuple[int, int]:
    """The ``(workers, cores)`` grid of a pipeline's logical data-parallel replicas: the mesh's data axes, each
    times its fold (``FoldLayout.folded_axes``: a device hosts that many consecutive replicas along it)."""
    if mesh is None:
        return 1, 1
    fold = dict(fold_axes)
    return tuple(  # type: ignore[return-value]
        mesh.shape[a] * fold.get(FOLDED_AXES[a], 1) for a in DATA_AXES
    )


def fold_map(fn: Callable[[list], Any], fold_axes: Sequence[tuple[str, int]]) -> Callable[[list], Any]:
    """``fn`` of one replica's ``(M, rows, ...)`` batch leaves, run on a device's ``(k, M, rows, ...)`` block: on
    block 0 without folding (``k = 1``), else under ``jax.vmap`` over each fold axis (outermost first, ``k``
    their product) with the user's collectives spanning them (:func:`~replicator.stages.programs.folded`); the
    outputs then have the fold axes leading. What ``fn`` closes over (the parameter rows) is not batched."""
    if not fold_axes:
        return lambda batch: fn([x[0] for x in batch])
    sizes = tuple(n for _, n in fold_axes)
    mapped = over_fold(fn, fold_axes)
    return lambda batch: mapped([jnp.reshape(x, (*sizes, *x.shape[1:])) for x in batch])


def over_fold(fn: Callable, fold_axes: Sequence[tuple[str, int]]) -> Callable:
    """``fn`` of one replica's values, vmapped over the fold axes leading its arguments' leaves (outermost
    first), the user's collectives spanning them (:func:`~replicator.stages.programs.folded`)."""
    for name, _ in reversed(fold_axes):
        fn = jax.vmap(fn, axis_name=name)

    def run(*args: Any) -> Any:
        with folded(fold_axes):
            return fn(*args)

    return run


def fold_mean(tree: Any, fold_axes: Sequence[tuple[str, int]]) -> Any:
    """The mean over the leading fold axes of :func:`fold_map`'s outputs (each leaf keeps its dtype)."""
    if not fold_axes:
        return tree
    axes = tuple(range(len(fold_axes)))
    return jax.tree.map(lambda v: jnp.mean(v, axis=axes).astype(v.dtype), tree)


def _micro_batches(batch: tuple, m: int, replicas: int = 1) -> list:
    """Each batch leaf ``(B, ...)`` as ``(replicas, m, B / (replicas m), ...)``: replica ``r`` takes the ``r``-th
    contiguous block of rows (as :meth:`Replicator.run` gives replica ``r`` its share), cut into ``m``."""
    leaves = jax.tree.leaves(batch)
    parts = m * replicas
    for leaf in leaves:
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] % parts:
            rows = "a scalar" if np.ndim(leaf) == 0 else f"{np.shape(leaf)[0]} rows"
            across = f" x {replicas} data-parallel replicas = {parts}" if replicas > 1 else ""
            raise ValueError(
                f"a batch leaf of shape {np.shape(leaf)} ({rows}) does not split into num_microbatches={m}"
                f"{across} equal parts; make the batch's leading axis a multiple of {parts}."
            )
    return [jnp.reshape(x, (replicas, m, x.shape[0] // parts, *x.shape[1:])) for x in map(jnp.asarray, leaves)]


class PipelineTrainStep:
    """``params, state, value = step(params, state, *batch)``: one optimizer step of a marked loss over its
    stages (see the module docstring); built by :func:`pipeline_train_step`."""

    def __init__(
        self,
        loss: Callable,
        optimizer: optax.GradientTransformation,
        *,
        num_microbatches: int,
        schedule: str | Schedule,
        devices: Sequence[Any] | None,
        mesh: Mesh | None = None,
        recompute: bool = False,
        zero_stage: int = 0,
        fold_axes: Sequence[tuple[str, int]] = (),
    ) -> None:
        self.loss, self.optimizer, self.recompute = loss, optimizer, recompute
        #: ZeRO on each stage's data-parallel replicas (:func:`pipeline_train_step`): 0 off, 1, 2 or 3.
        self.zero_stage = check_zero_stage(zero_stage)
        self.num_microbatches, self.schedule, self.devices = num_microbatches, schedule, devices
        self.last_rows: Any = None  # the packed (params, state) the last call returned, as they lie on the mesh
        if mesh is not None and tuple(mesh.axis_names) != (STAGE_AXIS, *DATA_AXES):
            raise ValueError(f"a pipeline's mesh has the axes {(STAGE_AXIS, *DATA_AXES)}, got {mesh.axis_names}.")
        if mesh is not None and devices is not None:
            raise ValueError("pass devices= (one per stage) or mesh= (stages x data-parallel replicas), not both.")
        self.mesh = mesh
        #: The fold axes, ``(name, size)`` outermost first (``FoldLayout.folded_axes``): each device of a stage
        #: hosts ``k`` (their product) consecutive data-parallel replicas, vmapped.
        self.fold_axes = check_fold_axes(fold_axes, mesh)
        #: The devices of a stage (the mesh's data axes); ZeRO splits each row over them.
        self.data_devices = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in DATA_AXES]))
        #: ``D``: the data-parallel replicas of the pipeline (``k`` per device), each on its share of the batch.
        self.data_replicas = self.data_devices * int(np.prod([n for _, n in self.fold_axes], dtype=int))
        self._built: dict[Any, _Built] = {}

    def built(self, params: Any, *batch: Any) -> _Built:
        """The compiled step for these shapes (traced and split on first use)."""
        key = (
            jax.tree.structure((params, batch)),
            tuple((np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves((params, batch))),
        )
        if key not in self._built:
            self._built[key] = _Built(self, params, batch)
        return self._built[key]

    def held(self, params: Any) -> Any:
        """Per parameter leaf (a tree like ``params``), the stages that keep it."""
        b = self._any(params)
        return b.param_def.unflatten([tuple(sorted(h)) for h in b.held])

    def _any(self, params: Any) -> _Built:
        structure = jax.tree.structure(params)
        for built in self._built.values():
            if built.param_def == structure:
                return built
        raise ValueError("run the step once (or call built(params, *batch)) before asking where leaves are kept.")

    def pack(self, params: Any, state: Any) -> tuple[dict, Any]:
        """The parameters and optimizer state, global shapes, packed per stage and placed on the stages."""
        b = self._any(params)
        return b.pack(params), b.pack_state(state)

    def unpack(self, params: Any, packed_params: dict, packed_state: Any) -> tuple[Any, Any]:
        """Back to global shapes (``params`` gives the structure)."""
        b = self._any(params)
        return b.unpack(packed_params), b.unpack_state(packed_state)

    def step(self, params: Any, packed_params: dict, packed_state: Any, *batch: Any) -> tuple[dict, Any, jax.Array]:
        """One step on packed parameters and state (``params``, global, gives the shapes); returns them packed."""
        b = self.built(params, *batch)
        return b.step(packed_params, packed_state, _micro_batches(batch, self.num_microbatches, self.data_replicas))

    def __call__(self, params: Any, state: Any, *batch: Any) -> tuple[Any, Any, jax.Array]:
        b = self.built(params, *batch)
        given = jax.tree.leaves((params, state))
        packed = b.last.rows_for(given)  # the leaves the last call returned: their rows as they are
        if packed is None:
            packed = (b.pack(params), b.pack_state(state))
        micro = _micro_batches(batch, self.num_microbatches, self.data_replicas)
        new_params, new_state, value = b.step(*packed, micro)
        out = b.unpack(new_params), b.unpack_state(new_state)
        b.last.remember(jax.tree.leaves(out), (new_params, new_state))
        self.last_rows = (new_params, new_state)
        return *out, value


def pipeline_train_step(
    loss: Callable,
    optimizer: optax.GradientTransformation,
    *,
    num_microbatches: int,
    schedule: str | Schedule = "gpipe",
    devices: Sequence[Any] | None = None,
    mesh: Mesh | None = None,
    recompute: bool = False,
    zero_stage: int = 0,
    fold_axes: Sequence[tuple[str, int]] = (),
) -> PipelineTrainStep:
    """A training step of ``loss`` (marked with ``rp.stage_boundary``) with ``optimizer`` over its stages.

    Args:
      loss: ``loss(params, *batch) -> scalar``, a mean over its batch.
      optimizer: an optax transformation whose state mirrors the parameters (elementwise: Adam, SGD, ...).
      num_microbatches: ``M``; schedule: ``"gpipe"``, ``"1f1b"`` or a table; devices: one per stage.
      mesh: instead of ``devices``, a mesh with the axes ``('stages', 'workers', 'cores')``
        (:func:`~replicator.stages.replicas.pipeline_mesh`): ``D = workers x cores`` data-parallel replicas of
        the pipeline, each on its contiguous ``1/D`` of the batch's rows, their gradients averaged.
      recompute: recomputation from the stage boundaries (:func:`~replicator.stages.lower.tick_loop`).
      zero_stage: ZeRO on the ``D`` data-parallel replicas of each stage (each row split in ``D`` chunks, its
        length padded to a multiple of ``D``): 0 off; 1 each device stores and updates its ``1/D`` of the
        stage's optimizer state and parameters, the new parameters all-gathered; 2 also the gradient row
        reduce-scattered instead of all-reduced; 3 also the parameters stored ``1/D`` between steps (gathered
        whole at the start of the step: a first increment, the step's peak holds the stage's whole row).
      fold_axes: several data-parallel replicas per device (``Replicator(replicas_per_device=k)``): the fold
        axes, ``FoldLayout.folded_axes``; each device of a stage then runs ``k`` consecutive replicas vmapped,
        ``D = k x workers x cores``, and ZeRO splits the rows over the stage's devices.

    Returns:
      ``step(params, state, *batch) -> (params, state, value)``, equal to one device's
      ``jax.value_and_grad`` on the whole batch followed by ``optimizer.update``.
    """
    return PipelineTrainStep(
        loss,
        optimizer,
        num_microbatches=num_microbatches,
        schedule=schedule,
        devices=devices,
        mesh=mesh,
        recompute=recompute,
        zero_stage=zero_stage,
        fold_axes=fold_axes,
    )


def check_fold_axes(fold_axes: Sequence[tuple[str, int]], mesh: Mesh | None) -> tuple[tuple[str, int], ...]:
    """``fold_axes`` as a tuple, checked: ``(name, size)`` pairs of :data:`~replicator.core.layout.FOLDED_AXES`
    names in replica order, sizes above 1, and a mesh to fold onto."""
    axes = tuple((str(name), int(size)) for name, size in fold_axes)
    order = [FOLDED_AXES[a] for a in DATA_AXES]
    names = [name for name, _ in axes]
    if (
        any(name not in order for name in names)
        or names != sorted(names, key=order.index)
        or len(set(names)) < len(names)
    ):
        raise ValueError(f"fold_axes must name {order} (in that order, each at most once), got {names}.")
    if any(size < 2 for _, size in axes):
        raise ValueError(f"fold_axes sizes must be above 1 (leave a size-1 fold out), got {axes}.")
    if axes and mesh is None:
        raise ValueError("fold_axes (several replicas per device) needs mesh= (stages x data-parallel devices).")
    return axes


def check_zero_stage(zero_stage: Any) -> int:
    """``zero_stage`` if it is 0, 1, 2 or 3, else a ``ValueError`` that says what each means."""
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, (int, np.integer)) or not 0 <= zero_stage <= 3:
        raise ValueError(
            f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}: ZeRO on each pipeline stage's data-parallel "
            "replicas stores 1/D per device of 1 the optimizer state, 2 also the averaged gradients, 3 also the "
            "parameters (0: off)."
        )
    return int(zero_stage)
