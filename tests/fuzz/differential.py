"""Run a random program replicated and as the stacked reference; compare every leaf.

Also checks the replica-variance analysis against what ran: an output leaf it
calls identical along a mesh axis must be identical along that axis.

Pipeline variants: the default pipeline and each optional pass or algorithm
switched on, all with ``verify=True`` (graph invariants after every pass).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import replicator as rp
from replicator.passes import StepGraph, analyze_invariance

from .programs import PerReplica, Spec, Stacked, global_batches, initial_state, make_step, random_spec

#: name -> options of ``rp.PassManager.default``.
VARIANTS: dict[str, dict] = {
    "default": {},
    "zero": {"shard_optimizer": True, "shard_optimizer_min_bytes": 0},
    "zero2": {"zero": 2, "shard_optimizer_min_bytes": 0},
    "zero3": {"zero": 3, "shard_optimizer_min_bytes": 0},
    "hierarchical": {"hierarchical": True},
    "compress": {"compress": True},
    "ring": {"all_reduce_algorithm": "ring"},
    "tree": {"all_reduce_algorithm": "reduce_broadcast"},
    "no-fusion": {"disable": ["fuse-collectives"]},
    "no-simplify": {"disable": ["simplify"]},
    # The same program written with lax collectives over the axis name 'batch' (as for jax.pmap),
    # run with Replicator(axis_name='batch'): capture-collectives makes them placeholders.
    "lax": {},
    # Several replicas per device (Parallelism(replicas_per_device=F), passes/fold.py): F = 2 folds
    # cores, F = 8 puts every replica on one device (2 x 4: whole workers folded too).
    "fold2": {"replicas_per_device": 2},
    "fold8": {"replicas_per_device": 8},
    "fold4-zero": {"replicas_per_device": 4, "shard_optimizer": True, "shard_optimizer_min_bytes": 0},
    "fold2-zero3": {"replicas_per_device": 2, "zero": 3, "shard_optimizer_min_bytes": 0},
    # A tensor axis of T devices under each replica (Replicator(parallelism=Parallelism(tensor=T))):
    # the program's matrices split column-wise (w's outputs, the bias, a stack's outputs) or row-wise
    # (w's inputs, a stack's inputs) where T divides them (tensor_plan), gathers allowed so that every
    # conversion the placement rules ask for runs. The mesh is the data replicas; each has T devices.
    "tensor2": {"tensor": 2, "split": "column"},
    "tensor2-row": {"tensor": 2, "split": "row"},
    "tensor4": {"tensor": 4, "split": "column"},
    "tensor2-zero3": {"tensor": 2, "split": "column", "zero": 3, "shard_optimizer_min_bytes": 0},
    "tensor4-row-zero3": {"tensor": 4, "split": "row", "zero": 3, "shard_optimizer_min_bytes": 0},
    # Two data replicas per tensor group of 2 devices (Parallelism(tensor=2, replicas_per_device=2)): the split step
    # vmapped over the folded replicas, ZeRO-3 over the data axes.
    "tensor2-fold2-zero3": {
        "tensor": 2,
        "split": "column",
        "replicas_per_device": 2,
        "zero": 3,
        "shard_optimizer_min_bytes": 0,
    },
    # The same, on programs with a block over a (rows, seq, features) input (programs.block: heads split by a
    # reshape, a dot_general of random dimensions, a reduction over a split dimension, a scan over the
    # sequence), with and without Megatron's sequence parallelism (dimension 1: the block's partial sums are
    # reduce-scattered on the sequence where T divides it, all-gathered before the next matmul).
    "tensor2-forms": {"tensor": 2, "split": "column", "forms": True},
    "tensor4-row-forms": {"tensor": 4, "split": "row", "forms": True},
    "tensor2-sp": {"tensor": 2, "split": "column", "forms": True, "sequence_parallel": 1},
    "tensor4-sp-zero3": {
        "tensor": 4,
        "split": "column",
        "forms": True,
        "sequence_parallel": 1,
        "zero": 3,
        "shard_optimizer_min_bytes": 0,
    },
}
RAW_VARIANTS = {"lax"}
MESHES = ((2, 4), (1, 8))
#: Meshes whose 'workers' and 'cores' groups have one size: a collective over one group taken for the other
#: keeps every shape there, and only the numbers tell (the test suite's sample runs them; 4 x 4 needs 16 devices).
SQUARE_MESHES = ((2, 2), (4, 4))


#: The data-replica meshes of the tensor variants, by T: each replica's T devices, 8 in all.
TENSOR_MESHES = {2: ((2, 2), (1, 4)), 4: ((1, 2), (2, 1))}


def runs_on(variant: str, mesh: tuple[int, int]) -> bool:
    """Whether ``variant`` can run on ``mesh``: ``replicas_per_device`` must divide the cores, or be a multiple
    of them that divides the replicas (fold8 needs 8 replicas); a tensor variant runs on its own meshes."""
    workers, cores = mesh
    tensor = VARIANTS[variant].get("tensor")
    if tensor is not None:
        return mesh in TENSOR_MESHES[tensor]
    f = VARIANTS[variant].get("replicas_per_device", 1)
    return cores % f == 0 or (f % cores == 0 and workers % (f // cores) == 0)


def spec_for(seed: int, variant: str, mesh: tuple[int, int]) -> Spec:
    """The program of index ``seed`` that ``variant`` runs on ``mesh`` (with the block over a 3-d input for
    the ``forms`` variants)."""
    return random_spec(seed, mesh[0] * mesh[1], forms=VARIANTS[variant].get("forms", False))


def tensor_plan(spec: Spec, size: int, split: str) -> dict[str, Any]:
    """The program's matrices split column-wise (outputs) or row-wise (inputs) over ``size`` devices, where
    ``size`` divides them; a plan that splits nothing names ``w`` replicated. The block's ``v`` (hidden,
    features) pairs with ``w``: split on its rows where ``w`` is split on its columns (Megatron's MLP), on its
    columns (the features) in the row plan."""
    hidden, features = spec.hidden % size == 0, spec.features % size == 0
    plan: dict[str, Any] = {}
    if split == "column" and hidden:
        plan = {"params/w": 1, "params/b": 0, **({"params/stack": 2} if spec.stack else {})}
        plan.update({"params/v": 0} if spec.seq else {})
    elif split == "row":
        plan = {**({"params/w": 0} if features else {}), **({"params/stack": 1} if spec.stack and hidden else {})}
        plan.update({"params/v": 1} if spec.seq and features else {})
    return plan or {"params/w": "replicated"}


STEPS = 2


@dataclasses.dataclass
class Outcome:
    """What one (program, variant, mesh) run found (also of a pipelined program: ``tests/fuzz/pipelines.py``)."""

    spec: Spec  # or a pipelines.PipeSpec: a seed and describe()
    variant: str
    mesh: tuple[int, int]
    error: str | None = None  # a crash
    mismatch: str | None = None  # the first leaf that differs, and by how much
    #: Set when the run agreed only within the reference's own sensitivity to the order of
    #: its float32 sums (:func:`order_sensitivity`): the mismatch the base tolerance saw.
    order_sensitive: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.mismatch is None

    def __str__(self) -> str:
        what = "ok" if self.ok else (f"CRASH {self.error}" if self.error else f"MISMATCH {self.mismatch}")
        return (
            f"seed={self.spec.seed} variant={self.variant} mesh={self.mesh}: {what}\n  program: {self.spec.describe()}"
        )


def reference(
    spec: Spec, workers: int, cores: int, wire_dtype: Any = None, order: str | None = None, wide: bool = False
) -> tuple[Any, list[Any]]:
    """Final state (replica 0's row, after checking every row agrees) and each step's outputs.

    With ``wire_dtype``, f32 sums and means round their operands and results to it
    (what ``compress-communication`` does): the difference from the exact reference
    measures how much this program amplifies that rounding. With ``order``, sums
    over replicas add them one by one in that order (:class:`Stacked`).
    """
    R = workers * cores
    step = jax.jit(make_step(spec, Stacked(workers, cores, wire_dtype, None if order == "state" else order)))
    start = _widened(initial_state(spec), wide)
    if order == "state":  # every float of the initial state moved by about 2 ulps, alternately up and down
        start = jax.tree.map(_moved_by_ulps, start)
    state = jax.tree.map(lambda a: np.broadcast_to(a, (R, *np.shape(a))), start)
    outputs = []
    for batch in _widened(global_batches(spec, R, STEPS), wide):
        stacked = jax.tree.map(lambda a: a.reshape(R, spec.rows, *a.shape[1:]), batch)
        state, out = step(state, stacked)
        outputs.append(out)
    rows = jax.tree.map(np.asarray, state)
    for leaf in jax.tree.leaves(rows):
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))  # state stays identical
    return jax.tree.map(lambda a: a[0], rows), outputs


def _widened(tree: Any, wide: bool) -> Any:
    """``tree`` with its float32 leaves as float64 when ``wide`` (under ``jax.enable_x64(True)``)."""
    if not wide:
        return tree
    return jax.tree.map(lambda a: np.asarray(a, np.float64) if np.asarray(a).dtype == np.float32 else a, tree)


def equal_in_float64(spec: Spec, variant: str, mesh: tuple[int, int], offset: float = 0.0) -> str | None:
    """The run and the reference again with every float32 of the program's state and batches in float64:
    None if they agree within 1e-9 of each leaf's scale (the float32 difference was rounding the program
    amplifies), else the first leaf that differs. A tensor variant's split matmuls add in another order
    than one device's inside the replica, which the reference's other orders of its replica sums do not
    reproduce.

    It runs in a process of its own (``python -m tests.fuzz.differential``, at most 10 minutes): JAX's
    64-bit mode, once on, changes what later steps of this process trace. ``offset`` is added to the
    run's first weight there (to show that the judge tells a difference).
    """
    return judge_in_own_process("tests.fuzz.differential", spec, variant, mesh, offset)


def judge_in_own_process(module: str, spec: Any, variant: str, mesh: tuple[int, int], offset: float) -> str | None:
    """Run ``python -m module`` on the program's JSON (a float64 judge's own process, at most 10 minutes, on
    as many emulated devices as this one) and return its verdict, the last line it prints."""
    payload = json.dumps({"spec": dataclasses.asdict(spec), "variant": variant, "mesh": list(mesh), "offset": offset})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-m", module, payload],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        env={**os.environ, "REPLICATOR_FUZZ_DEVICES": str(jax.device_count())},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the float64 judge failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _judge_in_float64(payload: dict) -> str | None:
    """:func:`equal_in_float64`'s work, in its own process with 64-bit mode on."""
    spec, mesh = Spec.from_json(payload["spec"]), tuple(payload["mesh"])
    want_state, _ = reference(spec, *mesh, wide=True)
    got_state, _, _ = replicated(spec, *mesh, payload["variant"], wide=True)
    got_state["params"]["w"] = got_state["params"]["w"] + payload["offset"]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_state), jax.tree.leaves(want_state), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape or (a.size and np.max(np.abs(a - b)) > 1e-9 * max(1.0, float(np.max(np.abs(b))))):
            return f"{jax.tree_util.keystr(path)} differs in float64 too"
    return None


