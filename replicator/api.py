"""``Replicator``: run a one-device step on every replica of a device mesh.

Example (``rp.force_cpu_devices(8)`` emulates 8 CPU devices; call it before JAX starts):

>>> repl = rp.Replicator(num_workers=1, cores_per_worker=8)
>>> def input_fn(ctx):  # one worker's batches
...     while True:
...         yield {"x": np.ones((64, 3), np.float32)}
>>> def loss(w, batch):
...     return jnp.mean((batch["x"] @ w - 1.0) ** 2)
>>> def step_fn(w, batch):  # one replica: 64 / 8 rows
...     grads = rp.all_mean(jax.grad(loss)(w, batch))
...     return w - 0.1 * grads, {"replica": rp.replica_id()}
>>> w, outputs = repl.run(step_fn, input_fn, jnp.zeros(3))
>>> np.asarray(outputs["replica"]).tolist()  # outputs: one row per replica
[0, 1, 2, 3, 4, 5, 6, 7]
>>> print(np.asarray(w).round(3))  # one step of gradient descent from zeros
[0.2 0.2 0.2]
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from replicator.axes import place_axes
from replicator.core.context import ReplicaContext, normalize_axis_names
from replicator.cost.report import CommunicationReport, communication_report
from replicator.parallelism import Parallelism, older_keywords
from replicator.pass_manager.manager import Lowered, PassManager, RenamedAttribute
from replicator.runtime.build import CompiledStep, StepCache, build_step
from replicator.runtime.consistency import check_replicas_agree
from replicator.runtime.distributed import progress
from replicator.runtime.distributed.startup import check_initialized_under_launcher
from replicator.runtime.execution import place_batch, place_state
from replicator.runtime.gc_pause import gc_paused
from replicator.runtime.inputs import BatchSignature, InputContext, WorkerInputs, check_worker_batch
from replicator.runtime.pipelined import PipelineFront, first_batches
from replicator.runtime.retrace import warn_if_retracing
from replicator.runtime.state import broadcast_state
from replicator.runtime.state_key import (
    NO_STATE,
    ReturnedState,
    StateKey,
    array_leaves,
    merge_static,
    per_replica_key,
    state_key_of,
)
from replicator.runtime.steady import SteadyStep
from replicator.runtime.step_inputs import StepInputs, check_max_in_flight, check_prefetch

__all__ = ["CompiledStep", "Replicator"]

PyTree = Any


class Replicator:
    """Runs ``step_fn`` on ``num_workers x cores_per_worker`` replicas.

    Args:
      num_workers: workers (one per process when running multi-process).
      cores_per_worker: devices per worker; ``None`` means all local devices.
      devices: explicit devices to build the mesh from (default: all).
      passes: the pass manager (default: ``PassManager.default()``); kept as
        ``self.passes``. On a pipelined Replicator (``Parallelism(stages=S)``) only
        ``PassManager.default(zero=k)``: ZeRO on each stage's data-parallel
        replicas (``run_pipelined``).
      donate_state: let XLA reuse the state's buffers for the new state. The
        state passed to ``run`` is then invalid after the call.
      axis_name: the axis names of code written for ``jax.pmap``/``shard_map``
        and what they mean here: ``'batch'`` (all replicas) or a mapping such
        as ``{'batch': None, 'local': 'cores'}`` (groups ``None``, ``'cores'``,
        ``'workers'``). ``lax.pmean(x, 'batch')`` and Flax's
        ``BatchNorm(axis_name='batch')`` then trace unchanged and become the
        same placeholders as ``rp.all_mean``. The mesh names ``'workers'`` and
        ``'cores'`` are always bound.
      check_state_every: every this many steps, check that every replica still
        holds the same state (a host fingerprint of each device's copy, compared
        across processes with one small all-gather); the first differing leaf
        is named (:mod:`replicator.runtime.consistency`). In a pipeline, each
        stage's packed rows are compared across that stage's replicas, on every
        process, after ``run`` and ``run_pipelined``. ``None``: never.
      max_in_flight: how many dispatched steps may run ahead of the host
        before ``run`` waits for the oldest. ``None``: 2 on CPU, unbounded
        elsewhere. XLA's CPU backend deadlocks (and aborts after 40 s) when
        many executions with collectives over emulated devices are queued at
        once (reproduced with plain ``jit(shard_map(psum))``: 200 queued calls
        on 8 devices hang, 4 do not), so on CPU the queue is kept short.
      prefetch: how many batches to draw from ``input_fn`` and place on the
        devices ahead of their step (while it runs); ``0``: none. ``None``: 1
        on accelerators in one process, 0 on CPU devices and across processes
        (:mod:`replicator.runtime.step_inputs` says why, and when to turn it
        off: batches that depend on what happens after a step returns).
      pipeline_stages, microbatches, schedule, pipeline_recompute: deprecated (a
        ``DeprecationWarning`` when given other than their defaults): the older
        spellings of ``parallelism=rp.Parallelism(stages=..., microbatches=...,
        schedule=..., recompute=...)``; ``replicas_per_device`` too. They work as
        before.
      parallelism: how the devices are split between the axes (pipeline
        stages, the tensor axis, folding; the data-parallel replicas take the
        rest): a :class:`~replicator.Parallelism` (its fields say what each
        does; ``replicator/axes.py`` places them on the devices).
    """

    def __init__(
        self,
        num_workers: int = 1,
        cores_per_worker: int | None = None,
        *,
        devices: list | None = None,
        passes: PassManager | None = None,
        donate_state: bool = False,
        max_in_flight: int | None = None,
        axis_name: str | Mapping[str, str | None] | None = None,
        check_state_every: int | None = None,
        replicas_per_device: int = 1,
        prefetch: int | None = None,
        pipeline_stages: int = 1,
        microbatches: int | None = None,
        schedule: str | None = None,
        pipeline_recompute: bool = False,
        parallelism: Parallelism | None = None,
    ):
        axis_names = normalize_axis_names(axis_name)
        check_initialized_under_launcher()
        older = older_keywords(  # without parallelism=, a DeprecationWarning for those given
            parallelism,
            replicas_per_device=replicas_per_device,
            pipeline_stages=pipeline_stages,
            microbatches=microbatches,
            schedule=schedule,
            pipeline_recompute=pipeline_recompute,
        )
        axes = place_axes(num_workers, cores_per_worker, devices, parallelism, older, passes)
        self.mesh, self.fold, self.tensor, self.pipelined = axes.mesh, axes.fold, axes.tensor, axes.pipelined
        self.num_workers, self.cores_per_worker = axes.num_workers, axes.cores_per_worker
        self.context = ReplicaContext(self.num_workers, self.cores_per_worker, axis_names)
        self.passes = passes if passes is not None else PassManager.default()
        if not isinstance(self.passes, PassManager):
            raise TypeError(f"passes= must be a replicator.passes.PassManager, got {type(self.passes).__name__}.")
        self.donate_state = donate_state
        self.max_in_flight = check_max_in_flight(max_in_flight, self.mesh)
        if check_state_every is not None and (not isinstance(check_state_every, int) or check_state_every < 1):
            raise ValueError(f"check_state_every must be a positive int or None, got {check_state_every!r}.")
        self.check_state_every = check_state_every
        #: A pipelined Replicator's calls around its pipeline (the batch, the count, the state check).
        self._front = None if self.pipelined is None else PipelineFront(self.pipelined, check_state_every)
        self.prefetch = check_prefetch(prefetch, self.mesh)
        self._steps_run = 0
        self._cached_passes_key: tuple[PassManager, tuple] | None = None
        self._in_flight: collections.deque = collections.deque()
        self._compiled = StepCache()
        self._returned: ReturnedState | None = None
        self._steady: SteadyStep | None = None  # the last call, if the next one may run as it did
        self._warned_retrace: set[str] = set()
        self._batches = StepInputs(self, self._warned_retrace)
        self._inputs = self._batches.registry
        self.trace_count = 0

    #: Deprecated: the pass manager is :attr:`passes` ("pipeline" means pipeline parallelism only).
    pipeline = RenamedAttribute("passes", "Replicator.pipeline is now Replicator.passes (the PassManager).")

    # -- shape of the job ---------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return self.num_workers * self.cores_per_worker

    @property
    def local_workers(self) -> list[int]:
        """Workers whose devices belong to this process, in order."""
        me = jax.process_index()
        rows = self.fold.workers_fold
        return [w for w in range(self.num_workers) if self.mesh.devices[w // rows].flat[0].process_index == me]

    def input_context(self, worker_id: int) -> InputContext:
        return InputContext(self.num_workers, worker_id, self.cores_per_worker)

    def __repr__(self) -> str:
        return (
            f"Replicator(num_workers={self.num_workers}, cores_per_worker={self.cores_per_worker}, "
            + (f"replicas_per_device={self.fold.replicas_per_device}, " if self.fold.replicas_per_device > 1 else "")
            + f"platform={self.mesh.devices.flat[0].platform!r}, passes={self.passes!r})"
        )

    # -- tracing and compiling -----------------------------------------------

    def _passes_key(self) -> tuple:
        """``self.passes.key()``, computed once per pass manager (it is on every step's path)."""
        cached = self._cached_passes_key
        if cached is None or cached[0] is not self.passes:
            cached = self._cached_passes_key = (self.passes, self.passes.key())
        return cached[1]

    def _compile(
        self, step_fn: Callable, state: PyTree | None, batch: PyTree, per_replica_state: Any = None
    ) -> CompiledStep:
        """Trace + rewrite ``step_fn`` for a worker batch like ``batch`` (cached)."""
        state_key, _, _ = state_key_of(state)
        state_key = per_replica_key(state_key, state, per_replica_state, self.num_replicas)
        return self._lookup(step_fn, state_key, BatchSignature.of(batch, self.cores_per_worker), batch)

    #: ``(step_fn, state_key, batch_key, passes, compiled)`` of the last :meth:`_lookup`: the most recently
    #: used entry of the cache, found again by identity (no hashing) when a step repeats.
    _last_lookup: tuple | None = None

    def _lookup(
        self, step_fn: Callable, state_key: StateKey, batch_key: BatchSignature, batch: PyTree | None = None
    ) -> CompiledStep:
        """The compiled step for a state and batch signature: from the cache, or traced and rewritten now.

        The key's parts hash in constant time (their hashes are computed once), as it is looked up on every
        step. ``batch``: one worker's batch, checked before tracing (None: checked already).
        """
        if self.pipelined is not None:
            raise ValueError(
                f"this Replicator runs a pipeline ({self.pipelined!r}): call run_pipelined(loss_fn, optimizer, "
                "batch, (params, opt_state)) or run(step_fn, batch, state) (docs/guide/pipeline.md); a pipelined step "
                "has no pass-manager graph to lower: explain(step_fn, batch, state) describes it (the schedule, its "
                "bubble, per-stage compute and memory)."
            )
        key = (step_fn, state_key, batch_key, self._passes_key())
        compiled = self._compiled.lookup(key)
        if compiled is None:
            with progress.phase("compiling"), gc_paused():
                warn_if_retracing(step_fn, self._compiled, self._warned_retrace)
                if batch is not None:
                    check_worker_batch(batch, self.cores_per_worker, 0)
                compiled = build_step(
                    step_fn,
                    state_key,
                    batch_key,
                    context=self.context,
                    passes=self.passes,
                    mesh=self.mesh,
                    fold=self.fold,
                    tensor=self.tensor,
                    donate_state=self.donate_state,
                )
                self.trace_count += 1
                self._compiled.add(key, compiled)
        self._last_lookup = (step_fn, state_key, batch_key, self.passes, compiled)
        return compiled

    def lower(
        self, step_fn: Callable, batch: PyTree, state: PyTree | None = None, *, per_replica_state: Any = None
    ) -> Lowered:
        """Trace ``step_fn`` and run the passes, without executing anything.

        Args:
          step_fn: as for :meth:`run`.
          batch: one worker's batch (arrays or ``jax.ShapeDtypeStruct``), as
            ``input_fn`` would yield it.
          state: the state (arrays or ``jax.ShapeDtypeStruct``), or None.
          per_replica_state: as for :meth:`run`.

        Returns:
          A :class:`~replicator.passes.Lowered`: ``print()`` it to see the
          per-replica graph with placeholders and the graph after each pass.
        """
        return self._compile(step_fn, state, batch, per_replica_state).lowered

    def explain(
        self, step_fn: Callable, input_fn_or_batch: Any, state: PyTree | None = None, *, per_replica_state: Any = None
    ) -> CommunicationReport:
        """The collectives a step will run and what they cost, without running it.

        Args:
          step_fn: as for :meth:`run`.
          input_fn_or_batch: an ``input_fn`` (a *fresh* iterator of worker 0 is
            made and one batch drawn from it; the iterator used by :meth:`run`
            is not touched) or one worker's batch.
          state: as for :meth:`run`.
          per_replica_state: as for :meth:`run`.

        Returns:
          A :class:`~replicator.cost.report.CommunicationReport`; ``print()`` it. On a pipelined Replicator
          (``Parallelism(stages=S)``), a :class:`~replicator.stages.replicas.PipelineReport` of the step
          :meth:`run` would run: the schedule, its bubble, per stage the leaves it keeps, the cost model's
          compute and its residuals, and XLA's memory analysis of the compiled step per device.
        """
        if self.pipelined is not None:
            if per_replica_state is not None:
                raise ValueError("a pipelined Replicator keeps no per-replica state; leave per_replica_state out.")
            if callable(input_fn_or_batch):  # fresh iterators, as below: run's are not touched
                input_fn_or_batch = first_batches(
                    input_fn_or_batch, [self.input_context(w) for w in self.local_workers]
                )
            return self._front.explain(step_fn, input_fn_or_batch, state)
        batch = input_fn_or_batch
        if callable(input_fn_or_batch):
            try:
                batch = next(iter(input_fn_or_batch(self.input_context(self.local_workers[0]))))
            except StopIteration:
                raise ValueError("explain: input_fn yielded no batch to trace the step with.") from None
        return communication_report(self.lower(step_fn, batch, state, per_replica_state=per_replica_state))

    def run_pipelined(self, loss_fn: Callable, optimizer: Any, batch: PyTree, state: tuple) -> tuple:
        """One training step of ``loss_fn`` cut into ``parallelism.stages`` stages (the constructor's option).

        A narrower entry point than :meth:`run`: the loss and the optax optimizer are given apart, and the step
        run is the one a data-parallel user writes from them (``jax.value_and_grad``, ``rp.all_mean`` of the
        gradients, the optimizer's update), built as :meth:`run` builds the user's own step (with the tensor
        axis too). Guide: docs/guide/pipeline.md.

        Args:
          loss_fn: ``loss_fn(params, *batch) -> scalar``, a mean over its rows, marked with ``rp.stage_boundary``.
          optimizer: an optax transformation (a global-norm clip reads every stage's gradients).
          batch: the global batch (a tuple of arrays, or one array): ``B`` rows, ``B`` divisible by
            ``microbatches x`` the data-parallel replicas.
          state: ``(params, opt_state)`` with their global shapes.

        Returns:
          ``((params, opt_state), loss)``: equal to one device's ``jax.value_and_grad`` on the global batch
          followed by ``optimizer.update``.
        """
        if self.pipelined is None:
            raise ValueError(
                "run_pipelined needs Replicator(..., parallelism=rp.Parallelism(stages=S, microbatches=M))."
            )
        return self._front.run(loss_fn, optimizer, self._pipelined_batch(batch), state)

    def _pipelined_batch(self, data: Any) -> PyTree:
        """The global batch of a pipelined step (:meth:`~replicator.runtime.pipelined.PipelineFront.global_batch`)."""
        return self._front.global_batch(
            data, lambda fn: self._batches.worker_inputs(fn).take().batches, self.local_workers
        )

    def describe_pipeline(
        self, loss_fn: Callable, optimizer: Any, batch: PyTree, state: tuple, *, memory: bool = False
    ) -> Any:
        """What :meth:`run_pipelined` runs, without running it: the schedule, its bubble, per-stage compute
        (the cost model's, :mod:`replicator.cost.compute`, with the emulated-CPU figures) and per-stage memory;
        ``memory=True`` also compiles the step and adds XLA's memory analysis per device. ``print()`` it."""
        if self.pipelined is None:
            raise ValueError(
                "describe_pipeline needs Replicator(..., parallelism=rp.Parallelism(stages=S, microbatches=M))."
            )
        return self._front.describe(loss_fn, optimizer, batch, state, memory)

    def broadcast_state(self, state: PyTree) -> PyTree:
        """Replica 0's (process 0's) ``state`` on every replica, placed on the mesh.

        See :func:`replicator.runtime.state.broadcast_state`.
        """
        return broadcast_state(state, self)

    def wrap_optimizer(self, tx: Any, reduce: str = "mean", group: str | None = None) -> Any:
        """``tx`` whose ``update`` first all-reduces the gradients.

        See :func:`replicator.training.optim.wrap_optimizer`.
        """
        from replicator.training.optim import wrap_optimizer  # the training layer builds on this one

        return wrap_optimizer(tx, reduce=reduce, group=group)

    # -- running ---------------------------------------------------------------

    def _wait_for_room(self) -> None:
        """Bound the steps dispatched but not finished (see ``max_in_flight``)."""
        while self.max_in_flight and len(self._in_flight) >= self.max_in_flight:
            token = self._in_flight.popleft()
            if not token.is_deleted():  # a donated state was consumed by a later step
                token.block_until_ready()

    def forget_input(self, input_fn: Callable) -> None:
        """Drop the iterators of ``input_fn`` and its prefetched batches: the next ``run`` with it starts over.

        (An ``input_fn`` the caller no longer holds is dropped by itself: the Replicator refers to it weakly.)
        """
        self._inputs.forget(input_fn)  # a steady step holds its inputs weakly: no longer steady

    def input_position(self, input_fn: Callable) -> int:
        """How many batches steps have taken from each worker's iterator of ``input_fn`` (since it was started,
        or since :meth:`forget_input`); batches prefetched for later steps are not counted."""
        inputs = self._inputs.get(input_fn)
        return inputs.taken if inputs is not None else 0

    def run(
        self,
        step_fn: Callable,
        input_fn: Callable[[InputContext], Any] | Iterator[PyTree] | PyTree,
        state: PyTree | None = None,
        *,
        prefetch: int | None = None,
        per_replica_state: Any = None,
    ) -> Any:
        """Run one step on every replica with the next batch of ``input_fn``.

        Args:
          step_fn: ``step_fn(batch) -> outputs`` without state, or
            ``step_fn(state, batch) -> (new_state, outputs)`` with state. Give
            the step itself, not a ``jax.pmap`` of it (a ``TypeError`` says so).
          input_fn: where the step's batch comes from, one of:

            * ``input_fn(ctx: InputContext) -> iterable`` of a worker's
              batches; called once per worker, later calls with the same
              function continue its iterators (held as long as the function
              is: define it once, outside the loop);
            * an iterator of this process's batches: one batch is drawn from
              it per call (``rp.InputExhausted`` when it ends);
            * one batch of this process (a pytree of arrays), for this step.

            Every batch leaf is split along its leading axis over the replicas
            in order; leaves may have different numbers of rows (one row per
            replica next to many), each a multiple of the replicas it is split
            over. With one worker per process (the usual) a batch of this
            process is that worker's batch.
          state: a pytree of arrays, identical on every replica (but for the
            leaves of ``per_replica_state``), or None.
          prefetch: batches of ``input_fn`` to draw and place ahead, after this
            step is dispatched (default: the Replicator's ``prefetch``; ``0``
            for an ``input_fn`` whose batches depend on this step's outputs).
            Batches prefetched before are used first either way. Only an
            ``input_fn`` is drawn ahead; an iterator or a batch is placed when
            its step starts.
          per_replica_state: which state leaves each replica keeps its own
            copy of (as ``jax.pmap`` keeps per-device batch statistics), so
            that they may differ between replicas: a pytree prefix of
            ``state`` with a bool per subtree (``{'params': False,
            'batch_stats': True}``), a bool, or a function of a leaf's path
            (``"state['batch_stats']['mean']"``) returning one. Such a leaf
            carries a leading axis of size ``num_replicas`` in the state
            given and returned (row ``r``: replica ``r``'s copy, stored on
            its device); ``step_fn`` sees this replica's row, without the
            axis. ``None``: every leaf is identical on every replica.

        Returns:
          ``outputs`` or ``(new_state, outputs)``. The new state is one copy
          (it lives replicated on the mesh: feed it back as is; a per-replica
          leaf keeps its replica axis, split over the replicas). Every output
          leaf gets a leading axis of size ``num_replicas``, in replica order.
          In a multi-process job each process holds only its own replicas'
          rows: read them with ``rp.local_outputs`` / ``rp.replica_invariant``
          (no communication) or ``rp.gather_outputs`` (all rows, a collective).
        """
        if self.pipelined is not None:  # the update phase cut from step_fn: replicator/stages/user_step.py
            if state is None or per_replica_state is not None:
                raise ValueError(
                    f"this Replicator runs a pipeline ({self.pipelined!r}): run(step_fn, input_fn_or_batch, state) "
                    "needs a state, without per_replica_state; or call run_pipelined(loss_fn, optimizer, batch, "
                    "(params, opt_state)) (docs/guide/pipeline.md)."
                )
            out, compiled = self._front.run_step(step_fn, self._pipelined_batch(input_fn), state)
            self.trace_count += compiled  # a new shape traced and compiled
            return out
        depth = self.prefetch if prefetch is None else check_prefetch(prefetch)
        step = progress.begin_step()
        try:
            steady = self._steady  # a call like the last one: replicator/runtime/steady.py
            if (
                steady is not None
                and steady.step_fn is step_fn
                and depth == 0
                and per_replica_state is None
                and steady.passes is self.passes
                and (taken := steady.take(state, input_fn)) is not None
            ):
                return self._run_steady(steady, taken[0], taken[1], step)
            return self._run(step_fn, input_fn, state, depth, per_replica_state, step)
        finally:
            progress.end_step()

    def _run_steady(self, steady: SteadyStep, state_leaves: list, batch_leaves: list, step: int) -> Any:
        """The general path's step (:meth:`_run`) for a call like the last one, its checks done by ``steady``."""
        progress.set_phase("step", step)
        in_flight = self._in_flight  # _wait_for_room, inline: no Python call per step
        while self.max_in_flight and len(in_flight) >= self.max_in_flight:
            token = in_flight.popleft()
            if not token.is_deleted():
                token.block_until_ready()
        compiled = steady.compiled
        new_state, outputs = compiled.executable(state_leaves, batch_leaves)
        compiled.runs += 1
        if self.max_in_flight:
            in_flight.append(new_state[0])
        self._steps_run += 1
        if self.check_state_every and self._steps_run % self.check_state_every == 0:
            check_replicas_agree(new_state, compiled.lowered.final.state_paths)
        steady.returned.arrays = list(map(weakref.ref, new_state))
        traced = compiled.traced
        return traced.state_treedef.unflatten(new_state), traced.output_treedef.unflatten(outputs)

    def _run(
        self,
        step_fn: Callable,
        data: Any,
        state: PyTree | None,
        depth: int,
        per_replica_state: Any = None,
        step: int | None = None,
    ) -> Any:
        # Every step but the steady ones (run_steady) runs this: a step like the last one (same step_fn, state
        # returned by the last call, batch structure) is found by identity, with few Python calls.
        self._steady = None
        if callable(data):
            inputs: WorkerInputs | None = self._inputs.get(data) or self._batches.worker_inputs(data)
            batch = inputs.take()
        else:
            inputs, depth = None, 0
            batch = self._batches.given(data)
        self._batches.check(batch)
        placed_state = returned = None
        if state is None:
            state_key, leaves, state_def = NO_STATE, [], None
        else:
            leaves, state_def = jax.tree_util.tree_flatten(state)
            returned = self._returned
            if returned is not None and (placed_state := returned.match(leaves, state_def)) is not None:
                state_key = returned.key
            else:
                returned = None
                state_key, leaves, state_def = state_key_of(state)
            if per_replica_state is not None:
                state_key = per_replica_key(state_key, state, per_replica_state, self.num_replicas)
        last = self._last_lookup
        if (
            last is not None
            and last[0] is step_fn
            and last[1] is state_key
            and last[2] is batch.signature
            and last[3] is self.passes
        ):
            compiled = last[4]
        else:
            compiled = self._lookup(step_fn, state_key, batch.signature)
        progress.set_phase(
            "compiling" if compiled.runs == 0 else "step", progress.current_step() if step is None else step
        )
        traced = compiled.traced
        # The state the last call returned, from this compiled step, is laid out as it needs.
        same_step = returned is not None and returned.compiled is compiled and per_replica_state is None
        if not same_step:
            sharded_state = compiled.lowered.final.sharded_state
            if placed_state is None or returned.sharded_state != sharded_state:
                placed_state = place_state(
                    array_leaves(leaves, traced.static_state), self.mesh, sharded_state, compiled.lowered.final.tensor
                )
        if batch.placed is None:
            # Without prefetch, host leaves go to the compiled step as they are: its own dispatch places them
            # (faster than a device_put of ours). With prefetch every batch is placed here, as the prefetched
            # ones are: the compiled step is given placed arrays every time (numpy and placed arrays are two
            # entries of jit's cache, each compiled).
            batch.placed = place_batch(
                batch.leaves, self.mesh, self.num_workers, nbytes=batch.signature.nbytes, host=depth == 0
            )
        self._wait_for_room()
        if compiled.runs:
            new_state, outputs = compiled.executable(placed_state, batch.placed)
        else:
            with gc_paused():  # the first call lowers the step and compiles it with XLA
                new_state, outputs = compiled.executable(placed_state, batch.placed)
        if compiled.runs == 0 and new_state:  # would place_state take the new state as it is?
            sharded_state = compiled.lowered.final.sharded_state
            compiled.state_reusable = not any(getattr(a, "weak_type", False) for a in new_state) and all(
                a is b
                for a, b in zip(
                    place_state(new_state, self.mesh, sharded_state, compiled.lowered.final.tensor),
                    new_state,
                    strict=True,
                )
            )
        compiled.runs += 1
        if self.max_in_flight and (new_state or outputs):
            self._in_flight.append((new_state or outputs)[0])
        self._steps_run += 1
        if depth:
            self._batches.prefetch(inputs, depth)
        if self.check_state_every and self._steps_run % self.check_state_every == 0 and new_state:
            check_replicas_agree(new_state, compiled.lowered.final.state_paths)
        outputs = traced.output_treedef.unflatten(outputs)
        if state is None:
            return outputs
        statics = traced.static_state
        new_leaves = merge_static(new_state, statics, traced.state_treedef.num_leaves) if statics else new_state
        if same_step and compiled.state_reusable:
            returned.arrays = list(map(weakref.ref, new_state))  # its key, structure and layout are the same
        elif compiled.state_reusable and per_replica_state is None:
            self._returned = ReturnedState(
                state_key,
                state_def,
                new_state,
                statics,
                len(new_leaves),
                compiled.lowered.final.sharded_state,
                compiled,
            )
        if not depth and not statics and new_state and compiled.state_reusable and per_replica_state is None:
            self._steady = SteadyStep.after(step_fn, data, inputs, self.passes, compiled, self._returned, batch)
        return traced.state_treedef.unflatten(new_leaves), outputs
