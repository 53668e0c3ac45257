"""``lower-collectives``: swap every placeholder for a real mesh collective.

The last pass of every pipeline. Each placeholder primitive has a lowering
rule below, written as ordinary ``lax`` code over the mesh axes
``('workers', 'cores')``; the pass traces the rule on the placeholder's operands
and splices the result in its place, in every sub-jaxpr too (``jit``, ``cond``
branches, ``scan``, ``while`` condition and body, ``remat``, custom-derivative
calls, ``closed_call``).

Example::

    graph = LowerCollectives().run(graph).graph
    # all_reduce[op=mean group=None]  ->  psum[axes=('workers','cores')] ; div
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.extend.core import JaxprEqn, Primitive

from replicator.context import group_axes
from replicator.passes.base import Pass, PassResult, StepGraph, inline_function, rewrite_graph
from replicator.primitives import all_gather_p, all_reduce_p, broadcast_p, reduce_scatter_p, replica_id_p

__all__ = ["LOWERINGS", "LowerCollectives"]

Lowering = Callable[..., Any]
LOWERINGS: dict[Primitive, Lowering] = {}


def _as_reducible(x: Any) -> tuple[Any, Any]:
    """Booleans cannot be all-reduced by XLA: carry them as int32."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.int32), jnp.bool_
    return x, None


def _restore(x: Any, dtype: Any) -> Any:
    return x if dtype is None else x.astype(dtype)


def lower_all_reduce(*xs: Any, op: str, group: str | None, group_size: int) -> list:
    axes = group_axes(group)
    if op == "sum":
        return list(lax.psum(list(xs), axes))
    if op == "mean":
        return [s / jnp.asarray(group_size, s.dtype) for s in lax.psum(list(xs), axes)]
    reduce = lax.pmax if op == "max" else lax.pmin
    out = []
    for x in xs:
        x, dtype = _as_reducible(x)
        out.append(_restore(reduce(x, axes), dtype))
    return out


LOWERINGS[all_reduce_p] = lower_all_reduce


def lower_all_gather(x: Any, *, axis: int, tiled: bool, group: str | None, group_size: int) -> Any:
    del group_size
    return lax.all_gather(x, group_axes(group), axis=axis, tiled=tiled)


LOWERINGS[all_gather_p] = lower_all_gather


def lower_reduce_scatter(x: Any, *, axis: int, group: str | None, group_size: int) -> Any:
    del group_size
    return lax.psum_scatter(x, group_axes(group), scatter_dimension=axis, tiled=True)


LOWERINGS[reduce_scatter_p] = lower_reduce_scatter


def lower_broadcast(x: Any, *, source: int, group: str | None, group_size: int) -> Any:
    del group_size
    axes = group_axes(group)
    x, dtype = _as_reducible(x)
    mine = lax.axis_index(axes) == source
    return _restore(lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axes), dtype)


LOWERINGS[broadcast_p] = lower_broadcast


def lower_replica_id(*, group: str | None) -> Any:
    return lax.axis_index(group_axes(group)).astype(jnp.int32)


LOWERINGS[replica_id_p] = lower_replica_id


class LowerCollectives(Pass):
    """Replace each placeholder by its rule in :data:`LOWERINGS`."""

    name = "lower-collectives"
    required = True

    def run(self, graph: StepGraph) -> PassResult:
        def rule(eqn: JaxprEqn) -> Any:
            lowering = LOWERINGS.get(eqn.primitive)
            if lowering is None:
                return None

            def fn(*xs: Any) -> Any:
                return lowering(*xs, **eqn.params)

            eqns, outs = inline_function(fn, eqn.invars, context=graph.context, like=eqn)
            return eqns, outs

        return rewrite_graph(graph, rule)
