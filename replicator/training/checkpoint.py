"""Checkpoints of a training state: atomic, checked, and never executed.

A checkpoint is one directory per step, holding the state's arrays in a numpy
``.npz`` file and a JSON manifest that describes them::

    ckpt/
      step_00000040/
        arrays.npz       # leaf i stored as "a<i>", read with allow_pickle=False
        manifest.json    # format, step, extra, sha256 of arrays.npz, and per
                         # leaf: tree path, shape, dtype (and how it is stored)
      step_00000050/
        ...

Example::

    import replicator as rp

    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    rp.save_checkpoint("/tmp/ckpt", 10, params, extra={"input_position": 10})
    step, params, extra = rp.restore_checkpoint("/tmp/ckpt", params)  # the latest
    assert step == 10 and extra == {"input_position": 10}

    manager = rp.CheckpointManager("/tmp/ckpt", keep=3)  # keeps the 3 newest
    manager.save(20, params)
    manager.all_steps()  # [10, 20]

**Why our own format, and not orbax.** Orbax is not one of replicator's runtime
dependencies (jax, numpy, optax), and what we need is small: a single process
writes the whole state (see *Multi-process jobs* below). ``.npz`` plus JSON can be inspected with
``np.load`` and a text editor, and reading it never executes anything: arrays
are loaded with ``allow_pickle=False`` and the manifest is plain JSON (no
``pickle``, no ``eval``), so a checkpoint from an untrusted source can at worst
fail to load with a :class:`CheckpointError`.

**Atomic saves.** A checkpoint is written into a temporary directory next to
the final one (``.tmp-step_...``); every file and the directory are flushed and
``fsync``-ed, then the directory is renamed into place (a rename within one
file system is atomic) and the parent directory is ``fsync``-ed. A crash, an
exception or ``kill -9`` during a save therefore leaves the previous
checkpoints untouched; the half-written temporary directory is ignored by
readers and removed by the next save. Old checkpoints are pruned only after
the new one is in place.

**Restore is checked.** The checkpoint's tree paths, shapes and dtypes must
match ``target_state`` (a pytree of arrays or ``jax.ShapeDtypeStruct`` s, e.g.
the freshly initialized state), and the arrays file must match its sha256, so
another model's checkpoint, a truncated file or a foreign file is reported as a
:class:`CheckpointError` (a ``ValueError``) that names the problem, e.g.
``checkpoint has state['w'] of shape (3,) float32 but the model expects (4,)
float32``. The state is rebuilt with ``target_state``'s tree structure, so
dicts, lists, tuples, NamedTuples (optax states) and ``None`` leaves come back
as they were.

**Dtypes.** Numpy's own dtypes are stored as they are. ``bfloat16`` and the
other ``ml_dtypes`` types (``float8_*``, ``int4``...), which ``.npz`` cannot
store without pickle, are stored as a view of unsigned integers of the same
width, with the real dtype in the manifest. Typed PRNG keys
(``jax.random.key``) are stored as their ``key_data``, with the key
implementation recorded.

**Devices and processes.** State on a device mesh is copied to the host:
a leaf that this process can read whole (on its own devices, or replicated
over a mesh that spans processes: read from this process's first shard,
without communication) with ``np.asarray``, and a leaf sharded over several
processes (e.g. Adam's ``mu``/``nu`` under the default ZeRO-1 pass
``shard-optimizer-update``) gathered to the host of every process with
``jax.experimental.multihost_utils.process_allgather(x, tiled=True)`` (its
full, global value; each process holds it in memory for the save). Restored
leaves are numpy arrays, or, where the target leaf has a sharding (a
``jax.Array``, or a ``jax.ShapeDtypeStruct`` with ``sharding=``), arrays put on
that sharding, also one that spans processes.

**Multi-process jobs.** A checkpoint has one writer, so a checkpoint saved by a
job of any number of workers restores in a job of any other number, a single
process included (the arrays are stored whole, whatever their sharding was):

* ``save`` is a collective: call it on every process, with the same state
  (the same step, and the same ``extra`` on every process in practice: process
  0's is written). Every process gathers the leaves sharded over several
  processes (so each must take part), then process 0 alone writes the
  checkpoint (atomically, as above) while the others wait for it; ``save``
  returns on every process once the checkpoint is committed, so none goes on
  (or restores it) before it exists. If process 0 fails to write (e.g. an
  existing later step without ``overwrite=True``, or a full disk), ``save``
  raises a :class:`CheckpointError` on every process, so they stay in step.
  The wait is a collective over the job's devices (as a training step is), so
  a process 0 that dies or hangs meanwhile ends the job within JAX's heartbeat
  timeout instead of hanging it.
* ``restore`` reads the files on every process: the directory must be on a
  file system that every process can read (a shared one, e.g. NFS). It needs
  no communication when the target leaves are host values or
  ``jax.ShapeDtypeStruct`` s without a sharding (``Replicator.run`` then
  places the state, checking that it is identical on every process); where
  the target has leaves on a sharding that spans processes, every process must
  call it, and it checks (one small collective) that every process read the
  same checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "latest_step",
    "restore_checkpoint",
    "save_checkpoint",
]

PyTree = Any

FORMAT = "replicator-checkpoint"
FORMAT_VERSION = 1
ARRAYS_FILE = "arrays.npz"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".replaced-"  # a checkpoint being overwritten by one of the same step
_OLD_DIR = re.compile(r"^\.replaced-step_(\d+)-[0-9a-f]+$")
_MESSAGE_BYTES = 2048  # of process 0's error, sent to the other processes when its save fails


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or restored; the message says why and the fix."""


