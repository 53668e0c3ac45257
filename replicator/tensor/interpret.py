"""Run a one-device jaxpr on each device's part of its values: the tensor-parallel rewrite.

:func:`analyze` walks a jaxpr with its inputs' placements over the tensor axis
and returns every output's placement, applying the rules of
:mod:`replicator.tensor.rules` equation by equation; higher-order primitives
are handled here: calls (``jit``, ``remat``, ``custom_jvp_call``,
``custom_vjp_call``) are walked inline, ``scan`` and ``while`` carries reach a
fixed point (a carry that comes out sharded is carried sharded, its initial
value sliced; one that comes out a partial sum is summed at the end of each
iteration), and ``cond`` takes the join of its branches.

:func:`run` does the same walk on values: inside ``shard_map`` each device
holds its local part of every value (a sharded dimension is ``1/T`` of the
global one), each equation's inputs are first converted to the placements its
rule asks for (:func:`replicator.tensor.placement.convert`: an all-reduce, a
reduce-scatter, a free local slice, or a gather only where allowed), then the
primitive is bound on the local parts with its shape parameters made local.

Example: a column-parallel then a row-parallel matmul need one all-reduce:

>>> import jax, jax.numpy as jnp
>>> from replicator.tensor import interpret
>>> from replicator.tensor.placement import REPLICATED, Shard
>>> def mlp(x, w1, w2):
...     return jnp.tanh(x @ w1) @ w2
>>> closed = jax.make_jaxpr(mlp)(jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.ones((16, 8)))
>>> interpret.analyze(closed.jaxpr, [REPLICATED, Shard(1), Shard(0)], size=2)
[P]

Promises:

1. :func:`run` under ``shard_map`` over the tensor axis gives each device its
   part of what the jaxpr computes on one device, within rounding
   (``tests/tensor/test_interpret.py``, against ``jax.jit`` of the same function
   on one device, at T = 2 and 4).
2. :func:`analyze` and :func:`run` agree: the placements ``run`` returns are
   those ``analyze`` predicts.
3. A carry of ``scan``/``while`` keeps one placement for every iteration.
4. ``add_any`` of a partial sum and a replicated term (a residual's cotangents) costs no ``select`` on
   the device index where the sum is then summed: the partial part is all-reduced (or
   reduce-scattered) and the replicated term added after (``tests/tensor/test_cotangent_sums.py``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from replicator._jax_compat import UNKNOWN_LOCATION, scan_operand_counts, source_of, user_code_line
from replicator.core.jaxprs import CALL_PARAMS
from replicator.tensor import overlap
from replicator.tensor.placement import (
    PARTIAL,
    REPLICATED,
    Partial,
    Placement,
    Replicated,
    Shard,
    TensorContext,
    TensorPlacementError,
    convert,
    gather_allowed,
    local_shape,
)
from replicator.tensor.rules import Decision, rule_for

#: The source name of every batch input: a value computed from one is an activation (under sequence
#: parallelism it may be gathered; a weight, computed from state alone, never is).
BATCH = "the batch"

__all__ = ["analyze", "run", "run_step"]


class _Gathered(Replicated):
    """Analysis only: a carry whose iterations disagree on the dimension they shard (held whole)."""

    def __repr__(self) -> str:
        return "R*"


def _join(a: Placement, b: Placement) -> Placement:
    """One placement for a carry that enters as ``a`` and comes out of an iteration as ``b``."""
    if a == b:
        return a
    if isinstance(a, _Gathered) or isinstance(b, _Gathered):
        return _Gathered()
    if isinstance(a, Shard) and isinstance(b, Shard):
        return _Gathered()
    for x in (a, b):
        if isinstance(x, Shard):
            return x  # a replicated value is sliced for free, a partial one reduce-scattered
    return REPLICATED  # replicated and partial: summed each iteration


def _plain(p: Placement) -> Placement:
    return REPLICATED if isinstance(p, _Gathered) else p


class _PendingProduct:
    """Collective matmul: a ``dot_general``'s partial-sum output, not yet computed. Its only consumer may
    reduce-scatter it as a ring (:meth:`_Walker.ring_reduce_scatter`); any other use computes it here."""

    def __init__(self, eqn: JaxprEqn, operands: list, params: dict):
        self.eqn, self.operands, self.params = eqn, operands, params
        self._value: Any = None

    def value(self) -> Any:
        if self._value is None:
            self._value = self.eqn.primitive.bind(*self.operands, **self.params)
        return self._value


class _PendingSum:
    """``add_any``'s sum of a partial sum and replicated terms (a value's cotangents accumulated), the
    replicated terms not yet folded in. A consumer that sums it over the tensor axis (all-reduce or
    reduce-scatter) sums the partial part and adds the replicated terms after, as GSPMD orders it
    (:meth:`summed`); any other use reads the terms folded in (:meth:`value`: one device keeps them, the
    others add zero). Both are the same sum; the first needs no ``select`` on the device index.

    The folded sum is bound when this is made, where ``add_any`` was, so that a later use reads it from
    the backward (a step cut into pipeline stages must not compute on its gradients after them); where
    it goes unused (every consumer summed the parts), it is dead code XLA drops."""

    def __init__(self, add: Any, partial: Any | None, whole: Any, ctx: TensorContext):
        self.add, self.partial, self.whole, self.ctx = add, partial, whole, ctx
        folded = convert(ctx, whole, REPLICATED, PARTIAL, "", "")
        self.folded = folded if partial is None else add(partial, folded)

    def value(self) -> Any:
        return self.folded

    def summed(self, want: Placement, line: str, reason: str, activation: bool) -> Any:
        """The sum in placement ``want`` (not a partial sum): the partial part summed, then the rest added
        (``partial`` None: every term was summed already, and nothing is summed again)."""
        rest = convert(self.ctx, self.whole, REPLICATED, want, line, reason, activation)
        if self.partial is None:
            return rest
        return self.add(convert(self.ctx, self.partial, PARTIAL, want, line, reason, activation), rest)


def _value(x: Any) -> Any:
    return x.value() if isinstance(x, _PendingProduct | _PendingSum) else x


class _Walker:
    """One walk, on placements only (``values`` None) or on this device's values too."""

    def __init__(self, ctx: TensorContext):
        self.ctx = ctx
        # (id(value), wanted placement) -> (value, converted): a value one consumer summed or
        # gathered is not summed again for the next. The value is held so that its id stays its own.
        self._converted: dict[tuple[int, Placement], tuple[Any, Any]] = {}
        # What the values of the equation being run come from (state leaves' paths, "the batch"): named
        # in a refused gather. A sub-graph's inputs come from everything its equation reads.
        self.sources: frozenset[str] = frozenset()
        # The user's line of the equation whose body is being walked (a jnp function JAX jits, a scan):
        # its equations' own lines are inside JAX.
        self.enclosing: str = UNKNOWN_LOCATION
        # What each operand of the equation being walked comes from (is it an activation?).
        self.operand_sources: list[frozenset[str]] = []
        # Whether the output of the equation being walked has one use, by an equation (not an output).
        self.sole_use = False
        self.reads: collections.Counter = collections.Counter()  # how many equations read each variable

    def line(self, eqn: JaxprEqn) -> str:
        """The user's source line of ``eqn``, or of the call or loop it is inside."""
        own = user_code_line(eqn.source_info)
        return self.enclosing if own == UNKNOWN_LOCATION else own

    @contextlib.contextmanager
    def new_trace(self) -> Iterator[None]:
        """Inside a body JAX traces apart (``scan``, ``while``, ``cond``): conversions made there are
        values of that trace, never reused outside it (nor an outer one's reused inside, where it
        would be a constant closed over instead of the body's own input)."""
        outer = self._converted
        self._converted = {}
        try:
            yield
        finally:
            self._converted = outer

    # -- the walk ------------------------------------------------------------------

    def walk(
        self,
        jaxpr: Jaxpr,
        consts: Sequence[Any] | None,
        args: Sequence[Any] | None,
        in_pl: Sequence[Placement],
        in_sources: Sequence[frozenset[str]] | None = None,
    ) -> tuple[list[Any] | None, list[Placement]]:
        values = args is not None
        env_pl: dict[Any, Placement] = {}
        env: dict[Any, Any] = {}
        outer = self.sources
        env_src: dict[Any, frozenset[str]] = dict(
            zip(jaxpr.invars, in_sources or [outer] * len(jaxpr.invars), strict=True)
        )
        for v in jaxpr.constvars:
            env_pl[v] = REPLICATED
        if values:
            env.update(zip(jaxpr.constvars, consts or (), strict=True))
            env.update(zip(jaxpr.invars, args, strict=True))
        env_pl.update(zip(jaxpr.invars, [_plain(p) for p in in_pl], strict=True))

        def read_pl(a: Any) -> Placement:
            return REPLICATED if isinstance(a, Literal) else env_pl[a]

        def read(a: Any) -> Any:
            return a.val if isinstance(a, Literal) else env[a]

        uses: collections.Counter = collections.Counter()
        for e in jaxpr.eqns:
            uses.update(a for a in e.invars if not isinstance(a, Literal))
        uses.update({a: 2 for a in jaxpr.outvars if not isinstance(a, Literal)})  # returned: used as it is
        outer_reads, self.reads = self.reads, uses

        for eqn in jaxpr.eqns:
            ins_pl = [read_pl(a) for a in eqn.invars]
            ins = [read(a) for a in eqn.invars] if values else None
            self.operand_sources = [
                frozenset() if isinstance(a, Literal) else env_src.get(a, frozenset()) for a in eqn.invars
            ]
            self.sources = frozenset().union(*self.operand_sources)
            self.sole_use = len(eqn.outvars) == 1 and uses[eqn.outvars[0]] == 1
            with source_of(eqn):  # what it binds keeps the user's line
                outs, outs_pl = self.eqn(eqn, ins, ins_pl)
            env_src.update((v, self.sources) for v in eqn.outvars)
            env_pl.update(zip(eqn.outvars, outs_pl, strict=True))
            if values:
                env.update(zip(eqn.outvars, outs, strict=True))
        self.sources, self.reads = outer, outer_reads
        out_pl = [read_pl(a) for a in jaxpr.outvars]
        return ([_value(read(a)) for a in jaxpr.outvars] if values else None), out_pl

    def eqn(self, eqn: JaxprEqn, ins: list | None, ins_pl: list[Placement]) -> tuple[list | None, list[Placement]]:
        name = eqn.primitive.name
        higher = {"scan": self.scan, "while": self.while_, "cond": self.cond}
        if name in CALL_PARAMS or name in higher:
            ins = None if ins is None else [_value(x) for x in ins]
            outer, self.enclosing = self.enclosing, self.line(eqn)
            try:
                return (self.call if name in CALL_PARAMS else higher[name])(eqn, ins, ins_pl)
            finally:
                self.enclosing = outer
        decision = self.decide(eqn, ins_pl)
        if ins is None:
            return None, list(decision.outs)
        return self.bind(eqn, ins, ins_pl, decision), list(decision.outs)

    # -- choosing between the ways a rule allows ------------------------------------------

    def is_activation(self, i: int) -> bool:
        """Whether operand ``i`` of the equation being walked is computed from the batch."""
        return BATCH in self.operand_sources[i] if i < len(self.operand_sources) else False

    def decide(self, eqn: JaxprEqn, ins_pl: list[Placement]) -> Decision:
        """The rule's decision; of two ways, the one that gathers no weight, else fewer bytes; under
        sequence parallelism, a partial sum the rule would sum whole reduce-scattered on the sequence instead."""
        decision = self.ask_rule(eqn, ins_pl)
        if self.ctx.sequence_dim is not None:
            decision = self.prefer_sequence(eqn, ins_pl, decision)
        return decision

    def ask_rule(self, eqn: JaxprEqn, ins_pl: Sequence[Placement]) -> Decision:
        """The rule's decision for these placements, or its alternative where that costs less."""
        decision = rule_for(eqn.primitive.name)(eqn, ins_pl, self.ctx.size)
        other = decision.alternative
        if other is not None and self.gather_cost(eqn, ins_pl, other) < self.gather_cost(eqn, ins_pl, decision):
            return other
        return decision

    def gather_cost(self, eqn: JaxprEqn, ins_pl: Sequence[Placement], decision: Decision) -> float:
        """Bytes gathered by ``decision``'s conversions, and those of a partial sum it makes (summed later);
        infinite if it gathers a weight (a value computed from the state alone)."""
        total = sum(
            float(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
            for v, p in zip(eqn.outvars, decision.outs, strict=True)
            if isinstance(p, Partial)
        )
        for i, (a, have, want) in enumerate(zip(eqn.invars, ins_pl, decision.wants, strict=True)):
            if isinstance(have, Shard) and _plain(want) != have:
                if not self.is_activation(i):
                    return float("inf")
                total += float(np.prod(a.aval.shape)) * a.aval.dtype.itemsize
        return total

    def prefer_sequence(self, eqn: JaxprEqn, ins_pl: list[Placement], decision: Decision) -> Decision:
        """Sequence parallelism: partial sums the rule sums whole (all-reduces) are reduce-scattered on
        the sequence dimension instead, where it divides, and the rule asked again with them split there."""
        d, size = self.ctx.sequence_dim, self.ctx.size
        assert d is not None
        # Also a partial sum of the sequence's shape that an element-wise equation would carry on as a partial
        # sum while another equation reads it too: scattered once here, where it is first read, rather than
        # once per product it flows into (Megatron scatters a layer norm's incoming gradient once, before
        # the norm's backward).
        shape = [tuple(v.aval.shape) for v in eqn.outvars]
        swap = [
            i
            for i, (a, have, want) in enumerate(zip(eqn.invars, ins_pl, decision.wants, strict=True))
            if isinstance(have, Partial)
            and (
                isinstance(_plain(want), Replicated)
                or (isinstance(_plain(want), Partial) and shape == [a.aval.shape] and self.reads[a] > 1)
            )
            and not isinstance(a, Literal)
            and len(a.aval.shape) >= max(3, d + 1)
            and a.aval.shape[d] in self.ctx.sequence_lengths
            and a.aval.shape[d] % size == 0
        ]
        if not swap:
            return decision
        split = [Shard(d) if i in swap else p for i, p in enumerate(ins_pl)]
        alternative = self.ask_rule(eqn, split)
        if any(_plain(alternative.wants[i]) != Shard(d) for i in swap):
            return decision  # the rule needs them whole anyway
        return alternative

    def convert_all(
        self,
        eqn: JaxprEqn,
        xs: Sequence[Any],
        have: Sequence[Placement],
        want: Sequence[Placement],
        note: str | None = None,
        operands: bool = False,
    ):
        """``xs`` converted from ``have`` to ``want``; ``operands``: ``xs`` are the equation's operands, in
        order (whether each is an activation is known; otherwise it is the equation's as a whole)."""
        line = self.line(eqn)
        reason = f"'{eqn.primitive.name}'"
        out = []
        for i, (x, h, w) in enumerate(zip(xs, have, want, strict=True)):
            w = _plain(w)
            if isinstance(x, _PendingProduct):
                ring = self.ring_reduce_scatter(x, h, w, line, reason)
                if ring is not None:
                    out.append(ring)
                    continue
                x = x.value()
            summing = isinstance(x, _PendingSum) and isinstance(h, Partial) and not isinstance(w, Partial)
            if isinstance(x, _PendingSum) and not summing:
                x = x.value()
            if h == w:
                out.append(x)
                continue
            key = (id(x), w)
            if key not in self._converted:
                try:
                    activation = self.is_activation(i) if operands else BATCH in self.sources
                    if summing:
                        converted = x.summed(w, line, reason, activation)
                    else:
                        converted = convert(self.ctx, x, h, w, line, reason, activation)
                    self._converted[key] = (x, converted)
                except TensorPlacementError as e:
                    text = f"{e}" + (f"\n{note}" if note else "")
                    if self.sources:
                        named = sorted(self.sources)
                        shown = ", ".join(named[:8]) + (", ..." if len(named) > 8 else "")
                        text += f"\nIts operands are computed from: {shown}."
                    raise TensorPlacementError(text) from None
            out.append(self._converted[key][1])
        return out

    def bind(self, eqn: JaxprEqn, ins: list, ins_pl: list[Placement], decision: Decision) -> list:
        if eqn.primitive.name == "add_any" and isinstance(decision.outs[0], Partial):
            pending = self.pending_sum(eqn, ins, ins_pl)
            if pending is not None:
                return [pending]
        ring = self.ctx.collective_matmul and eqn.primitive.name == "dot_general" and decision.then is None
        if ring:
            gathered = self.ring_all_gather(eqn, ins, ins_pl, decision)
            if gathered is not None:
                return [gathered]
        local = self.convert_all(eqn, ins, ins_pl, decision.wants, decision.note, operands=True)
        params = _local_params(eqn, decision, self.ctx.size)
        if ring and self.sole_use and isinstance(decision.outs[0], Partial):
            return [_PendingProduct(eqn, local, params)]  # its consumer may reduce-scatter it as a ring
        if decision.then == "masked-gather":
            return [_masked_gather(self.ctx, eqn, local, decision.wants[0], params)]
        out = eqn.primitive.bind(*local, **params)
        outs = list(out) if eqn.primitive.multiple_results else [out]
        if decision.then is not None:
            kind = {"max": lax.pmax, "min": lax.pmin}[decision.then]
            self.ctx.record(f"all-reduce-{decision.then}", outs[0], self.line(eqn), f"'{eqn.primitive.name}'")
            outs = [kind(o, self.ctx.axis) for o in outs]
        return outs

    def pending_sum(self, eqn: JaxprEqn, ins: list, ins_pl: list[Placement]) -> _PendingSum | None:
        """``add_any`` of partial sums and replicated terms (the rule keeps the sum partial) as a
        :class:`_PendingSum`; ``None`` where no term is replicated (the plain way). A partial term that
        a consumer has summed already enters summed (its all-reduce is not repeated inside the new one's)."""
        partial, whole = [], []
        for x, p in zip(ins, ins_pl, strict=True):
            summed = self._converted.get((id(x), REPLICATED))
            if summed is not None:
                whole.append(summed[1])  # a consumer summed it already: sum the rest, not it again
            elif isinstance(x, _PendingSum):
                partial.append(x.partial)
                whole.append(x.whole)
            elif isinstance(p, Partial):
                partial.append(_value(x))
            elif isinstance(p, Replicated):
                whole.append(x)
            else:
                return None
        if not whole:
            return None

        def add(a: Any, b: Any) -> Any:
            return eqn.primitive.bind(a, b)

        rest = functools.reduce(add, partial) if partial else None
        return _PendingSum(add, rest, functools.reduce(add, whole), self.ctx)

    # -- collective matmul (replicator.tensor.overlap) ----------------------------------------

    def ring_all_gather(self, eqn: JaxprEqn, ins: list, ins_pl: list[Placement], decision: Decision) -> Any:
        """The product as a ring, where the decision gathers exactly one operand on a free dimension (and
        no consumer gathered it already: the ring's gathered operand is kept for the next, which reads it
        without a collective); ``None``: the plain way."""
        split_to_whole = [
            i
            for i, (have, want) in enumerate(zip(ins_pl, decision.wants, strict=True))
            if isinstance(have, Shard) and isinstance(_plain(want), Replicated)
        ]
        if len(split_to_whole) != 1:
            return None
        (i,) = split_to_whole
        dim = ins_pl[i].dim  # type: ignore[union-attr]
        dn = eqn.params["dimension_numbers"]
        ndims = (len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape))
        if (
            overlap.output_dim(dn, ndims, i, dim) is None
            or (id(ins[i]), REPLICATED) in self._converted
            or not gather_allowed(self.ctx, self.is_activation(i))
        ):
            return None  # contracted or batch; already whole; or refused (the plain way says why)
        wants = [ins_pl[i] if j == i else w for j, w in enumerate(decision.wants)]
        local = self.convert_all(eqn, ins, ins_pl, wants, decision.note, operands=True)
        params = _local_params(eqn, decision, self.ctx.size)
        whole = tuple(eqn.invars[i].aval.shape)
        gathered_shape = [tuple(x.shape) for x in local]
        gathered_shape[i] = tuple(n * self.ctx.size if d == dim else n for d, n in enumerate(local[i].shape))
        flops = overlap.dot_flops(dn, *gathered_shape)
        self.ctx.record(
            "ring all-gather matmul", local[i], self.line(eqn), f"'{eqn.primitive.name}'", whole, flops=flops
        )
        product, gathered = overlap.all_gather_matmul(
            local[0],
            local[1],
            dn,
            operand=i,
            dim=dim,
            axis=self.ctx.axis,
            size=self.ctx.size,
            dot=lambda a, b: eqn.primitive.bind(a, b, **params),
        )
        self._converted[(id(ins[i]), REPLICATED)] = (ins[i], gathered)
        return product

    def ring_reduce_scatter(self, pending: _PendingProduct, have: Placement, want: Placement, line: str, reason: str):
        """``pending``'s partial sum reduce-scattered as a ring, where ``want`` splits a free dimension of
        it; ``None``: the plain way."""
        eqn, (lhs, rhs), size = pending.eqn, pending.operands, self.ctx.size
        if not (isinstance(have, Partial) and isinstance(want, Shard)):
            return None
        dn = eqn.params["dimension_numbers"]
        source = overlap.operand_dim(dn, (lhs.ndim, rhs.ndim), want.dim)
        if source is None or (lhs, rhs)[source[0]].shape[source[1]] % size:
            return None
        ring = overlap.matmul_reduce_scatter(
            lhs,
            rhs,
            dn,
            dim=want.dim,
            axis=self.ctx.axis,
            size=size,
            dot=lambda a, b: eqn.primitive.bind(a, b, **pending.params),
        )
        flops = overlap.dot_flops(dn, tuple(lhs.shape), tuple(rhs.shape))
        self.ctx.record("ring matmul reduce-scatter", ring, line, reason, tuple(eqn.outvars[0].aval.shape), flops=flops)
        return ring

    # -- higher-order primitives ------------------------------------------------------

    def call(self, eqn: JaxprEqn, ins: list | None, ins_pl: list[Placement]):
        inner = eqn.params[CALL_PARAMS[eqn.primitive.name]]
        consts = inner.consts if isinstance(inner, ClosedJaxpr) else ()
        body = inner.jaxpr if isinstance(inner, ClosedJaxpr) else inner
        k = len(body.invars)
        return self.walk(body, consts, None if ins is None else ins[-k:], ins_pl[-k:])

    def _closed(self, closed: ClosedJaxpr, args: list | None, in_pl: Sequence[Placement]):
        return self.walk(closed.jaxpr, closed.consts, args, in_pl)

    def scan(self, eqn: JaxprEqn, ins: list | None, ins_pl: list[Placement]):
        p = eqn.params
        n_consts, n_carry = scan_operand_counts(p)
        body: ClosedJaxpr = p["jaxpr"]
        consts_pl = ins_pl[:n_consts]
        xs_pl = [_unstack(x) for x in ins_pl[n_consts + n_carry :]]
        carry_pl = list(ins_pl[n_consts : n_consts + n_carry])
        while True:
            _, out_pl = self._closed(body, None, consts_pl + [_plain(c) for c in carry_pl] + [_plain(x) for x in xs_pl])
            new = [_join(c, o) for c, o in zip(carry_pl, out_pl[:n_carry], strict=True)]
            if new == carry_pl:
                break
            carry_pl = new
        ys_pl = [_stack(y) for y in out_pl[n_carry:]]
        outs_pl = [_plain(c) for c in carry_pl] + ys_pl
        if ins is None:
            return None, outs_pl
        consts = ins[:n_consts]
        init = self.convert_all(
            eqn, ins[n_consts : n_consts + n_carry], ins_pl[n_consts : n_consts + n_carry], carry_pl
        )
        xs_have = ins_pl[n_consts + n_carry :]
        xs = self.convert_all(eqn, ins[n_consts + n_carry :], xs_have, [_stack(x) for x in xs_pl])
        carry_in = [_plain(c) for c in carry_pl]

        def step(carry: list, x: list) -> tuple[list, list]:
            with self.new_trace():
                outs, got = self._closed(body, list(consts) + list(carry) + list(x), consts_pl + carry_in + xs_pl)
                carry = self.convert_all(eqn, outs[:n_carry], got[:n_carry], carry_in)
            return carry, outs[n_carry:]

        carry, ys = lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        return list(carry) + list(ys), outs_pl

    def while_(self, eqn: JaxprEqn, ins: list | None, ins_pl: list[Placement]):
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_j: ClosedJaxpr = p["cond_jaxpr"]
        body_j: ClosedJaxpr = p["body_jaxpr"]
        cond_pl, body_pl = ins_pl[:nc], ins_pl[nc : nc + nb]
        carry_pl = list(ins_pl[nc + nb :])
        while True:
            _, out_pl = self._closed(body_j, None, body_pl + [_plain(c) for c in carry_pl])
            new = [_join(c, o) for c, o in zip(carry_pl, out_pl, strict=True)]
            if new == carry_pl:
                break
            carry_pl = new
        carry_in = [_plain(c) for c in carry_pl]
        if ins is None:
            return None, carry_in
        cond_consts, body_consts = ins[:nc], ins[nc : nc + nb]
        init = self.convert_all(eqn, ins[nc + nb :], ins_pl[nc + nb :], carry_pl)

        def cond_fun(carry: list) -> Any:
            with self.new_trace():
                (pred,), (pred_pl,) = self._closed(cond_j, list(cond_consts) + list(carry), cond_pl + carry_in)
                return convert(self.ctx, pred, pred_pl, REPLICATED, self.line(eqn), "the predicate of a 'while'")

        def body_fun(carry: list) -> list:
            with self.new_trace():
                outs, got = self._closed(body_j, list(body_consts) + list(carry), body_pl + carry_in)
                return self.convert_all(eqn, outs, got, carry_in)

        return list(lax.while_loop(cond_fun, body_fun, init)), carry_in

    def cond(self, eqn: JaxprEqn, ins: list | None, ins_pl: list[Placement]):
        branches: Sequence[ClosedJaxpr] = eqn.params["branches"]
        ops_pl = ins_pl[1:]
        outs_pl: list[Placement] | None = None
        for b in branches:
            _, got = self._closed(b, None, ops_pl)
            outs_pl = got if outs_pl is None else [_join(a, g) for a, g in zip(outs_pl, got, strict=True)]
        outs_pl = [_plain(p) for p in outs_pl or []]
        if ins is None:
            return None, outs_pl
        index = convert(self.ctx, ins[0], ins_pl[0], REPLICATED, self.line(eqn), "the index of a 'cond'")

        def branch_fn(b: ClosedJaxpr):
            def fn(*ops: Any) -> list:
                with self.new_trace():
                    outs, got = self._closed(b, list(ops), ops_pl)
                    return self.convert_all(eqn, outs, got, outs_pl)

            return fn

        return list(lax.switch(index, [branch_fn(b) for b in branches], *ins[1:])), outs_pl


