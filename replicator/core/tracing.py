"""``step_fn`` -> the per-replica jaxpr with placeholders, plus pytree bookkeeping.

The step is traced once per input signature with *per-replica* abstract
shapes (a worker's batch of B rows is seen as B / cores_per_worker rows) while
the replica context is active, so every cross-replica call becomes a
placeholder equation in the graph.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from replicator.core.context import ReplicaContext, replica_context
from replicator.core.graph import StepGraph
from replicator.core.inline_calls import inline_marked_calls

__all__ = [
    "TracedStep",
    "UnboundAxisNameError",
    "canonical_dtype",
    "check_not_pmapped",
    "is_array_leaf",
    "leaf_paths",
    "leaf_signature",
    "signature_spec",
    "trace_step",
]

PyTree = Any
_UNBOUND_AXIS = re.compile(r"unbound axis name: (?P<name>[^\s.]+)")


class UnboundAxisNameError(NameError):
    """``step_fn`` uses a named axis (``lax.psum(x, 'batch')``) that means nothing here."""

    def __init__(self, name: str, context: ReplicaContext):
        self.axis_name = name
        super().__init__(
            f"step_fn uses the axis name {name!r}, which is not bound in this Replicator; "
            f"{context.describe_names()}. Code written for jax.pmap or shard_map runs unchanged once its names "
            f"are mapped to replica groups: Replicator(..., axis_name={name!r}) makes {name!r} span all "
            f"replicas; axis_name={{{name!r}: 'cores'}} the replicas of one worker."
        )


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A traced step: its graph and how to rebuild pytrees around it."""

    graph: StepGraph
    state_treedef: Any
    output_treedef: Any
    #: ``(leaf index, value)`` of the state's non-array leaves (an Equinox
    #: module's activation function, a flag): part of the compiled program,
    #: never sent to devices, returned as they came.
    static_state: tuple[tuple[int, Any], ...] = ()

    def array_leaves(self, state: PyTree) -> list:
        """The state's array leaves, in the graph's order (static leaves left out)."""
        static = dict(self.static_state)
        return [leaf for i, leaf in enumerate(jax.tree.leaves(state)) if i not in static]

    def rebuild_state(self, arrays: list) -> PyTree:
        """The state pytree from the graph's new array leaves and the static leaves."""
        return self.state_treedef.unflatten(_merge(arrays, self.static_state, self.state_treedef.num_leaves))


def canonical_dtype(dtype: Any) -> Any:
    """``dtype`` as JAX stores it now: float64 is float32 unless 64-bit mode is on (also in a
    ``with jax.enable_x64(True)`` block: the mode is part of the cache's key)."""
    return _canonical_dtype(dtype, jax.dtypes.canonicalize_dtype(np.float64) == np.float64)


@functools.cache
def _canonical_dtype(dtype: Any, x64: bool) -> Any:
    del x64  # the key: the same dtype is canonicalized apart with 64-bit mode on and off
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # e.g. typed PRNG keys
        return dtype
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def leaf_signature(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and canonical dtype of an array, number or spec (weak types ignored)."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)):
        return tuple(x.shape), canonical_dtype(x.dtype)
    return tuple(np.shape(x)), canonical_dtype(np.result_type(x))


def signature_spec(signature: tuple[tuple[int, ...], np.dtype]) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(*signature)


def is_array_leaf(x: Any) -> bool:
    """Whether a state leaf is data (sent to devices) rather than a static part of the program.

    Arrays and Python numbers are data; Python ``bool`` flags (an Equinox
    module's ``inference``), strings, functions and other objects are static.
    """
    if isinstance(x, bool):
        return False
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, int, float, complex))


def _merge(arrays: list, static: tuple[tuple[int, Any], ...], n: int) -> list:
    by_index = dict(static)
    it = iter(arrays)
    return [by_index[i] if i in by_index else next(it) for i in range(n)]


