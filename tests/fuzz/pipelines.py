"""Random pipelined training steps for the differential fuzzer, and their one-device reference.

A program is a random :class:`PipeSpec`: a loss cut into ``S`` segments by
``rp.stage_boundary`` (random layers per segment; an embedding of integer inputs
or a dense input layer in the first; optionally the embedding reused as the head,
a tuple crossing one boundary, a parameter-only term, inputs rounded to bf16; or,
3 programs in 10, no markers and a ``lax.scan`` stack of ``S x 1`` or ``S x 2``
residual layers between the first and last segments, which the Replicator cuts), a
random optax optimizer, and the user's step as written for data parallelism
(``jax.value_and_grad``, ``rp.all_mean(grads)``, the optax update, outputs
``{'loss': rp.all_mean(value)}``). :func:`random_pipe_spec` is seeded by the
program's index and the stage count.

The reference (:func:`reference`) is the same step under ``jax.jit`` on one
device on the global batch, with ``rp.all_mean`` replaced by the identity (the
markers are the identity outside a pipeline): nothing of the library's
splitting, scheduling or lowering runs in it.

Statistics across rows (batch norm, ``rp.all_mean`` inside the loss) are left
out: inside a pipeline they are per micro-batch (``tests/stages/test_replicas.py``
``bn_loss``), so the step would equal one device's only with one micro-batch per
replica, and no variant here has that. Every layer is per row and the loss is a
mean over rows, so the mean over micro-batches and replicas of their values and
gradients is one device's on the global batch.

:func:`check` runs one program under one variant (``S``, ``M``, schedule,
recomputation, optionally ``passes=PassManager.default(zero=1)``) on one mesh
of 8 devices and compares the whole state (parameters and optimizer state) and
the losses of every step; a run beyond the tolerance is compared again within
the reference's own sensitivity to the order of its sums (:func:`order_sensitivity`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import replicator as rp
from replicator.core.layout import fold_layout
from tests.fuzz.differential import Outcome, judge_in_own_process
from tests.fuzz.programs import spec_from_json

#: The programs' float dtype: float32, or float64 in :func:`equal_in_float64`'s own process.
_FLOAT: Any = np.float32

LAYERS = ("dense-tanh", "dense-relu", "dense-gelu", "elementwise", "residual", "layernorm")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
STEPS = 3


@dataclasses.dataclass(frozen=True)
class PipeSpec:
    """One random pipelined program (a loss of ``stages`` segments, an optimizer, a batch)."""

    seed: int
    stages: int
    segments: tuple[tuple[str, ...], ...]  # layer kinds of each segment
    width: int
    embed: bool  # integer inputs and an embedding lookup in segment 0 (else a dense input layer)
    vocab: int
    in_dim: int
    tied: bool  # (with embed) the head is the embedding, transposed: read by stages 0 and S-1
    tuple_at: int | None  # the boundary after this segment carries (h, skip); the next segment adds skip
    ids_cross: bool  # (with embed and tuple_at) the tuple's second item is the ids, not an activation
    free_at: int | None  # the segment that adds a parameter-only term
    bf16: bool  # segment 0's input rounded to bfloat16 and cast back (straight-through gradient)
    cross_entropy: bool  # integer labels and softmax cross-entropy, else a squared error
    out_dim: int
    optimizer: str
    lr: float
    rows: int  # global batch rows
    stack: int = 0  # > 0: no markers; a lax.scan over S * stack residual layers, cut into the S stages unmarked
    seq: int = 0  # > 0: every row is a sequence of this many positions (activations (rows, seq, width))

    @property
    def used_segments(self) -> tuple[int, ...]:
        """The segments the loss runs: all, or with a stack the first (before it) and the last (after it)."""
        return tuple(sorted({0, self.stages - 1})) if self.stack else tuple(range(self.stages))

    def describe(self) -> str:
        parts = [f"S={self.stages}", f"width={self.width}", f"rows={self.rows}"]
        parts.append(f"input=embed({self.vocab})" if self.embed else f"input=dense({self.in_dim})")
        parts += [f"seg{i}={list(self.segments[i])}" for i in self.used_segments]
        if self.stack:
            parts.append(f"stack={self.stages}x{self.stack} (unmarked)")
        if self.seq:
            parts.append(f"seq={self.seq}")
        for flag in ("tied", "ids_cross", "bf16", "cross_entropy"):
            if getattr(self, flag):
                parts.append(flag)
        if self.tuple_at is not None:
            parts.append(f"tuple_at={self.tuple_at}")
        if self.free_at is not None:
            parts.append(f"free_at={self.free_at}")
        parts.append(f"{self.optimizer}(lr={self.lr})")
        return " ".join(parts)


def random_pipe_spec(seed: int, stages: int, seq: bool = False) -> PipeSpec:
    """The program of index ``seed`` with ``stages`` segments (reproducible); with ``seq``, the same program on
    sequences (its length drawn apart: 2, 3, 4 or 6 positions per row), for sequence parallelism."""
    rng = np.random.default_rng([seed, stages, 7])
    embed = bool(rng.random() < 0.6)
    width = int(rng.choice([4, 6, 8]))
    vocab = int(rng.choice([8, 11, 16]))
    tied = embed and bool(rng.random() < 0.5)
    cross_entropy = bool(rng.random() < 0.4)
    out_dim = vocab if tied else int(rng.choice([2, 3, 5]))
    segments = tuple(
        tuple(str(k) for k in rng.choice(LAYERS, size=int(rng.integers(0 if i == 0 else 1, 3)))) for i in range(stages)
    )
    tuple_at = int(rng.integers(0, stages - 1)) if rng.random() < 0.5 else None
    # Drawn apart, so that the other fields of a program stay what they were before stacks were added.
    extra = np.random.default_rng([seed, stages, 19])
    stack = int(extra.choice([1, 2])) if extra.random() < 0.3 else 0
    if stack:
        tuple_at = None  # no markers, so no tuple crossing one
    spec = PipeSpec(
        seed=seed,
        stages=stages,
        segments=segments,
        width=width,
        embed=embed,
        vocab=vocab,
        in_dim=int(rng.choice([3, 5])),
        tied=tied,
        tuple_at=tuple_at,
        ids_cross=embed and tuple_at is not None and bool(rng.random() < 0.5),
        free_at=int(rng.integers(0, stages)) if rng.random() < 0.5 else None,
        bf16=bool(rng.random() < 0.3),
        cross_entropy=cross_entropy,
        out_dim=out_dim,
        optimizer=str(rng.choice(OPTIMIZERS)),
        lr=float(rng.choice([0.01, 0.05])),
        rows=int(rng.choice([16, 32])),  # splits into M x D = 8 or 16 for every variant
        stack=stack,
        seq=int(np.random.default_rng([seed, stages, 23]).choice([2, 3, 4, 6])) if seq else 0,
    )
    return spec


# -- the loss, the parameters, the batch ----------------------------------------------------


def _layer(kind: str, p: dict, name: str, h: jax.Array) -> jax.Array:
    if kind.startswith("dense-"):
        act = {"tanh": jnp.tanh, "relu": jax.nn.relu, "gelu": jax.nn.gelu}[kind.split("-")[1]]
        return act(h @ p[name]["w"] + p[name]["b"])
    if kind == "elementwise":
        return h * jnp.sin(h) * p[name]["s"] + jnp.exp(-(h**2)) - 0.5
    if kind == "residual":
        return h + jnp.tanh(h @ p[name]["w"])
    if kind == "layernorm":
        mu = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
        return (h - mu) / jnp.sqrt(var + 1e-3) * p[name]["g"] + p[name]["b"]
    raise ValueError(kind)


def _stack_layer(h: jax.Array, layer: dict) -> tuple[jax.Array, None]:
    """One residual layer of the scanned stack."""
    return h + jnp.tanh(h @ layer["w"] + layer["b"]), None


def _round_bf16(h: jax.Array) -> jax.Array:
    """``h`` rounded to bfloat16 and cast back; the gradient passes straight through (no rounding of it)."""
    return h + lax.stop_gradient(h.astype(jnp.bfloat16).astype(h.dtype) - h)


def make_loss(spec: PipeSpec):
    """The loss ``(params, inputs, targets) -> scalar``, a mean over rows, with ``S - 1`` markers."""

    def loss(p, inputs, targets):
        ids = inputs if spec.embed else None
        # bf16 rounds what is exact on every side (the gathered rows, the batch's features): rounding a computed
        # value can flip on a 1-ulp difference of the f32 sums, which Adam amplifies (seed 82, S=2, M=4: 2.3e-4).
        x = _round_bf16(inputs) if spec.bf16 and not spec.embed else inputs
        h = p["emb"][inputs] if spec.embed else jnp.tanh(x @ p["inp"]["w"] + p["inp"]["b"])
        if spec.bf16 and spec.embed:
            h = _round_bf16(h)
        skip, extra = None, 0.0
        if spec.stack:  # segment 0, the stack (cut into the stages by the Replicator), the last segment
            for j, kind in enumerate(spec.segments[0]):
                h = _layer(kind, p, f"l0_{j}", h)
            h, _ = lax.scan(_stack_layer, h, p["stack"])
            last = spec.stages - 1
            for j, kind in enumerate(spec.segments[last]):
                h = _layer(kind, p, f"l{last}_{j}", h)
            if spec.free_at is not None:
                extra = 0.05 * jnp.sum(p["free"] ** 2)
        for i, kinds in enumerate(() if spec.stack else spec.segments):
            if skip is not None:  # the tuple's second item, from the boundary before this segment
                h = h + (0.1 * jnp.sin(skip.astype(h.dtype))[..., None] if spec.ids_cross else 0.5 * skip)
                skip = None
            for j, kind in enumerate(kinds):
                h = _layer(kind, p, f"l{i}_{j}", h)
            if spec.free_at == i:
                extra = extra + 0.05 * jnp.sum(p["free"] ** 2)
            if i == spec.stages - 1:
                break
            if spec.tuple_at == i:
                h, skip = rp.stage_boundary((h, ids if spec.ids_cross else h))
            else:
                h = rp.stage_boundary(h)
        logits = h @ (p["emb"].T if spec.tied else p["head"])
        if spec.cross_entropy:
            value = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
        else:
            value = jnp.mean((logits - targets) ** 2)
        return value + extra

    return loss


def initial_params(spec: PipeSpec) -> dict:
    rng = np.random.default_rng([spec.seed, spec.stages, 11])
    d = spec.width

    def normal(*shape, scale=1.0):
        return (scale * rng.normal(size=shape)).astype(_FLOAT)

    p: dict[str, Any] = {}
    if spec.embed:
        p["emb"] = normal(spec.vocab, d)
    else:
        p["inp"] = {"w": normal(spec.in_dim, d, scale=spec.in_dim**-0.5), "b": normal(d, scale=0.1)}
    for i in spec.used_segments:
        for j, kind in enumerate(spec.segments[i]):
            name = f"l{i}_{j}"
            if kind.startswith("dense-"):
                p[name] = {"w": normal(d, d, scale=d**-0.5), "b": normal(d, scale=0.1)}
            elif kind == "elementwise":
                p[name] = {"s": 1.0 + normal(d, scale=0.1)}
            elif kind == "residual":
                p[name] = {"w": normal(d, d, scale=0.5 * d**-0.5)}
            else:
                p[name] = {"g": 1.0 + normal(d, scale=0.1), "b": normal(d, scale=0.1)}
    if spec.stack:
        layers = spec.stages * spec.stack
        p["stack"] = {"w": normal(layers, d, d, scale=0.5 * d**-0.5), "b": normal(layers, d, scale=0.1)}
    if not spec.tied:
        p["head"] = normal(d, spec.out_dim, scale=d**-0.5)
    if spec.free_at is not None:
        p["free"] = normal(3)
    return p


def global_batches(spec: PipeSpec) -> list[tuple[np.ndarray, np.ndarray]]:
    """One global batch per step: inputs (ids or features) and targets (labels or values)."""
    rng = np.random.default_rng([spec.seed, spec.stages, 13])
    out = []
    rows = (spec.rows, spec.seq) if spec.seq else (spec.rows,)
    for _ in range(STEPS):
        if spec.embed:
            inputs = rng.integers(0, spec.vocab, size=rows).astype(np.int32)
        else:
            inputs = rng.normal(size=(*rows, spec.in_dim)).astype(_FLOAT)
        if spec.cross_entropy:
            targets = rng.integers(0, spec.out_dim, size=rows).astype(np.int32)
        else:
            targets = rng.normal(size=(*rows, spec.out_dim)).astype(_FLOAT)
        targets_shift = rng.random() < 0.5
        if targets_shift and not spec.cross_entropy:  # the replicas' halves pull apart
            targets[: spec.rows // 2] += 1.0
        out.append((inputs, targets))
    return out


def make_optimizer(spec: PipeSpec) -> optax.GradientTransformation:
    return {
        "sgd": lambda: optax.sgd(spec.lr),
        "momentum": lambda: optax.sgd(spec.lr, momentum=0.9),
        "adam": lambda: optax.adam(spec.lr),
        "adamw": lambda: optax.adamw(spec.lr, weight_decay=0.1),
    }[spec.optimizer]()


def make_step(spec: PipeSpec, mean=rp.all_mean):
    """The user's data-parallel step; ``mean=identity`` is one device's (where ``rp.all_mean`` is the identity)."""
    loss, opt = make_loss(spec), make_optimizer(spec)

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, *batch)
        grads = mean(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": mean(value)}

    return step


def initial_state(spec: PipeSpec) -> tuple:
    p = initial_params(spec)
    return p, make_optimizer(spec).init(p)


# -- the reference and the variants -----------------------------------------------------------


def reference(spec: PipeSpec, order: str | None = None) -> tuple[Any, list[float]]:
    """Final state and each step's loss: ``jax.jit`` of the step on one device on the global batch.

    ``order`` (:data:`ORDERS`) computes the same step with its float32 sums in another order, to measure how
    much the program amplifies their rounding (:func:`order_sensitivity`): ``"perm<k>"`` the global batch's
    rows permuted (seed ``k``); ``"chunks<k>"`` the loss and gradients averaged over ``k`` equal chunks of the
    batch, as the pipeline averages them over its micro-batches and replicas.
    """
    chunks = int(order[len("chunks") :]) if order is not None and order.startswith("chunks") else 0
    step = jax.jit(_chunked_step(spec, chunks) if chunks else make_step(spec, mean=lambda x: x))
    state, losses = initial_state(spec), []
    for i, batch in enumerate(global_batches(spec)):
        if order is not None and order.startswith("perm"):
            rows = np.random.default_rng([int(order[len("perm") :]), i]).permutation(spec.rows)
            batch = tuple(x[rows] for x in batch)
        state, out = step(state, batch)
        losses.append(float(out["loss"]))
    return jax.tree.map(np.asarray, state), losses


#: The other orders of :func:`reference`'s sums that :func:`order_sensitivity` tries.
ORDERS = ("perm0", "perm1", "chunks4", "chunks8", "chunks16")


def _chunked_step(spec: PipeSpec, k: int):
    """One device's step with the loss and gradients averaged over ``k`` equal chunks of the batch, in order."""
    loss, opt = make_loss(spec), make_optimizer(spec)

    def step(state, batch):
        params, opt_state = state
        parts = [
            jax.value_and_grad(loss)(params, *(x.reshape(k, -1, *x.shape[1:])[i] for x in batch)) for i in range(k)
        ]
        value = functools.reduce(jnp.add, [v for v, _ in parts]) / k
        grads = jax.tree.map(lambda *g: functools.reduce(jnp.add, g) / k, *[g for _, g in parts])
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": value}

    return step