def _moved_by_ulps(a: Any) -> Any:
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.floating):
        return a
    signs = np.where(np.arange(a.size) % 2 == 0, 1.0, -1.0).reshape(a.shape)
    return (a * (1.0 + signs * 2.0**-22)).astype(a.dtype)


def graph_key(final: StepGraph, fold: Any = None) -> str:
    """What determines a compiled step's results: its graph, its constants' bytes, its sharded state,
    and how replicas sit on devices."""
    digest = hashlib.sha256(f"{fold!r}\n{final.jaxpr}".encode())
    for const in final.jaxpr.consts:
        digest.update(np.asarray(const).tobytes())
    digest.update(repr(sorted(final.sharded_state)).encode())
    digest.update(repr(final.tensor and final.tensor.state_dims).encode())
    return digest.hexdigest()


def replicated(
    spec: Spec,
    workers: int,
    cores: int,
    variant: str,
    executed: dict[str, tuple] | None = None,
    wide: bool = False,
    seen: collections.Counter | None = None,
) -> tuple[Any, list[Any], tuple]:
    """Final state, each step's per-replica outputs, and the analysis's variance of each output leaf.

    ``executed`` maps :func:`graph_key` of final graphs already run for this
    program and mesh to their results: a variant whose passes produced the same
    final graph as another (a pass with nothing to do) reuses them instead of
    compiling that graph again. ``seen`` counts, per ``"variant kind"``, the runs whose graph
    holds a collective of that kind over the tensor axis (``all-reduce``, ``reduce-scatter``, ``all-gather``).
    """
    options = dict(VARIANTS[variant])
    replicas_per_device = options.pop("replicas_per_device", 1)
    tensor, split = options.pop("tensor", 1), options.pop("split", None)
    sequence_parallel = options.pop("sequence_parallel", None)
    options.pop("forms", None)
    parallelism = rp.Parallelism(replicas_per_device=replicas_per_device)
    if tensor > 1:
        plan = tensor_plan(spec, tensor, split)
        parallelism = rp.Parallelism(
            tensor=tensor,
            tensor_plan=plan,
            allow_gather=True,
            sequence_parallel=sequence_parallel,
            replicas_per_device=replicas_per_device,
        )
    raw = variant in RAW_VARIANTS
    repl = rp.Replicator(
        workers,
        cores * tensor,
        passes=rp.PassManager.default(verify=True, **options),
        axis_name="batch" if raw else None,
        parallelism=parallelism,
    )
    R = workers * cores
    batches = _widened(global_batches(spec, R, STEPS), wide)
    rows = spec.rows * cores
    step = make_step(spec, PerReplica(workers, cores, raw=raw))
    lowered = repl.lower(step, jax.tree.map(lambda a: a[:rows], batches[0]), _widened(initial_state(spec), wide))
    variance = analyze_invariance(lowered.traced).output_variance[lowered.traced.num_state :]
    if seen is not None and lowered.final.tensor is not None:
        for kind in sorted({c.kind for c in lowered.final.tensor.collectives}):
            seen[f"{variant} {kind}"] += 1
    key = graph_key(lowered.final, repl.fold)
    if executed is not None and key in executed:
        return (*executed[key], variance)

    def input_fn(ctx):
        for b in batches:
            yield jax.tree.map(lambda a: a[ctx.worker_id * rows : (ctx.worker_id + 1) * rows], b)

    state, outputs = _widened(initial_state(spec), wide), []
    for _ in batches:
        state, out = repl.run(step, input_fn, state)
        outputs.append(out)
    result = (jax.tree.map(np.asarray, state), [jax.tree.map(np.asarray, o) for o in outputs])
    if executed is not None:
        executed[key] = result
    return (*result, variance)


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


