"""Random step programs for the differential fuzzer, and their independent reference.

A program is a random :class:`Spec` turned into one step function written
against an *ops* object ``K``. Two ops objects run it:

* :class:`PerReplica`: the step as a user writes it for ``Replicator.run``;
  collectives are ``rp.all_sum``/``rp.all_gather``/..., local code is plain JAX.
* :class:`Stacked`: every replica at once on one device. Every value carries a
  leading replica axis of size ``R = W * C`` (replica ``r = w * C + c``);
  local code is ``jax.vmap`` of the same per-replica function; collectives are
  explicit reductions over that axis in NumPy-like ``jnp`` code; a gradient
  is ``jax.grad`` of the *sum over replicas* of the stacked losses (the
  library's convention: the transpose of a cross-replica sum is a
  cross-replica sum, i.e. each replica gets the gradient of every replica's
  loss with respect to its own input); ``cond`` takes replica 0's predicate
  (the generator only makes predicates identical on every replica).

Nothing of the library's tracing, passes or lowering is used by
:class:`Stacked`, so a bug there cannot cancel out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import replicator as rp

GROUPS = (None, "cores", "workers")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "clip_adam", "wrapped_adam")


# -- the two ops objects ---------------------------------------------------------------


class PerReplica:
    """Ops for the per-replica step run by ``Replicator.run``.

    ``raw=True`` writes the collectives as code for ``jax.pmap`` does: ``lax.psum``,
    ``pmean``, ``all_gather``, ``psum_scatter``, ``axis_index`` over the axis name
    ``'batch'`` (all replicas; run with ``Replicator(axis_name='batch')``) or the
    mesh names, so ``capture-collectives`` is what turns them into placeholders.
    """

    def __init__(self, workers: int, cores: int, raw: bool = False):
        self.W, self.C, self.R = workers, cores, workers * cores
        self.raw = raw

    @staticmethod
    def _name(group):
        return "batch" if group is None else group

    def local(self, fn: Callable, *args: Any) -> Any:
        return fn(*args)

    def all_sum(self, x, group=None):
        return lax.psum(x, self._name(group)) if self.raw else rp.all_sum(x, group=group)

    def all_mean(self, x, group=None):
        return lax.pmean(x, self._name(group)) if self.raw else rp.all_mean(x, group=group)

    def all_max(self, x, group=None):
        return lax.pmax(x, self._name(group)) if self.raw else rp.all_max(x, group=group)

    def all_min(self, x, group=None):
        return lax.pmin(x, self._name(group)) if self.raw else rp.all_min(x, group=group)

    def all_gather(self, x, group=None, tiled=False):
        if self.raw:
            return jax.tree.map(lambda a: lax.all_gather(a, self._name(group), tiled=tiled), x)
        return rp.all_gather(x, group=group, tiled=tiled)

    def reduce_scatter(self, x, group=None):
        if self.raw:
            return jax.tree.map(lambda a: lax.psum_scatter(a, self._name(group), tiled=True), x)
        return rp.reduce_scatter(x, group=group)

    def broadcast(self, x, source=0, group=None):
        return rp.broadcast(x, source=source, group=group)  # lax has no broadcast: mixed with raw code

    def replica_id(self, group=None):
        return lax.axis_index(self._name(group)) if self.raw else rp.replica_id(group=group)

    def batch_norm(self, x, scale, offset, group=None, eps=1e-5):
        if not self.raw:
            return rp.cross_replica_batch_norm(x, scale, offset, group=group)
        axes = tuple(range(x.ndim - 1))  # as Flax's BatchNorm(axis_name=...) computes it
        mean = self.all_mean(jnp.mean(x, axis=axes), group)
        var = self.all_mean(jnp.mean((x - mean) ** 2, axis=axes), group)
        return (x - mean) * lax.rsqrt(var + eps) * scale + offset, mean, var

    def grad(self, loss: Callable, params: Any) -> tuple[Any, Any]:
        """``(loss, grads)`` of this replica's loss."""
        return jax.value_and_grad(loss)(params)

    def cond(self, pred, true_fn, false_fn, *operands):
        return lax.cond(pred, true_fn, false_fn, *operands)

    def scan(self, body, carry, xs):
        return lax.scan(body, carry, xs)

    def optimizer_update(self, tx, wrapped: bool, grads, opt, params):
        if wrapped:
            return rp.wrap_optimizer(tx).update(grads, opt, params)
        return tx.update(grads, opt, params)


