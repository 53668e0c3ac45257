"""``fold-replicas``: run several logical replicas on one device.

``Replicator(num_workers, cores_per_worker, parallelism=Parallelism(replicas_per_device=F))`` runs
``R = W * C`` replicas on ``R / F`` devices. Every pass before this one sees the
logical mesh (``W`` workers x ``C`` cores): group sizes, replica ids, the
variance analysis and the collectives are those of ``R`` replicas. This pass
runs last, on the lowered graph, and rewrites every mesh collective for the
device mesh: the logical axis ``'workers'`` of size ``W`` becomes the device
axis ``'workers'`` of size ``W / Fw`` followed by the *folded* axis
``'workers_fold'`` of size ``Fw``; ``'cores'`` likewise with ``Fc``
(``F = Fw * Fc``). At run time each device evaluates the graph under
``jax.vmap`` over the folded axes (:func:`~replicator.runtime.execution.build_executable`),
so a device holds a contiguous block of ``F`` replicas.

Because ``vmap`` only batches what depends on batched values, work that is
identical on every replica of a device's block (the optimizer update after an
all-reduce over a group the block lies in, anything computed from the state
alone) runs once per device, not once per replica.

**Precondition (soundness).** The block of a device must be contiguous in
replica order and a group's replica index must be *device-major*: with the
expanded axes of a group in mesh order, no device axis longer than 1 comes
after a folded axis longer than 1. :func:`fold_layout` only builds layouts
that satisfy it: fold within workers (``Fw = 1``, ``C % F == 0``) or whole
workers (``Fc = C``, ``Cm = 1``). Under it, the linear index of a replica over
a group's expanded axes is ``device_index * F_group + fold_index``, which is
its logical index in the group. Each collective is then rewritten to compute
exactly its logical result:

* ``pmax``/``pmin``: the same primitive over the expanded axes (JAX reduces
  over a vmapped axis and a device axis at once);
* ``psum`` over a group with folded axes: first over the folded axes, then
  over the device axes (the same sum: addition is associative). Of a
  ``concatenate`` (a fused bucket), each packed tensor is summed over the fold
  and the sums packed, so that no packed copy per replica is made. A summand
  that is (a reshape of) a ``dot_general`` with one contracted pair of
  dimensions and no batch dimensions, such as a dense layer's weight gradient
  ``x^T dy``, is summed over the fold as one contraction of every folded
  replica's operands concatenated along the contracted dimension:
  ``sum_r a_r . b_r = [a_1 ... a_F] . [b_1 ... b_F]`` (an ``all_gather`` over
  a vmapped axis is a free reshape);
* ``axis_index``: one ``axis_index`` per expanded axis, combined row-major
  (the ``axis_index`` primitive bound with a device axis and a vmapped axis
  together returns the vmapped index alone in this JAX:
  ``tests/passes/test_fold.py`` pins it);
* ``all_gather``: one gather per expanded axis, innermost first, then the
  gathered axes merged (row-major, so index ``device * F + fold``);
* ``psum_scatter`` (tiled): sum over the folded axes, scatter over the device
  axes (chunk ``device``), then keep this replica's slice ``fold`` of it;
* ``ppermute``: every replica of the group gathered, each replica selects the
  row its source sent (zeros where no one sends to it, as ``ppermute``).

Anything else that names a mesh axis (``all_to_all``, a primitive this pass
does not know) raises :class:`FoldError`: computed over the device axis alone
it would be silently wrong. Tests: ``tests/passes/test_fold.py`` (every
collective, group and layout against the unfolded run and against numpy) and
the differential fuzzer's ``fold`` variant.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax.extend.core.primitives as lax_primitives
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn, Var

from replicator._jax_compat import reduce_scatter_primitive
from replicator.core.context import REPLICA_AXES, axis_names
from replicator.core.graph import StepGraph
from replicator.core.jaxprs import inline_function, iter_eqns
from replicator.core.layout import FOLDED_AXES, FoldError, FoldLayout
from replicator.pass_manager.contract import Pass, PassResult, rewrite_graph

if TYPE_CHECKING:
    from replicator.pass_manager.manager import Lowered

__all__ = ["FoldReplicas", "fold_lowered"]


# -- the rewrite rules ---------------------------------------------------------------

_REDUCTIONS = {lax_primitives.psum_p, lax_primitives.pmax_p, lax_primitives.pmin_p}
#: Shape-only linear operations a summand may apply to a contraction (they commute with a sum).
_LAYOUT_OPS = {lax_primitives.reshape_p, lax_primitives.transpose_p}
#: Primitives with named-axis params this pass rewrites, and the param.
_AXIS_PARAM = {
    **{p: "axes" for p in _REDUCTIONS},
    lax_primitives.axis_index_p: "axis_name",
    lax_primitives.all_gather_p: "axis_name",
    lax_primitives.ppermute_p: "axis_name",
}


def _mesh_names(eqn: JaxprEqn) -> tuple[str, ...]:
    """The mesh axes an equation's params name (any param that holds axis names)."""
    found: list[str] = []
    for key in ("axes", "axis_name"):
        if key in eqn.params:
            found += [n for n in axis_names(eqn.params[key]) if n in REPLICA_AXES]
    return tuple(found)