def _unstack(p: Placement) -> Placement:
    """The placement of one step's slice of a scanned-over value."""
    if isinstance(p, Shard):
        return Shard(p.dim - 1) if p.dim > 0 else _Gathered()
    return p


def _stack(p: Placement) -> Placement:
    if isinstance(p, _Gathered):
        return REPLICATED
    return Shard(p.dim + 1) if isinstance(p, Shard) else p


def _masked_gather(ctx: TensorContext, eqn: JaxprEqn, local: list, split: Shard, params: dict) -> Any:
    """This device's rows of a lookup in a table split on the looked-up dimension; zeros elsewhere.

    The looked-up indices are moved to this device's block; those outside it look up row 0 and
    are zeroed, so the lookups summed over the tensor axis are the whole lookup (Megatron's
    vocabulary-parallel embedding).
    """
    table, indices = local
    dn = params["dimension_numbers"]
    rows = table.shape[split.dim]
    k = list(dn.start_index_map).index(split.dim)
    mine = indices[..., k] - lax.axis_index(ctx.axis).astype(indices.dtype) * rows
    inside = (mine >= 0) & (mine < rows)
    moved = indices.at[..., k].set(jnp.where(inside, mine, 0))
    out = eqn.primitive.bind(table, moved, **params)
    batch_dims = [i for i in range(out.ndim) if i not in dn.offset_dims]
    mask = lax.broadcast_in_dim(inside, out.shape, batch_dims)
    return jnp.where(mask, out, jnp.zeros((), out.dtype))