class Stacked:
    """Ops for all replicas at once: a leading replica axis on every value."""

    def __init__(self, workers: int, cores: int, wire_dtype: Any = None, order: str | None = None):
        self.W, self.C, self.R = workers, cores, workers * cores
        # With a wire dtype, f32 sums and means over 2 or more replicas round every
        # replica's operand and the sum to it, as ``compress-communication`` does.
        self.wire_dtype = wire_dtype
        # With an order ('forward' or 'reverse'), sums over replicas add the members one
        # at a time in that order (XLA's reduction order otherwise); with 'jitter', each
        # member is first moved by about 2 float32 ulps (alternately up and down): how much
        # a program's results depend on the rounding of a float32 sum.
        self.order = order

    def _add_members(self, g):
        """``sum(g, axis=1, keepdims=True)`` in :attr:`order`."""
        if self.order is None:
            return jnp.sum(g, axis=1, keepdims=True)
        if self.order == "jitter" and jnp.issubdtype(g.dtype, jnp.floating):
            signs = np.where(np.arange(g.shape[1]) % 2 == 0, 1.0, -1.0).reshape(1, -1, *([1] * (g.ndim - 2)))
            return jnp.sum(g * jnp.asarray(1.0 + signs * 2.0**-22, g.dtype), axis=1, keepdims=True)
        if self.order == "jitter":
            return jnp.sum(g, axis=1, keepdims=True)
        members = range(g.shape[1]) if self.order == "forward" else reversed(range(g.shape[1]))
        total = None
        for m in members:
            total = g[:, m : m + 1] if total is None else total + g[:, m : m + 1]
        return total

    def local(self, fn: Callable, *args: Any) -> Any:
        return jax.vmap(fn)(*args)

    def _grouped(self, x, group):
        """``x`` as (groups, members, ...): members are the replicas a collective spans."""
        x = x.reshape(self.W, self.C, *x.shape[1:])
        if group is None:
            return x.reshape(1, self.R, *x.shape[2:])
        if group == "cores":
            return x
        return jnp.swapaxes(x, 0, 1)  # (C, W, ...): the replicas of one core index

    def _ungrouped(self, g, group):
        if group is None:
            return g.reshape(self.R, *g.shape[2:])
        if group == "workers":
            g = jnp.swapaxes(g, 0, 1)
        return g.reshape(self.R, *g.shape[2:])

    def _reduce(self, x, group, op):
        g = self._grouped(x, group)
        r = op(g, axis=1, keepdims=True)
        return self._ungrouped(jnp.broadcast_to(r, g.shape), group)

    def _sum(self, x, group, mean: bool):
        g = self._grouped(x, group)
        rounded = self.wire_dtype is not None and x.dtype == jnp.float32 and g.shape[1] >= 2
        wire = (lambda a: a.astype(self.wire_dtype).astype(x.dtype)) if rounded else (lambda a: a)
        r = wire(self._add_members(wire(g)))
        r = r / g.shape[1] if mean else r
        return self._ungrouped(jnp.broadcast_to(r, g.shape), group)

    def all_sum(self, x, group=None):
        return jax.tree.map(lambda a: self._sum(a, group, mean=False), x)

    def all_mean(self, x, group=None):
        return jax.tree.map(lambda a: self._sum(a, group, mean=True), x)

    def all_max(self, x, group=None):
        return jax.tree.map(lambda a: self._reduce(a, group, jnp.max), x)

    def all_min(self, x, group=None):
        return jax.tree.map(lambda a: self._reduce(a, group, jnp.min), x)

    def all_gather(self, x, group=None, tiled=False):
        return jax.tree.map(lambda a: self._all_gather(a, group, tiled), x)

    def _all_gather(self, x, group, tiled):
        g = self._grouped(x, group)  # (G, M, *s)
        m = g.shape[1]
        every = jnp.broadcast_to(g[:, None], (g.shape[0], m, *g.shape[1:]))  # (G, M, M, *s)
        if tiled:
            every = every.reshape(g.shape[0], m, m * g.shape[2], *g.shape[3:])
        return self._ungrouped(every, group)

    def reduce_scatter(self, x, group=None):
        return jax.tree.map(lambda a: self._reduce_scatter(a, group), x)

    def _reduce_scatter(self, x, group):
        g = self._grouped(x, group)  # (G, M, n, ...)
        m = g.shape[1]
        total = self._add_members(g)[:, 0]  # (G, n, ...)
        chunks = total.reshape(g.shape[0], m, g.shape[2] // m, *g.shape[3:])
        return self._ungrouped(chunks, group)

    def broadcast(self, x, source=0, group=None):
        return jax.tree.map(lambda a: self._broadcast(a, source, group), x)

    def _broadcast(self, x, source, group):
        g = self._grouped(x, group)
        return self._ungrouped(jnp.broadcast_to(g[:, source : source + 1], g.shape), group)

    def replica_id(self, group=None):
        ids = jnp.arange(self.R, dtype=jnp.int32)
        if group == "cores":
            return ids % self.C
        if group == "workers":
            return ids // self.C
        return ids

    def batch_norm(self, x, scale, offset, group=None, eps=1e-5):
        axes = tuple(range(1, x.ndim - 1))
        mean = self.all_mean(jnp.mean(x, axis=axes), group)
        centered = x - mean.reshape(mean.shape[0], *([1] * len(axes)), mean.shape[-1])
        var = self.all_mean(jnp.mean(centered**2, axis=axes), group)
        inv = lax.rsqrt(var + eps).reshape(centered.shape[0], *([1] * len(axes)), var.shape[-1])
        return centered * inv * scale[:, None] + offset[:, None], mean, var

    def grad(self, loss: Callable, params: Any) -> tuple[Any, Any]:
        """Row ``r`` of the gradient: d(sum of every replica's loss) / d(replica r's params)."""
        return loss(params), jax.grad(lambda p: jnp.sum(loss(p)))(params)

    def cond(self, pred, true_fn, false_fn, *operands):
        return lax.cond(pred[0], true_fn, false_fn, *operands)

    def scan(self, body, carry, xs):
        carry, ys = lax.scan(body, carry, jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), xs))
        return carry, jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), ys)

    def optimizer_update(self, tx, wrapped: bool, grads, opt, params):
        if wrapped:
            grads = self.all_mean(grads)
        return jax.vmap(tx.update)(grads, opt, params)