def _split(layout: FoldLayout, axes: tuple) -> tuple[tuple[str, ...], tuple[str, ...]]:
    expanded = layout.expand(axes)
    folded = set(FOLDED_AXES.values())
    return tuple(a for a in expanded if a not in folded), tuple(a for a in expanded if a in folded)


def _linear_index(layout: FoldLayout, names: tuple) -> Any:
    """The replica's index over ``names`` (row-major), one ``axis_index`` per axis.

    The ``axis_index`` primitive over a device axis and a vmapped axis
    together returns the vmapped index alone in this JAX, so the axes are
    combined here, one at a time.
    """
    index = jnp.int32(0)
    for name in names:
        index = index * np.int32(layout.size(name)) + lax.axis_index(name)
    return index


def _all_gather(layout: FoldLayout, x: Any, axes: tuple, dim: int, tiled: bool) -> Any:
    expanded = layout.expand(axes)
    y = x
    for name in reversed(expanded):  # innermost first: index device * F + fold, row-major
        y = lax.all_gather(y, name, axis=dim, tiled=False)
    n = math.prod(layout.size(a) for a in expanded)
    if tiled:
        return y.reshape(*x.shape[:dim], n * x.shape[dim], *x.shape[dim + 1 :])
    return y.reshape(*x.shape[:dim], n, *x.shape[dim:])


def _reduce_scatter(layout: FoldLayout, x: Any, axes: tuple, dim: int) -> Any:
    device_axes, folded_axes = _split(layout, axes)
    if folded_axes:
        x = lax.psum(x, folded_axes)
    if device_axes:
        x = lax.psum_scatter(x, device_axes, scatter_dimension=dim, tiled=True)
    if not folded_axes:
        return x
    f = math.prod(layout.size(a) for a in folded_axes)
    size = x.shape[dim] // f
    return lax.dynamic_slice_in_dim(x, _linear_index(layout, folded_axes) * size, size, axis=dim)


def _ppermute(layout: FoldLayout, x: Any, axes: tuple, perm: tuple) -> Any:
    expanded = layout.expand(axes)
    me = _linear_index(layout, expanded)
    source = jnp.int32(-1)  # the replica that sends to me (selects of scalars: no table constant)
    for src, dst in perm:
        source = jnp.where(me == np.int32(dst), np.int32(src), source)
    every = _all_gather(layout, x, axes, 0, tiled=False)
    row = lax.dynamic_index_in_dim(every, jnp.maximum(source, 0), axis=0, keepdims=False)
    return jnp.where(source >= 0, row, jnp.zeros_like(row))


def _gather_folded(x: Any, folded_axes: tuple, dim: int) -> Any:
    """Every folded replica's ``x`` concatenated along ``dim`` (a free reshape under ``vmap``)."""
    for name in reversed(folded_axes):
        x = lax.all_gather(x, name, axis=dim, tiled=True)
    return x


