"""Checkpoints from and for orbax: restore an orbax checkpoint as a state, export a state as one.

Flax, MaxText, T5X and most JAX code save with ``orbax.checkpoint``; this
module reads such a checkpoint into the state of a
:class:`~replicator.Replicator` run and writes a state as a checkpoint
that plain orbax restores. It needs the optional extra
(``pip install 'replicator[orbax]'``); orbax is imported on the first call,
never by ``import replicator``.

:func:`restore_orbax` reads a checkpoint that ``ocp.StandardCheckpointer``
or ``ocp.PyTreeCheckpointer`` saved (sharded or not, on any devices), or a
step of an ``ocp.CheckpointManager`` directory, into the structure of a
target state, as :func:`~replicator.restore_checkpoint` does: each leaf is
matched by its tree path (a dict key, attribute name or sequence index: a
Flax ``TrainState``'s ``opt_state[0].mu['Dense_0']['kernel']`` is orbax's
``opt_state.0.mu.Dense_0.kernel``), checked against the checkpoint's
metadata (a missing or unexpected leaf, another shape or dtype is a
:class:`~replicator.CheckpointError` naming it, raised before any array is
read), read to the host and placed like a restored leaf of replicator's
own format (:func:`~.encoding.place_like`): whole, or on the target leaf's
sharding, which is how a state lands on a ZeRO layout, another replica count
or a folded one.

:func:`export_orbax` writes a state with ``ocp.StandardCheckpointer``,
every leaf whole as a host array (a ZeRO-sharded leaf gathered first), so
that ``ocp.StandardCheckpointer().restore(path)`` reads it on any machine;
with a target of the saved structure it restores it as that structure (a
``TrainState`` as a ``TrainState``).

Nothing read is executed: orbax reads JSON metadata and arrays through
tensorstore (zarr, OCDBT); its msgpack reader builds arrays with
``np.frombuffer``; no pickle.

Promises:

1. :func:`restore_orbax` matches leaves by tree path; a missing leaf, an unexpected one (without
   ``partial=True``), another shape or dtype is a CheckpointError naming it, raised before any array is read
   (tests/test_checkpoint_orbax.py::test_a_mismatch_names_the_leaf_before_reading,
   tests/test_checkpoint_orbax.py::test_a_mismatch_is_raised_before_any_array_is_read).
2. Restored leaves are the saved ones bit for bit, on the target's sharding (any layout or ZeRO stage), or numpy
   (tests/test_checkpoint_orbax.py::test_an_orbax_train_state_restores_into_a_run,
   tests/test_checkpoint_orbax.py::test_a_checkpoint_manager_step_or_its_item_directory).
3. A Python number (stored as int64 or float64) takes the target's dtype, an int it cannot hold is refused; a
   typed PRNG key comes back a typed key of its implementation
   (tests/test_checkpoint_orbax.py::test_a_python_number_and_a_typed_key,
   tests/test_checkpoint_orbax.py::test_a_python_int_too_large_for_its_target,
   tests/test_checkpoint.py::test_export_orbax_writes_a_typed_key_that_orbax_and_restore_orbax_read_back).
4. ``path`` is a checkpoint, a manager's step, or a manager's directory (its newest step, or ``step=``); one with
   no such checkpoint, step or item is a CheckpointError
   (tests/test_checkpoint_orbax.py::test_paths_that_hold_no_such_checkpoint,
   tests/test_checkpoint_orbax.py::test_a_checkpoint_manager_step_or_its_item_directory).
5. :func:`export_orbax` writes every leaf whole as a host array (a ZeRO-split one gathered), which plain orbax
   restores, with a target as the saved structure
   (tests/test_checkpoint_orbax.py::test_a_run_exports_what_orbax_restores,
   tests/test_checkpoint_orbax.py::test_export_then_restore_into_another_layout).
6. bfloat16, float16, int8, bool and 0-d leaves keep their dtype and shape through export and restore
   (tests/test_checkpoint_orbax.py::test_narrow_dtypes_keep_their_dtype_through_export_and_restore).
7. :func:`export_orbax` refuses an existing directory (without ``overwrite``), a leaf that is not numeric, and
   one process of several (tests/test_checkpoint_orbax.py::test_export_refuses_an_existing_directory,
   tests/test_checkpoint.py::test_export_orbax_refuses_one_process_of_two_and_names_the_fix).
8. orbax is imported on first use, never by ``import replicator``; without it both functions raise a
   CheckpointError that says how to install it
   (tests/test_checkpoint_orbax.py::test_replicator_does_not_import_orbax,
   tests/test_checkpoint.py::test_restore_and_export_orbax_without_orbax_say_how_to_install_it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from replicator.training.checkpoint import encoding
from replicator.training.checkpoint.encoding import CheckpointError

__all__ = ["export_orbax", "restore_orbax"]

PyTree = Any

_INSTALL_HINT = "pip install 'replicator[orbax]' (or orbax-checkpoint)"
_METADATA_FILE = "_METADATA"  # a pytree checkpoint's tree metadata (orbax's PyTree and Standard checkpointers)
_STEP_DIR = re.compile(r"^\d+$")  # an ocp.CheckpointManager step (the default naming, no step_prefix)


def _orbax() -> Any:
    """``orbax.checkpoint``, or a CheckpointError that says how to install it."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise CheckpointError(
            f"orbax checkpoints need orbax-checkpoint, which is not installed ({e}): {_INSTALL_HINT}."
        ) from None
    return ocp


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """Hide orbax's absl warnings about the files of a CheckpointManager step that an item directory lacks."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _is_item(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, _METADATA_FILE))


def _item_directory(path: str, step: int | None, item: str | None) -> str:
    """The pytree checkpoint directory that ``path`` (a checkpoint, a manager's step, or a manager's directory) means."""
    if not os.path.isdir(path):
        raise CheckpointError(
            f"no orbax checkpoint at {path!r}: it is not a directory (if orbax is still saving it asynchronously, "
            f"call the checkpointer's wait_until_finished() first)."
        )
    if _is_item(path):
        if step is not None or item is not None:
            raise CheckpointError(
                f"{path!r} is one orbax checkpoint (it holds {_METADATA_FILE}); step= and item= choose within an "
                f"ocp.CheckpointManager directory. Drop them, or pass the manager's directory."
            )
        return path
    names = sorted(os.listdir(path))
    steps = sorted(int(n) for n in names if _STEP_DIR.match(n) and os.path.isdir(os.path.join(path, n)))
    items = [n for n in names if _is_item(os.path.join(path, n))]
    if steps and not items:  # an ocp.CheckpointManager directory: one subdirectory per step
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(
                f"no step {step} in the orbax CheckpointManager directory {path!r}; it has steps {steps}."
            )
        path = os.path.join(path, str(step))
        items = sorted(n for n in os.listdir(path) if _is_item(os.path.join(path, n)))
    elif step is not None:
        raise CheckpointError(
            f"{path!r} is not an orbax CheckpointManager directory (no numbered step directories); drop step=."
        )
    if not items:
        raise CheckpointError(
            f"no orbax checkpoint at {path!r}: neither it nor a subdirectory holds {_METADATA_FILE}, the file of a "
            f"pytree checkpoint (ocp.StandardCheckpointer, ocp.PyTreeCheckpointer, or a pytree item of an "
            f"ocp.CheckpointManager step). Pass the directory the checkpoint was saved to."
        )
    if item is None:
        if len(items) > 1:
            raise CheckpointError(f"the orbax checkpoint {path!r} holds the items {items}; choose one with item=.")
        item = items[0]
    elif item not in items:
        raise CheckpointError(f"the orbax checkpoint {path!r} has no pytree item {item!r}; it has {items}.")
    return os.path.join(path, item)


def _key_name(key: Any) -> str:
    """One tree path entry as orbax names it: a dict key, an attribute (dataclass, namedtuple) or an index."""
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _orbax_path(keys: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(_key_name(k) for k in keys)


def _tree_metadata(ocp: Any, directory: str) -> Any:
    """The checkpoint's tree of leaf metadata (nested dicts and lists; ``ArrayMetadata`` leaves)."""
    try:
        with _quiet_absl():
            metadata = ocp.PyTreeCheckpointer().metadata(directory)
    except Exception as e:  # noqa: BLE001 - whatever orbax makes of a damaged or foreign directory
        raise CheckpointError(f"cannot read the orbax checkpoint {directory!r} ({type(e).__name__}: {e}).") from None
    metadata = getattr(metadata, "item_metadata", metadata)  # orbax >= 0.11: a StepMetadata
    return getattr(metadata, "tree", metadata)


