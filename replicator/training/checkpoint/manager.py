"""The checkpoint manager: one ``step_<N>/`` directory per checkpoint, committed atomically.

The commit protocol (the directory's lock, a temporary directory renamed into
place, moving aside a checkpoint being replaced, pruning) and reading a
checkpoint back. What a checkpoint's files hold is
:mod:`~replicator.training.checkpoint.manifest`'s. See
``docs/design/checkpoints.md`` for the format and the guarantees.

Promises:

1. A save is atomic: an exception, a crash or ``kill -9`` at any moment of it leaves the earlier checkpoints as
   they were and no step directory of its own
   (tests/test_checkpoint.py::TestAtomicity::test_failure_while_writing_arrays_keeps_the_last_checkpoint,
   tests/test_checkpoint.py::TestAtomicity::test_failure_before_the_rename,
   tests/test_checkpoint.py::TestAtomicity::test_sigkill_during_large_saves,
   tests/test_checkpoint_async.py::test_kill_9_during_an_async_save_loses_nothing).
2. Every file is fsynced before the rename that commits the step, and the directory after it
   (tests/test_checkpoint.py::test_every_data_file_is_fsynced_before_the_step_directory_is_renamed_into_place,
   tests/test_checkpoint.py::test_the_directory_is_fsynced_after_the_rename_that_commits_a_checkpoint).
3. Without ``overwrite`` a step not newer than every checkpoint is refused and nothing changes; with it the step
   is replaced and the later ones discarded, and a crash meanwhile keeps the old one
   (tests/test_checkpoint.py::TestManager::test_same_or_earlier_step_needs_overwrite,
   tests/test_checkpoint.py::TestAtomicity::test_crash_while_overwriting_keeps_the_old_checkpoint).
4. After every save exactly the ``keep`` newest checkpoints are left (all with ``keep=None``), an overwrite too
   (tests/test_checkpoint.py::test_pruning_keeps_exactly_the_keep_newest_checkpoints,
   tests/test_checkpoint.py::TestManager::test_keeps_the_newest, tests/test_checkpoint.py::TestManager::test_keep_none_keeps_all).
5. One writer at a time: a second writer meanwhile, in this process or another, gets a CheckpointError and changes
   nothing; the lock is gone when a save returns or raises
   (tests/test_checkpoint_faults.py::TestLock::test_a_second_manager_saving_meanwhile_is_refused,
   tests/test_checkpoint_faults.py::TestLock::test_another_process_holding_the_lock,
   tests/test_checkpoint.py::TestAtomicity::test_failure_while_writing_arrays_keeps_the_last_checkpoint).
6. The next save removes what a dead save left (under the lock); temporaries carry their writer's token
   (tests/test_checkpoint_faults.py::TestLock::test_a_dead_writers_temporary_is_removed_under_the_lock,
   tests/test_checkpoint_faults.py::TestLock::test_temporaries_carry_the_writers_token).
7. A negative step, an ``extra`` that is not JSON, a leaf that is not numeric, ``keep`` < 1 and ``writer_nice``
   outside 0-19 are refused before anything is written
   (tests/test_checkpoint.py::TestManager::test_bad_arguments,
   tests/test_checkpoint_async.py::test_writer_nice_lowers_the_priority_of_the_writer_thread_only).
8. A process other than 0 of a one-process view writes nothing and returns the path
   (tests/test_checkpoint.py::TestManager::test_only_process_zero_writes).
9. A restore checks the arrays file's sha256 (truncated, corrupt), each stored array's dtype against the
   manifest, and never unpickles (tests/test_checkpoint.py::TestRestoreChecks::test_truncated_arrays,
   tests/test_checkpoint.py::TestRestoreChecks::test_corrupt_byte,
   tests/test_checkpoint.py::TestRestoreChecks::test_stored_dtype_differs_from_manifest,
   tests/test_checkpoint.py::TestRestoreChecks::test_never_unpickles).
10. ``fallback=True`` (without ``step=``) warns for each damaged newer checkpoint and restores the newest intact
    one; it is off by default, never skips a checkpoint that is intact but does not fit the target, is ignored
    with ``step=``, and with none intact raises
    (tests/test_checkpoint_faults.py::TestFallback::test_off_by_default,
    tests/test_checkpoint_faults.py::TestFallback::test_warns_and_restores_the_newest_intact,
    tests/test_checkpoint.py::test_fallback_skips_only_damaged_checkpoints_not_one_that_does_not_fit_the_target,
    tests/test_checkpoint_faults.py::TestFallback::test_an_explicit_step_does_not_fall_back,
    tests/test_checkpoint_faults.py::TestFallback::test_all_broken).
11. The restored state has the target's tree structure (dicts, lists, NamedTuples, None) and the saved ``extra``,
    and training resumed from it is bit-identical (tests/test_checkpoint.py::TestRoundTrip::test_pytrees_dtypes_and_extra,
    tests/test_checkpoint.py::test_resume_is_bit_identical).
12. A restore onto leaves spanning processes asks every process to have read the same step and manifest digest,
    and shares a read error so that the others fail too; onto host targets it is no collective
    (tests/test_checkpoint.py::test_a_restore_spanning_processes_asks_them_all_to_have_read_the_same_step_and_digest,
    tests/test_checkpoint.py::test_a_failed_read_on_a_spanning_restore_tells_the_others_and_raises_its_own_error,
    tests/test_checkpoint.py::test_a_restore_onto_host_targets_in_a_multi_process_job_is_not_a_collective).
13. :meth:`CheckpointManager.save_async` returns before the files are written, with at most one save in flight;
    its failure is raised by the next save or wait, the earlier checkpoints unchanged and the lock released
    (tests/test_checkpoint_async.py::test_the_save_returns_before_the_files_are_written,
    tests/test_checkpoint_async.py::test_trainer_saves_every_step_of_a_donated_state_one_at_a_time,
    tests/test_checkpoint_async.py::test_a_failed_async_save_raises_at_the_next_save_and_leaves_the_earlier_ones).
14. A directory that is a file is a CheckpointError, on save and restore
    (tests/test_checkpoint_faults.py::TestStrictManifest::test_restoring_from_a_file_path).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from replicator.runtime.distributed import progress
from replicator.training.checkpoint import agreement, background, encoding, files, shards, snapshot
from replicator.training.checkpoint.encoding import CheckpointError
from replicator.training.checkpoint.manifest import (
    ARRAYS_FILE,
    DIGEST_FIELD,
    MANIFEST_FILE,
    DamagedCheckpoint,
    build_manifest,
    parse_manifest,
)

PyTree = Any

LOCK_FILE = ".lock"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".replaced-"  # a checkpoint being overwritten by one of the same step
_OLD_DIR = re.compile(r"^\.replaced-step_(\d+)-[0-9a-f]+$")


@dataclasses.dataclass(frozen=True)
class _Save:
    """One save, described before anything is written (the same on every process but ``me``/``writer``)."""

    step: int
    final: str  # the checkpoint's directory once committed
    extra_json: Any
    leaves: list[Any]
    entries: list[dict[str, Any]]
    treedef: Any
    layout: dict[int, list[shards.Record]]
    me: int  # this process
    writer: bool  # process 0: locks, writes the whole leaves, commits
    multi: bool


class CheckpointManager:
    """Saves, lists, prunes and restores the checkpoints of one directory.

    Args:
      directory: where checkpoints live (created on the first save).
      keep: how many of the newest checkpoints to keep (``None``: all).
      writer_nice: niceness (0-19) added to the thread of an asynchronous
        save (:meth:`save_async`; Linux only, elsewhere ignored). On a host
        whose cores also run the step (CPU devices) a positive value lets
        the step go first: the save takes longer, the steps it overlaps are
        slowed less (``benchmarks/bench_async_save.py --nice``).

    One writer at a time: each save holds an exclusive, non-blocking
    ``fcntl.flock`` on ``<directory>/.lock`` while it writes, commits and
    prunes, so a second writer (another manager, or another process) saving
    into the same directory meanwhile gets a :class:`CheckpointError` and
    changes nothing. Temporary directories are named with this manager's
    token (``.tmp-step_<N>-<token>-<n>``).

    Example::

        manager = CheckpointManager("/tmp/run1/ckpt", keep=3)
        manager.save(100, state, extra={"input_position": 100})
        step, state, extra = manager.restore(state)  # the newest; step= for another
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3, *, writer_nice: int = 0):
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep= must be a positive int or None (keep all), got {keep!r}.")
        if not isinstance(writer_nice, int) or not 0 <= writer_nice <= 19:
            raise ValueError(f"writer_nice= must be an int from 0 to 19 (added niceness), got {writer_nice!r}.")
        self.writer_nice = writer_nice
        self.directory = os.fspath(directory)
        self.keep = keep
        self._token = uuid.uuid4().hex[:16]  # names this writer's temporary directories
        self._saves = 0
        self._pending: background.BackgroundSave | None = None  # the asynchronous save in flight

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
        except NotADirectoryError:
            raise CheckpointError(
                f"{self.directory!r} is a file, not a checkpoint directory; pass the directory that holds the "
                f"step_<N>/ checkpoint directories (the parent of a checkpoint, not one of its files)."
            ) from None
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

        Leaves split over devices (e.g. ZeRO's sharded optimizer state) are
        written as their shards, each distinct shard once, by the process
        that holds it; nothing is gathered. Leaves stored whole (host
        arrays, replicated leaves, PRNG keys) are written by process 0.

        In a multi-process job this is a collective: call it on every
        process with the same state. Process 0 takes the directory's lock and
        makes the temporary directory, every process writes its own shards
        into it, all agree that they did, then process 0 commits, and every
        process returns once the checkpoint is committed (see *Multi-process
        jobs* in ``docs/design/checkpoints.md``). The directory must then be
        on a file system every process shares.

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
          The checkpoint's directory (on every process).

        Raises:
          CheckpointError: ``extra`` is not JSON-serializable, a leaf is not
            numeric, (without ``overwrite``) the directory already has a
            checkpoint of ``step`` or a later one, or another writer is saving
            into the directory (it holds ``.lock``). Nothing saved is changed.
            In a multi-process job it is raised on every process, also when
            one process failed to write its part (the others' message says
            which and why).
        """
        save, lock = self._prepare(step, state, extra)
        if not save.writer and not save.multi:
            return save.final
        tmp: str | None = None
        try:
            tmp, existing = self._open(save, overwrite, lock)
            digests: dict[Any, str] = {}
            written = agreement.Attempt(save.multi)
            with written:
                # Every process takes part in gathering the (rare) whole leaves sharded over processes: PRNG keys.
                with progress.phase("checkpoint-gather", f"step {save.step}"):
                    whole = {
                        f"a{i}": encoding.stored(leaf, entry, save.writer)
                        for i, (leaf, entry) in enumerate(zip(save.leaves, save.entries, strict=True))
                        if i not in save.layout
                    }
                with progress.phase("checkpoint-write", f"step {save.step} into {tmp}"):
                    digests = shards.write_own(
                        tmp,
                        lambda r: shards.device_shard(save.leaves[r.leaf], r.device),
                        save.entries,
                        save.layout,
                        save.me,
                        sidecar=save.multi and not save.writer,
                    )
                    if save.writer:
                        files.write_arrays(os.path.join(tmp, ARRAYS_FILE), whole)
            if save.multi:
                with progress.phase("checkpoint-wait", f"step {save.step}"):
                    agreement.agree_written(written.error, save.final)
            committed = agreement.Attempt(save.multi)
            if save.writer:
                with committed, progress.phase("checkpoint-write", f"step {save.step} into {save.final}"):
                    self._commit_written(save, tmp, digests, existing, shards.SIDECAR_WAIT_S)
                    tmp = None  # committed: renamed into place
            if save.multi:
                with progress.phase("checkpoint-wait", f"step {save.step}"):
                    agreement.agree_on_save(committed.error, save.final)
            return save.final
        finally:
            if save.writer:
                if tmp is not None:
                    files.rmtree(tmp)
                lock.release()

    def save_async(
        self,
        step: int,
        state: PyTree,
        *,
        extra: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        copy_on_device: bool = False,
    ) -> str:
        """Start saving ``state`` at ``step``; the files are written and committed by a background thread.

        At the call, on this thread: the save before it, if still in flight,
        is waited for (:meth:`wait`; at most one is in flight), the step is
        checked and the directory locked as for :meth:`save`, and this
        process's part of the state is held with its device-to-host copies
        started (:mod:`~replicator.training.checkpoint.snapshot`); it waits
        for no device. The thread then copies it off the devices, writes it
        and commits it as :meth:`save` does (same files, same atomic rename:
        a failure or a kill meanwhile leaves the earlier checkpoints as they
        were). A failure is raised by the next :meth:`save`,
        :meth:`save_async` or :meth:`wait`.

        Args:
          step, state, extra, overwrite: as for :meth:`save`. Do not change
            host (numpy) leaves of ``state`` in place before the save is
            written; device arrays are immutable.
          copy_on_device: copy this process's part of the state on its
            devices first, so that the state's buffers may be donated to the
            next step (``Replicator(donate_state=True)``) while the save still
            reads them; it holds one more copy of that part in device memory
            until the thread has fetched it. Without it the state's own
            buffers are held (no copy) until then.

        Returns:
          The directory the checkpoint will have once committed.

        In a multi-process job call it on every process at the same step, as
        :meth:`save`, and :meth:`wait` too (both are collectives): every
        process writes its shards in its thread, process 0's thread waits
        (at most ``background.WAIT_S``) for the others' lists of shards,
        files that they write when done, and commits; :meth:`wait` then
        tells every process whether every part was written and committed.
        No collective ever runs in a background thread (see *Asynchronous
        saves* in ``docs/design/checkpoints.md``).
        """
        save, lock = self._prepare(step, state, extra)
        if not save.writer and not save.multi:
            return save.final
        tmp: str | None = None  # until process 0 has made it and every process knows it
        try:
            tmp, existing = self._open(save, overwrite, lock)
            held = snapshot.capture(save.leaves, save.entries, save.layout, save.me, save.writer, copy_on_device)
        except BaseException as e:
            if save.writer:
                if tmp is not None:
                    files.rmtree(tmp)
                lock.release()
            elif tmp is not None:
                shards.write_failure(tmp, save.me, e)
            raise
        work = functools.partial(self._write_and_commit, save, held, tmp, existing, lock)
        self._pending = background.BackgroundSave(save.step, save.final, work, nice=self.writer_nice)
        return save.final

    def _write_and_commit(
        self,
        save: _Save,
        held: snapshot.Snapshot,
        tmp: str,
        existing: dict[int, str],
        lock: files.DirectoryLock,
    ) -> None:
        """The background thread of :meth:`save_async`: fetch, write, and (process 0) commit."""
        committed = False
        try:
            digests = shards.write_own(
                tmp,
                held.shard,
                save.entries,
                save.layout,
                save.me,
                sidecar=save.multi and not save.writer,
                report=False,
            )
            if save.writer:
                files.write_arrays(os.path.join(tmp, ARRAYS_FILE), held.stored_whole(), report=False)
            held.release()
            if save.writer:
                self._commit_written(save, tmp, digests, existing, background.WAIT_S)
                committed = True
        except BaseException as e:
            if save.multi and not save.writer:
                shards.write_failure(tmp, save.me, e)
            raise
        finally:
            held.release()
            if save.writer:
                if not committed:
                    files.rmtree(tmp)
                lock.release()

    @property
    def in_flight(self) -> int | None:
        """The step of the asynchronous save still being written or committed, or None."""
        pending = self._pending
        return pending.step if pending is not None and pending.running else None

    def wait(self, timeout_s: float = background.WAIT_S, *, collective: bool = True) -> None:
        """Wait for the asynchronous save in flight, if any, to be written and committed (at most ``timeout_s``).

        Raises:
          CheckpointError: it failed (or still runs after ``timeout_s``); it
            was not committed, and the earlier checkpoints are unchanged. In
            a multi-process job (with ``collective=True``, a collective: call
            it on every process) it raises on every process, naming the
            process that failed. ``collective=False`` waits for this
            process's thread only (on a path where the others may not call
            it, e.g. after an exception).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        with progress.phase("checkpoint-wait", f"step {pending.step} (background save)"):
            failure = pending.join(timeout_s)
            error = None
            if failure is not None:
                error = CheckpointError(
                    f"the asynchronous save of step {pending.step} into {pending.final} failed, so it was not "
                    f"committed; the checkpoints before it are unchanged (steps {self.all_steps()}). "
                    f"{type(failure).__name__}: {failure}"
                )
            if jax.process_count() > 1 and collective:
                agreement.agree_written(error, pending.final)
            elif error is not None:
                raise error from failure

    def _prepare(self, step: int, state: PyTree, extra: Mapping[str, Any] | None) -> tuple[_Save, files.DirectoryLock]:
        """Wait for the asynchronous save in flight (at most one at a time), then describe the new one."""
        self.wait()
        return self._plan(step, state, extra), files.DirectoryLock(self.directory, LOCK_FILE)

    def _plan(self, step: int, state: PyTree, extra: Mapping[str, Any] | None) -> _Save:
        """Check the arguments of a save and describe it: leaves, manifest entries, shard layout, roles."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}.")
        step = int(step)
        try:
            extra_json = json.loads(json.dumps(dict(extra or {})))
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"extra= must be JSON-serializable (numbers, strings, lists, dicts): {e}. "
                f"Convert arrays with .tolist() or int()/float()."
            ) from None
        flat, treedef = jax.tree_util.tree_flatten_with_path(state)
        leaves = [leaf for _, leaf in flat]
        entries = [encoding.entry(jax.tree_util.keystr(keys), leaf) for keys, leaf in flat]  # the same everywhere
        me = jax.process_index()
        return _Save(
            step=step,
            final=os.path.join(self.directory, f"step_{step:08d}"),
            extra_json=extra_json,
            leaves=leaves,
            entries=entries,
            treedef=treedef,
            layout=shards.plan(leaves, entries),  # the same on every process
            me=me,
            writer=me == 0,
            multi=jax.process_count() > 1,
        )

    def _open(self, save: _Save, overwrite: bool, lock: files.DirectoryLock) -> tuple[str, dict[int, str]]:
        """Process 0 checks the step, locks and makes the temporary directory; every process learns its name.

        Returns the temporary directory and (on process 0) the committed checkpoints.
        """
        existing: dict[int, str] = {}
        tmp: str | None = None
        begun = agreement.Attempt(save.multi)
        if save.writer:
            with begun, progress.phase("checkpoint-write", f"step {save.step}: taking {LOCK_FILE}"):
                existing, tmp = self._begin(save.step, overwrite, lock)
        if save.multi:
            with progress.phase("checkpoint-wait", f"step {save.step}"):
                name = agreement.share_temporary(begun.error, os.path.basename(tmp or ""), save.final)
            tmp = os.path.join(self.directory, name)
        assert tmp is not None
        return tmp, existing

    def _commit_written(
        self, save: _Save, tmp: str, digests: dict[Any, str], existing: dict[int, str], wait_s: float
    ) -> None:
        """Process 0: gather every process's shard records (waiting at most ``wait_s`` for them) and commit."""
        records = shards.collect(tmp, save.layout, digests, wait_s)
        entries = list(save.entries)
        for i, shard_records in records.items():
            entries[i] = {**entries[i], "shards": shard_records}
        self._commit(save.step, save.final, tmp, entries, save.treedef, save.extra_json, existing)

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

    def _begin(self, step: int, overwrite: bool, lock: files.DirectoryLock) -> tuple[dict[int, str], str]:
        """Process 0: check the step, take the directory's lock, tidy up, make the temporary directory.

        Returns the committed checkpoints and the temporary directory. The
        caller releases the lock.
        """
        self._check_new(step, overwrite)  # early, before taking the lock; again under it
        os.makedirs(self.directory, exist_ok=True)
        if not lock.acquire():
            raise CheckpointError(
                f"another writer is saving into {self.directory!r} (it holds {os.path.join(self.directory, LOCK_FILE)}"
                f"); step {step} was not saved and its checkpoints are unchanged. Give each run its own directory, "
                f"or save from one CheckpointManager (in one process) at a time."
            )
        existing = self._check_new(step, overwrite)  # again, under the lock
        self._remove_leftovers(existing)
        self._saves += 1
        tmp = os.path.join(self.directory, f"{_TMP_PREFIX}step_{step:08d}-{self._token}-{self._saves}")
        os.mkdir(tmp)
        return existing, tmp

    def _commit(
        self,
        step: int,
        final: str,
        tmp: str,
        entries: list[dict[str, Any]],
        treedef: Any,
        extra_json: Any,
        existing: dict[int, str],
    ) -> None:
        """Process 0, under the lock: write the manifest, rename ``tmp`` into place, prune."""
        later = sorted(s for s in existing if s > step)
        manifest = build_manifest(tmp, step, extra_json, treedef, entries)
        files.write_text(os.path.join(tmp, MANIFEST_FILE), json.dumps(manifest, indent=1) + "\n")
        files.fsync_dir(tmp)
        old = None
        if step in existing:  # overwrite: move the old one aside, it counts until the new one is in
            old = os.path.join(self.directory, f"{_OLD_PREFIX}step_{step:08d}-{uuid.uuid4().hex}")
            os.rename(os.path.join(self.directory, existing[step]), old)
        os.rename(tmp, final)
        files.fsync_dir(self.directory)
        if old is not None:
            files.rmtree(old)
        for newer in later:  # overwrite=True: the run restarted from `step`; its old future goes
            files.rmtree(os.path.join(self.directory, existing[newer]))
        self._prune()

    def _remove_leftovers(self, entries: dict[int, str]) -> None:
        """Remove temporary directories of saves that died, and replaced checkpoints (under the lock).

        This writer's own temporaries (``-<token>-`` in the name) always go.
        Another writer's go too, but only because this runs while holding the
        directory's lock, which every writer holds for the whole of a save: a
        temporary directory that exists while we hold it belongs to a save
        that died (e.g. ``kill -9``), never to one under way.
        """
        live = set(entries.values())
        for name in os.listdir(self.directory):
            if (name.startswith(_TMP_PREFIX) or name.startswith(_OLD_PREFIX)) and name not in live:
                files.rmtree(os.path.join(self.directory, name))
        for step, name in entries.items():  # a replaced checkpoint whose save died: make it whole again
            if name.startswith(_OLD_PREFIX):
                os.rename(os.path.join(self.directory, name), os.path.join(self.directory, f"step_{step:08d}"))
                entries[step] = f"step_{step:08d}"

    def _prune(self) -> None:
        if self.keep is None:
            return
        entries = self._entries()
        for step in sorted(entries)[: -self.keep]:
            files.rmtree(os.path.join(self.directory, entries[step]))

    # -- restoring ---------------------------------------------------------------

    def read_manifest(self, step: int | None = None) -> dict[str, Any]:
        """The manifest of a checkpoint (the newest by default), verified and type-checked.

        Raises:
          CheckpointError: the checkpoint is missing, not a directory, foreign,
            of an unknown format version, or its manifest was modified or
            corrupted (its ``manifest_sha256`` differs) or has a field of the
            wrong type.
        """
        step, path = self._checkpoint_path(step)
        return parse_manifest(path, step, self.all_steps)

    def _checkpoint_path(self, step: int | None) -> tuple[int, str]:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(
                    f"no checkpoint in {self.directory!r} (looked for step_<N>/ directories); "
                    f"check the path, or start from the initial state."
                )
        return step, self.path(step)

    def restore(
        self, target_state: PyTree, step: int | None = None, *, fallback: bool = False
    ) -> tuple[int, PyTree, dict[str, Any]]:
        """Read a checkpoint into the structure of ``target_state``.

        Args:
          target_state: a pytree of arrays or ``jax.ShapeDtypeStruct`` s with
            the tree structure, shapes and dtypes the checkpoint must have
            (e.g. the freshly initialized state).
          step: which checkpoint; None means the newest.
          fallback: with ``step=None``, if the newest checkpoint fails
            verification (a missing, truncated, corrupt or edited file, or a
            stray file named like a checkpoint), warn (a ``RuntimeWarning``
            naming it and why) and restore the newest one that passes, going
            back as far as needed. Off by default, so that a damaged newest
            checkpoint stops the run rather than silently resuming from an
            older step. It never skips a checkpoint that is intact but does
            not match ``target_state`` (that error is raised), and is ignored
            with an explicit ``step=``.

        Returns:
          ``(step, state, extra)``. ``state`` has ``target_state``'s tree
          structure; a leaf is a numpy array (the whole leaf), or where the
          target leaf has a sharding (a ``jax.Array``, or a
          ``jax.ShapeDtypeStruct`` with ``sharding=``), an array on that
          sharding, whatever layout the checkpoint was saved from (another
          mesh, replica count or ZeRO stage): each device's part is read
          from the stored shards that overlap it.

        In a multi-process job every process reads the files (they must be on
        a file system every process can read). Where ``target_state`` has
        leaves on a sharding that spans processes this is a collective: call
        it on every process; it checks that they all read the same
        checkpoint. Otherwise it needs no communication.

        Raises:
          CheckpointError: no such checkpoint, a damaged or foreign one (with
            ``fallback=True``: no intact one), or
            one whose tree paths, shapes or dtypes differ from ``target_state``
            (the message names the first mismatching leaf), or (where it is a
            collective) processes that read different checkpoints.
        """
        target_flat, target_def = jax.tree_util.tree_flatten_with_path(target_state)
        shardings = [encoding.target_sharding(target) for _, target in target_flat]
        spans = jax.process_count() > 1 and any(s is not None and not s.is_fully_addressable for s in shardings)
        try:
            if fallback and step is None:
                manifest, placed = self._read_newest_intact(target_flat, shardings)
            else:
                manifest, placed = self._read(target_flat, shardings, step)
        except CheckpointError as e:
            if not spans:
                raise
            try:  # the others may have read it: make them fail too, rather than wait for this process
                agreement.check_same_checkpoint(f"error: {e}")
            except CheckpointError:
                pass
            raise
        if spans:
            digest = manifest.get(DIGEST_FIELD) or manifest["arrays_sha256"]
            agreement.check_same_checkpoint(f"step {manifest['step']} sha256 {digest}")
        return int(manifest["step"]), target_def.unflatten(placed), manifest["extra"]

    def _read_newest_intact(
        self, target_flat: list[tuple[Any, Any]], shardings: list[Any]
    ) -> tuple[dict[str, Any], list[Any]]:
        """:meth:`_read` of the newest checkpoint that passes verification, warning about each newer one."""
        steps = self.all_steps()
        if not steps:
            self._checkpoint_path(None)  # raises: there is none
        broken: list[str] = []
        for step in reversed(steps):
            try:
                result = self._read(target_flat, shardings, step)
            except DamagedCheckpoint as e:
                broken.append(f"step {step}: {e}")
                continue
            for message in broken:
                warnings.warn(
                    f"checkpoint {message} -- skipped it; restoring the newest intact checkpoint, step {step}.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return result
        raise CheckpointError(
            f"no intact checkpoint in {self.directory!r}: every one failed verification. "
            + " | ".join(broken)
            + " Start from the initial state, or restore a copy of the checkpoints."
        )

    def _read(
        self, target_flat: list[tuple[Any, Any]], shardings: list[Any], step: int | None
    ) -> tuple[dict[str, Any], list[Any]]:
        """The manifest and the leaves of a checkpoint, checked against the target and placed on ``shardings``.

        Leaves stored whole are read from the arrays file (checked against its
        sha256). Leaves stored as shards are assembled from the shard records
        that overlap each part a device of ``shardings`` holds (the whole leaf
        where the sharding is None), each record checked against its sha256.
        """
        manifest = self.read_manifest(step)
        path = manifest["path"]
        entries = manifest["leaves"]
        encoding.check_structure(path, entries, target_flat)
        whole = self._read_whole(manifest)

        def damaged(problem: str) -> DamagedCheckpoint:
            return DamagedCheckpoint(
                f"checkpoint {path}: {problem}. Restore an earlier step with step= (steps: {self.all_steps()}), or "
                f"the newest intact one with fallback=True."
            )

        placed = []
        for i, (entry, sharding) in enumerate(zip(entries, shardings, strict=True)):
            if "shards" in entry:
                placed.append(shards.LeafReader(path, entry, damaged).place(sharding))
            else:
                placed.append(encoding.place_like(whole.pop(i), sharding))
        return manifest, placed

    def _read_whole(self, manifest: dict[str, Any]) -> dict[int, Any]:
        """The leaves stored whole in the arrays file, by leaf index, after checking its sha256."""
        path = manifest["path"]
        entries = manifest["leaves"]
        arrays_path = os.path.join(path, manifest["arrays_file"])
        try:
            digest = files.sha256(arrays_path)
        except FileNotFoundError:
            raise DamagedCheckpoint(f"checkpoint {path} lacks {manifest['arrays_file']}; it is damaged.") from None
        except OSError as e:
            raise DamagedCheckpoint(f"checkpoint {path}: cannot read {manifest['arrays_file']} ({e}).") from None
        if digest != manifest["arrays_sha256"]:
            size = os.path.getsize(arrays_path)
            expected = manifest.get("arrays_bytes")
            how = f"{size} bytes, {expected} when saved" if expected is not None else f"{size} bytes"
            raise DamagedCheckpoint(
                f"checkpoint {path}: {manifest['arrays_file']} is truncated or corrupt ({how}; sha256 differs "
                f"from the manifest). Restore an earlier step with step= (steps: {self.all_steps()}), or the "
                f"newest intact one with fallback=True."
            )
        leaves: dict[int, Any] = {}
        try:
            with np.load(arrays_path, allow_pickle=False) as npz:
                for i, entry in enumerate(entries):
                    if "shards" in entry:
                        continue
                    array = npz[f"a{i}"]
                    stored = encoding.stored_dtype(entry)
                    if array.dtype != np.dtype(stored):
                        raise DamagedCheckpoint(
                            f"checkpoint {path}: array {i} (state{entry['path']}) is stored as {array.dtype}, "
                            f"its manifest says {stored}; the checkpoint is damaged."
                        )
                    leaf = encoding.decode(array, entry)
                    if tuple(leaf.shape) != tuple(entry["shape"]):
                        raise DamagedCheckpoint(
                            f"checkpoint {path}: array {i} (state{entry['path']}) has shape {leaf.shape}, its "
                            f"manifest says {tuple(entry['shape'])}; the checkpoint is damaged."
                        )
                    leaves[i] = leaf
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever np.load makes of a bad file
            raise DamagedCheckpoint(f"checkpoint {path}: cannot read {manifest['arrays_file']} ({e}).") from None
        return leaves


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
    directory: str | os.PathLike, target_state: PyTree, step: int | None = None, *, fallback: bool = False
) -> tuple[int, PyTree, dict[str, Any]]:
    """``(step, state, extra)`` of the newest checkpoint in ``directory`` (or of ``step``).

    ``fallback=True``: if the newest fails verification, warn and restore the
    newest intact one. See :meth:`CheckpointManager.restore`.
    """
    return CheckpointManager(directory, keep=None).restore(target_state, step, fallback=fallback)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The step of the newest checkpoint in ``directory``, or None if there is none."""
    return CheckpointManager(directory, keep=None).latest_step()