def _sum_over_fold(inputs: tuple, plan: tuple, folded_axes: tuple) -> list:
    """Each planned summand summed over the folded replicas.

    ``("plain", i, None)``: ``psum(inputs[i])`` over the folded axes.
    ``("contraction", i, (params, layout_ops))``: ``inputs[i], inputs[i + 1]``
    are the operands of a ``dot_general`` with one contracted dimension and no
    batch dimensions (say a dense layer's ``x^T dy``); the sum over replicas of
    ``a_r . b_r`` is one contraction of every replica's ``a`` and ``b``
    concatenated along the contracted dimension, then reshaped and transposed
    as the summand was (``layout_ops``, equations to re-bind).
    """
    out = []
    for kind, i, extra in plan:
        if kind == "plain":
            out.append(lax.psum(inputs[i], folded_axes) if folded_axes else inputs[i])
            continue
        params, layout_ops = extra
        (ca, cb), _ = params["dimension_numbers"]
        a, b = _gather_folded(inputs[i], folded_axes, ca[0]), _gather_folded(inputs[i + 1], folded_axes, cb[0])
        y = lax_primitives.dot_general_p.bind(a, b, **params)
        for op in layout_ops:  # linear: they commute with the sum over replicas
            y = op.primitive.bind(y, **op.params)
        out.append(y)
    return out


def _sum_fold_then_devices(
    inputs: tuple, plan: tuple, device_axes: tuple, folded_axes: tuple, pack: dict | None
) -> Any:
    """``psum`` of the summands over the fold (:func:`_sum_over_fold`), then over the devices.

    With ``pack`` (a ``concatenate``'s params: a fused bucket), the summands are
    packed between the two sums, so that one buffer crosses the devices.
    """
    xs = _sum_over_fold(inputs, plan, folded_axes)
    if pack is not None:
        xs = [lax.concatenate(xs, pack["dimension"])]
    if device_axes:
        xs = lax.psum(xs, device_axes)
    return xs[0] if pack is not None else list(xs)


def _check_device_major(layout: FoldLayout, eqn: JaxprEqn, axes: tuple) -> None:
    """The precondition: in a group's expanded axes no device axis > 1 follows a folded axis > 1."""
    seen_fold = False
    for name in layout.expand(axes):
        if name in FOLDED_AXES.values():
            seen_fold |= layout.size(name) > 1
        elif name in REPLICA_AXES and seen_fold and layout.size(name) > 1:
            raise FoldError(
                f"fold-replicas: '{eqn.primitive.name}' over {axes} is not device-major under {layout} "
                "(a layout fold_layout never builds)."
            )


