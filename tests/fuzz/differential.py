"""Run a random program replicated and as the stacked reference; compare every leaf.

Also checks the replica-variance analysis against what ran: an output leaf it
calls identical along a mesh axis must be identical along that axis.

Pipeline variants: the default pipeline and each optional pass or algorithm
switched on, all with ``verify=True`` (graph invariants after every pass).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

import replicator as rp
from replicator.passes import analyze_invariance

from .programs import PerReplica, Spec, Stacked, global_batches, initial_state, make_step, random_spec

#: name -> options of ``rp.Pipeline.default``.
VARIANTS: dict[str, dict] = {
    "default": {},
    "zero": {"shard_optimizer": True, "shard_optimizer_min_bytes": 0},
    "hierarchical": {"hierarchical": True},
    "compress": {"compress": True},
    "ring": {"all_reduce_algorithm": "ring"},
    "tree": {"all_reduce_algorithm": "reduce_broadcast"},
    "no-fusion": {"disable": ["fuse-allreduce"]},
    "no-simplify": {"disable": ["simplify"]},
}
MESHES = ((2, 4), (1, 8))
STEPS = 2


@dataclasses.dataclass
class Outcome:
    """What one (program, variant, mesh) run found."""

    spec: Spec
    variant: str
    mesh: tuple[int, int]
    error: str | None = None  # a crash
    mismatch: str | None = None  # the first leaf that differs, and by how much

    @property
    def ok(self) -> bool:
        return self.error is None and self.mismatch is None

    def __str__(self) -> str:
        what = "ok" if self.ok else (f"CRASH {self.error}" if self.error else f"MISMATCH {self.mismatch}")
        return (
            f"seed={self.spec.seed} variant={self.variant} mesh={self.mesh}: {what}\n  program: {self.spec.describe()}"
        )


def reference(spec: Spec, workers: int, cores: int) -> tuple[Any, list[Any]]:
    """Final state (replica 0's row, after checking every row agrees) and each step's outputs."""
    R = workers * cores
    step = jax.jit(make_step(spec, Stacked(workers, cores)))
    state = jax.tree.map(lambda a: np.broadcast_to(a, (R, *np.shape(a))), initial_state(spec))
    outputs = []
    for batch in global_batches(spec, R, STEPS):
        stacked = jax.tree.map(lambda a: a.reshape(R, spec.rows, *a.shape[1:]), batch)
        state, out = step(state, stacked)
        outputs.append(out)
    rows = jax.tree.map(np.asarray, state)
    for leaf in jax.tree.leaves(rows):
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))  # state stays identical
    return jax.tree.map(lambda a: a[0], rows), outputs


def replicated(spec: Spec, workers: int, cores: int, variant: str) -> tuple[Any, list[Any], tuple]:
    """Final state, each step's per-replica outputs, and the analysis's variance of each output leaf."""
    options = dict(VARIANTS[variant])
    repl = rp.Replicator(workers, cores, passes=rp.Pipeline.default(verify=True, **options))
    R = workers * cores
    batches = global_batches(spec, R, STEPS)
    rows = spec.rows * cores

    def input_fn(ctx):
        for b in batches:
            yield jax.tree.map(lambda a: a[ctx.worker_id * rows : (ctx.worker_id + 1) * rows], b)

    step = make_step(spec, PerReplica(workers, cores))
    state, outputs = initial_state(spec), []
    for _ in batches:
        state, out = repl.run(step, input_fn, state)
        outputs.append(out)
    outputs = [jax.tree.map(np.asarray, o) for o in outputs]
    traced = repl.lower(step, jax.tree.map(lambda a: a[:rows], batches[0]), initial_state(spec)).traced
    variance = analyze_invariance(traced).output_variance[traced.num_state :]
    return jax.tree.map(np.asarray, state), outputs, variance


def claimed_identical_but_differs(outputs: list[Any], variance: tuple, workers: int, cores: int) -> str | None:
    """Check the variance analysis against the run: an output it calls identical along an axis must be."""
    for step, out in enumerate(outputs):
        leaves = jax.tree_util.tree_leaves_with_path(out)
        for (path, leaf), axes in zip(leaves, variance, strict=True):
            rows = np.asarray(leaf).reshape(workers, cores, *np.shape(leaf)[1:]).astype(np.float64)
            for axis, name in ((1, "cores"), (0, "workers")):
                if name in axes:
                    continue
                spread = float(np.max(np.abs(rows - np.take(rows, [0], axis=axis)), initial=0.0))
                if not spread <= 1e-6 * max(1.0, float(np.max(np.abs(rows), initial=0.0))):
                    return (
                        f"step {step} output {jax.tree_util.keystr(path)}: the analysis says it is identical "
                        f"along '{name}', but replicas differ by {spread:.3g}"
                    )
    return None


def tolerance(variant: str, ref: np.ndarray) -> float:
    """Allowed absolute difference for one leaf (floats; integers must be equal)."""
    scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
    if variant == "compress":  # bf16 payloads: 8 mantissa bits, summed over replicas (compress.py's bound)
        return 8 * 2.0**-8 * scale
    return 2e-4 * scale


def first_mismatch(variant: str, got: Any, want: Any) -> str | None:
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} leaves, expected {len(want_leaves)}"
    for (path, a), b in zip(got_leaves, want_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        name = jax.tree_util.keystr(path)
        if a.shape != b.shape:
            return f"{name}: shape {a.shape}, expected {b.shape}"
        if not np.issubdtype(b.dtype, np.floating):
            if not np.array_equal(a, b):
                return f"{name}: {a.ravel()[:6]} != {b.ravel()[:6]}"
            continue
        diff = float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0
        if not diff <= tolerance(variant, b):  # NaN fails too
            return f"{name}: max |difference| {diff:.3g} (tolerance {tolerance(variant, b):.3g})"
    return None


def check(spec: Spec, variant: str, mesh: tuple[int, int], ref: tuple[Any, list[Any]] | None = None) -> Outcome:
    """Run one program under one variant and mesh against the stacked reference."""
    workers, cores = mesh
    outcome = Outcome(spec, variant, mesh)
    try:
        want_state, want_outputs = ref if ref is not None else reference(spec, workers, cores)
        got_state, got_outputs, variance = replicated(spec, workers, cores, variant)
    except Exception as e:  # noqa: BLE001 - every crash is a finding
        outcome.error = f"{type(e).__name__}: {str(e)[:400]}"
        return outcome
    outcome.mismatch = first_mismatch(variant, got_state, want_state)
    for i, (g, w) in enumerate(zip(got_outputs, want_outputs, strict=True)):
        if outcome.mismatch is None:
            m = first_mismatch(variant, g, w)
            outcome.mismatch = f"step {i} outputs{m}" if m else None
    if outcome.mismatch is None:
        outcome.mismatch = claimed_identical_but_differs(got_outputs, variance, workers, cores)
    return outcome


def run_program(seed: int, variants: list[str], meshes=MESHES) -> list[Outcome]:
    """One random program under every variant and mesh (the reference computed once per mesh)."""
    outcomes = []
    for mesh in meshes:
        spec = random_spec(seed, mesh[0] * mesh[1])
        try:
            ref = reference(spec, *mesh)
        except Exception as e:  # noqa: BLE001 - a reference failure is a generator bug
            outcomes.append(Outcome(spec, "reference", mesh, error=f"{type(e).__name__}: {str(e)[:400]}"))
            continue
        outcomes.extend(check(spec, v, mesh, ref) for v in variants)
    return outcomes