def _expected(target: Any) -> tuple[tuple[int, ...], str, set[str]]:
    """The shape and dtype of a target leaf's stored array, and the dtypes accepted (its own and JAX's canonical)."""
    dtype = getattr(target, "dtype", None)
    if dtype is not None and encoding.is_key(dtype):
        data = jax.eval_shape(jax.random.key_data, target)  # orbax stores a typed key as its key data
        return tuple(data.shape), np.dtype(data.dtype).name, {np.dtype(data.dtype).name}
    shape, canonical = encoding.leaf_spec(target)
    own = np.dtype(dtype).name if dtype is not None else canonical
    return shape, canonical, {canonical, own}


def _convert(value: np.ndarray, target: Any, stored_scalar: bool, where: str) -> Any:
    """A read leaf as the target leaf wants it: a typed key wrapped, a Python number's int64/float64 narrowed."""
    dtype = getattr(target, "dtype", None)
    if dtype is not None and encoding.is_key(dtype):
        return jax.random.wrap_key_data(value, impl=jax.random.key_impl(target))
    if stored_scalar:  # saved from a Python number: orbax stores int64 / float64
        _, canonical = encoding.leaf_spec(target)
        narrowed = np.asarray(value).astype(jnp.dtype(canonical))
        if narrowed.dtype.kind in "iu" and narrowed != value:  # a float is rounded, as JAX rounds a Python float
            raise CheckpointError(f"{where} is {value.item()!r}, which a {canonical} (the target's dtype) cannot hold.")
        return narrowed
    return value


