"""The pass pipeline: ordered named passes, checked, dumped, disableable.

A :class:`Pipeline` runs its passes in order on a :class:`StepGraph` and keeps
every intermediate graph (a :class:`Stage`) so users can see what each pass
did. Around each pass it can run the invariant checks of
:mod:`replicator.passes.verify` (``verify=True``), write the graph before and
after each pass into a directory (``dump_dir=`` or the environment variable
``REPLICATOR_DUMP_DIR``), and skip passes by name (``disable=``). A pass
that fails is re-raised naming it and the passes that ran before it.

Example::

    pipe = Pipeline.default(disable=["check-replica-invariance"], verify=True)
    lowered = pipe.run(graph)
    print(lowered)            # the graph after each pass
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from replicator.errors import PassError, ReplicationError
from replicator.passes.base import Pass, StepGraph
from replicator.passes.capture import CaptureCollectives
from replicator.passes.compress import CompressCommunication
from replicator.passes.fold import FoldLayout
from replicator.passes.fuse_allreduce import DEFAULT_MAX_TENSOR_BYTES, DEFAULT_THRESHOLD_BYTES, FuseAllReduce
from replicator.passes.hierarchical import HierarchicalAllReduce
from replicator.passes.invariance import CheckReplicaInvariance
from replicator.passes.lower_collectives import LowerCollectives
from replicator.passes.shard_optimizer import DEFAULT_MIN_TENSOR_BYTES, ShardOptimizerUpdate
from replicator.passes.simplify import Simplify
from replicator.passes.validate import GraphRunner, compare_results, validate_from_env
from replicator.passes.verify import GraphInvariantError, check_defined, verify_graph

__all__ = ["DUMP_ENV", "VERIFY_ENV", "Lowered", "Pipeline", "Stage", "default_passes"]

DUMP_ENV = "REPLICATOR_DUMP_DIR"
VERIFY_ENV = "REPLICATOR_VERIFY"


def _flag_from_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def default_passes(
    *,
    shard_optimizer: bool = False,
    shard_optimizer_min_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    hierarchical: bool = False,
    compress: bool = False,
    all_reduce_algorithm: str = "native",
    fuse_threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
    fuse_max_tensor_bytes: int | None = DEFAULT_MAX_TENSOR_BYTES,
) -> list[Pass]:
    """The default pipeline, in order, with its optional passes switched.

    Raw ``lax`` collectives become placeholders first (``capture-collectives``);
    checks run next so their errors point at the collectives the user wrote;
    optimizations work on placeholders; lowering comes last. The defaults
    were chosen by ``benchmarks/bench_step.py`` (see BENCHMARKS.md).

    Args:
      shard_optimizer: ZeRO-1 (``shard-optimizer-update``): reduce-scatter
        gradients, update and store element-wise optimizer state in 1/N chunks.
        Off by default: it divides optimizer-state memory by N but was not
        faster on every workload measured (BENCHMARKS.md).
      shard_optimizer_min_bytes: with ``shard_optimizer``, smaller gradients
        and state leaves stay whole.
      hierarchical: ``hierarchical-allreduce`` over ('workers', 'cores').
      compress: ``compress-communication``: f32 all-reduce payloads as bf16.
      all_reduce_algorithm: ``'native'``, ``'ring'`` or ``'reduce_broadcast'``.
      fuse_threshold_bytes: the largest fused all-reduce bucket.
      fuse_max_tensor_bytes: larger tensors are not fused (``None``: all are).

    Example::

        repl = rp.Replicator(2, 4, passes=rp.Pipeline(default_passes(hierarchical=True)))
    """
    passes: list[Pass] = [CaptureCollectives(), CheckReplicaInvariance(), Simplify()]
    if shard_optimizer:
        passes.append(ShardOptimizerUpdate(min_tensor_bytes=shard_optimizer_min_bytes))
    passes.append(FuseAllReduce(threshold_bytes=fuse_threshold_bytes, max_tensor_bytes=fuse_max_tensor_bytes))
    if compress:
        passes.append(CompressCommunication())
    if hierarchical:
        passes.append(HierarchicalAllReduce())
    passes.append(LowerCollectives(algorithms={"all_reduce": all_reduce_algorithm}))
    return passes


@dataclasses.dataclass(frozen=True)
class Stage:
    """The graph after one pass (``name='traced'`` for the input)."""

    name: str
    graph: StepGraph
    changed: bool

    def __str__(self) -> str:
        flag = "changed" if self.changed else "unchanged"
        return (
            f"=== after {self.name} ({flag}) ===\n{self.graph.jaxpr}"
            if self.name != "traced"
            else (f"=== traced (per replica, with placeholders) ===\n{self.graph.jaxpr}")
        )


@dataclasses.dataclass(frozen=True)
class Lowered:
    """Every stage of a step through the pipeline; ``str()`` prints them all."""

    stages: tuple[Stage, ...]
    #: What the pipeline wants a reader to know (``auto=True``: the options it chose and why).
    notes: tuple[str, ...] = ()

    @property
    def traced(self) -> StepGraph:
        """The per-replica graph with placeholders, before any pass."""
        return self.stages[0].graph

    @property
    def final(self) -> StepGraph:
        """The graph that runs: every placeholder lowered."""
        return self.stages[-1].graph

    def after(self, pass_name: str) -> StepGraph:
        """The graph right after the pass named ``pass_name``."""
        for stage in self.stages:
            if stage.name == pass_name:
                return stage.graph
        raise KeyError(f"no pass named {pass_name!r} ran; ran: {[s.name for s in self.stages[1:]]}")

    def __str__(self) -> str:
        return "\n\n".join(str(s) for s in self.stages)


class Pipeline:
    """An ordered list of passes, itself usable like one pass.

    Args:
      passes: the passes in order (default: :func:`default_passes`).
      disable: names of passes to skip; required passes cannot be skipped.
      verify: run the invariant checks before the first and after every pass
        (default: the ``REPLICATOR_VERIFY`` environment variable; the test
        suite sets it). Off otherwise: the type-check costs about as much as
        tracing and all passes together (:mod:`replicator.passes.verify`).
        Without it, every pass is still checked not to read an undefined
        variable. A broken graph raises
        :class:`~replicator.passes.verify.GraphInvariantError` naming the pass.
      validate: translation validation (:mod:`replicator.passes.validate`):
        execute the graph before and after every pass on random inputs and
        raise :class:`~replicator.errors.MiscompileError` if a result changed
        (default: the ``REPLICATOR_VALIDATE`` environment variable).
      dump_dir: write ``NN-<pass>.before.txt``/``.after.txt`` here (default: the
        ``REPLICATOR_DUMP_DIR`` environment variable, if set).
    """

    def __init__(
        self,
        passes: Sequence[Pass] | None = None,
        *,
        disable: Iterable[str] = (),
        verify: bool | None = None,
        validate: bool | None = None,
        dump_dir: str | os.PathLike | None = None,
    ):
        self.passes = list(default_passes() if passes is None else passes)
        for p in self.passes:
            if not isinstance(p, Pass):
                raise TypeError(f"Pipeline: {p!r} is not a replicator.passes.Pass instance.")
        names = [p.name for p in self.passes]
        self.disabled = frozenset(disable)
        unknown = self.disabled - set(names)
        if unknown:
            raise ValueError(f"Pipeline(disable=...): no pass named {sorted(unknown)}; the passes are {names}.")
        _check_order(self.passes)
        required = [p.name for p in self.passes if p.required and p.name in self.disabled]
        if required:
            raise ValueError(f"Pipeline: pass {required} is required for the step to run and cannot be disabled.")
        self.verify = _flag_from_env(VERIFY_ENV) if verify is None else bool(verify)
        self.validate = validate_from_env() if validate is None else bool(validate)
        self.dump_dir = dump_dir if dump_dir is not None else os.environ.get(DUMP_ENV) or None

    @classmethod
    def default(
        cls,
        *,
        disable: Iterable[str] = (),
        verify: bool | None = None,
        validate: bool | None = None,
        dump_dir: str | os.PathLike | None = None,
        auto: bool = False,
        topology: Any = "cpu-emulated",
        **options: Any,
    ) -> Pipeline:
        """The default passes with ``options`` (see :func:`default_passes`).

        With ``auto=True``, fusion buckets, ZeRO, hierarchical all-reduce and
        the all-reduce algorithm are chosen for each compiled step by the
        communication cost model on ``topology`` (a preset name or a
        calibrated :class:`~replicator.passes.costmodel.Topology`):
        :class:`~replicator.passes.auto.AutoPipeline`.
        """
        settings = dict(disable=disable, verify=verify, validate=validate, dump_dir=dump_dir)
        if auto:
            from replicator.passes.auto import AutoPipeline

            return AutoPipeline(topology, options=options, **settings)
        return cls(default_passes(**options), **settings)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def key(self) -> tuple:
        """Hashable identity of the configuration (for compile caches)."""
        return (tuple(repr(p) for p in self.passes), self.disabled, self.verify, self.validate)

    def __repr__(self) -> str:
        active = [p.name for p in self.passes if p.name not in self.disabled]
        return f"Pipeline({active})"

    def run(self, graph: StepGraph, *, fold: FoldLayout | None = None) -> Lowered:
        """Every pass in order on ``graph``; ``fold``: how replicas sit on devices (for ``validate``)."""
        stages = [Stage("traced", graph, False)]
        ran: list[str] = []
        runner = GraphRunner(graph, fold=fold) if self.validate else None
        results = runner.run(graph) if runner else None
        if self.verify:
            try:
                verify_graph(graph, lowered=False)
            except GraphInvariantError as e:
                raise GraphInvariantError(f"the traced step graph (before any pass) is broken: {e}") from e
        for index, p in enumerate(self.passes):
            if p.name in self.disabled:
                continue
            self._dump(index, p.name, "before", graph)
            try:
                result = p.run(graph)
                if result.graph is not graph:  # an unchanged graph was checked already
                    check_defined(result.graph)
                    if self.verify:
                        verify_graph(result.graph, lowered=isinstance(p, LowerCollectives) or _lowered(ran))
            except GraphInvariantError as e:
                raise GraphInvariantError(
                    f"pass '{p.name}' (after {ran or 'no other pass'}) produced a broken graph: {e}\n"
                    f"This is a bug in the pass. Disable it with Pipeline(disable=['{p.name}']) and please "
                    f"report the step with the graphs around the pass (REPLICATOR_DUMP_DIR=dir)."
                ) from e
            except ReplicationError as e:
                e.add_note(f"(raised by pass '{p.name}' after {ran or 'no other pass'})")
                raise
            except Exception as e:
                raise PassError(
                    f"pass '{p.name}' failed after passes {ran or '[]'}: {type(e).__name__}: {e}\n"
                    f"Disable it with Replicator(..., passes=Pipeline(disable=['{p.name}'])) and "
                    f"please report the failing step."
                ) from e
            if runner is not None and result.graph is not graph:  # even if it says unchanged
                new_results = runner.run(result.graph)
                compare_results(results, new_results, graph, p.name, exact=p.exact)
                results = new_results
            graph = result.graph
            ran.append(p.name)
            stages.append(Stage(p.name, graph, result.changed))
            self._dump(index, p.name, "after", graph)
        return Lowered(tuple(stages))

    def _dump(self, index: int, name: str, when: str, graph: StepGraph) -> None:
        if not self.dump_dir:
            return
        os.makedirs(self.dump_dir, exist_ok=True)
        safe = re.sub(r"[^a-z0-9-]", "_", name)
        with open(os.path.join(self.dump_dir, f"{index:02d}-{safe}.{when}.txt"), "w") as f:
            f.write(str(graph.jaxpr))


def _check_order(passes: Sequence[Pass]) -> None:
    """Raise ``ValueError`` naming both passes if the order breaks a declared constraint."""
    lowering: Pass | None = None
    for index, p in enumerate(passes):
        library = [q.name for q in passes[:index] if type(q).__module__.startswith("replicator.passes")]
        if p.first and library:
            raise ValueError(
                f"Pipeline: pass '{p.name}' must come before the library's passes (they expect what it produces), "
                f"but comes after '{library[0]}'. Move '{p.name}' to the front."
            )
        if p.needs_placeholders and lowering is not None:
            raise ValueError(
                f"Pipeline: pass '{p.name}' works on placeholders but comes after '{lowering.name}', which "
                f"replaces them, so it would do nothing. Put '{p.name}' before '{lowering.name}'."
            )
        later = [q.name for q in passes[index + 1 :] if q.name in p.run_after]
        if later:
            raise ValueError(
                f"Pipeline: pass '{p.name}' must run after '{later[0]}' (it rewrites what '{later[0]}' "
                f"produces), but comes before it. Move '{later[0]}' before '{p.name}'."
            )
        if p.lowers:
            lowering = p
    return None


def _lowered(ran: list[str]) -> bool:
    return LowerCollectives.name in ran