def order_sensitivity(spec: Spec, workers: int, cores: int, moved_state: bool = False) -> tuple[Any, list[Any]]:
    """Per element, how far the reference moves when its replica sums add in another order.

    The largest ``|reference - reference(order)|`` over a forward and a reverse
    one-by-one order and a sum of operands moved by about 2 ulps ('jitter'). Large where a program amplifies float32 rounding: Adam
    dividing a mean gradient that cancels to ~1e-8 across replicas by
    ``sqrt(v) + 1e-8`` turns the rounding of that sum into an update of any sign
    up to the learning rate, whichever order is right.
    """
    base_state, base_outputs = reference(spec, workers, cores)
    state = jax.tree.map(lambda a: np.zeros(np.shape(a)), base_state)
    outputs = [jax.tree.map(lambda a: np.zeros(np.shape(a)), o) for o in base_outputs]

    def widen(acc, base, other):
        return jax.tree.map(
            lambda s, b, o: (
                np.maximum(s, np.abs(np.asarray(b, np.float64) - np.asarray(o, np.float64)))
                if np.issubdtype(np.asarray(b).dtype, np.floating)
                else s
            ),
            acc,
            base,
            other,
        )

    # With ``moved_state`` (the tensor variants: a split matmul adds its products in another order than one
    # device's, inside the replica), also the initial state moved by about 2 ulps ('state'): how much the
    # program amplifies rounding anywhere, not only in the sums over replicas.
    for order in ("forward", "reverse", "jitter", *(("state",) if moved_state else ())):
        other_state, other_outputs = reference(spec, workers, cores, order=order)
        state = widen(state, base_state, other_state)
        outputs = [widen(a, b, o) for a, b, o in zip(outputs, base_outputs, other_outputs, strict=True)]
    return state, outputs


