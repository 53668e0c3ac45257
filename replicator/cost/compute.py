"""Compute cost model: a rough time for a step graph's own work, without its collectives.

The communication model (:mod:`replicator.cost.collectives`) sees only
collectives. Some pass options trade communication for compute or the other
way round: ``shard-optimizer-update`` (ZeRO-1) makes every device update
``1/N`` of the parameters at the price of an all-gather, and fusion adds the
copies that pack and unpack its buckets. :class:`AutoPassManager
<replicator.cost.auto.AutoPassManager>` adds this model's time to the
communication time when its topology has a :class:`Compute`.

The model is a count, per device, over the equations of the lowered graph:

=======================================  ===========================================
``dot_general``, ``conv_general_dilated``  ``2 x`` multiply-adds ``x seconds_per_flop``
reductions, cumulative ops, ``sort``       input elements ``x seconds_per_element``
``dynamic_update_slice``, ``scatter``      update elements (in place)
collectives, ``axis_index``                ``0`` (the communication model's)
reshapes, broadcasts, ``iota``             ``0`` (XLA folds them into their users)
every other equation                       output elements ``x seconds_per_element``
=======================================  ===========================================

Sub-graphs: a call counts its body once, ``scan`` its body ``length`` times,
``while`` its body and condition once (the trip count is not in the graph),
``cond`` its most expensive branch. ``seconds_per_element`` is the cost of
one element-wise operation inside a loop XLA fused (what :func:`~replicator.tools.calibrate.calibrate_compute`
measures), so a chain of ``k`` element-wise equations on ``n`` elements costs
``k n seconds_per_element`` whether or not XLA fuses it. What it does not
model: memory traffic that fusion saves or a layout change costs, the overlap
of compute with communication, and the launch overhead per kernel.

>>> import jax, jax.numpy as jnp
>>> jaxpr = jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w) * 2.0)(jnp.ones((64, 32)), jnp.ones((8, 64)))
>>> fast = Compute(seconds_per_element=1e-9, seconds_per_flop=1e-12, source="an example")
>>> round(compute_time(jaxpr.jaxpr, fast) * 1e9)  # 2*8*64*32 flops * 1 ps + 2 ops * 8*32 elements * 1 ns
545
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn

from replicator.core.jaxprs import CALL_PARAMS, open_jaxpr, sub_jaxprs

__all__ = ["Compute", "compute_time", "equation_time"]


@dataclasses.dataclass(frozen=True)
class Compute:
    """One device's speed at a step's own work (see the module docstring).

    Attributes:
      seconds_per_element: one element-wise operation on one element.
      seconds_per_flop: one floating-point operation of a matrix product
        (a multiply-add is 2).
      source: where the figures come from.
    """

    seconds_per_element: float
    seconds_per_flop: float
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("seconds_per_element", "seconds_per_flop"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Compute.{name} must be a finite number >= 0 (seconds), got {value!r}.")

    def __str__(self) -> str:
        return (
            f"{1e-9 / self.seconds_per_element if self.seconds_per_element else math.inf:.3g} G element-ops/s, "
            f"{1e-12 / self.seconds_per_flop if self.seconds_per_flop else math.inf:.3g} TFLOP/s"
        )


#: Equations XLA turns into no work of their own (layout, broadcasting, constants).
FREE = frozenset(
    ["reshape", "squeeze", "expand_dims", "broadcast_in_dim", "iota", "stop_gradient", "device_put", "copy_p"]
)
#: Equations the communication model costs.
COMMUNICATION = frozenset(
    [
        "psum",
        "pmax",
        "pmin",
        "psum_invariant",
        "all_gather",
        "all_gather_invariant",
        "reduce_scatter",
        "psum_scatter",
        "ppermute",
        "all_to_all",
        "axis_index",
        "pbroadcast",
        "pvary",
    ]
)
#: Equations that read every element of their input to write fewer (or as many).
READ_ALL = frozenset(["argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort"])


#: Equations XLA performs in place: only the update (this operand) is written.
IN_PLACE = {"dynamic_update_slice": 1, "scatter": 2, "scatter-add": 2, "scatter_add": 2}


def _size(aval) -> int:
    shape = getattr(aval, "shape", ())
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def _matmul_flops(eqn: JaxprEqn) -> float:
    out = _size(eqn.outvars[0].aval)
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    if eqn.primitive.name == "dot_general":
        (contract_lhs, _), _ = eqn.params["dimension_numbers"]
        depth = int(np.prod([lhs.shape[d] for d in contract_lhs], dtype=np.int64)) if contract_lhs else 1
    else:  # conv_general_dilated: each output element sums kernel-window x input-feature products
        out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        depth = _size(rhs) // max(1, rhs.shape[out_feature_dim])
    return 2.0 * out * depth


def equation_time(eqn: JaxprEqn, compute: Compute) -> float:
    """The model's seconds for one equation, its sub-graphs included."""
    name = eqn.primitive.name
    if name in COMMUNICATION or name.startswith("rp_") or name in FREE:
        return 0.0
    if name in ("dot_general", "conv_general_dilated"):
        return _matmul_flops(eqn) * compute.seconds_per_flop
    if name == "scan":
        return eqn.params["length"] * compute_time(open_jaxpr(eqn.params["jaxpr"]), compute)
    if name == "cond":
        return max(compute_time(open_jaxpr(b), compute) for b in eqn.params["branches"])
    if name in CALL_PARAMS or name == "while" or any(True for _ in sub_jaxprs(eqn.params)):
        return sum(compute_time(sub, compute) for sub in sub_jaxprs(eqn.params))
    if name in IN_PLACE:  # XLA writes the update into the buffer it was given
        elements = _size(eqn.invars[IN_PLACE[name]].aval)
    elif name.startswith("reduce_") or name in READ_ALL:
        elements = max((_size(v.aval) for v in eqn.invars), default=1)
    else:
        elements = sum(_size(v.aval) for v in eqn.outvars)
    return elements * compute.seconds_per_element


def compute_time(jaxpr: Jaxpr, compute: Compute) -> float:
    """The model's seconds for every equation of ``jaxpr`` on one device."""
    return sum(equation_time(eqn, compute) for eqn in jaxpr.eqns)
