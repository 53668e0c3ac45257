"""A replica's step graph split over a tensor axis: one device's program, on local shapes.

:func:`split_step_graph` takes the per-replica graph a :class:`~replicator.Replicator` traced
(its cross-replica calls still placeholders) and the plan's placements of the state leaves, and
returns the graph one device of a tensor group runs: split leaves enter and leave as ``1/T``
blocks, every shape inside is local, and a collective over the tensor axis stands wherever a
consumer needs a placement its producer does not give (:mod:`replicator.tensor.interpret`). The
placeholders go through with their operands' placements (:mod:`replicator.tensor.rules`), so the
passes after it (fusion, ZeRO, lowering) work on the data axes of this graph as on any other;
they never touch the collectives over the tensor axis.

>>> import jax.numpy as jnp
>>> repl = rp.Replicator(1, 2)
>>> def step(w, x):
...     loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w["a"]) @ w["b"]))(w)
...     return jax.tree.map(lambda p, g: p - 0.1 * g, w, rp.all_mean(g)), loss
>>> w = {"a": np.ones((4, 8), np.float32), "b": np.ones((8, 2), np.float32)}
>>> graph = repl.lower(step, np.ones((2, 4), np.float32), w).traced
>>> split = split_step_graph(graph, [Shard(1), Shard(0)], size=2)
>>> [v.aval.shape for v in split.jaxpr.jaxpr.invars]  # a: columns, b: rows, the batch row whole
[(4, 4), (4, 2), (1, 4)]
>>> [c.kind for c in split.tensor.collectives]  # the loss, a partial sum, summed once (the gradients need none)
['all-reduce']

Promises:

1. The split graph's state inputs and outputs are the planned leaves' ``1/T`` blocks (the same
   placement in and out) and every other input and output is whole
   (``tests/tensor/test_replicator.py``).
2. Run on a mesh with the tensor axis, it computes what the per-replica graph computes, within
   rounding (``tests/tensor/test_replicator.py``, against one device on the global batch).
3. Placeholders stay placeholders, each with its operands' local shapes; nothing is gathered whole
   over the tensor axis unless ``allow_gather``
   (``tests/tensor/test_replicator.py::test_a_gather_the_plan_needs_is_refused_naming_the_line_and_leaf``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.extend.core import ClosedJaxpr

from replicator.core.graph import StepGraph, TensorLayout
from replicator.tensor.interpret import BATCH, run_step
from replicator.tensor.placement import REPLICATED, Placement, Shard, TensorContext, local_shape
from replicator.tensor.state_placements import infer_state_placements

__all__ = ["SplitJaxpr", "split_jaxpr", "split_step_graph"]


@dataclasses.dataclass(frozen=True)
class SplitJaxpr:
    """A closed jaxpr split for one device of a tensor group: the jaxpr on local shapes, the state leaves'
    placements (the same in and out), and the collectives over the tensor axis it holds."""

    jaxpr: ClosedJaxpr
    placements: tuple[Placement, ...]
    collectives: tuple

    def layout(self, axis: str, size: int) -> TensorLayout:
        """The :class:`~replicator.core.graph.TensorLayout` a step graph records of this split."""
        dims = tuple(p.dim if isinstance(p, Shard) else None for p in self.placements)
        return TensorLayout(axis, size, dims, self.collectives)


def split_jaxpr(
    closed: ClosedJaxpr,
    named: Sequence[Placement | None],
    names: Sequence[str],
    *,
    num_state: int,
    size: int,
    axis: str = "tensor",
    allow_gather: bool = False,
    sequence_parallel: int | None = None,
    collective_matmul: bool = False,
) -> SplitJaxpr:
    """``closed(state..., batch...) -> (new_state..., outputs...)`` as one device of a tensor group of
    ``size`` runs it. ``named``: per state leaf, the plan's placement, or ``None`` to take the placement its
    update comes out in (an optimizer's moments follow their parameter), else replicated. ``names``: each
    input's name for errors (a state leaf's path, or the batch)."""
    invars, outvars = closed.jaxpr.invars, closed.jaxpr.outvars
    n_batch = len(invars) - num_state
    shapes = [tuple(v.aval.shape) for v in invars[:num_state]]
    placements = infer_state_placements(closed.jaxpr, named, shapes, n_batch, size, sequence_parallel)
    in_pl = placements + [REPLICATED] * n_batch
    out_pl = placements + [REPLICATED] * (len(outvars) - num_state)
    ctx = TensorContext(
        axis, size, allow_gather=allow_gather, sequence_dim=sequence_parallel, collective_matmul=collective_matmul
    )

    def one_device(*args: jax.Array) -> list[jax.Array]:
        return run_step(ctx, closed, args, in_pl, out_pl, list(names))

    local = [
        jax.ShapeDtypeStruct(local_shape(tuple(v.aval.shape), p, size), v.aval.dtype)
        for v, p in zip(invars, in_pl, strict=True)
    ]
    split = jax.make_jaxpr(one_device, axis_env=[(axis, size)])(*local)
    return SplitJaxpr(split, tuple(placements), tuple(ctx.events))


def split_step_graph(
    graph: StepGraph,
    named: Sequence[Placement | None],
    *,
    size: int,
    axis: str = "tensor",
    allow_gather: bool = False,
    sequence_parallel: int | None = None,
    collective_matmul: bool = False,
) -> StepGraph:
    """``graph`` as one device of a tensor group of ``size`` runs it (:func:`split_jaxpr` of its jaxpr).

    ``named``: per state leaf, the plan's placement, or ``None`` (see :func:`split_jaxpr`).
    ``sequence_parallel``, ``collective_matmul``: as for :class:`~replicator.tensor.TensorParallel`.
    """
    names = list(graph.state_paths) + [BATCH] * graph.num_batch
    split = split_jaxpr(
        graph.jaxpr,
        named,
        names,
        num_state=graph.num_state,
        size=size,
        axis=axis,
        allow_gather=allow_gather,
        sequence_parallel=sequence_parallel,
        collective_matmul=collective_matmul,
    )
    return dataclasses.replace(graph, jaxpr=split.jaxpr, tensor=split.layout(axis, size))
