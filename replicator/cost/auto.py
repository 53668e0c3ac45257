"""``PassManager.default(auto=True)``: pass options chosen per graph by the communication cost model.

For each step it compiles, an :class:`AutoPassManager` runs the default passes
under several option settings and keeps the one whose collectives the cost
model (:mod:`replicator.cost.collectives`) predicts fastest on its topology.
The search is a steepest descent from the default setting: each round tries
every setting one option away from the current one and moves to the fastest
while it is predicted strictly faster (so ZeRO is weighed against the
defaults, not only after another option was fixed), over:

* ``all_reduce_algorithm``: ``'native'``, ``'ring'``, ``'reduce_broadcast'``;
* ``hierarchical``: on or off (meshes with several workers and cores);
* fusion: buckets of 64 MiB (the default), 1 MiB, 64 KiB, or off;
* ``shard_optimizer`` (ZeRO-1): on or off.

Each setting is judged by the predicted time of its collectives plus, when
the topology has a compute model (every preset does;
:mod:`replicator.cost.compute`), the predicted time of the graph's own
work: ZeRO's sharded update does ``1/N`` of the optimizer's element-wise work,
fusion adds the copies that pack its buckets. ``compress`` (a precision
change) is never tried, and ties keep the default. The choice and the
predicted times are in ``Lowered.notes`` and in ``explain``'s report.

>>> repl = rp.Replicator(2, 4, passes=rp.PassManager.default(auto=True, topology="gpu-hosts-100gbe"))
>>> report = repl.explain(lambda b: rp.all_sum(b), np.ones((8, 4), np.float32))
>>> "auto (gpu-hosts-100gbe)" in str(report)
True
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable
from typing import Any

from replicator.core.graph import StepGraph
from replicator.core.layout import FoldLayout
from replicator.pass_manager.manager import HOOKS, Lowered, PassManager
from replicator.passes.defaults import default_passes

__all__ = ["AutoPassManager", "SEARCH"]

FUSION = "fuse-collectives"

#: The options tried, in order, each as (name, values other than the default).
SEARCH: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("all_reduce_algorithm", ("ring", "reduce_broadcast")),
    ("hierarchical", (True,)),
    ("fusion", (1 << 20, 64 << 10, None)),  # bucket bytes; None: fusion off
    ("shard_optimizer", (True,)),
)


class AutoPassManager(PassManager):
    """The default passes, their options chosen per graph (see the module docstring).

    ``passes`` and ``names`` are every pass it may choose (the default passes with
    each searched option on); which of them ran for a step is in that step's
    ``Lowered.snapshots`` and its ``notes``.

    Args:
      topology: a preset name of :data:`~replicator.cost.collectives.PRESETS`
        or a :class:`~replicator.cost.collectives.Topology` (``calibrate()``).
      options: fixed options of :func:`default_passes` (not searched).
      disable, verify, validate, dump_dir: as for :class:`PassManager`.
    """

    def __init__(
        self,
        topology: Any,
        *,
        options: dict | None = None,
        disable: Iterable[str] = (),
        verify: bool | None = None,
        validate: bool | None = None,
        dump_dir: str | os.PathLike | None = None,
    ):
        from replicator.cost.topology import get_topology

        self.topology = get_topology(topology)
        self.options = dict(options or {})
        fixed = set(self.options) & {name for name, _ in SEARCH}
        if fixed:
            raise ValueError(
                f"PassManager.default(auto=True) chooses {sorted(fixed)} itself; drop them, or use auto=False to fix them."
            )
        self._settings = dict(disable=tuple(disable), verify=verify, validate=validate, dump_dir=dump_dir)
        candidates = default_passes(**self.options, hierarchical=True, shard_optimizer=True)
        super().__init__(candidates, **self._settings)

    def key(self) -> tuple:
        return (*super().key(), "auto", repr(self.topology))

    def __repr__(self) -> str:
        return f"PassManager(auto, topology={self.topology.name!r})"

    def _passes(self, setting: dict) -> PassManager:
        options = dict(self.options)
        disable = list(self._settings["disable"])
        for name, value in setting.items():
            if name == "fusion":
                if value is None:
                    disable.append(FUSION)
                else:
                    options["fuse_threshold_bytes"] = value
            else:
                options[name] = value
        passes = default_passes(**options)
        present = {p.name for p in passes}  # the user may disable a candidate this setting leaves out
        settings = {**self._settings, "disable": [name for name in disable if name in present]}
        return PassManager(passes, **settings)

    def predicted_seconds(self, final: StepGraph) -> float:
        """The cost model's time for a lowered graph: its collectives, plus its own work if the topology has a compute model."""
        communication, compute = self.predicted_parts(final)
        return communication + compute

    def predicted_parts(self, final: StepGraph) -> tuple[float, float]:
        """(communication, compute) seconds of a lowered graph (compute 0 without a compute model)."""
        from replicator.cost.collectives import collective_time
        from replicator.cost.compute import compute_time

        workers = final.context.num_workers
        communication = sum(collective_time(r, self.topology, num_workers=workers) for r in final.collectives)
        compute = compute_time(final.jaxpr.jaxpr, self.topology.compute) if self.topology.compute else 0.0
        return communication, compute

    def run(self, graph: StepGraph, *, fold: FoldLayout | None = None) -> Lowered:
        ctx = graph.context
        tried: list[tuple[dict, float]] = []

        def attempt(setting: dict) -> tuple[Lowered, float]:
            lowered = self._passes(setting).run(graph, fold=fold)
            seconds = self.predicted_seconds(lowered.final)
            tried.append((setting, seconds))
            return lowered, seconds

        names = [n for n, _ in SEARCH if n != "hierarchical" or (ctx.num_workers > 1 and ctx.cores_per_worker > 1)]
        setting: dict = {}
        best, best_s = attempt(setting)
        seen = {_key(setting)}
        # Steepest descent over single-option changes: each round tries every setting one option
        # away from the current one and moves to the fastest, while that is strictly faster.
        while True:
            step = None
            for trial in _neighbours(setting, names):
                if _key(trial) in seen:
                    continue
                seen.add(_key(trial))
                lowered, seconds = attempt(trial)
                if seconds < best_s * (1 - 1e-6) and (step is None or seconds < step[2]):
                    step = (trial, lowered, seconds)
            if step is None:  # ties keep the current setting (the default, first)
                break
            setting, best, best_s = step
        communication, compute = self.predicted_parts(best.final)
        work = f" + {compute * 1e6:.1f} us of compute" if self.topology.compute else ""
        note = (
            f"auto ({self.topology.name}): chose {_describe(setting)}, predicted {communication * 1e6:.1f} us of "
            f"communication{work} per step; tried {len(tried)} settings (default: {tried[0][1] * 1e6:.1f} us)"
        )
        return dataclasses.replace(best, notes=(*best.notes, note))


