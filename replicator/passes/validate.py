"""Translation validation: run the graph before and after a pass and compare.

With ``Pipeline(validate=True)`` (or the environment variable
``REPLICATOR_VALIDATE=1``), every pass's result is executed on the mesh with
the same inputs as the graph before it, and every new-state and output leaf
is compared. A difference beyond a dtype-aware tolerance raises
:class:`~replicator.errors.MiscompileError` naming the pass, the first
differing leaf and the size of the difference.

Inputs are random and fixed by a seed: state identical on every replica (as
``Replicator.run`` guarantees), batch rows different on every replica. A
graph that still holds placeholders runs after the plain native lowering
(``LowerCollectives()``); state leaves that a pass stores sharded
(``StepGraph.sharded_state``) are fed as this replica's chunk and compared
whole. Compile time grows by one compilation per pass: use it to check a
pipeline, not in production.

Example::

    repl = rp.Replicator(1, 8, passes=rp.Pipeline.default(shard_optimizer=True, validate=True))
    repl.lower(step_fn, batch, state)   # raises MiscompileError if a pass changed a result
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from replicator.errors import MiscompileError
from replicator.passes.base import StepGraph, iter_eqns
from replicator.primitives import PLACEHOLDERS

__all__ = ["VALIDATE_ENV", "GraphRunner", "compare_results", "validate_from_env"]

VALIDATE_ENV = "REPLICATOR_VALIDATE"


def validate_from_env() -> bool:
    return os.environ.get(VALIDATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _random_leaf(rng: np.random.Generator, aval: Any, shape: tuple[int, ...]) -> np.ndarray:
    dtype = np.dtype(aval.dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 4, size=shape).astype(dtype)
    return rng.normal(size=shape).astype(dtype)


class GraphRunner:
    """Runs step graphs of one traced step on the mesh with one fixed set of inputs."""

    def __init__(self, graph: StepGraph, seed: int = 0):
        from replicator.mesh import build_mesh

        ctx = graph.context
        self.mesh = build_mesh(ctx.num_workers, ctx.cores_per_worker)
        self.replicas = ctx.num_replicas
        rng = np.random.default_rng(seed)
        invars = graph.jaxpr.jaxpr.invars
        self.state = [_random_leaf(rng, v.aval, v.aval.shape) for v in invars[: graph.num_state]]
        # Every replica's own rows, stacked along the leading axis (as execution shards them).
        self.batch = [
            _random_leaf(rng, v.aval, (self.replicas * v.aval.shape[0], *v.aval.shape[1:]))
            for v in invars[graph.num_state :]
        ]

    def run(self, graph: StepGraph) -> list[np.ndarray]:
        """New state (whole) and outputs (stacked per replica) of ``graph``."""
        from replicator.execution import build_executable, place_batch, place_state
        from replicator.passes.lower_collectives import LowerCollectives

        if any(e.primitive in PLACEHOLDERS for e in iter_eqns(graph.jaxpr.jaxpr)):
            graph = LowerCollectives().run(graph).graph
        executable = build_executable(graph, self.mesh)
        state = place_state(self.state, self.mesh, graph.sharded_state)
        c = self.mesh.shape["cores"]
        workers = [
            [b[w * c * len(b) // self.replicas : (w + 1) * c * len(b) // self.replicas] for b in self.batch]
            for w in range(self.replicas // c)
        ]
        new_state, outputs = executable(state, place_batch(workers, self.mesh))
        return [np.asarray(x) for x in jax.device_get([*new_state, *outputs])]


def _tolerance(reference: np.ndarray, exact: bool) -> float:
    scale = max(1.0, float(np.max(np.abs(reference)))) if reference.size else 1.0
    eps = float(np.finfo(reference.dtype).eps) if np.issubdtype(reference.dtype, np.floating) else 0.0
    if not exact:  # the pass changes precision (bf16 on the wire): 8 mantissa bits, summed over replicas
        return 8 * 2.0**-8 * scale
    return max(2e-4 * scale, 64 * eps * scale)


def compare_results(
    before: list[np.ndarray], after: list[np.ndarray], graph: StepGraph, pass_name: str, exact: bool
) -> None:
    """Raise :class:`MiscompileError` at the first leaf where ``after`` differs from ``before``."""
    paths = [*(f"new {p}" for p in graph.state_paths), *graph.output_paths]
    for path, b, a in zip(paths, before, after, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise MiscompileError(
                f"pass '{pass_name}' changed {path} from {b.dtype}{list(b.shape)} to {a.dtype}{list(a.shape)}."
                + _how_to_report(pass_name)
            )
        if not np.issubdtype(b.dtype, np.inexact):
            if not np.array_equal(a, b):
                bad = int(np.sum(a != b))
                raise MiscompileError(
                    f"pass '{pass_name}' changed {path}: {bad} of {b.size} elements differ "
                    f"(e.g. {a.ravel()[np.argmax(a.ravel() != b.ravel())]} instead of "
                    f"{b.ravel()[np.argmax(a.ravel() != b.ravel())]})." + _how_to_report(pass_name)
                )
            continue
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        both_nan = np.isnan(a) & np.isnan(b)
        worst = float(np.max(np.where(both_nan, 0.0, diff), initial=0.0))
        if not worst <= _tolerance(b, exact):
            rel = worst / max(float(np.max(np.abs(b), initial=0.0)), 1e-30)
            raise MiscompileError(
                f"pass '{pass_name}' changed {path}: max |difference| {worst:.3g} (relative {rel:.3g}, "
                f"tolerance {_tolerance(b, exact):.3g})." + _how_to_report(pass_name)
            )


def _how_to_report(pass_name: str) -> str:
    return (
        f"\nThe pass miscompiled this step. Work around it with Pipeline(disable=['{pass_name}']) "
        f"(or its Pipeline.default option); please report the step with the graphs around the pass "
        f"(REPLICATOR_DUMP_DIR=dir) and the output of rp.passes.bisect_passes."
    )