def _same_kind(a: np.dtype, b: str) -> bool:
    """Whether a Python number saved as ``a`` (int64, float64, bool) may be restored as dtype ``b``."""
    kinds = {"i": "iu", "u": "iu", "f": "f", "c": "c", "b": "b"}
    return jnp.dtype(b).kind in kinds.get(a.kind, a.kind)


def restore_orbax(
    path: str | os.PathLike,
    target_state: PyTree,
    *,
    step: int | None = None,
    item: str | None = None,
    partial: bool = False,
) -> PyTree:
    """Read an orbax checkpoint into the structure of ``target_state``.

    Args:
      path: what orbax saved to: the directory of ``ocp.StandardCheckpointer().save(path, state)`` (or
        ``PyTreeCheckpointer``), an ``ocp.CheckpointManager`` directory (its newest step, or ``step=``; steps
        named by number, as by default) or one of its step directories (any name).
      target_state: a pytree of arrays or ``jax.ShapeDtypeStruct`` s with the tree paths, shapes and dtypes of
        the saved state (e.g. the freshly initialized Flax ``TrainState``). A leaf with a sharding (a
        ``jax.Array``, or a ``ShapeDtypeStruct`` with ``sharding=``, e.g. from a step's output on a ZeRO
        layout) is restored onto it; any other leaf as a numpy array.
      step: the step of a CheckpointManager directory (None: the newest).
      item: the item of a CheckpointManager step that saved several (``ocp.args.Composite``); one pytree item
        (e.g. ``default``) is found by itself.
      partial: restore a part of the saved state: leaves the checkpoint has and the target lacks are skipped
        (e.g. the ``params`` of a ``TrainState`` into a new optimizer's state).

    Returns:
      The state, with ``target_state``'s tree structure; each leaf bit for bit the saved one. A leaf saved
      from a Python number (orbax stores int64 or float64) takes the target leaf's dtype: an int if it holds
      the value, a float rounded as JAX rounds a Python float.

    Raises:
      CheckpointError: orbax is not installed, ``path`` holds no orbax checkpoint, or its tree paths, shapes or
        dtypes differ from the target's (the message names the leaf), before any array is read.

    In a multi-process job call it on every process (orbax's restore ends with a barrier of all processes):
    each reads the whole state to its host, then fills its own devices (not tested with several processes).
    """
    ocp = _orbax()
    directory = _item_directory(os.path.abspath(os.fspath(path)), step, item)
    stored_flat, stored_def = jax.tree_util.tree_flatten_with_path(_tree_metadata(ocp, directory))
    stored = {_orbax_path(keys): (i, meta) for i, (keys, meta) in enumerate(stored_flat)}
    target_flat, target_def = jax.tree_util.tree_flatten_with_path(target_state)

    def named(keys: tuple[str, ...]) -> str:
        return ".".join(keys)

    wanted: list[int] = []
    for keys, target in target_flat:
        where = f"state{jax.tree_util.keystr(keys)}"
        name = _orbax_path(keys)
        if name not in stored:
            raise CheckpointError(
                f"the orbax checkpoint {directory} lacks {where} (orbax's name {named(name)}); it has "
                f"{len(stored)} arrays, e.g. {', '.join(named(n) for n in list(stored)[:3])}. Restore it into the "
                f"structure it was saved from (e.g. the same TrainState, tx and model)."
            )
        i, meta = stored[name]
        shape, dtype, accepted = _expected(target)
        saved_shape, saved_dtype = tuple(getattr(meta, "shape", ())), np.dtype(getattr(meta, "dtype", object))
        scalar = type(meta).__name__ == "ScalarMetadata" and shape == () and _same_kind(saved_dtype, dtype)
        if saved_shape != shape or (saved_dtype.name not in accepted and not scalar):
            raise CheckpointError(
                f"the orbax checkpoint {directory} has {named(name)} of shape {saved_shape} {saved_dtype.name}, "
                f"but the target's {where} is {shape} {dtype}."
            )
        wanted.append(i)
    if not partial and len(wanted) < len(stored):
        extra = [named(n) for n, (i, _) in stored.items() if i not in set(wanted)]
        raise CheckpointError(
            f"the orbax checkpoint {directory} has {extra[0]}, which the target lacks ({len(extra)} such leaves, "
            f"{len(stored)} saved, {len(target_flat)} in the target). Restore it into the structure it was saved "
            f"from, or pass partial=True to restore only the target's leaves."
        )

    restore_args = stored_def.unflatten([ocp.RestoreArgs(restore_type=np.ndarray) for _ in stored_flat])
    try:
        with _quiet_absl():
            read = ocp.PyTreeCheckpointer().restore(directory, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except Exception as e:  # noqa: BLE001 - a damaged file, whatever tensorstore makes of it
        raise CheckpointError(f"cannot read the orbax checkpoint {directory} ({type(e).__name__}: {e}).") from None
    values = jax.tree.leaves(read)
    if len(values) != len(stored_flat):
        raise CheckpointError(
            f"the orbax checkpoint {directory} gave {len(values)} arrays where its metadata lists {len(stored_flat)}; "
            f"it is damaged."
        )
    placed = []
    for (keys, target), i in zip(target_flat, wanted, strict=True):
        where = f"state{jax.tree_util.keystr(keys)}"
        value = np.asarray(values[i])
        scalar = type(stored_flat[i][1]).__name__ == "ScalarMetadata"
        placed.append(encoding.place_like(_convert(value, target, scalar, where), encoding.target_sharding(target)))
    return target_def.unflatten(placed)


def _host_leaf(leaf: Any) -> Any:
    """A state leaf as it is exported: its whole value as a numpy array (a typed key: on one device)."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and encoding.is_key(dtype):
        return jax.device_put(leaf, jax.local_devices()[0])  # orbax stores its key data and impl
    encoding.entry("", leaf)  # raises a CheckpointError for a leaf that is not an array of numbers
    return encoding.to_host(leaf)


def export_orbax(path: str | os.PathLike, state: PyTree, *, overwrite: bool = False) -> str:
    """Write ``state`` as an orbax checkpoint that ``ocp.StandardCheckpointer().restore(path)`` reads.

    Every leaf is written whole, as a host array (a leaf split over devices, e.g. by ZeRO, is gathered
    first): the checkpoint names no device, so orbax restores it anywhere, and with a target (a
    ``TrainState``'s shapes, with shardings or not) onto the target's structure and layout. A typed PRNG
    key is written as orbax writes one (its key data and impl).

    Args:
      path: the checkpoint's directory (it must not exist, unless ``overwrite``).
      state: a pytree of arrays (on devices or not), e.g. a Replicator run's state or what
        :func:`~replicator.restore_checkpoint` read from replicator's own format.
      overwrite: replace an existing directory at ``path``.

    Returns:
      The checkpoint's directory (absolute).

    Raises:
      CheckpointError: orbax is not installed, ``path`` exists (without ``overwrite``), a leaf is not an array
        of numbers, or this is one process of several (export from a single process: restore the replicator
        checkpoint there with host targets, then export).
    """
    ocp = _orbax()
    if jax.process_count() > 1:
        raise CheckpointError(
            f"export_orbax runs in a single process (this is process {jax.process_index()} of "
            f"{jax.process_count()}). Save with replicator's own checkpoints in the job, then in one process "
            f"restore_checkpoint(directory, host_target) and export_orbax(path, state)."
        )
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise CheckpointError(f"{path!r} exists; export into a new directory, or pass overwrite=True to replace it.")
    host = jax.tree.map(_host_leaf, state)
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(path, host, force=overwrite)
        checkpointer.wait_until_finished()
    finally:
        checkpointer.close()
    return path