def tolerance(variant: str, ref: np.ndarray, rounded: np.ndarray | None = None) -> float:
    """Allowed absolute difference for one leaf (floats; integers must be equal).

    ``compress``: bf16 payloads (8 significand bits, summed over replicas:
    compress.py's bound) plus 4 times the program's own sensitivity to that
    rounding, ``|ref - rounded|`` with ``rounded`` the reference whose sums round
    their operands and results to bf16. Batch norm over a few rows, for one,
    turns a rounding of the mean into a much larger error in the normalized
    values; a wrong rewrite (a wrong scale, group or operand) is far outside.
    """
    scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
    if variant == "compress":
        sensitivity = float(np.max(np.abs(ref - rounded))) if rounded is not None and ref.size else 0.0
        return 8 * 2.0**-8 * scale + 4 * sensitivity
    return 2e-4 * scale


def first_mismatch(variant: str, got: Any, want: Any, rounded: Any = None, sensitivity: Any = None) -> str | None:
    """The first leaf of ``got`` that differs from ``want`` beyond :func:`tolerance`, or None.

    ``sensitivity`` (:func:`order_sensitivity`, same structure as ``want``) widens the
    tolerance element by element by 4 times the reference's own movement under another
    summation order.
    """
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree.leaves(want)
    rounded_leaves = jax.tree.leaves(rounded) if rounded is not None else [None] * len(want_leaves)
    sensitive_leaves = jax.tree.leaves(sensitivity) if sensitivity is not None else [0.0] * len(want_leaves)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} leaves, expected {len(want_leaves)}"
    for (path, a), b, r, e in zip(got_leaves, want_leaves, rounded_leaves, sensitive_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        r = None if r is None else np.asarray(r, dtype=np.float64)
        name = jax.tree_util.keystr(path)
        if a.shape != b.shape:
            return f"{name}: shape {a.shape}, expected {b.shape}"
        if not np.issubdtype(b.dtype, np.floating):
            if not np.array_equal(a, b):
                return f"{name}: {a.ravel()[:6]} != {b.ravel()[:6]}"
            continue
        if not a.size:
            continue
        excess = np.abs(a.astype(np.float64) - b) - (tolerance(variant, b, r) + 4 * np.asarray(e))
        if not np.all(excess <= 0):  # NaN fails too
            i = np.unravel_index(np.nanargmax(np.where(np.isnan(excess), np.inf, excess)), excess.shape)
            diff = float(np.max(np.abs(a.astype(np.float64) - b)))
            tol = tolerance(variant, b, r) + 4 * float(np.asarray(e)[i] if np.ndim(e) else e)
            return f"{name}: max |difference| {diff:.3g} (tolerance {tol:.3g} at element {tuple(int(k) for k in i)})"
    return None


def check(
    spec: Spec,
    variant: str,
    mesh: tuple[int, int],
    ref: tuple[Any, list[Any]] | None = None,
    rounded: tuple[Any, list[Any]] | None = None,
    executed: dict[str, tuple] | None = None,
    sensitivity_cache: dict | None = None,
    seen: collections.Counter | None = None,
) -> Outcome:
    """Run one program under one variant and mesh against the stacked reference.

    ``rounded`` is the reference with bf16 sums (computed here when ``variant`` is
    ``compress`` and it is not given); it only widens the compress tolerance. A run
    that differs beyond the tolerance is compared again with the tolerance widened,
    element by element, by the reference's own sensitivity to the order of its sums
    (:func:`order_sensitivity`, computed once per program and mesh in
    ``sensitivity_cache``); if it agrees then, the outcome passes and records the
    first comparison in ``order_sensitive``. A tensor variant's sensitivity also moves the
    initial state by 2 ulps, and a tensor variant still beyond it is run again with the
    program in float64 (:func:`equal_in_float64`): equal there within 1e-9, it passes the
    same way.
    """
    workers, cores = mesh
    outcome = Outcome(spec, variant, mesh)
    try:
        want_state, want_outputs = ref if ref is not None else reference(spec, workers, cores)
        if variant == "compress" and rounded is None:
            rounded = reference(spec, workers, cores, jnp.bfloat16)
        rounded_state, rounded_outputs = rounded if variant == "compress" else (None, [None] * len(want_outputs))
        got_state, got_outputs, variance = replicated(spec, workers, cores, variant, executed, seen=seen)
    except Exception as e:  # noqa: BLE001 - every crash is a finding
        outcome.error = f"{type(e).__name__}: {str(e)[:400]}"
        return outcome

    def compare(sensitivity: tuple[Any, list[Any]] | None) -> str | None:
        state_e, outputs_e = sensitivity if sensitivity is not None else (None, [None] * len(want_outputs))
        found = first_mismatch(variant, got_state, want_state, rounded_state, state_e)
        for i, (g, w, r, e) in enumerate(zip(got_outputs, want_outputs, rounded_outputs, outputs_e, strict=True)):
            if found is None:
                m = first_mismatch(variant, g, w, r, e)
                found = f"step {i} outputs{m}" if m else None
        return found

    outcome.mismatch = compare(None)
    if outcome.mismatch is not None:  # is the reference itself that sensitive to rounding there?
        if sensitivity_cache is None:
            sensitivity_cache = {}
        key = "order+state" if "tensor" in VARIANTS[variant] else "order"
        if key not in sensitivity_cache:
            sensitivity_cache[key] = order_sensitivity(spec, workers, cores, moved_state=key == "order+state")
        if compare(sensitivity_cache[key]) is None:
            outcome.order_sensitive, outcome.mismatch = outcome.mismatch, None
        elif "tensor" in VARIANTS[variant] and equal_in_float64(spec, variant, mesh) is None:
            outcome.order_sensitive = f"{outcome.mismatch} (equal within 1e-9 in float64)"
            outcome.mismatch = None
    if outcome.mismatch is None:
        outcome.mismatch = claimed_identical_but_differs(got_outputs, variance, workers, cores)
    return outcome


def run_program(
    seed: int, variants: list[str], meshes=MESHES, stats: collections.Counter | None = None
) -> list[Outcome]:
    """One random program under every variant and mesh (the reference computed once per mesh); the tensor
    variants on their own meshes (:data:`TENSOR_MESHES`).

    Variants whose final graphs are identical share one execution; ``stats``
    counts ``runs`` (variant x mesh) and distinct ``graphs`` executed, and the tensor variants' runs with
    each kind of collective over the tensor axis (``"variant kind"``). The ``forms`` variants run the
    program with its block over a 3-d input (:func:`spec_for`), the others the program without it.
    """
    stats = collections.Counter() if stats is None else stats
    outcomes = []
    tensor_meshes = sorted({m for t, ms in TENSOR_MESHES.items() for m in ms})
    all_variants = variants
    for mesh in [*meshes, *(m for m in tensor_meshes if m not in meshes)]:
        here = [v for v in all_variants if runs_on(v, mesh) and (mesh in meshes or "tensor" in VARIANTS[v])]
        for forms in (False, True):
            variants = [v for v in here if VARIANTS[v].get("forms", False) == forms]
            if not variants:
                continue
            spec = random_spec(seed, mesh[0] * mesh[1], forms=forms)
            try:
                ref = reference(spec, *mesh)
                rounded = reference(spec, *mesh, jnp.bfloat16) if "compress" in variants else None
            except Exception as e:  # noqa: BLE001 - a reference failure is a generator bug
                outcomes.append(Outcome(spec, "reference", mesh, error=f"{type(e).__name__}: {str(e)[:400]}"))
                continue
            executed: dict[str, tuple] = {}  # final graphs run for this program and mesh
            sensitivity: dict = {}  # computed on the first mismatch only
            outcomes.extend(check(spec, v, mesh, ref, rounded, executed, sensitivity, stats) for v in variants)
            stats["graphs"] += len(executed)
            stats["runs"] += len(variants)
    return outcomes


if __name__ == "__main__":  # equal_in_float64's own process
    jax.config.update("jax_enable_x64", True)
    rp.force_cpu_devices(int(os.environ.get("REPLICATOR_FUZZ_DEVICES", "8")))
    print(json.dumps(_judge_in_float64(json.loads(sys.argv[1]))))