@dataclasses.dataclass(frozen=True)
class Variant:
    stages: int
    microbatches: int
    schedule: str
    recompute: bool = False
    zero: int = 0  # passes=rp.PassManager.default(zero=zero), through run_pipelined
    fold: int = 1  # replicas_per_device: the mesh's logical replicas, this many per device
    run: bool = False  # with zero: the user's own step through repl.run (its update on chunks), not run_pipelined
    tensor: int = 1  # Parallelism(tensor=T, tensor_plan=tensor_plan(spec, T)): the user's step, split, then cut
    sequence_parallel: bool = False  # with tensor: Parallelism(sequence_parallel=1), on programs on sequences

    @property
    def name(self) -> str:
        tail = ("-recompute" if self.recompute else "") + (f"-zero{self.zero}" if self.zero else "")
        return (
            f"pipe-S{self.stages}-M{self.microbatches}-{self.schedule}{tail}"
            + (f"-fold{self.fold}" if self.fold > 1 else "")
            + ("-run" if self.run else "")
            + (f"-tensor{self.tensor}" if self.tensor > 1 else "")
            + ("-sp" if self.sequence_parallel else "")
        )


#: name -> variant: S in {2, 4}, M in {S, 2S}, 1F1B, GPipe, GPipe with recomputation; each also with ZeRO (stage
#: 1 for 1F1B, 2 for GPipe, 3 for GPipe with recomputation); and three with 2 replicas per device
#: (replicas_per_device=2: the mesh's 8 logical replicas on 4 devices), the user's step and ZeRO; two with ZeRO
#: on the user's own step (``-run``: repl.run, the update cut from it run on chunks), and one of both; and four
#: of the fused 1F1B (a forward and a backward in one tick), one with ZeRO-3 and recomputation, one on the user's
#: own step with ZeRO-2; and five with a tensor axis of 2 under each stage (the user's step through repl.run,
#: split by :func:`tensor_plan`, ZeRO on the user's step): 1F1B, GPipe with ZeRO-3, fused 1F1B with sequence
#: parallelism on programs on sequences, GPipe with recomputation and sequence parallelism at 4 stages (one
#: replica of 4 x 2 devices), 1F1B with ZeRO-1.
PIPE_VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        *(
            v
            for s in (2, 4)
            for m in (s, 2 * s)
            for zero in (False, True)
            for v in (
                Variant(s, m, "1f1b", zero=1 * zero),
                Variant(s, m, "gpipe", zero=2 * zero),
                Variant(s, m, "gpipe", True, 3 * zero),
            )
        ),
        Variant(2, 4, "1f1b", fold=2),
        Variant(4, 8, "gpipe", True, fold=2),
        Variant(2, 4, "1f1b", zero=1, fold=2),
        Variant(2, 4, "1f1b", zero=2, run=True),
        Variant(4, 8, "gpipe", True, zero=3, run=True),
        Variant(2, 4, "gpipe", zero=2, fold=2, run=True),
        Variant(2, 4, "1f1b-fused"),
        Variant(4, 8, "1f1b-fused"),
        Variant(4, 4, "1f1b-fused", True, zero=3),
        Variant(2, 4, "1f1b-fused", zero=2, run=True),
        Variant(2, 4, "1f1b", tensor=2),
        Variant(2, 4, "gpipe", zero=3, run=True, tensor=2),
        Variant(2, 4, "1f1b-fused", tensor=2, sequence_parallel=True),
        Variant(4, 8, "gpipe", True, tensor=2, sequence_parallel=True),
        Variant(2, 2, "1f1b", zero=1, run=True, tensor=2),
    ]
}
#: (num_workers, cores_per_worker) of 8 devices per stage count: stages within a worker (S divides the cores),
#: then across workers (S divides num_workers only).
PIPE_MESHES: dict[int, tuple[tuple[int, int], ...]] = {2: ((1, 8), (2, 4), (8, 1)), 4: ((1, 8), (2, 4), (4, 2))}


