"""The user's own training step over S stages: ``Replicator.run(step_fn, batch, state)`` on a pipelined
``Replicator``, the update phase cut from the step.

``step_fn(state, batch) -> (new_state, outputs)`` is written as for data parallelism: a loss marked with
``rp.stage_boundary``, ``jax.value_and_grad`` of it, ``rp.all_mean(grads)``, an optax update. It is traced
once on one micro-batch's shapes (in the data-parallel replicas' context) and split
(:func:`~replicator.stages.split.split_stages`, which labels each equation ``forward``, ``backward`` or
``update``). The cut:

* the *cut values* are what the forward and backward compute from the batch and the update or the step's
  outputs read: the gradients before ``rp.all_mean``, the loss, a metric;
* the forward and backward, with the cut values as outputs, run under the schedule's tick loop
  (:func:`~replicator.stages.lower.tick_loop`), which averages them over the ``M`` micro-batches and sums
  each over the stages (every device then holds every cut value, as the loop has always done);
* the update (every other equation, the cut values as inputs) runs once per step on each stage, pruned to
  the state leaves that stage keeps (its ``U_s``); its ``rp.all_mean`` is the mean over the data axes.

A cut value is a mean over the micro-batch's rows (a loss, its gradients, a metric), so its average over
the micro-batches is the replica's value on its whole share; anything else a step feeds the update (a sum,
a maximum) would differ, so only means go through: the common shape above. The update of stage ``s`` may
read any cut value (all gradients: a global-norm clip works) but only the state leaves ``s`` keeps; an
update that reads another stage's state is refused at trace time, naming the leaves.

ZeRO on each stage's ``D`` data-parallel replicas (``zero``, from ``rp.PassManager.default(zero=k)``;
:mod:`replicator.stages.chunks`): each *chunked* leaf is flattened, padded to a multiple of ``D`` and cut in
``D`` contiguous chunks, device ``r`` of a stage (its index over ``('workers', 'cores')``) storing chunk ``r``
(buffers sharded ``P('stages', ('workers', 'cores'))``), and the update runs on the chunks (element-wise
equations on chunks, a sum over a whole leaf on each chunk then over the stage's devices, anything else on the
leaf gathered whole). Stage 1 chunks the *update-only* leaves (read by no stage's forward or backward: the
optimizer's moments), floating point with an axis, unless the update reads them whole (integers and scalars,
Adam's count, stay whole); the new parameters are computed on chunks and all-gathered. Stage 2 also
reduce-scatters the averaged gradients (``rp.all_mean`` of a value of the forward and backward becomes
``psum_scatter / D``). Stage 3 also stores the parameters in chunks, all-gathered once at the start of the step
for the tick loop (the step's peak holds the stage's whole parameters: a first increment).

With ``replicas_per_device=k`` each device of a stage runs its ``k`` replicas' loop under ``jax.vmap``
(:func:`~replicator.stages.data_replicas.fold_map`). The state's update runs once per device, on the loop's outputs
averaged over the ``k``: it reads them through ``rp.all_mean`` only, the mean over every logical replica,
which is the mean over the device's ``k`` and then over the devices. Its own collectives must then be equal
over the ``k`` (means, maxima, minima); an update with an ``rp.all_sum`` or an ``rp.replica_id`` runs vmapped
over the ``k`` instead (the first of their equal rows kept; ZeRO refused there). The step's outputs, each
replica's own (a row per logical replica), are computed vmapped over the ``k``.

>>> def loss(p, x):
...     h = rp.stage_boundary(jnp.tanh(x @ p["a"]))
...     return jnp.mean((h @ p["b"]) ** 2)
>>> opt = optax.sgd(0.1)
>>> def step(state, x):
...     params, opt_state = state
...     value, grads = jax.value_and_grad(loss)(params, x)
...     updates, opt_state = opt.update(rp.all_mean(grads), opt_state, params)
...     return (optax.apply_updates(params, updates), opt_state), rp.all_mean(value)
>>> p = {"a": jnp.full((3, 4), 0.1), "b": jnp.full((4, 2), 0.2)}
>>> x = jnp.linspace(-1, 1, 24).reshape(8, 3)
>>> repl = rp.Replicator(1, 4, devices=jax.devices()[:4], parallelism=rp.Parallelism(stages=2, microbatches=2))
>>> (new_p, _), value = repl.run(step, x, (p, opt.init(p)))
>>> want_p = optax.apply_updates(p, opt.update(jax.grad(loss)(p, x), opt.init(p), p)[0])
>>> bool(jnp.allclose(new_p["a"], want_p["a"], atol=1e-6)), value.shape
(True, (2,))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from replicator._jax_compat import user_source_line
from replicator.core.context import ReplicaContext, replica_context
from replicator.core.jaxprs import iter_eqns, sub_jaxprs
from replicator.core.primitives import PLACEHOLDERS, all_reduce_p
from replicator.stages.chunks import ChunkPacking, Chunks, chunkable, plan, run_chunked
from replicator.stages.data_replicas import (
    check_fold_axes,
    check_zero_stage,
    fold_map,
    fold_mean,
    logical_data_shape,
    micro_batches,
    over_fold,
    takes_zero_stage,
    user_stacklevel,
)
from replicator.stages.lower import STAGE_AXIS, OutputLayout, _shapes, tick_loop
from replicator.stages.packing import Packing, RowReader
from replicator.stages.programs import DATA_AXES, check_collectives, stage_programs
from replicator.stages.rows import LastRows, RowPacker, RowUnpacker
from replicator.stages.scan_split import traced_in_stages
from replicator.stages.schedule import make_schedule
from replicator.stages.split import UPDATE, StageSplitError, split_stages
from replicator.stages.stack_update import SlicePlan, plan_slices
from replicator.stages.tensor_rows import TensorRows

__all__ = ["PipelinedStep"]

SUPPORTED = (
    "a pipelined Replicator.run supports the step `loss, grads = jax.value_and_grad(loss_fn)(params, batch)` "
    "(loss_fn marked with rp.stage_boundary), `grads = rp.all_mean(grads)`, an optax update, and outputs "
    "computed from the loss (or other means over the batch)"
)
ALTERNATIVE = (
    "or give the loss and the optimizer apart: repl.run_pipelined(loss_fn, optimizer, batch, (params, opt_state))"
)


def _once_per_device(eqns: Sequence[JaxprEqn]) -> bool:
    """Whether ``eqns`` (a state's update) hold only collectives equal over a device's replicas given equal
    inputs: means, maxima, minima (at any depth)."""
    every = (inner for eqn in eqns for inner in (eqn, *(e for sub in sub_jaxprs(eqn.params) for e in iter_eqns(sub))))
    return all(
        eqn.primitive not in PLACEHOLDERS
        or (eqn.primitive is all_reduce_p and eqn.params.get("op") in ("mean", "max", "min"))
        for eqn in every
    )


def _reached(eqns: Sequence[JaxprEqn], sources: Sequence[Any]) -> set[Var]:
    """The variables computed from ``sources`` (and those themselves)."""
    reached = {v for v in sources if isinstance(v, Var)}
    for eqn in eqns:
        if any(isinstance(v, Var) and v in reached for v in eqn.invars):
            reached.update(v for v in eqn.outvars if isinstance(v, Var))
    return reached


def _prune(eqns: Sequence[JaxprEqn], wanted: Sequence[Any]) -> tuple[list[JaxprEqn], set[Var]]:
    """The equations ``wanted`` (atoms) needs, in order, and the variables they read that none defines."""
    need = {v for v in wanted if isinstance(v, Var)}
    kept: list[JaxprEqn] = []
    for eqn in reversed(eqns):
        if any(isinstance(v, Var) and v in need for v in eqn.outvars):
            kept.append(eqn)
            need.update(v for v in eqn.invars if isinstance(v, Var))
    kept.reverse()
    defined = {v for eqn in kept for v in eqn.outvars}
    return kept, {v for v in need if v not in defined}


class PipelinedStep:
    """``step_fn`` on the pipeline mesh for one state and batch shape (see the module docstring). ``zero``: the
    ZeRO level (``zero_stage=`` is its old name, a ``DeprecationWarning``)."""

    @takes_zero_stage
    def __init__(
        self,
        step_fn: Any,
        state: Any,
        batch: Any,
        mesh: Mesh,
        microbatches: int,
        schedule: str,
        recompute: bool = False,
        zero: int = 0,
        fold_axes: Sequence[tuple[str, int]] = (),
        tensor: Any = None,
    ) -> None:
        #: ZeRO on each stage's data-parallel replicas (:mod:`replicator.stages.chunks`): 0 off, 1, 2 or 3.
        self.zero_stage = zero = check_zero_stage(zero)
        #: The fold axes (``FoldLayout.folded_axes``): each device runs ``k`` consecutive replicas, vmapped.
        self.fold_axes = fold_axes = check_fold_axes(fold_axes, mesh)
        self.replicas_per_device = int(np.prod([k for _, k in fold_axes], dtype=int))
        #: ``D``: the logical data-parallel replicas (``k`` per device of a stage).
        self.replicas = replicas = int(np.prod([mesh.shape[a] for a in DATA_AXES])) * self.replicas_per_device
        state_leaves, self.state_def = jax.tree.flatten(state)
        batch_leaves, batch_def = jax.tree.flatten(batch)
        n = len(state_leaves)
        if n == 0:
            raise TypeError(
                f"a pipelined Replicator.run needs a state (the parameters and optimizer state); {SUPPORTED}."
            )
        self.micro_leaves = lambda b: micro_batches(tuple(jax.tree.leaves(b)), microbatches, replicas)
        micro = self.micro_leaves(batch)
        state_def = self.state_def

        data = logical_data_shape(mesh, fold_axes)

        def trace(step_fn: Callable) -> tuple[ClosedJaxpr, Any]:
            def one(state_leaves: list, batch_leaves: list) -> Any:
                return step_fn(state_def.unflatten(state_leaves), batch_def.unflatten(batch_leaves))

            with replica_context(ReplicaContext(*data)):
                shapes = (_shapes(state_leaves), _shapes([x[0, 0] for x in micro]))
                return jax.make_jaxpr(one, return_shape=True)(*shapes)

        # An unmarked step's scanned stack is cut into the mesh's stages (split_scan).
        closed, out_shape = traced_in_stages(trace, step_fn, mesh.shape[STAGE_AXIS])
        paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        #: With a tensor axis (a :class:`~replicator.tensor.axis.TensorAxis`): the step as one device of a
        #: tensor group runs it, split before the stages are (its shapes local, its collectives over the axis).
        self.tensor_split = None
        self.tensor_axis = (tensor.name, tensor.size) if tensor is not None else None
        if tensor is not None:
            self.tensor_split = tensor.split_jaxpr(closed, state, paths + ["the batch"] * len(batch_leaves))
            closed = self.tensor_split.jaxpr
        if not (isinstance(out_shape, tuple) and len(out_shape) == 2):
            raise TypeError(f"step_fn must return (new_state, outputs); {SUPPORTED}.")
        if jax.tree.structure(out_shape[0]) != state_def:
            raise TypeError("step_fn's new state must have the structure of the state it is given.")
        self.outputs_def = jax.tree.structure(out_shape[1])
        whole = split_stages(closed, num_state=n, update_reads_all=True)
        flat: Jaxpr = whole.jaxpr
        stages = whole.num_stages
        if mesh.shape[STAGE_AXIS] != stages:
            raise StageSplitError(
                f"the step has {stages} stages (its rp.stage_boundary markers cut it {stages - 1} times) but the "
                f"pipeline has {mesh.shape[STAGE_AXIS]} (rp.Parallelism(stages=...), or the devices given); mark "
                f"{mesh.shape[STAGE_AXIS] - 1} boundaries or ask for {stages} stages."
            )
        if microbatches < stages:
            warnings.warn(
                f"microbatches={microbatches} < {stages} stages: most of the step is bubble (idle fraction "
                f"{(stages - 1) / (microbatches + stages - 1):.2f} = (S-1)/(M+S-1)).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

        # The cut: values of the micro-batch part read by the update or returned. That part is what the forward
        # and backward place on a stage, and what they compute from the batch: with one stage (no marker, a
        # gradient accumulation) nothing is placed, every equation is free.
        from_batch = _reached(flat.eqns, flat.invars[n:])
        late = {
            v
            for i, eqn in enumerate(flat.eqns)
            if whole.phases[i] != UPDATE and (not whole.free[i] or any(o in from_batch for o in eqn.outvars))
            for v in eqn.outvars
            if isinstance(v, Var)
        }
        update_eqns = [eqn for i, eqn in enumerate(flat.eqns) if whole.phases[i] == UPDATE]
        cut: dict[Var, None] = {}
        for eqn in update_eqns:
            cut.update((v, None) for v in eqn.invars if isinstance(v, Var) and v in late)
        cut.update((v, None) for v in flat.outvars if isinstance(v, Var) and v in late)
        for eqn in update_eqns:
            reads = [v for v in eqn.invars if isinstance(v, Var) and v in cut]
            mean = eqn.primitive in PLACEHOLDERS and eqn.params.get("op") == "mean" and eqn.params.get("group") is None
            if reads and not mean:
                raise StageSplitError(
                    f"'{eqn.primitive.name}' at {user_source_line(eqn.source_info)} reads the gradients (or another "
                    f"value of the batch) before rp.all_mean: the data-parallel replicas would update apart. "
                    f"{SUPPORTED}; {ALTERNATIVE}."
                )
        for v in cut:
            if not jnp.issubdtype(v.aval.dtype, jnp.inexact):
                raise StageSplitError(
                    f"{SUPPORTED}; the step returns or updates with an integer value computed from the batch "
                    f"(shape {v.aval.shape}, {v.aval.dtype}), which is not a mean over micro-batches; {ALTERNATIVE}."
                )
        self.cut = list(cut)
        # The micro-batch part: forward and backward, the cut values its outputs.
        fb_eqns, _ = _prune([e for i, e in enumerate(flat.eqns) if whole.phases[i] != UPDATE], self.cut)
        fb = ClosedJaxpr(
            Jaxpr(flat.constvars, flat.invars, self.cut, fb_eqns, flat.effects, flat.debug_info), closed.consts
        )
        fb_split = split_stages(fb, num_state=None, first_batch=n)
        check_collectives(fb_split.jaxpr)
        if fb_split.num_stages != stages:
            raise StageSplitError(f"the update phase holds stage boundaries; {SUPPORTED}; {ALTERNATIVE}.")
        everyone = frozenset(range(stages))
        state_stages = whole.state_stages(n)
        self.held = [(state_stages[i] | fb_split.input_stages[i]) or everyone for i in range(n)]
        self.avals = [v.aval for v in flat.invars[:n]]
        self.stages, self.mesh, self.recompute = stages, mesh, recompute

        # The update per stage: every equation but the micro-batch part, pruned to the leaves the stage keeps.
        rest = [e for e in flat.eqns if not any(isinstance(v, Var) and v in late for v in e.outvars)]
        state_in = {v: i for i, v in enumerate(flat.invars[:n])}
        batch_in = set(flat.invars[n:])
        outputs = flat.outvars[n:]
        # A state leaf that a stage's update reads is kept, and updated, by that stage too (the moments of a
        # stack whose update another stage's global-norm clip decides): until every update reads its own.
        grown = True
        while grown:
            grown, self.updates = False, []
            self.layout = [[i for i in range(n) if s in self.held[i]] for s in range(stages)]
            for s in range(stages):
                wanted = [flat.outvars[i] for i in self.layout[s]]
                eqns, reads = _prune(rest, [*wanted, *outputs])
                if reads & batch_in:
                    raise StageSplitError(
                        f"the update reads the batch outside the loss's value and gradient; {SUPPORTED}; {ALTERNATIVE}."
                    )
                for i in sorted(state_in[v] for v in reads if v in state_in and s not in self.held[state_in[v]]):
                    self.held[i], grown = self.held[i] | {s}, True
                self.updates.append((eqns, wanted))

        # With k replicas per device the state's update runs once per device, on the loop's outputs averaged
        # over the k (the update reads them through rp.all_mean only, a mean over every logical replica: the
        # mean over the device's k, then over the devices), where its collectives are means, maxima or minima
        # (equal over the k: a sum or a replica_id would differ); else vmapped over the k, the first row kept.
        self.update_once = bool(fold_axes) and all(
            _once_per_device(_prune(eqns, wanted)[0]) for eqns, wanted in self.updates
        )
        if zero and fold_axes and not self.update_once:
            raise ValueError(
                f"zero={zero} with replicas_per_device > 1: the update cut from step_fn holds a collective "
                "other than a mean, maximum or minimum (an rp.all_sum, an rp.replica_id), so it runs vmapped over "
                "a device's replicas, and ZeRO's chunks are per device. Use one replica per device, or "
                "repl.run_pipelined(loss_fn, optimizer, batch, (params, opt_state))."
            )

        # A scanned stack each stage keeps its slice of, with its gradient and moments (stack_update).
        self.update_only = [not fb_split.input_stages[i] for i in range(n)]
        used = {id(e) for eqns, _ in self.updates for e in eqns}  # free equations (slices of inputs) left out
        self.slices = self._plan_slices(fb_split, fb, flat, [e for e in rest if id(e) in used], outputs)
        # ZeRO: which leaves each stage stores 1/D per device (see _chunked), each kind in buffers of its own.
        devices = int(np.prod([mesh.shape[a] for a in DATA_AXES]))  # a stage's devices: ZeRO's chunks
        self.scatter = (
            frozenset(v for v in self.cut if chunkable(v.aval)) if zero >= 2 else frozenset()
        )  # ZeRO-2: the averaged gradients reduce-scattered
        self.chunked = chunked = self._chunked(flat.invars[:n]) if zero else frozenset()
        if self.slices.leaves and self._slices_meet_chunks(chunked, flat.invars[:n]):
            self.slices = SlicePlan()  # an equation would read a slice and a whole leaf's chunk: the stack whole
        moments = [[i for i in lay if i in chunked and self.update_only[i]] for lay in self.layout]
        params = [[i for i in lay if i in chunked and not self.update_only[i]] for lay in self.layout]
        self.whole_layout = [[i for i in lay if i not in chunked] for lay in self.layout]
        kept = self.slices.kept_aval  # a sliced leaf: the stage's slice, chunked as a leaf of that shape
        self.moments = ChunkPacking(
            [[kept(i, s, self.avals[i]) for i in lay] for s, lay in enumerate(moments)], devices, "chunks_"
        )
        self.param_chunks = ChunkPacking(
            [[kept(i, s, self.avals[i]) for i in lay] for s, lay in enumerate(params)], devices, "param_chunks_"
        )
        self.packing = Packing(
            [[kept(i, s, self.avals[i]) for i in lay] for s, lay in enumerate(self.whole_layout)],
            slots=True,
        )
        on = Chunks(devices)
        programs = stage_programs(fb_split, fb, self.slices.grads)
        table = make_schedule(schedule, stages, microbatches)
        self.table, self.split, self.programs, self.paths = table, fb_split, programs, paths
        # Each stage's update reads some cut values (its leaves' gradients, the loss; a global-norm clip reads
        # them all): those accumulate where they are read (OutputLayout), the rest is never summed over stages.
        position = {v: i for i, v in enumerate(self.cut)}
        needed = []
        for eqns, wanted in self.updates:
            read = {v for e in eqns for v in e.invars if isinstance(v, Var)} | set(wanted) | set(outputs)
            needed.append(sorted(position[v] for v in read if isinstance(v, Var) and v in position))
        self.outputs_layout = OutputLayout(programs, fb.out_avals, needed)
        self.reader = reader = RowReader(self.packing, self.whole_layout, self.avals)
        main_keys = list(self.packing.buffers())
        param_keys = list(self.param_chunks.buffers())

        def prepare(rows: dict, stage: Any = None) -> tuple:
            """The rows as the loop reads them: ZeRO-3's parameter chunks gathered whole, once per step."""
            view = reader.prepare({k: rows[k] for k in main_keys}, stage)
            return view, {k: lax.all_gather(rows[k][0], DATA_AXES, tiled=True) for k in param_keys}

        def leaves(stage: int, view: tuple) -> list:
            out = reader.leaves(stage, view[0])
            for i, value in zip(params[stage], self.param_chunks.unpack(stage, view[1]), strict=True):
                out[i] = value
            return out

        loop = tick_loop(
            programs,
            table,
            fb.out_avals,
            leaves,
            recompute=recompute,
            layout=self.outputs_layout,
            prepare=prepare,
        )
        consts = dict(zip(flat.constvars, closed.consts, strict=True))
        chunk_in = {flat.invars[i] for i in chunked}
        chunk_keys = {*self.moments.buffers(), *param_keys}

        def update(stage: int, part: str = "all") -> Any:
            """Stage ``stage``'s update branch: its new row and the outputs (``part="all"``), the row alone
            (``"state"``, the outputs ``[]``) or the outputs alone (``"outputs"``, the row ``{}``)."""
            eqns, wanted = self.updates[stage]
            if part != "all":
                eqns = _prune(eqns, wanted if part == "state" else outputs)[0]

            def branch(row: dict, own: dict, shared: list) -> tuple:
                cut_values = self.outputs_layout.values(stage, own, shared)
                env: dict[Any, Any] = dict(consts)
                env.update(
                    (v, x)
                    for v, x in zip(flat.invars[:n], self.reader.from_row(stage, row), strict=True)
                    if v not in chunk_in
                )
                env.update(zip(self.cut, cut_values, strict=True))
                chunks: dict[Any, Any] = {}
                for lay, packing in ((moments, self.moments), (params, self.param_chunks)):
                    chunks.update(
                        zip([flat.invars[i] for i in lay[stage]], packing.local_unpack(stage, row), strict=True)
                    )
                bounds = self.slices.on_stage(stage)
                run_chunked(eqns, env, chunks, on, self.scatter, bounds)

                def whole(v: Any) -> Any:
                    if isinstance(v, Literal):
                        return v.val
                    return env[v] if v in env else on.gather(chunks[v], bounds.aval(v))

                def kept_value(i: int) -> Any:
                    """Leaf ``i``'s new value as the stage keeps it: whole, or its slice of a stack."""
                    v = flat.outvars[i]
                    if i not in self.slices.leaves or (isinstance(v, Var) and v in bounds):
                        return whole(v)
                    return lax.slice_in_dim(whole(v), *self.slices.bounds_of(i, stage))

                def chunk(i: int) -> Any:
                    v, aval = flat.outvars[i], kept(i, stage, self.avals[i])
                    mine = chunks[v] if isinstance(v, Var) and v in chunks else on.mine(kept_value(i), aval)
                    return jnp.where(on.valid(aval), mine, jnp.zeros((), aval.dtype))  # the padding kept zero

                outs = [] if part == "state" else [jnp.asarray(whole(v))[None] for v in outputs]
                if part == "outputs":
                    return {}, outs

                packed = self.packing.pack(stage, [kept_value(i) for i in self.whole_layout[stage]])
                packed.update(self.moments.local_pack(stage, [chunk(i) for i in moments[stage]]))
                packed.update(self.param_chunks.local_pack(stage, [chunk(i) for i in params[stage]]))
                packed = {k: v if k in chunk_keys else v[None] for k, v in packed.items()}
                return dict(sorted(packed.items())), outs

            return branch

        branches = [update(s) for s in range(stages)]

        def one(row: dict, batch: list) -> tuple:
            own, shared = loop(row, batch)
            return lax.switch(lax.axis_index(STAGE_AXIS), branches, row, own, shared)

        state_branches = [update(s, "state") for s in range(stages)]
        output_branches = [update(s, "outputs") for s in range(stages)]

        def per_device(row: dict, batch: list) -> tuple:
            if not fold_axes:
                return one(row, [x[0] for x in batch])
            lead = len(fold_axes)
            if not self.update_once:
                # k replicas per device: each runs the loop and the update (its collectives over every logical
                # replica), vmapped; their new rows are equal (the update reads the batch through rp.all_mean).
                new_rows, outs = fold_map(lambda b: one(row, b), fold_axes)(batch)
                new_row = {k: v[(0,) * lead] for k, v in new_rows.items()}
            else:
                # The loop vmapped over the k; the state's update once, on the loop's outputs averaged over
                # them; the outputs (each replica's own) vmapped.
                own, shared = fold_map(lambda b: loop(row, b), fold_axes)(batch)
                stage = lax.axis_index(STAGE_AXIS)
                new_row, _ = lax.switch(stage, state_branches, row, *fold_mean((own, shared), fold_axes))
                _, outs = over_fold(lambda o, sh: lax.switch(stage, output_branches, row, o, sh), fold_axes)(
                    own, shared
                )
            return new_row, [jnp.reshape(o, (-1, *o.shape[lead + 1 :])) for o in outs]  # a row per replica

        # Each kind of leaf in buffers of its own: whole on each device of its stage, or (ZeRO) split over them.
        owners = [min(h) for h in self.held]
        split_rows = P(STAGE_AXIS, DATA_AXES)
        self._stores = [
            (packing, layout, spec)
            for packing, layout, spec in (
                (self.packing, self.whole_layout, P(STAGE_AXIS)),
                (self.moments, moments, split_rows),
                (self.param_chunks, params, split_rows),
            )
            if packing.buffers()
        ]
        #: How each buffer ``(S, n)`` lies on the mesh (``(S, T * n)`` with a tensor axis: TensorRows).
        self.row_spec = row_spec = {k: spec for packing, _, spec in self._stores for k in packing.buffers()}

        def pieces(layout: Sequence[Sequence[int]]) -> dict:
            """The sliced leaves among a store's (only the whole rows: a sliced leaf is never chunked)."""
            return {i: p for i, p in self.slices.leaves.items() if any(i in lay for lay in layout)}

        # With a tensor axis TensorRows packs and reads the rows (its own packers on the T sub-meshes).
        self._tensor_rows, self._packers, self._unpackers = None, [], []
        if self.tensor_split is not None:
            self._tensor_rows = TensorRows(self._stores, mesh, self.tensor_split.placements, owners, pieces)
            self.row_spec = row_spec = self._tensor_rows.specs
        else:
            self._packers = [RowPacker(p, lay, mesh, spec, pieces=pieces(lay)) for p, lay, spec in self._stores]
            self._unpackers = [
                (list(p.buffers()), RowUnpacker(p, lay, owners, pieces(lay))) for p, lay, _ in self._stores
            ]
        self._last = LastRows()
        self.step = jax.jit(
            jax.shard_map(
                per_device,
                mesh=mesh,
                in_specs=(row_spec, P(DATA_AXES)),
                out_specs=(row_spec, [P(DATA_AXES)] * len(outputs)),
                check_vma=False,
            )
        )

    def _plan_slices(
        self, fb_split: Any, fb: ClosedJaxpr, flat: Jaxpr, rest: Sequence[JaxprEqn], outputs: Sequence[Any]
    ) -> SlicePlan:
        """The scanned stacks each stage keeps its slice of (:func:`~replicator.stages.stack_update.plan_slices`):
        a state leaf partitioned in the forward, paired with a cut value partitioned alike (its gradient; two
        stacks of one shape and pieces may pair crosswise: the programs take inputs and return outputs sliced
        independently, and the update's plan checks the pairs it is given)."""
        n = len(self.avals)
        free: dict[tuple, list[int]] = {}
        for position, part in sorted(fb_split.output_partitions.items()):
            free.setdefault((part.pieces, tuple(fb.out_avals[position].shape)), []).append(position)
        pairs = {}
        for i, part in sorted(fb_split.input_partitions.items()):
            key = (part.pieces, tuple(self.avals[i].shape))
            if i < n and free.get(key):
                position = free[key].pop(0)
                pairs[i] = (position, self.cut[position], part.pieces)
        everyone = frozenset(range(self.stages))
        return plan_slices(
            rest,
            flat.invars[:n],
            flat.outvars[:n],
            outputs,
            pairs,
            lambda j: self.update_only[j] and self.held[j] == everyone,
        )

    def _slices_meet_chunks(self, chunked: frozenset[int], invars: Sequence[Var]) -> bool:
        """Whether some equation of an update (not a collective) would read both a slice of a stack and a ZeRO
        chunk of a whole leaf (a chunk of a slice lines up with the slice's chunks; a whole leaf's does not)."""
        for s, (eqns, _) in enumerate(self.updates):
            chunks = plan(eqns, {invars[i] for i in chunked if s in self.held[i]}, self.scatter)[0]
            whole_chunks = {v for v in chunks if v not in self.slices.values}
            for eqn in eqns:
                reads = {v for v in eqn.invars if isinstance(v, Var)}
                if eqn.primitive in PLACEHOLDERS or not reads & whole_chunks:
                    continue
                if any(v in self.slices.values for v in reads):
                    return True
        return False

    def _chunked(self, invars: Sequence[Var]) -> frozenset[int]:
        """The leaves stored ``1/D`` per device: ZeRO-1 and 2 the update-only leaves (optimizer state), ZeRO-3
        the parameters too, each floating point with an axis (:func:`~replicator.stages.chunks.chunkable`);
        an update-only leaf that some stage's update reads whole (:func:`~replicator.stages.chunks.plan`: not
        element-wise) stays whole, as chunks it would save nothing."""
        wanted = {i for i, aval in enumerate(self.avals) if chunkable(aval)}
        if self.zero_stage < 3:
            wanted = {i for i in wanted if self.update_only[i]}
        while True:
            gathered: set[Var] = set()
            for s, (eqns, _) in enumerate(self.updates):
                gathered |= plan(eqns, {invars[i] for i in wanted if s in self.held[i]}, self.scatter)[1]
            whole = {i for i in wanted if self.update_only[i] and invars[i] in gathered}
            if not whole:
                return frozenset(wanted)
            wanted -= whole

    @property
    def nbytes(self) -> int:
        """The bytes of the state one device stores between steps: its stage's whole row, its chunks."""
        return self.packing.nbytes + self.moments.nbytes + self.param_chunks.nbytes

    def zeros(self) -> dict:
        """The packed state's buffers, zeros, global shapes ``(S, n)``."""
        if self._tensor_rows is not None:
            return dict(sorted(self._tensor_rows.zeros().items()))
        out = {}
        for packing, _, _ in self._stores:
            out.update(packing.zeros((self.stages,)))
        return dict(sorted(out.items()))

    def pack(self, state: Any) -> dict:
        """The state, global shapes, as one row per stage placed on its devices (ZeRO: its chunks split)."""
        leaves = self.state_def.flatten_up_to(state)
        if self._tensor_rows is not None:
            return dict(sorted(self._tensor_rows.pack(leaves).items()))
        out = {}
        for packer in self._packers:
            out.update(packer(leaves))
        return dict(sorted(out.items()))

    def unpack(self, packed: dict) -> Any:
        """Back to global shapes: each leaf from the first stage that keeps it."""
        if self._tensor_rows is not None:
            return self.state_def.unflatten(self._tensor_rows.unpack(packed))
        leaves: list[Any] = [None] * len(self.avals)
        for keys, unpacker in self._unpackers:
            for i, value in enumerate(unpacker({k: packed[k] for k in keys})):
                if value is not None:
                    leaves[i] = value
        return self.state_def.unflatten(leaves)

    @property
    def last_rows(self) -> Any:
        """The packed rows the last call returned, as they lie on the mesh."""
        return self._last.rows

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        packed = self._last.rows_for(self.state_def.flatten_up_to(state))  # the leaves the last call returned
        packed, outs = self.step(self.pack(state) if packed is None else packed, self.micro_leaves(batch))
        new_state = self.unpack(packed)
        self._last.remember(self.state_def.flatten_up_to(new_state), packed)
        return new_state, self.outputs_def.unflatten(outs)