class FoldReplicas(Pass):
    """Rewrite a lowered graph's mesh collectives for ``layout`` (see the module docstring).

    Not part of a pass manager: ``Parallelism(replicas_per_device=F)`` applies it
    after the other passes, as the stage ``fold-replicas`` of ``Replicator.lower``.
    """

    name = "fold-replicas"
    needs_placeholders = False

    def __init__(self, layout: FoldLayout):
        self.layout = layout

    def __repr__(self) -> str:
        return f"FoldReplicas({self.layout})"

    def run(self, graph: StepGraph) -> PassResult:
        layout = self.layout
        if layout.replicas_per_device == 1:
            return PassResult(graph, False)
        scatter_p = reduce_scatter_primitive()
        defs = {e.outvars[0]: e for e in iter_eqns(graph.jaxpr.jaxpr) if len(e.outvars) == 1}
        # Results of the collectives this pass replaces: renamed by the rewrite, so a rule must
        # not read them through an equation it looked up here (it would read the old name).
        renamed = {v for e in iter_eqns(graph.jaxpr.jaxpr) if _mesh_names(e) for v in e.outvars}
        concatenated = {
            v: e
            for v, e in defs.items()
            if e.primitive is lax_primitives.concatenate_p and not renamed.intersection(e.invars)
        }

        def contraction(atom: Any) -> tuple[JaxprEqn, tuple] | None:
            """The ``dot_general`` (one contracted pair, no batch dims) that ``atom`` is, reshaped or
            transposed, and those reshapes and transposes (outermost last)."""
            e = defs.get(atom) if isinstance(atom, Var) else None
            layout_ops: list[JaxprEqn] = []
            while e is not None and e.primitive in _LAYOUT_OPS and isinstance(e.invars[0], Var):
                if e.primitive is lax_primitives.reshape_p and e.params.get("dimensions") is not None:
                    return None
                layout_ops.append(e)
                e = defs.get(e.invars[0])
            if e is None or e.primitive is not lax_primitives.dot_general_p:
                return None
            (ca, cb), (ba, bb) = e.params["dimension_numbers"]
            if ba or bb or len(ca) != 1 or not all(isinstance(v, Var) and v not in renamed for v in e.invars):
                return None
            return e, tuple(reversed(layout_ops))

        def summands(atoms: list) -> tuple[list, tuple]:
            inputs, plan = [], []
            for atom in atoms:
                found = contraction(atom)
                if found is None:
                    plan.append(("plain", len(inputs), None))
                    inputs.append(atom)
                else:
                    dot, layout_ops = found
                    plan.append(("contraction", len(inputs), (dot.params, layout_ops)))
                    inputs.extend(dot.invars)
            return inputs, tuple(plan)

        def rule(eqn: JaxprEqn) -> Any:
            prim = eqn.primitive
            axes = _mesh_names(eqn)
            if not axes:
                return None
            names = axis_names(eqn.params.get("axes", eqn.params.get("axis_name")))
            if eqn.params.get("axis_index_groups") is not None:
                raise FoldError(f"fold-replicas: '{prim.name}' with axis_index_groups cannot be folded.")
            _check_device_major(layout, eqn, names)

            def emit(fn: Any, atoms: Any) -> Any:  # the equation's replacement, traced on the folded mesh
                return inline_function(fn, atoms, context=graph.context, like=eqn, axis_env=layout.axis_env)

            if prim is lax_primitives.axis_index_p:
                expanded = layout.expand(names)
                return emit(lambda: _linear_index(layout, expanded), [])
            device_axes, folded_axes = _split(layout, names)
            if prim is lax_primitives.psum_p and folded_axes:
                # Sum over the fold first: a fused bucket's tensors one by one, before they are
                # packed (vmap would otherwise pack a copy per replica), and a dense layer's
                # replica-summed weight gradient as one contraction over the device's rows.
                # Then one psum over the devices.
                pack = None
                atoms = list(eqn.invars)
                if len(atoms) == 1 and atoms[0] in concatenated:
                    pack, atoms = concatenated[atoms[0]].params, list(concatenated[atoms[0]].invars)
                inputs, plan = summands(atoms)
                return emit(lambda *xs: _sum_fold_then_devices(xs, plan, device_axes, folded_axes, pack), inputs)
            if prim in _REDUCTIONS:
                params = {**eqn.params, _AXIS_PARAM[prim]: layout.expand(names)}
                return emit(lambda *xs: prim.bind(*xs, **params), eqn.invars)
            if prim is lax_primitives.all_gather_p:
                p = eqn.params
                return emit(lambda x: _all_gather(layout, x, names, p["all_gather_dimension"], p["tiled"]), eqn.invars)
            if prim is scatter_p and eqn.params.get("tiled"):
                dim = eqn.params["scatter_dimension"]
                return emit(lambda x: _reduce_scatter(layout, x, names, dim), eqn.invars)
            if prim is lax_primitives.ppermute_p:
                perm = eqn.params["perm"]
                return emit(lambda x: _ppermute(layout, x, names, perm), eqn.invars)
            raise FoldError(
                f"fold-replicas: '{prim.name}' over the mesh axes {axes} has no folded form, so this step cannot "
                "run with several replicas per device. Run it with one replica per device "
                "(rp.Parallelism(replicas_per_device=1), the default)."
            )

        return rewrite_graph(graph, rule, recompute_effects=True)


def fold_lowered(lowered: Lowered, layout: FoldLayout) -> Lowered:
    """``lowered`` with a last snapshot ``fold-replicas``: its final graph folded for ``layout``."""
    from replicator.pass_manager.manager import Lowered, PassSnapshot
    from replicator.pass_manager.verify import check_defined

    result = FoldReplicas(layout).run(lowered.final)
    check_defined(result.graph)
    return Lowered((*lowered.snapshots, PassSnapshot(FoldReplicas.name, result.graph, result.changed)), lowered.notes)