def mesh_for(seed: int, stages: int) -> tuple[int, int]:
    """The mesh a program runs on: the meshes of its stage count in turn, by program index."""
    meshes = PIPE_MESHES[stages]
    return meshes[seed % len(meshes)]


def mesh_of(variant: Variant, mesh: tuple[int, int]) -> tuple[int, int]:
    """The mesh ``variant`` runs on: ``mesh``, unless its replicas folded ``variant.fold`` per device leave a
    device grid that ``variant.stages`` divides neither way (2 x 4 folded in 2 is 2 x 2: not 4 stages), or its
    tensor groups do not fit in a worker beside its stages (``S x T`` must divide the cores, or ``T`` the cores
    and ``S`` the workers); then 1 x 8."""
    if variant.tensor > 1:
        workers, cores = mesh
        fits = cores % (variant.stages * variant.tensor) == 0 or (
            cores % variant.tensor == 0 and workers % variant.stages == 0
        )
        return mesh if fits else (1, 8)
    if variant.fold == 1:
        return mesh
    devices = fold_layout(*mesh, replicas_per_device=variant.fold).device_mesh
    return mesh if any(n % variant.stages == 0 for n in devices) else (1, 8)


def tensor_plan(spec: PipeSpec, size: int) -> dict[str, str | int]:
    """The program's matrices split over ``size`` devices, Megatron's way: the input layer (or the embedding)
    by columns, then the dense and residual layers' matrices alternately by rows and columns in the order the
    loss reads them (a dense layer's bias with its columns), the scanned stack's by columns, the head by rows
    after a column split. A leaf ``size`` does not divide, and the norms' and element-wise layers' vectors,
    are left unnamed (whole)."""
    d = spec.width
    if d % size:
        return {"0/head": "replicated"} if not spec.tied else {"0/emb": "replicated"}
    plan: dict[str, str | int] = {}
    if spec.embed:
        plan["0/emb"] = "column"
    else:
        plan.update({"0/inp/w": "column", "0/inp/b": 0})
    column = False  # the next matrix's split: a column-split one gives a row-split one its input's split
    for i in spec.used_segments:
        for j, kind in enumerate(spec.segments[i]):
            if kind.startswith("dense-") or kind == "residual":
                plan[f"0/l{i}_{j}/w"] = "column" if column else "row"
                if kind.startswith("dense-") and column:
                    plan[f"0/l{i}_{j}/b"] = 0
                column = not column
    if spec.stack:
        plan.update({"0/stack/w": "column", "0/stack/b": 1})
        column = False
    if not spec.tied and not column:
        plan["0/head"] = "row"
    return plan