# -- the random program ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """One random program: sizes and which features it uses."""

    seed: int
    features: int  # input width
    hidden: int  # hidden width (state vectors, batch-norm features)
    rows: int  # rows per replica
    optimizer: str
    batch_norm: str | None  # group name as text ('all' for None) or None: no batch norm
    checkpoint: bool
    grad_reduce: str  # 'mean', 'sum', 'scatter_gather', 'broadcast'
    stats: bool  # Flax-style running mean of per-replica statistics
    extra: tuple[tuple[str, str | None], ...]  # (collective, group) outputs
    cond: str | None  # None, 'state' or 'collective': a collective inside lax.cond
    scan: bool  # all_sum inside lax.scan over row chunks
    loop: bool  # all_mean inside lax.fori_loop (while) with a fixed trip count
    replica_offset: bool  # replica_id() feeds the loss
    stack: int = 0  # layers of a (stack, hidden, hidden) parameter run by lax.scan (0: none)
    # The block over a (rows, seq, features) input (:func:`block`; random_spec(forms=True) only): its sequence
    # length (0: no block), the forms in it (of :data:`FORMS`), and each form's draw.
    seq: int = 0
    forms: tuple[str, ...] = ()
    heads: int = 0  # "heads": the hidden dimension reshaped into this many heads
    dot: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # "dot": (contracting, batch) dimensions
    reduce: tuple[str, int] = ("sum", 2)  # "reduce": (op, dimension) of a reduction kept beside its input

    def describe(self) -> str:
        fields = dataclasses.asdict(self)
        if not self.seq:  # the programs as they were before the block, described the same
            for name in ("seq", "forms", "heads", "dot", "reduce"):
                del fields[name]
        return ", ".join(f"{k}={v!r}" for k, v in fields.items())

    @classmethod
    def from_json(cls, fields: dict) -> Spec:
        """The spec of ``dataclasses.asdict`` after a JSON round trip (:func:`spec_from_json`)."""
        return spec_from_json(cls, fields)


