"""Leaves <-> stored arrays: manifest entries, dtypes, PRNG keys, host copies, placement.

Promises:

1. A leaf of any dtype JAX holds (bool, int8 to uint32, float16, bfloat16, float32, complex64, float8) and any
   shape, 0-d included, on a device or not, comes back from its stored array with its own dtype, shape and bits;
   the stored array is of a numpy builtin dtype, which ``.npz`` holds without pickle
   (tests/test_checkpoint.py::test_a_leaf_round_trips_through_its_stored_array_with_its_dtype_shape_and_bits,
   tests/test_checkpoint.py::TestRoundTrip::test_pytrees_dtypes_and_extra).
2. bfloat16, float8 and the other ``ml_dtypes`` are stored as the unsigned ints of their width, named by the
   entry's ``stored_as`` (tests/test_checkpoint.py::TestRoundTrip::test_the_files_are_plain_npz_and_json).
3. A Python number or a 64-bit leaf gets JAX's canonical dtype (float32, int32 without x64)
   (tests/test_checkpoint.py::TestRoundTrip::test_python_numbers_get_jax_dtypes).
4. A typed PRNG key is stored as its key data with its implementation and comes back a typed key that draws the
   same numbers (tests/test_checkpoint.py::TestRoundTrip::test_prng_keys).
5. A leaf that is not an array of numbers or booleans (a string, an array of strings) is a CheckpointError naming
   its path, raised before anything is written (tests/test_checkpoint.py::TestManager::test_bad_arguments).
6. A checkpoint whose tree paths differ from the target's is a CheckpointError naming the first missing and the
   first unexpected leaf and the counts; a leaf of another shape or dtype is one naming the leaf and both specs
   (tests/test_checkpoint.py::TestRestoreChecks::test_another_model,
   tests/test_checkpoint.py::TestRestoreChecks::test_shape_mismatch_names_the_leaf,
   tests/test_checkpoint.py::TestRestoreChecks::test_dtype_mismatch).
7. A restored leaf is a numpy array where the target leaf has no sharding, else an array on the target's sharding
   (tests/test_checkpoint.py::TestRoundTrip::test_target_of_shape_dtype_structs_gives_numpy,
   tests/test_checkpoint.py::TestRoundTrip::test_target_arrays_give_arrays_on_their_sharding).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or restored; the message says why and the fix."""