def replicated(
    spec: PipeSpec, variant: Variant, mesh: tuple[int, int], seen: collections.Counter | None = None
) -> tuple[Any, list[float]]:
    """Final state and each step's loss (replica 0's; every replica's must agree) from ``repl.run``; after every
    step, each stage's replicas must hold the same packed rows (``check_state_every=1``): the data-parallel
    fuzzer's "claimed identical but differs", for the pipeline's state. ``seen`` counts, per ``"variant kind"``,
    the runs of a tensor variant whose split step holds a collective of that kind over the tensor axis."""
    workers, cores = mesh
    passes = rp.PassManager.default(zero=variant.zero) if variant.zero else None
    if variant.tensor > 1:  # ZeRO's threshold off: the programs' leaves are small
        passes = rp.PassManager.default(zero=variant.zero, shard_optimizer_min_bytes=0) if variant.zero else None
        return _replicated_tensor(spec, variant, mesh, passes, seen)
    repl = rp.Replicator(
        workers,
        cores,
        devices=jax.devices()[: workers * cores // variant.fold],
        parallelism=rp.Parallelism(
            replicas_per_device=variant.fold,
            stages=variant.stages,
            microbatches=variant.microbatches,
            schedule=variant.schedule,
            recompute=variant.recompute,
        ),
        passes=passes,
        check_state_every=1,  # every step: each stage's replicas hold the same rows (a DivergentStateError crashes)
    )
    step, state, losses = make_step(spec), initial_state(spec), []
    loss_fn, optimizer = make_loss(spec), make_optimizer(spec)
    for batch in global_batches(spec):
        if variant.zero and not variant.run:  # ZeRO on each stage's replicas through run_pipelined
            state, value = repl.run_pipelined(loss_fn, optimizer, batch, state)
            losses.append(float(value))
            continue
        state, out = repl.run(step, batch, state)
        rows = np.asarray(out["loss"])
        if rows.shape != (repl.pipelined.replicas,) or not np.all(rows == rows[0]):
            raise AssertionError(f"loss rows {rows}: expected {repl.pipelined.replicas} identical values")
        losses.append(float(rows[0]))
    return jax.tree.map(np.asarray, state), losses


def _replicated_tensor(
    spec: PipeSpec, variant: Variant, mesh: tuple[int, int], passes: Any, seen: collections.Counter | None
) -> tuple[Any, list]:
    """:func:`replicated` with a tensor axis: ``rp.Parallelism(tensor=T, stages=S, ...)``, the user's step through
    ``repl.run`` (ZeRO on it from ``passes``), gathers allowed so that every conversion the rules ask for runs."""
    workers, cores = mesh
    parallelism = rp.Parallelism(
        tensor=variant.tensor,
        tensor_plan=tensor_plan(spec, variant.tensor),
        allow_gather=True,
        sequence_parallel=1 if variant.sequence_parallel else None,
        stages=variant.stages,
        microbatches=variant.microbatches,
        schedule=variant.schedule,
        recompute=variant.recompute,
    )
    repl = rp.Replicator(
        workers, cores, devices=jax.devices()[: workers * cores], passes=passes, parallelism=parallelism
    )
    step, state, losses = make_step(spec), initial_state(spec), []
    batches = global_batches(spec)
    for batch in batches:
        state, out = repl.run(step, batch, state)
        rows = np.asarray(out["loss"])
        if rows.shape != (repl.pipelined.replicas,) or not np.all(rows == rows[0]):
            raise AssertionError(f"loss rows {rows}: expected {repl.pipelined.replicas} identical values")
        losses.append(float(rows[0]))
    split = repl.pipelined.user_step(step, batches[0], initial_state(spec)).tensor_split  # built by the run
    if split is None or repl.pipelined.mesh.shape.get("tensor") != variant.tensor:
        raise AssertionError(f"the pipeline was not split over a tensor axis of {variant.tensor}")
    if seen is not None:
        for kind in sorted({c.kind for c in split.collectives}):
            seen[f"{variant.name} {kind}"] += 1
    return jax.tree.map(np.asarray, state), losses


def tolerance(want: np.ndarray) -> float:
    """Allowed absolute difference of a float leaf: 2e-4 of its scale (at least 1), as the data-parallel fuzzer."""
    return 2e-4 * max(1.0, float(np.max(np.abs(want)))) if want.size else 0.0


def order_sensitivity(spec: PipeSpec) -> tuple[Any, list[float]]:
    """Per element of the final state, and per step's loss, how far the reference moves when its sums add in
    another order (the largest ``|reference - reference(order)|`` over :data:`ORDERS`).

    Large where a program amplifies float32 rounding: AdamW dividing a mean gradient that cancels to ~1e-6
    over the batch (each quarter's ~4e-4) by ``sqrt(v) + 1e-8``, through ReLU kinks, three steps (seed 340047,
    S = 4: the reference itself moves by up to 1.4e-4 when its rows are permuted; the pipelines by 4e-4 to
    9e-4 on that one element, every other element within 8e-5).
    """
    base_state, base_losses = reference(spec)
    state = jax.tree.map(lambda a: np.zeros(np.shape(a)), base_state)
    losses = [0.0] * len(base_losses)
    for order in ORDERS:
        other_state, other_losses = reference(spec, order)
        state = jax.tree.map(
            lambda e, b, o: (
                np.maximum(e, np.abs(np.asarray(b, np.float64) - o))
                if np.issubdtype(np.asarray(b).dtype, np.floating)
                else e
            ),
            state,
            base_state,
            other_state,
        )
        losses = [max(e, abs(b - o)) for e, b, o in zip(losses, base_losses, other_losses, strict=True)]
    return state, losses


def first_mismatch(got: Any, want: Any, sensitivity: Any = None) -> str | None:
    """The first leaf of ``got`` beyond :func:`tolerance` of ``want`` (integers: equal), or None. ``sensitivity``
    (:func:`order_sensitivity`'s state) widens the tolerance element by element by 4 times the reference's own
    movement under another order of its sums."""
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree.leaves(want)
    if jax.tree.structure(got) != jax.tree.structure(want):
        return f"structure {jax.tree.structure(got)}, expected {jax.tree.structure(want)}"
    widen = jax.tree.leaves(sensitivity) if sensitivity is not None else [0.0] * len(want_leaves)
    for (path, a), b, e in zip(got_leaves, want_leaves, widen, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        name = jax.tree_util.keystr(path)
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: {a.dtype}{a.shape}, expected {b.dtype}{b.shape}"
        if not np.issubdtype(b.dtype, np.floating):
            if not np.array_equal(a, b):
                return f"{name}: {a.ravel()[:6]} != {b.ravel()[:6]}"
            continue
        diff = np.abs(a.astype(np.float64) - b)
        allowed = tolerance(b) + 4 * np.asarray(e)
        if not np.all(diff <= allowed):  # NaN fails too
            excess = np.where(np.isnan(diff), np.inf, diff - allowed)
            i = np.unravel_index(np.argmax(excess), diff.shape)
            at = float(np.broadcast_to(allowed, diff.shape)[i])
            return f"{name}: max |difference| {float(diff[i]):.3g} at {tuple(int(k) for k in i)} (tolerance {at:.3g})"
    return None


#: What one (program, variant, mesh) run found: the data-parallel fuzzer's record, so scripts/fuzz.py reads
#: both alike.
PipeOutcome = Outcome


def check(
    spec: PipeSpec,
    variant: Variant,
    mesh: tuple[int, int],
    ref: tuple[Any, list[float]] | None = None,
    sensitivity_cache: dict | None = None,
    seen: collections.Counter | None = None,
) -> PipeOutcome:
    """Run one program under one variant and mesh against one device; a crash is an outcome, not an exception.

    A run that differs beyond the tolerance is compared again with the tolerance widened, element by element,
    by the reference's own sensitivity to the order of its sums (:func:`order_sensitivity`, computed once per
    program in ``sensitivity_cache``); if it agrees then, the outcome passes and records the first comparison
    in ``order_sensitive``."""
    outcome = PipeOutcome(spec, variant.name, mesh)
    try:
        want_state, want_losses = ref if ref is not None else reference(spec)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the bubble warning (M < S) never applies here; others are not findings
            got_state, got_losses = (
                replicated(spec, variant, mesh, seen) if seen is not None else replicated(spec, variant, mesh)
            )
    except Exception as e:  # noqa: BLE001 - every crash is a finding
        outcome.error = f"{type(e).__name__}: {str(e)[:400]}"
        return outcome

    def compare(sensitivity: tuple[Any, list[float]] | None) -> str | None:
        state_e, losses_e = sensitivity if sensitivity is not None else (None, [0.0] * len(want_losses))
        found = first_mismatch(got_state, want_state, state_e)
        for i, (g, w, e) in enumerate(zip(got_losses, want_losses, losses_e, strict=True)):
            if found is None and not abs(g - w) <= 1e-5 * max(1.0, abs(w)) + 4 * e:
                found = f"step {i} loss {g!r}, expected {w!r}"
        return found

    outcome.mismatch = compare(None)
    if outcome.mismatch is not None:  # is the reference itself that sensitive to rounding there?
        cache = {} if sensitivity_cache is None else sensitivity_cache
        if "order" not in cache:
            cache["order"] = order_sensitivity(spec)
        if compare(cache["order"]) is None:
            outcome.order_sensitive, outcome.mismatch = outcome.mismatch, None
        elif variant.tensor > 1 and equal_in_float64(spec, variant.name, mesh) is None:
            outcome.order_sensitive = f"{outcome.mismatch} (equal within 1e-9 in float64)"
            outcome.mismatch = None
    return outcome


def equal_in_float64(spec: PipeSpec, variant: str, mesh: tuple[int, int], offset: float = 0.0) -> str | None:
    """The pipelined run and the reference again with the program's floats in float64: None if they agree
    within 1e-9 of each leaf's scale (the float32 difference was rounding the program amplifies), else the
    first leaf that differs. A tensor variant's split matmuls add in another order than one device's, which
    the reference's other orders of its batch sums (:func:`order_sensitivity`) do not reproduce.

    It runs in a process of its own (``python -m tests.fuzz.pipelines``, at most 10 minutes): JAX's 64-bit
    mode, once on, changes what later steps of this process trace. ``offset`` is added to the run's first
    parameter leaf there (to show that the judge tells a difference)."""
    return judge_in_own_process("tests.fuzz.pipelines", spec, variant, mesh, offset)


def _judge_in_float64(payload: dict) -> str | None:
    """:func:`equal_in_float64`'s work, in its own process with 64-bit mode on."""
    global _FLOAT
    _FLOAT = np.float64
    spec, mesh = spec_from_json(PipeSpec, payload["spec"]), tuple(payload["mesh"])
    want_state, _ = reference(spec)
    got_state, _ = replicated(spec, PIPE_VARIANTS[payload["variant"]], mesh)
    leaves, tree = jax.tree.flatten(got_state)
    got_state = jax.tree.unflatten(tree, [leaves[0] + payload["offset"], *leaves[1:]])
    wide = 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_state), jax.tree.leaves(want_state), strict=True):
        if np.asarray(b).dtype != np.float64:
            continue  # integer leaves (Adam's count): compared exactly by the float32 run
        wide += 1
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape or (a.size and np.max(np.abs(a - b)) > 1e-9 * max(1.0, float(np.max(np.abs(b))))):
            return f"{jax.tree_util.keystr(path)} differs in float64 too"
    if not wide:
        raise AssertionError("no leaf of the reference is float64: the judge compared nothing")
    return None