def spec_from_json(cls: type, fields: dict) -> Any:
    """``cls(**fields)``, for the fields of a spec dataclass after ``dataclasses.asdict`` and a JSON round trip:
    JSON's lists back to the tuples they were, at every depth.

    >>> spec_from_json(dict, {"extra": [["all_sum", None]], "seed": 3})
    {'extra': (('all_sum', None),), 'seed': 3}
    """

    def tupled(v: Any) -> Any:
        return tuple(tupled(x) for x in v) if isinstance(v, list) else v

    return cls(**{k: tupled(v) for k, v in fields.items()})


#: The forms of the block over a 3-d input (:func:`block`).
FORMS = ("heads", "dot", "reduce", "scan")


def random_spec(seed: int, replicas: int, forms: bool = False) -> Spec:
    """The program of index ``seed``; with ``forms``, the same program with a block over a (rows, seq,
    features) input (:func:`block`), drawn apart, so the other fields stay what they are without it."""
    rng = np.random.default_rng(seed)
    collectives = ("all_sum", "all_mean", "all_max", "all_min", "all_gather", "gather_tiled", "reduce_scatter")
    collectives += ("broadcast", "replica_id")
    n_extra = int(rng.integers(0, 4))
    extra = tuple(
        (str(rng.choice(collectives)), [None, "cores", "workers"][int(rng.integers(0, 3))]) for _ in range(n_extra)
    )
    spec = Spec(
        seed=seed,
        features=int(rng.choice([3, 4, 5, 8])),
        hidden=int(rng.choice([4, 5, 8, 16, 64, replicas * 2])),
        rows=int(rng.choice([1, 2, 4])),
        optimizer=str(rng.choice(OPTIMIZERS)),
        batch_norm=[None, "all", "cores"][int(rng.integers(0, 3))],
        checkpoint=bool(rng.integers(0, 2)),
        grad_reduce=str(rng.choice(["mean", "mean", "sum", "scatter_gather", "broadcast"])),
        stats=bool(rng.integers(0, 2)),
        extra=extra,
        cond=[None, "state", "collective"][int(rng.integers(0, 3))],
        scan=bool(rng.integers(0, 2)),
        loop=bool(rng.integers(0, 2)),
        replica_offset=bool(rng.integers(0, 2)),
        stack=int(rng.choice([0, 0, 2, 3])),
    )
    return _with_block(spec, np.random.default_rng((seed, 5))) if forms else spec


def _with_block(spec: Spec, rng: np.random.Generator) -> Spec:
    chosen = tuple(f for f in FORMS if rng.random() < 0.5)
    heads = [n for n in (2, 4) if spec.hidden % n == 0]
    chosen = tuple(f for f in chosen if f != "heads" or heads)
    contracting = tuple(int(d) for d in sorted(rng.choice(3, size=int(rng.integers(1, 4)), replace=False)))
    free = [d for d in range(3) if d not in contracting]
    batch = tuple(d for d in free if rng.random() < 0.5)
    return dataclasses.replace(
        spec,
        seq=int(rng.choice([2, 3, 4, 4, 6, 8])),  # 3 and 6: T = 4 (or 2) does not divide them
        forms=chosen,
        heads=int(rng.choice(heads)) if heads else 0,
        dot=(contracting, batch),
        reduce=(str(rng.choice(["sum", "max", "min"])), int(rng.choice([1, 2]))),
    )


