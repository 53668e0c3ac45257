"""A loss and an optimizer over S stages: the step a data-parallel user would write from them, built by the one
pipelined build (:class:`~replicator.stages.user_step.PipelinedStep`).

``pipeline_train_step(loss, optimizer, ...)`` (and ``Replicator.run_pipelined``) writes the step
:func:`optimizer_step`: ``jax.value_and_grad`` of the loss, ``rp.all_mean`` of the gradients and the loss, the
optimizer's update. The pipeline cuts it as it cuts any user's step: the forward and backward under the
schedule's tick loop, the update once per step on each stage's own leaves. So ZeRO 1-3 on each stage's ``D``
data-parallel replicas (:mod:`~replicator.stages.chunks`), a stack of layers each stage keeps only its slice of
(:mod:`~replicator.stages.stack_update`), tied leaves, several replicas per device (``fold_axes``) and the tensor
axis (``tensor``) are the user step's, written once. An optimizer that reads across parameters (a global-norm
clip) works: each stage's update reads every gradient.

Stages come from ``mesh`` (``('stages', 'workers', 'cores')``, :func:`~replicator.stages.replicas.pipeline_mesh`),
or from ``devices`` (one per stage), or, with neither, from the loss's ``rp.stage_boundary`` markers (the first
devices, one per stage).

:meth:`PipelineTrainStep.__call__` takes and returns the parameters and optimizer state with their global (the
user's) shapes; :meth:`~PipelineTrainStep.pack`, :meth:`~PipelineTrainStep.step` and
:meth:`~PipelineTrainStep.unpack` keep them packed, one row per stage, across steps.

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

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from replicator.core.context import ReplicaContext, replica_context
from replicator.core.primitives import all_mean
from replicator.stages.data_replicas import check_fold_axes, check_zero_stage, micro_batches, takes_zero_stage
from replicator.stages.lower import STAGE_AXIS, _shapes
from replicator.stages.programs import DATA_AXES
from replicator.stages.schedule import Schedule
from replicator.stages.split import split_stages
from replicator.stages.user_step import PipelinedStep

__all__ = ["DATA_AXES", "PipelineTrainStep", "optimizer_step", "pipeline_train_step"]


def optimizer_step(loss: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """The step of ``loss`` and ``optimizer`` as a data-parallel user writes it: ``step((params, opt_state),
    batch) -> ((params, opt_state), rp.all_mean(loss))``, the gradients averaged with ``rp.all_mean``.

    >>> step = optimizer_step(lambda p, x: jnp.mean(x * p), optax.sgd(0.5))
    >>> state = (jnp.ones(()), optax.sgd(0.5).init(jnp.ones(())))
    >>> (p, _), value = rp.Replicator(1, 2, devices=jax.devices()[:2]).run(step, (jnp.arange(4.0),), state)
    >>> float(p), value.tolist()  # the mean gradient 1.5 on both replicas; the loss, one per replica
    (0.25, [1.5, 1.5])
    """

    def step(state: tuple, batch: tuple) -> tuple:
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = optimizer.update(all_mean(grads), opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), all_mean(value)

    return step


class PipelineTrainStep:
    """``params, state, value = step(params, state, *batch)``: one optimizer step of a marked loss over its
    stages (see the module docstring); built by :func:`pipeline_train_step`."""

    @takes_zero_stage
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
        zero: int = 0,
        fold_axes: Sequence[tuple[str, int]] = (),
        tensor: Any = None,
    ) -> None:
        self.loss, self.optimizer, self.recompute = loss, optimizer, recompute
        #: ZeRO on each stage's data-parallel replicas (:func:`pipeline_train_step`'s ``zero``): 0 off, 1, 2 or 3.
        self.zero_stage = check_zero_stage(zero)
        self.num_microbatches, self.schedule, self.devices = num_microbatches, schedule, devices
        axes = (STAGE_AXIS, *DATA_AXES, *(() if tensor is None else (tensor.name,)))
        if mesh is not None and tuple(mesh.axis_names) != axes:
            raise ValueError(f"a pipeline's mesh has the axes {axes}, got {mesh.axis_names}.")
        if mesh is not None and devices is not None:
            raise ValueError("pass devices= (one per stage) or mesh= (stages x data-parallel replicas), not both.")
        if tensor is not None and mesh is None:
            raise ValueError("a pipeline with a tensor axis needs mesh= (stages x data x tensor devices).")
        self.mesh, self.tensor = mesh, tensor
        #: The fold axes, ``(name, size)`` outermost first (``FoldLayout.folded_axes``): each device of a stage
        #: hosts ``k`` (their product) consecutive data-parallel replicas, vmapped.
        self.fold_axes = check_fold_axes(fold_axes, mesh)
        #: The devices of a stage (the mesh's data axes); ZeRO splits each row over them.
        self.data_devices = 1 if mesh is None else int(np.prod([mesh.shape[a] for a in DATA_AXES]))
        #: ``D``: the data-parallel replicas of the pipeline (``k`` per device), each on its share of the batch.
        self.data_replicas = self.data_devices * int(np.prod([n for _, n in self.fold_axes], dtype=int))
        self.step_fn = optimizer_step(loss, optimizer)
        self._built: dict[Any, PipelinedStep] = {}
        self._last: PipelinedStep | None = None

    def built(self, params: Any, *batch: Any) -> PipelinedStep:
        """The compiled step for these shapes (traced and split on first use)."""
        key = (
            jax.tree.structure((params, batch)),
            tuple((np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves((params, batch))),
        )
        if key not in self._built:
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params)
            state = (shapes, jax.eval_shape(self.optimizer.init, shapes))
            self._built[key] = PipelinedStep(
                self.step_fn,
                state,
                batch,
                self.mesh if self.mesh is not None else self._stage_mesh(params, batch),
                self.num_microbatches,
                self.schedule,
                self.recompute,
                self.zero_stage,
                self.fold_axes,
                tensor=self.tensor,
            )
        return self._built[key]

    def _stage_mesh(self, params: Any, batch: tuple) -> Mesh:
        """One device per stage: the given ``devices``, or the first devices, as many as the loss's stages."""
        devices = self.devices
        if devices is None:
            leaves = jax.tree.leaves(params)
            micro = micro_batches(batch, self.num_microbatches)

            def value_and_grad(leaves: list, batch_leaves: list) -> Any:
                batch_args = jax.tree.unflatten(jax.tree.structure(batch), batch_leaves)
                return jax.value_and_grad(self.loss)(
                    jax.tree.unflatten(jax.tree.structure(params), leaves), *batch_args
                )

            with replica_context(ReplicaContext(1, 1)):
                closed = jax.make_jaxpr(value_and_grad)(_shapes(leaves), _shapes([x[0, 0] for x in micro]))
            devices = jax.devices()[: split_stages(closed, first_batch=len(leaves)).num_stages]
        return Mesh(np.array(list(devices)).reshape(len(devices), 1, 1), (STAGE_AXIS, *DATA_AXES))

    def held(self, params: Any) -> Any:
        """Per parameter leaf (a tree like ``params``), the stages that keep it."""
        built, structure = self._any(params), jax.tree.structure(params)
        return structure.unflatten([tuple(sorted(h)) for h in built.held[: structure.num_leaves]])

    def _any(self, params: Any) -> PipelinedStep:
        structure = jax.tree.structure(params)
        for built in self._built.values():
            if built.state_def.children()[0] == structure:
                return built
        raise ValueError("run the step once (or call built(params, *batch)) before asking where leaves are kept.")

    def pack(self, params: Any, state: Any) -> dict:
        """The parameters and optimizer state, global shapes, packed per stage and placed on the stages."""
        return self._any(params).pack((params, state))

    def unpack(self, params: Any, rows: dict) -> tuple[Any, Any]:
        """Back to global shapes (``params`` gives the structure): ``(params, opt_state)``."""
        return self._any(params).unpack(rows)

    def step(self, params: Any, rows: dict, *batch: Any) -> tuple[dict, jax.Array]:
        """One step on packed rows (``params``, global, gives the shapes); returns the new rows and the loss."""
        built = self.built(params, *batch)
        rows, outputs = built.step(rows, built.micro_leaves(batch))
        return rows, outputs[0][0]

    @property
    def last_rows(self) -> Any:
        """The packed rows the last call returned, as they lie on the mesh (``None`` before the first)."""
        return None if self._last is None else self._last.last_rows

    def __call__(self, params: Any, state: Any, *batch: Any) -> tuple[Any, Any, jax.Array]:
        self._last = built = self.built(params, *batch)
        (new_params, new_state), value = built((params, state), batch)
        return new_params, new_state, value[0]  # the loss, the same on every data-parallel replica


