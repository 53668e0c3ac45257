"""Metrics of a step's outputs: replica means, keyed by tree path."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

PyTree = Any


def replica_means(outputs: PyTree) -> dict[str, float]:
    """The mean over replicas of every output that has one number per replica.

    Args:
      outputs: outputs of ``Replicator.run`` (leaves with a leading replica axis).

    Returns:
      ``{name: mean}``, names joined from the tree path (``"loss"``,
      ``"metrics/accuracy"``, ``"0"``; ``"output"`` for a single array), for
      leaves of shape ``(num_replicas,)``; other leaves are left out. With
      several processes, each averages the replicas it holds.
    """
    means = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(outputs)[0]:
        if np.ndim(leaf) != 1:
            continue
        name = "/".join(_key_name(k) for k in keys) or "output"
        means[name] = float(np.mean(_local_values(leaf)))
    return means


def _local_values(leaf: Any) -> np.ndarray:
    """A leaf's values as float64 on the host; with several processes, this process's replicas."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.concatenate([np.asarray(s.data, np.float64).ravel() for s in leaf.addressable_shards])
    return np.asarray(leaf, np.float64)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)