def _optimizer(name: str) -> tuple[optax.GradientTransformation, bool]:
    return {
        "sgd": (optax.sgd(0.1), False),
        "momentum": (optax.sgd(0.05, momentum=0.9), False),
        "adam": (optax.adam(1e-2), False),
        "adamw": (optax.adamw(1e-2, weight_decay=1e-2), False),
        "clip_adam": (optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)), False),
        "wrapped_adam": (optax.adam(1e-2), True),
    }[name]


def initial_state(spec: Spec) -> dict:
    rng = np.random.default_rng((spec.seed, 1))
    params = {
        "w": (rng.normal(size=(spec.features, spec.hidden)) * 0.5).astype(np.float32),
        "b": (rng.normal(size=(spec.hidden,)) * 0.1).astype(np.float32),
        "scale": np.ones(spec.hidden, np.float32),
        "offset": np.zeros(spec.hidden, np.float32),
    }
    if spec.stack:
        shape = (spec.stack, spec.hidden, spec.hidden)
        params["stack"] = (rng.normal(size=shape) / np.sqrt(spec.hidden)).astype(np.float32)
    if spec.seq:  # the block's second matrix, drawn apart
        v = np.random.default_rng((spec.seed, 4)).normal(size=(spec.hidden, spec.features))
        params["v"] = (v / np.sqrt(spec.hidden)).astype(np.float32)
    tx, _ = _optimizer(spec.optimizer)
    return {
        "params": params,
        "opt": tx.init(params),
        "stats": np.zeros(spec.hidden, np.float32),
        "step": np.zeros((), np.int32),
    }


def global_batches(spec: Spec, replicas: int, steps: int) -> list[dict]:
    """Global batches: replica ``r`` gets rows ``[r * rows, (r + 1) * rows)``."""
    rng = np.random.default_rng((spec.seed, 2))
    n = replicas * spec.rows
    batches = [
        {
            "x": rng.normal(size=(n, spec.features)).astype(np.float32),
            "y": rng.normal(size=(n, spec.hidden)).astype(np.float32),
        }
        for _ in range(steps)
    ]
    if spec.seq:  # the block's input, drawn apart
        seq_rng = np.random.default_rng((spec.seed, 3))
        for b in batches:
            b["s"] = seq_rng.normal(size=(n, spec.seq, spec.features)).astype(np.float32)
    return batches


