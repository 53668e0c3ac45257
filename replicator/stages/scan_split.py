"""A stack of identical layers under ``lax.scan`` cut into pipeline stages, without markers.

A transformer is usually written as one ``lax.scan`` over its ``L`` layers (Flax's ``nn.scan``, Equinox's
scanned stacks): the stacked parameters ``(L, ...)`` are the scan's ``xs``, the activation its carry. A
marker cannot go inside that loop (:func:`~replicator.stages.split.split_stages` cuts the step's top level
only), so :func:`split_scan` rewrites the loop while the step is traced: the scan over the stack becomes
``S`` scans over consecutive slices of ``L / S`` layers, with ``rp.stage_boundary`` on the carry between
them. It is the same computation, so the transformed function gives the same value and gradients anywhere;
the markers cut it into ``S`` stages where a pipeline splits it.

Which scan is the stack (the choice rule):

* only calls of ``jax.lax.scan`` are seen (what Flax's ``nn.scan`` and Equinox call), made at the
  *top level* of the function: not inside another scan's body, a ``while``/``fori_loop`` body, a ``cond``
  branch or a ``custom_jvp``/``custom_vjp`` function (a ``jax.jit`` or ``jax.checkpoint`` around it is
  fine). Nested scans, and loops built by ``lax.map``/``fori_loop``, are left alone;
* of those, the ones whose length ``L`` is divisible by ``S`` are candidates: exactly one must be (a scan
  over a sequence in the loss, or in an optimizer, usually has another length). Two or more are an error
  that lists them: pass ``index=k`` (the ``k``-th top-level scan, in call order) or mark the boundaries
  with ``rp.stage_boundary``. None is an error too: mark the boundaries, or give a stack whose length
  divides by ``S``.

To decide, the function is first traced once as it is (``jax.make_jaxpr`` on its arguments' shapes) with
every top-level ``jax.lax.scan`` call tagged by a ``jax.named_scope``; the top-level scans are the tagged
``scan`` equations of that jaxpr, outside any loop or branch. The second trace, the real one (under the
caller's ``jax.value_and_grad``, or the step's own), splits the chosen call. ``jax.lax.scan`` is replaced
by an intercepting function only while a transformed function runs (a context manager, restored in
``finally``); the interception acts on the thread that entered it, other threads get ``lax.scan`` as it
is. The function must make the same ``lax.scan`` calls in both traces (no Python side effects that change
them); a scan inside a ``jax.jit`` whose trace JAX has cached from an earlier call is not re-traced, so
it cannot be split (an error says so).

In a ``reverse=True`` scan the last slice runs first, so the stages run the slices from the end; ``ys``
are concatenated back in index order. ``length=``, ``unroll`` and other keyword arguments go to each
piece (``length=L / S``). The ``ys`` of earlier pieces pass through the later boundaries with the carry,
so that their concatenation (a value of the last stage) reads nothing across stages.

The stacked parameters are read by every stage through a slice of their leading axis, and their gradient is
the sum of each stage's padded slice gradient: the split records them as *partitioned*
(:class:`~replicator.stages.split.Partition`). ``Replicator.run_pipelined`` (built on the lower-level
:func:`~replicator.stages.train.pipeline_train_step`, which the user guide does not need) then keeps on each
stage only its ``L / S`` slice of the stack, of the optimizer's moments and of the gradient, never summed across
stages, and each stage stashes per micro-batch only its activations, not its slice of the weights
(:mod:`~replicator.stages.stash`). The user's own step (``Replicator.run(step_fn, ...)`` on a pipeline) does the same where its update is
element-wise on the stack (:mod:`~replicator.stages.stack_update`); an update that reads it whole (a global-norm
clip) treats it as a tied parameter: each stage keeps all of it, its gradient summed across them.

>>> def loss(w, x):
...     h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)
...     return jnp.mean(h**2)
>>> w, x = jnp.full((4, 3, 3), 0.2), jnp.ones((2, 3))
>>> two = rp.stages.split_scan(loss, 2)
>>> eqns = jax.make_jaxpr(jax.value_and_grad(two))(w, x).eqns
>>> [e.primitive.name for e in eqns].count("rp.stage_boundary")  # forward, and transposed in the backward
2
>>> bool(jnp.allclose(jax.grad(two)(w, x), jax.grad(loss)(w, x)))
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn
from jax.extend.core import primitives as jax_primitives

from replicator._jax_compat import user_code_line
from replicator.core.jaxprs import iter_eqns, sub_jaxprs
from replicator.core.primitives import stage_boundary, stage_boundary_p
from replicator.stages.split import StageSplitError

__all__ = ["split_scan", "traced_in_stages"]

#: The named scope that tags top-level call ``k`` in the deciding trace.
_SCOPE = "replicator_split_scan_"
_SCOPE_PATTERN = re.compile(_SCOPE + r"(\d+)")
#: Calls whose body is still the function's top level: the split inlines them (``jit``, ``checkpoint``).
_TRANSPARENT = frozenset(
    p.name
    for p in (jax_primitives.jit_p, jax_primitives.closed_call_p, jax_primitives.call_p, jax_primitives.remat_p)
    if p
) | {"eval_jaxpr"}  # JAX 0.12's closed_call


@dataclasses.dataclass
class _Trace:
    """One run of a transformed function on this thread: what the interception does with each call.

    Attributes:
      num_stages: ``S``.
      deciding: the first trace (tag and record the top-level calls) rather than the second (split one).
      target: in the second trace, the index of the call to split.
      target_length: its length in the first trace.
      calls: how many ``jax.lax.scan`` calls were made outside any other scan so far.
      depth: how many intercepted calls are running (a call made while one runs is nested: left alone).
      split: whether the target was split.
    """

    num_stages: int
    deciding: bool
    target: int | None = None
    target_length: int | None = None
    calls: int = 0
    depth: int = 0
    split: bool = False


_local = threading.local()
_install_lock = threading.Lock()
_installed = 0  # how many transformed functions are running, on any thread
_original_scan: Callable[..., Any] | None = None  # jax.lax.scan before the interception


def _stack() -> list[_Trace]:
    if not hasattr(_local, "traces"):
        _local.traces = []
    return _local.traces


@contextlib.contextmanager
def _intercepting(trace: _Trace) -> Iterator[None]:
    """Route ``jax.lax.scan`` calls of this thread to ``trace`` while the block runs; restored in ``finally``."""
    global _installed, _original_scan
    with _install_lock:
        if _installed == 0:
            _original_scan = jax.lax.scan
            jax.lax.scan = _scan
        _installed += 1
    _stack().append(trace)
    try:
        yield
    finally:
        _stack().pop()
        with _install_lock:
            _installed -= 1
            if _installed == 0 and jax.lax.scan is _scan:  # _original_scan stays: a late caller still finds it
                jax.lax.scan = _original_scan


def _scan_length(xs: Any, length: int | None) -> int | None:
    leaves = jax.tree.leaves(xs)
    if leaves:
        return int(np.shape(leaves[0])[0]) if np.ndim(leaves[0]) else None
    return length


def _scan(f: Callable, init: Any, xs: Any = None, length: int | None = None, *rest: Any, **kwargs: Any) -> Any:
    """``jax.lax.scan`` while a transformed function runs: tags, splits or passes each call through."""
    original = _original_scan
    assert original is not None
    if rest:  # reverse, unroll, ... given by position: by name, as this JAX's scan names them
        names = list(inspect.signature(original).parameters)[4:]
        if len(rest) > len(names):
            return original(f, init, xs, length, *rest, **kwargs)  # its own TypeError
        kwargs.update(zip(names, rest, strict=False))
    traces = _stack()
    trace = traces[-1] if traces else None
    if trace is None or trace.depth:  # another thread's call, or one nested in an intercepted scan's body
        return original(f, init, xs, length=length, **kwargs)
    index = trace.calls
    trace.calls += 1
    total = _scan_length(xs, length)
    trace.depth += 1
    try:
        if trace.deciding:
            with jax.named_scope(f"{_SCOPE}{index}"):
                return original(f, init, xs, length=length, **kwargs)
        if index != trace.target:
            return original(f, init, xs, length=length, **kwargs)
        if total != trace.target_length:
            raise StageSplitError(
                f"split_scan: the lax.scan chosen as the stack of layers had length {trace.target_length} when "
                f"the function was first traced and {total} now: the function must make the same lax.scan "
                "calls each time it is traced (no Python side effects that change them)."
            )
        trace.split = True
        return _split_call(original, f, init, xs, total, trace.num_stages, kwargs)
    finally:
        trace.depth -= 1


def _split_call(
    original: Callable, f: Callable, init: Any, xs: Any, total: int, num_stages: int, kwargs: dict[str, Any]
) -> tuple[Any, Any]:
    """``original(f, init, xs)`` as ``num_stages`` scans over consecutive slices, a marker between each two."""
    chunk = total // num_stages
    order = list(range(num_stages))[:: -1 if kwargs.get("reverse", False) else 1]
    carry, ys = init, [None] * num_stages
    for n, i in enumerate(order):
        if n:
            done = order[:n]
            if not jax.tree.leaves((carry, [ys[j] for j in done])):
                raise StageSplitError(
                    "split_scan: the lax.scan chosen as the stack of layers carries nothing from one layer to "
                    "the next, so there is nothing to pipeline; mark the stage boundaries with rp.stage_boundary."
                )
            # What earlier pieces stacked passes on with the carry: their concatenation is the last stage's.
            carry, passed = stage_boundary((carry, [ys[j] for j in done]))
            for j, y in zip(done, passed, strict=True):
                ys[j] = y
        piece = jax.tree.map(lambda x, i=i: jax.lax.slice_in_dim(x, i * chunk, (i + 1) * chunk), xs)
        carry, ys[i] = original(f, carry, piece, length=chunk, **kwargs)
    return carry, jax.tree.map(lambda *parts: jnp.concatenate(parts), *ys)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))  # a tracer is a jax.Array


def _tagged_scans(jaxpr: Jaxpr, found: dict[int, JaxprEqn]) -> dict[int, JaxprEqn]:
    """The top-level ``scan`` equations by the call that made them (its tag), inside ``jit``/``checkpoint``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            tags = _SCOPE_PATTERN.findall(str(eqn.source_info.name_stack))
            if tags:
                found.setdefault(int(tags[-1]), eqn)  # the forward's, before the backward's of the same call
        elif eqn.primitive.name in _TRANSPARENT:
            for sub in sub_jaxprs(eqn.params):
                _tagged_scans(sub, found)
    return found


