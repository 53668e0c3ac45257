"""Helpers shared by the tests (in the spirit of ``optax._src.test_utils``).

Import as ``from utils import ...``: ``tests/`` has no ``__init__.py``, so pytest
puts it on ``sys.path`` (with ``pytest`` and ``python -m pytest`` alike).

* :func:`simulate`: an independent reference for a step. Every replica runs at
  once on one device: ``jax.vmap`` over a ``'workers'`` and a ``'cores'`` axis,
  with the ``rp.*`` collectives swapped for plain ``jax.lax`` collectives over
  those named axes. None of the library's tracing, passes or lowering is used,
  so a bug there cannot cancel out against the reference.
* :func:`assert_identical_where_claimed`: an output leaf the replica-variance
  analysis calls identical along a mesh axis must be identical along it.
* The placeholder cases, their NumPy references and the contexts a step may
  put a placeholder in (test_placeholders.py, test_placeholders_grad.py).
* The deliberately wrong pass and the small step shared by the translation
  validation and bisection tests (and their command-line entry points).
* :func:`custom_vmap_call_primitive`: found by tracing, not a private import.
* The child processes of ``tests/multiproc/child_worker.py``: :func:`child_pids`,
  :func:`still_running` (launcher tests: what a worker started ends with it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import replicator as rp
from replicator.core.jaxprs import inline_function
from replicator.core.primitives import all_reduce_p
from replicator.pass_manager.contract import rewrite_graph
from replicator.passes import Pass, PassManager, default_passes

# -- the vmap reference --------------------------------------------------------------------

_BOTH = ("workers", "cores")


def _axes(group: str | None):
    if group not in (None, "cores", "workers"):
        raise ValueError(f"unknown group {group!r}")
    return _BOTH if group is None else group


class _Sim:
    """``rp.*`` replacements over the named vmap axes ``'workers'`` and ``'cores'``.

    Gradients follow the library's convention: the transpose of a cross-replica
    sum (mean) is a cross-replica sum (mean), so these are ``custom_vjp``s.
    """

    def __init__(self, workers: int, cores: int):
        self.sizes = {"workers": workers, "cores": cores, None: workers * cores}

    @staticmethod
    def _linear(reduce: Callable) -> Callable:
        f = jax.custom_vjp(reduce)
        f.defvjp(lambda a: (reduce(a), None), lambda _, ct: (reduce(ct),))
        return f

    def all_sum(self, x, *, group=None):
        f = self._linear(lambda a: lax.psum(a, _axes(group)))

        def one(a):
            a = jnp.asarray(a)
            return f(a) if jnp.issubdtype(a.dtype, jnp.inexact) else lax.psum(a, _axes(group))

        return jax.tree.map(one, x)

    def all_mean(self, x, *, group=None):
        n = self.sizes[group]
        f = self._linear(lambda a: lax.psum(a, _axes(group)) / n)
        return jax.tree.map(lambda a: f(jnp.asarray(a)), x)

    def _extreme(self, x, group, op):
        def one(a):
            a = jnp.asarray(a)
            if a.dtype == jnp.bool_:
                return op(a.astype(jnp.int32), _axes(group)).astype(jnp.bool_)
            return op(a, _axes(group))

        return jax.tree.map(one, x)

    def all_max(self, x, *, group=None):
        return self._extreme(x, group, lax.pmax)

    def all_min(self, x, *, group=None):
        return self._extreme(x, group, lax.pmin)

    def _gather(self, a, axis, tiled, group):
        def fwd(v):
            return self._plain_gather(v, axis, tiled, group)

        def bwd(ct):  # the library's transpose: a reduce-scatter
            summed = self._scatter(ct, axis, group)
            return summed if tiled else jnp.squeeze(summed, axis)

        f = jax.custom_vjp(fwd)
        f.defvjp(lambda v: (fwd(v), None), lambda _, ct: (bwd(ct),))
        return f(a)

    @staticmethod
    def _plain_gather(v, axis, tiled, group):
        """``lax.all_gather`` one named axis at a time (replica ``w * C + c``)."""
        g = lax.all_gather(v, "cores") if group in (None, "cores") else lax.all_gather(v, "workers")
        if group is None:
            g = lax.all_gather(g, "workers")  # (W, C, ...)
            g = g.reshape(-1, *g.shape[2:])
        g = jnp.moveaxis(g, 0, axis)
        if tiled:
            g = g.reshape(*g.shape[:axis], g.shape[axis] * g.shape[axis + 1], *g.shape[axis + 2 :])
        return g

    def _scatter(self, a, axis, group):
        n = self.sizes[group]
        chunk = a.shape[axis] // n
        return lax.dynamic_slice_in_dim(lax.psum(a, _axes(group)), lax.axis_index(_axes(group)) * chunk, chunk, axis)

    def all_gather(self, x, *, axis=0, tiled=False, group=None):
        return jax.tree.map(lambda a: self._gather(jnp.asarray(a), axis, tiled, group), x)

    def reduce_scatter(self, x, *, axis=0, group=None):
        def one(a):
            a = jnp.asarray(a)
            f = jax.custom_vjp(lambda v: self._scatter(v, axis, group))
            f.defvjp(
                lambda v: (self._scatter(v, axis, group), None),
                lambda _, ct: (self._plain_gather(ct, axis, True, group),),
            )
            return f(a) if jnp.issubdtype(a.dtype, jnp.inexact) else self._scatter(a, axis, group)

        return jax.tree.map(one, x)

    def broadcast(self, x, *, source=0, group=None):
        def fwd(v):
            return self._plain_gather(v, 0, False, group)[source]

        def bwd(ct):  # the library's transpose: the sum of every replica's cotangent, at the source
            mine = lax.axis_index(_axes(group)) == source
            return jnp.where(mine, lax.psum(ct, _axes(group)), jnp.zeros_like(ct))

        f = jax.custom_vjp(fwd)
        f.defvjp(lambda v: (fwd(v), None), lambda _, ct: (bwd(ct),))
        return jax.tree.map(
            lambda a: f(jnp.asarray(a)) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.inexact) else fwd(a), x
        )

    def replica_id(self, *, group=None):
        return lax.axis_index(_axes(group)).astype(jnp.int32)

    def num_replicas(self, *, group=None):
        return self.sizes[group]


_PATCHED = (
    "all_sum",
    "all_mean",
    "all_max",
    "all_min",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "replica_id",
    "num_replicas",
)


@contextlib.contextmanager
def _patched(sim: _Sim) -> Iterator[None]:
    # ``jax.jit`` caches a function's trace by identity: one traced under the
    # library holds placeholders, one traced here holds ``lax`` collectives.
    # Clearing on the way in and out keeps each side from reusing the other's.
    saved = {name: getattr(rp, name) for name in _PATCHED}
    jax.clear_caches()
    try:
        for name in _PATCHED:
            setattr(rp, name, getattr(sim, name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(rp, name, fn)
        jax.clear_caches()


def _split(batch: Any, workers: int, cores: int) -> Any:
    """A global batch (the worker batches concatenated) as (workers, cores, rows, ...)."""
    return jax.tree.map(lambda a: np.asarray(a).reshape(workers, cores, -1, *np.shape(a)[1:]), batch)


def simulate(
    step: Callable,
    workers: int,
    cores: int,
    batches: Sequence[Any],
    state: Any = None,
    *,
    has_state: bool | None = None,
) -> tuple[Any, list[Any]]:
    """Run ``step`` for each of ``batches`` on all replicas at once, with ``jax.vmap``.

    ``batches``: one entry per step, each the *global* batch (worker 0's batch,
    then worker 1's, ...; a worker's rows are split evenly over its cores, as
    ``Replicator.run`` does). Returns ``(final_state, [outputs per step])``: the
    state after checking that every replica holds the same one, and outputs
    with a leading replica axis (replica ``w * cores + c``) as ``Replicator.run``
    returns them. Steps must call collectives as ``rp.<name>`` (looked up at
    call time); they are swapped for ``jax.lax`` collectives while this runs.
    """
    has_state = state is not None if has_state is None else has_state
    sim = _Sim(workers, cores)
    R = workers * cores

    def per_replica(s, b):
        return step(s, b) if has_state else (s, step(b))

    vmapped = jax.vmap(
        jax.vmap(per_replica, in_axes=(None, 0), axis_name="cores"), in_axes=(None, 0), axis_name="workers"
    )
    outputs = []
    with _patched(sim):
        for batch in batches:
            new, out = vmapped(state, _split(batch, workers, cores))
            rows = jax.tree.map(lambda a: np.asarray(a).reshape(R, *np.shape(a)[2:]), new)
            for leaf in jax.tree.leaves(rows):
                np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape), "state differs by replica")
            state = jax.tree.map(lambda a: a[0], rows)
            outputs.append(jax.tree.map(lambda a: np.asarray(a).reshape(R, *np.shape(a)[2:]), out))
    return state, outputs


def worker_batches(input_fn: Callable, workers: int, cores: int, steps: int) -> list[Any]:
    """The first ``steps`` global batches an ``input_fn`` gives ``Replicator.run`` (worker batches concatenated)."""
    repl = rp.Replicator(workers, cores)
    iters = [iter(input_fn(repl.input_context(w))) for w in range(workers)]
    out = []
    for _ in range(steps):
        parts = [next(it) for it in iters]
        out.append(jax.tree.map(lambda *a: np.concatenate([np.asarray(x) for x in a]), *parts))
    return out


def sum_rounding_scale(replicas: int) -> float:
    """How much larger rounding can be on ``replicas`` than on the 8 the tests' float tolerances were set for.

    The error bound of a float sum of N terms grows as ``N u`` (Higham, *Accuracy and Stability of Numerical
    Algorithms*, Lemma 3.1), and a cross-replica sum has a term per replica; with ``REPLICATOR_TEST_DEVICES=16``
    tolerances double, with 8 or fewer they are as written.
    """
    return max(1.0, replicas / 8)


def assert_trees_close(got: Any, want: Any, *, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Same structure, shapes and dtypes; floats within ``atol + rtol * |want|``, others equal."""
    assert jax.tree.structure(got) == jax.tree.structure(want), (jax.tree.structure(got), jax.tree.structure(want))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        name = jax.tree_util.keystr(path)
        assert a.shape == b.shape, f"{name}: shape {a.shape} != {b.shape}"
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
        if np.issubdtype(b.dtype, np.inexact):
            np.testing.assert_allclose(a, b, atol=atol, rtol=rtol, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@contextlib.contextmanager
def _fresh_input_on_purpose() -> Iterator[None]:
    """Each call of these helpers starts its batches over, on purpose: no warning for an input_fn made per call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Replicator\.run: input_fn .* is a new function object")
        yield


def train_on_global_batches(repl: rp.Replicator, step: Callable, state: Any, batches: Sequence[Any]) -> Any:
    """``repl.run`` once per global batch of ``batches`` (worker ``w`` takes its contiguous rows); the last state."""

    def input_fn(ctx):
        rows = len(batches[0]["x"]) // repl.num_workers
        for b in batches:
            yield jax.tree.map(lambda a: a[ctx.worker_id * rows : (ctx.worker_id + 1) * rows], b)

    for _ in batches:
        state, _ = repl.run(step, input_fn, state)
    return state


def check_against_simulation(
    repl: rp.Replicator, step: Callable, batches: Sequence[Any], state: Any = None, **tol: float
) -> tuple[Any, list[Any]]:
    """Run ``step`` with ``repl`` on ``batches`` (global batches) and compare each step with :func:`simulate`."""
    W, C = repl.num_workers, repl.cores_per_worker
    rows = [jax.tree.map(lambda a: np.asarray(a).reshape(W, -1, *np.shape(a)[1:]), b) for b in batches]

    def input_fn(ctx):
        for b in rows:
            yield jax.tree.map(lambda a: a[ctx.worker_id], b)

    want_state, want_outputs = simulate(step, W, C, batches, state)
    got_state = state
    for want in want_outputs:
        with _fresh_input_on_purpose():
            if state is None:
                got = repl.run(step, input_fn)
            else:
                got_state, got = repl.run(step, input_fn, got_state)
        assert_trees_close(rp.local_outputs(got), want, **tol)
    if state is not None:
        assert_trees_close(jax.tree.map(np.asarray, got_state), want_state, **tol)
    return want_state, want_outputs


# -- the variance analysis against a run ----------------------------------------------------


def assert_identical_where_claimed(outputs: Any, variance: Sequence[frozenset], workers: int, cores: int) -> None:
    """Every output leaf the analysis calls identical along 'cores' or 'workers' is identical along it.

    ``outputs``: per-replica outputs (a leading replica axis); ``variance``: the
    analysis's variance of each output leaf, in leaf order.
    """
    leaves = jax.tree_util.tree_leaves_with_path(outputs)
    assert len(leaves) == len(variance)
    for (path, leaf), axes in zip(leaves, variance, strict=True):
        rows = np.asarray(leaf).reshape(workers, cores, *np.shape(leaf)[1:])
        for axis, name in ((1, "cores"), (0, "workers")):
            if name in axes:
                continue
            np.testing.assert_array_equal(
                rows,
                np.broadcast_to(np.take(rows, [0], axis=axis), rows.shape),
                f"output {jax.tree_util.keystr(path)}: called identical along {name!r} but it differs",
            )


# -- placeholder cases against NumPy (test_placeholders.py, test_placeholders_grad.py) ------
#
# Replica ``r`` gets rows ``r * k:(r + 1) * k`` of the global batch.

COLS = 3


def run_step(repl: rp.Replicator, step_fn: Callable, batch: Any, state: Any = None) -> Any:
    """One ``repl.run`` on ``batch``, the *global* batch: worker w yields its rows."""
    workers = repl.num_workers

    def input_fn(ctx):
        local = jax.tree.map(lambda a: np.split(np.asarray(a), workers)[ctx.worker_id], batch)
        while True:
            yield local

    with _fresh_input_on_purpose():
        return repl.run(step_fn, input_fn, state)


def per_replica(a: Any, n: int) -> Any:
    """``(n * k, ...) -> (n, k, ...)``: the slices replica 0..n-1 receive."""
    return a.reshape(n, a.shape[0] // n, *a.shape[1:])


def group_of(repl: rp.Replicator, group: str | None, r: int) -> tuple[list[int], int]:
    """The replica ids of ``r``'s group, in group order, and ``r``'s index in it."""
    workers, cores = repl.num_workers, repl.cores_per_worker
    w, c = divmod(r, cores)
    if group is None:
        return list(range(workers * cores)), r
    if group == "cores":
        return [w * cores + j for j in range(cores)], c
    assert group == "workers"
    return [j * cores + c for j in range(workers)], w


def reference(repl: rp.Replicator, ref: Callable, xs: Any, group: str | None = None, xp: Any = np) -> Any:
    """Stack ``ref(xp, xs[group members of r], index of r)`` over replicas ``r``."""
    outs = []
    for r in range(repl.num_replicas):
        members, index = group_of(repl, group, r)
        step = members[1] - members[0] if len(members) > 1 else 1
        assert members == list(range(members[0], members[-1] + 1, step))
        outs.append(ref(xp, xs[members[0] : members[-1] + 1 : step], index))  # a slice, not a gather
    return xp.stack([xp.asarray(o) for o in outs])


def data(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _chunk(s: Any, axis: int, parts: int, i: int) -> Any:
    """The ``i``-th of ``parts`` equal chunks of ``s`` along ``axis``."""
    size = s.shape[axis] // parts
    return s[(slice(None),) * axis + (slice(i * size, (i + 1) * size),)]


@dataclasses.dataclass(frozen=True)
class Case:
    """A placeholder call ``fn(x, group)`` on one replica's ``x`` (shape (k, d)),
    and ``ref(xp, xg, i)``: its value on the replica of index ``i`` of a group
    whose members' ``x`` are stacked in ``xg`` (``xp``: numpy or jax.numpy)."""

    name: str
    fn: Callable[[jax.Array, str | None], jax.Array]
    ref: Callable[[Any, Any, int], Any]


CASES = [
    Case("all_sum", lambda x, g: rp.all_sum(x, group=g), lambda xp, xg, i: xg.sum(0)),
    Case("all_mean", lambda x, g: rp.all_mean(x, group=g), lambda xp, xg, i: xg.mean(0)),
    Case("all_max", lambda x, g: rp.all_max(x, group=g), lambda xp, xg, i: xg.max(0)),
    Case("all_min", lambda x, g: rp.all_min(x, group=g), lambda xp, xg, i: xg.min(0)),
    Case("all_gather", lambda x, g: rp.all_gather(x, group=g), lambda xp, xg, i: xg),
    Case(
        "all_gather_axis1",
        lambda x, g: rp.all_gather(x, axis=1, group=g),
        lambda xp, xg, i: xp.moveaxis(xg, 0, 1),
    ),
    Case(
        "all_gather_axis-1",
        lambda x, g: rp.all_gather(x, axis=-1, group=g),
        lambda xp, xg, i: xp.moveaxis(xg, 0, -1),
    ),
    Case(
        "all_gather_tiled",
        lambda x, g: rp.all_gather(x, tiled=True, group=g),
        lambda xp, xg, i: xp.concatenate(list(xg), axis=0),
    ),
    Case(
        "all_gather_tiled_axis1",
        lambda x, g: rp.all_gather(x, axis=1, tiled=True, group=g),
        lambda xp, xg, i: xp.concatenate(list(xg), axis=1),
    ),
    Case("broadcast_first", lambda x, g: rp.broadcast(x, source=0, group=g), lambda xp, xg, i: xg[0]),
    Case(
        "broadcast_last",
        lambda x, g: rp.broadcast(x, source=rp.num_replicas(group=g) - 1, group=g),
        lambda xp, xg, i: xg[-1],
    ),
    Case(
        "reduce_scatter",
        lambda x, g: rp.reduce_scatter(x, group=g),
        lambda xp, xg, i: _chunk(xg.sum(0), 0, len(xg), i),
    ),
    Case(
        "reduce_scatter_axis1",
        lambda x, g: rp.reduce_scatter(x.T, axis=1, group=g),
        lambda xp, xg, i: _chunk(xg.sum(0).T, 1, len(xg), i),
    ),
    Case("replica_id", lambda x, g: rp.replica_id(group=g), lambda xp, xg, i: np.int32(i)),
    Case(
        "num_replicas",
        lambda x, g: jnp.asarray(rp.num_replicas(group=g), jnp.int32),
        lambda xp, xg, i: np.int32(len(xg)),
    ),
]
CASE_PARAMS = [pytest.param(c, id=c.name) for c in CASES]
CASES_BY_NAME = {c.name: c for c in CASES}


def assert_matches(got: Any, want: Any) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# The contexts a step may put a placeholder in.


def _zeros_like_out(fn: Callable, x: jax.Array) -> Callable:
    spec = jax.eval_shape(fn, x)
    return lambda _: jnp.zeros(spec.shape, spec.dtype)


def _loss_with_out(fn: Callable) -> Callable:
    """A scalar loss that differentiates through ``fn`` (when it is float), with ``fn(x)`` as aux."""

    def loss(x):
        out = fn(x)
        total = jnp.sum(jnp.sin(x))
        if jnp.issubdtype(out.dtype, jnp.floating):
            total = total + jnp.sum(jnp.tanh(out))
        return total, out

    return loss


def _in_cond_true_branch(fn):
    # A runtime predicate, identical on every replica because it was all-reduced: always True.
    def wrapped(x):
        pred = rp.all_max(jnp.max(x)) >= rp.all_min(jnp.min(x))
        return lax.cond(pred, fn, _zeros_like_out(fn, x), x)

    return wrapped


def _in_cond_false_branch(fn):
    # A predicate that is identical on every replica because it was all-reduced.
    def wrapped(x):
        pred = rp.all_max(jnp.max(x)) < rp.all_min(jnp.min(x))  # always False
        return lax.cond(pred, _zeros_like_out(fn, x), fn, x)

    return wrapped


def _in_scan(fn):
    def wrapped(x):
        _, ys = lax.scan(lambda c, xi: (c, fn(xi)), None, jnp.stack([x - 1.0, x]))
        return ys[1]

    return wrapped


def _in_while(fn):
    def wrapped(x):
        def body(carry):
            i, _ = carry
            return i + 1, fn(x + (i - 2).astype(x.dtype))  # the last of 3 trips sees x

        init = (jnp.int32(0), _zeros_like_out(fn, x)(x))
        return lax.while_loop(lambda carry: carry[0] < 3, body, init)[1]

    return wrapped


def _under_grad(fn):
    return lambda x: jax.grad(_loss_with_out(fn), has_aux=True)(x)[1]


def _under_value_and_grad(fn):
    return lambda x: jax.value_and_grad(_loss_with_out(fn), has_aux=True)(x)[0][1]


def _under_grad_of_checkpoint(fn):
    return lambda x: jax.grad(jax.checkpoint(_loss_with_out(fn)), has_aux=True)(x)[1]


CONTEXTS = {
    "plain": lambda fn: fn,
    "jit": jax.jit,
    "cond_true_branch": _in_cond_true_branch,
    "cond_false_branch": _in_cond_false_branch,
    "scan": _in_scan,
    "while_loop": _in_while,
    "checkpoint": jax.checkpoint,
    "grad": _under_grad,
    "value_and_grad": _under_value_and_grad,
    "grad_checkpoint": _under_grad_of_checkpoint,
}


# -- a deliberately wrong pass and the step it breaks (validation and bisection tests) ------


class DoubleFirstAllSum(Pass):
    """A wrong pass: the first all_sum's operand is doubled (``factor``: another multiplier)."""

    name = "double-first-all-sum"
    factor = 2.0

    def run(self, graph):
        factor = self.factor
        done = []

        def rule(eqn):
            if done or eqn.primitive is not all_reduce_p or eqn.params["op"] != "sum":
                return None
            done.append(eqn)
            params = eqn.params
            return inline_function(
                lambda x: all_reduce_p.bind(x * factor, **params), eqn.invars, context=graph.context, like=eqn
            )

        return rewrite_graph(graph, rule)


def wrong_pipeline(**kwargs) -> PassManager:
    """The default passes with :class:`DoubleFirstAllSum` right after ``simplify``."""
    passes = default_passes()
    passes.insert([p.name for p in passes].index("simplify") + 1, DoubleFirstAllSum())
    return PassManager(passes, **kwargs)


def small_step(state, batch):
    """A step with an averaged gradient and two all_sum outputs (``total`` reads the batch)."""
    g = rp.all_mean(jax.grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(state["w"]))
    return {"w": state["w"] - 0.1 * g}, {"total": rp.all_sum(jnp.sum(batch["x"])), "rows": rp.all_sum(1)}


def small_inputs(n: int) -> tuple[dict, dict]:
    """A batch of ``2 n`` rows and a state for :func:`small_step`."""
    return {"x": np.ones((2 * n, 3), np.float32)}, {"w": np.ones((3, 2), np.float32)}


def cli_batch() -> dict:
    """For command-line tests: a :func:`small_step` batch for all local devices."""
    return small_inputs(jax.device_count())[0]


def cli_state() -> dict:
    return small_inputs(jax.device_count())[1]


# -- JAX internals the tests need, found through public API -----------------------------------


def custom_vmap_call_primitive() -> Any:
    """The primitive ``jax.custom_batching.custom_vmap`` binds (found by tracing one, not by a private import)."""

    @jax.custom_batching.custom_vmap
    def identity(x):
        return x

    @identity.def_vmap
    def _rule(axis_size, in_batched, x):
        del axis_size
        return x, in_batched[0]

    (eqn,) = jax.make_jaxpr(identity)(1.0).eqns
    return eqn.primitive


# -- processes a worker started (tests/multiproc/child_worker.py) -----------------------------


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited and waiting for its parent, does not)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def finish(procs: Sequence[subprocess.Popen], timeout_s: float) -> list[tuple[int, str]]:
    """``(exit code, output)`` of each process, in order, waiting at most ``timeout_s`` for each (then killed)."""
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout_s)
        finally:
            p.kill()
        out.append((p.returncode, text))
    return out


def still_running(pids: list[int], within_s: float = 5.0) -> list[int]:
    """The ``pids`` still running after waiting up to ``within_s`` for them to end."""
    deadline = time.monotonic() + within_s
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if running(p)]


def child_pids(prefix: Path) -> dict[str, int]:
    """``{'<worker>.<start>': pid}`` of the children that tests/multiproc/child_worker.py wrote."""
    return {p.name.split(".", 1)[1]: int(p.read_text()) for p in prefix.parent.glob(f"{prefix.name}.*.*")}


def kill_leftovers(pids: list[int]) -> None:
    """Clean-up after a failing test: end the children it checked (started by this test's workers)."""
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def kill_left_running(workers: list) -> None:
    """SIGKILL the process group of every launcher ``Worker`` in ``workers`` still running, emptying the list.

    For a test's autouse fixture: what a test (failing, or run against a broken module) leaves running
    is killed at its end.
    """
    import signal

    from replicator.launch import processes

    while workers:
        w = workers.pop()
        if w.ended is None:
            processes.signal_group(w, signal.SIGKILL)