def _local_params(eqn: JaxprEqn, decision: Decision, size: int) -> dict:
    """The equation's params with the shapes they name made local."""
    params = dict(eqn.params)
    name = eqn.primitive.name
    out = decision.outs[0] if decision.outs else REPLICATED
    if name == "broadcast_in_dim":
        params["shape"] = local_shape(params["shape"], out, size)
        params["sharding"] = None
    elif name == "reshape":
        params["new_sizes"] = local_shape(tuple(params["new_sizes"]), out, size)
        if "sharding" in params:
            params["sharding"] = None
    elif name == "slice" and isinstance(out, Shard):
        limit = list(params["limit_indices"])
        limit[out.dim] //= size
        params["limit_indices"] = tuple(limit)
    elif name == "gather" and isinstance(decision.wants[0], Shard) and decision.then is None:
        params["slice_sizes"] = local_shape(tuple(params["slice_sizes"]), decision.wants[0], size)
    elif name == "dynamic_slice" and isinstance(decision.wants[0], Shard):
        params["slice_sizes"] = local_shape(tuple(params["slice_sizes"]), decision.wants[0], size)
    return params


def analyze(
    jaxpr: Jaxpr,
    in_placements: Sequence[Placement],
    *,
    size: int,
    axis: str = "tensor",
    sequence_dim: int | None = None,
    in_names: Sequence[str] | None = None,
) -> list[Placement]:
    """The placement of each output of ``jaxpr`` given its inputs' (``in_names`` as for :func:`run`: the
    batch's inputs named :data:`BATCH` make what is computed from them activations)."""
    ctx = TensorContext(axis, size, allow_gather=True, sequence_dim=sequence_dim)
    if sequence_dim is not None and in_names is not None:
        ctx.sequence_lengths = sequence_lengths(jaxpr.invars, in_names, sequence_dim)
    sources = [frozenset([n]) for n in in_names] if in_names is not None else None
    return _Walker(ctx).walk(jaxpr, None, None, in_placements, sources)[1]


