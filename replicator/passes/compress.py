"""``compress-communication``: all-reduce float32 payloads in a narrower dtype.

Halves the bytes a sum or mean all-reduce moves, at the cost of precision
(the idea of Horovod's ``Compression.fp16`` and of bf16 gradient all-reduce
in large-scale training). Off by default: it is not in
:func:`~replicator.passes.default_passes`; insert it after ``fuse-collectives``
(so that it casts the fused buckets) and before ``hierarchical-allreduce`` and
``lower-collectives``. On placeholders it rewrites::

    s = rp.all_reduce[op=mean group=None] g                 # f32[20]

into::

    w = convert_element_type[new_dtype=bfloat16] g
    t = rp.all_reduce[op=sum group=None] w                  # bf16 on the wire
    s = (convert_element_type[new_dtype=float32] t) / 8.0   # back to f32, then the mean

Operands of other dtypes (f64, f16, bf16, integers) in the same all-reduce
stay as they are; ``max``/``min`` are left alone (a rounded maximum would no
longer be any replica's value). A mean is all-reduced as a
sum and divided by the group size after the cast back, in float32. With
``groups=('workers',)`` after ``hierarchical-allreduce`` only the
inter-worker step (the slow links) is compressed.

**Precondition (when the pass rewrites).** An ``rp.all_reduce`` is
rewritten only if its op is ``sum`` or ``mean``, its group is one of
``groups``, it has at least one float32 operand, and its group has ``N``
replicas with ``2 <= N`` and ``N u < 1`` (``u`` below): over one replica there
is nothing to send, so casting would only lose precision, and for ``N u >= 1``
(bfloat16: 256 replicas or more) no bound holds. Only the float32 operands are
cast; ``max``/``min``, other dtypes and other groups are left alone
(``tests/passes/test_compress.py::test_only_float32_operands_are_compressed``,
``test_groups_of_one_replica_are_not_compressed``,
``test_groups_too_large_for_the_bound_are_not_compressed``). The pass changes
results by design, within the bound below, so it is ``exact = False`` for
translation validation.

Error. Let ``u`` be the unit roundoff of the wire dtype (``finfo.eps / 2``:
``2**-8`` for bfloat16, whose significand has 8 bits; ``2**-11`` for
float16), ``eta`` its smallest normal number (``finfo.tiny``: ``1.2e-38`` for
bfloat16, ``6.1e-5`` for float16), ``x_1 .. x_N`` the float32 values of one
element on the ``N`` replicas of the group, and ``s = sum x_i`` computed
exactly. Every rounding to the wire dtype is modelled as ``fl(z) = z (1 + d)
+ e`` with ``|d| <= u``, ``|e| <= eta`` (``e`` is the underflow: a result
below ``eta`` in magnitude is rounded to a subnormal, or flushed to zero on a
backend that flushes them, either way off by at most ``eta``).

0. The bound needs the values to stay finite in the wire dtype: every
   ``|x_i|`` and every partial sum below ``finfo.max`` of the wire dtype
   (float16: 65504, so float16 is only safe for small values; bfloat16:
   3.3895e38, a little below float32's 3.4028e38, so a float32 above 3.396e38
   becomes ``inf``). Otherwise the result is ``inf`` or ``nan``; the pass cannot
   know the values, this is a condition on the user's data.
1. The cast rounds each operand: ``x^_i = x_i (1 + d_i) + e_i``.
2. XLA adds the ``x^_i`` in the wire dtype in an order of its choosing (a
   ring, a tree, ...). In any order each term goes through at most ``N - 1``
   rounded additions ``fl(a + b) = (a + b)(1 + e) + e'``, so ``s^ = sum x_i
   (1 + d_i) prod_k (1 + e_k)`` plus at most ``2N - 1`` underflow terms (``N``
   casts, ``N - 1`` additions), each multiplied by at most ``N - 1`` factors
   ``(1 + e_k)``; ``|prod - 1| <= (1 + u)**N - 1 <= gamma_N = N u / (1 - N u)``
   (Higham, *Accuracy and Stability of Numerical Algorithms*, Lemma 3.1).
3. The cast back to float32 is exact.

Hence, for a sum, element-wise::

    |s^ - s| <= gamma_N * sum_i |x_i| + (2N - 1) * eta * (1 + gamma_N),    gamma_N = N u / (1 - N u)

The first term is ``u * sum|x_i| * c(N)`` with ``c(N) = N / (1 - N u)``: for
bfloat16 and 8 replicas, ``c = 8.26`` and it is ``0.0323 * sum|x_i|``; the
second is negligible for bfloat16 (``2e-37``) but not for float16 (``9.2e-4``
for 8 replicas: float16 rounds values below ``3e-8`` to zero, and keeps those
below ``6.1e-5`` with fewer bits). A mean divides in float32 (unit
roundoff ``u32 = 2**-24``, smallest normal ``eta32``)::

    |m^ - m| <= ((gamma_N + u32 (1 + gamma_N)) * sum|x_i| + (2N - 1) eta (1 + gamma_N)(1 + u32)) / N + eta32

If the backend accumulates in float32 the error is smaller, and the bound still
holds. It is a worst case: on random data the error is typically near ``u *
|s|`` (the cast of the operands and of the result), and the bound is reached
only when all roundings go the same way. Compare the float32 all-reduce:
``gamma_N`` with ``u = 2**-24``. :func:`error_bound` evaluates the bound.

Example (``rp.PassManager.default(compress=True)`` does the same; or
``CompressCommunication(wire_dtype=jnp.float16, groups=("workers",))``):

>>> from replicator.passes import CompressCommunication, default_passes
>>> passes = default_passes()
>>> at = [p.name for p in passes].index("fuse-collectives") + 1
>>> passes.insert(at, CompressCommunication())
>>> repl = rp.Replicator(1, 8, passes=rp.PassManager(passes))
>>> report = repl.explain(lambda b: rp.all_mean(b), np.ones((8, 4), np.float32))
>>> [(r.kind, r.dtype, r.nbytes) for r in report.rows]
[('all_sum', 'bfloat16', 8)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from replicator.core.context import GROUPS
from replicator.core.graph import StepGraph
from replicator.core.primitives import all_reduce_p
from replicator.pass_manager.contract import Pass, PassResult, replace_placeholders

__all__ = ["CompressCommunication", "error_bound", "has_bound"]

Atom = Any  # Var | Literal
#: The dtype whose all-reduce payloads are compressed.
SOURCE_DTYPE = np.dtype(np.float32)
#: The all-reduce ops that are compressed.
OPS = ("sum", "mean")


def _wire(dtype: Any) -> np.dtype:
    try:
        wire = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"CompressCommunication: wire_dtype={dtype!r} is not a dtype; use e.g. jnp.bfloat16.") from e
    if not jnp.issubdtype(wire, jnp.floating) or wire.itemsize >= SOURCE_DTYPE.itemsize:
        raise ValueError(
            f"CompressCommunication: wire_dtype must be a floating dtype narrower than float32 "
            f"(jnp.bfloat16 or jnp.float16), got {wire}."
        )
    return wire


def _unit_roundoff(dtype: Any) -> float:
    return float(jnp.finfo(dtype).eps) / 2


def has_bound(num_replicas: int, wire_dtype: Any = jnp.bfloat16) -> bool:
    """Whether :func:`error_bound` exists for a group of this size (``N u < 1``)."""
    return int(num_replicas) * _unit_roundoff(_wire(wire_dtype)) < 1


def error_bound(abs_sum: Any, num_replicas: int, *, wire_dtype: Any = jnp.bfloat16, op: str = "sum") -> Any:
    """The worst-case error of a compressed all-reduce (see the module docstring).

    Valid while every operand and partial sum is finite in the wire dtype.

    Args:
      abs_sum: ``sum_i |x_i|`` over the replicas, element-wise (an array or a number).
      num_replicas: ``N``, the size of the group.
      wire_dtype: the dtype on the wire.
      op: ``'sum'`` or ``'mean'``.

    Returns:
      ``gamma_N * abs_sum + (2N - 1) eta (1 + gamma_N)`` for a sum, ``((gamma_N
      + u32 (1 + gamma_N)) * abs_sum + (2N - 1) eta (1 + gamma_N)(1 + u32)) / N
      + eta32`` for a mean, where ``gamma_N = N u / (1 - N u)``, ``u`` and
      ``eta`` are the wire dtype's unit roundoff and smallest normal number,
      ``u32`` and ``eta32`` float32's.
    """
    if op not in OPS:
        raise ValueError(f"error_bound: op must be one of {OPS}, got {op!r}.")
    wire = _wire(wire_dtype)
    u, eta = _unit_roundoff(wire), float(jnp.finfo(wire).tiny)
    n = int(num_replicas)
    if not has_bound(n, wire):
        raise ValueError(f"error_bound: the bound needs N * u < 1; N = {n}, u = {u}.")
    gamma = n * u / (1 - n * u)
    underflow = (2 * n - 1) * eta * (1 + gamma)
    if op == "sum":
        return gamma * abs_sum + underflow
    u32, eta32 = _unit_roundoff(jnp.float32), float(jnp.finfo(jnp.float32).tiny)
    return ((gamma + u32 * (1 + gamma)) * abs_sum + underflow * (1 + u32)) / n + eta32


def compressed_all_reduce(*xs: Any, op: str, group: str | None, group_size: int, wire_dtype: Any) -> list:
    """One all-reduce of ``xs`` with the float32 operands cast to ``wire_dtype``.

    Args:
      xs: the operands of one ``all_reduce``.
      op: ``'sum'`` or ``'mean'`` (all-reduced as a sum; divided afterwards).
      group: the replica group.
      group_size: its size.
      wire_dtype: the dtype float32 operands travel in.

    Returns:
      One array per operand, of the operand's dtype.
    """
    wire = [lax.convert_element_type(x, wire_dtype) if x.dtype == SOURCE_DTYPE else x for x in xs]
    summed = all_reduce_p.bind(*wire, op="sum", group=group, group_size=group_size)
    out = []
    for x, s in zip(xs, summed, strict=True):
        s = lax.convert_element_type(s, x.dtype) if s.dtype != x.dtype else s
        if op == "mean":
            s = s / jnp.asarray(group_size, s.dtype)
        out.append(s)
    return out


class CompressCommunication(Pass):
    """Cast float32 sum/mean all-reduce operands to a narrower dtype on the wire.

    Args:
      wire_dtype: the dtype the payload travels in (``jnp.bfloat16`` or
        ``jnp.float16``).
      groups: the replica groups whose all-reduces are compressed (``None``,
        ``'cores'``, ``'workers'``); e.g. ``('workers',)`` after
        ``hierarchical-allreduce`` compresses only the inter-worker step.
    """

    name = "compress-communication"
    exact = False  # bf16 on the wire

    def __init__(self, wire_dtype: Any = jnp.bfloat16, *, groups: Sequence[str | None] = GROUPS):
        self.wire_dtype = _wire(wire_dtype)
        if isinstance(groups, str) or groups is None:
            groups = (groups,)
        unknown = [g for g in groups if g not in GROUPS]
        if unknown:
            raise ValueError(f"CompressCommunication: unknown groups {unknown}; choose from {list(GROUPS)}.")
        self.groups = tuple(g for g in GROUPS if g in groups)

    def __repr__(self) -> str:
        return f"CompressCommunication(wire_dtype={self.wire_dtype.name!r}, groups={self.groups!r})"

    def is_candidate(self, eqn: JaxprEqn) -> bool:
        """A sum/mean all-reduce of the chosen groups with a float32 operand, within the bound.

        Groups of one replica (nothing is sent) and groups too large for the
        error bound (``N u >= 1``) are left alone.
        """
        return (
            eqn.primitive is all_reduce_p
            and eqn.params["op"] in OPS
            and eqn.params["group"] in self.groups
            and eqn.params["group_size"] > 1
            and has_bound(eqn.params["group_size"], self.wire_dtype)
            and any(getattr(v.aval, "dtype", None) == SOURCE_DTYPE for v in eqn.invars)
        )

    def run(self, graph: StepGraph) -> PassResult:
        def lowering(eqn: JaxprEqn) -> Any:
            params = dict(eqn.params)
            return lambda *xs: compressed_all_reduce(*xs, wire_dtype=self.wire_dtype, **params)

        return replace_placeholders(graph, self.is_candidate, lowering)
