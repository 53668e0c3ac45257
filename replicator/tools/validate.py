"""Translation validation: run the graph before and after a pass and compare.

With ``PassManager(validate=True)`` (or the environment variable
``REPLICATOR_VALIDATE=1``), every pass's result is executed on the mesh with
the same inputs as the graph before it, and every new-state and output leaf
is compared. A difference beyond a dtype-aware tolerance raises
:class:`~replicator.errors.MiscompileError` naming the pass, the first
differing leaf and the size of the difference.

Inputs are random and fixed by a seed: state identical on every replica (as
``Replicator.run`` guarantees), batch rows different on every replica;
floats normal, ints in ``[0, 4)`` (safe as small indices), random bools and
PRNG keys. Tolerance: ints, bools and keys must match exactly, NaN and
infinities where they were; a float leaf may move by ``max(2e-4, 64 eps) *
max(1, max |before|)``, or, after a pass that declares ``exact = False`` (it
changes precision on purpose: ``compress-communication`` sends bf16) and
after every pass that follows it (a ring all-reduce then reorders a bf16
sum), by ``8 * 2**-8 * max(1, max |before|)``. A
graph that still holds placeholders runs after the plain native lowering
(``LowerCollectives()``); state leaves that a pass stores sharded
(``StepGraph.sharded_state``) are fed as this replica's chunk and compared
whole. Compile time grows by one compilation per pass: use it to check a
pass manager, not in production.

Example::

    repl = rp.Replicator(1, 8, passes=rp.PassManager.default(shard_optimizer=True, validate=True))
    repl.lower(step_fn, batch, state)   # raises MiscompileError if a pass changed a result
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from replicator.core.buffers import is_floating
from replicator.core.graph import StepGraph
from replicator.core.jaxprs import iter_eqns
from replicator.core.layout import FoldLayout
from replicator.core.primitives import PLACEHOLDERS
from replicator.errors import MiscompileError
from replicator.pass_manager.manager import HOOKS
from replicator.passes.fold import FoldReplicas

__all__ = ["GraphRunner", "compare_results"]


def _random_leaf(rng: np.random.Generator, dtype: Any, shape: tuple[int, ...]) -> Any:
    """Normal floats, small ints (safe as indices), bools, or PRNG keys of ``shape``."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        bits = rng.integers(0, 2**32, size=data.shape, dtype=np.uint64).astype(np.uint32)
        return jax.random.wrap_key_data(bits, impl=dtype._impl)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 4, size=shape).astype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(dtype)
    return rng.normal(size=shape).astype(dtype)


def _to_host(x: Any) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)  # keys are compared bit for bit
    return np.asarray(jax.device_get(x))


class GraphRunner:
    """Runs step graphs of one traced step on the mesh, always on the same inputs.

    Args:
      graph: the traced step (its avals give the input shapes).
      seed: seed of the random inputs.
      state: the state leaves to use instead of random ones (whole values,
        as ``Replicator.run`` takes them).
      batch: the batch leaves to use instead of random ones: every replica's
        rows stacked in replica order (the batches of all workers,
        concatenated), leading axis ``num_replicas *`` the traced rows.
      mesh: the ``('workers', 'cores')`` mesh to run on (default: the first
        devices, shaped like ``graph.context``, or like ``fold.device_mesh``).
      fold: run several replicas per device (:mod:`replicator.passes.fold`).
    """

    def __init__(
        self,
        graph: StepGraph,
        seed: int = 0,
        *,
        state: Sequence[Any] | None = None,
        batch: Sequence[Any] | None = None,
        mesh: Mesh | None = None,
        fold: FoldLayout | None = None,
    ):
        from replicator.runtime.mesh import build_mesh

        ctx = graph.context
        self.fold = fold if fold is not None and fold.replicas_per_device > 1 else None
        device_mesh = self.fold.device_mesh if self.fold else (ctx.num_workers, ctx.cores_per_worker)
        self.mesh = mesh if mesh is not None else build_mesh(*device_mesh)
        self.replicas = ctx.num_replicas
        rng = np.random.default_rng(seed)
        invars = graph.jaxpr.jaxpr.invars
        state_avals = [v.aval for v in invars[: graph.num_state]]
        batch_avals = [v.aval for v in invars[graph.num_state :]]
        # Replica-identical state (as Replicator.run guarantees); every replica's own batch rows.
        state_shapes = [a.shape for a in state_avals]
        batch_shapes = [(self.replicas * a.shape[0], *a.shape[1:]) for a in batch_avals]
        self.state = _given("state", state, state_avals, state_shapes) or [
            _random_leaf(rng, a.dtype, sh) for a, sh in zip(state_avals, state_shapes, strict=True)
        ]
        self.batch = _given("batch", batch, batch_avals, batch_shapes) or [
            _random_leaf(rng, a.dtype, sh) for a, sh in zip(batch_avals, batch_shapes, strict=True)
        ]

    def run(self, graph: StepGraph) -> list[np.ndarray]:
        """New state (whole) and outputs (stacked per replica) of ``graph``, on the host."""
        from replicator.passes.lower_collectives import LowerCollectives
        from replicator.runtime.execution import build_executable, place_state, sharded

        if any(e.primitive in PLACEHOLDERS for e in iter_eqns(graph.jaxpr.jaxpr)):
            graph = LowerCollectives().run(graph).graph  # the plain native lowering
        if self.fold is not None:
            graph = FoldReplicas(self.fold).run(graph).graph
        executable = build_executable(graph, self.mesh, fold=self.fold)
        state = place_state(self.state, self.mesh, graph.sharded_state)
        batch = [jax.device_put(b, sharded(self.mesh)) for b in self.batch]
        new_state, outputs = executable(state, batch)
        return [_to_host(x) for x in [*new_state, *outputs]]