def sequence_lengths(invars: Sequence[Any], names: Sequence[str], dim: int) -> frozenset[int]:
    """The sizes on ``dim`` of the batch's inputs (those named :data:`BATCH`) that have it."""
    return frozenset(
        v.aval.shape[dim] for v, n in zip(invars, names, strict=True) if n == BATCH and len(v.aval.shape) > dim
    )


def run(
    ctx: TensorContext,
    closed: ClosedJaxpr,
    args: Sequence[Any],
    in_placements: Sequence[Placement],
    in_names: Sequence[str] | None = None,
) -> tuple[list[Any], list[Placement]]:
    """Evaluate ``closed`` on this device's parts ``args`` (under ``shard_map`` over ``ctx.axis``).

    ``in_names`` name the inputs (state paths) in a refused gather's message.
    """
    sources = [frozenset([n]) for n in in_names] if in_names is not None else None
    if ctx.sequence_dim is not None and in_names is not None:
        ctx.sequence_lengths = sequence_lengths(closed.jaxpr.invars, in_names, ctx.sequence_dim)
    outs, pl = _Walker(ctx).walk(closed.jaxpr, closed.consts, list(args), in_placements, sources)
    assert outs is not None
    return outs, pl


def run_step(
    ctx: TensorContext,
    closed: ClosedJaxpr,
    args: Sequence[Any],
    in_placements: Sequence[Placement],
    out_placements: Sequence[Placement],
    in_names: Sequence[str] | None = None,
) -> list[Any]:
    """:func:`run` of a step, each output then brought to the placement it is returned in (the collectives
    recorded afresh in ``ctx.events``)."""
    ctx.events.clear()
    outs, got = run(ctx, closed, args, in_placements, in_names)
    return [
        convert(ctx, o, g, w, "the step's outputs", "returning it in its placement")
        for o, g, w in zip(outs, got, out_placements, strict=True)
    ]
