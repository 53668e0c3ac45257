"""Tensor parallelism of a one-device training step, from a plan.

:class:`TensorParallel` traces ``step(state, batch) -> (new_state, aux)`` on
the global shapes, decides every state leaf's placement over the tensor axis
(the plan's, then, for the leaves it does not name, the placement their update
comes out in: an optimizer's moments follow their parameter), and runs the
step under ``jit(shard_map(...))`` with each device holding ``1/T`` of every
split leaf, through the rewrite of :mod:`replicator.tensor.interpret`.

>>> import jax, jax.numpy as jnp
>>> def step(w, x):
...     loss = lambda w: jnp.mean(jnp.tanh(x @ w["fc1"]) @ w["fc2"])
...     g = jax.grad(loss)(w)
...     return jax.tree.map(lambda p, g: p - 0.1 * g, w, g), loss(w)
>>> tp = TensorParallel(step, TensorPlan({"fc1": "column", "fc2": "row"}), size=2)
>>> w = {"fc1": jnp.ones((4, 8)) / 8, "fc2": jnp.ones((8, 2)) / 8}
>>> new_w, loss = tp(tp.shard(w), jnp.ones((3, 4)))
>>> [(c.kind, c.shape) for c in tp.collectives(w, jnp.ones((3, 4)))]  # the loss, summed once
[('all-reduce', ())]

Promises:

1. ``tp(state, batch)`` equals ``jax.jit(step)(state, batch)`` on one device
   within rounding (``tests/tensor/test_parallelize.py``, T = 2 and 4).
2. Split leaves are held ``1/T`` per device, in and out.
3. No value is gathered whole over the tensor axis unless ``allow_gather``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replicator.cost.collectives import tensor_sent_bytes
from replicator.tensor.auto import as_plan, resolve_plan
from replicator.tensor.interpret import BATCH, run_step
from replicator.tensor.placement import (
    REPLICATED,
    Collective,
    Placement,
    Shard,
    TensorContext,
    TensorPlacementError,
)
from replicator.tensor.plan import TensorPlan, leaf_paths
from replicator.tensor.state_placements import infer_state_placements

__all__ = ["TensorParallel", "infer_state_placements", "sent_bytes"]


def sent_bytes(c: Collective, size: int) -> float:
    """Bytes one device sends for ``c`` (:func:`~replicator.cost.collectives.tensor_sent_bytes`)."""
    return tensor_sent_bytes(c.kind, c.nbytes, size)


def _spec(p: Placement, ndim: int, axis: str) -> PartitionSpec:
    if isinstance(p, Shard):
        return PartitionSpec(*[axis if d == p.dim else None for d in range(ndim)])
    return PartitionSpec()


def _signature(leaves: list, tree: Any) -> tuple:
    """The cache key of a call: the pytree's structure and each leaf's shape and dtype.

    Arrays (jax's, NumPy's, ``ShapeDtypeStruct``) in one comprehension of attribute reads, no
    Python call per leaf: this runs on every step."""
    try:
        return tree, tuple([(x.shape, x.dtype) for x in leaves])
    except AttributeError:  # a Python scalar among the leaves
        return tree, tuple((np.shape(x), getattr(x, "dtype", None) or np.result_type(x)) for x in leaves)


class TensorParallel:
    """``step(state, batch) -> (new_state, aux)`` run split over a tensor axis of ``size`` devices.

    ``allow_gather``: let the rewrite gather a split value whole where a consumer needs it.
    ``sequence_parallel``: the dimension of the activations that is their sequence (``1`` for
    ``(batch, sequence, hidden)``): between the tensor-parallel regions activations are split on it
    (Megatron's sequence parallelism: each all-reduce becomes a reduce-scatter there and an all-gather
    before the next column-parallel matmul); ``None``: off.
    ``collective_matmul``: an all-gather feeding a matmul and a matmul's output reduce-scattered (sequence
    parallelism's, where the gathered or scattered dimension is a free one of the product) become rings
    of ``size`` partial matmuls and ``ppermute`` (:mod:`replicator.tensor.overlap`).
    """

    def __init__(
        self,
        step: Callable[[Any, Any], tuple[Any, Any]],
        plan: TensorPlan | dict,
        *,
        size: int,
        devices: Sequence[Any] | None = None,
        axis: str = "tensor",
        allow_gather: bool = False,
        sequence_parallel: int | None = None,
        collective_matmul: bool = False,
    ):
        self.step = step
        self.sequence_parallel = sequence_parallel
        self.collective_matmul = collective_matmul
        self.plan = as_plan(plan)
        self.size = size
        devices = list(devices if devices is not None else jax.devices())
        if len(devices) < size:
            raise TensorPlacementError(
                f"a tensor degree of {size} needs {size} devices; there are {len(devices)}.\n"
                f"Fix: lower the degree, or on CPU emulate devices with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={size}."
            )
        self.mesh = Mesh(np.array(devices[:size]), (axis,))
        self.axis = axis
        self.allow_gather = allow_gather
        self._built: dict[Any, tuple] = {}

    # -- building ------------------------------------------------------------------------

    def _build(self, state: Any, batch: Any, key: tuple | None = None) -> tuple:
        if key is None:
            key = _signature(*jax.tree_util.tree_flatten((state, batch)))
        if key in self._built:
            return self._built[key]
        closed, out_shape = jax.make_jaxpr(self.step, return_shape=True)(state, batch)
        state_leaves, state_tree = jax.tree_util.tree_flatten(state)
        n_state, n_batch = len(state_leaves), len(jax.tree_util.tree_leaves(batch))
        new_state_tree = jax.tree_util.tree_structure(out_shape[0])
        if new_state_tree != state_tree:
            raise TensorPlacementError(
                f"the step must return (new_state, aux) with new_state of the state's structure; it "
                f"returned {new_state_tree} for {state_tree}."
            )
        shapes = [np.shape(x) for x in state_leaves]
        names = leaf_paths(state) + [BATCH] * n_batch
        plan, sequence_parallel, collective_matmul = self._resolve(closed, names, n_state)
        named = plan.placements(state, self.size)
        pl = infer_state_placements(closed.jaxpr, named, shapes, n_batch, self.size, sequence_parallel)
        ctx = TensorContext(
            self.axis,
            self.size,
            allow_gather=self.allow_gather,
            sequence_dim=sequence_parallel,
            collective_matmul=collective_matmul,
        )
        n_out = len(closed.jaxpr.outvars)
        out_pl = pl + [REPLICATED] * (n_out - n_state)

        def local_step(*args: Any) -> list:
            return run_step(ctx, closed, args, pl + [REPLICATED] * n_batch, out_pl, names)

        in_specs = [_spec(p, len(s), self.axis) for p, s in zip(pl, shapes, strict=True)]
        in_specs += [PartitionSpec()] * n_batch
        out_avals = [v.aval for v in closed.jaxpr.outvars]
        out_specs = [_spec(p, len(a.shape), self.axis) for p, a in zip(out_pl, out_avals, strict=True)]
        mapped = jax.shard_map(
            local_step, mesh=self.mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False
        )
        fn = jax.jit(mapped)
        out_tree = jax.tree_util.tree_structure(out_shape)
        built = (fn, pl, ctx, out_tree, state_tree)
        self._built[key] = built
        return built

    def _resolve(self, closed: Any, names: list[str], n_state: int) -> tuple[Any, int | None, bool]:
        return resolve_plan(
            self.plan,
            closed,
            names,
            num_state=n_state,
            size=self.size,
            sequence_parallel=self.sequence_parallel,
            allow_gather=self.allow_gather,
            collective_matmul=self.collective_matmul,
        )

    # -- the user's calls -----------------------------------------------------------------

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        # One flatten per call, and a cache key of shapes and dtype objects (no str() of a dtype per
        # leaf): at 27 leaves this was 105 us of Python per call on top of the jitted call.
        leaves, tree = jax.tree_util.tree_flatten((state, batch))
        key = _signature(leaves, tree)
        built = self._built.get(key) or self._build(state, batch, key)
        return jax.tree_util.tree_unflatten(built[3], built[0](*leaves))

    def placements(self, state: Any, batch: Any) -> dict[str, Placement]:
        """Each state leaf's placement over the tensor axis, by path."""
        _, pl, _, _, _ = self._build(state, batch)
        return dict(zip(leaf_paths(state), pl, strict=True))

    def shard(self, state: Any, batch: Any = None) -> Any:
        """``state`` placed on the mesh as the step holds it (split leaves 1/T per device)."""
        if batch is None:
            pl = [p or REPLICATED for p in self.plan.placements(state, self.size)]
        else:
            pl = self._build(state, batch)[1]
        leaves, tree = jax.tree_util.tree_flatten(state)
        placed = [
            jax.device_put(x, NamedSharding(self.mesh, _spec(p, np.ndim(x), self.axis)))
            for x, p in zip(leaves, pl, strict=True)
        ]
        return jax.tree_util.tree_unflatten(tree, placed)

    def lower(self, state: Any, batch: Any) -> Any:
        """The step lowered for these shapes (``jax.stages.Lowered``: ``.as_text()``, ``.compile()``)."""
        fn = self._build(state, batch)[0]
        return fn.lower(*jax.tree_util.tree_leaves((state, batch)))

    def explain(self, state: Any, batch: Any) -> str:
        """What the plan does to this step: each leaf's placement, every collective over the tensor
        axis with its source line, reason and bytes a device sends, and XLA's memory per device.

        >>> import jax.numpy as jnp
        >>> tp = TensorParallel(lambda p, x: (p, jnp.sum(x @ p["w"])), {"w": "column"}, size=2)
        >>> print(tp.explain({"w": jnp.ones((4, 8))}, jnp.ones((2, 4))))  # doctest: +ELLIPSIS
        tensor parallelism over 'tensor' (T = 2)
        leaves split: w S(1)
        collectives (per step, in program order; bytes a device sends, ring algorithm):
          all-reduce    float32[]  4 B  the step's outputs  returning it in its placement
        memory per device (XLA): arguments ...
        """
        placements = self.placements(state, batch)
        split = [f"{path} {p!r}" for path, p in placements.items() if isinstance(p, Shard)]
        lines = [
            f"tensor parallelism over '{self.axis}' (T = {self.size})",
            "leaves split: " + ", ".join(split or ["none"]),
        ]
        lines.append("collectives (per step, in program order; bytes a device sends, ring algorithm):")
        for c in self.collectives(state, batch):
            shape = ",".join(map(str, c.shape))
            lines.append(f"  {c.kind:<13} {c.dtype}[{shape}]  {sent_bytes(c, self.size):.0f} B  {c.line}  {c.reason}")
        memory = self.lower(state, batch).compile().memory_analysis()
        if memory is not None:
            lines.append(
                f"memory per device (XLA): arguments {memory.argument_size_in_bytes} B, outputs "
                f"{memory.output_size_in_bytes} B, temporaries {memory.temp_size_in_bytes} B"
            )
        return "\n".join(lines)

    def collectives(self, state: Any, batch: Any) -> list[Collective]:
        """Every collective over the tensor axis the rewrite inserts (traced once, in program order)."""
        self.lower(state, batch)
        return list(self._build(state, batch)[2].events)