# -- leaves <-> host arrays --------------------------------------------------------------------


def _is_key(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _leaf_spec(leaf: Any) -> tuple[tuple[int, ...], str]:
    """Shape and dtype name of a state or target leaf, as the manifest records them.

    Python numbers get JAX's canonical dtype (``1.0`` -> float32 without x64),
    as :class:`~replicator.Replicator` gives them.
    """
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        shape, dtype = tuple(leaf.shape), leaf.dtype
    else:
        shape, dtype = np.shape(leaf), np.result_type(leaf)
    if _is_key(dtype):
        return shape, str(dtype)
    return shape, jnp.dtype(jax.dtypes.canonicalize_dtype(dtype)).name


def _to_host(leaf: Any, fetch: bool = True) -> np.ndarray | None:
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
    _, dtype = _leaf_spec(leaf)
    return np.asarray(leaf).astype(jnp.dtype(dtype), copy=False)


def _entry(path: str, leaf: Any) -> dict[str, Any]:
    """The manifest entry of one state leaf; raises if it cannot be saved. No data is copied."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and _is_key(dtype):
        return {
            "path": path,
            "shape": list(leaf.shape),
            "dtype": str(dtype),
            "key_impl": str(jax.random.key_impl(leaf)),
        }
    try:
        shape, name = _leaf_spec(leaf)
        numeric = jnp.dtype(name).kind in "biufcV"
    except (TypeError, ValueError):
        numeric = False
    if not numeric:
        raise CheckpointError(
            f"state{path} is of type {type(leaf).__name__}{'' if dtype is None else f' and dtype {dtype}'}; "
            f"checkpoints hold arrays of numbers or booleans. Keep other values out of the state "
            f"(JSON-serializable ones can go in extra=)."
        )
    entry: dict[str, Any] = {"path": path, "shape": list(shape), "dtype": name}
    if jnp.dtype(name).isbuiltin != 1:  # bfloat16, float8, int4, ...: not storable in .npz without pickle
        entry["stored_as"] = np.dtype(f"u{jnp.dtype(name).itemsize}").name
    return entry


def _stored(leaf: Any, entry: Mapping[str, Any], fetch: bool = True) -> np.ndarray | None:
    """The array to store for a leaf and its entry (None where ``fetch=False``; see :func:`_to_host`)."""
    if "key_impl" in entry:
        return _to_host(jax.random.key_data(leaf), fetch)
    host = _to_host(leaf, fetch)
    if host is not None and "stored_as" in entry:
        host = host.view(np.dtype(entry["stored_as"]))
    return host


def _decode(array: np.ndarray, entry: Mapping[str, Any]) -> Any:
    """The leaf a stored array and its manifest entry describe."""
    if "key_impl" in entry:
        return jax.random.wrap_key_data(array, impl=entry["key_impl"])
    if "stored_as" in entry:
        return array.view(jnp.dtype(entry["dtype"]))
    return array


def _describe(shape: Any, dtype: str) -> str:
    return f"{tuple(shape)} {dtype}"


# -- files ---------------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (POSIX; a no-op elsewhere)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_arrays(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to a new ``.npz`` at ``path`` and fsync it."""
    with open(path, "xb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())


def _write_text(path: str, text: str) -> None:
    with open(path, "x", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- the manager -----------------------------------------------------------------------------------


class CheckpointManager:
    """Saves, lists, prunes and restores the checkpoints of one directory.

    Args:
      directory: where checkpoints live (created on the first save).
      keep: how many of the newest checkpoints to keep (``None``: all).

    Example::

        manager = CheckpointManager("/tmp/run1/ckpt", keep=3)
        manager.save(100, state, extra={"input_position": 100})
        step, state, extra = manager.restore(state)  # the newest; step= for another
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3):
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep= must be a positive int or None (keep all), got {keep!r}.")
        self.directory = os.fspath(directory)
        self.keep = keep

    def __repr__(self) -> str:
        return f"CheckpointManager({self.directory!r}, keep={self.keep})"

    # -- listing -----------------------------------------------------------------

    def _entries(self) -> dict[int, str]:
        """step -> directory name of every committed checkpoint.

        A checkpoint being replaced by one of the same step is moved aside
        first; if the save died before the new one was renamed into place, the
        moved-aside one still counts.
        """
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return {}
        found = {int(m.group(1)): n for n in names if (m := _STEP_DIR.match(n))}
        for name in sorted(names):
            m = _OLD_DIR.match(name)
            if m and int(m.group(1)) not in found:
                found[int(m.group(1))] = name
        return found

    def all_steps(self) -> list[int]:
        """The steps of the checkpoints in the directory, oldest first."""
        return sorted(self._entries())

    def latest_step(self) -> int | None:
        """The newest checkpoint's step, or None if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> str:
        """The directory of the checkpoint of ``step`` (which must exist)."""
        entries = self._entries()
        if step not in entries:
            raise CheckpointError(
                f"no checkpoint of step {step} in {self.directory!r}; it has steps {sorted(entries) or 'none'}."
            )
        return os.path.join(self.directory, entries[step])

    # -- saving ------------------------------------------------------------------

    def save(self, step: int, state: PyTree, *, extra: Mapping[str, Any] | None = None, overwrite: bool = False) -> str:
        """Atomically write a checkpoint of ``state`` at ``step``, then prune old ones.

        In a multi-process job this is a collective: call it on every
        process with the same state. Leaves sharded over several processes
        are gathered on every process, process 0 writes, and every process
        returns once the checkpoint is committed (see the module's
        *Multi-process jobs*).

        Args:
          step: the training step, a non-negative int.
          state: a pytree of arrays (on devices or not).
          extra: JSON-serializable metadata saved with it, e.g. the input
            position ``{"input_position": 1200}`` (process 0's is saved).
          overwrite: replace a checkpoint of the same step and delete those of
            later steps (a run restarted from an earlier step). Without it,
            saving a step that is not newer than every checkpoint in the
            directory raises, so that two runs never mix in one directory.

        Returns:
          The checkpoint's directory (on every process; only process 0 writes).

        Raises:
          CheckpointError: ``extra`` is not JSON-serializable, a leaf is not
            numeric, or (without ``overwrite``) the directory already has a
            checkpoint of ``step`` or a later one. Nothing saved is changed.
            In a multi-process job it is raised on every process, also when
            process 0 failed to write (the others' message says why).
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}.")
        step = int(step)
        final = os.path.join(self.directory, f"step_{step:08d}")
        try:
            extra_json = json.loads(json.dumps(dict(extra or {})))
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"extra= must be JSON-serializable (numbers, strings, lists, dicts): {e}. "
                f"Convert arrays with .tolist() or int()/float()."
            ) from None
        flat, treedef = jax.tree_util.tree_flatten_with_path(state)
        leaves = [_entry(jax.tree_util.keystr(keys), leaf) for keys, leaf in flat]  # the same on every process
        writer = jax.process_index() == 0
        multi = jax.process_count() > 1

        error: Exception | None = None
        existing: dict[int, str] = {}
        if writer:
            try:
                existing = self._check_new(step, overwrite)
            except CheckpointError as e:
                if not multi:
                    raise
                error = e  # the others still gather (below), then learn of it
        # Every process takes part in gathering the leaves sharded over processes.
        fetch = writer and error is None
        arrays = {
            f"a{i}": _stored(leaf, entry, fetch) for i, ((_, leaf), entry) in enumerate(zip(flat, leaves, strict=True))
        }
        if fetch:
            try:
                self._write(step, final, arrays, leaves, treedef, extra_json, existing)
            except Exception as e:
                if not multi:
                    raise
                error = e
        if multi:
            _agree_on_save(error, final)
        return final

    def _check_new(self, step: int, overwrite: bool) -> dict[int, str]:
        """The committed checkpoints; raises if ``step`` is not newer than all of them (without overwrite)."""
        existing = self._entries()
        later = sorted(s for s in existing if s > step)
        if not overwrite and (step in existing or later):
            what = f"a checkpoint of step {step}" if step in existing else f"checkpoints of later steps {later}"
            raise CheckpointError(
                f"{self.directory!r} already has {what}, written by another run or before a restart. Resume "
                f"from its latest checkpoint, save into another directory, or pass overwrite=True to replace "
                f"step {step} and discard the checkpoints after it."
            )
        return existing

    def _write(
        self,
        step: int,
        final: str,
        arrays: dict[str, Any],
        leaves: list[dict[str, Any]],
        treedef: Any,
        extra_json: Any,
        existing: dict[int, str],
    ) -> None:
        """Write and commit the checkpoint (process 0), then prune."""
        later = sorted(s for s in existing if s > step)
        os.makedirs(self.directory, exist_ok=True)
        self._remove_leftovers(existing)
        token = uuid.uuid4().hex
        tmp = os.path.join(self.directory, f"{_TMP_PREFIX}step_{step:08d}-{token}")
        os.mkdir(tmp)
        try:
            _write_arrays(os.path.join(tmp, ARRAYS_FILE), arrays)
            arrays_path = os.path.join(tmp, ARRAYS_FILE)
            manifest = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "step": step,
                "extra": extra_json,
                "arrays_file": ARRAYS_FILE,
                "arrays_sha256": _sha256(arrays_path),
                "arrays_bytes": os.path.getsize(arrays_path),
                "treedef": str(treedef),
                "leaves": leaves,
            }
            _write_text(os.path.join(tmp, MANIFEST_FILE), json.dumps(manifest, indent=1) + "\n")
            _fsync_dir(tmp)
            old = None
            if step in existing:  # overwrite: move the old one aside, it counts until the new one is in
                old = os.path.join(self.directory, f"{_OLD_PREFIX}step_{step:08d}-{token}")
                os.rename(os.path.join(self.directory, existing[step]), old)
            os.rename(tmp, final)
            _fsync_dir(self.directory)
        except BaseException:
            _rmtree(tmp)
            raise
        if old is not None:
            _rmtree(old)
        for newer in later:  # overwrite=True: the run restarted from `step`; its old future goes
            _rmtree(os.path.join(self.directory, existing[newer]))
        self._prune()

    def _remove_leftovers(self, entries: dict[int, str]) -> None:
        """Remove temporary directories of saves that died, and replaced checkpoints."""
        live = set(entries.values())
        for name in os.listdir(self.directory):
            if (name.startswith(_TMP_PREFIX) or name.startswith(_OLD_PREFIX)) and name not in live:
                _rmtree(os.path.join(self.directory, name))
        for step, name in entries.items():  # a replaced checkpoint whose save died: make it whole again
            if name.startswith(_OLD_PREFIX):
                os.rename(os.path.join(self.directory, name), os.path.join(self.directory, f"step_{step:08d}"))
                entries[step] = f"step_{step:08d}"

    def _prune(self) -> None:
        if self.keep is None:
            return
        entries = self._entries()
        for step in sorted(entries)[: -self.keep]:
            _rmtree(os.path.join(self.directory, entries[step]))

    # -- restoring ---------------------------------------------------------------

    def read_manifest(self, step: int | None = None) -> dict[str, Any]:
        """The manifest of a checkpoint (the newest by default), checked for format and version."""
        path = self._checkpoint_path(step)
        try:
            with open(os.path.join(path, MANIFEST_FILE), encoding="utf-8") as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"{path!r} has no {MANIFEST_FILE}: it is not a replicator checkpoint.") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{path}/{MANIFEST_FILE} is not valid JSON ({e}); the checkpoint is damaged."
            ) from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(
                f"{path}/{MANIFEST_FILE} is not a replicator checkpoint manifest (format "
                f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, expected {FORMAT!r})."
            )
        if manifest.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has checkpoint format version {manifest.get('version')!r}; this replicator reads "
                f"version {FORMAT_VERSION}. Use the replicator version that wrote it."
            )
        missing = {"step", "extra", "arrays_file", "arrays_sha256", "leaves"} - manifest.keys()
        leaves = manifest.get("leaves")
        if missing or not isinstance(leaves, list):
            raise CheckpointError(
                f"{path}/{MANIFEST_FILE} lacks {sorted(missing) or ['leaves']}; the checkpoint is damaged."
            )
        for i, entry in enumerate(leaves):
            if not isinstance(entry, dict) or not {"path", "shape", "dtype"} <= entry.keys():
                raise CheckpointError(
                    f"{path}/{MANIFEST_FILE}: leaf {i} lacks path, shape or dtype; the checkpoint is damaged."
                )
        if os.path.basename(manifest["arrays_file"]) != manifest["arrays_file"]:
            raise CheckpointError(
                f"{path}/{MANIFEST_FILE} names arrays file {manifest['arrays_file']!r}, not a file name."
            )
        manifest["path"] = path
        return manifest

    def _checkpoint_path(self, step: int | None) -> str:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(
                    f"no checkpoint in {self.directory!r} (looked for step_<N>/ directories); "
                    f"check the path, or start from the initial state."
                )
        return self.path(step)

    def restore(self, target_state: PyTree, step: int | None = None) -> tuple[int, PyTree, dict[str, Any]]:
        """Read a checkpoint into the structure of ``target_state``.

        Args:
          target_state: a pytree of arrays or ``jax.ShapeDtypeStruct`` s with
            the tree structure, shapes and dtypes the checkpoint must have
            (e.g. the freshly initialized state).
          step: which checkpoint; None means the newest.

        Returns:
          ``(step, state, extra)``. ``state`` has ``target_state``'s tree
          structure; a leaf is a numpy array, or where the target leaf has a
          sharding (a ``jax.Array``, or a ``jax.ShapeDtypeStruct`` with
          ``sharding=``), an array on that sharding.

        In a multi-process job every process reads the files (they must be on
        a file system every process can read). Where ``target_state`` has
        leaves on a sharding that spans processes this is a collective: call
        it on every process; it checks that they all read the same
        checkpoint. Otherwise it needs no communication.

        Raises:
          CheckpointError: no such checkpoint, a damaged or foreign one, or
            one whose tree paths, shapes or dtypes differ from ``target_state``
            (the message names the first mismatching leaf), or (where it is a
            collective) processes that read different checkpoints.
        """
        target_flat, target_def = jax.tree_util.tree_flatten_with_path(target_state)
        shardings = [_target_sharding(target) for _, target in target_flat]
        spans = jax.process_count() > 1 and any(s is not None and not s.is_fully_addressable for s in shardings)
        try:
            manifest, leaves = self._read(target_flat, step)
        except CheckpointError as e:
            if not spans:
                raise
            try:  # the others may have read it: make them fail too, rather than wait for this process
                _check_same_checkpoint(f"error: {e}")
            except CheckpointError:
                pass
            raise
        if spans:
            _check_same_checkpoint(f"step {manifest['step']} sha256 {manifest['arrays_sha256']}")
        placed = [_place_like(leaf, s) for leaf, s in zip(leaves, shardings, strict=True)]
        return int(manifest["step"]), target_def.unflatten(placed), manifest["extra"]

    def _read(self, target_flat: list[tuple[Any, Any]], step: int | None) -> tuple[dict[str, Any], list[Any]]:
        """The manifest and the leaves (host arrays) of a checkpoint, checked against the target."""
        manifest = self.read_manifest(step)
        path = manifest["path"]
        entries = manifest["leaves"]
        _check_structure(path, entries, target_flat)

        arrays_path = os.path.join(path, manifest["arrays_file"])
        try:
            digest = _sha256(arrays_path)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path} lacks {manifest['arrays_file']}; it is damaged.") from None
        if digest != manifest["arrays_sha256"]:
            size = os.path.getsize(arrays_path)
            expected = manifest.get("arrays_bytes")
            how = f"{size} bytes, {expected} when saved" if expected is not None else f"{size} bytes"
            raise CheckpointError(
                f"checkpoint {path}: {manifest['arrays_file']} is truncated or corrupt ({how}; sha256 differs "
                f"from the manifest). Restore an earlier step with step= (steps: {self.all_steps()})."
            )
        leaves = []
        try:
            with np.load(arrays_path, allow_pickle=False) as npz:
                for i, entry in enumerate(entries):
                    array = npz[f"a{i}"]
                    stored = entry.get("stored_as", "uint32" if "key_impl" in entry else entry["dtype"])
                    if array.dtype != np.dtype(stored):
                        raise CheckpointError(
                            f"checkpoint {path}: array {i} (state{entry['path']}) is stored as {array.dtype}, "
                            f"its manifest says {stored}; the checkpoint is damaged."
                        )
                    leaf = _decode(array, entry)
                    if tuple(leaf.shape) != tuple(entry["shape"]):
                        raise CheckpointError(
                            f"checkpoint {path}: array {i} (state{entry['path']}) has shape {leaf.shape}, its "
                            f"manifest says {tuple(entry['shape'])}; the checkpoint is damaged."
                        )
                    leaves.append(leaf)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever np.load makes of a bad file
            raise CheckpointError(f"checkpoint {path}: cannot read {manifest['arrays_file']} ({e}).") from None
        return manifest, leaves


def _check_structure(path: str, entries: list[dict[str, Any]], target_flat: list[tuple[Any, Any]]) -> None:
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
    for entry, (_, target) in zip(entries, target_flat, strict=True):
        shape, dtype = _leaf_spec(target)
        if tuple(entry["shape"]) != shape or entry["dtype"] != dtype:
            raise CheckpointError(
                f"checkpoint {path} has state{entry['path']} of shape {_describe(entry['shape'], entry['dtype'])} "
                f"but the model expects {_describe(shape, dtype)}."
            )


def _target_sharding(target: Any) -> Any:
    """The sharding a restored leaf goes on: ``target``'s, if it has one."""
    return getattr(target, "sharding", None) if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)) else None


def _place_like(leaf: Any, sharding: Any) -> Any:
    """``leaf`` on ``sharding`` if there is one, else as it is.

    On a sharding that spans processes each process fills its own devices
    from its copy of the leaf (every process read the same checkpoint).
    """
    if sharding is None:
        return leaf
    if not sharding.is_fully_addressable:
        return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])
    return jax.device_put(leaf, sharding)


