"""``capture-collectives``: raw ``lax`` collectives become placeholders.

Code written for ``jax.pmap`` or ``shard_map`` calls ``lax.psum(x, 'batch')``,
``lax.pmean``, ``lax.all_gather``, ``lax.axis_index``, and Flax's, Equinox's and
Haiku's batch norms do the same inside. With ``Replicator(axis_name='batch')``
the step is traced with ``'batch'`` (and the mesh axes ``'workers'``, ``'cores'``)
bound, so these calls trace to raw collective equations; this pass, first in
the pass manager, rewrites each into the placeholder ``rp.all_mean`` and friends
bind, so every later pass (the invariance check, simplify, fusion, ZeRO, the
lowerings) treats it exactly like a collective written with ``rp.*``:

====================================  ============================================
raw equation                          placeholder (after a local reduction over positional axes)
====================================  ============================================
``psum`` / ``pmax`` / ``pmin``         ``rp.all_reduce[op=sum|max|min]``
``all_gather``                         ``rp.all_gather`` (same axis and tiling)
``reduce_scatter`` (``psum_scatter``)  ``rp.reduce_scatter`` (a squeeze if untiled)
``axis_index``                         ``rp.replica_id``
====================================  ============================================

``lax.pmean`` is ``psum`` then a division, so it becomes a sum all-reduce and the
same division. Gradients keep JAX's own ``pmap`` semantics: ``jax.grad`` ran at
trace time, so the transposes (``psum`` of cotangents) are already in the graph
and are captured like the rest. ``ppermute`` and ``all_to_all`` have no
placeholder: their user names are renamed to the mesh axes they stand for and they
run as written.

**Precondition.** An equation is rewritten only if its axes name exactly one
replica group (all replicas as ``('workers', 'cores')`` in that order, ``'cores'``
or ``'workers'``, directly or through ``axis_name``) and it has no
``axis_index_groups``; anything else raises :class:`CaptureError` naming the
user's line, since it could not run on the mesh either.

>>> repl = rp.Replicator(2, 4, axis_name="batch")
>>> step = lambda b: {"m": jax.lax.pmean(b["x"], "batch")}
>>> lowered = repl.lower(step, {"x": np.ones((4, 2), np.float32)})
>>> rp.passes.count_primitives(lowered.after("capture-collectives").jaxpr, ["psum", "rp.all_reduce"])
{'rp.all_reduce': 1}
"""

from __future__ import annotations

from typing import Any

import jax.extend.core.primitives as lax_primitives
import jax.numpy as jnp
from jax.extend.core import JaxprEqn

from replicator._jax_compat import reduce_scatter_primitive, user_source_line
from replicator.core.context import REPLICA_AXES, ReplicaContext, axis_names, group_axes
from replicator.core.graph import StepGraph
from replicator.core.jaxprs import inline_function
from replicator.core.primitives import all_gather_p, all_reduce_p, reduce_scatter_p, replica_id_p
from replicator.errors import ReplicationError
from replicator.pass_manager.contract import Pass, PassResult, rewrite_graph

__all__ = ["CaptureCollectives", "CaptureError"]

_REDUCE_OPS = {lax_primitives.psum_p: "sum", lax_primitives.pmax_p: "max", lax_primitives.pmin_p: "min"}
_RENAMED = {lax_primitives.ppermute_p: "axis_name", lax_primitives.all_to_all_p: "axis_name"}


class CaptureError(ReplicationError):
    """A raw collective that cannot be expressed over the replica mesh."""


def _fail(eqn: JaxprEqn, why: str) -> CaptureError:
    return CaptureError(
        f"lax.{eqn.primitive.name} at {user_source_line(eqn.source_info)}: {why}. "
        "Collectives in a replicated step span one replica group: all replicas (an axis_name mapped to None, "
        "or ('workers', 'cores')), 'cores' or 'workers'."
    )