def block(spec: Spec, p: dict, s: jax.Array) -> jax.Array:
    """One replica's term of the loss from a (rows, seq, features) input: a Megatron-like block (``w`` then ``v``,
    a residual add and a norm over the features, ``w`` again) with the forms of ``spec.forms`` on its hidden
    activation (rows, seq, hidden) between the two matrices:

    * ``heads``: the hidden dimension reshaped into heads (split, a column-split ``w`` splits the heads), an
      attention over the sequence per head (a softmax over it), merged back;
    * ``dot``: a ``dot_general`` of the activation with its sine, contracting and batching random dimensions;
    * ``reduce``: a sum, max or min subtracted back, over the hidden dimension of the activation (split by a
      column-split ``w``) or over the sequence of the residual sum (split there with sequence parallelism);
    * ``scan``: a ``lax.scan`` over the sequence with a (rows, hidden) carry.

    With sequence parallelism (dimension 1) the residual's partial sum is reduce-scattered on the sequence and
    the second ``@ w`` all-gathers it.
    """
    h = jnp.tanh(s @ p["w"] + p["b"])  # (rows, seq, hidden)
    extra = jnp.zeros((), h.dtype)
    if "heads" in spec.forms:
        q = h.reshape(*h.shape[:2], spec.heads, h.shape[2] // spec.heads)
        scores = jnp.einsum("bqnd,bknd->bnqk", q, q) / np.sqrt(q.shape[-1])
        h = h + jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(scores, axis=-1), q).reshape(h.shape)
    if "dot" in spec.forms:
        contracting, batch = spec.dot
        g = lax.dot_general(h, jnp.sin(h), ((contracting, contracting), (batch, batch)))
        extra = extra + 0.1 * jnp.mean(jnp.tanh(g))
    if "reduce" in spec.forms and spec.reduce[1] == 2:
        h = _reduced(spec.reduce[0], h, 2)
    if "scan" in spec.forms:

        def cell(c, x):
            c = jnp.tanh(0.5 * c + x)
            return c, c

        _, hs = lax.scan(cell, jnp.zeros_like(h[:, 0]), jnp.swapaxes(h, 0, 1))
        h = jnp.swapaxes(hs, 0, 1)
    o = s + h @ p["v"]  # a row-parallel product's partial sum, added to the input: summed (or reduce-scattered)
    if "reduce" in spec.forms and spec.reduce[1] == 1:
        o = _reduced(spec.reduce[0], o, 1)
    o = o - jnp.mean(o, axis=-1, keepdims=True)
    return 0.1 * jnp.mean(jnp.tanh(o @ p["w"]) ** 2) + extra


def _reduced(op: str, x: jax.Array, dim: int) -> jax.Array:
    """``x`` less half its sum (as a mean), max or min over ``dim``."""
    r = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[op](x, axis=dim, keepdims=True)
    return x - 0.5 * (r / x.shape[dim] if op == "sum" else r)