def _check_same_checkpoint(what_was_read: str) -> None:
    """Check that every process read the same checkpoint (or failed the same way); one collective."""
    from replicator.runtime.distributed import check_same_across_workers

    try:
        check_same_across_workers(
            [what_was_read],
            ["the checkpoint read (its step and sha256, or the error)"],
            what="the restored checkpoint",
            fix=(
                "Every process must restore the same checkpoint: keep the checkpoint directory on a file "
                "system that every process reads (a shared one), and pass the same directory and step= "
                "on every process."
            ),
        )
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _agree_on_save(error: Exception | None, final: str) -> None:
    """Process 0 tells every process whether its save succeeded; a collective that all wait in.

    Returns on every process once process 0 has committed the checkpoint (or
    raises on every process if it failed: process 0 its own exception, the
    others a :class:`CheckpointError` that quotes it).
    """
    from jax.experimental import multihost_utils

    text = np.zeros(_MESSAGE_BYTES, np.uint8)
    if error is not None:
        raw = f"{type(error).__name__}: {error}".encode()[:_MESSAGE_BYTES]
        text[: len(raw)] = np.frombuffer(raw, np.uint8)
    failed, text = multihost_utils.broadcast_one_to_all((np.int32(error is not None), text))
    if jax.process_index() == 0:
        if error is not None:
            raise error
        return
    if int(failed):
        message = np.asarray(text).tobytes().rstrip(b"\0").decode(errors="replace")
        raise CheckpointError(f"process 0 failed to save the checkpoint {final}: {message}")


# -- functions -----------------------------------------------------------------------------------------


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    state: PyTree,
    *,
    extra: Mapping[str, Any] | None = None,
    keep: int | None = 3,
    overwrite: bool = False,
) -> str:
    """Atomically save ``state`` at ``step`` into ``directory``, keeping the ``keep`` newest.

    See :meth:`CheckpointManager.save`.
    """
    return CheckpointManager(directory, keep=keep).save(step, state, extra=extra, overwrite=overwrite)


def restore_checkpoint(
    directory: str | os.PathLike, target_state: PyTree, step: int | None = None
) -> tuple[int, PyTree, dict[str, Any]]:
    """``(step, state, extra)`` of the newest checkpoint in ``directory`` (or of ``step``).

    See :meth:`CheckpointManager.restore`.
    """
    return CheckpointManager(directory, keep=None).restore(target_state, step)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The step of the newest checkpoint in ``directory``, or None if there is none."""
    return CheckpointManager(directory, keep=None).latest_step()