def _given(what: str, leaves: Sequence[Any] | None, avals: list, shapes: list) -> list | None:
    if leaves is None:
        return None
    leaves = list(leaves)
    want = [f"{a.dtype}{list(sh)}" for a, sh in zip(avals, shapes, strict=True)]
    got = [f"{jnp.result_type(x)}{list(np.shape(x))}" for x in leaves]
    if want != got:
        raise ValueError(
            f"GraphRunner: the given {what} leaves are {got}, but the traced step takes {want} "
            f"(the batch: every replica's rows, stacked)."
        )
    return leaves


def _tolerance(reference: np.ndarray, dtype: np.dtype, exact: bool) -> float:
    """Absolute tolerance for a float leaf: relative to its largest finite magnitude (at least 1)."""
    scale = max(1.0, float(np.max(np.abs(reference[np.isfinite(reference)]), initial=0.0)))
    if not exact:  # the pass changes precision (bf16 on the wire): 8 mantissa bits, summed over replicas
        return 8 * 2.0**-8 * scale
    return max(2e-4 * scale, 64 * float(jnp.finfo(dtype).eps) * scale)


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
        if not is_floating(b.dtype, include_complex=True):
            if not np.array_equal(a, b):
                bad = int(np.sum(a != b))
                first = int(np.argmax(a.ravel() != b.ravel()))
                raise MiscompileError(
                    f"pass '{pass_name}' changed {path}: {bad} of {b.size} elements differ "
                    f"(e.g. element {first}: {a.ravel()[first]} instead of {b.ravel()[first]})."
                    + _how_to_report(pass_name)
                )
            continue
        wide = np.complex128 if np.iscomplexobj(b) else np.float64
        a64, b64 = a.astype(wide), b.astype(wide)
        same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))  # equal infinities and NaN in both agree
        with np.errstate(invalid="ignore"):  # inf - inf where both agree, masked by `same`
            diff = np.where(same, 0.0, np.abs(a64 - b64))  # NaN where only one side is NaN: always reported
        worst = float(np.max(diff, initial=0.0))
        tolerance = _tolerance(b64, b.dtype, exact)
        if not worst <= tolerance:
            rel = worst / max(float(np.max(np.abs(b64[np.isfinite(b64)]), initial=0.0)), 1e-30)
            raise MiscompileError(
                f"pass '{pass_name}' changed {path}: max |difference| {worst:.3g} (relative {rel:.3g}, "
                f"tolerance {tolerance:.3g})." + _how_to_report(pass_name)
            )


def _how_to_report(pass_name: str) -> str:
    return (
        f"\nThe pass miscompiled this step. Work around it with PassManager(disable=['{pass_name}']) "
        f"(or its PassManager.default option); please report the step with the graphs around the pass "
        f"(REPLICATOR_DUMP_DIR=dir) and the report of rp.tools.bisect_passes(repl, step_fn, input_fn, state) "
        f"(or python -m replicator.bisect)."
    )


HOOKS.graph_runner = GraphRunner
HOOKS.compare_results = compare_results