def _decide(
    fn: Callable, num_stages: int, index: int | None, unmarked_only: bool, args: tuple, kwargs: dict
) -> tuple[int, int] | None:
    """Trace ``fn`` once with its top-level scans tagged; the call to split and its length (``None``: ``fn``
    holds markers and ``unmarked_only``)."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    traced = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

    def on_shapes(*values: Any) -> Any:
        full = list(leaves)
        for i, value in zip(traced, values, strict=True):
            full[i] = value
        a, k = tree.unflatten(full)
        return fn(*a, **k)

    trace = _Trace(num_stages, deciding=True)
    with _intercepting(trace):
        closed: ClosedJaxpr = jax.make_jaxpr(on_shapes)(*(leaves[i] for i in traced))
    if unmarked_only and any(e.primitive is stage_boundary_p for e in iter_eqns(closed.jaxpr)):
        return None
    found = _tagged_scans(closed.jaxpr, {})
    calls = sorted(found)
    lengths = {k: found[k].params["length"] for k in calls}
    name = getattr(fn, "__name__", repr(fn))

    def listed(keys: list[int]) -> str:
        return "; ".join(
            f"scan {calls.index(k)}: length {lengths[k]} at {user_code_line(found[k].source_info)}" for k in keys
        )

    if index is not None:
        if not 0 <= index < len(calls):
            raise StageSplitError(
                f"split_scan(index={index}): {name} makes {len(calls)} top-level lax.scan call(s)"
                + (f" ({listed(calls)})" if calls else "")
                + "; pass the index of the stack of layers among them, or mark the stage boundaries with "
                "rp.stage_boundary."
            )
        chosen = calls[index]
        if lengths[chosen] % num_stages:
            raise StageSplitError(
                f"split_scan(index={index}): the scan's length {lengths[chosen]} (at "
                f"{user_code_line(found[chosen].source_info)}) does not divide by {num_stages} stages; give a stack "
                f"whose number of layers divides by {num_stages}, or mark the stage boundaries with rp.stage_boundary."
            )
        return chosen, lengths[chosen]
    candidates = [k for k in calls if lengths[k] and lengths[k] % num_stages == 0]
    if len(candidates) == 1:
        return candidates[0], lengths[candidates[0]]
    if not candidates:
        seen = f"its top-level scans: {listed(calls)}" if calls else "it makes no top-level jax.lax.scan call"
        raise StageSplitError(
            f"split_scan: no lax.scan at the top level of {name} has a length divisible by {num_stages} stages "
            f"({seen}). Mark the stage boundaries with rp.stage_boundary, or give a stack whose number of layers "
            f"divides by {num_stages}. Not seen: a scan inside another loop's body, a cond branch or a custom_vjp, "
            "and a scan called through a name imported from jax.lax before split_scan ran."
        )
    raise StageSplitError(
        f"split_scan: {len(candidates)} lax.scan calls at the top level of {name} have a length divisible by "
        f"{num_stages} stages ({listed(candidates)}); pass index=k (the k-th, as numbered here) to say which "
        "one is the stack of layers, or mark the stage boundaries with rp.stage_boundary."
    )


def traced_in_stages(trace: Callable[[Callable], Any], fn: Callable, num_stages: int) -> Any:
    """``trace(fn)`` (a ``ClosedJaxpr``, or a tuple that starts with one), or, where that holds no
    ``rp.stage_boundary`` and ``num_stages > 1``, ``trace(split_scan(fn, num_stages))``: an unmarked step's
    scanned stack cut into the stages asked for. A marked step is traced once; an unmarked one three times
    (``split_scan`` decides on a trace of its own)."""
    traced = trace(fn)
    closed = traced[0] if isinstance(traced, tuple) else traced
    if num_stages > 1 and not any(e.primitive is stage_boundary_p for e in iter_eqns(closed.jaxpr)):
        traced = trace(split_scan(fn, num_stages))
    return traced


def split_scan(fn: Callable, num_stages: int, *, index: int | None = None, unmarked_only: bool = False) -> Callable:
    """``fn`` with its scan over a stack of layers cut into ``num_stages`` pipeline stages.

    A pipelined ``Replicator`` (``run_pipelined``, ``run``) applies it by itself to a step without markers;
    call it for a function you pipeline yourself (:func:`~replicator.stages.lower.pipeline_value_and_grad`
    cuts only at markers).

    Args:
      fn: a loss or a whole step (it may call ``jax.value_and_grad`` itself) that runs a stack of layers with
        one top-level ``jax.lax.scan`` (or Flax's ``nn.scan``), whose length ``L`` divides by ``num_stages``.
      num_stages: ``S``; 1 returns ``fn`` itself.
      index: which top-level ``lax.scan`` call (in call order, from 0) is the stack, when several have a length
        divisible by ``S``. ``None``: the only one.
      unmarked_only: leave ``fn`` as it is when its trace already holds an ``rp.stage_boundary`` marker
        (anywhere): its own markers cut it. For a caller that applies ``split_scan`` to any step it pipelines.
        ``False``: other markers in ``fn`` add their own stages to the ``S``.

    Returns:
      A function of the same arguments and results: while it is traced the stack's scan runs as ``S`` scans
      over ``L / S`` layers each, with ``rp.stage_boundary`` on the carry between them (the module docstring
      has the rule and its limits).

    Raises:
      StageSplitError: when the transformed function is called: no candidate scan, or several (the message
        lists them with their lines), or a scan that carries nothing.
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"split_scan: num_stages must be a positive int, got {num_stages!r}.")
    if num_stages == 1:
        return fn

    @functools.wraps(fn)
    def split(*args: Any, **kwargs: Any) -> Any:
        decided = _decide(fn, num_stages, index, unmarked_only, args, kwargs)
        if decided is None:
            return fn(*args, **kwargs)
        target, length = decided
        trace = _Trace(num_stages, deciding=False, target=target, target_length=length)
        with _intercepting(trace):
            out = fn(*args, **kwargs)
        if not trace.split:
            raise StageSplitError(
                f"split_scan: the lax.scan chosen as the stack of layers (length {length}) was not called again "
                "when the function was traced: is it inside a jax.jit that JAX had traced before (its cached "
                "trace is reused)? Apply split_scan inside that jax.jit, or call the stack without it."
            )
        return out

    return split