def run_program(seed: int, variants: list[str], stats: collections.Counter | None = None) -> list[PipeOutcome]:
    """Program ``seed`` for each stage count the variants ask, on :func:`mesh_for`, under every variant."""
    stats = collections.Counter() if stats is None else stats
    outcomes = []
    for stages, seq in sorted({(PIPE_VARIANTS[v].stages, PIPE_VARIANTS[v].sequence_parallel) for v in variants}):
        spec = random_pipe_spec(seed, stages, seq)
        mesh = mesh_for(seed, stages)
        try:
            ref = reference(spec)
        except Exception as e:  # noqa: BLE001 - a reference failure is a generator bug
            outcomes.append(PipeOutcome(spec, "reference", mesh, error=f"{type(e).__name__}: {str(e)[:400]}"))
            continue
        sensitivity: dict = {}  # computed on the first mismatch only
        for v in variants:
            if (PIPE_VARIANTS[v].stages, PIPE_VARIANTS[v].sequence_parallel) == (stages, seq):
                variant = PIPE_VARIANTS[v]
                outcomes.append(check(spec, variant, mesh_of(variant, mesh), ref, sensitivity, stats))
                stats["runs"] += 1
                stats["graphs"] += 1  # every run compiles its own pipelined step
    return outcomes


if __name__ == "__main__":  # equal_in_float64's own process
    jax.config.update("jax_enable_x64", True)
    rp.force_cpu_devices(int(os.environ.get("REPLICATOR_FUZZ_DEVICES", "8")))
    print(json.dumps(_judge_in_float64(json.loads(sys.argv[1]))))
