"""The compile-cache key of a step's state, and the state a step returned, recognized when it comes back.

Every ``Replicator.run`` looks its compiled step up by ``(step_fn, state key, batch key, passes)``: the
state's key is its structure and each leaf's shape and dtype (a non-array leaf, such as an Equinox module's
function, is compiled in: its key is the object), hashed once (:class:`StateKey`). The state the last call
returned is held weakly (:class:`ReturnedState`); given back as the next call's state it is recognized by
identity, so its leaves are neither signed nor placed again.

>>> key, leaves, treedef = state_key_of({"w": np.zeros((2, 3), np.float32), "act": "tanh"})
>>> key.value[2]  # the signature of each leaf: the static string is its own key
(('tanh',), ((2, 3), dtype('float32')))
>>> state_key_of(None)[0] is NO_STATE
True
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import jax
import numpy as np

from replicator.core.tracing import is_array_leaf, leaf_paths, leaf_signature, signature_spec
from replicator.runtime.state import per_replica_flags, with_per_replica
from replicator.runtime.steady import _deref

__all__ = [
    "NO_STATE",
    "ReturnedState",
    "StateKey",
    "array_leaves",
    "merge_static",
    "per_replica_key",
    "state_key_of",
    "state_spec",
]

PyTree = Any


class _Static(tuple):
    """The cache-key entry of a non-array state leaf: the object itself."""


def _state_signature(leaf: Any, treedef: Any, index: int) -> Any:
    """Shape and dtype of an array leaf; a non-array leaf (an Equinox module's function) is static."""
    if is_array_leaf(leaf):
        signature = leaf_signature(leaf)
        if isinstance(leaf, int):  # a Python int becomes the default integer dtype (int32 without x64)
            info = np.iinfo(signature[1])
            if not info.min <= leaf <= info.max:
                raise OverflowError(
                    f"{_leaf_path(treedef, index)} is the Python int {leaf}, which does not fit in "
                    f"{signature[1]} (the integer dtype JAX uses here; it would wrap around silently). Pass "
                    f"an array of a wide enough dtype with jax_enable_x64, or keep it outside the state."
                )
        return signature
    try:
        hash(leaf)
    except TypeError:
        raise TypeError(
            f"{_leaf_path(treedef, index)} is a {type(leaf).__name__}, neither an array nor a hashable static value. State leaves are "
            "arrays (sent to every replica) or hashable Python objects compiled into the step (functions, "
            "strings); convert it to an array, or keep it out of the state (eqx.partition(model, eqx.is_array))."
        ) from None
    return _Static((leaf,))


class StateKey:
    """The compile-cache key of a step's state: ``(has_state, treedef, leaf signatures)``, hashed once."""

    __slots__ = ("_hash", "value")

    def __init__(self, has_state: bool, treedef: Any, signatures: tuple):
        self.value = (has_state, treedef, signatures)
        self._hash = hash(self.value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, StateKey) and self._hash == other._hash and self.value == other.value
        )


NO_STATE = StateKey(False, None, ())


def state_key_of(state: PyTree | None) -> tuple[StateKey, list, Any]:
    """``(key, leaves, treedef)`` of a step's state; the checks of each leaf raise here."""
    if state is None:
        return NO_STATE, [], None
    leaves, treedef = jax.tree.flatten(state)
    return (
        StateKey(True, treedef, tuple(_state_signature(leaf, treedef, i) for i, leaf in enumerate(leaves))),
        leaves,
        treedef,
    )


class ReturnedState:
    """The state the last ``run`` returned (arrays held weakly), recognized when it comes back as the next
    call's state: its arrays are then on the mesh already and its key is known, so neither is worked out
    again for every leaf."""

    __slots__ = ("arrays", "compiled", "key", "n", "sharded_state", "statics", "treedef")

    def __init__(
        self,
        key: StateKey,
        treedef: Any,
        arrays: list,
        statics: tuple,
        n: int,
        sharded_state: frozenset[int],
        compiled: Any = None,
    ):
        self.key, self.treedef, self.statics, self.n, self.sharded_state = key, treedef, statics, n, sharded_state
        self.compiled = compiled  # the step that returned it
        self.arrays = list(map(weakref.ref, arrays))

    def match(self, leaves: list, treedef: Any) -> list | None:
        """The array leaves of ``leaves`` if they are this state's, else None."""
        if treedef != self.treedef or len(leaves) != self.n:
            return None
        if self.statics:
            if any(leaves[i] is not value for i, value in self.statics):
                return None
            static = dict(self.statics)
            leaves = [leaf for i, leaf in enumerate(leaves) if i not in static]
        if len(leaves) != len(self.arrays) or not all(map(operator.is_, map(_deref, self.arrays), leaves)):
            return None
        return leaves


def merge_static(arrays: list, statics: tuple, n: int) -> list:
    """All of the state's leaves: the step's new arrays with the static leaves at their places."""
    if not statics:
        return arrays
    by_index = dict(statics)
    it = iter(arrays)
    return [by_index[i] if i in by_index else next(it) for i in range(n)]


def _leaf_path(treedef: Any, index: int) -> str:
    return leaf_paths(treedef.unflatten(range(treedef.num_leaves)), "state")[index]


def state_spec(signature: Any) -> Any:
    return signature[0] if isinstance(signature, _Static) else signature_spec(signature)


def array_leaves(leaves: list, statics: tuple) -> list:
    """The state's array leaves (its static leaves left out)."""
    if not statics:
        return leaves
    static = dict(statics)
    return [leaf for i, leaf in enumerate(leaves) if i not in static]


def per_replica_key(state_key: StateKey, state: PyTree, per_replica_state: Any, num_replicas: int) -> StateKey:
    """``state_key`` with the leaves ``per_replica_state`` declares kept per replica marked
    (``Replicator.run``'s ``per_replica_state``)."""
    if per_replica_state is None or state is None:
        return state_key
    has_state, treedef, signatures = state_key.value
    flags = per_replica_flags(state, per_replica_state, num_replicas)
    return StateKey(has_state, treedef, with_per_replica(signatures, flags))
