"""Placement rules: what each primitive needs of its inputs and gives its outputs.

A rule looks at an equation and its inputs' placements over the tensor axis
(:mod:`replicator.tensor.placement`) and returns a :class:`Decision`: the
placement each input must be brought to first, and the placement of each
output. Rules are registered by primitive name in :data:`RULES`, beside the
primitive family they handle; Megatron's conjugate operators are not written
anywhere, they fall out of these rules on the forward and on its transpose:

* ``dot_general`` with a sharded contracting dimension gives a partial sum
  (row-parallel), with a sharded free dimension a sharded result
  (column-parallel), and a replicated operand facing a sharded one is sliced
  locally, for free;
* linear primitives (``add``, ``neg``, a ``mul`` or ``div`` by a replicated
  value, ``transpose``, ``reshape``, ``reduce_sum``, ...) keep a partial sum
  partial; every other primitive needs it summed first (an all-reduce);
* ``reduce_sum`` over a sharded dimension gives a partial sum,
  ``reduce_max``/``reduce_min`` over one a ``pmax``/``pmin``.

A primitive without a rule gets the worst case (:func:`unknown_rule`): every
input whole, which for a sharded input is a gather, refused unless the user
allowed it. Higher-order primitives (``scan``, ``while``, ``cond``, calls) are
handled by the interpreter (:mod:`replicator.tensor.interpret`).

Promises:

1. A decision never asks for a conversion from sharded to something else
   unless no placement without one exists for that primitive
   (``tests/tensor/test_rules.py``).
2. Outputs' placements are exact: running the primitive on the converted local
   inputs gives each device its part of the global output
   (``tests/tensor/test_interpret.py``, against the one-device result).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.extend.core import JaxprEqn

from replicator.tensor.placement import PARTIAL, REPLICATED, Partial, Placement, Replicated, Shard

__all__ = ["RULES", "Decision", "Rule", "rule_for", "unknown_rule"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """Inputs' placements to convert to first, then outputs' placements."""

    wants: tuple[Placement, ...]
    outs: tuple[Placement, ...]
    # Reduce over the tensor axis after the local primitive: "max" or "min" (reduce_max/min).
    then: str | None = None
    # Why an input must be whole, said with a refused gather (e.g. heads the degree does not divide).
    note: str | None = None
    # Another way to the same result, converting other inputs (``dot_general`` with both operands split
    # on dimensions that do not pair: keep the left one's split or the right one's). The interpreter
    # takes the one that gathers no weight, else the one that moves fewer bytes.
    alternative: Decision | None = None


Rule = Callable[[JaxprEqn, Sequence[Placement], int], Decision]
RULES: dict[str, Rule] = {}


def _ndim(atom: Any) -> int:
    return len(atom.aval.shape)


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(atom.aval.shape)


def _whole(p: Placement) -> Placement:
    """What a non-linear primitive can use of ``p``: a partial sum summed, a shard kept."""
    return REPLICATED if isinstance(p, Partial) else p


def unknown_rule(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    """The worst case: every input whole, every output replicated."""
    return Decision(tuple(REPLICATED for _ in ins), tuple(REPLICATED for _ in eqn.outvars))


def rule_for(name: str) -> Rule:
    return RULES.get(name, unknown_rule)


# -- element-wise -------------------------------------------------------------------


def _spans(atom: Any, target: Placement, rank: int) -> bool:
    """Whether an operand of an element-wise primitive has the output's extent on ``target``'s dimension.

    A scalar, or an operand of size 1 there (lax broadcasts it), is used whole on every device.
    """
    if not isinstance(target, Shard) or _ndim(atom) != rank:
        return False
    return _shape(atom)[target.dim] != 1


def _common_shard(eqn: JaxprEqn, ins: Sequence[Placement]) -> Placement:
    """The placement every operand of an element-wise primitive that spans it is brought to."""
    rank = max(_ndim(a) for a in eqn.invars) if eqn.invars else 0
    shards = {p.dim for p, a in zip(ins, eqn.invars, strict=True) if isinstance(p, Shard) and _ndim(a) == rank}
    if len(shards) == 1:
        return Shard(shards.pop())
    return REPLICATED  # none sharded, or sharded on different dimensions: whole


def _elementwise(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    target = _common_shard(eqn, ins)
    rank = max(_ndim(a) for a in eqn.invars)
    wants = tuple(target if _spans(a, target, rank) else REPLICATED for a in eqn.invars)
    return Decision(wants, tuple(target for _ in eqn.outvars))


def _all_partial_or(rule: Rule, *, absorb: bool = False) -> Rule:
    """Linear in every operand together (``add``): partial sums stay partial.

    A partial sum meeting a replicated term is summed there (as DTensor does) in the forward's
    ``add``: kept partial, the all-reduce would move later, onto values the backward reads again.
    ``add_any`` (``absorb``), JAX's accumulation of one value's cotangents, takes a replicated term in
    for free instead (one device keeps it, the others add zero): the cotangents of a value read in
    several places (a layer norm's input, read by the query, key and value projections) are added
    one by one, and summing at each addition would cost an all-reduce per reader instead of one.
    The interpreter keeps such a sum in two parts (``interpret._PendingSum``): a consumer that sums it
    sums the partial part and adds the replicated terms after, so no device-index ``select`` is paid.
    """

    def linear(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
        if all(isinstance(p, Partial) for p in ins):
            return Decision(tuple(ins), tuple(PARTIAL for _ in eqn.outvars))
        mixed = any(isinstance(p, Partial) for p in ins) and all(isinstance(p, Partial | Replicated) for p in ins)
        if absorb and mixed:
            return Decision(tuple(PARTIAL for _ in ins), tuple(PARTIAL for _ in eqn.outvars))
        return rule(eqn, [_whole(p) for p in ins], size)

    return linear


def _first_partial_or(rule: Rule) -> Rule:
    """Linear in its first operand given the others (``mul``, ``div``): one partial operand stays partial."""

    def linear(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
        partial = [i for i, p in enumerate(ins) if isinstance(p, Partial)]
        others_whole = all(isinstance(p, Replicated) for i, p in enumerate(ins) if i not in partial)
        ok = len(partial) == 1 and others_whole and (eqn.primitive.name == "mul" or partial == [0])
        if ok:
            return Decision(tuple(ins), (PARTIAL,))
        return rule(eqn, [_whole(p) for p in ins], size)

    return linear


def _nonlinear(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    return _elementwise(eqn, [_whole(p) for p in ins], size)


ELEMENTWISE = """abs acos acosh asin asinh atan atan2 atanh cbrt ceil clamp cos cosh digamma erf erf_inv
erfc exp exp2 expm1 floor igamma igammac imag integer_pow is_finite lgamma log log1p logistic max min
nextafter not and or xor pow real rem round rsqrt select_n sign sin sinh sqrt square tan tanh eq ne lt le
gt ge shift_left shift_right_logical shift_right_arithmetic population_count reduce_precision
stop_gradient clz complex eq_to le_to lt_to mulhi log2 one_minus_square bessel_i0e bessel_i1e polygamma
zeta igamma_grad_a random_gamma_grad regularized_incomplete_beta""".split()
for _name in ELEMENTWISE:
    RULES[_name] = _nonlinear
for _name in ("add", "sub"):
    RULES[_name] = _all_partial_or(_elementwise)
RULES["add_any"] = _all_partial_or(_elementwise, absorb=True)
for _name in ("mul", "div"):
    RULES[_name] = _first_partial_or(_elementwise)


def _unary_linear(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    return Decision(tuple(ins), (ins[0],))


def _convert(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    # A partial sum stays partial only between floating dtypes (truncating each summand is not linear).
    src, dst = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
    floating = np.issubdtype(src, np.inexact) and np.issubdtype(dst, np.inexact)
    p = ins[0] if floating else _whole(ins[0])
    return Decision((p,), (p,))


for _name in ("neg", "copy", "copy_p", "conj", "sharding_constraint"):
    RULES[_name] = _unary_linear
RULES["convert_element_type"] = _convert


def _optimization_barrier(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    return Decision(tuple(ins), tuple(ins))


RULES["optimization_barrier"] = _optimization_barrier


# -- contraction ----------------------------------------------------------------------


def _dot_general(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    lp, rp = ins
    lfree = [i for i in range(_ndim(lhs)) if i not in lc and i not in lb]
    rfree = [i for i in range(_ndim(rhs)) if i not in rc and i not in rb]
    # Bilinear: a partial operand facing a replicated one stays partial.
    if isinstance(lp, Partial) and isinstance(rp, Replicated) or isinstance(rp, Partial) and isinstance(lp, Replicated):
        return Decision((lp, rp), (PARTIAL,))
    lp, rp = _whole(lp), _whole(rp)
    # One operand's split decides what the other must be (split on the paired dimension, or whole: a
    # gather if it is split on another). With both split, either may decide: the other is the alternative.
    offset = len(lb) + len(lfree)
    left = _dot_from(lp.dim, lc, rc, lb, rb, lfree, len(lb), lambda p: (lp, p), rp) if isinstance(lp, Shard) else None
    right = _dot_from(rp.dim, rc, lc, rb, lb, rfree, offset, lambda p: (p, rp), lp) if isinstance(rp, Shard) else None
    if left is not None and right is not None and left.wants != right.wants:
        return dataclasses.replace(left, alternative=right)
    return left or right or Decision((REPLICATED, REPLICATED), (REPLICATED,))


def _dot_from(
    d: int,
    contract: Sequence[int],
    other_contract: Sequence[int],
    batch: Sequence[int],
    other_batch: Sequence[int],
    free: Sequence[int],
    free_offset: int,
    pack: Callable[[Placement], tuple[Placement, Placement]],
    other: Placement,
) -> Decision:
    """The decision when one operand is sharded on ``d``."""
    if d in contract:
        return Decision(pack(Shard(other_contract[list(contract).index(d)])), (PARTIAL,))
    if d in batch:
        k = list(batch).index(d)
        return Decision(pack(Shard(other_batch[k])), (Shard(k),))
    # A free dimension: the other operand must be whole.
    del other
    return Decision(pack(REPLICATED), (Shard(free_offset + list(free).index(d)),))


RULES["dot_general"] = _dot_general


# -- shapes ---------------------------------------------------------------------------


def _broadcast_in_dim(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    p = ins[0]
    dims = eqn.params["broadcast_dimensions"]
    wants = (p,) + tuple(REPLICATED for _ in eqn.invars[1:])
    if isinstance(p, Shard):
        if _shape(eqn.invars[0])[p.dim] != eqn.params["shape"][dims[p.dim]]:
            return Decision((REPLICATED,) + wants[1:], (REPLICATED,))
        return Decision(wants, (Shard(dims[p.dim]),))
    return Decision(wants, (p,))


def _reshape_target(src: Sequence[int], dst: Sequence[int], d: int, size: int) -> int | None:
    """The output dimension that a block split of input dimension ``d`` becomes, if any."""
    before = int(np.prod(src[:d], dtype=np.int64))
    for o in range(len(dst)):
        if int(np.prod(dst[:o], dtype=np.int64)) != before or dst[o] == 1 and src[d] != 1:
            continue
        split = src[d] % dst[o] == 0 and dst[o] % size == 0  # d splits into (dst[o], ...)
        merge = dst[o] % src[d] == 0  # (src[d], ...) merge into dst[o]
        if split or merge:
            return o
    return None


def _reshape(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    p = ins[0]
    extra = tuple(REPLICATED for _ in eqn.invars[1:])
    if isinstance(p, Shard):
        src, dst = _shape(eqn.invars[0]), tuple(eqn.params["new_sizes"])
        o = _reshape_target(src, dst, p.dim, size)
        if o is None:
            note = (
                f"The reshape {src} -> {dst} turns the split dimension (size {src[p.dim]}) into dimensions whose "
                f"first the tensor degree {size} does not divide (e.g. a head count): choose a degree that "
                f"divides it, or split another dimension."
            )
            return Decision((REPLICATED,) + extra, (REPLICATED,), note=note)
        return Decision((p,) + extra, (Shard(o),))
    return Decision((p,) + extra, (p,))


def _transpose(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    p = ins[0]
    if isinstance(p, Shard):
        return Decision((p,), (Shard(list(eqn.params["permutation"]).index(p.dim)),))
    return Decision((p,), (p,))


def _squeeze(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    p = ins[0]
    if isinstance(p, Shard):
        dims = eqn.params["dimensions"]
        return Decision((p,), (Shard(p.dim - sum(1 for x in dims if x < p.dim)),))
    return Decision((p,), (p,))


def _reduce(linear: bool) -> Rule:
    def rule(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
        p = ins[0] if linear else _whole(ins[0])
        axes = eqn.params["axes"]
        if isinstance(p, Shard):
            if p.dim in axes:
                if linear:
                    return Decision((p,), (PARTIAL,))
                return Decision((p,), (REPLICATED,), then=eqn.primitive.name[len("reduce_") :])
            return Decision((p,), (Shard(p.dim - sum(1 for a in axes if a < p.dim)),))
        return Decision((p,), (p,))

    return rule


RULES["broadcast_in_dim"] = _broadcast_in_dim
RULES["reshape"] = _reshape
RULES["transpose"] = _transpose
RULES["squeeze"] = _squeeze
RULES["reduce_sum"] = _reduce(linear=True)
RULES["reduce_max"] = _reduce(linear=False)
RULES["reduce_min"] = _reduce(linear=False)


def _along(param: str, linear: bool) -> Rule:
    """A primitive that works along the dimensions in ``param``: a shard elsewhere is kept."""

    def rule(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
        p = ins[0] if linear else _whole(ins[0])
        dims = eqn.params[param]
        dims = dims if isinstance(dims, tuple | list) else (dims,)
        extra = tuple(REPLICATED for _ in eqn.invars[1:])
        if isinstance(p, Shard) and p.dim in dims:
            p = REPLICATED
        outs = tuple(p for _ in eqn.outvars)
        if eqn.primitive.name in ("argmax", "argmin") and isinstance(p, Shard):
            outs = (Shard(p.dim - sum(1 for a in dims if a < p.dim)),)
        return Decision((p,) + extra, outs)

    return rule


RULES["rev"] = _along("dimensions", linear=True)
RULES["cumsum"] = _along("axis", linear=True)
for _name in ("cumprod", "cummax", "cummin", "cumlogsumexp"):
    RULES[_name] = _along("axis", linear=False)
for _name in ("argmax", "argmin"):
    RULES[_name] = _along("axes", linear=False)


def _full_extent(eqn: JaxprEqn, d: int, sizes: Sequence[int]) -> bool:
    return _shape(eqn.invars[0])[d] == sizes[d]


def _slice(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    p = ins[0]
    if isinstance(p, Shard):
        start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
        strides = eqn.params["strides"] or (1,) * len(start)
        whole_dim = start[p.dim] == 0 and limit[p.dim] == _shape(eqn.invars[0])[p.dim] and strides[p.dim] == 1
        if not whole_dim:
            p = REPLICATED
    return Decision((p,), (p,))


def _dynamic_slice(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    p = ins[0]
    if isinstance(p, Shard) and not _full_extent(eqn, p.dim, eqn.params["slice_sizes"]):
        p = REPLICATED  # the start is clamped to 0 when the slice spans the dimension
    return Decision((p,) + tuple(REPLICATED for _ in eqn.invars[1:]), (p,))


def _dynamic_update_slice(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    op, upd = ins[0], ins[1]
    idx = tuple(REPLICATED for _ in eqn.invars[2:])
    if isinstance(op, Partial) and isinstance(upd, Partial):
        return Decision((op, upd) + idx, (PARTIAL,))
    op, upd = _whole(op), _whole(upd)
    shard = op if isinstance(op, Shard) else upd if isinstance(upd, Shard) else None
    if shard is not None and _shape(eqn.invars[1])[shard.dim] == _shape(eqn.invars[0])[shard.dim]:
        return Decision((shard, shard) + idx, (shard,))
    return Decision((REPLICATED, REPLICATED) + idx, (REPLICATED,))


def _concatenate(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    if all(isinstance(p, Partial) for p in ins):
        return Decision(tuple(ins), (PARTIAL,))
    target = _common_shard(eqn, [_whole(p) for p in ins])
    if isinstance(target, Shard) and target.dim == eqn.params["dimension"]:
        target = REPLICATED
    return Decision(tuple(target for _ in ins), (target,))


def _pad(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    p = _whole(ins[0])
    if isinstance(p, Shard) and eqn.params["padding_config"][p.dim] != (0, 0, 0):
        p = REPLICATED
    return Decision((p, REPLICATED), (p,))


def _gather(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    """A lookup in a table split on the looked-up dimension (a vocabulary-split embedding) is a masked
    local lookup, a partial sum; a table split on a dimension each lookup takes whole keeps the split."""
    table = _whole(ins[0])
    dn = eqn.params["dimension_numbers"]
    sizes = eqn.params["slice_sizes"]
    if isinstance(table, Shard) and table.dim not in dn.operand_batching_dims:
        d = table.dim
        if d in dn.collapsed_slice_dims and d in dn.start_index_map and sizes[d] == 1:
            return Decision((table, REPLICATED), (PARTIAL,), then="masked-gather")
        if d not in dn.start_index_map and sizes[d] == _shape(eqn.invars[0])[d]:
            dropped = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)
            kept = [i for i in range(_ndim(eqn.invars[0])) if i not in dropped]
            return Decision((table, REPLICATED), (Shard(dn.offset_dims[kept.index(d)]),))
    return unknown_rule(eqn, ins, size)


def _scatter_add(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    """The transpose of a lookup that keeps a table's split: updates split on a window dimension that
    spans the table's dimension are added into the table split there, locally."""
    operand, indices, updates = eqn.invars
    up = ins[2]
    dn = eqn.params["dimension_numbers"]
    if isinstance(up, Shard) and up.dim in dn.update_window_dims:
        dropped = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
        windows = [i for i in range(_ndim(operand)) if i not in dropped]
        d = windows[list(dn.update_window_dims).index(up.dim)]
        spans = _shape(updates)[up.dim] == _shape(operand)[d] and d not in dn.scatter_dims_to_operand_dims
        if spans and not isinstance(ins[0], Partial):
            return Decision((Shard(d), REPLICATED, up), (Shard(d),))
    return unknown_rule(eqn, ins, size)


RULES["gather"] = _gather
RULES["scatter-add"] = _scatter_add
RULES["slice"] = _slice
RULES["dynamic_slice"] = _dynamic_slice
RULES["dynamic_update_slice"] = _dynamic_update_slice
RULES["concatenate"] = _concatenate
RULES["pad"] = _pad


def _constant(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    return Decision(tuple(REPLICATED for _ in ins), tuple(REPLICATED for _ in eqn.outvars))


for _name in ("iota", "rng_bit_generator", "random_bits", "random_seed", "random_wrap", "random_unwrap"):
    RULES[_name] = _constant


# -- collectives over other mesh axes (the data axes), in lowered graphs ------------


def _passthrough(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    """A sum over other axes commutes with the tensor axis's placements."""
    return Decision(tuple(ins), tuple(ins))


RULES["psum"] = _passthrough
RULES["ppermute"] = _passthrough
for _name in ("pmax", "pmin"):
    RULES[_name] = lambda eqn, ins, size: Decision(tuple(_whole(p) for p in ins), tuple(_whole(p) for p in ins))
RULES["axis_index"] = _constant


# -- the cross-replica placeholders (collectives over the data axes, before lowering) -------------
# They act on each replica's value as a whole and element by element across replicas, so a
# placement over the tensor axis goes through them; a sum or a mean is linear (a partial sum stays
# one), a max or a min is not.


def _all_reduce(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    if eqn.params["op"] in ("sum", "mean"):
        return _passthrough(eqn, ins, size)
    whole = tuple(_whole(p) for p in ins)
    return Decision(whole, whole)


def _all_gather(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    """Replicas' values stacked (a new axis) or concatenated along ``axis``."""
    (p,) = ins
    axis, tiled = eqn.params["axis"], eqn.params["tiled"]
    if not isinstance(p, Shard):
        return Decision((p,), (p,))
    if tiled:
        if p.dim == axis:  # the replicas' blocks interleave with the tensor axis's: whole first
            return Decision((REPLICATED,), (REPLICATED,), note="it is concatenated across replicas on that dimension")
        return Decision((p,), (p,))
    return Decision((p,), (Shard(p.dim + 1 if p.dim >= axis else p.dim),))


def _reduce_scatter(eqn: JaxprEqn, ins: Sequence[Placement], size: int) -> Decision:
    """A sum over replicas, each keeping one chunk along ``axis``."""
    (p,) = ins
    if isinstance(p, Shard) and p.dim == eqn.params["axis"]:
        return Decision((REPLICATED,), (REPLICATED,), note="it is cut into replicas' chunks on that dimension")
    return Decision((p,), (p,))


RULES["rp.all_reduce"] = _all_reduce
RULES["rp.broadcast"] = _passthrough
RULES["rp.all_gather"] = _all_gather
RULES["rp.reduce_scatter"] = _reduce_scatter
RULES["rp.replica_id"] = _constant
# A pipeline's stage boundary carries each device's block as it is (a boundary's messages are local):
# a split activation crosses as its 1/T, a partial sum as each device's part.
RULES["rp.stage_boundary"] = _passthrough
