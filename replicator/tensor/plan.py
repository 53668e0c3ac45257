"""A tensor-parallel plan: which parameters are split over the tensor axis, and how.

A plan maps glob patterns over the state pytree's paths (keys joined by ``/``)
to a style, in the torchtitan way but without parallel layer classes: the
model code stays the one-device code.

* ``"column"``: split the last dimension (a dense layer's outputs; its bias);
* ``"row"``: split the second-to-last dimension (a dense layer's inputs);
* ``"replicated"``: every device holds the whole leaf;
* an ``int`` ``d``: split dimension ``d``.

In a pattern ``*`` matches within one path component and ``**`` any number of
whole components; the first pattern that matches a leaf decides. A leaf no
pattern names is replicated, except that the tensor-parallel rewrite keeps an
unnamed leaf split where the step's update of it comes out split (an
optimizer's moments of a split parameter, a split layer's bias).

>>> import numpy as np
>>> plan = TensorPlan({"mlp/fc1/kernel": "column", "mlp/fc2/kernel": "row"})
>>> state = {"mlp": {"fc1": {"kernel": np.zeros((8, 32))}, "fc2": {"kernel": np.zeros((32, 8))}}}
>>> plan.placements(state, size=4)
[S(1), S(0)]

Promises:

1. Every pattern of the plan matches at least one leaf, else
   :class:`~replicator.tensor.placement.TensorPlacementError` lists the paths
   there are (``tests/tensor/test_plan.py``).
2. A split dimension not divisible by the tensor degree is refused, naming the
   leaf, its shape and the degree.
3. A leaf no pattern names gets ``None`` (the rewrite decides, replicated
   unless its update comes out split).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from replicator.tensor.placement import REPLICATED, Placement, Shard, TensorPlacementError

__all__ = ["STYLES", "TensorPlan", "leaf_paths"]

STYLES = ("column", "row", "replicated")


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_paths(tree: Any) -> list[str]:
    """Each leaf's path: its keys joined by ``/`` (``"params/Dense_0/kernel"``)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return ["/".join(_key_name(k) for k in path) for path, _ in leaves]


def _match(pattern: Sequence[str], path: Sequence[str]) -> bool:
    if not pattern:
        return not path
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match(rest, path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], head) and _match(rest, path[1:])


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """Glob patterns over state paths -> a style (``"column"``, ``"row"``, ``"replicated"`` or a dimension)."""

    rules: Mapping[str, str | int]

    def __post_init__(self) -> None:
        for pattern, style in self.rules.items():
            if not (isinstance(style, int) and not isinstance(style, bool) or style in STYLES):
                raise TensorPlacementError(
                    f"the plan gives {pattern!r} the style {style!r}; a style is one of {STYLES} or a "
                    f"dimension (an int)."
                )

    def style_of(self, path: str) -> str | int | None:
        parts = path.split("/")
        for pattern, style in self.rules.items():
            if _match(pattern.split("/"), parts):
                return style
        return None

    def placements(self, state: Any, size: int) -> list[Placement | None]:
        """Each state leaf's placement at tensor degree ``size`` (``None``: not named)."""
        paths = leaf_paths(state)
        leaves = jax.tree_util.tree_leaves(state)
        used: set[str] = set()
        out: list[Placement | None] = []
        for path, leaf in zip(paths, leaves, strict=True):
            style = self.style_of(path)
            if style is None:
                out.append(None)
                continue
            used.update(p for p in self.rules if _match(p.split("/"), path.split("/")))
            out.append(_placement(path, np.shape(leaf), style, size))
        unused = [p for p in self.rules if p not in used]
        if unused:
            shown = ", ".join(paths[:12]) + (", ..." if len(paths) > 12 else "")
            raise TensorPlacementError(
                f"the plan's pattern(s) {unused} match no leaf of the state. Its leaves are: {shown}.\n"
                f"Fix: write the pattern over these paths ('*' matches one component, '**' several)."
            )
        return out


def _placement(path: str, shape: tuple[int, ...], style: str | int, size: int) -> Placement:
    if style == "replicated":
        return REPLICATED
    ndim = len(shape)
    dim = {"column": ndim - 1, "row": ndim - 2}.get(style, style) if isinstance(style, str) else style
    if isinstance(style, int) and dim < 0:
        dim += ndim
    if not 0 <= dim < ndim:
        raise TensorPlacementError(
            f"the plan splits {path!r} (shape {shape}) {style!r}, which names dimension {dim}: it has "
            f"{ndim}. Fix: 'column' splits the last dimension, 'row' the second-to-last (a matrix)."
        )
    if shape[dim] % size:
        raise TensorPlacementError(
            f"the plan splits {path!r} (shape {shape}) on dimension {dim} of size {shape[dim]}, which "
            f"the tensor degree {size} does not divide.\nFix: choose a degree that divides it, or leave "
            f"this leaf out of the plan (replicated)."
        )
    return Shard(dim)