class CaptureCollectives(Pass):
    """Rewrite ``psum``/``pmax``/``pmin``/``all_gather``/``psum_scatter``/``axis_index`` into placeholders."""

    name = "capture-collectives"
    required = True  # raw collectives over the user's names cannot run on the mesh as they are
    first = True

    def run(self, graph: StepGraph) -> PassResult:
        context = graph.context
        reduce_scatter_raw = reduce_scatter_primitive()

        def group_of(eqn: JaxprEqn, axes: Any) -> tuple[str | None, int]:
            names = axis_names(axes)
            if not all(isinstance(n, str) for n in names):
                raise _fail(eqn, f"positional axes {names} are not replica axes")
            if eqn.params.get("axis_index_groups") is not None:
                raise _fail(eqn, "axis_index_groups is not supported; use group='cores' or 'workers' instead")
            try:
                group = context.group_of_axes(names)
            except ValueError as e:
                raise _fail(eqn, str(e)) from None
            return group, context.group_size(group)

        tensor_axis = graph.tensor.axis if graph.tensor is not None else None

        def rule(eqn: JaxprEqn) -> tuple[list[JaxprEqn], list] | None:
            prim, params = eqn.primitive, eqn.params
            names = axis_names(params.get("axes", params.get("axis_name", ())))
            if tensor_axis is not None and names and all(n == tensor_axis for n in names):
                return None  # put there by the tensor split (replicator.tensor.split_graph), over its own axis
            if prim in _REDUCE_OPS:
                # Inside jax.vmap(axis_name=...), JAX turns the vmapped name into a positional axis:
                # a local reduction over that array dimension, then the collective over the rest.
                positional = tuple(a for a in axis_names(params["axes"]) if not isinstance(a, str))
                named = tuple(a for a in axis_names(params["axes"]) if isinstance(a, str))
                if not named:
                    return None  # only a local reduction
                group, n = group_of(eqn, named)
                op = _REDUCE_OPS[prim]
                local = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[op]

                def reduce(*xs: Any) -> list:
                    xs = [local(x, axis=positional) if positional else x for x in xs]
                    return all_reduce_p.bind(*xs, op=op, group=group, group_size=n)

                return inline_function(reduce, eqn.invars, context=context, like=eqn)
            if prim is lax_primitives.all_gather_p:
                group, n = group_of(eqn, params["axis_name"])
                axis, tiled = params["all_gather_dimension"], params["tiled"]
                return inline_function(
                    lambda x: all_gather_p.bind(x, axis=axis, tiled=tiled, group=group, group_size=n),
                    eqn.invars,
                    context=context,
                    like=eqn,
                )
            if prim is reduce_scatter_raw:
                group, n = group_of(eqn, params["axis_name"])
                axis, tiled = params["scatter_dimension"], params["tiled"]

                def scatter(x: Any) -> Any:
                    chunk = reduce_scatter_p.bind(x, axis=axis, group=group, group_size=n)
                    return chunk if tiled else jnp.squeeze(chunk, axis)

                return inline_function(scatter, eqn.invars, context=context, like=eqn)
            if prim is lax_primitives.axis_index_p:
                group, _ = group_of(eqn, params["axis_name"])
                return inline_function(lambda: replica_id_p.bind(group=group), [], context=context, like=eqn)
            if prim in _RENAMED:
                return _renamed(eqn, _RENAMED[prim], context)
            return None

        return rewrite_graph(graph, rule, recompute_effects=True)


def _renamed(eqn: JaxprEqn, param: str, context: ReplicaContext) -> tuple[list[JaxprEqn], list] | None:
    """The equation re-bound with the user's axis names replaced by the mesh axes they stand for."""
    names = axis_names(eqn.params[param])
    if all(n in REPLICA_AXES for n in names):
        return None
    try:
        axes = group_axes(context.group_of_axes(names))
    except ValueError as e:
        raise _fail(eqn, str(e)) from None
    params = {**eqn.params, param: axes}
    return inline_function(lambda *xs: eqn.primitive.bind(*xs, **params), eqn.invars, context=context, like=eqn)