def make_step(spec: Spec, K: Any) -> Callable:
    """The step of ``spec`` written against the ops object ``K``."""
    tx, wrapped = _optimizer(spec.optimizer)
    group = {None: None, "all": None, "cores": "cores"}[spec.batch_norm]
    R = K.R

    def forward(p, x):
        return x @ p["w"] + p["b"]

    def loss_fn(p, batch):
        if spec.batch_norm is None:
            h = K.local(forward, p, batch["x"])
        else:  # a bias before batch norm has a gradient of rounding noise, which Adam would amplify
            h = K.local(lambda w, x: x @ w, p["w"], batch["x"])
            h, _, _ = K.batch_norm(h, p["scale"], p["offset"], group=group)
            h = K.local(jnp.add, h, p["b"])
        if spec.stack:  # a stack of layers, one per scan iteration (ZeRO-3 gathers it slice by slice)
            h = K.local(lambda a, ws: lax.scan(lambda c, w: (jnp.tanh(c @ w), None), a, ws)[0], h, p["stack"])
        if spec.replica_offset:
            rid = K.replica_id()
            h = K.local(lambda a, r: a + 0.01 * r.astype(a.dtype), h, rid)
        value = K.local(lambda a, y: jnp.mean((jnp.tanh(a) - y) ** 2), h, batch["y"])
        if spec.seq:
            value = K.local(lambda v, q, s: v + block(spec, q, s), value, p, batch["s"])
        return value

    def step(state, batch):
        params, opt = state["params"], state["opt"]
        fn = (lambda p: loss_fn(p, batch)) if not spec.checkpoint else jax.checkpoint(lambda p: loss_fn(p, batch))
        loss, grads = K.grad(fn, params)
        if not wrapped:
            if spec.grad_reduce == "mean":
                grads = K.all_mean(grads)
            elif spec.grad_reduce == "sum":
                grads = jax.tree.map(lambda g: K.local(lambda a: a / R, g), K.all_sum(grads))
            elif spec.grad_reduce == "broadcast":
                grads = K.broadcast(K.all_mean(grads), source=R - 1)
            else:  # reduce-scatter then all-gather, written by the user (leaves padded to divide)
                grads = jax.tree.map(lambda g: _scatter_gather(K, g), grads)
        updates, opt = K.optimizer_update(tx, wrapped, grads, opt, params)
        params = K.local(optax.apply_updates, params, updates)
        new = {"params": params, "opt": opt, "stats": state["stats"], "step": state["step"]}
        outputs = {"loss": K.all_mean(loss)}
        if spec.stats:  # Flax's batch statistics: a running mean of per-replica means
            local_mean = K.local(lambda h: jnp.mean(jnp.tanh(h), axis=0), K.local(forward, params, batch["x"]))
            new["stats"] = K.all_mean(K.local(lambda s, m: 0.9 * s + 0.1 * m, state["stats"], local_mean))
        new["step"] = K.local(lambda s: s + 1, state["step"])
        x = batch["x"]
        for i, (kind, g) in enumerate(spec.extra):
            outputs[f"extra{i}_{kind}"] = _extra(K, kind, g, x)
        if spec.cond is not None:
            if spec.cond == "state":
                pred = K.local(lambda s: s % 2 == 0, state["step"])
            else:
                pred = K.local(lambda m: m > 0.0, K.all_max(K.local(lambda a: jnp.sum(a), x)))
            outputs["cond"] = K.cond(
                pred,
                lambda a: K.all_sum(K.local(lambda v: v * 2.0, a)),
                lambda a: K.all_max(a, group="cores"),
                x,
            )
        if spec.scan:
            chunks = K.local(lambda a: a.reshape(a.shape[0], 1, a.shape[1]), x)

            def body(carry, xs):
                s = K.all_sum(K.local(lambda v: jnp.sum(v, axis=0), xs))
                return K.local(jnp.add, carry, s), K.local(jnp.max, s)

            carry0 = K.local(lambda a: jnp.zeros(a.shape[1], a.dtype), x)
            outputs["scan_total"], outputs["scan_max"] = K.scan(body, carry0, chunks)
        if spec.loop:
            start = K.local(lambda a: jnp.sum(a, axis=0), x)

            def loop(_, v):
                return K.all_mean(K.local(lambda a: jnp.sin(a) + 0.5 * a, v))

            outputs["loop"] = _while(3, loop, start)
        return new, outputs

    return step


def _while(n: int, body: Callable, init: Any) -> Any:
    """``n`` trips of ``body`` in a ``lax.while_loop`` (the trip count is the same on every replica)."""
    return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[0], c[1])), (0, init))[1]


def _scatter_gather(K: Any, g: Any) -> Any:
    """``all_gather(reduce_scatter(g)) / R`` along a leading axis padded to divide by R."""
    R = K.R
    flat = K.local(lambda a: jnp.pad(a.reshape(-1), (0, (-a.size) % R)), g)
    chunk = K.reduce_scatter(flat)
    full = K.all_gather(chunk, tiled=True)
    return K.local(lambda f, a: (f[: a.size] / R).reshape(a.shape), full, g)


def _extra(K: Any, kind: str, group: str | None, x: Any) -> Any:
    members = {None: K.R, "cores": K.C, "workers": K.W}[group]
    v = K.local(lambda a: jnp.tanh(a).sum(axis=0), x)
    if kind == "all_sum":
        return K.all_sum(v, group)
    if kind == "all_mean":
        return K.all_mean(v, group)
    if kind == "all_max":
        return K.all_max(v, group)
    if kind == "all_min":
        return K.all_min(v, group)
    if kind == "all_gather":
        return K.all_gather(v, group)
    if kind == "gather_tiled":
        return K.all_gather(v, group, tiled=True)
    if kind == "reduce_scatter":
        rows = K.local(lambda a: jnp.tile(a, (members, 1)), v)  # (members * f,): divides
        return K.reduce_scatter(rows, group)
    if kind == "broadcast":
        return K.broadcast(v, source=members - 1, group=group)
    return K.local(lambda r, a: a * r.astype(a.dtype), K.replica_id(group), v)