def leaf_paths(tree: PyTree, root: str) -> tuple[str, ...]:
    """``root['w']``-style names for every leaf of ``tree``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return tuple(root + jax.tree_util.keystr(path) for path, _ in flat)


def _check_outputs(outputs: PyTree) -> None:
    flat, _ = jax.tree_util.tree_flatten_with_path(outputs)
    for path, leaf in flat:
        if isinstance(leaf, (jax.Array, jax.core.Tracer, np.ndarray, np.generic, bool, int, float, complex)):
            continue
        raise TypeError(
            f"step_fn output outputs{jax.tree_util.keystr(path)} is a {type(leaf).__name__}, "
            f"not an array. Step outputs must be pytrees of arrays (or numbers); "
            f"return metrics as jnp arrays and keep other Python objects out of the step."
        )


def _dtype_name(dtype: Any) -> str:
    return getattr(dtype, "name", str(dtype))


def _describe(avals: Any) -> str:
    return f"{tuple(avals.shape)} {_dtype_name(avals.dtype)}"


def _check_state_out(state_in: PyTree, state_out: PyTree) -> None:
    in_def = jax.tree.structure(state_in)
    out_def = jax.tree.structure(state_out)
    if in_def != out_def:
        raise ValueError(
            "step_fn returned a new state whose structure differs from the state it "
            f"received:\n  in:  {in_def}\n  out: {out_def}\n"
            "The state must keep the same pytree structure from step to step; return "
            "extra values as outputs instead."
        )
    paths = leaf_paths(state_in, "state")
    for path, a, b in zip(paths, jax.tree.leaves(state_in), jax.tree.leaves(state_out), strict=True):
        if not isinstance(a, jax.ShapeDtypeStruct):  # a static leaf
            if b is not a and not _same_static(a, b):
                raise ValueError(
                    f"step_fn changed {path}, a non-array part of the state ({type(a).__name__}), to "
                    f"{type(b).__name__}. Non-array leaves are compiled into the step and must come back as "
                    f"they were; keep what changes in arrays."
                )
            continue
        b_shape = tuple(np.shape(b))
        b_dtype = b.dtype if hasattr(b, "dtype") else jax.numpy.result_type(b)
        if tuple(a.shape) != b_shape or a.dtype != b_dtype:
            raise ValueError(
                f"step_fn changed {path} from {_describe(a)} to {b_shape} {_dtype_name(b_dtype)}. "
                f"State must keep its shapes and dtypes between steps (or every step would "
                f"recompile); cast with .astype({_dtype_name(a.dtype)}) or reshape before returning it."
            )


def _same_static(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable == are only the same if identical
        return False


def _is_pmapped(fn: Any) -> bool:
    """Whether ``fn`` is what ``jax.pmap`` returns: a wrapper (``__wrapped__``, ``lower``) made in JAX's pmap
    module (there is no public type to test for)."""
    code = getattr(fn, "__code__", None)
    if code is None or not hasattr(fn, "__wrapped__") or not callable(getattr(fn, "lower", None)):
        return False
    return code.co_filename.replace("\\", "/").endswith("jax/_src/pmap.py")


def check_not_pmapped(step_fn: Any) -> None:
    """Refuse a ``jax.pmap``-ed ``step_fn`` with the fix: the step is mapped over the replicas here."""
    if not _is_pmapped(step_fn):
        return
    name = getattr(step_fn.__wrapped__, "__name__", "")
    name = name if name.isidentifier() else "step_fn"
    raise TypeError(
        f"step_fn {name!r} is a jax.pmap of a function (jax.pmap(f) or @jax.pmap); Replicator.run maps the step "
        f"over the replicas itself, so give it the function pmap wraps: repl.run({name}.__wrapped__, ...), or "
        f"drop the jax.pmap. Map pmap's axis_name with Replicator(..., axis_name='batch') (the name you gave "
        f"pmap), and give run the batch of this process as it is (no leading device axis: run splits every "
        f"leaf over the replicas)."
    )


def trace_step(
    step_fn: Callable[..., Any],
    state_avals: PyTree | None,
    batch_avals: PyTree,
    context: ReplicaContext,
) -> TracedStep:
    """Trace ``step_fn`` for one replica.

    Args:
      step_fn: ``step_fn(batch) -> outputs`` when ``state_avals`` is None,
        else ``step_fn(state, batch) -> (new_state, outputs)``.
      state_avals: pytree of ``jax.ShapeDtypeStruct`` for the state, or None.
      batch_avals: pytree of per-replica ``jax.ShapeDtypeStruct``.
      context: the mesh shape.

    Returns:
      The traced step; its graph's inputs are ``(*state, *batch)`` leaves and
      outputs ``(*new_state, *outputs)`` leaves.
    """
    check_not_pmapped(step_fn)
    has_state = state_avals is not None
    all_state, state_treedef = jax.tree.flatten(state_avals if has_state else ())
    static = tuple((i, leaf) for i, leaf in enumerate(all_state) if not isinstance(leaf, jax.ShapeDtypeStruct))
    state_leaves = [leaf for leaf in all_state if isinstance(leaf, jax.ShapeDtypeStruct)]
    batch_leaves, batch_treedef = jax.tree.flatten(batch_avals)
    out_info: dict[str, Any] = {}

    def flat_step(*leaves: Any) -> list:
        state = state_treedef.unflatten(_merge(list(leaves[: len(state_leaves)]), static, len(all_state)))
        batch = batch_treedef.unflatten(leaves[len(state_leaves) :])
        if has_state:
            result = step_fn(state, batch)
            if not (isinstance(result, tuple) and len(result) == 2):
                raise TypeError(
                    "step_fn was run with state, so it must return a pair "
                    f"(new_state, outputs); it returned {type(result).__name__}. "
                    "Return (state, {}) if there are no outputs."
                )
            new_state, outputs = result
            _check_state_out(state_avals, new_state)
        else:
            new_state, outputs = (), step_fn(batch)
        _check_outputs(outputs)
        out_leaves, out_info["treedef"] = jax.tree.flatten(outputs)
        out_info["paths"] = leaf_paths(outputs, "outputs")
        static_index = dict(static)
        new_arrays = [leaf for i, leaf in enumerate(jax.tree.leaves(new_state)) if i not in static_index]
        return new_arrays + list(out_leaves)

    with replica_context(context):
        try:
            # The mesh axes and the user's names are bound, so lax.psum(x, 'batch')
            # traces to a raw collective that capture-collectives turns into a placeholder.
            closed = jax.make_jaxpr(flat_step, axis_env=context.axis_env)(*state_leaves, *batch_leaves)
        except NameError as e:
            match = _UNBOUND_AXIS.search(str(e))
            if match is None:
                raise
            raise UnboundAxisNameError(match["name"], context) from None
    inlined = inline_marked_calls(closed.jaxpr)
    if inlined is not closed.jaxpr:
        closed = ClosedJaxpr(inlined, closed.consts)
    graph = StepGraph(
        jaxpr=closed,
        context=context,
        state_paths=tuple(p for i, p in enumerate(leaf_paths(state_avals, "state")) if i not in dict(static))
        if has_state
        else (),
        output_paths=out_info["paths"],
    )
    return TracedStep(
        graph=graph,
        state_treedef=state_treedef,
        output_treedef=out_info["treedef"],
        static_state=static,
    )