@takes_zero_stage
def pipeline_train_step(
    loss: Callable,
    optimizer: optax.GradientTransformation,
    *,
    num_microbatches: int,
    schedule: str | Schedule = "gpipe",
    devices: Sequence[Any] | None = None,
    mesh: Mesh | None = None,
    recompute: bool = False,
    zero: int = 0,
    fold_axes: Sequence[tuple[str, int]] = (),
    tensor: Any = None,
) -> PipelineTrainStep:
    """A training step of ``loss`` (marked with ``rp.stage_boundary``) with ``optimizer`` over its stages.

    Args:
      loss: ``loss(params, *batch) -> scalar``, a mean over its batch.
      optimizer: an optax transformation.
      num_microbatches: ``M``; schedule: ``"gpipe"``, ``"1f1b"``, ``"1f1b-fused"`` or a table; devices: one per
        stage (default: the first devices, as many as the loss has stages).
      mesh: instead of ``devices``, a mesh with the axes ``('stages', 'workers', 'cores')``
        (:func:`~replicator.stages.replicas.pipeline_mesh`): ``D = workers x cores`` data-parallel replicas of
        the pipeline, each on its contiguous ``1/D`` of the batch's rows, their gradients averaged.
      recompute: recomputation from the stage boundaries (:func:`~replicator.stages.lower.tick_loop`).
      zero: the ZeRO level on the ``D`` data-parallel replicas of each stage (:mod:`~replicator.stages.chunks`):
        0 off; 1 each device stores and updates its ``1/D`` of the optimizer's moments, the new parameters
        all-gathered; 2 also the averaged gradients reduce-scattered; 3 also the parameters stored ``1/D``.
        ``zero_stage=`` is its old name (a ``DeprecationWarning``; both given: a ``TypeError``).
      fold_axes: several data-parallel replicas per device (``Parallelism(replicas_per_device=k)``): the fold
        axes, ``FoldLayout.folded_axes``; ``D = k x workers x cores``.
      tensor: the tensor axis (a :class:`~replicator.tensor.axis.TensorAxis`, innermost in ``mesh``).

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
        zero=zero,
        fold_axes=fold_axes,
        tensor=tensor,
    )