def _key(setting: dict) -> tuple:
    return tuple(sorted(setting.items(), key=lambda item: item[0]))


def _neighbours(setting: dict, names: list[str]) -> Iterable[dict]:
    """Every setting that differs from ``setting`` in one option (absent: the default value)."""
    values = dict(SEARCH)
    for name in names:
        if name in setting:
            yield {k: v for k, v in setting.items() if k != name}
        for value in values[name]:
            if setting.get(name, _DEFAULT) != value:
                yield {**setting, name: value}


_DEFAULT = object()


def _describe(setting: dict) -> str:
    if not setting:
        return "the defaults"
    parts = []
    for name, value in setting.items():
        if name == "fusion":
            parts.append("fusion off" if value is None else f"fusion buckets of {value} bytes")
        else:
            parts.append(f"{name}={value!r}")
    return ", ".join(parts)


HOOKS.auto_pass_manager = AutoPassManager


def __getattr__(name: str) -> Any:
    if name == "AutoPipeline":  # the old name ("pipeline" means pipeline parallelism only)
        warnings.warn(
            "replicator.cost.auto.AutoPipeline is now replicator.cost.auto.AutoPassManager.",
            DeprecationWarning,
            stacklevel=2,
        )
        return AutoPassManager
    raise AttributeError(f"module 'replicator.cost.auto' has no attribute {name!r}")