def is_key(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key dtype (``jax.random.key``)."""
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


def leaf_spec(leaf: Any) -> tuple[tuple[int, ...], str]:
    """Shape and dtype name of a state or target leaf, as the manifest records them.

    Python numbers get JAX's canonical dtype (``1.0`` -> float32 without x64),
    as :class:`~replicator.Replicator` gives them.
    """
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        shape, dtype = tuple(leaf.shape), leaf.dtype
    else:
        shape, dtype = np.shape(leaf), np.result_type(leaf)
    if is_key(dtype):
        return shape, str(dtype)
    return shape, jnp.dtype(jax.dtypes.canonicalize_dtype(dtype)).name


def to_host(leaf: Any, fetch: bool = True) -> np.ndarray | None:
    """A numpy copy of a state leaf: its whole, global value.

    A leaf sharded over several processes is gathered with
    ``process_allgather``, a collective in which every process must take
    part; ``fetch=False`` (a process that does not write) takes part in that
    but copies nothing else and returns None. A replicated leaf that spans
    processes is read from this process's first shard, without communication.
    """
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if leaf.is_fully_replicated:
            if not fetch:
                return None
            leaf = leaf.addressable_data(0)
        else:
            from jax.experimental import multihost_utils

            leaf = multihost_utils.process_allgather(leaf, tiled=True)  # the global value, on every process
            if not fetch:
                return None
    elif not fetch:
        return None
    _, dtype = leaf_spec(leaf)
    return np.asarray(leaf).astype(jnp.dtype(dtype), copy=False)


def entry(path: str, leaf: Any) -> dict[str, Any]:
    """The manifest entry of one state leaf; raises if it cannot be saved. No data is copied."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and is_key(dtype):
        return {
            "path": path,
            "shape": list(leaf.shape),
            "dtype": str(dtype),
            "key_impl": str(jax.random.key_impl(leaf)),
        }
    try:
        shape, name = leaf_spec(leaf)
        numeric = jnp.dtype(name).kind in "biufcV"
    except (TypeError, ValueError):
        numeric = False
    if not numeric:
        raise CheckpointError(
            f"state{path} is of type {type(leaf).__name__}{'' if dtype is None else f' and dtype {dtype}'}; "
            f"checkpoints hold arrays of numbers or booleans. Keep other values out of the state "
            f"(JSON-serializable ones can go in extra=)."
        )
    result: dict[str, Any] = {"path": path, "shape": list(shape), "dtype": name}
    if jnp.dtype(name).isbuiltin != 1:  # bfloat16, float8, int4, ...: not storable in .npz without pickle
        result["stored_as"] = np.dtype(f"u{jnp.dtype(name).itemsize}").name
    return result


def stored(leaf: Any, entry: Mapping[str, Any], fetch: bool = True) -> np.ndarray | None:
    """The array to store for a leaf and its entry (None where ``fetch=False``; see :func:`to_host`)."""
    if "key_impl" in entry:
        return to_host(jax.random.key_data(leaf), fetch)
    host = to_host(leaf, fetch)
    if host is not None and "stored_as" in entry:
        host = host.view(np.dtype(entry["stored_as"]))
    return host


def stored_dtype(entry: Mapping[str, Any]) -> str:
    """The dtype name of the array stored for a manifest entry."""
    return entry.get("stored_as", "uint32" if "key_impl" in entry else entry["dtype"])


def decode(array: np.ndarray, entry: Mapping[str, Any]) -> Any:
    """The leaf a stored array and its manifest entry describe."""
    if "key_impl" in entry:
        return jax.random.wrap_key_data(array, impl=entry["key_impl"])
    if "stored_as" in entry:
        return array.view(jnp.dtype(entry["dtype"]))
    return array


def _describe(shape: Any, dtype: str) -> str:
    return f"{tuple(shape)} {dtype}"


def check_structure(path: str, entries: list[dict[str, Any]], target_flat: list[tuple[Any, Any]]) -> None:
    """Raise a CheckpointError naming the first leaf where a checkpoint and the target differ."""
    saved = [e["path"] for e in entries]
    expected = [jax.tree_util.keystr(keys) for keys, _ in target_flat]
    if saved != expected:
        missing = [p for p in expected if p not in set(saved)]
        unexpected = [p for p in saved if p not in set(expected)]
        parts = []
        if missing:
            parts.append(f"the model expects state{missing[0]}, which the checkpoint lacks")
        if unexpected:
            parts.append(f"the checkpoint has state{unexpected[0]}, which the model lacks")
        if not parts:
            i = next(i for i, (a, b) in enumerate(zip(saved, expected, strict=True)) if a != b)
            parts.append(f"array {i} is state{saved[i]} in the checkpoint but state{expected[i]} in the model")
        raise CheckpointError(
            f"checkpoint {path} does not match the model's state: {'; '.join(parts)} ({len(saved)} arrays "
            f"saved, {len(expected)} expected). It was written for a different model or state structure; "
            f"restore it with the state it was saved from, or start from a fresh directory."
        )
    for e, (_, target) in zip(entries, target_flat, strict=True):
        shape, dtype = leaf_spec(target)
        if tuple(e["shape"]) != shape or e["dtype"] != dtype:
            raise CheckpointError(
                f"checkpoint {path} has state{e['path']} of shape {_describe(e['shape'], e['dtype'])} "
                f"but the model expects {_describe(shape, dtype)}."
            )


def target_sharding(target: Any) -> Any:
    """The sharding a restored leaf goes on: ``target``'s, if it has one."""
    return getattr(target, "sharding", None) if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)) else None


def place_like(leaf: Any, sharding: Any) -> Any:
    """``leaf`` on ``sharding`` if there is one, else as it is.

    On a sharding that spans processes each process fills its own devices
    from its copy of the leaf (every process read the same checkpoint).
    """
    if sharding is None:
        return leaf
    if not sharding.is_fully_addressable:
        return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])
    return jax.device_put(leaf, sharding)
